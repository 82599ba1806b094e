"""Scale profiles: one typed, validated config for an emulated (or planned) training cluster.

A profile is a TOML file in scale_profiles/ read with tomllib into these frozen keyword-only
dataclasses. Every section checks itself in __post_init__ and raises ValueError naming the bad field;
the loader prefixes the section ("[ftar.engine] FtarConfig.num_chunks must be >= 1, got 0") and rejects unknown
keys. Runtime configs are nested as they are, not renamed: `[timeouts]` is ftrun.config.Timeouts,
`[ftar.engine]` ftrun.config.FtarConfig, `[catchup]` ftrun.catchup.config.CatchupConfig and `[checkpoint]`
ftrun.checkpoint.policy.CheckpointConfig, exactly what the emulated runtime is given.
Dotted overrides (`apply_overrides(p, ["ftar.engine.num_chunks=8", "replicas=4"])`) rebuild the profile
through the same loader, so they are validated the same way.

Top-level keys: name, description, seed, replicas, ranks_per_replica. Tables: [topology] [network]
[model] [train] [timeouts] [ftar] [catchup] [checkpoint] [storage] [failures] (events: fault specs) [spares]
[scheduler] [emulation] [calibration] (+ [[calibration.values]], written by `ftrun calibrate`: each
says how and when a key's value was measured). Every table is optional and has defaults.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal

# The [model] and [scheduler] sections and the field checks live in mocks.config, below both mocks and
# harness; they are re-exported here so a profile's types come from one place.
from ftrun import faultspec
from ftrun.catchup.config import CatchupConfig
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import FtarConfig, Timeouts
from mocks.config import DTYPE_BYTES, ModelConfig, SchedulerConfig  # noqa: F401
from mocks.config import non_negative as _non_negative, one_of as _one_of, positive as _positive, require as _check

PROFILE_DIR = Path(__file__).resolve().parents[1] / "scale_profiles"


class HopClass(IntEnum):
    """How far apart two hosts are; latency grows with the class (paper §2.1). Defined here, where
    NetworkConfig keys its latency factors by it; harness.topology computes it for a pair of hosts."""

    SAME_HOST = 0
    SAME_RACK = 1
    OTHER_RACK = 2  # same AI zone, another rack (through the CTSW)
    OTHER_ZONE = 3  # same building, another AI zone (through the ATSW; oversubscribed)
    OTHER_BUILDING = 4  # across the inter-DC mesh (oversubscribed like cross-zone)

    @property
    def crosses_zone(self) -> bool:
        return self >= HopClass.OTHER_ZONE


def hosts_per_replica(ranks_per_replica: int, gpus_per_host: int) -> int:
    return -(-ranks_per_replica // gpus_per_host)


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    gpus_per_host: int = 8
    hosts_per_rack: int = 4
    racks_per_zone: int = 64
    zones_per_building: int = 4
    buildings: int = 1

    def __post_init__(self) -> None:
        _positive(self, "gpus_per_host", "hosts_per_rack", "racks_per_zone", "zones_per_building", "buildings")

    @property
    def capacity_hosts(self) -> int:
        return self.hosts_per_rack * self.racks_per_zone * self.zones_per_building * self.buildings


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """One-way latency = base_latency_us x the hop class's factor (paper §2.1: rack 1x, other rack 7x,
    other zone 15x, other building 30x). Bandwidth: each host's NIC serializes its frames at
    host_nic_gbps; frames that cross a zone also pass the source zone's uplink and the destination
    zone's downlink, each worth (hosts in zone x host_nic_gbps / cross_zone_oversubscription).
    A send blocks while its host's NIC backlog exceeds send_buffer_kib (see harness.engine.linkmodel)."""

    base_latency_us: float = 10.0
    same_host_factor: float = 0.2
    same_rack_factor: float = 1.0
    other_rack_factor: float = 7.0
    other_zone_factor: float = 15.0
    other_building_factor: float = 30.0
    host_nic_gbps: float = 400.0
    loopback_gbps: float = 80.0
    cross_zone_oversubscription: float = 2.8
    frame_overhead_bytes: int = 64
    send_buffer_kib: int = 4096
    latency_jitter: float = 0.0  # uniform +-fraction of latency, from the world's seeded RNG
    # A crashed process's connections are reset this long after the crash (the OS tearing the process
    # down; `ftrun calibrate` measures SIGKILL -> the peer's EOF). 0: at once (one latency later).
    crash_fin_delay_s: float = 0.0
    # Per tree pass of a collective over a replica's comm (the decision's broadcast, the commit vote's
    # all-reduce), what a real one costs beyond the modeled network (gloo's own work and wake-ups on a loaded
    # machine: `ftrun calibrate SCRIPT --script-ranks K` measures the script's commit vote). 0: none.
    replica_collective_pass_s: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "base_latency_us", "host_nic_gbps", "loopback_gbps", "send_buffer_kib")
        _non_negative(self, "same_host_factor", "frame_overhead_bytes", "latency_jitter", "crash_fin_delay_s",
                      "replica_collective_pass_s")
        _check(self.cross_zone_oversubscription >= 1, "cross_zone_oversubscription", ">= 1",
               self.cross_zone_oversubscription)
        _check(self.latency_jitter < 1, "latency_jitter", "< 1", self.latency_jitter)
        factors = [self.same_rack_factor, self.other_rack_factor, self.other_zone_factor, self.other_building_factor]
        _check(all(f > 0 for f in factors) and factors == sorted(factors), "*_factor",
               "positive and non-decreasing from same_rack to other_building", factors)

    def latency_s(self, hop: HopClass) -> float:
        factor = (self.same_host_factor, self.same_rack_factor, self.other_rack_factor,
                  self.other_zone_factor, self.other_building_factor)[hop]
        return self.base_latency_us * 1e-6 * factor

    @property
    def host_nic_bytes_per_s(self) -> float:
        return self.host_nic_gbps * 1e9 / 8

    @property
    def loopback_bytes_per_s(self) -> float:
        return self.loopback_gbps * 1e9 / 8


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    step_compute_s: float = 1.0
    steps: int = 20
    min_replicas: int = 1
    lr_intervention: Literal["none", "linear", "sqrt"] = "sqrt"
    # The paper's "first-step effect" of a restarted replica (checkpoint re-creation, dataloader
    # init, JIT). With warmup_before_checkin (paper §5's mitigation) it runs before the replica checks
    # in, hidden from the others; without, it lengthens the replica's first trained step and stalls them.
    first_step_extra_s: float = 0.0
    warmup_before_checkin: bool = True
    first_batch_s: float = 0.0  # loading the first batch: between check-in and the first FTAR (paper §5)
    step_jitter: float = 0.0  # uniform +-fraction of step_compute_s per step
    # Per catch-up fetch, on top of the modeled network: the real client/server's per-request work
    # (HTTP, manifest, CRC) that the emulated transport does not do (`ftrun calibrate` measures it).
    catchup_fetch_extra_s: float = 0.0
    # The job's rank processes share this many CPU cores (one machine running them all, as `ftrun launch`
    # does; `ftrun calibrate` measures the effective figure): while N ranks are up, a step's compute takes
    # max(1, N / shared_cpu_cores) x step_compute_s. 0: every rank has CPUs of its own.
    shared_cpu_cores: float = 0.0
    # Per step, between a step's end (a commit, or an aborted attempt: a real rank's loop runs either way) and the
    # next quorum request, the script's own work the emulator does not model (the step event and its parameter
    # hash, logging, wake-ups): `ftrun calibrate SCRIPT` measures it after commits.
    step_bookkeeping_s: float = 0.0
    # Per step, the compute a rank's forward and backward gain from a second replica up beyond the contention
    # above (the other replicas' ranks computing on the same CPUs); with R up, R / 2 of it (as
    # ftar.sync_overhead_s). `ftrun calibrate SCRIPT` measures it: the script's compute phase as 2 replicas
    # against 1. 0: none.
    replica_compute_extra_s: float = 0.0
    # Per rank and step, a late start drawn from an exponential distribution of this mean (seeded by the job's
    # seed, the replica, rank and step; a leader's after its quorum decision, before its quorum event, the other
    # ranks' before their compute): the ranks of a job that oversubscribes its machine's CPUs wake for a step at
    # different times, and every collective waits for the latest of them (the slowest of R x K).
    # `ftrun calibrate SCRIPT` measures it: the spread of the ranks' "started" phases in a step of its 2-replica
    # run; with R replicas up the emulator draws with R / 2 of it (more processes wake on the shared CPUs). 0:
    # identical ranks.
    rank_start_skew_s: float = 0.0
    # Per rank and step, a late wake from the cross-replica all-reduce, drawn as above (seeded by the job's seed,
    # the replica, rank, quorum and step; only when the all-reduce had peers): after the ring ends, each rank's
    # process wakes on the oversubscribed CPUs at its own time, so a replica's commit vote waits for the later of
    # its ranks and the replicas' commits (and their next quorum requests) spread. `ftrun calibrate SCRIPT`
    # measures it: the spread of the leaders' commits of a step in its 2-replica run (R / 2 of it with R up, as
    # above). 0: the replicas commit together.
    rank_exchange_skew_s: float = 0.0
    # How the waits for a CPU measured with 2 replicas up (the two skews above) grow with R replicas up: "replicas",
    # R / 2 of each; "queue", each plus half the growth of a rank's wait per step in the finite-source CPU queue
    # (harness.run.cpu_queue.wait_growth x rank_cpu_step_s) of the live ranks against the rank_cpu_share_ranks
    # processes of the run that measured them, each busy rank_cpu_share of its time, on shared_cpu_cores cores (needs
    # all four; else as "replicas"). ftar.sync_overhead_s and replica_compute_extra_s take R / 2 either way.
    shared_cpu_model: Literal["replicas", "queue"] = "replicas"
    # A rank process's busy share (its CPU time over wall time, from its phase events' `cpu`) in `ftrun calibrate
    # SCRIPT`'s 2-replica run, and that run's rank processes (2 x its ranks per replica). 0: not measured.
    rank_cpu_share: float = 0.0
    rank_cpu_share_ranks: float = 0.0
    # A rank process's CPU seconds per step in that run (the phase events' `cpu`). 0: not measured.
    # With all three measured and shared_cpu_cores set, a step is never shorter than the shared CPUs allow: N live
    # ranks x rank_cpu_step_s over the rank_cpu_share x rank_cpu_share_ranks cores a synchronous job keeps busy
    # (harness.run.job.EmulatedJob.cpu_floor_period_s; what falls short is charged to each all-reduce). And where
    # that run had a core per rank (rank_cpu_share_ranks <= round(shared_cpu_cores)) but the job has more ranks
    # than cores, the two skews above are at least the burst a rank wakes for over ln 2 (EmulatedJob.queued_wake_s).
    rank_cpu_step_s: float = 0.0
    # What a rank's CPU in its all-reduce rises by from 1 replica to 2 (`ftrun calibrate SCRIPT`'s two runs, their
    # phase events' `cpu` from exchange to before_commit): the CPU of its ring's traffic with 2 replicas up. A rank of
    # R replicas sends and receives 2 (R - 1) / R of its gradient, so the CPU floor takes rank_cpu_step_s plus this x
    # (2 (R - 1) / R - 1) per rank and step (EmulatedJob.rank_cpu_step_s). 0: not measured (the floor takes
    # rank_cpu_step_s at any R).
    rank_ring_cpu_s: float = 0.0
    # What a rank's CPU rises by in the step it retries after a replica of its quorum died, over its next steps' (real
    # 3 and 4 x 1 and 2 runs: 1.1-1.8 ms): its own retry work (`ftrun calibrate SCRIPT`'s 2-replica run: r0's retries
    # into a ring of 1, the median over the kills) plus the FTAR ring it rebuilds with its peers
    # (measured.ftar_rebuild_cpu_s: two real engines). The emulator charges it after that step's all-reduce. 0: not
    # measured.
    rank_retry_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "step_compute_s", "steps", "min_replicas")
        _non_negative(self, "first_step_extra_s", "first_batch_s", "step_jitter", "catchup_fetch_extra_s",
                      "shared_cpu_cores", "step_bookkeeping_s", "replica_compute_extra_s",
                      "rank_start_skew_s", "rank_exchange_skew_s", "rank_cpu_share_ranks",
                      "rank_cpu_step_s", "rank_ring_cpu_s", "rank_retry_cpu_s")
        _one_of(self, "lr_intervention", ("none", "linear", "sqrt"))
        _one_of(self, "shared_cpu_model", ("replicas", "queue"))
        _check(0 <= self.rank_cpu_share <= 1, "rank_cpu_share", "in [0, 1]", self.rank_cpu_share)
        _check(float(self.rank_cpu_share_ranks).is_integer(), "rank_cpu_share_ranks", "a whole number of processes "
               "(0: not measured)", self.rank_cpu_share_ranks)
        _check(self.step_jitter < 1, "step_jitter", "< 1", self.step_jitter)


