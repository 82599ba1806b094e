"""What an emulated job records while it runs: compact, because 98,304 ranks report into it.

- every rank: how long its start_step took, and when it returned, per quorum round
  (round = (quorum_id, step)); kept as a float array and one small list per round;
- replica leaders (rank 0): the lighthouse round trip (ask -> decision) per round, the Manager's events
  (quorum, heal, commit, abort, error) and spans of each step's phases, named `ftrun::<component>::<op>`;
- the job: kills, restarts, failures, allocations.
"""

from __future__ import annotations

from array import array
from typing import Any


class Recorder:
    def __init__(self, *, spans: bool = True) -> None:
        self.events: list[dict[str, Any]] = []
        self.spans: list[tuple[str, int, str, float, float]] | None = [] if spans else None
        self.phase_s: dict[str, float] = {}  # leaders' time per span name, summed
        self.start_step_s = array("d")  # every rank, every start_step
        self.rounds: dict[tuple[int, int], list[float]] = {}  # (quorum_id, step) -> [last ask, last end, ranks]
        self.leader_rtt_s = array("d")
        self.errors: list[str] = []  # unexpected exceptions in rank tasks (bugs), for the report

    def event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def span(self, replica_id: str, incarnation: int, name: str, t0: float, t1: float) -> None:
        self.phase_s[name] = self.phase_s.get(name, 0.0) + (t1 - t0)
        if self.spans is not None:
            self.spans.append((replica_id, incarnation, name, t0, t1))

    def rank_started_step(self, quorum_id: int, step: int, t0: float, t1: float) -> None:
        self.start_step_s.append(t1 - t0)
        r = self.rounds.get((quorum_id, step))
        if r is None:
            self.rounds[(quorum_id, step)] = [float("-inf"), t1, 1.0]
        else:
            if t1 > r[1]:
                r[1] = t1
            r[2] += 1

    def leader_asked(self, quorum_id: int, step: int, t_ask: float, t_reply: float) -> None:
        self.leader_rtt_s.append(t_reply - t_ask)
        r = self.rounds.setdefault((quorum_id, step), [float("-inf"), float("-inf"), 0.0])
        if t_ask > r[0]:
            r[0] = t_ask

    def round_latencies_s(self) -> list[float]:
        """Per quorum round: from the last leader's request to the last rank holding the decision."""
        return list(self.round_latency_by_key().values())

    def round_latency_by_key(self) -> dict[tuple[int, int], float]:
        return {key: end - ask for key, (ask, end, _) in self.rounds.items() if ask != float("-inf") and end >= ask}
