"""`ForwardingCatchup`: a CatchupService (ftrun.catchup.transport) that hands every call to the one it
wraps. The emulator's catch-up wrappers (seams.TimedCatchup, fold.LeadCatchup) subclass it and change
only `fetch`.
"""

from __future__ import annotations

from typing import Any, Sequence


class ForwardingCatchup:
    """Forwards publish, check, reserve, prepare_fetch, release_fetch, retire, fetch and stop to
    `service`; `url` is the service's."""

    def __init__(self, service: Any) -> None:
        self._s = service
        self.url = service.url

    def publish(self, *args: Any, **kwargs: Any) -> None:
        self._s.publish(*args, **kwargs)

    def check(self, state: Any, metadata: Any = None) -> None:
        self._s.check(state, metadata)

    def reserve(self, *args: Any, **kwargs: Any) -> None:
        self._s.reserve(*args, **kwargs)

    def prepare_fetch(self, shapes: Any) -> None:
        self._s.prepare_fetch(shapes)

    def release_fetch(self) -> None:
        self._s.release_fetch()

    def retire(self, step: int) -> None:
        self._s.retire(step)

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        return self._s.fetch(step, sources)

    def stop(self) -> None:
        self._s.stop()
