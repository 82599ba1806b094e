"""The catch-up component's typed config (STYLE habit 5)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ftrun.config import Timeouts

ALIGN = 64  # every tensor starts at a multiple of this in the flat snapshot (any dtype can view it)


@dataclass(frozen=True, kw_only=True)
class CatchupConfig:
    """Settings of the catch-up state server and client.

    max_shard_bytes: the state is cut into shards of at most this size (a multiple of 64); sources serve
        different shards in parallel, so smaller shards balance better and larger ones cost fewer requests.
    bind: where the state server listens ("host:port", port 0 picks a free one); loopback by default.
    advertise_host: the host in the URL peers are given (default: bind's host; needed with 0.0.0.0).
    max_source_failures: bad shards (checksum, short body, server error) a source may send before it
        is dropped from the fetch; each bad shard is retried from another source.
    wait_limit_s: paper §6.1 — how long the healthy replicas may wait for a joiner whose fetch runs past
        the end of the step before it joins one step later instead: it bounds each wait of building a
        step's FTAR ring when the quorum has a joiner, in place of ftar_timeout_s (see ftrun.catchup.wait).
        None: timeouts.ftar_timeout_s (`wait_limit` is the value in force).
    timeouts: the job's timeouts; the client bounds a whole fetch by catchup_timeout_s and a connect by
        connect_timeout_s; catchup_long_poll_s is how long the server holds a request for a step not yet
        published, catchup_stall_s how long a silent source is given before it counts as dead.
    """

    max_shard_bytes: int = 8 << 20
    bind: str = "127.0.0.1:0"
    advertise_host: str | None = None
    max_source_failures: int = 2
    wait_limit_s: float | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if self.max_shard_bytes < ALIGN or self.max_shard_bytes % ALIGN:
            raise ValueError(
                f"CatchupConfig.max_shard_bytes must be a positive multiple of {ALIGN}, got {self.max_shard_bytes}"
            )
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"CatchupConfig.bind must be 'host:port', got {self.bind!r}")
        if self.wait_limit_s is not None and (isinstance(self.wait_limit_s, bool) or self.wait_limit_s < 0):
            raise ValueError(f"CatchupConfig.wait_limit_s must be >= 0 or None, got {self.wait_limit_s!r}")
        if self.advertise_host is not None and not self.advertise_host:
            raise ValueError("CatchupConfig.advertise_host must be a host name or None, got ''")
        if self.max_source_failures < 1:
            raise ValueError(f"CatchupConfig.max_source_failures must be >= 1, got {self.max_source_failures}")

    @property
    def wait_limit(self) -> float:
        """The wait limit in force: wait_limit_s, else the job's FTAR timeout."""
        return self.timeouts.ftar_timeout_s if self.wait_limit_s is None else self.wait_limit_s

    @property
    def long_poll_s(self) -> float:
        return self.timeouts.catchup_long_poll_s

    @property
    def stall_s(self) -> float:
        return self.timeouts.catchup_stall_s
