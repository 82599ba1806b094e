"""A Clock (ftrun.env.base) for unit tests: its time moves only when the test moves it."""

from __future__ import annotations


class ManualClock:
    """`now()` is `t`, which the test sets; `sleep(s)` adds s at once."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
