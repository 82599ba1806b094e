"""The FT-HSDP trainer's parts (state round trip, gradient buffer, fault plans) and, in one process with
threads over loopback, the trainer itself: a late replica heals and ends bitwise equal, a failure inside
backward is retried without touching model or optimizer."""

from __future__ import annotations

import gc
import json
import re
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ftrun.catchup import snapshot
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupUsageError
from ftrun.catchup.http_transport import HttpCatchup
from ftrun.config import LighthouseConfig, ManagerConfig, Timeouts
from ftrun.data.audit import AuditLog, audit, read_log
from ftrun.data.loader_state import LoaderState, LoaderStateError, LoaderStateStore
from ftrun.data.sampler import DataLayout
from ftrun.env.real import RealEnv
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.service import Lighthouse
from ftrun.replica.comm import LocalComm
from ftrun.storage import FileStorage
from ftrun.train.checkpointer import DcpCheckpointer
from ftrun.train.compute import TorchCompute
from ftrun.train.exchange import GradientExchange
from ftrun.train.ft_worker import Float32Kernels, param_hash
from ftrun.train.grads import FlatGrads
from ftrun.train.inject import CatchupFault, DieAt, parse_catchup_fault, parse_die_at, plan_for
from ftrun.train.lr import BASE_LR_KEY, apply_lr_factor
from ftrun.train.resume import resume
from ftrun.train.state import ReplicaState, stable_names
from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens
from ftrun.train.trainer import TrainerConfig, build, step_seed
from ftrun.checkpoint import store
from ftrun.checkpoint.policy import CheckpointConfig

TOY = ToyConfig(vocab=16, seq_len=8, d_model=8, hidden=16, num_samples=256, seed=3)
DATA = make_tokens(TOY)