@dataclass(frozen=True, kw_only=True)
class FtarSection:
    """[ftar]: the runtime's FTAR engine config as it is (`[ftar.engine]`: ftrun.config.FtarConfig, e.g.
    chunk_bytes = S, num_chunks = C; a bad value raises, nothing is rounded) and what the emulator charges
    for FTAR beyond the modeled network. The engine's timeout_s is the job's, from [timeouts]; its transport
    is the emulator's (socket frames over the modeled network)."""

    engine: FtarConfig = field(default_factory=lambda: FtarConfig(chunk_bytes=8 << 20, num_chunks=4))
    # Throughput of the FTAR kernels (GB/s of payload). 0: the modeled GPU kernels (mocks.ftar_kernels);
    # set (e.g. by `ftrun calibrate`, from the CPU kernels a real run on this machine uses) to charge these.
    kernel_reduce_gb_s: float = 0.0
    kernel_copy_gb_s: float = 0.0
    # Per cross-replica all-reduce, what a real one costs beyond the modeled network and kernels (waiting for
    # the slower peer, the runtime's per-message work and wake-ups: `ftrun calibrate SCRIPT` measures the
    # script as 2 replicas against 1, less what of that rise lands in the compute, train.replica_compute_extra_s).
    # 0: none.
    sync_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self, "kernel_reduce_gb_s", "kernel_copy_gb_s", "sync_overhead_s")
        _check(self.engine.timeout_s == FtarConfig.timeout_s, "engine.timeout_s",
               "left unset (the emulated job's FTAR timeout comes from [timeouts])", self.engine.timeout_s)


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """[storage]: what the emulator's Storage seam (the mock object store for loader_state and the audit log,
    and the remote one for persistent checkpoints) charges per call. When and how persistent checkpoints
    are written is [checkpoint], the runtime's CheckpointConfig."""

    # One atomic write (write, fsync, rename, fsync the folder) of a small file on the ranks' local disk:
    # loader_state every step (`ftrun calibrate` measures ftrun.storage.FileStorage).
    local_write_latency_s: float = 0.001
    # One append to the leader's audit log (an O_APPEND write(2), no fsync: ftrun.data.audit.FileAuditSink).
    local_append_latency_s: float = 0.0
    # One read of a small file on that disk (a loader_state save reads both slots before it writes; `ftrun calibrate`
    # measures ftrun.storage.FileStorage.read: tens of microseconds, from the page cache). 0.2 ms: an assumption.
    local_read_latency_s: float = 0.0002
    # The remote object store persistent checkpoints go to: first-byte latency of a put, and the bandwidth
    # one writer rank's checkpoint is written at (assumption: 200 MB/s per rank, MockObjectStore.remote).
    checkpoint_write_latency_s: float = 0.02
    checkpoint_bandwidth_bytes_per_s: float = 200e6
    # An asynchronous checkpoint's staging: the writer rank's copy of its state to host memory, the only part
    # its step waits for (assumption: 20 GB/s, a device-to-host copy into pinned memory over PCIe Gen4/5).
    checkpoint_stage_bytes_per_s: float = 20e9
    # Whether the lighthouse writes its quorum state to its disk at every decision before handing it out (a
    # lighthouse with a state directory, `ftrun lighthouse --state-dir` as the slurm launcher runs it: a restarted
    # one reloads it). false: it keeps its state in memory, as `ftrun launch`'s in-process lighthouse does
    # (ftrun.launch.job.make_lighthouse), so a decision waits for no write (`ftrun fidelity` emulates that).
    lighthouse_persists: bool = True

    def __post_init__(self) -> None:
        _non_negative(self, "local_write_latency_s", "local_append_latency_s", "local_read_latency_s",
                      "checkpoint_write_latency_s")
        _positive(self, "checkpoint_bandwidth_bytes_per_s", "checkpoint_stage_bytes_per_s")


