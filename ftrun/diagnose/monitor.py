"""The diagnosis monitor beside the lighthouse of a real job (`ftrun launch` runs one).

It owns a Collector (ftrun.diagnose.collect) that the job's ranks register with (FTRUN_DIAGNOSE) and
pulls every rank's telemetry every `interval_s` (2 s), or every `late_interval_s` (0.25 s) while a step
is late. Late: the lighthouse has handed out no quorum for quorum_late_factor step periods (while too
few quorums give a period: for cold_late_s, or it has held a quorum request for late_min_s; `quorum_late`,
checked every late_interval_s without pulling anything: every step asks for a quorum), or the last pull
showed an all-reduce or a replica collective running well past its usual time, or a rank that stopped
answering (`step_late`). A hang waiting for confirmation is pulled again as soon as its confirmation is
due (`next_interval`: a second pull right after, not a period later). Each round it analyzes and applies
the eviction rule (ftrun.diagnose.act); a confirmed culprit is evicted at once: `on_evict` tells the launcher, which
(if that incarnation still runs) has the lighthouse stop counting its replica (ftrun.quorum.decide rule
9) and kills it (its restart follows); without `on_evict` the monitor evicts at the lighthouse itself. An incarnation is evicted at most once. `ftrun diagnose --lighthouse` reaches
`verdict()` through the lighthouse's own authenticated channel.

`quorum_late`, `step_late` and `next_interval` are pure; the loop around them is the driver.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ftrun.diagnose.act import EvictionConfig
from ftrun.diagnose.collect import Collector, CollectorConfig
from ftrun.diagnose.model import CANDIDATES, HANG, AnalysisConfig, Layout, Snapshot
from ftrun.diagnose.summary import RUNNING
from ftrun.diagnose.telemetry import Ev
from ftrun.env.base import Env

log = logging.getLogger("ftrun.diagnose")
MAX_VERDICTS_KEPT = 200
# A silent (stopped) rank holds each pull for pull_timeout_s, so a hang is confirmed by the next pull (the
# same culprits and silent ranks on two pulls at least pull_timeout_s apart). A collective that has not
# moved for stall_s is blocked; for silent_stall_s when one of its ranks did not answer that pull.
COLLECTOR = CollectorConfig(pull_timeout_s=0.4, analysis=AnalysisConfig(stall_s=1.0, silent_stall_s=0.2),
                            eviction=EvictionConfig(confirm_s=0.2))


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    interval_s: float = 2.0  # between pulls while the job is healthy
    late_interval_s: float = 0.25  # between pulls while a step is late or a hang is being confirmed
    late_factor: float = 3.0  # a collective running longer than this multiple of the usual all-reduce is late
    late_min_s: float = 0.25  # ... and longer than this
    quorum_late_factor: float = 2.0  # no quorum for this multiple of the usual period is late (a pull is cheap)
    cold_late_s: float = 0.5  # no quorum for this long is late while too few quorums give a step period

    def __post_init__(self) -> None:
        if (not 0 < self.late_interval_s <= self.interval_s or self.late_factor <= 1 or self.late_min_s < 0
                or self.cold_late_s <= 0 or self.quorum_late_factor <= 1):
            raise ValueError(f"MonitorConfig: need 0 < late_interval_s <= interval_s, late_factor > 1, "
                             f"quorum_late_factor > 1, late_min_s >= 0 and cold_late_s > 0, got {self}")


def step_late(snap: Snapshot, layout: Layout, config: MonitorConfig) -> bool:
    """Whether the job looks late: a registered rank did not answer, or an all-reduce (or a replica
    collective) has been running for more than late_factor times the usual all-reduce (median over the
    ranks' recent history) and at least late_min_s."""
    ans, s, h = snap.answered, snap.summary, snap.hist
    if not len(ans):
        return False
    if not ans.all():
        return True
    done = (h["cid"] >= 0) & ans[:, None]
    usual = float(np.median((h["done"] - h["enter"])[done])) if done.any() else 0.0
    limit = max(config.late_factor * usual, config.late_min_s)
    ftar = (s["f_state"] == RUNNING) & (snap.now - s["f_enter"] > limit)
    tree = (s["t_cid"] >= 0) & (s["t_ev"] != Ev.DONE) & (snap.now - s["t_t"] > limit)
    return bool((ftar | tree).any())


def quorum_late(quorum_times: list[float], now: float, config: MonitorConfig,
                waiting_since: float | None = None) -> bool:
    """Whether the next quorum is overdue: more than quorum_late_factor times the median period of the
    recent quorums (and late_min_s) since the last one. With fewer than three quorums (the job's first
    steps, no period yet): more than cold_late_s, or a quorum request the lighthouse has held for more
    than late_min_s (`waiting_since`: when the oldest pending one was made, None: none pends; the round
    waits for a replica that has not asked, whose leader may wait on a hung rank). False before the
    first quorum (start-up)."""
    if not quorum_times:
        return False
    if len(quorum_times) < 3:
        held = waiting_since is not None and now - waiting_since > config.late_min_s
        return held or now - quorum_times[-1] > config.cold_late_s
    period = float(np.median(np.diff(quorum_times)))
    return now - quorum_times[-1] > max(config.quorum_late_factor * period, config.late_min_s)


def next_interval(verdict: dict, late: bool, config: MonitorConfig, now: float | None = None) -> float:
    """Seconds to the next pull: interval_s, late_interval_s while late or hung; a hang whose eviction waits
    for confirmation (`verdict["eviction"]["retry_at"]`) is pulled again as soon as that is due."""
    fast = late or verdict.get("kind") in (HANG, CANDIDATES)
    wait = config.late_interval_s if fast else config.interval_s
    retry_at = (verdict.get("eviction") or {}).get("retry_at")
    if retry_at is not None and now is not None:
        wait = min(wait, max(retry_at - now, 0.0))
    return wait


EvictFn = Callable[[dict], None]  # {replica, replica_id, incarnation, t, reason, verdict, ranks, silent}


class Monitor:
    """Threading: `start`/`stop` from the owner; the loop is its own task; `verdict()` from any task."""

    def __init__(self, *, env: Env, token: str, lighthouse: Any = None, on_evict: EvictFn | None = None,
                 on_verdict: Callable[[dict], None] | None = None, bind: str = "127.0.0.1:0",
                 config: MonitorConfig = MonitorConfig(), collector: CollectorConfig = COLLECTOR) -> None:
        self.env, self.config, self.lighthouse = env, config, lighthouse
        self.on_evict, self.on_verdict = on_evict, on_verdict
        self.collector = Collector(env=env, token=token, bind=bind, config=collector)
        self.latest: dict | None = None
        self.verdicts: list[dict] = []  # each change of verdict (kind, ranks), with its time
        self.evictions: list[dict] = []
        self.rounds = 0
        self._evicted: set[tuple[int, int]] = set()  # (replica, incarnation)
        self._stop = env.event()
        self._task = None
        self.addr = ""

    def start(self) -> str:
        self.addr = self.collector.start()
        self._task = self.env.spawn(self._loop, name="diagnose-monitor")
        if self.lighthouse is not None:
            self.lighthouse.diagnosis = self.verdict
            self.lighthouse.diagnosis_report = self.report
        return self.addr

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.join(timeout=10.0)
        self.collector.stop()

    def verdict(self) -> dict:
        """The verdict now (a fresh pull and analysis), for `ftrun diagnose --lighthouse`."""
        return self.collector.diagnose()

    def report(self) -> dict:
        cost = list(self.collector.cost.values())
        return {"rounds": self.rounds, "latest": self.latest, "serve_s": sum(c["serve_s"] for c in cost),
                "records": sum(c["written"] for c in cost), "verdicts": self.verdicts[-MAX_VERDICTS_KEPT:],
                "evictions": self.evictions, "config": {"interval_s": self.config.interval_s,
                                                        "late_interval_s": self.config.late_interval_s}}

    def _quorum_times(self, n: int = 16) -> list[float]:
        history = getattr(self.lighthouse, "history", None)
        if history is None:
            return []
        return [h["t"] for h in list(history)[-4 * n:] if h.get("event") == "quorum"][-n:]

    def _waiting_since(self) -> float | None:
        waiting = getattr(self.lighthouse, "waiting_since", None)
        return waiting() if waiting is not None else None

    def _loop(self) -> None:
        due = self.env.clock.now() + self.config.interval_s
        while not self._stop.wait(timeout=min(self.config.late_interval_s, max(due - self.env.clock.now(), 0.0))):
            now = self.env.clock.now()
            if now < due and not quorum_late(self._quorum_times(), now, self.config, self._waiting_since()):
                continue
            try:
                due = self.env.clock.now() + self._round()
            except Exception:  # a monitor outlives one bad round; the error is logged with its traceback
                log.exception("diagnosis round failed")
                due = self.env.clock.now() + self.config.interval_s

    def _round(self) -> float:
        v = self.collector.diagnose()
        self.latest, self.rounds = v, self.rounds + 1
        last = self.verdicts[-1] if self.verdicts else None
        if last is None or (last["kind"], last["ranks"], last["silent"]) != (v["kind"], v["ranks"], v["silent"]):
            entry = {k: v[k] for k in ("t", "kind", "reason", "ranks", "silent", "hosts", "replicas", "collectives")}
            entry.update({k: v[k] for k in ("rank_names", "edges") if k in v})  # for the graph in the reports
            self.verdicts.append(entry)
            if self.on_verdict is not None:
                self.on_verdict(entry)
        ev = v["eviction"]
        for rep, inc, rid in zip(ev["replicas"], ev["incarnations"], ev["replica_ids"]):
            if (rep, inc) in self._evicted:
                continue
            self._evicted.add((rep, inc))
            entry = {"replica": rep, "replica_id": rid, "incarnation": inc, "t": self.env.clock.now(),
                     "reason": ev["reason"], "verdict": v["reason"], "ranks": v["ranks"], "silent": v["silent"]}
            self.evictions.append(entry)
            log.warning("diagnosis evicts replica %d (incarnation %d): %s", rep, inc, ev["reason"])
            if self.on_evict is not None:  # the launcher checks the incarnation is still running, then evicts
                self.on_evict(entry)
            elif self.lighthouse is not None:
                self.lighthouse.evict((rid,), ev["reason"])
        snap_layout = self.collector.last_input
        late = snap_layout is not None and step_late(*snap_layout, self.config)
        return next_interval(v, late, self.config, self.env.clock.now())