def trained(steps: int):
    model = make_model(TOY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for i in range(steps):
        apply_lr_factor(opt, 0.5 + 0.1 * i)
        lm_loss(model, DATA[i * 8:(i + 1) * 8]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def one_step(model, opt, grads_from):
    for p, g in zip(model.parameters(), grads_from):
        p.grad = g.clone()
    apply_lr_factor(opt, 0.7)
    opt.step()


def test_replica_state_round_trip_is_bitwise_and_keeps_the_optimizer_exact():
    src_model, src_opt = trained(3)
    dst_model = make_model(replace(TOY, seed=99))
    dst_opt = torch.optim.AdamW(dst_model.parameters(), lr=5.0)  # other LR, no state yet
    src = ReplicaState(model=src_model, optimizer=src_opt)
    metadata = json.loads(json.dumps(src.metadata()))  # it travels as JSON
    ReplicaState(model=dst_model, optimizer=dst_opt).load({k: v.clone() for k, v in src.tensors().items()}, metadata)
    assert param_hash(dst_model) == param_hash(src_model)
    assert dst_opt.param_groups[0][BASE_LR_KEY] == src_opt.param_groups[0][BASE_LR_KEY]
    assert dst_opt.param_groups[0]["betas"] == src_opt.param_groups[0]["betas"]  # a tuple again
    grads = [torch.randn_like(p) for p in src_model.parameters()]
    one_step(src_model, src_opt, grads)
    one_step(dst_model, dst_opt, grads)
    assert param_hash(dst_model) == param_hash(src_model)  # same step counters, moments, LR: same bits
    for a, b in zip(src_opt.state.values(), dst_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_replica_state_carries_tensor_hyperparameters_as_tensors():
    """A captured or compiled optimizer holds its LR and betas as one-element tensors: they travel as numbers
    and come back as tensors of the loader's own dtype and device, so a scheduler's fill_ still works."""
    def tensor_adamw(model, lr):
        return torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr),
                                 betas=(torch.tensor(0.8), torch.tensor(0.95, dtype=torch.float64)))
    src_model = make_model(TOY)
    src_opt = tensor_adamw(src_model, 1e-2)
    for i in range(2):
        apply_lr_factor(src_opt, 0.5 + 0.1 * i)
        lm_loss(src_model, DATA[i * 8:(i + 1) * 8]).backward()
        src_opt.step()
        src_opt.zero_grad()
    dst_model = make_model(replace(TOY, seed=99))
    dst_opt = tensor_adamw(dst_model, 5.0)
    src = ReplicaState(model=src_model, optimizer=src_opt)
    metadata = json.loads(json.dumps(src.metadata()))
    ReplicaState(model=dst_model, optimizer=dst_opt).load({k: v.clone() for k, v in src.tensors().items()}, metadata)
    mine, theirs = dst_opt.param_groups[0], src_opt.param_groups[0]
    assert isinstance(mine["lr"], torch.Tensor) and torch.equal(mine["lr"], theirs["lr"])
    assert isinstance(mine["betas"], tuple) and [b.dtype for b in mine["betas"]] == [torch.float32, torch.float64]
    assert all(torch.equal(a, b) for a, b in zip(mine["betas"], theirs["betas"]))
    grads = [torch.randn_like(p) for p in src_model.parameters()]
    one_step(src_model, src_opt, grads)
    one_step(dst_model, dst_opt, grads)
    assert param_hash(dst_model) == param_hash(src_model)


def test_what_a_snapshot_may_lend_leaves_out_what_a_forward_changes():
    """Lent tensors must change only at the optimizer step or a load: a buffer (running statistics) and an
    embedding's weight under max_norm (renormalized in place by its forward) are copied; a TrainState
    without stable() is copied whole."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Linear(4, 4),
                                torch.nn.BatchNorm1d(4), torch.nn.Embedding(10, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stable = ReplicaState(model=model, optimizer=opt).stable()
    assert "model.0.weight" not in stable and "model.2.running_mean" not in stable
    assert {"model.1.weight", "model.1.bias", "model.2.weight", "model.3.weight"} <= stable
    assert stable_names(object()) == frozenset()


def test_replica_state_load_keeps_the_handed_tensors_as_the_optimizer_state():
    """A fetch's tensors are the loader's: a CPU optimizer's state is them, not a copy (no clone on the
    joiner's critical path), and it goes on from them in place."""
    src_model, src_opt = trained(2)
    dst_model = make_model(replace(TOY, seed=99))
    dst_opt = torch.optim.AdamW(dst_model.parameters(), lr=5.0)
    src = ReplicaState(model=src_model, optimizer=src_opt)
    handed = {k: v.clone() for k, v in src.tensors().items()}
    ReplicaState(model=dst_model, optimizer=dst_opt).load(handed, src.metadata())
    moments = handed["optim.up.weight.exp_avg"]
    assert dst_opt.state[dst_model.up.weight]["exp_avg"].data_ptr() == moments.data_ptr()
    before = moments.clone()
    one_step(dst_model, dst_opt, [torch.randn_like(p) for p in dst_model.parameters()])
    assert not torch.equal(moments, before)  # updated where it lies


def test_replica_state_load_adopts_the_handed_tensors_as_cpu_parameters_unless_shared():
    """A CPU parameter takes its fetched tensor as its data (no copy; the Parameter, which the optimizer
    holds, stays the same object); one whose storage something else shares (an alias kept outside, a view
    of a flat buffer) is copied into instead, so the alias sees the loaded values; buffers are copied."""
    src_model, src_opt = trained(2)
    src_model.register_buffer("scale", torch.arange(3.0))
    dst_model = make_model(replace(TOY, seed=99))
    dst_model.register_buffer("scale", torch.zeros(3))
    dst_opt = torch.optim.AdamW(dst_model.parameters(), lr=5.0)
    params = list(dst_model.parameters())
    alias = dst_model.up.weight.detach()  # e.g. user code keeping p.detach()
    src = ReplicaState(model=src_model, optimizer=src_opt)
    handed = {k: v.clone() for k, v in src.tensors().items()}
    ReplicaState(model=dst_model, optimizer=dst_opt).load(handed, src.metadata())
    assert list(dst_model.parameters()) == params and dst_opt.param_groups[0]["params"] == params
    adopted = [n for n, p in dst_model.named_parameters() if p.data_ptr() == handed[f"model.{n}"].data_ptr()]
    assert adopted == [n for n, _ in dst_model.named_parameters() if n != "up.weight"]
    assert torch.equal(alias, src_model.up.weight) and alias.data_ptr() == dst_model.up.weight.data_ptr()
    assert torch.equal(dst_model.scale, src_model.scale) and dst_model.scale.data_ptr() != handed["model.scale"].data_ptr()
    grads = [torch.randn_like(p) for p in src_model.parameters()]
    one_step(src_model, src_opt, grads)
    one_step(dst_model, dst_opt, grads)
    assert param_hash(dst_model) == param_hash(src_model)


def test_replica_state_stable_tensors_are_parameters_and_optimizer_state_not_buffers():
    """What a catch-up snapshot may serve in place: what only the optimizer step (or a load) changes; a
    forward updates BatchNorm's running statistics, so buffers are copied."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    state = ReplicaState(model=model, optimizer=opt)
    params = {f"model.{n}" for n, _ in model.named_parameters()}
    optim = {k for k in state.tensors() if k.startswith("optim.")}
    assert optim and state.stable() == params | optim
    assert {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"} <= \
        set(state.tensors()) - state.stable()


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3)),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.1),  # no state at all
], ids=["adamw", "adam-tensor-lr", "sgd-momentum", "sgd"])
def test_peer_shapes_before_the_first_step_are_the_layout_a_peer_publishes_after_it(make_opt):
    """A restarted replica sizes its receive buffer before its optimizer has state: peer_shapes stands
    the state of the first step in, exactly, and leaves this optimizer untouched."""
    model = make_model(TOY)
    params = list(model.parameters())
    opt = make_opt([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    state = ReplicaState(model=model, optimizer=opt)
    shapes = state.peer_shapes()()
    assert not opt.state and param_hash(model) == param_hash(make_model(TOY))
    lm_loss(model, DATA[:8]).backward()
    opt.step()
    assert snapshot.describe(shapes, shape_only=True) == snapshot.describe(state.tensors())
    assert state.peer_shapes()().keys() == state.tensors().keys()  # after a step: tensors() itself


def test_peer_shapes_take_what_they_need_now_and_step_only_when_called_even_after_the_live_optimizer_did():
    """build's synchronous path only takes shapes and param groups; the throwaway step runs when the function
    is called (in the catch-up's background task), and the live optimizer stepping or changing its groups in
    between changes neither its answer nor is touched by it."""
    class Counted(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            Counted.steps += 1
            return super().step(closure)

    model = make_model(TOY)
    opt = Counted(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = ReplicaState(model=model, optimizer=opt)
    shapes = state.peer_shapes()
    assert Counted.steps == 0 and not opt.state  # nothing stepped yet
    lm_loss(model, DATA[:8]).backward()
    opt.step()  # the training loop's first step, before the background task gets to run
    opt.param_groups[0]["lr"] = 5.0
    opt.param_groups[0]["amsgrad"] = True  # would add state (max_exp_avg_sq) to a step: the groups were taken before
    stepped = {k: v.clone() for k, v in state.tensors().items()}
    got = shapes()
    assert Counted.steps == 2 and opt.param_groups[0]["lr"] == 5.0  # the live step and the throwaway one
    assert not any(name.endswith(".max_exp_avg_sq") for name in got)
    assert all(t.device.type == "meta" for name, t in got.items() if not name.endswith(".step"))  # no memory
    assert snapshot.describe(got, shape_only=True) == snapshot.describe(state.tensors())
    assert all(torch.equal(stepped[k], v) for k, v in state.tensors().items())  # the live state untouched


def test_peer_shapes_share_a_param_group_value_that_cannot_be_copied():
    """A param group may hold what deepcopy refuses (a process group, say): build's synchronous path must not fail
    on it. Such a value is shared as it is, and the function still gives the first step's layout."""
    class ProcessGroupLike:
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle 'ProcessGroup' object")

    model = make_model(TOY)
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "group": ProcessGroupLike()}], lr=1e-2)
    state = ReplicaState(model=model, optimizer=opt)
    shapes = state.peer_shapes()()
    assert not opt.state
    lm_loss(model, DATA[:8]).backward()
    opt.step()
    assert snapshot.describe(shapes, shape_only=True) == snapshot.describe(state.tensors())