def _check_event(text: str) -> None:
    """A scripted failure: one fault in the fault grammar (ftrun.faultspec) that the emulator injects."""
    try:
        spec = faultspec.parse(text, "emulate")
    except ValueError as e:
        raise ValueError(f"events: bad fault {text!r}: {e}; {faultspec.usage('emulate')}") from None
    _check(spec.key != ("kill", None) or spec.has("step", "time"), "events", "a kill with step= or time=", text)


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    mode: Literal["none", "scripted", "periodic", "mtbf"] = "none"
    # scripted: faults in the one fault grammar of `--inject` (ftrun.faultspec), e.g. "kill replica=1 step=3"
    events: tuple[str, ...] = ()
    interval_s: float = 60.0  # periodic: a failure every interval_s ...
    interval_jitter_s: float = 0.0  # ... +- uniform jitter
    mtbf_host_hours: float = 5000.0  # mtbf: per-host mean time between failures
    distribution: Literal["exponential", "weibull"] = "exponential"
    weibull_shape: float = 0.7
    replicas_per_failure: int = 1
    protected_replicas: tuple[int, ...] = ()  # never failed (e.g. one replica kept as a metrics anchor)

    def __post_init__(self) -> None:
        _one_of(self, "mode", ("none", "scripted", "periodic", "mtbf"))
        _one_of(self, "distribution", ("exponential", "weibull"))
        _positive(self, "interval_s", "mtbf_host_hours", "weibull_shape", "replicas_per_failure")
        _check(0 <= self.interval_jitter_s <= self.interval_s, "interval_jitter_s",
               f"within [0, interval_s={self.interval_s}]", self.interval_jitter_s)
        _check(self.mode != "scripted" or bool(self.events), "events", "non-empty when mode = 'scripted'", ())
        for event in self.events:
            _check_event(event)

    def cluster_mtbf_s(self, num_hosts: int) -> float:
        """Mean seconds between failures anywhere among num_hosts independent hosts."""
        return self.mtbf_host_hours * 3600.0 / num_hosts


