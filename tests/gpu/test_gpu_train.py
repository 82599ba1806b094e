"""Real training on a CUDA GPU (FTConfig.device, ftrun.train.device), end to end.

- `ftrun launch` of 3 replicas x 1 rank, replica i on cuda:{i % GPUs} (its host slot; all on cuda:0 with one
  GPU), of examples/train_llama_tiny.py (`ft.train()`)
  and of examples/own_loop.py (the user's own loop, with its scheduler and EMA registered), one replica
  SIGKILLed mid-run and restarted: it catches up onto its GPU from a peer; the job completes with
  bit-identical parameters (and registered state) on every replica, the exactly-once audit holds and
  the loss goes down. Both run through tests/integration/own_loop_worker.py, which slows the steps
  while a replica is missing so the job cannot end before the restarted one is back.
- One standalone process on the GPU against one on the CPU, same seed: the first steps' losses agree.
- A persistent checkpoint restores the model, the optimizer state and the registered state onto the GPU.
- `ft.train()` with the exchange overlapped with backward ends bitwise where one exchange after backward
  does, and a job resumed from a background-written checkpoint trains on to the same parameters.

Skips without a CUDA GPU. FTRUN_TEST_DEVICE=cpu runs the same checks on the CPU (a dry run of the
test itself, not part of the CPU suite). The corpus of the Llama example is made here (faker) and
cached, so the ranks only read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("FTRUN_TEST_DEVICE", "cuda")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ftrun.checkpoint.policy import CheckpointConfig  # noqa: E402
from ftrun.train.api import Hooks  # noqa: E402
from tests.integration.test_launch import ROOT, launch, python_path  # noqa: E402
from tests.integration.test_own_loop import check_identical_and_exactly_once, events_of  # noqa: E402
from tests.unit.test_own_optimizer import ACCUM, MICRO, Ema, Pairs, job_for, lambda_of, parts  # noqa: E402
from tests.unit.test_train_api import load_example  # noqa: E402

pytestmark = pytest.mark.gpu

WORKER = "tests/integration/own_loop_worker.py"
LLAMA = os.path.join("examples", "train_llama_tiny.py")
WANT = "cuda:0" if DEVICE == "cuda" else DEVICE


def small_llama(tmp_path) -> list[str]:
    """The example's arguments for a small model and corpus (no --device), the corpus made and cached here."""
    pytest.importorskip("faker")
    cache = tmp_path / "cache"
    load_example().load_tokens(cache, seed=0, num_chars=40_000)
    return ["--cache-dir", str(cache), "--corpus-chars", "40000", "--dim", "32", "--seq-len", "32", "--batch-size", "4"]


def check_on_device(out) -> None:
    """Every rank of every incarnation said it trained on the device: replica ri on host slot i, so on
    cuda:{i % GPUs} (ftrun launch spreads the replicas sharing a host over its GPUs)."""
    ready = [e for e in events_of(out) if e["event"] == "ready" and "device" in e]
    assert len(ready) >= 4  # 3 replicas and the restarted one
    for e in ready:
        assert e["host_slot"] == int(e["replica_id"][1:])
        assert e["device"] == (f"cuda:{e['host_slot'] % torch.cuda.device_count()}" if DEVICE == "cuda" else WANT)


def loss_curve(out) -> list[float]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r["loss"] for r in rows if r.get("loss") is not None]


def check_rejoined(events: list[dict], victim: str) -> float:
    """The victim's restarted incarnation caught up from a peer and committed; returns the seconds from
    its kill to its restarted rank's ready event."""
    later = [e for e in events if e.get("replica_id") == victim and e.get("incarnation", 0) >= 1]
    timeline = (f"kill {[round(e['t'], 2) for e in events if e['event'] == 'kill']}, last event "
                f"{round(max(e.get('t', 0) for e in events), 2)}; {victim} after its restart: "
                f"{[(e['event'], round(e.get('t', 0), 2)) for e in later[:12]]}")
    assert any(e["event"] == "catchup" for e in later), f"{victim}'s restarted incarnation never caught up: {timeline}"
    assert any(e["event"] == "step" and e.get("committed") for e in later), \
        f"{victim}'s restarted incarnation committed no step: {timeline}"
    killed = next(e["t"] for e in events if e["event"] == "kill" and e["replica_id"] == victim)
    return next(e["t"] for e in later if e["event"] == "ready") - killed


# A GPU job's steps take ~35 ms, and a restarted rank process is spawned where the fork server is unsafe
# (its start: python, torch, CUDA): the survivors wait MISSING_WAIT_S after each step while a replica is
# missing (own_loop_worker.py), 32 steps x 1 s after the kill at step 8.
MISSING_WAIT_S = "1.0"
KILL = "step=8,replica=r1"


