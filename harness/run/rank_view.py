"""What an emulated rank (harness.run.rank) sees of its job and of its replica's incarnation: the parts of
harness.run.job's EmulatedJob and Incarnation it uses, as protocols. Below both modules, so job can import
rank's entry point without rank importing job (the job <-> rank import cycle is gone)."""

from __future__ import annotations

from random import Random
from typing import Any, Protocol

from ftrun.catchup.config import CatchupConfig
from ftrun.config import FtarConfig, Timeouts
from ftrun.data.sampler import DataLayout
from harness.profile import Profile
from harness.run.options import JobOptions
from harness.run.record import Recorder


class RankIncarnation(Protocol):
    """One start of one replica (harness.run.job.Incarnation)."""

    replica: int
    number: int
    replica_id: str
    world_size: int
    ranks: tuple[int, ...]  # the ranks it runs, by tree index (all, or the represented ones with rank folding)
    tree_extra_s: float  # rank folding: latency each tree pass adds (harness.run.fold.FoldedComm)
    envs: list[Any]
    mirror: Any  # harness.run.fold.Mirror, or None when not folded
    listeners: list[Any]
    addrs: list[str]
    prewired: list[tuple[Any, list[Any]]] | None
    ledgers: dict


class RankJob(Protocol):
    """The emulated job (harness.run.job.EmulatedJob) as its ranks use it."""

    profile: Profile
    options: JobOptions
    timeouts: Timeouts
    token: str
    recorder: Recorder
    shapes: Any
    shape_state: Any
    state_bytes_per_rank: int
    rng: Random
    replica_ids: tuple[str, ...]
    data_layout: DataLayout
    storage: Any
    checkpoint_storage: Any
    ftar_config: FtarConfig
    catchup_config: CatchupConfig
    mirror_timeout_s: float
    lighthouse_addr: str
    finished: bool
    diagnosis: Any
    ring_board: Any  # harness.run.ring_model.RingBoard with analytic rings, else None

    def ring_cost(self, host: str) -> Any: ...

    def kernels(self) -> Any: ...

    def contention_extra_s(self) -> float: ...

    def ftar_overhead_s(self) -> float: ...

    def replica_compute_extra_s(self) -> float: ...

    def jitter_s(self, replica: int, step: int) -> float: ...

    def start_skew_s(self, replica: int, rank: int, n: int | str) -> float: ...

    def exchange_skew_s(self, replica: int, rank: int, quorum: Any) -> float: ...

    def compute_extra_s(self, inc: Any, rank: int, step: int) -> float: ...

    def slow_fetch(self) -> tuple[float, float] | None: ...

    def committed(self, inc: Any, step: int) -> None: ...

    def step_started(self, inc: Any, step: int) -> None: ...

    def step_forward(self, inc: Any, step: int) -> None: ...

    def entering_ftar(self, inc: Any, step: int) -> None: ...

    def leader_event(self, inc: Any, event: dict) -> None: ...

    def rank_failed(self, inc: Any, rank: int, error: BaseException, unexpected: bool = False) -> None: ...

    def rank_exited(self, inc: Any, rank: int, ok: bool) -> None: ...
