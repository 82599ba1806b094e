"""Ctrl-C and SIGTERM for `ftrun launch`: the first asks the job to stop and write its partial report.

`Interrupts.install()` replaces the SIGINT and SIGTERM handlers (main thread only; elsewhere it leaves
them alone) until `restore()`. The first signal sets `signal` (its name), which the supervisor's loop
checks between events; a second one raises KeyboardInterrupt to stop at once. Rank processes lead their
own sessions, so a terminal's Ctrl-C reaches only the supervisor, which then stops them.
"""

from __future__ import annotations

import signal
import sys


class Interrupts:
    """SIGINT/SIGTERM handling: the first signal asks the job to stop (and write its partial report); a
    second one raises KeyboardInterrupt to stop at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: str | None = None  # the first signal's name, once one came
        self.exit_code = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Catch SIGINT and SIGTERM, except a SIGINT this process was started ignoring (a background job)."""
        try:
            self._previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
            for sig, previous in self._previous.items():
                if not (sig == signal.SIGINT and previous == signal.SIG_IGN):
                    signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (an embedding caller): signals stay theirs
            self._previous = {}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal, self.exit_code = signal.Signals(signum).name, 128 + signum  # the shell's convention
        print(f"\nftrun launch: {self.signal}: stopping the job and writing the partial report "
              f"(again to quit at once)", file=sys.stderr, flush=True)
