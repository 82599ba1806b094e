"""What a training job is configured with (`FTConfig`), its instrumentation (`Hooks`), what `train` returns
(`TrainResult`), and the view of a job that wiring a rank needs (`RankJob`): below both `ftrun.train.api`
(which re-exports FTConfig, Hooks and TrainResult; so does its emulated shadow, mocks.train_api) and
`ftrun.train.wiring`, so neither imports the other's module."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import FtarConfig, Timeouts
from ftrun.env.admission import ListenLimits
from ftrun.env.base import Env
from ftrun.ftar.kernels import Kernels
from ftrun.launch.worker_env import WorkerSpec
from ftrun.replica.comm import ReplicaComm
from ftrun.train.device import check_device_name
from ftrun.train.events import print_event
from ftrun.train.lr import LRConfig
from ftrun.train.trainer import PhaseFn, StepResult


@dataclass(frozen=True, kw_only=True)
class FTConfig:
    """batch_size: samples per rank per step. seed: model init, data order and per-step RNG.
    checkpoint: persistent checkpoints under run_dir/ckpt, the runtime's ftrun.checkpoint.policy.CheckpointConfig
    (every_steps, keep); None: off. Each rank of a sharded replica writes its shards. run_dir: audit and
    loader_state files (default: the launcher's, else a temp folder).
    ftar: the FTAR engine's config (ftrun.config.FtarConfig: chunk_bytes S, num_chunks C, transport), by
    default the engine's own (4 MiB chunks, 4 in flight; with 256 KiB x 2 the 3-replica launch of
    benchmarks/catchup_launch.py stepped in 97-114 ms instead of 84-94); its timeout_s is
    timeouts.ftar_timeout_s (set it there: a different ftar.timeout_s raises).
    catchup: the catch-up server's and client's config (ftrun.catchup.config.CatchupConfig: max_shard_bytes,
    max_source_failures, wait_limit_s (paper §6.1; None: timeouts.ftar_timeout_s)); its timeouts are
    `timeouts` (a different catchup.timeouts raises) and its bind/advertise_host the launcher's network.
    reshard_after_forward: FSDP2's (False trades memory for one all-gather less per step).
    num_threads: torch intra-op threads per rank (None: torch's default). events: JSON lines on stdout.
    phase_events: besides them, every rank prints {"event": "phase", "t", "phase", "step", "rank"} at each phase
    boundary of a step (ftrun.train.trainer's PHASES; `ftrun calibrate SCRIPT` reads where a step's time goes
    from them); FTRUN_PHASE_EVENTS=1 in the environment turns it on (init_from_env).
    overlap_bucket_bytes: exchange gradients in buckets of about this many bytes during backward
    (ftrun.train.overlap; one rank per replica, `train` only); None: one exchange after backward.
    device: where each rank trains (ftrun.train.device): "cpu", "cuda" (the rank's GPU, cuda:{slot % GPUs},
    slot: its place among the ranks started on its host) or "cuda:N"; the model, optimizer state and
    batches live there, the cross-replica FTAR reduces a host copy of the gradients. A CUDA device takes
    one rank per replica.
    net_limits: caps on each of the rank's listeners (FTAR ring, catch-up over env.net): connections not past
    their first message (a new one beyond max_pending closes the oldest of them), live connections, and the
    size of a first message (ftrun.env.admission)."""

    batch_size: int = 8
    seed: int = 0
    lr: LRConfig = field(default_factory=LRConfig)
    checkpoint: CheckpointConfig | None = None
    run_dir: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_retries: int = 10
    ftar: FtarConfig = field(default_factory=FtarConfig)
    catchup: CatchupConfig = field(default_factory=CatchupConfig)
    reshard_after_forward: bool = True
    num_threads: int | None = 1
    events: bool = True
    phase_events: bool = False
    log_level: str = "WARNING"
    overlap_bucket_bytes: int | None = None
    device: str = "cpu"
    net_limits: ListenLimits = field(default_factory=ListenLimits)

    def __post_init__(self) -> None:
        if not isinstance(self.net_limits, ListenLimits):
            raise ValueError(f"FTConfig.net_limits must be a ListenLimits, got {self.net_limits!r}")
        if self.batch_size < 1:
            raise ValueError(f"FTConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.ftar.timeout_s != self.timeouts.ftar_timeout_s:
            if self.ftar.timeout_s != FtarConfig.timeout_s:
                raise ValueError(f"FTConfig.ftar.timeout_s ({self.ftar.timeout_s}) differs from "
                                 f"timeouts.ftar_timeout_s ({self.timeouts.ftar_timeout_s}): set it in timeouts")
            object.__setattr__(self, "ftar", replace(self.ftar, timeout_s=self.timeouts.ftar_timeout_s))
        if self.seed < 0 or self.max_retries < 0:
            raise ValueError(f"FTConfig.seed and max_retries must be >= 0, got {self.seed}, {self.max_retries}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise ValueError(f"FTConfig.checkpoint must be a CheckpointConfig or None, got {self.checkpoint!r}")
        self._nest_catchup()
        b = self.overlap_bucket_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"FTConfig.overlap_bucket_bytes must be an int >= 1 or None, got {b!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"FTConfig.num_threads must be >= 1 or None, got {self.num_threads}")
        check_device_name(self.device)

    def _nest_catchup(self) -> None:
        """catchup as the job runs it: with the job's timeouts; where it listens is the launcher's to say."""
        c = self.catchup
        if not isinstance(c, CatchupConfig):
            raise ValueError(f"FTConfig.catchup must be a CatchupConfig, got {c!r}")
        defaults = CatchupConfig()
        if (c.bind, c.advertise_host) != (defaults.bind, defaults.advertise_host):
            raise ValueError(f"FTConfig.catchup.bind/advertise_host ({c.bind!r}, {c.advertise_host!r}) are set by "
                             f"the launcher's network (FTRUN_BIND_HOST / FTRUN_ADVERTISE_HOST): leave them unset")
        if c.timeouts != self.timeouts:
            if c.timeouts != defaults.timeouts:
                raise ValueError("FTConfig.catchup.timeouts differs from FTConfig.timeouts: set them in timeouts")
            object.__setattr__(self, "catchup", replace(c, timeouts=self.timeouts))


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """Instrumentation and fault injection (tests, ftrun.train.ft_worker). kernels: FTAR kernels
    (default: CPU, float32 warmed up). on_model: called with the (sharded) model before the optimizer
    is built. on_phase: trainer phase boundaries. catchup_fault: the catch-up server's fault hook.
    on_step: after every step, with its StepResult."""

    kernels: Kernels | None = None
    on_model: Callable[[torch.nn.Module], None] | None = None
    on_phase: PhaseFn | None = None
    catchup_fault: Callable[[int, int], Any] | None = None
    on_step: Callable[[StepResult], None] | None = None


class RankJob(Protocol):
    """This rank's membership in the job, as the wiring reads it (`ftrun.train.api.FTJob` is one)."""

    config: FTConfig
    spec: WorkerSpec
    env: Env
    comm: ReplicaComm
    device: torch.device  # where the model is (ftrun.train.device)

    def emit(self, event: dict) -> None: ...


class JobBasics:
    """What an FTJob answers from its `spec` (WorkerSpec) and `config` (FTConfig) alone: the real one
    (ftrun.train.api) and its emulated shadow (mocks.train_api) both subclass it."""

    config: FTConfig
    spec: WorkerSpec

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def max_steps(self) -> int | None:
        """The launcher's --steps (None when it set none)."""
        return self.spec.max_steps

    def emit(self, event: dict) -> None:
        """Print `event` on stdout (the launcher reads it) when FTConfig.events is set."""
        if self.config.events:
            print_event(event)


@dataclass(frozen=True)
class TrainResult:
    ok: bool  # False: the replica failed (ReplicaError) and must be restarted
    step: int  # steps committed (or healed to) by this replica
    param_hash: str  # fingerprint of this rank's parameter bytes at the end (ftrun.train.fingerprint)
    loader_state: dict  # the ledger at the end (JSON form)
    error: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def steps_target(steps: int | Callable[[], int] | None, launcher_steps: int | None) -> Callable[[], int]:
    """train(steps=...) as a callable giving the step count: `steps` (a count or a callable), else the
    launcher's. Raises ValueError when neither is set or a count is negative."""
    if steps is None:
        if launcher_steps is None:
            raise ValueError("train(steps=...) is required when the launcher set no step count (FTRUN_MAX_STEPS)")
        steps = launcher_steps
    if callable(steps):
        return steps
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    return lambda: steps