@pytest.mark.timeout(150)
def test_llama_three_replicas_on_one_gpu_kill_restart_bitwise(tmp_path, monkeypatch):
    args = [*small_llama(tmp_path), "--device", DEVICE]
    monkeypatch.setenv("OWN_LOOP_SCRIPT", LLAMA)
    monkeypatch.setenv("OWN_LOOP_MISSING_WAIT_S", MISSING_WAIT_S)
    f = launch(tmp_path, "--replicas", "3", "--ranks-per-replica", "1", "--steps", "40", "--kill-at", KILL,
               "--restart-delay", "0.2s", "--timeout", "120s", WORKER, *args, timeout=140)
    assert f["complete"], f["incomplete_reasons"]
    assert f["failures_injected"] == 1 and f["restarts"] == 1 and f["crashes"] == 0
    assert f["replicas_identical"] and f["identity_checks"] > 40
    assert (f["duplicate_batches"], f["skipped_batches"], f["audit_problems"]) == (0, 0, 0)
    events = events_of(tmp_path)
    back_s = check_rejoined(events, "r1")
    check_on_device(tmp_path)
    finals = [e for e in events if e["event"] == "final" and e["step"] == f["steps_reached"]]
    assert len(finals) == 3 and len({e["param_hash"] for e in finals}) == 1
    losses = loss_curve(tmp_path)
    print(f"\n[gpu llama 3x1 on {WANT}] loss {losses[0]:.3f} -> {f['final_loss']:.3f}; median step "
          f"{f['median_step_s'] * 1e3:.1f} ms; r1 ready {back_s:.1f} s after its kill; start method "
          f"{f.get('start_method')}; wall {f['wall_s']:.1f} s")
    assert f["final_loss"] < losses[0] - 0.5


@pytest.mark.timeout(150)
def test_own_loop_three_replicas_on_one_gpu_kill_restart_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("OWN_LOOP_MISSING_WAIT_S", MISSING_WAIT_S)
    f = launch(tmp_path, "--replicas", "3", "--steps", "40", "--kill-at", KILL, "--restart-delay", "0.2s",
               "--timeout", "120s", WORKER, "--device", DEVICE, timeout=140)
    back_s = check_rejoined(events_of(tmp_path), "r1")
    check_identical_and_exactly_once(f, tmp_path, kills=1, victims={"r1"})
    check_on_device(tmp_path)
    losses = loss_curve(tmp_path)
    print(f"\n[gpu own loop 3x1 on {WANT}] loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step "
          f"{f['median_step_s'] * 1e3:.1f} ms; r1 ready {back_s:.1f} s after its kill")
    assert sum(losses[-5:]) < sum(losses[:5])


def standalone_losses(tmp_path, args: list[str], device: str) -> list[float]:
    proc = subprocess.run([sys.executable, LLAMA, "--steps", "10", *args, "--device", device], cwd=ROOT,
                          capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["device"] for e in events if e["event"] == "ready"] == [WANT if device == DEVICE else "cpu"]
    return [e["loss"] for e in events if e["event"] == "step" and e["committed"]]


@pytest.mark.timeout(120)
def test_standalone_gpu_loss_matches_the_cpu_run(tmp_path):
    """Same seed, weights (built on the CPU, then moved) and batches: the losses agree step by step within
    float32 reordering noise; a step that was not applied (or applied twice) is ~0.1 off by step 2."""
    args = small_llama(tmp_path)
    gpu, cpu = standalone_losses(tmp_path, args, DEVICE), standalone_losses(tmp_path, args, "cpu")
    print(f"\n[gpu vs cpu] {[round(a - b, 6) for a, b in zip(gpu, cpu)]}")
    assert len(gpu) == len(cpu) == 10
    assert abs(gpu[0] - cpu[0]) < 1e-3  # the same weights and batch; TF32 or kernel order at most
    assert all(abs(a - b) < 0.02 for a, b in zip(gpu, cpu)), (gpu, cpu)
    assert cpu[-1] < cpu[0] - 0.5


def own_loop_steps(job, data: Pairs, steps: int, seed: int = 0):
    """tests/unit/test_own_optimizer.py's loop with the batches moved to the job's device; returns the model,
    the inner optimizer, the scheduler, the EMA and the parameters after each committed step."""
    model, opt = job.wrap(*parts(seed))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_of)
    ema = Ema(model)
    job.register_state("sched", sched)
    job.register_state("ema", ema)
    batches = iter(DataLoader(data, batch_size=MICRO, sampler=job.sampler(data)))
    history = []
    while job.step < steps:
        opt.zero_grad()
        for _ in range(ACCUM):
            x, y = (t.to(job.device) for t in next(batches))
            (F.mse_loss(model(x), y) / ACCUM).backward()
        opt.clip_grad_norm_(0.5)
        if opt.step():
            sched.step()
            ema.update(model)
            history.append([p.detach().clone() for p in model.parameters()])
    return model, opt.optim, sched, ema, history