def test_peer_shapes_of_an_optimizer_that_cannot_step_on_meta_tensors_are_its_tensors():
    model = make_model(TOY)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # no meta kernels
    state = ReplicaState(model=model, optimizer=opt)
    assert state.peer_shapes()().keys() == state.tensors().keys() and not opt.state


def test_peer_shapes_take_no_throwaway_step_that_a_global_step_hook_would_see():
    model = make_model(TOY)
    state = ReplicaState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    handle = register_optimizer_step_pre_hook(lambda opt, *_: seen.append(opt))
    try:
        assert state.peer_shapes()().keys() == state.tensors().keys() and seen == []
    finally:
        handle.remove()
    assert len(state.peer_shapes()()) > len(state.tensors())


def test_replica_state_rejects_another_models_state():
    with pytest.raises(ValueError, match="not parameters of the model"):
        ReplicaState(model=make_model(TOY), optimizer=torch.optim.SGD(make_model(TOY).parameters(), lr=1.0))
    model, opt = trained(1)
    tensors = ReplicaState(model=model, optimizer=opt).tensors()
    other = make_model(replace(TOY, hidden=17))
    with pytest.raises(ValueError, match="up.weight"):
        ReplicaState(model=other, optimizer=torch.optim.AdamW(other.parameters())).load(tensors, {})


def test_flat_grads_gather_zero_fills_and_scatter_gives_every_param_a_grad():
    model = make_model(TOY)
    grads = FlatGrads(model.parameters())
    assert grads.buffer.dtype == np.float32 and grads.buffer.size == sum(p.numel() for p in model.parameters())
    lm_loss(model, DATA[:4]).backward()
    model.embed.weight.grad = None  # e.g. an unused parameter
    grads.gather()
    n = model.embed.weight.numel()
    assert not grads.buffer[:n].any() and grads.buffer[n:].any()
    grads.buffer[:] = 2.0
    model.zero_grad(set_to_none=True)
    grads.scatter()
    assert all(p.grad is not None and bool((p.grad == 2.0).all()) for p in model.parameters())


