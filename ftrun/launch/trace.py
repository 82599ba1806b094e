"""OUT/trace.json of a job, real (`ftrun launch`) or emulated (`ftrun emulate`, whose Recorder converts to the
same event dicts: harness.report_files.launch_schema): Chrome trace-event JSON (open in https://ui.perfetto.dev).

    launch_trace(events, history, diagnosis, spans=None) -> dict   pure: the job's events, the lighthouse's, the
                                                                   monitor's, and the leaders' phase spans
    write_trace(out_dir, history, diagnosis, spans) -> path   reads OUT/events.jsonl, writes OUT/trace.json

Tracks: "lighthouse" (its quorums and membership changes as instant events), "diagnosis" (each verdict change
as an instant event whose args hold the reason, the ranks and the wait-for graph drawn on the status page,
a span for as long as a verdict names something, and each eviction), and one process per replica, one
thread per incarnation, with a span per committed step, the leader's phase spans (`ftrun::<component>::<op>`,
where recorded) and its kills, restarts, hangs and the supervisor's other replica events; job-level faults are
instants on the "job" track. Every event carries one clock (the launcher's monotonic clock, or the emulator's
modeled time); the trace starts at the earliest one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from ftrun.diagnose import graph

_US = 1e6
_REPLICA_EVENTS = ("kill", "restart", "evict", "gave_up", "ready", "hang", "fault_end", "start", "noticed", "allocated",
                   "failed", "teardown", "no_capacity", "rank_died", "heal")
_JOB_EVENTS = ("fault", "stop", "steady", "lighthouse_kill", "lighthouse_restart", "cut_start", "cut_end", "slow_fetch")
Span = tuple[str, int, str, float, float]  # (replica_id, incarnation, name, t0, t1)
_SKIP_ARGS = ("t", "event")


def launch_trace(events: Iterable[dict], history: Iterable[dict], diagnosis: dict | None,
                 spans: Iterable[Span] | None = None, *,
                 clock: str = "the launcher's monotonic clock, from the job's first event") -> dict[str, Any]:
    events, history, spans = list(events), list(history), list(spans or ())
    verdicts = list((diagnosis or {}).get("verdicts") or [])
    evictions = list((diagnosis or {}).get("evictions") or [])
    times = [e["t"] for e in events + history + verdicts + evictions if isinstance(e.get("t"), (int, float))]
    t0 = min(times + [span[3] for span in spans], default=0.0)
    pids: dict[str, int] = {"lighthouse": 0, "diagnosis": 1, "job": 2}
    out: list[dict[str, Any]] = []

    def ts(t: float) -> float:
        return round((t - t0) * _US, 3)

    def pid(rid: str) -> int:
        return pids.setdefault(f"replica {rid}", len(pids))

    for h in history:
        name = f"quorum {h.get('quorum_id')} (step {h.get('max_step')})" if h.get("event") == "quorum" else \
            f"{h.get('event')} {h.get('replica_id', '')}".strip()
        out.append({"name": name, "cat": "quorum", "ph": "i", "s": "p", "pid": 0, "tid": 0, "ts": ts(h["t"]),
                    "args": {k: v for k, v in h.items() if k not in _SKIP_ARGS}})
    out += graph.trace_events(verdicts, pid=1, t0=t0, t_end=max(times, default=t0))
    for x in evictions:
        out.append({"name": f"evict {x.get('replica_id')}", "cat": "diagnosis", "ph": "i", "s": "p", "pid": 1,
                    "tid": 0, "ts": ts(x["t"]), "args": {k: v for k, v in x.items() if k not in _SKIP_ARGS}})
    last: dict[tuple[str, int], float] = {}
    for e in events:
        rid, kind, t = e.get("replica_id"), e.get("event"), e.get("t")
        if not isinstance(rid, str) or not isinstance(t, (int, float)):
            continue
        inc = int(e.get("incarnation", 0))
        if kind == "commit" and e.get("rank", 0) == 0 and isinstance(e.get("step"), int):
            start = last.get((rid, inc))
            if start is not None:
                out.append({"name": f"step {e['step'] - 1}", "cat": "step", "ph": "X", "pid": pid(rid), "tid": inc,
                            "ts": ts(start), "dur": round((t - start) * _US, 3)})
            last[(rid, inc)] = t
        elif kind in _REPLICA_EVENTS and e.get("rank", 0) == 0:
            out.append({"name": str(kind), "cat": "job", "ph": "i", "s": "t", "pid": pid(rid), "tid": inc,
                        "ts": ts(t), "args": {k: v for k, v in e.items() if k not in _SKIP_ARGS}})
    for e in events:
        if e.get("event") in _JOB_EVENTS and not isinstance(e.get("replica_id"), str) and "t" in e:
            out.append({"name": str(e.get("fault") or e["event"]), "cat": "job", "ph": "i", "s": "p", "pid": 2,
                        "tid": 0, "ts": ts(e["t"]), "args": {k: v for k, v in e.items() if k not in _SKIP_ARGS}})
    for rid, inc, name, a, b in spans:
        out.append({"name": name, "cat": name.split("::")[1] if name.count("::") >= 2 else "phase", "ph": "X",
                    "pid": pid(rid), "tid": inc, "ts": ts(a), "dur": round((b - a) * _US, 3)})
    for name, p in pids.items():
        out.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": p}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"clock": clock, "t0": t0}}


def read_events(path: str) -> list[dict]:
    """The JSON lines of an events.jsonl; a torn or malformed line is skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)
    return out


def write_trace(out_dir: str, history: Iterable[dict], diagnosis: dict | None, spans: Iterable[Span] | None = None,
                **kw: str) -> str:
    """OUT/trace.json from OUT/events.jsonl (both `ftrun launch` and `ftrun emulate --out` write it)."""
    path = os.path.join(out_dir, "trace.json")
    trace = launch_trace(read_events(os.path.join(out_dir, "events.jsonl")), history, diagnosis, spans, **kw)
    with open(path, "w") as f:
        json.dump(trace, f, default=str)
    return path
