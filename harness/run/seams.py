"""What the emulator plugs into the real trainer's seams besides the Env: shape-only catch-up payloads
and snapshots, and a checkpoint writer to the mock object store.

- `ShapePayloads`: the catch-up client's destination is a ShapeOnlyGrads of the state's size (no
  bytes), its tensors meta tensors, its CRC32 0 (the shape store's manifest says 0 too): the real fetch
  protocol (ftrun.catchup.fetcher over ftrun.catchup.net_transport) moves modeled bytes.
- `ShapeSnapshotStore`: the serving side. `publish` lays the (meta) state out with the real
  ftrun.catchup.manifest code and answers `lookup` with the same pure `availability` rule as the real
  SnapshotStore; the published buffer is shape-only, so a shard goes out as a ShapeOnly bulk frame of
  its real size and the modeled network charges it.
- `ObjectStoreCheckpointer`: the elected writer's checkpoint: the modeled state bytes written to the
  mock object store (latency + bandwidth) and then an atomic manifest with the ledger (the commit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ftrun.catchup.manifest import DTYPES, Layout, Manifest, encode_manifest, layout_for
from ftrun.catchup.snapshot import Availability, Published, availability, check_metadata, describe
from ftrun.data.loader_state import LoaderState
from ftrun.data.progress import DataProgress
from ftrun.data.sampler import DataLayout
from harness.run.catchup_forward import ForwardingCatchup
from mocks.compute import ShapeOnlyGrads, ShapeOnlyTrainCompute


class ShapePayloads:
    def destination(self, nbytes: int) -> ShapeOnlyGrads:
        return ShapeOnlyGrads(nbytes)

    def views(self, dest: Any, layout: Layout) -> dict[str, torch.Tensor]:
        return {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype], device="meta") for t in layout.tensors}

    def crc32(self, buf: Any) -> int:
        return 0

    def prepare(self, env: Any, size: Callable[[], int]) -> None:
        """Shape-only fetches have no receive buffer to prepare."""

    def release(self) -> None:
        """Nothing was prepared."""


@dataclass(frozen=True)
class _ShapeBuffer:
    mem: ShapeOnlyGrads


class ShapeSnapshotStore:
    """A SnapshotStore for meta-tensor states (see the module docstring). Threading: as SnapshotStore."""

    def __init__(self, *, max_shard_bytes: int, on_change: Callable[[], None] | None = None) -> None:
        self._max_shard_bytes, self._on_change = max_shard_bytes, on_change
        self._layouts: dict[tuple, Layout] = {}
        self._ready: Published | None = None
        self._newest: int | None = None
        self._retired: int | None = None
        self.generation = 0
        self.num_published = 0

    @property
    def newest(self) -> int | None:
        return self._newest

    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Any = ()) -> None:
        """A shape-only snapshot of `state` (nothing is copied, so nothing is borrowed either)."""
        entries = tuple(sorted(describe(state, shape_only=True)))
        layout = self._layouts.get(entries)
        if layout is None:
            layout = self._layouts[entries] = layout_for(entries, self._max_shard_bytes)
        manifest = Manifest(step, layout, (0,) * len(layout.shards), json.loads(json.dumps(metadata or {})))
        self.generation += 1
        self._newest = step
        self._ready = Published(step, self.generation, manifest, encode_manifest(manifest),
                                _ShapeBuffer(ShapeOnlyGrads(layout.total_bytes)))  # type: ignore[arg-type]
        self.num_published += 1
        self._changed()

    def check(self, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
        """Raises CatchupUsageError as SnapshotStore.check, meta tensors allowed."""
        check_metadata(metadata or {})
        describe(state, shape_only=True)

    def reserve(self, state: Mapping[str, torch.Tensor], *, borrow: Any = ()) -> None:
        """Shape-only snapshots have no buffer to prepare."""

    def retire(self, step: int) -> None:
        if self._ready is None or self._ready.step != step:
            return
        self.generation += 1
        self._ready, self._retired = None, step
        self._changed()

    def lookup(self, step: int) -> tuple[Availability, Published | None]:
        ready = self._ready
        a = availability(step, ready=ready.step if ready else None, pending=None, newest=self._newest,
                         retired=self._retired)
        return a, (ready if a.kind == "serve" else None)

    def close(self) -> None:
        self._ready = None
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()


class ObjectStoreCheckpointer:
    """The Checkpointer seam (ftrun.train.checkpointer) over a mock object store: `state_bytes` of
    modeled data, then `ckpt/step-N/manifest.json` (the commit point: a checkpoint without it is
    incomplete). Staging (asynchronous checkpoints) copies `state_bytes` to host memory at `stage_bytes_per_s`
    on `clock`. `restore` finds none (an emulated job starts fresh)."""

    def __init__(self, *, storage: Any, state_bytes: int, clock: Any, stage_bytes_per_s: float,
                 prefix: str = "ckpt") -> None:
        self.storage, self.state_bytes, self.prefix = storage, state_bytes, prefix
        self.clock, self.stage_bytes_per_s = clock, stage_bytes_per_s
        self.committed: list[int] = []

    def restore(self, layout: DataLayout, replica_ids: tuple[str, ...]) -> tuple[int, LoaderState] | None:
        return None

    def save(self, step: int, loader_state: LoaderState) -> None:
        self._write(step, loader_state)

    def in_flight(self, local: bool) -> bool:
        return local  # the replica's leader is its only writer here

    def stage(self, step: int, loader_state: LoaderState) -> Callable[[], None]:
        """The host copy now (the step waits for it); the write, charged to the store, when called."""
        self.clock.sleep(self.state_bytes / self.stage_bytes_per_s)
        return lambda: self._write(step, loader_state)

    def _write(self, step: int, loader_state: LoaderState) -> None:
        self.storage.charge_write(self.state_bytes)  # the model and optimizer shards
        manifest = {"step": step, "state_bytes": self.state_bytes, "loader_state": loader_state.to_dict()}
        self.storage.write_atomic(f"{self.prefix}/step-{step:08d}/manifest.json", json.dumps(manifest).encode())
        self.committed.append(step)


class FirstStepCosts:
    """What a restarted incarnation's first steps cost beyond the modeled step (paper §5): `batch_s` on its
    first step, whether it computes or heals with a zero gradient; `extra_s` (the first-step initialization
    not done before check-in) on its first forward, which for a replica that heals first is the step after
    the healing one. `take` returns what a step owes and marks it paid."""

    def __init__(self, *, batch_s: float, extra_s: float) -> None:
        self.batch_s, self.extra_s = batch_s, extra_s

    def take(self, *, forward: bool) -> float:
        due, self.batch_s = self.batch_s, 0.0
        if forward:
            due, self.extra_s = due + self.extra_s, 0.0
        return due


class EmulatedCompute(ShapeOnlyTrainCompute):
    """One emulated rank's shape-only compute with the job's timing effects: a restarted replica's
    first-step costs (`FirstStepCosts`), step jitter and straggler hosts (`extra_s(step)`).
    A mirroring rank (folded rings) computes in zero time: its lead's compute is inside the lead's
    exchange it waits for. A lead's modeled step compute (step_time_s) is its process's busy time
    (env.clock.charge: what the Env's clock.cpu() reads, as a real rank's phase events do)."""

    def __init__(self, *, lead: bool, first_extra_s: float, first_batch_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lead = lead
        self._first = FirstStepCosts(batch_s=first_batch_s, extra_s=first_extra_s)

    def forward_backward(self, step: int = 0, samples: Any = None, seed: int | None = None) -> float:
        if not self._lead:
            return 0.0
        if due := self._first.take(forward=True):
            self.env.clock.sleep(due)
        self.env.clock.charge(self._base_s)  # the modeled compute is busy time; its extras (skews, contention) wait
        return super().forward_backward(step, samples, seed)

    def zero_grads(self) -> None:
        due = self._first.take(forward=False)
        if self._lead and due:
            self.env.clock.sleep(due)  # its first batch loads before it enters the all-reduce


class TimedCatchup(ForwardingCatchup):
    """A CatchupService that reports each fetch to the emulator: `on_fetch(t_start, t_end)` (the
    decision arrived at t_start: catching up is not part of get_quorum), and slows it as the slow-fetch
    fault in force when it starts says (`slow()`: (factor, delay_s) or None): (factor - 1) x the modeled
    fetch, plus delay_s. `extra_s` is charged once per fetch: the
    real client and server's per-request work the modeled transport does not do (the profile's
    train.catchup_fetch_extra_s, from `ftrun calibrate`)."""

    def __init__(self, service: Any, env: Any, *, on_fetch: Callable[[float, float], None],
                 slow: Callable[[], tuple[float, float] | None] | None = None, extra_s: float = 0.0) -> None:
        super().__init__(service)
        self._env, self._on_fetch, self._slow, self._extra_s = env, on_fetch, slow, extra_s

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        t0 = self._env.clock.now()
        slow = self._slow() if self._slow is not None else None
        try:
            result = self._s.fetch(step, sources)
            if self._extra_s:
                self._env.clock.sleep(self._extra_s)
            if slow is not None:
                factor, delay = slow
                self._env.clock.sleep((factor - 1.0) * (self._env.clock.now() - t0) + delay)
            return result
        finally:
            self._on_fetch(t0, self._env.clock.now())


class FoldedProgress(DataProgress):
    """A rank's DataProgress whose commits are shared by the replica incarnation's ranks: they all
    apply the same step with the same contributors to the same ledger (the trainer's contract), so
    the first rank computes the next ledger and its commit record and the others take them from
    `cache` (one dict per incarnation). Everything else is the real DataProgress."""

    def __init__(self, *, replica_id: str, state: LoaderState, cache: dict) -> None:
        super().__init__(replica_id=replica_id, state=state)
        self._cache = cache

    def commit(self, *, writer: str) -> Any:
        key = (self.state.lineage, self._step, self._contributors, writer)
        hit = self._cache.get(key)
        if hit is None:
            record = super().commit(writer=writer)
            self._cache[key] = (self.state, record)
            return record
        self.state, record = hit
        self._step = None
        return record


class OverheadExchange:
    """A GradientExchange that pays the real all-reduce's measured overhead (ftar.sync_overhead_s)
    after the modeled ring, then this rank's late wake from it (`late_s(quorum)`: train.rank_exchange_skew_s's draw,
    before the commit vote, which waits for the replica's later rank): a peer that dies meanwhile is still seen in
    the ring, as in a real run, where the ranks wait inside the all-reduce. A failed all-reduce pays neither: its
    error reaches the trainer when the dead peer's reset arrives (real 3 x 1 and 3 x 2 runs: every survivor's error
    came within a few ms of the lighthouse's loss of the killed replica's connection, 11-81 ms after the kill, while
    the overhead was 5-15 ms; the reset's delay is network.crash_fin_delay_s, a killed rank's teardown).
    `overhead_s()`: the current overhead (it depends on the replicas up). `retry_s(quorum)`: what the rank's CPU work
    adds to this all-reduce beyond a step's (a retry's after a peer died: train.rank_retry_cpu_s)."""

    def __init__(self, exchange: Any, env: Any, overhead_s: Callable[[], float],
                 late_s: Callable[[Any], float] | None = None, retry_s: Callable[[Any], float] | None = None) -> None:
        object.__setattr__(self, "_x", exchange)
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_overhead_s", overhead_s)
        object.__setattr__(self, "_late_s", late_s)
        object.__setattr__(self, "_retry_s", retry_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._x, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._x, name, value)

    def average(self, quorum: Any, grads: Any, **kwargs: Any) -> None:
        self._x.average(quorum, grads, **kwargs)
        extra = (self._overhead_s() + (self._late_s(quorum) if self._late_s is not None else 0.0)
                 + (self._retry_s(quorum) if self._retry_s is not None else 0.0))
        if extra:
            self._env.clock.sleep(extra)