def test_fault_plans_parse_and_filter():
    plans = parse_die_at("step=5,phase=exchange,replica=r1,incarnation=0; phase=heal")
    assert plans == (DieAt(phase="exchange", step=5, replica="r1", incarnation=0), DieAt(phase="heal"))
    assert plan_for(plans, "r1", 1) == (DieAt(phase="heal"),)
    assert plans[0].due("exchange", 6) and not plans[0].due("exchange", 4) and not plans[0].due("heal", 9)
    assert parse_catchup_fault("kind=truncate,then=die,replica=r0") == (
        CatchupFault(kind="truncate", then_die=True, replica="r0"),)
    assert parse_die_at("") == ()
    for bad in ("phase=lunch", "step=1", "phase=heal,when=now", "phase=heal,step=-1"):
        with pytest.raises(ValueError):
            parse_die_at(bad)
    with pytest.raises(ValueError):
        parse_catchup_fault("kind=corrupt,then=live")


def test_a_die_at_fraction_of_the_step_parses_and_goes_with_the_backward_only():
    plan = DieAt(phase="backward", step=15, replica="r1", incarnation=2, at=0.5)
    assert parse_die_at(plan.encode()) == (plan,) and "at=0.5" in plan.encode()
    assert "at=" not in DieAt(phase="backward").encode()
    for bad in ("phase=backward,at=1", "phase=backward,at=-0.1", "phase=exchange,at=0.5",
                "phase=backward,at=0.5,action=slow,seconds=1", "phase=backward,at=half"):
        with pytest.raises(ValueError):
            parse_die_at(bad)


def _faults(monkeypatch, die_at: str, spawn):
    """ft_worker.Faults of r1's rank 0 on a clock the test moves, dying into a list instead of SIGKILL."""
    from ftrun.launch.worker_env import WorkerSpec
    from ftrun.train import ft_worker

    died, slept, clock = [], [], [0.0]
    monkeypatch.setattr(ft_worker, "die", lambda: died.append(clock[0]))
    spec = WorkerSpec(replica_id="r1", replica_index=1, num_replicas=3, rank=0, ranks_per_replica=1, incarnation=0,
                      lighthouse="", token="", store_addr="", store_port=0, run_dir="")
    faults = ft_worker.Faults(spec, die_at=die_at, catchup="", plan_file=None, sleep=slept.append,
                              now=lambda: clock[0], spawn=spawn)
    return faults, died, slept, clock


def _timed_steps(faults, clock, computes):
    for step, compute in enumerate(computes):
        faults.on_phase("forward", step)
        clock[0] += compute
        faults.on_phase("exchange", step)


def test_a_kill_at_a_fraction_of_the_step_fires_that_share_of_the_ranks_compute_after_the_step_started(
        monkeypatch, capsys):
    tasks = []
    faults, died, slept, clock = _faults(monkeypatch, "phase=backward,step=3,replica=r1,at=0.5",
                                         lambda fn, name: tasks.append(fn))
    _timed_steps(faults, clock, [0.02, 0.04, 0.03])
    assert faults.computes == pytest.approx([0.02, 0.04, 0.03])
    faults.on_phase("started", 2)
    assert tasks == []  # not due before step 3
    faults.on_phase("started", 3)
    assert len(tasks) == 1 and died == []
    faults.on_phase("forward", 3)
    faults._in_backward(None)  # the timer took the plan: the backward does not act on it
    assert died == []
    tasks[0]()
    assert slept == [pytest.approx(0.5 * 0.03)] and len(died) == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["event"] == "fault" and line["action"] == "kill" and line["step"] == 3
    faults.on_phase("started", 4)
    assert len(tasks) == 1  # once


def test_timing_the_compute_leaves_an_exchange_fault_armed(monkeypatch):
    faults, died, slept, clock = _faults(monkeypatch, "phase=exchange,step=1", None)
    _timed_steps(faults, clock, [0.02, 0.03])
    assert faults.computes == pytest.approx([0.02, 0.03])
    assert faults.kernels.die_after == 3  # step 1's exchange armed the kernels' kill


def test_a_kill_at_a_fraction_before_any_timed_compute_acts_inside_the_backward(monkeypatch):
    tasks = []
    faults, died, slept, clock = _faults(monkeypatch, "phase=backward,step=0,at=0.5", lambda fn, name: tasks.append(fn))
    faults.on_phase("started", 0)
    faults.on_phase("forward", 0)
    faults._in_backward(None)
    assert tasks == [] and died == [0.0] and slept == []


