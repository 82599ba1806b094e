"""WorkerSpec.from_environ: `ftrun launch`'s environment and one torchrun per replica map to the same spec."""

from __future__ import annotations

import os

import pytest

from ftrun.launch.host_faults import place_replicas
from ftrun.launch.worker_env import TORCHRUN_HELP, WorkerSpec, first_host_slots
from ftrun.net import NetConfig
from ftrun.train.device import resolve_device

FT = {"FTRUN_LIGHTHOUSE": "10.0.0.1:29510", "FTRUN_TOKEN": "tok"}


def torchrun(*, rank, world, local_rank=None, group_rank=0, restarts=0, **ftrun_vars):
    """What torchrun sets for one worker (single node: LOCAL_RANK = RANK)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": str(group_rank), "ROLE_RANK": str(rank),
            "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": str(restarts),
            "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3", **ftrun_vars}


def fields(spec):
    return (spec.replica_id, spec.replica_index, spec.num_replicas, spec.rank, spec.ranks_per_replica,
            spec.incarnation, spec.store_addr, spec.store_port)


# (environment, (replica_id, index, num_replicas, rank in replica, ranks per replica, incarnation, store))
CASES = [
    # one torchrun per replica: torchrun's world is the replica; GROUP_RANK (0) is not the replica index
    (torchrun(rank=0, world=2, FTRUN_REPLICA_ID="r1", FTRUN_NUM_REPLICAS="3", **FT),
     ("r1", 1, 3, 0, 2, 0, "10.0.0.2", 29400)),
    (torchrun(rank=1, world=2, FTRUN_REPLICA_ID="r2", FTRUN_NUM_REPLICAS="3", **FT),
     ("r2", 2, 3, 1, 2, 0, "10.0.0.2", 29400)),
    # torchrun's restarts are the replica's incarnations
    (torchrun(rank=0, world=1, restarts=4, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="2", **FT),
     ("r0", 0, 2, 0, 1, 4, "10.0.0.2", 29400)),
    # a replica spanning two nodes: the second node's ranks are 2 and 3 of the replica (GROUP_RANK=1)
    (torchrun(rank=3, world=4, local_rank=1, group_rank=1, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="2", **FT),
     ("r0", 0, 2, 3, 4, 0, "10.0.0.2", 29400)),
    # an explicit index wins over the id's number
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r5", FTRUN_REPLICA_INDEX="0", FTRUN_NUM_REPLICAS="1", **FT),
     ("r5", 0, 1, 0, 1, 0, "10.0.0.2", 29400)),
    # a hand-started single-rank replica: no torchrun variables, no store needed
    ({"FTRUN_REPLICA_ID": "r0", "FTRUN_NUM_REPLICAS": "1", **FT}, ("r0", 0, 1, 0, 1, 0, "", 0)),
]


@pytest.mark.parametrize("environ, expected", CASES)
def test_environment_maps_to_the_replica_layout(environ, expected):
    assert fields(WorkerSpec.from_environ(environ)) == expected


def _spec(**kw):
    base = dict(replica_id="r2", replica_index=2, num_replicas=3, rank=1, ranks_per_replica=2, incarnation=5,
                lighthouse="10.0.0.1:1", token="t", store_addr="127.0.0.1", store_port=9, run_dir="/r", max_steps=7)
    return WorkerSpec(**{**base, **kw})


@pytest.mark.parametrize("spec", [_spec(), _spec(net=NetConfig(bind_host="0.0.0.0", advertise_host="10.3.0.4")),
                                  _spec(rank=0, ranks_per_replica=1, replica_index=0, replica_id="r0", max_steps=None),
                                  _spec(diagnose="127.0.0.1:29511"), _spec(host_slot=5), _spec(host_slot=0)])
def test_ftrun_launch_environment_round_trips(spec):
    environ = spec.to_environ()
    # torchrun's names describe the replica's world, as one torchrun per replica sets them
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_WORLD_SIZE"]) == \
        (str(spec.rank), str(spec.ranks_per_replica), str(spec.ranks_per_replica))
    assert environ["LOCAL_RANK"] == str(spec.device_slot) and environ["GROUP_RANK"] == "0"
    # the replica incarnation's store, which a script's own env:// init_process_group joins as a client
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == (spec.store_addr, str(spec.store_port))
    assert environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert WorkerSpec.from_environ(environ) == spec


@pytest.mark.parametrize("old, message", [({"RANK": "5", "WORLD_SIZE": "6"}, "FTRUN_RANKS_PER_REPLICA=2 but WORLD_SIZE=6"),
                                          ({"RANK": "5"}, "FTRUN_REPLICA_RANK=1 but RANK=5")])
def test_a_job_wide_torchrun_world_beside_ftruns_layout_is_refused(old, message):
    """The old contract (RANK and WORLD_SIZE for the whole job: r2's rank 1 of 3 x 2 ranks) read as the new one
    would silently be another rank: the two sets of names must agree."""
    with pytest.raises(ValueError, match=f"{message}: .* must be the replica's"):
        WorkerSpec.from_environ({**_spec().to_environ(), **old})


def test_torch_env_init_joins_the_launchers_store_as_a_client(monkeypatch):
    """What a torchrun-style `dist.init_process_group()` does with ftrun launch's variables: rank 0 too is a
    client of the store at MASTER_ADDR/PORT (the launcher's), which it would otherwise try to listen on."""
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    from ftrun.env.real_store import bound_store

    store = bound_store("127.0.0.1", timeout_s=10)
    environ = _spec(rank=0, ranks_per_replica=1, store_port=store.port).to_environ()
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.setenv(name, environ[name])
    client, rank, world = next(rendezvous("env://", rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"])))
    client.set("k", "v")
    assert (rank, world, store.get("k")) == (0, 1, b"v") and isinstance(client, dist.TCPStore)


@pytest.mark.parametrize("environ", [
    torchrun(rank=0, world=2),  # plain torchrun --nproc-per-node 2: it used to train two 1-replica jobs
    torchrun(rank=0, world=1),
    {"GROUP_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"},
])
def test_torchrun_without_replica_settings_names_what_to_set(environ):
    with pytest.raises(ValueError) as e:
        WorkerSpec.from_environ(environ)
    assert str(e.value) == TORCHRUN_HELP
    for name in ("FTRUN_REPLICA_ID", "FTRUN_NUM_REPLICAS", "FTRUN_LIGHTHOUSE", "FTRUN_TOKEN_FILE", "one torchrun per replica"):
        assert name in str(e.value)


@pytest.mark.parametrize("environ, message", [
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r3", FTRUN_NUM_REPLICAS="3", **FT), "outside FTRUN_NUM_REPLICAS=3"),
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="left", FTRUN_NUM_REPLICAS="3", **FT), "must be r<i>"),
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="zero", **FT), "FTRUN_NUM_REPLICAS='zero'"),
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="0", **FT), "FTRUN_NUM_REPLICAS=0 must be >= 1"),
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="1", FTRUN_TOKEN="t"), "FTRUN_LIGHTHOUSE"),
    (torchrun(rank=0, world=1, FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="1", FTRUN_LIGHTHOUSE="h:1"), "job token"),
    ({"FTRUN_REPLICA_ID": "r0", "FTRUN_NUM_REPLICAS": "1", "RANK": "2", "WORLD_SIZE": "2", **FT}, "rank 2 is outside"),
    ({"FTRUN_REPLICA_ID": "r0", "FTRUN_NUM_REPLICAS": "1", "RANK": "0", "WORLD_SIZE": "2", **FT}, "MASTER_ADDR"),
    ({"FTRUN_REPLICA_ID": "r0", "FTRUN_NUM_REPLICAS": "1", "FTRUN_BIND_HOST": "0.0.0.0", **FT}, "advertise_host"),
])
def test_bad_environment_names_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        WorkerSpec.from_environ(environ)


