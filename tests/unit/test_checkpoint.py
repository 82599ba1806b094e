"""Persistent checkpoints: writer choice, cadence, pruning plan, manifest, and the DCP store on a tiny model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest
import torch

from ftrun.checkpoint import manifest as mf
from ftrun.checkpoint import store
from ftrun.checkpoint.policy import (
    CheckpointConfig, async_action, checkpoint_writer, ledger_for_layout, parse_step_dir, prune_plan, should_checkpoint,
    step_dir,
)
from ftrun.data.loader_state import LoaderState, LoaderStateError
from ftrun.data.sampler import DataLayout
from ftrun.storage import FileStorage
from ftrun.train.lr import BASE_LR_KEY, apply_lr_factor

LAYOUT = DataLayout(dataset_size=64, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=4)
KEY = mf.checkpoint_key("job-token")


@dataclass(frozen=True)
class P:
    replica_id: str
    step: int


# -- pure policy -----------------------------------------------------------------------------------
WRITER_CASES = [
    ("lowest id of all healthy", [P("b", 5), P("a", 5), P("c", 5)], "a"),
    ("behind replicas never write", [P("a", 3), P("b", 5), P("c", 5)], "b"),
    ("only one healthy", [P("a", 1), P("b", 1), P("c", 9)], "c"),
    ("string order, like the ring", [P("r10", 4), P("r2", 4)], "r10"),
    ("no participants", [], None),
]


@pytest.mark.parametrize(("name", "participants", "writer"), WRITER_CASES, ids=[c[0] for c in WRITER_CASES])
def test_checkpoint_writer(name, participants, writer):
    assert checkpoint_writer(participants) == writer


@pytest.mark.parametrize(("step", "every", "expected"), [
    (0, 100, False), (99, 100, False), (100, 100, True), (200, 100, True), (201, 100, False), (3, 1, True),
])
def test_should_checkpoint(step, every, expected):
    assert should_checkpoint(step, CheckpointConfig(every_steps=every)) is expected


@pytest.mark.parametrize(("field", "value"), [("every_steps", 0), ("keep", 0), ("keep", True), ("every_steps", 1.5),
                                              ("async_write", 1), ("async_write", "yes")])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"CheckpointConfig.{field}"):
        CheckpointConfig(**{field: value})


def test_defaults_follow_the_paper():
    assert CheckpointConfig().every_steps == 100
    assert CheckpointConfig().async_write is True  # a write longer than the FTAR timeout must not drop the writer


@pytest.mark.parametrize(("due", "in_flight", "action"), [
    ((10, "L"), None, "stage"),  # nothing being written
    ((10, "L"), (10, "L"), "in_flight"),  # the retry of the step whose checkpoint is being written
    ((20, "L"), (10, "L"), "skip"),  # one write at a time: the next cadence does not wait for it
    ((10, "M"), (10, "L"), "skip"),  # another lineage at the same step is another checkpoint
])
def test_at_most_one_checkpoint_in_flight(due, in_flight, action):
    assert async_action(due, in_flight) == action


PRUNE_CASES = [
    ("nothing to prune", [300, 200], [], 3, []),
    ("drop the oldest complete", [100, 200, 300, 400], [], 2, [100, 200]),
    ("torn folders older than the newest complete go", [100, 300], [200, 50], 2, [50, 200]),
    ("a torn folder newer than every complete stays (write in progress)", [100], [200], 1, []),
    ("no complete checkpoint: keep everything", [], [100, 200], 1, []),
]


@pytest.mark.parametrize(("name", "complete", "incomplete", "keep", "drop"), PRUNE_CASES,
                         ids=[c[0] for c in PRUNE_CASES])
def test_prune_plan(name, complete, incomplete, keep, drop):
    assert prune_plan(complete, incomplete, keep) == drop


def test_step_dir_names_round_trip():
    assert step_dir(1200) == "step-00001200" and parse_step_dir("step-00001200") == 1200
    assert parse_step_dir("step-12") is None and parse_step_dir("tmp") is None


# -- manifest --------------------------------------------------------------------------------------
RELAYOUT_CASES = [  # (name, changes to LAYOUT (2 replicas x 1 rank x 4), allowed)
    ("unchanged", {}, True),
    ("2 ranks of 2: the same replica batch", {"ranks_per_replica": 2, "batch_size_per_rank": 2}, True),
    ("4 ranks of 1", {"ranks_per_replica": 4, "batch_size_per_rank": 1}, True),
    ("a bigger replica batch: a new era, needs the replica ids", {"ranks_per_replica": 2, "batch_size_per_rank": 4},
     False),
    ("another number of replicas: a new era, needs the replica ids", {"num_replicas": 3}, False),
    ("another seed: another order", {"seed": 1}, False),
    ("another dataset", {"dataset_size": 65}, False),
]


@pytest.mark.parametrize(("name", "changes", "allowed"), RELAYOUT_CASES, ids=[c[0] for c in RELAYOUT_CASES])
def test_ledger_for_layout(name, changes, allowed):
    old = ledger(3)
    new = DataLayout(**{**LAYOUT.to_dict(), **changes})
    if not allowed:
        with pytest.raises(LoaderStateError, match="replica batch"):
            ledger_for_layout(old, new)
        ids = tuple(f"r{i}" for i in range(new.num_replicas))
        if (new.dataset_size, new.seed) == (LAYOUT.dataset_size, LAYOUT.seed):
            got = ledger_for_layout(old, new, ids)
            assert (got.layout, got.replica_ids, got.step, got.eras[-1].lineage) == (new, ids, 3, old.lineage)
        else:
            with pytest.raises(LoaderStateError, match="never dataset_size or seed"):
                ledger_for_layout(old, new, ids)
        return
    got = ledger_for_layout(old, new)
    assert got.layout == new and (got.step, got.lineage, got.committed_batches) == (3, old.lineage,
                                                                                  old.committed_batches)
    for rid in ("r0", "r1"):  # the replica's next batch starts at the same sample of its stream
        assert got.rank_positions()[rid][0] == old.rank_positions()[rid][0]


def test_manifest_round_trip_and_checks():
    m = mf.Manifest(7, (mf.FileEntry("a.distcp", 10, 1), mf.FileEntry("loader_state.bin", 3, 2)),
                    "loader_state.bin", "abc")
    assert mf.decode(mf.encode(m)) == m
    sizes, digests = {"a.distcp": 10, "loader_state.bin": 2}, {"a.distcp": (5, "")}
    problems = mf.check_files(m, sizes.get, digests.get)
    assert problems == ["a.distcp: CRC32 0x00000005 does not match the manifest's 0x00000001",
                        "loader_state.bin: truncated or resized (2 bytes, manifest says 3)"]
    assert mf.check_files(m, {}.get, digests.get) == ["a.distcp: missing (or not a regular file)",
                                                      "loader_state.bin: missing (or not a regular file)"]


@pytest.mark.parametrize(("data", "message"), [
    (b"{", "malformed manifest"),
    (json.dumps({"format": "other/1"}).encode(), "format 'other/1'"),
    (json.dumps({"format": mf.FORMAT, "step": 1, "loader_state": "x", "files": []}).encode(), "not among the listed"),
    (json.dumps({"format": mf.FORMAT, "step": 1, "loader_state": "../x",
                 "files": [{"name": "../x", "size": 1, "crc32": 0}]}).encode(), "not a plain name"),
])
def test_manifest_decode_errors(data, message):
    with pytest.raises(mf.ManifestError, match=message):
        mf.decode(data)


# -- the store on a tiny model ---------------------------------------------------------------------
def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=gen)).pow(2).mean().backward()
        opt.step()


def ledger(step: int) -> LoaderState:
    s = LoaderState.initial(LAYOUT, ("r0", "r1"))
    for n in range(step):
        s = s.advance(step=n, contributors=("r0", "r1") if n % 2 else ("r0",))
    return s


def save_at(root, model, opt, step, keep=5):
    return store.save(root, step=step, model=model, optimizer=opt, loader_state=ledger(step), keep=keep)


def test_save_then_restore_round_trips_model_optimizer_and_loader_state(tmp_path):
    model, opt = make()
    train(model, opt, 3)
    info = save_at(tmp_path, model, opt, 3)
    assert info.path == tmp_path / "step-00000003"
    names = {f.name for f in info.manifest.files}
    assert {"loader_state.bin", ".metadata"} <= names and any(n.endswith(".distcp") for n in names)
    fresh, fresh_opt = make(seed=9)
    step, state = store.restore(tmp_path, fresh, fresh_opt)
    assert step == 3 and state == ledger(3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    bufs = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(bufs, model.parameters()))


def test_a_staged_checkpoint_is_the_state_at_its_step_though_training_went_on(tmp_path):
    model, opt = make()
    counter = Counter(3)
    train(model, opt, 3)
    at_3 = ({k: v.clone() for k, v in model.state_dict().items()},
            [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()])
    staged = store.stage(tmp_path, step=3, model=model, optimizer=opt, loader_state=ledger(3),
                         extra={"counter": counter})
    train(model, opt, 2)  # the optimizer changes the live state before the write runs
    counter.n = 5
    assert not (tmp_path / "step-00000003" / mf.MANIFEST).exists()  # staged, not written: no checkpoint yet
    info = store.write(staged)
    assert info.step == 3 and not store.verify(info.path)[1]
    fresh, fresh_opt = make(seed=9)
    restored = Counter()
    step, state = store.restore(tmp_path, fresh, fresh_opt, extra={"counter": restored})
    assert step == 3 and state == ledger(3) and restored.n == 3
    assert all(torch.equal(at_3[0][k], v) for k, v in fresh.state_dict().items())  # bit-equal to step 3
    assert all(torch.equal(a, fresh_opt.state[p]["momentum_buffer"]) for a, p in zip(at_3[1], fresh.parameters()))
    assert not all(torch.equal(at_3[0][k], v) for k, v in model.state_dict().items())  # training did go on


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "name": f"counter-{self.n}"}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def test_registered_user_state_round_trips_as_user_entries(tmp_path):
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, 3)
    for _ in range(3):
        sched.step()
    store.save(tmp_path, step=3, model=model, optimizer=opt, loader_state=ledger(3),
               extra={"counter": Counter(7), "sched": sched})
    fresh, fresh_opt = make(seed=9)
    fresh_sched, counter = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5), Counter()
    store.restore(tmp_path, fresh, fresh_opt, extra={"counter": counter, "sched": fresh_sched})
    assert counter.n == 7 and fresh_sched.last_epoch == 3 and fresh_sched.get_last_lr() == sched.get_last_lr()
    keys = store.dcp.FileSystemReader(tmp_path / "step-00000003").read_metadata().state_dict_metadata
    assert {"user.counter.n", "user.sched.last_epoch"} <= set(keys)


def test_resume_into_another_number_of_ranks_per_replica(tmp_path):
    from ftrun.train.resume import resume

    model, opt = make()
    train(model, opt, 2)
    save_at(tmp_path, model, opt, 2)
    wider = DataLayout(**{**LAYOUT.to_dict(), "ranks_per_replica": 2, "batch_size_per_rank": 2})
    fresh, fresh_opt = make(seed=9)
    step, state = resume(tmp_path, model=fresh, optimizer=fresh_opt, layout=wider, replica_ids=("r0", "r1"))
    assert step == 2 and state.layout == wider and state.lineage == ledger(2).lineage
    other = DataLayout(**{**LAYOUT.to_dict(), "batch_size_per_rank": 8})  # another replica batch: a new era
    step, state = resume(tmp_path, model=fresh, optimizer=fresh_opt, layout=other, replica_ids=("r0", "r1"))
    assert step == 2 and state == ledger(2).resharded(other, ("r0", "r1"))
    with pytest.raises(LoaderStateError, match="dataset_size"):
        resume(tmp_path, model=fresh, optimizer=fresh_opt, layout=DataLayout(**{**LAYOUT.to_dict(), "seed": 5}),
               replica_ids=("r0", "r1"))


def test_restore_brings_back_param_group_keys_a_fresh_optimizer_lacks(tmp_path):
    model, opt = make()
    apply_lr_factor(opt, 0.5)
    train(model, opt, 1)
    save_at(tmp_path, model, opt, 1)
    fresh, fresh_opt = make()
    store.restore(tmp_path, fresh, fresh_opt)
    assert fresh_opt.param_groups[0][BASE_LR_KEY] == 0.1 and fresh_opt.param_groups[0]["lr"] == 0.05


def test_a_checkpoint_without_its_manifest_is_not_current(tmp_path, monkeypatch):
    model, opt = make()
    train(model, opt, 1)
    save_at(tmp_path, model, opt, 1)
    real_write = FileStorage.write_atomic

    def crash_on_manifest(self, key, data):
        if key.endswith(mf.MANIFEST):
            raise OSError("killed before the manifest")
        real_write(self, key, data)

    monkeypatch.setattr(FileStorage, "write_atomic", crash_on_manifest)
    with pytest.raises(OSError):
        save_at(tmp_path, model, opt, 2)
    assert (tmp_path / "step-00000002").is_dir()
    assert store.latest_complete(tmp_path).step == 1
    assert store.scan(tmp_path)[0].problems == ("manifest.json: missing (the write did not finish)",)


@pytest.mark.parametrize(("damage", "problem"), [
    ("flip", "CRC32 0x"),
    ("truncate", "truncated or resized"),
    ("delete", "missing"),
])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path, caplog, damage, problem):
    model, opt = make()
    train(model, opt, 2)
    save_at(tmp_path, model, opt, 2)
    train(model, opt, 2)
    save_at(tmp_path, model, opt, 4)
    victim = next((tmp_path / "step-00000004").glob("*.distcp"))
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    with caplog.at_level(logging.WARNING, logger="ftrun.checkpoint"):
        info = store.latest_complete(tmp_path)
    assert info.step == 2
    assert f"step-00000004 skipped" in caplog.text and f"{victim.name}: {problem}" in caplog.text
    fresh, fresh_opt = make()
    assert store.restore(tmp_path, fresh, fresh_opt)[0] == 2


def test_a_corrupt_manifest_falls_back_too(tmp_path):
    model, opt = make()
    train(model, opt, 1)
    save_at(tmp_path, model, opt, 1)
    save_at(tmp_path, model, opt, 2)
    (tmp_path / "step-00000002" / mf.MANIFEST).write_bytes(b'{"format": "ftrun.checkpoint/1", "st')
    assert store.latest_complete(tmp_path).step == 1


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    model, opt = make()
    train(model, opt, 1)
    (tmp_path / "step-00000001").mkdir()  # torn leftover of an earlier write
    for step in (2, 3, 4, 5):
        save_at(tmp_path, model, opt, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]


def test_rewriting_a_step_replaces_it(tmp_path):
    model, opt = make()
    train(model, opt, 1)
    save_at(tmp_path, model, opt, 1)
    train(model, opt, 1)
    save_at(tmp_path, model, opt, 1)
    fresh, fresh_opt = make()
    store.restore(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_restore_without_a_checkpoint_and_save_misuse(tmp_path):
    model, opt = make()
    with pytest.raises(store.NoCheckpoint):
        store.restore(tmp_path / "none", model, opt)
    with pytest.raises(ValueError, match="loader_state is at step 3, the checkpoint is of step 4"):
        store.save(tmp_path, step=4, model=model, optimizer=opt, loader_state=ledger(3))


# -- the sharded writer's vote (pure) -----------------------------------------------------------------
def entry(name: str) -> mf.FileEntry:
    return mf.FileEntry(name, 10, 7, "ab" * 32)


R0 = mf.encode_report(0, files=[entry(".metadata"), entry("__0_0.distcp"), entry("loader_state.bin")])
R1 = mf.encode_report(1, files=[entry("__1_0.distcp")])
DISK = {".metadata", "__0_0.distcp", "__1_0.distcp", "loader_state.bin"}
VOTE_CASES = [  # (name, reports, on disk, world size, commit, reason contains)
    ("every rank wrote", [R0, R1], DISK, 2, True, "all 2 ranks wrote 4 files"),
    ("a rank's write failed", [R0, mf.encode_report(1, error="rank 1: OSError: disk full")], DISK, 2, False,
     "disk full"),
    ("a rank missing", [R0], DISK, 2, False, "1 of 2 ranks reported"),
    ("a file nobody claims (a dead rank's)", [R0, R1], DISK | {"__2_0.distcp"}, 2, False, "no rank reported"),
    ("a name claimed twice", [R0, mf.encode_report(1, files=[entry("__0_0.distcp")])], DISK, 2, False, "twice"),
    ("a report out of rank order", [R1, R0], DISK, 2, False, "says rank 1"),
    ("garbage", [R0, b"\xff{"], DISK, 2, False, "rank 1: unreadable"),
    ("a path instead of a name", [R0, mf.encode_report(1, files=[entry("../x")])], DISK, 2, False, "unreadable"),
    ("one rank, nothing written", [mf.encode_report(0, files=[])], set(), 1, False, "no rank wrote"),
]


@pytest.mark.parametrize(("name", "reports", "disk", "world", "commit", "reason"), VOTE_CASES,
                         ids=[c[0] for c in VOTE_CASES])
def test_shard_vote(name, reports, disk, world, commit, reason):
    vote = mf.shard_vote(reports, disk, world)
    assert vote.commit == commit and reason in vote.reason, vote.reason
    if commit:
        assert [f.name for f in vote.files] == sorted(DISK)


def test_a_rank_checks_each_data_file_before_dcp_reads_it(tmp_path):
    model, opt = make()
    train(model, opt, 1)
    info = store.save(tmp_path, step=1, model=model, optimizer=opt, loader_state=ledger(1), key=KEY)
    data = next(info.path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    small = {".metadata", "loader_state.bin"}
    assert store.verify(info.path, key=KEY, only=small) == (info.manifest, [])  # what a non-leader checks first
    assert store.check_files_of(info.path, info.manifest, ["x.distcp"], signed=True) == \
        ["x.distcp: not listed in the manifest"]
    reader = store._CheckingReader(info.path, info.manifest, signed=True, checked=small)
    fresh, fresh_opt = make(seed=9)
    sd = store._state_dict(fresh, fresh_opt, None)
    with pytest.raises((store.CheckpointCorrupt, store.CheckpointException), match=f"{data.name}: CRC32"):
        with store._single_process():
            store.dcp.load(sd, storage_reader=reader, no_dist=True)