def test_resume_restores_the_latest_checkpoint_and_its_ledger(tmp_path):
    from ftrun.checkpoint import store

    layout = DataLayout(dataset_size=len(DATA), num_replicas=2, ranks_per_replica=1, batch_size_per_rank=4)
    fresh = make_model(TOY)
    assert resume(tmp_path / "none", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()), layout=layout,
                  replica_ids=("a", "b")) == (0, LoaderState.initial(layout, ("a", "b")))
    model, opt = trained(2)
    ledger = LoaderState.initial(layout, ("a", "b")).advance(step=0, contributors=("a", "b")).advance(
        step=1, contributors=("a",))
    store.save(tmp_path, step=2, model=model, optimizer=opt, loader_state=ledger)
    other = make_model(TOY)
    other_opt = torch.optim.AdamW(other.parameters())
    assert resume(tmp_path, model=other, optimizer=other_opt, layout=layout, replica_ids=("a", "b")) == (2, ledger)
    assert param_hash(other) == param_hash(model)
    with pytest.raises(LoaderStateError, match="replicas"):
        resume(tmp_path, model=other, optimizer=other_opt, layout=layout, replica_ids=("b", "a"))


def test_step_seed_is_a_pure_function_of_its_key():
    assert step_seed(0, 1, 0, 7) == step_seed(0, 1, 0, 7)
    assert len({step_seed(0, r, 0, s) for r in range(3) for s in range(50)}) == 150
    assert 0 <= step_seed(2**40, 5, 3, 10**9) < 2**63
    with pytest.raises(ValueError):
        TrainerConfig(replica_id="")


# -- the trainer in one process: threads, loopback sockets ------------------------------------------
IDS = ("r0", "r1", "r2")
TOKEN = "tok"
T = Timeouts(heartbeat_interval_s=0.05, heartbeat_timeout_s=2.0, join_timeout_s=3.0, ftar_timeout_s=1.0,
             catchup_long_poll_s=3.0, catchup_stall_s=3.0)
LAYOUT = DataLayout(dataset_size=len(DATA), num_replicas=3, ranks_per_replica=1, batch_size_per_rank=4, seed=1)


class Rep:
    def __init__(self, env, lighthouse, rid, root, *, checkpoint=None, checkpointer=None, on_phase=None,
                 optimizer=None, layout=LAYOUT, joining=False):
        """checkpoint/checkpointer(model, optimizer): persistent checkpoints (default: none). joining:
        build's (a restart: the receive buffer of a heal is prepared).
        on_phase(rep, phase, step): a test's own hook at every phase boundary. optimizer(model): the
        optimizer (default AdamW, lr 1e-2). layout: the job's data layout (its replicas are IDS' first)."""
        self.rid, self.records, self.events, self.results = rid, [], [], []
        self.at_quorum = []  # (step, param hash, optimizer step count) before each attempt
        self.fail_next_backward = False
        self._on_phase = on_phase
        self.model = make_model(TOY)
        self.opt = optimizer(self.model) if optimizer else torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        config = TrainerConfig(replica_id=rid, catchup=CatchupConfig(max_shard_bytes=1024, timeouts=T),
                               **({"checkpoint": checkpoint} if checkpoint is not None else {}))
        catchup = CatchupConfig(max_shard_bytes=1024, timeouts=T)
        self.server = HttpCatchup(env=env, token=TOKEN, config=catchup)
        self.engine = FtarEngine(env=env, kernels=Float32Kernels(), token=TOKEN,
                                 config=FtarConfig(chunk_bytes=512, num_chunks=2, timeout_s=T.ftar_timeout_s))
        try:
            self.trainer = build(
                config=config, env=env,
                compute=TorchCompute(model=self.model, optimizer=self.opt, loss_fn=self.loss, dataset=DATA),
                layout=layout, replica_ids=IDS[:layout.num_replicas],
                manager_config=ManagerConfig(max_retries=3, timeouts=T), comm=LocalComm(),
                lighthouse=LighthouseClient(env=env, addr=lighthouse.addr, token=TOKEN, replica_id=rid, timeouts=T),
                exchange=GradientExchange(engine=self.engine, rank=0), catchup=self.server,
                loader_store=LoaderStateStore(storage=FileStorage(root / rid)), audit=AuditLog(self.records.append),
                checkpointer=checkpointer(self.model, self.opt) if checkpointer is not None else None,
                on_event=self.events.append, on_phase=self.on_phase, joining=joining)
        except BaseException:
            self.engine.close()
            self.server.stop()
            raise

    def on_phase(self, phase, step):
        if self._on_phase is not None:
            self._on_phase(self, phase, step)
        if phase == "quorum":
            count = self.opt.state_dict()["state"].get(0, {}).get("step")
            self.at_quorum.append((step, param_hash(self.model), None if count is None else float(count)))

    def loss(self, model, batch):
        if self.fail_next_backward:
            self.fail_next_backward = False
            raise RuntimeError("injected failure in the compute")
        return lm_loss(model, batch)

    def run_until(self, step):
        while self.trainer.step < step:
            self.results.append(self.trainer.train_step())

    def close(self):
        self.trainer.close()
        self.engine.close()
        self.server.stop()