def test_token_from_a_private_file(tmp_path):
    path = tmp_path / "tok"
    path.write_text("filetok\n")
    os.chmod(path, 0o600)
    environ = {"FTRUN_REPLICA_ID": "r0", "FTRUN_NUM_REPLICAS": "1", "FTRUN_LIGHTHOUSE": "h:1", "FTRUN_TOKEN_FILE": str(path)}
    assert WorkerSpec.from_environ(environ).token == "filetok"
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        WorkerSpec.from_environ(environ)


# -- the host slot: which GPU FTConfig.device="cuda" picks ---------------------------------------------

def test_a_replicas_ranks_take_consecutive_host_slots():
    first = _spec(rank=0, ranks_per_replica=3, host_slot=6)
    assert [first.for_rank(r).host_slot for r in range(3)] == [6, 7, 8]
    assert first.for_rank(2).for_rank(1) == first.for_rank(1) and first.for_rank(2).rank == 2
    assert _spec(rank=0, host_slot=None).for_rank(1).host_slot is None
    with pytest.raises(ValueError, match="rank 2 is outside a replica of 2 ranks"):
        _spec().for_rank(2)


def test_first_host_slots_count_the_replicas_placed_before_on_the_same_host():
    assert first_host_slots({f"r{i}": 0 for i in range(3)}, 1) == {"r0": 0, "r1": 1, "r2": 2}
    assert first_host_slots({f"r{i}": 0 for i in range(3)}, 2) == {"r0": 0, "r1": 2, "r2": 4}
    # `ftrun launch --hosts`: replicas round-robin over hosts 1..3; r10 comes after r2 (index order, not text)
    _, placement = place_replicas(11, 4)
    slots = first_host_slots(placement, 2)
    assert [slots[f"r{i}"] for i in (1, 4, 7, 10)] == [0, 2, 4, 6]  # host 1's replicas
    assert [slots[f"r{i}"] for i in (2, 5, 8)] == [0, 2, 4]  # host 2's
    with pytest.raises(ValueError, match="ranks_per_replica must be >= 1"):
        first_host_slots(placement, 0)


