"""Crashed rank processes: what they died of, what to show, and when to stop restarting. Pure.

`summarize_stderr(text, exit_code)` reads the tail of a rank's stderr. With a Python traceback in it, the
last one is the detail to show and its exception line is the error; without one, the last stderr lines
are the detail and the last line the error; with no stderr at all, the exit status is. A log line's
timestamp and memory addresses are masked in the error, so two crashes of the same bug compare equal.

`CrashLog` folds the crashes of a job. Each error's detail is shown once per job (the first crash that
shows it), whatever the number of restarts. A crash is futile when the incarnation never committed a
step (it failed to start), or when the job has not gone past the step it had reached at this replica's
previous crash (every replica crashing at the same step, restarting and crashing there again). A replica
that crashes futilely `max_startup_failures` times in a row with the same error is in a crash loop: the
supervisor stops restarting it. A different error, or the job advancing past that step, starts the count
again.
"""

from __future__ import annotations

import re
import signal
from itertools import groupby
from dataclasses import dataclass, field

TRACEBACK = "Traceback (most recent call last):"
MAX_DETAIL_LINES = 40  # the traceback's first lines and its last ones, when it is longer
TAIL_LINES = 15  # stderr lines shown when there is no traceback


@dataclass(frozen=True)
class ErrorSummary:
    error: str  # one line; equal for two crashes with the same cause
    detail: str  # the traceback, or the last stderr lines, to show a person ("" without stderr)


def exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def summarize_stderr(text: str, exit_code: int | None) -> ErrorSummary:
    """What a rank that ended with `exit_code` died of, from the tail of its stderr."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == TRACEBACK]
    if starts:
        start = starts[-1]
        end = start + 1
        while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
            end += 1  # frames and source lines are indented; the exception line is not
        error = lines[end] if end < len(lines) else lines[-1]
        return ErrorSummary(_mask(error.strip()) or exit_status(exit_code), _clip(lines[start:end + 1]))
    tail = _collapse([line for line in lines if line.strip()])[-TAIL_LINES:]
    if tail:
        return ErrorSummary(_mask(tail[-1].split(REPEATED)[0].strip()), "\n".join(tail))
    return ErrorSummary(f"{exit_status(exit_code)}, nothing on stderr", "")


LOG_TIME = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\s*")  # logging's asctime


def _mask(line: str) -> str:
    return re.sub(r"0x[0-9a-fA-F]+", "0x...", LOG_TIME.sub("", line))


REPEATED = "  [repeated "


def _collapse(lines: list[str]) -> list[str]:
    """Runs of lines equal but for their timestamps, as the first line of each and how often it came."""
    out = []
    for _, run in groupby(lines, key=_mask):
        run = list(run)
        out.append(run[0] + (f"{REPEATED}{len(run)} times]" if len(run) > 1 else ""))
    return out


def _clip(lines: list[str]) -> str:
    if len(lines) > MAX_DETAIL_LINES:
        head = MAX_DETAIL_LINES // 4
        lines = lines[:head] + [f"  ... ({len(lines) - MAX_DETAIL_LINES} lines left out)"] + \
            lines[-(MAX_DETAIL_LINES - head):]
    return "\n".join(lines)


@dataclass
class ErrorRecord:
    error: str
    detail: str
    replica_id: str  # where it was first seen
    rank: int
    incarnation: int
    exit_code: int | None
    count: int = 0  # crashes with this error, in all replicas

    def as_json(self) -> dict:
        return {"error": self.error, "count": self.count, "replica_id": self.replica_id, "rank": self.rank,
                "incarnation": self.incarnation, "exit_code": self.exit_code, "detail": self.detail}


@dataclass(frozen=True)
class CrashVerdict:
    show: bool  # the first crash with this error in the job: show its detail
    futile: int  # this replica's futile crashes in a row with this error (0: this one was not futile)
    give_up: bool  # a crash loop: do not restart the replica


@dataclass
class CrashLog:
    max_startup_failures: int = 3
    errors: dict[str, ErrorRecord] = field(default_factory=dict)  # by error, in the order first seen

    def __post_init__(self) -> None:
        if self.max_startup_failures < 1:
            raise ValueError(f"max_startup_failures must be >= 1, got {self.max_startup_failures}")
        # replica -> (error, futile crashes in a row, the job's step at its last crash)
        self._streak: dict[str, tuple[str, int, int]] = {}

    def committed(self, replica_id: str, job_step: int) -> None:
        """The replica's running incarnation committed; `job_step`: the job's highest step now. The count
        starts again once the job has gone past the step of the replica's last crash."""
        streak = self._streak.get(replica_id)
        if streak is not None and job_step > streak[2]:
            del self._streak[replica_id]

    def crashed(self, replica_id: str, *, rank: int, incarnation: int, exit_code: int | None,
                summary: ErrorSummary, started: bool, job_step: int) -> CrashVerdict:
        """Record a crash of `replica_id`. started: its incarnation had committed a step; job_step: the job's
        highest step now."""
        record = self.errors.get(summary.error)
        show = record is None
        if record is None:
            record = self.errors[summary.error] = ErrorRecord(summary.error, summary.detail, replica_id, rank,
                                                              incarnation, exit_code)
        record.count += 1
        previous, count, last_step = self._streak.get(replica_id, ("", 0, -1))
        if started and job_step > last_step:  # it ran, and the job got further than at its last crash
            self._streak[replica_id] = ("", 0, job_step)
            return CrashVerdict(show, 0, False)
        count = count + 1 if previous == summary.error else 1
        self._streak[replica_id] = (summary.error, count, job_step)
        return CrashVerdict(show, count, count >= self.max_startup_failures)