def run(env, reps, step):
    tasks = [env.spawn(r.run_until, step, name=r.rid) for r in reps]
    for t in tasks:
        assert t.join(30.0), "a replica hung"
        assert t.exception is None, t.exception


def watch_lent_state(r, changes):
    """Record in `changes` every change of r's state (its optimizer's step, a heal's load) made while its
    catch-up snapshot may still serve the state's stable tensors in place, and every retire that finds a
    lent tensor changed since its publish. Returns the publishes: (step, names lent)."""
    store, publishes, lent = r.server.server.store, [], {}
    publish, retire, load = r.server.publish, r.server.retire, r.trainer.state.load

    def watched_publish(step, state, metadata=None, *, borrow=()):
        publishes.append((step, sorted(borrow)))
        lent[step] = {k: state[k].clone() for k in borrow}
        publish(step, state, metadata, borrow=borrow)

    def watched_retire(step):
        now = r.trainer.state.tensors()
        changes.extend(f"{r.rid} step {step}: {k} changed before the retire"
                       for k, v in lent.pop(step, {}).items() if not torch.equal(now[k], v))
        retire(step)

    def before_change(what):
        if store.status()["state"] not in ("none", "retired"):
            changes.append(f"{r.rid}: {what} while the snapshot is {store.status()}")

    r.server.publish, r.server.retire = watched_publish, watched_retire
    r.opt.register_step_pre_hook(lambda *_: before_change("an optimizer step"))
    r.trainer.state.load = lambda *a: (before_change("a heal's load"), load(*a))
    return publishes


def with_vector_hyperparameter(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.param_groups[0]["scales"] = torch.ones(3)  # more than a number: JSON cannot carry it
    return opt


def with_sparse_buffer(model):
    model.register_buffer("mask", torch.zeros(4).to_sparse())  # no flat bytes for a snapshot to carry
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer, wrong", [
    (with_vector_hyperparameter, "metadata['state']['param_groups'][0]['scales'] is a Tensor"),
    (with_sparse_buffer, "tensor 'model.mask' (torch.sparse_coo, cpu) has no bytes to publish")])
def test_a_state_that_cannot_be_published_fails_the_build(tmp_path, optimizer, wrong):
    """A replica that restarts or starts late heals from its peers' published state: a state that cannot be
    published is refused when the rank is built, naming what is wrong, not once steps have committed (it
    failed the first heal's publish, or the reserve after the first commit of a quorum lacking a replica).
    A job of one replica never publishes, and is built."""
    env = RealEnv()
    lighthouse = Lighthouse(env=env, token=TOKEN, config=LighthouseConfig(min_replicas=1, timeouts=T))
    lighthouse.start()
    try:
        with pytest.raises(CatchupUsageError, match=re.escape(wrong)) as got:
            Rep(env, lighthouse, "r0", tmp_path, optimizer=optimizer)
        assert "replica r0 rank 0: its state cannot be published" in str(got.value)
        alone = Rep(env, lighthouse, "r0", tmp_path, optimizer=optimizer, layout=replace(LAYOUT, num_replicas=1))
        alone.close()
    finally:
        lighthouse.stop()