@pytest.mark.parametrize("replicas, ranks, gpus, want", [
    (3, 1, 8, ["cuda:0", "cuda:1", "cuda:2"]),  # used to be cuda:0 three times
    (2, 2, 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (5, 1, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]),  # more ranks than GPUs: round robin
])
def test_replicas_on_one_host_spread_over_its_gpus(replicas, ranks, gpus, want):
    """What `ftrun launch` on one host sets (Job.spec: host slot i * ranks) -> the environment -> the rank's
    spec -> its device."""
    got = []
    for i in range(replicas):
        replica = _spec(replica_id=f"r{i}", replica_index=i, num_replicas=replicas, rank=0, ranks_per_replica=ranks,
                        host_slot=i * ranks)
        for r in range(ranks):
            spec = WorkerSpec.from_environ(replica.for_rank(r).to_environ())
            environ = replica.for_rank(r).to_environ()
            assert spec.rank == r and int(environ["RANK"]) == r and int(environ["LOCAL_RANK"]) == i * ranks + r
            got.append(str(resolve_device("cuda", slot=spec.device_slot, device_count=gpus)))
    assert got == want


def test_the_slot_under_torchrun_is_its_local_rank_and_without_a_launcher_the_rank():
    ids = dict(FTRUN_REPLICA_ID="r0", FTRUN_NUM_REPLICAS="2", **FT)
    # a replica over two nodes: rank 3 of the replica is the second rank on its node
    spec = WorkerSpec.from_environ(torchrun(rank=3, world=4, local_rank=1, group_rank=1, **ids))
    assert (spec.rank, spec.host_slot, spec.device_slot) == (3, 1, 1)
    explicit = WorkerSpec.from_environ(torchrun(rank=3, world=4, local_rank=1, FTRUN_HOST_SLOT="5", **ids))
    assert explicit.device_slot == 5  # set by hand (or a wrapper): it wins
    by_hand = WorkerSpec.from_environ({"FTRUN_REPLICA_ID": "r1", "FTRUN_NUM_REPLICAS": "2", **FT})
    assert by_hand.host_slot is None and by_hand.device_slot == 0
    assert _spec(rank=1, host_slot=None).device_slot == 1
    with pytest.raises(ValueError, match="FTRUN_HOST_SLOT='x' is not an integer"):
        WorkerSpec.from_environ({**_spec(host_slot=1).to_environ(), "FTRUN_HOST_SLOT": "x"})
    with pytest.raises(ValueError, match="FTRUN_HOST_SLOT=-1 must be >= 0"):
        WorkerSpec.from_environ({**_spec(host_slot=1).to_environ(), "FTRUN_HOST_SLOT": "-1"})