@dataclass(frozen=True, kw_only=True)
class SpareConfig:
    hot_spare_hosts: int = 0  # pre-warmed, promoted with alloc_delay_warm_s
    cold_spare_hosts: int = 0  # idle capacity, allocated with alloc_delay_cold_s

    def __post_init__(self) -> None:
        _non_negative(self, "hot_spare_hosts", "cold_spare_hosts")


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    cpu_charging: bool = True  # charge each task's real CPU time to its host's virtual timeline
    cpu_scale: float = 1.0  # modeled seconds per measured second
    cpu_clock: Literal["thread", "perf"] = "thread"  # thread CPU time (ignores other load) or wall time
    host_cpu_cores: int = 8  # concurrent CPU slices per emulated host
    ftar_detail: Literal["folded", "full"] = "folded"

    def __post_init__(self) -> None:
        _positive(self, "cpu_scale", "host_cpu_cores")
        _one_of(self, "cpu_clock", ("thread", "perf"))
        _one_of(self, "ftar_detail", ("folded", "full"))


@dataclass(frozen=True, kw_only=True)
class CalibratedValue:
    """One measured figure of a calibrated profile: `key` is the profile key it sets (its value must be
    the profile's, in the key's unit), or `measured.NAME` for a figure recorded but not used as a key."""

    key: str
    value: float
    unit: str
    method: str  # how it was measured, in words
    measured_at: str  # UTC, ISO 8601
    samples: int = 1

    def __post_init__(self) -> None:
        _check(bool(self.key), "key", "non-empty", self.key)
        _check(bool(self.method), "method", "non-empty", self.method)
        _check(math.isfinite(self.value), "value", "finite", self.value)
        _positive(self, "samples")


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """Provenance of a profile written by `ftrun calibrate`: where and when, and every measured value."""

    measured_at: str
    host: str = ""
    command: str = ""
    quick: bool = False
    values: tuple[CalibratedValue, ...] = ()

    def __post_init__(self) -> None:
        keys = [v.key for v in self.values]
        _check(len(keys) == len(set(keys)), "values", "one entry per key", sorted(k for k in keys if keys.count(k) > 1))


