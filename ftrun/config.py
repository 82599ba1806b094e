"""Typed configuration shared by the runtime's components.

Every timeout lives in `Timeouts`, so one object says how long anything in a job may wait. Components
take their own config (LighthouseConfig, ManagerConfig, FtarConfig, ...), defined here (CatchupConfig in
ftrun.catchup.config); FTConfig and the scale profiles nest them rather than renaming their fields. Only entry
points read the environment or files; everything else receives these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _check_positive(obj: object, *, allow_zero: tuple[str, ...] = ()) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < 0 or (value == 0 and f.name not in allow_zero):
                raise ValueError(f"{type(obj).__name__}.{f.name} must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Every timeout of a job, in seconds.

    Defaults suit a loopback job; the paper's production figure for failure detection is 60 s, which the
    scale profiles set.
    """

    heartbeat_interval_s: float = 0.1  # how often a replica leader tells the lighthouse it is alive
    heartbeat_timeout_s: float = 2.0  # silence after which the lighthouse declares a replica hung
    join_timeout_s: float = 0.5  # bounded wait for live replicas that have not asked yet
    quorum_timeout_s: float = 30.0  # how long a replica waits for a quorum decision
    connect_timeout_s: float = 10.0  # connecting to the lighthouse or a peer
    commit_timeout_s: float = 30.0  # collectives inside a replica (check-in, vote, broadcast)
    ftar_timeout_s: float = 10.0  # any single wait inside a cross-replica all-reduce
    catchup_timeout_s: float = 60.0  # fetching a peer's state
    catchup_long_poll_s: float = 5.0  # a catch-up server holds a request for a not-yet-published step this long
    # a catch-up source that sends nothing for this long is treated as dead (over HTTP: no byte arrives; over
    # env.net: a response frame, a whole shard, does not complete), and a client that takes nothing is dropped
    catchup_stall_s: float = 10.0

    @property
    def replica_comm_s(self) -> float:
        """The timeout a ReplicaComm needs: ranks other than the leader wait in the decision broadcast
        while their leader waits for the lighthouse (up to quorum_timeout_s). A dead peer is still seen
        at once through its closed connection; this bounds only how long a hang goes unnoticed."""
        return self.quorum_timeout_s + self.commit_timeout_s

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ValueError(
                f"Timeouts.heartbeat_interval_s ({self.heartbeat_interval_s}) must be below "
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s})"
            )


@dataclass(frozen=True, kw_only=True)
class LighthouseConfig:
    """min_replicas: a quorum needs this many replicas, and a commit this many contributors.
    leave_out_after: a replica reporting this many failed commits by its own fault since its last commit
    sits out the next quorum when the others can form it (ftrun.quorum.decide rule 7)."""

    min_replicas: int = 1
    leave_out_after: int = 2
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        for name in ("min_replicas", "leave_out_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"LighthouseConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Per-replica manager settings.

    max_retries: failed commits by the replica's own fault (its compute, a local error) since its last
    commit, after which it gives up (raises) instead of retrying.
    max_peer_retries: the same for failed commits that other replicas caused (a peer died or stalled in
    the exchange, too few contributors): a larger budget, so a failing peer cannot take this one down.
    ask_ahead: the leader sends its quorum request for the next step right after a commit, so the
    lighthouse decides while the replica finishes the step (ftrun.replica.ask_ahead); off: it asks at
    the next start_step and waits. Off by default for now: with it on, `ftrun fidelity` (3 x 1) puts
    the emulator's commit-to-quorum time at about 0.2x the real run's (the emulator does not yet model
    what the real replicas still wait for after an early ask), beyond the fidelity test's factor 2.
    """

    max_retries: int = 10
    max_peer_retries: int = 100
    ask_ahead: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        for name in ("max_retries", "max_peer_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"ManagerConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.ask_ahead, bool):
            raise ValueError(f"ManagerConfig.ask_ahead must be a bool, got {self.ask_ahead!r}")


MIN_SOCKET_BUFFER_BYTES = 128 << 10


@dataclass(frozen=True, kw_only=True)
class FtarConfig:
    """The FTAR engine's settings, the one place FTAR chunking is named: FTConfig (`ftar`) and the scale
    profiles (`[ftar.engine]`) nest this. A bad value raises; nothing is rounded."""

    chunk_bytes: int = 4 << 20  # S: message and staging-slot size
    num_chunks: int = 4  # C: chunks in flight per peer
    timeout_s: float = 10.0  # any single wait inside an all-reduce
    transport: str = "auto"  # "auto": shared slots with same-host neighbours; "socket": bulk frames only
    # Socket links: "blocking" is "threads" with each chunk sent and received in one blocking call
    # when the Env's connections offer it (ftrun.env.real_bulk), else "threads"; "threads" sends from
    # a helper task while this one receives, waiting in poll().
    socket_io: str = "blocking"
    # Socket buffers (send and receive) of a ring link whose ends are on one machine (transport "socket"
    # or network namespaces): small, so the bytes the sender's kernel copies in are still in the shared
    # cache when the receiver's copies them out; 0 keeps the connection's (4 MiB). Links between
    # machines keep theirs: there the window must cover the bandwidth-delay product.
    local_socket_buffer_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        if self.chunk_bytes < 16 or self.chunk_bytes % 16:
            raise ValueError(f"FtarConfig.chunk_bytes must be a positive multiple of 16, got {self.chunk_bytes}")
        if self.num_chunks < 1:
            raise ValueError(f"FtarConfig.num_chunks must be >= 1, got {self.num_chunks}")
        if self.timeout_s <= 0:
            raise ValueError(f"FtarConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.transport not in ("auto", "socket"):
            raise ValueError(f"FtarConfig.transport must be 'auto' or 'socket', got {self.transport!r}")
        if self.socket_io not in ("blocking", "threads"):
            raise ValueError(f"FtarConfig.socket_io must be 'blocking' or 'threads', got {self.socket_io!r}")
        b = self.local_socket_buffer_bytes
        if not isinstance(b, int) or isinstance(b, bool):  # setsockopt would refuse it at every ring's setup
            raise ValueError(f"FtarConfig.local_socket_buffer_bytes must be an int, got {b!r}")
        if b and b < MIN_SOCKET_BUFFER_BYTES:
            raise ValueError(f"FtarConfig.local_socket_buffer_bytes must be 0 or >= {MIN_SOCKET_BUFFER_BYTES} (a "
                             f"window under two loopback segments of 64 KiB stalls the link), got "
                             f"{self.local_socket_buffer_bytes}")

    @property
    def staging_bytes(self) -> int:
        return 2 * self.num_chunks * self.chunk_bytes
