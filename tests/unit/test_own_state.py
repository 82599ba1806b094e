"""The user's registered state (ftrun.train.user_state), the LR multiplier and the launcher's fold of it.

Pure: no job, no sockets. The round trips are what catch-up relies on (a replica loads a peer's split
state); the hash is what `ftrun launch` compares as user_state_identical.
"""

from __future__ import annotations

import math

import pytest
import torch

from ftrun.catchup import snapshot
from ftrun.catchup.snapshot import SnapshotStore, tensor_views
from ftrun.env.real import RealEnv
from ftrun.launch.stats import RunStats
from ftrun.train.lr import scaled_lr
from ftrun.train.state import ReplicaState
from ftrun.train.user_state import UserState, WithUserState, flatten, unflatten


class Ema:
    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


class Counter:
    def __init__(self) -> None:
        self.n, self.seen = 0, (1, "a")

    def state_dict(self) -> dict:
        return {"n": self.n, "seen": self.seen, "by_int": {3: 1.5, 4: None}}

    def load_state_dict(self, state: dict) -> None:
        assert state["by_int"] == {3: 1.5, 4: None}
        self.n, self.seen = state["n"], state["seen"]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(s / 10)))


def setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    user = UserState()
    sched, ema, counter = schedule(opt), Ema(model), Counter()
    for name, obj in (("sched", sched), ("ema", ema), ("counter", counter)):
        user.register(name, obj)
    return model, opt, user, sched, ema, counter