@pytest.mark.timeout(120)
def test_a_checkpoint_restores_model_optimizer_and_user_state_onto_the_gpu(tmp_path):
    data = Pairs()
    config = CheckpointConfig(every_steps=2, async_write=False)
    with job_for(tmp_path, checkpoint=config, device=DEVICE) as job:  # written at step 5, after 4 commits
        *_, history = own_loop_steps(job, data, 5)
        assert job.device == torch.device(WANT)
    with job_for(tmp_path, checkpoint=config, device=DEVICE) as job:
        model, opt = job.wrap(*parts(seed=7))  # other weights: the checkpoint must replace them
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_of)
        ema = Ema(model)
        job.register_state("sched", sched)
        job.register_state("ema", ema)
        batches = iter(DataLoader(data, batch_size=MICRO, sampler=job.sampler(data)))
        assert job.step == 4
        assert all(p.device == torch.device(WANT) and torch.equal(p, q) for p, q in zip(model.parameters(), history[3]))
        state = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
        assert state and all(t.device == torch.device(WANT) for t in state)  # AdamW's moments
        assert all(t.device == torch.device(WANT) for t in ema.shadow.values())
        opt.zero_grad()  # and it trains on from there, on the device
        for _ in range(ACCUM):
            x, y = (t.to(job.device) for t in next(batches))
            (F.mse_loss(model(x), y) / ACCUM).backward()
        assert opt.step() and job.step == 5
        assert all(p.device == torch.device(WANT) for p in model.parameters())


def train_mlp(run_dir, steps: int, **config):
    """`ft.train()` of the MLP of test_own_optimizer on the device, one replica of one rank; returns the
    TrainResult and the steps it trained."""
    data = Pairs()
    dataset = torch.cat([data.x, data.y], dim=1)  # a row: 5 inputs, 1 target
    trained = []

    def on_model(model: torch.nn.Module) -> None:
        assert all(p.device == torch.device(WANT) for p in model.parameters())

    run_dir.mkdir(exist_ok=True)
    with job_for(run_dir, device=DEVICE, **config) as job:
        result = job.train(model_fn=lambda: parts()[0], optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=0.05),
                           loss_fn=lambda model, batch: F.mse_loss(model(batch[:, :5]), batch[:, 5:]),
                           dataset=dataset, steps=steps, hooks=Hooks(on_model=on_model,
                                                                     on_step=lambda r: trained.append(r.step)))
        assert job.device == torch.device(WANT)
    assert result.ok, result.error
    return result, trained


@pytest.mark.timeout(120)
def test_overlapped_exchange_and_background_checkpoints_on_the_gpu(tmp_path):
    """`ft.train()` on the device with the exchange overlapped with backward (each gradient copied to the
    host buffer by its hook) ends at the same parameters as one exchange after backward; a job resumed
    from its background-written checkpoint (staged off the device) trains on to the same parameters."""
    plain, _ = train_mlp(tmp_path / "plain", 8)
    overlapped, _ = train_mlp(tmp_path / "overlap", 8, overlap_bucket_bytes=64)
    assert overlapped.param_hash == plain.param_hash
    ckpt = CheckpointConfig(every_steps=3)
    train_mlp(tmp_path / "ckpt", 5, checkpoint=ckpt)
    resumed, trained = train_mlp(tmp_path / "ckpt", 8, checkpoint=ckpt)
    assert trained[0] == 3 and trained[-1] == 7  # restored after step 3, then steps 3..7 on the device
    assert resumed.param_hash == plain.param_hash


@pytest.mark.timeout(60)
def test_peer_shapes_of_a_gpu_state_before_its_first_step_are_its_layout_after_it():
    """A restarted replica on the GPU sizes its (host) receive buffer by the meta step of its optimizer;
    a fused optimizer has no meta kernels and falls back to its tensors (the fetch allocates its own)."""
    from ftrun.catchup.snapshot import describe
    from ftrun.train.state import ReplicaState

    for fused in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        state = ReplicaState(model=model, optimizer=opt)
        shapes, before = state.peer_shapes()(), state.tensors()
        assert not opt.state
        model(torch.randn(8, 16, device=DEVICE)).sum().backward()
        opt.step()
        if fused and shapes.keys() == before.keys():
            continue  # the meta step was refused: a size hint only
        assert describe(shapes, shape_only=True) == describe(state.tensors()), fused
