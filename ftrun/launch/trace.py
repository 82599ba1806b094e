"""OUT/trace.json of an `ftrun launch` job: Chrome trace-event JSON (open in https://ui.perfetto.dev).

    launch_trace(events, history, diagnosis) -> dict     pure: the job's events, the lighthouse's, the monitor's
    write_trace(out_dir, history, diagnosis) -> path     reads OUT/events.jsonl, writes OUT/trace.json

Tracks: "lighthouse" (its quorums and membership changes as instant events), "diagnosis" (each verdict change
as an instant event whose args hold the reason, the ranks and the wait-for graph drawn on the status page,
a span for as long as a verdict names something, and each eviction), and one process per replica, one
thread per incarnation, with a span per committed step and its kills and restarts. Every event carries the
launcher's monotonic clock; the trace starts at the earliest one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from ftrun.diagnose import graph

_US = 1e6
_REPLICA_EVENTS = ("kill", "restart", "evict", "gave_up", "ready")
_SKIP_ARGS = ("t", "event")


def launch_trace(events: Iterable[dict], history: Iterable[dict], diagnosis: dict | None) -> dict[str, Any]:
    events, history = list(events), list(history)
    verdicts = list((diagnosis or {}).get("verdicts") or [])
    evictions = list((diagnosis or {}).get("evictions") or [])
    times = [e["t"] for e in events + history + verdicts + evictions if isinstance(e.get("t"), (int, float))]
    t0 = min(times, default=0.0)
    pids: dict[str, int] = {"lighthouse": 0, "diagnosis": 1}
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
    for name, p in pids.items():
        out.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": p}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"clock": "the launcher's monotonic clock, from the job's first event", "t0": t0}}


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


def write_trace(out_dir: str, history: Iterable[dict], diagnosis: dict | None) -> str:
    path = os.path.join(out_dir, "trace.json")
    trace = launch_trace(read_events(os.path.join(out_dir, "events.jsonl")), history, diagnosis)
    with open(path, "w") as f:
        json.dump(trace, f, default=str)
    return path