def advance(model, opt, sched, ema, counter, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema.shadow[n].lerp_(p, 0.1)
        counter.n += 1
        counter.seen = (counter.n, "b")


def test_flatten_round_trips_nested_state():
    t = torch.arange(6.0).view(2, 3)
    value = {"a": [1, 2.5, None, True, "s"], "t": t, "tup": (t, 3), "ints": {1: t, 2: [t]}, "empty": {}}
    tensors: dict = {}
    skeleton = flatten(value, "user.x", tensors)
    assert all(k.startswith("user.x.") for k in tensors) and len(tensors) == 4
    back = unflatten(skeleton, tensors)
    assert back["a"] == value["a"] and back["tup"][1] == 3 and isinstance(back["tup"], tuple)
    assert torch.equal(back["ints"][1], t) and torch.equal(back["ints"][2][0], t) and back["empty"] == {}


def test_flatten_names_what_is_not_json():
    with pytest.raises(ValueError, match=r"user\.x\.bad: a set"):
        flatten({"ok": 1, "bad": {1, 2}}, "user.x", {})
    with pytest.raises(ValueError, match="same name"):
        flatten({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, "u", {})
    with pytest.raises(ValueError, match="lacks"):
        unflatten({"$t": "u.missing"}, {})


def test_register_rejects_bad_names_duplicates_and_objects_without_state():
    user = UserState()
    user.register("ok", Counter())
    for name, obj, match in (("ok", Counter(), "already"), ("no dots.", Counter(), "must match"),
                             ("x", object(), "no state_dict or load_state_dict")):
        with pytest.raises(ValueError, match=match):
            user.register(name, obj)


def test_a_peer_state_loads_into_a_fresh_replica_with_the_same_hash():
    src = setup(0)
    advance(*src[:2], *src[3:], steps=5)
    dst = setup(1)  # other weights, fresh scheduler/EMA/counter
    assert src[2].hash() != dst[2].hash()
    src_state = WithUserState(ReplicaState(model=src[0], optimizer=src[1]), src[2])
    dst_state = WithUserState(ReplicaState(model=dst[0], optimizer=dst[1]), dst[2])
    tensors, meta = src_state.tensors(), src_state.metadata()
    assert any(k.startswith("user.ema.shadow.") for k in tensors) and "user" in meta
    dst_state.load({k: v.clone() for k, v in tensors.items()}, meta)
    assert dst[2].hash() == src[2].hash()
    assert dst[3].state_dict() == src[3].state_dict() and dst[5].seen == (5, "b")
    # both continue identically: the scheduler drives the LR, the EMA follows the weights
    advance(*src[:2], *src[3:], steps=3)
    advance(*dst[:2], *dst[3:], steps=3)
    assert dst[2].hash() == src[2].hash()
    assert torch.equal(dst[0].weight, src[0].weight)


def test_the_own_loops_snapshot_is_the_state_its_step_began_with(monkeypatch):
    """The user's own loop runs its code between the step's begin (the catch-up publish) and opt.step()
    (the retire): SAM's ascent step, a weight clamp or an EMA swap change the parameters in place there. Its
    snapshot is the state the step began with, whatever that code does (nothing of it is lent)."""
    monkeypatch.setattr(snapshot, "LEND_MIN_BYTES", 0)
    model, opt, user, *rest = setup(0)
    advance(model, opt, *rest, steps=2)  # optimizer state to serve too
    state = WithUserState(ReplicaState(model=model, optimizer=opt), user)
    began = {k: v.clone() for k, v in state.tensors().items()}
    store = SnapshotStore(env=RealEnv(), max_shard_bytes=256)
    try:
        store.publish(1, state.tensors(), {"state": state.metadata()}, borrow=state.stable())
        assert store.wait_ready(5.0)
        with torch.no_grad():  # the user's code, mid-step: SAM perturbs the weights, the optimizer's moments
            for p in model.parameters():
                p.add_(1.0)
                opt.state[p]["exp_avg"].add_(1.0)
        published = store.lookup(1)[1]
        layout = published.manifest.layout
        served = torch.frombuffer(bytearray(published.read(0, layout.total_bytes)), dtype=torch.uint8)
        got = tensor_views(served, layout)
        assert {k for k in began if not torch.equal(got[k], began[k])} == set()
    finally:
        store.close()


def test_load_refuses_other_registered_names():
    _, _, user, *_ = setup(0)
    tensors, skeleton = user.split()
    other = UserState()
    other.register("sched", Counter())
    with pytest.raises(ValueError, match="registered"):
        other.load(tensors, skeleton)


def test_scaled_lr_composes_with_the_schedule_and_restores_it():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    seen = []
    for _ in range(4):
        with scaled_lr(opt, 0.25) as lrs:
            seen.append(lrs[0])
            assert opt.param_groups[0]["lr"] == lrs[0]
            opt.step()
        sched.step()
    assert seen == [0.25, 0.125, 0.0625, 0.03125]  # the schedule's LR x the factor, every step
    assert opt.param_groups[0]["lr"] == 0.0625 and sched.get_last_lr() == [0.0625]  # never overridden
    with pytest.raises(ValueError, match="factor"):
        with scaled_lr(opt, 0.0):
            pass


def test_launch_stats_compare_user_state_hashes_and_fold_metrics():
    stats = RunStats(num_replicas=2)
    assert stats.user_state_identical is None  # no user_state_hash: an ft.train job
    for rid, user in (("r0", "a"), ("r1", "a")):
        stats.add({"event": "step", "step": 0, "committed": True, "replica_id": rid, "rank": 0, "param_hash": "p",
                   "user_state_hash": user, "loss": 1.0})
        stats.add({"event": "metrics", "step": 1, "replica_id": rid, "rank": 0, "val_loss": 2.0 if rid == "r0" else 4.0,
                   "t": 1.0, "note": "text is skipped"})
    assert stats.user_state_identical is True and stats.user_state_checks == 1
    row = stats.rows[0].as_json()
    assert row["val_loss"] == 3.0 and "note" not in row and row["loss"] == 1.0
    stats.add({"event": "step", "step": 1, "committed": True, "replica_id": "r0", "rank": 0, "user_state_hash": "a"})
    stats.add({"event": "step", "step": 1, "committed": True, "replica_id": "r1", "rank": 0, "user_state_hash": "b"})
    assert stats.user_state_identical is False and stats.replicas_identical