@pytest.mark.timeout(60)
def test_trainer_heals_a_late_replica_and_retries_a_failed_backward(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "LEND_MIN_BYTES", 0)  # the toy's tensors are small: lend every stable one
    env = RealEnv()
    lighthouse = Lighthouse(env=env, token=TOKEN, config=LighthouseConfig(min_replicas=2, timeouts=T))
    lighthouse.start()
    # r2 restarts (its receive buffer prepared before it checks in); so does r0, which has nobody to heal from
    reps = [Rep(env, lighthouse, rid, tmp_path, joining=rid != "r1") for rid in IDS]
    try:
        r0, r1, r2 = reps
        payloads = {r.rid: r.server.transport.payloads for r in reps}
        assert payloads["r1"]._preparation is None
        assert payloads["r2"]._preparation.task.join(30.0)
        prepared = torch.frombuffer(payloads["r2"]._preparation.buffer, dtype=torch.uint8)
        reserved = {r.rid: [] for r in reps}  # the state names of each catch-up reserve (trainer -> service)
        for r in reps:
            r.server.reserve = lambda state, borrow, rid=r.rid, real=r.server.reserve: (
                reserved[rid].append(sorted(state)), real(state, borrow=borrow))
        changes = []  # changes of a lent tensor while it was lent: there must be none
        publishes = {r.rid: watch_lent_state(r, changes) for r in reps}
        run(env, [r0, r1], 3)  # r2 is not there yet
        assert payloads["r0"]._preparation is None  # dropped at its 1st commit
        own = sorted(r0.trainer.state.tensors())
        assert reserved == {"r0": [own], "r1": [own], "r2": []}  # once, optimizer state included, while r2 is away
        fetched = []  # weak references to the model's tensors r2 fetches (views into the fetch's buffer)
        fetch = r2.server.fetch
        r2.server.fetch = lambda *args, **kwargs: fetched.append(got := fetch(*args, **kwargs)) or got
        late = env.spawn(r2.run_until, 6, name="r2")  # asks for step 0 first, so it is in the next quorum
        while "r2" not in lighthouse.status()["pending"]:
            env.clock.sleep(0.01)
        run(env, [r0, r1], 6)
        assert late.join(30.0) and late.exception is None, late.exception
        healed = r2.results[0]
        assert healed.healed and healed.step == 3 and healed.committed and healed.loss is None
        assert [e for e in r2.events if e["event"] == "catchup"][0]["step"] == 3
        views = [weakref.ref(t) for k, t in fetched.pop().tensors.items() if k.startswith("model.")]
        gc.collect()
        assert views and all(v() is None for v in views)  # loaded: the fetch's own tensor objects are gone
        assert r2.trainer.last_fetch.num_bytes > 0  # the fetch's figures are kept
        moments = r2.opt.state[r2.model.up.weight]["exp_avg"]  # the fetch landed in the prepared pages,
        for t in (moments, r2.model.up.weight):  # where the optimizer and (adopted, not copied) the model use it
            assert prepared.data_ptr() <= t.data_ptr() < prepared.data_ptr() + prepared.numel()
        assert r2.trainer.last_fetch.num_bytes == prepared.numel() and payloads["r2"]._preparation is None  # exact
        assert len({param_hash(r.model) for r in reps}) == 1  # healed from tensors served in place
        assert reserved == {"r0": [own], "r1": [own], "r2": []}  # r2 joined a full quorum: nothing to reserve
        stable = sorted(k for k in own if k.startswith(("model.", "optim.")))
        assert publishes["r0"] == publishes["r1"] == [(3, stable)] and not publishes["r2"]

        r1.fail_next_backward = True
        fail_at = r1.trainer.step
        run(env, reps, fail_at + 1)
        for r in reps:  # nobody applied the failed attempt: r1 never entered the FTAR, the others timed out
            attempts = [x for x in r.results if x.step == fail_at]
            assert [x.committed for x in attempts] == [False, True], (r.rid, attempts)
            failed, retry = [q for q in r.at_quorum if q[0] == fail_at]
            assert failed == retry  # model and optimizer (its step count too) untouched by the failure
        assert r1.results[-2].loss is None  # the failed attempt
        assert len({param_hash(r.model) for r in reps}) == 1
        run(env, reps, fail_at + 2)
        assert len({param_hash(r.model) for r in reps}) == 1
        assert changes == []

        records = [rec for r in reps for rec in read_log(b"".join(r.records))[0]]
        final = r0.trainer.progress.state
        assert all(r.trainer.progress.state == final for r in reps)
        report = audit(records, final=final)
        assert report.ok and report.num_steps == fail_at + 2, report.summary()
        assert final.committed_batches == (fail_at + 2, fail_at + 2, fail_at + 2 - 4)  # r2: away 0..2, healed in 3
    finally:
        for r in reps:
            r.close()
        lighthouse.stop()


# -- asynchronous checkpoints: the step waits for the staging only --------------------------------------
class GatedCheckpointer(DcpCheckpointer):
    """A DcpCheckpointer whose background write waits until `gate` is set (training goes on meanwhile) and
    then runs `before_write(step)` (e.g. breaks the storage) first."""

    def __init__(self, *, gate, before_write=lambda step: None, **kwargs):
        super().__init__(**kwargs)
        self.gate, self.before_write = gate, before_write

    def stage(self, step, loader_state):
        write = super().stage(step, loader_state)

        def gated():
            assert self.gate.wait(20.0), "the gate never opened"
            self.before_write(step)
            write()
        return gated


def _async_job(tmp_path, before_write=lambda root, step: None):
    """Three replicas train to step 5 with a checkpoint every 3 steps, written by r0 in the background; its
    write of step 3 starts only once step 4 has committed. Returns (reps, the state of r0 at step 3's start)."""
    env, root = RealEnv(), tmp_path / "ckpt"
    gate, at_3 = env.event(), {}

    def on_phase(rep, phase, step):
        if rep.rid == "r0" and phase == "started" and step == 3:  # the state after 3 commits, before the compute
            at_3["model"] = {k: v.clone() for k, v in rep.model.state_dict().items()}
            at_3["optim"] = {p: {k: v.clone() for k, v in st.items()} for p, st in rep.opt.state.items()}
        if rep.rid == "r0" and phase == "after_commit" and step == 4:
            at_3["opened"] = env.clock.now()
            gate.set()

    def checkpointer(model, opt):
        return GatedCheckpointer(root=root, model=model, optimizer=opt, keep=3, gate=gate,
                                 before_write=lambda step: before_write(root, step))

    lighthouse = Lighthouse(env=env, token=TOKEN, config=LighthouseConfig(min_replicas=3, timeouts=T))
    lighthouse.start()
    reps = [Rep(env, lighthouse, rid, tmp_path, checkpoint=CheckpointConfig(every_steps=3), checkpointer=checkpointer,
                on_phase=on_phase) for rid in IDS]
    try:
        run(env, reps, 5)
    finally:
        for r in reps:
            r.close()  # r0's close waits for its write in flight
        lighthouse.stop()
    return reps, at_3, root


