"""The pure reduction of one rank's records to what the analysis reads (kilobytes at 98K ranks).

`summarize(records, now)` returns one `SUMMARY` row: the rank's latest FTAR all-reduce (id, ring place,
chunk steps done of how many, chunks sent, state, when it entered and last moved), its latest tree
collective, quorum ask and catch-up fetch; and `HIST_LEN` `HIST` rows, one per completed all-reduce,
newest last (unused rows have cid = -1): enter and done times, and the send busy time, the time the
rank's sends to its next ring rank spent on the wire (a send's completion minus the later of its
chunk step and the previous send's completion), the signature of a slow link.

A modeled all-reduce (MODEL / MODEL_END records, the emulator's analytic rings) reads as a chunk run would:
its progress counters are interpolated between its modeled start and end at `now` (at its end once done, at
its failure if it failed), so a snapshot mid-all-reduce shows it moving, and its history row takes the
modeled send busy time and bytes.
"""

from __future__ import annotations

import numpy as np

from ftrun.diagnose.telemetry import RECORD, Ev, Op, w48

HIST_LEN = 8

# FTAR state of a rank in its latest all-reduce
NONE, RUNNING, DONE, FAILED = 0, 1, 2, 3

SUMMARY = np.dtype([
    ("now", "<f8"), ("f_qid", "<i4"), ("f_cid", "<i4"), ("f_step", "<i4"), ("f_state", "u1"),
    ("f_ring", "<i4"), ("f_index", "<i4"), ("f_total", "<i4"), ("f_steps", "<i4"), ("f_recvd", "<i4"),
    ("f_used", "<i4"), ("f_sends", "<i4"), ("f_sent", "<i4"), ("f_fail_peer", "<i4"), ("f_enter", "<f8"), ("f_last", "<f8"),
    ("t_cid", "<i4"), ("t_ev", "u1"), ("t_t", "<f8"),
    ("q_step", "<i4"), ("q_ev", "u1"), ("q_t", "<f8"),
    ("c_step", "<i4"), ("c_ev", "u1"), ("c_t", "<f8"),
])
HIST = np.dtype([("qid", "<i4"), ("cid", "<i4"), ("step", "<i4"), ("enter", "<f8"), ("done", "<f8"),
                 ("busy", "<f8"), ("sent_bytes", "<f8")])


def empty_summary() -> np.ndarray:
    s = np.zeros(1, SUMMARY)
    for f in ("f_qid", "f_cid", "f_step", "f_fail_peer", "t_cid", "q_step", "c_step", "f_index"):
        s[f] = -1
    return s


def empty_hist(n: int = HIST_LEN) -> np.ndarray:
    h = np.zeros(n, HIST)
    h["cid"] = h["qid"] = h["step"] = -1
    return h


def summarize(records: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
    """(one SUMMARY row, HIST_LEN HIST rows) from one rank's records, oldest first."""
    if records.dtype != RECORD:
        raise ValueError(f"summarize needs telemetry RECORD rows, got dtype {records.dtype}")
    s, h = empty_summary(), empty_hist()
    s["now"] = now
    for op, prefix in ((Op.TREE, "t"), (Op.QUORUM, "q"), (Op.CATCHUP, "c")):
        idx = np.flatnonzero(records["op"] == op)
        if idx.size:
            last = records[idx[-1]]
            s[f"{prefix}_{'cid' if op == Op.TREE else 'step'}"] = last["cid"]
            s[f"{prefix}_ev"], s[f"{prefix}_t"] = last["ev"], last["t"]
    ftar = records[records["op"] == Op.FTAR]
    enters = np.flatnonzero(ftar["ev"] == Ev.ENTER)
    if enters.size:
        _current(s, ftar[enters[-1]:], now)
        done = [ftar[a:b] for a, b in zip(enters, list(enters[1:]) + [len(ftar)])]
        done = [op for op in done if (op["ev"] == Ev.DONE).any()][-HIST_LEN:]
        for row, op in zip(h[HIST_LEN - len(done):], done):
            _history(row, op)
    return s, h


def _current(s: np.ndarray, op: np.ndarray, now: float) -> None:
    enter, ev = op[0], op["ev"]
    s["f_qid"], s["f_cid"], s["f_step"] = enter["qid"], enter["cid"], enter["step"]
    s["f_ring"], s["f_index"], s["f_total"] = enter["aux"], enter["peer"], enter["seq"]
    s["f_enter"], s["f_last"] = enter["t"], op["t"][ev != Ev.MODEL_END].max()
    fail = np.flatnonzero(ev == Ev.FAIL)
    if fail.size:
        s["f_state"], s["f_fail_peer"] = FAILED, op["peer"][fail[0]]
    else:
        s["f_state"] = DONE if (ev == Ev.DONE).any() else RUNNING
    model, end = np.flatnonzero(ev == Ev.MODEL), np.flatnonzero(ev == Ev.MODEL_END)
    if model.size and end.size:
        _modeled(s, op[model[0]], float(op["t"][end[0]]), now)
        return
    steps, last_hop = ev == Ev.STEP, 2 * int(enter["aux"]) - 2
    hops = op["aux"][steps]
    s["f_steps"], s["f_used"], s["f_recvd"] = int(steps.sum()), int((hops > 0).sum()), int((ev == Ev.RECV).sum())
    s["f_sends"] = int((hops < last_hop).sum())
    s["f_sent"] = int((ev == Ev.SEND).sum())


def _modeled(s: np.ndarray, model: np.void, end: float, now: float) -> None:
    """Progress of a modeled all-reduce: the fraction of [start, end] passed at `now` (running), at its end
    (done) or where it failed. Every send step also receives (hop > 0) except the C hop-0 steps, and the
    schedule's sends are its (2N - 2) C hops before the last: so received = used = sent = sends so far."""
    start, state = float(model["t"]), int(s["f_state"][0])
    at = min(now, end) if state == RUNNING else end if state == DONE else min(float(s["f_last"][0]), end)
    frac = 1.0 if end <= start else min(max((at - start) / (end - start), 0.0), 1.0)
    total, sends = int(model["seq"]), int(model["aux"])
    done_sends = int(frac * sends)
    s["f_steps"] = int(frac * total)
    s["f_used"] = s["f_recvd"] = s["f_sends"] = s["f_sent"] = done_sends
    s["f_last"] = max(float(s["f_last"][0]), at)


def _history(row: np.void, op: np.ndarray) -> None:
    ev = op["ev"]
    row["qid"], row["cid"], row["step"], row["enter"] = op[0]["qid"], op[0]["cid"], op[0]["step"], op[0]["t"]
    row["done"] = op["t"][ev == Ev.DONE][0]
    model, end = op[ev == Ev.MODEL], op[ev == Ev.MODEL_END]
    if model.size and end.size:
        row["busy"], row["sent_bytes"] = float(w48(end[:1])[0]) / 1e9, float(w48(model[:1])[0])
        return
    produced = op["t"][(ev == Ev.STEP) & (op["aux"] < 2 * int(op[0]["aux"]) - 2)]
    sent = op["t"][ev == Ev.SEND]
    n = min(len(produced), len(sent))
    if n:
        start = np.maximum(produced[:n], np.concatenate([[produced[0]], sent[:n - 1]]))
        row["busy"] = float(np.clip(sent[:n] - start, 0, None).sum())
        row["sent_bytes"] = float(op["nbytes"][ev == Ev.SEND].sum())
