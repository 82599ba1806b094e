"""WorkerSpec.from_environ: `ftrun launch`'s environment and one torchrun per replica map to the same spec."""

from __future__ import annotations

import os

import pytest

from ftrun.launch.worker_env import TORCHRUN_HELP, WorkerSpec
from ftrun.net import NetConfig

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
                                  _spec(diagnose="127.0.0.1:29511")])
def test_ftrun_launch_environment_round_trips(spec):
    environ = spec.to_environ()
    assert environ["RANK"] == str(spec.replica_index * spec.ranks_per_replica + spec.rank)  # job-wide, as torchrun
    assert environ["GROUP_RANK"] == str(spec.replica_index)
    assert WorkerSpec.from_environ(environ) == spec


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