@pytest.mark.timeout(60)
def test_an_async_checkpoint_is_complete_and_bit_equal_to_its_step_though_training_went_on(tmp_path):
    reps, at_3, root = _async_job(tmp_path)
    assert all([x.committed for x in r.results] == [True] * 5 for r in reps)  # nobody waited for the write
    events = [e for e in reps[0].events if e["event"].startswith("checkpoint")]
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint_staged", 3), ("checkpoint", 3)]
    assert events[0]["t"] < at_3["opened"] < events[1]["t"]  # staged at step 3, written after step 4 committed
    assert not any(e["event"].startswith("checkpoint") for r in reps[1:] for e in r.events)  # one writer
    info = store.latest_complete(root)
    assert info is not None and info.step == 3 and not store.verify(info.path)[1]
    model = make_model(ToyConfig(**{**TOY.__dict__, "seed": 99}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, ledger = DcpCheckpointer(root=root, model=model, optimizer=opt, keep=3).restore(LAYOUT, IDS)
    assert step == 3 and ledger.step == 3
    assert all(torch.equal(at_3["model"][k], v) for k, v in model.state_dict().items())
    for p_at, p in zip(at_3["optim"], opt.state):  # Adam's moments and step count, bit for bit
        assert all(torch.equal(at_3["optim"][p_at][k], v) for k, v in opt.state[p].items())
    assert param_hash(model) != param_hash(reps[0].model)  # r0 trained on (steps 3 and 4) while it was written


@pytest.mark.timeout(60)
def test_a_background_write_that_fails_is_logged_and_leaves_no_manifest(tmp_path, caplog):
    def break_storage(root, step):  # the step's folder cannot be made: every file write fails
        (root / f"step-{step:08d}").write_bytes(b"not a folder")

    reps, _, root = _async_job(tmp_path, before_write=break_storage)
    assert all([x.committed for x in r.results] == [True] * 5 for r in reps)  # training went on regardless
    events = [e for e in reps[0].events if e["event"].startswith("checkpoint")]
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint_staged", 3), ("checkpoint_failed", 3)]
    assert "step-00000003" in events[1]["error"]  # the write names what failed
    assert store.latest_complete(root) is None and not list(root.rglob("manifest.json"))
    assert "checkpoint of step 3 failed" in caplog.text


def test_a_timed_kill_is_armed_on_the_kernels_timer_and_announced_for_when_it_lands(monkeypatch, capsys):
    tasks, armed = [], []
    faults, died, slept, clock = _faults(monkeypatch, "phase=backward,step=2,replica=r1,at=0.5",
                                         lambda fn, name: tasks.append(fn))
    faults._kill_later = lambda s: armed.append(s) or True
    _timed_steps(faults, clock, [0.02, 0.04])
    faults.on_phase("started", 2)
    assert armed == [pytest.approx(0.5 * 0.03)] and tasks == [] and died == []
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["event"] == "fault" and line["action"] == "kill" and line["t"] == pytest.approx(clock[0] + 0.015)
    faults.on_phase("forward", 2)
    faults._in_backward(None)
    assert died == [] and len(armed) == 1  # fired once, by the timer


def test_a_kill_falls_back_to_a_task_where_no_timer_can_be_armed(monkeypatch, capsys):
    tasks = []
    faults, died, slept, clock = _faults(monkeypatch, "phase=backward,step=1,replica=r1,at=0.5",
                                         lambda fn, name: tasks.append(fn))
    faults._kill_later = lambda s: False
    _timed_steps(faults, clock, [0.02])
    faults.on_phase("started", 1)
    assert len(tasks) == 1 and died == []
    tasks[0]()
    assert slept == [pytest.approx(0.01)] and len(died) == 1
    faults_printed = [line for line in capsys.readouterr().out.splitlines() if '"fault"' in line]
    assert len(faults_printed) == 1  # announced once, before arming


def test_kill_in_has_the_kernel_sigkill_a_busy_process_on_time():
    import subprocess
    import sys
    import time

    code = ("import time; from ftrun.train.ft_worker import kill_in\n"
            "print(kill_in(0.2), time.monotonic(), flush=True)\n"
            "while True: pass  # holds the GIL: no task could run\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        armed, t0 = p.stdout.readline().split()
        assert armed == "True"
        assert p.wait(timeout=30) == -9
        assert time.monotonic() - float(t0) >= 0.2
    finally:
        p.kill()
        p.wait()
