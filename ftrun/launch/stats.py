"""What a supervised run did, folded from its event stream as it happens. Pure: no clock, no I/O.

`RunStats.add(event)` takes the rank processes' JSON events (tagged replica_id, incarnation, rank by the
supervisor) and the supervisor's own (kill, restart, steady). Steps are the step *trained* (0-based):
a Manager "commit" event carries the step count after the commit, so it counts for step - 1; a
worker "step" event carries the step it trained. Per step it keeps which replicas committed (leaders'
commit events), the failed commits (aborts), the loss of every replica that trained a batch (committed
"step" events that did not heal) and, per (step, rank), the first param_hash seen: every later replica
committing that step must show the same hash (the identical-state check). Per kill it measures the
victim's downtime: from the kill to the first commit of one of its later incarnations; and it counts
events a killed incarnation stamped after its kill, which a rank that really died cannot produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

SUPERVISOR_EVENTS = frozenset({"kill", "restart", "steady", "stop", "gave_up"})  # the supervisor's, not a rank's
SKIP_METRIC_KEYS = frozenset({"event", "t", "step", "rank", "replica_id", "incarnation"})
AFTER_KILL_SLACK_S = 0.1  # events carry the rank's monotonic clock, the supervisor's kill its own (same clock)


@dataclass
class StepRow:
    step: int
    committed: set[str] = field(default_factory=set)  # replicas whose leader committed this step
    aborts: int = 0  # failed commits of this step (one per replica and try)
    losses: list[float] = field(default_factory=list)  # per replica that trained a batch in it
    first_t: float | None = None  # first and last commit time
    last_t: float | None = None
    user: dict[str, list[float]] = field(default_factory=dict)  # custom metrics (job.log_metrics), per replica

    @property
    def loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def as_json(self) -> dict:
        return {"step": self.step, "replicas_committed": sorted(self.committed), "failed_commits": self.aborts,
                "loss": self.loss, "batches": len(self.losses), "t_first_commit": self.first_t,
                "t_last_commit": self.last_t,
                **{k: sum(v) / len(v) for k, v in self.user.items() if k not in _ROW_KEYS}}


_ROW_KEYS = frozenset({"step", "replicas_committed", "failed_commits", "loss", "batches", "t_first_commit",
                       "t_last_commit"})


@dataclass(frozen=True)
class Divergence:
    step: int
    rank: int
    first: tuple[str, int, str]  # (replica, incarnation, hash) that committed it first
    other: tuple[str, int, str]


@dataclass(frozen=True)
class Downtime:
    replica_id: str
    killed_at: float
    ready_after_s: float | None  # kill -> the new incarnation's ready event (restart delay + start-up)
    commit_after_s: float  # kill -> its first commit again


class RunStats:
    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.rows: dict[int, StepRow] = {}
        self.num_kills = self.num_restarts = self.num_crashes = 0
        self.identity_checks = 0  # param_hash comparisons made (a replica's hash against the step's first)
        self.divergences: list[Divergence] = []
        self.downtimes: list[Downtime] = []
        self.steady_step: int | None = None  # first step all replicas committed
        self.steady_t: float | None = None
        self.last_t: float | None = None
        self.finals: list[dict] = []  # "final" events (clean exits)
        self._hashes: dict[tuple[int, int], tuple[str, int, str]] = {}
        self._user_hashes: dict[tuple[int, int], tuple[str, int, str]] = {}  # (step, rank) -> the first seen
        self.user_state_checks = 0  # user_state_hash comparisons made
        self.user_state_divergences = 0
        self.events_after_kill = 0  # events a killed incarnation stamped after the kill (must stay 0)
        self._died: dict[tuple[str, int], float] = {}
        self._killed: dict[str, tuple[float, int]] = {}  # replica -> (kill time, incarnation killed)
        self._ready: dict[tuple[str, int], float] = {}
        self._last_commit: dict[tuple[str, int], float] = {}
        self._periods: list[float] = []  # gaps between consecutive commits of one incarnation
        self._num_committed = 0  # the highest committed step + 1

    @property
    def user_state_identical(self) -> bool | None:
        """Every replica that committed a step showed the same user_state_hash (per rank); None when no
        step event carried one (a script that registers no user state, or reports none)."""
        return None if not self._user_hashes else self.user_state_divergences == 0

    @property
    def max_step(self) -> int:
        """Steps the job has committed (the highest step any replica committed; a failed commit of the next
        step does not count)."""
        return self._num_committed

    def row(self, step: int) -> StepRow:
        if step not in self.rows:
            self.rows[step] = StepRow(step)
        return self.rows[step]

    def add(self, ev: dict) -> None:
        kind, rid, inc = ev.get("event"), ev.get("replica_id"), ev.get("incarnation", 0)
        if "t" in ev:
            self.last_t = ev["t"] if self.last_t is None else max(self.last_t, ev["t"])
            died = self._died.get((rid, inc))
            if kind not in SUPERVISOR_EVENTS and died is not None and ev["t"] > died + AFTER_KILL_SLACK_S:
                self.events_after_kill += 1  # stamped by a rank after its replica was killed: it survived
        if kind == "commit" and ev.get("rank", 0) == 0:
            self._on_commit(rid, inc, ev["step"] - 1, ev["t"])
        elif kind == "step" and ev.get("committed"):
            self._on_step(ev, rid, inc)
        elif kind == "metrics" and ev.get("rank", 0) == 0 and isinstance(ev.get("step"), int):
            self._on_metrics(ev)
        elif kind == "abort" and ev.get("rank", 0) == 0:
            self.row(ev["step"]).aborts += 1
        elif kind == "kill":
            self.num_kills += ev.get("why") == "injected"
            self.num_crashes += ev.get("why") != "injected"
            earlier = self._killed.get(rid)
            if earlier is not None:  # killed again while recovering: the earlier kill's downtime ends here
                self.downtimes.append(Downtime(rid, earlier[0], None, ev["t"] - earlier[0]))
            self._killed[rid] = (ev["t"], inc)
            self._died[(rid, inc)] = ev["t"]
        elif kind == "restart":
            self.num_restarts += 1
        elif kind == "ready" and ev.get("rank", 0) == 0:
            self._ready[(rid, inc)] = ev["t"]
        elif kind == "final" and ev.get("rank", 0) == 0:
            self.finals.append(ev)

    def _on_commit(self, rid: str, inc: int, step: int, t: float) -> None:
        self._num_committed = max(self._num_committed, step + 1)
        row = self.row(step)
        row.committed.add(rid)
        row.first_t = t if row.first_t is None else min(row.first_t, t)
        row.last_t = t if row.last_t is None else max(row.last_t, t)
        prev = self._last_commit.get((rid, inc))
        if prev is not None:
            self._periods.append(t - prev)
        self._last_commit[(rid, inc)] = t
        if self.steady_step is None and len(row.committed) == self.num_replicas:
            self.steady_step, self.steady_t = step, t
        killed = self._killed.get(rid)
        if killed is not None and inc > killed[1]:
            del self._killed[rid]
            ready = self._ready.get((rid, inc))
            self.downtimes.append(Downtime(rid, killed[0], None if ready is None else ready - killed[0], t - killed[0]))

    def _on_step(self, ev: dict, rid: str, inc: int) -> None:
        step, rank = ev["step"], ev.get("rank", 0)
        self._num_committed = max(self._num_committed, step + 1)  # a committed "step" event
        if rank == 0 and ev.get("loss") is not None and not ev.get("healed"):
            self.row(step).losses.append(float(ev["loss"]))
        user = ev.get("user_state_hash")  # the registered user state (the user's own loop), when reported
        if user is not None:
            first_user = self._user_hashes.setdefault((step, rank), (rid, inc, user))
            if first_user[:2] != (rid, inc):
                self.user_state_checks += 1
                self.user_state_divergences += first_user[2] != user
        digest = ev.get("param_hash")
        if digest is not None:
            first = self._hashes.setdefault((step, rank), (rid, inc, digest))
            if first[:2] != (rid, inc):
                self.identity_checks += 1
                if first[2] != digest:
                    self.divergences.append(Divergence(step, rank, first, (rid, inc, digest)))

    def _on_metrics(self, ev: dict) -> None:
        """A "metrics" event (job.log_metrics) of the step it names (1-based: the steps committed); its
        numbers are averaged over the replicas into that step's metrics.jsonl row (0-based step - 1)."""
        step = ev["step"] - 1
        if step < 0:
            return
        row = self.row(step)
        for key, value in ev.items():
            if key not in SKIP_METRIC_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                row.user.setdefault(key, []).append(float(value))

    # -- figures ----------------------------------------------------------------------------------
    def step_period_s(self) -> float | None:
        """Median time between two commits of one replica incarnation (the steady step time)."""
        return median(self._periods) if self._periods else None

    def efficiency(self) -> tuple[int, int]:
        """(committed, total) replica-steps from the first step all replicas committed to the end.

        Start-up (replicas arriving one by one) is not a failure, so it is left out of the window."""
        if self.steady_step is None:
            return 0, 0
        steps = range(self.steady_step, self.max_step)
        committed = sum(len(self.rows[s].committed) if s in self.rows else 0 for s in steps)
        return committed, len(steps) * self.num_replicas

    def stalls(self) -> list[tuple[float, float]]:
        """Intervals of the steady part in which the whole job committed nothing for over two step times
        (failure detection, aborted commits, waiting for a quorum), each less the one step it would take."""
        t = self.step_period_s()
        if t is None or self.steady_step is None:
            return []
        times = sorted(r.first_t for s, r in self.rows.items() if s >= self.steady_step and r.first_t is not None)
        return [(a + t, b) for a, b in zip(times, times[1:]) if b - a > 2 * t]

    def stepping_downtimes(self) -> list[float]:
        """Each kill's downtime less the job-wide stalls inside it: the time the others were stepping without it."""
        stalls = self.stalls()
        out = []
        for d in self.downtimes:
            start, end = d.killed_at, d.killed_at + d.commit_after_s
            overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in stalls)
            out.append(d.commit_after_s - overlap)
        return out

    @property
    def replicas_identical(self) -> bool:
        return not self.divergences


def loss_curve(rows: dict[int, StepRow], batches_per_step: dict[int, int] | None = None) -> list[tuple[float, float]]:
    """[(batches trained so far, mean loss of the step)] in step order, for steps with a loss.

    batches_per_step: exact counts (e.g. from the audit); else the number of losses reported per step."""
    out, total = [], 0.0
    for step in sorted(rows):
        row = rows[step]
        total += batches_per_step.get(step, 0) if batches_per_step is not None else len(row.losses)
        if row.loss is not None:
            out.append((total, row.loss))
    return out


def loss_at(curve: list[tuple[float, float]], batches: float, window: float) -> float | None:
    """Mean loss of the curve's steps that end in (batches - window, batches]; None if there are none.

    Two runs compared at the same `batches` and `window` have trained on the same number of batches."""
    picked = [loss for x, loss in curve if batches - window < x <= batches]
    return sum(picked) / len(picked) if picked else None
