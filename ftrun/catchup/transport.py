"""The catch-up transport seam: how one fetch reaches its sources, and how a rank serves its snapshot.

The fetch protocol (manifest, long-poll, plan, CRC checks, source death and re-plan, the deadline)
is one code path, ftrun.catchup.fetcher, blocking on the Env. It reaches sources through a
`CatchupTransport`:

    link = transport.open(source)               # one source; used by one task at a time
    manifest = link.manifest(step, wait_s, limit_s)   # long-polls up to wait_s for the step's publication
    crc = link.shard(step, shard, into, wait_s, limit_s)  # the shard's bytes into `into` (shard.nbytes
                                                # long); their CRC32 if the link computed it on arrival
    link.shard(..., ahead=(next_shard, its_into))  # where transport.pipelines: request the next shard
                                                # now, behind this one; the next call asks for it
    link.close()
    dest = transport.destination(nbytes)        # where a fetch lands: dest[a:b] is a writable buffer
    transport.views(dest, layout)               # name -> tensor over dest
    transport.crc32(buf)                        # checked against the manifest (when the link gave none)

Neither call takes longer than limit_s (what is left of the fetch's deadline). A link raises CatchupAuthError (token refused: the fetch stops), CatchupStepError (the source does not
have the step), SourceFailed (unreachable, stalled, gone: drop it and re-plan) or ShardFailed (bad or
torn bytes: retry the shard elsewhere). Implementations: HTTP (ftrun.catchup.http_transport, the
aiohttp server of ftrun.catchup.server) and framed messages over `env.net` (ftrun.catchup.net_transport),
which in the emulator carries shape-only payloads over the modeled network.

The serving side is a `CatchupService` (publish/retire/fetch/url), what the trainer holds.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Protocol, Sequence

import torch

from ftrun.catchup.errors import CatchupError
from ftrun.catchup.manifest import Layout, Manifest, ShardSpec


class SourceFailed(CatchupError):
    """Drop this source: unreachable, stalled, or it no longer has the step."""


class ShardFailed(CatchupError):
    """This shard's bytes from this source are bad (checksum, short body, server error): retry elsewhere."""


class SourceLink(Protocol):
    def manifest(self, step: int, wait_s: float, limit_s: float) -> Manifest: ...

    def shard(self, step: int, shard: ShardSpec, into: Any, wait_s: float, limit_s: float,
              ahead: tuple[ShardSpec, Any] | None = None) -> int | None: ...

    def close(self) -> None: ...


class CatchupTransport(Protocol):
    pipelines: bool  # its links take `ahead`: the next shard's request goes out behind the current one

    def open(self, source: str) -> SourceLink: ...

    def destination(self, nbytes: int) -> Any: ...

    def views(self, dest: Any, layout: Layout) -> dict[str, torch.Tensor]: ...

    def crc32(self, buf: Any) -> int: ...


class CatchupService(Protocol):
    """A rank's catch-up endpoint and client, as the trainer uses them (started: `url` is set)."""

    url: str

    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Collection[str] = ()) -> None:
        """Serve `state` as `step` (returns once it is copied and checksummed, servable; the caller may change
        its tensors, except the `borrow` ones, which may be served in place until it retires `step` or
        publishes again)."""

    def check(self, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
        """Raises CatchupUsageError as a publish of `state` and `metadata` would (the trainer's build asks,
        before any step commits); copies nothing."""

    def reserve(self, state: Mapping[str, torch.Tensor], *, borrow: Collection[str] = ()) -> None:
        """Prepare, in the background, for a later publish of a state like `state` (returns at once)."""

    def retire(self, step: int) -> None:
        """Stop serving `step` (a no-op for another step)."""

    def prepare_fetch(self, shapes: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Prepare, in the background, the receive buffer of a later fetch of a state like `shapes()` (meta
        tensors stand for shapes; called in that background task): the next fetch that fits receives into
        it (returns at once)."""

    def release_fetch(self) -> None:
        """Drop what prepare_fetch made, if no fetch took it."""

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        """The state of `step` from `sources` (a FetchResult). Raises CatchupError."""

    def stop(self) -> None: ...