def _check_catchup(c: CatchupConfig | None) -> None:
    """[catchup] leaves to the emulator what is not the catch-up's own: its timeouts and where it listens."""
    if c is None:
        return
    d = CatchupConfig()
    _check(c.timeouts == d.timeouts, "[catchup] timeouts", "left unset (the job's timeouts are [timeouts])",
           c.timeouts)
    _check((c.bind, c.advertise_host) == (d.bind, d.advertise_host), "[catchup] bind/advertise_host",
           "left unset (the emulator places the servers on its modeled hosts)", (c.bind, c.advertise_host))


def profile_value(profile: "Profile", key: str) -> Any:
    """The value at a dotted key ("ftar.engine.num_chunks", "replicas"). Raises KeyError for an unknown key."""
    node: Any = profile
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            raise KeyError(key)
        node = getattr(node, part)
    return node


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    replicas: int
    ranks_per_replica: int
    description: str = ""
    seed: int = 0
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # [timeouts]: the runtime's Timeouts as they are (ftrun.config.Timeouts: heartbeat_timeout_s, ftar_timeout_s,
    # commit_timeout_s, quorum_timeout_s, ...), what every emulated rank and the lighthouse are given
    timeouts: Timeouts = field(default_factory=Timeouts)
    ftar: FtarSection = field(default_factory=FtarSection)
    # [catchup]: the runtime's CatchupConfig as it is (max_shard_bytes, max_source_failures, wait_limit_s; unset
    # wait_limit_s: timeouts.ftar_timeout_s); its timeouts are [timeouts]. No table: the emulator cuts a rank's
    # state into about 8 shards (harness.run.job.catchup_config_of).
    catchup: CatchupConfig | None = None
    # [checkpoint]: the runtime's CheckpointConfig as it is (every_steps, keep), what FTConfig.checkpoint is;
    # no table: no persistent checkpoints (FTConfig's None)
    checkpoint: CheckpointConfig | None = None
    storage: StorageConfig = field(default_factory=StorageConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    spares: SpareConfig = field(default_factory=SpareConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    calibration: CalibrationConfig | None = None  # written by `ftrun calibrate`

    def __post_init__(self) -> None:
        _positive(self, "replicas", "ranks_per_replica")
        _check(self.train.min_replicas <= self.replicas, "train.min_replicas",
               f"<= replicas={self.replicas}", self.train.min_replicas)
        _check(self.num_hosts <= self.topology.capacity_hosts, "topology",
               f"large enough for {self.num_hosts} hosts (capacity)", self.topology.capacity_hosts)
        bad = [r for r in self.failures.protected_replicas if not 0 <= r < self.replicas]
        bad += [r for r in (faultspec.parse(e).int("replica") for e in self.failures.events)
                if r is not None and not 0 <= r < self.replicas]
        _check(not bad, "failures", f"to name replicas in 0..{self.replicas - 1}", bad)
        _check(len(self.scheduler.first_start_s) in (0, self.replicas), "scheduler.first_start_s",
               f"empty or one value per replica ({self.replicas})", list(self.scheduler.first_start_s))
        _check_catchup(self.catchup)
        for v in self.calibration.values if self.calibration is not None else ():
            if v.key.startswith("measured."):
                continue
            try:
                actual = profile_value(self, v.key)
            except KeyError:
                raise ValueError(f"[calibration] value for unknown profile key {v.key!r}") from None
            _check(isinstance(actual, (int, float)) and math.isclose(actual, v.value, rel_tol=1e-9, abs_tol=1e-12),
                   f"[calibration] {v.key}", f"the profile's value {actual!r} (a calibrated key says what it set)",
                   v.value)

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.ranks_per_replica

    @property
    def hosts_per_replica(self) -> int:
        return hosts_per_replica(self.ranks_per_replica, self.topology.gpus_per_host)

    @property
    def num_hosts(self) -> int:
        """Training hosts plus spares."""
        return self.replicas * self.hosts_per_replica + self.spares.hot_spare_hosts + self.spares.cold_spare_hosts


# -- loading -----------------------------------------------------------------------------------------

def _convert(hint: Any, value: Any, path: str) -> Any:
    """`value` (from TOML) checked and converted to the field type `hint`; ValueError naming `path`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a table, got {value!r}")
        return _build(hint, value, path + ".")
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, path)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path} must be one of {args}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path} must be an array, got {value!r}")
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ValueError(f"{path} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key '{prefix}{unknown[0]}' (known: {', '.join(sorted(names))})")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"missing key '{prefix}{missing[0]}'")
    kwargs = {k: _convert(hints[k], v, prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        if prefix and not str(e).startswith("["):
            raise ValueError(f"[{prefix.rstrip('.')}] {e}") from None
        raise


def profile_from_dict(data: dict[str, Any]) -> Profile:
    """Validate a parsed TOML document into a Profile. Raises ValueError naming the bad key."""
    return _build(Profile, data)


def profile_path(name_or_path: str | Path) -> Path:
    """A profile name ("meta-98k") resolves to scale_profiles/<name>.toml; anything else is a path."""
    p = Path(name_or_path)
    if p.suffix != ".toml" and not p.exists():
        p = PROFILE_DIR / f"{name_or_path}.toml"
    return p


def load_profile(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Profile:
    """Read, validate and override a profile. Raises FileNotFoundError, ValueError."""
    with open(profile_path(name_or_path), "rb") as f:
        data = tomllib.load(f)
    return apply_overrides(profile_from_dict(data), overrides)


def list_profiles() -> list[str]:
    """Names of the scale profiles in scale_profiles/ (other TOML files there, e.g. the time-to-train
    profile, have no ranks_per_replica and are skipped)."""
    names = []
    for path in sorted(PROFILE_DIR.glob("*.toml")):
        with open(path, "rb") as f:
            if "ranks_per_replica" in tomllib.load(f):
                names.append(path.stem)
    return names


def _parse_value(raw: str) -> Any:
    """A TOML value ("8", "2.5", "true", "[1, 2]", '"x"'); a bare word falls back to a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _field_hint(cls: Any, name: str) -> tuple[Any, bool] | None:
    """The type of dataclass `cls`'s field `name` (Optional unwrapped) and whether it may be None; None if `cls`
    has no such field."""
    if not dataclasses.is_dataclass(cls):
        return None
    hint = typing.get_type_hints(cls).get(name)
    if hint is None:
        return None
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def apply_overrides(profile: Profile, overrides: list[str] | tuple[str, ...]) -> Profile:
    """A new profile with each "dotted.key=value" applied, validated like a loaded file. A key inside an
    optional table the profile leaves out (`checkpoint.every_steps=5` without [checkpoint]) starts that
    table; `TABLE=none` (e.g. `checkpoint=none`) leaves an optional table out, and `KEY=none` unsets an
    optional key.

    Raises:
        ValueError: malformed override, unknown key, or a value the field rejects.
    """
    if not overrides:
        return profile
    data = _to_dict(profile)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not 'dotted.key=value'")
        *parents, leaf = key.split(".")
        node, cls = data, Profile
        for part in parents:
            hint = _field_hint(cls, part)
            if hint is None or not dataclasses.is_dataclass(hint[0]):
                raise ValueError(f"unknown key '{key}' in override {item!r}")
            node, cls = node.setdefault(part, {}), hint[0]
        hint = _field_hint(cls, leaf)
        if hint is None:
            raise ValueError(f"unknown key '{key}' in override {item!r}")
        value = _parse_value(raw.strip())
        if value == "none" and hint[1]:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        calibration = data.get("calibration")
        if isinstance(calibration, dict):  # an overridden key was no longer measured
            calibration["values"] = [v for v in calibration.get("values", []) if v.get("key") != key]
    return profile_from_dict(data)


def _to_dict(obj: Any) -> Any:
    """Like dataclasses.asdict, but None fields are dropped (TOML has no null) and tuples become lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, tuple):
        return [_to_dict(v) for v in obj]
    return obj


def weibull_scale_for_mean(mean: float, shape: float) -> float:
    """Weibull scale parameter giving the requested mean (mean = scale x Gamma(1 + 1/shape))."""
    return mean / math.gamma(1.0 + 1.0 / shape)
