"""Diagnosis on real processes: how fast a SIGSTOPped rank is named and evicted and the survivors commit
again, against the same job without diagnosis; the telemetry's cost; false evictions under kills.

Usage: python benchmarks/diagnose_real.py [--runs 3] [--steps 400] [--step-time 0.05]
                                          [--kill-every 1.5s] [--kill-steps 120] [--json]
Each run launches `ftrun launch --replicas 3 --ranks-per-replica 2 -m ftrun.train.ft_worker` twice, with
diagnosis (the default) and with --no-diagnose (the baseline), waits until every replica committed and
a few steps more, SIGSTOPs rank 1 of r1 and measures from the SIGSTOP (the events carry the monotonic
clock): `named_s` (the first verdict naming r1/1 as a culprit or the silent rank beside one), `evicted_s` (the launcher's evict event) and
`recommit_s` (both survivors committed a step in a new quorum; `survivors_commit_s` in the figures), then stops
the job (SIGTERM). Each row carries the 1-minute load average at the SIGSTOP (`load`).
Telemetry cost: records written and time spent answering pulls over the diagnosed runs (report.json),
with the cost of one record measured here, as a percentage of the ranks' time. False evictions: one
diagnosed run with --kill-every over --kill-steps steps and no SIGSTOP; every evict event is false.
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftrun.diagnose.telemetry import Recorder  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
VICTIM = ("r1", 1)  # not the leader: it keeps the lighthouse heartbeat, so today its peers wait out FTAR


def _events(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _launch(out: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--out", out, "--json", "--no-progress", "--replicas", "3",
           "--ranks-per-replica", "2", "--min-replicas", "2", *extra, "-m", "ftrun.train.ft_worker",
           "--step-time", str(args.step_time)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)


def _wait(out: str, proc: subprocess.Popen, pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pred(_events(out))
        if found:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"ftrun launch exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {timeout}s")


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        stdout, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
    return stdout


def _recommitted(evs: list[dict], since: float) -> float | None:
    """When both survivors had committed a step, after `since`, in a quorum without the stopped incarnation:
    one whose participants leave the victim's replica out, or hold its restarted incarnation. (Counting any
    new quorum id is not enough: near the job's start the id also moves as replicas join.)"""
    free = {e["quorum_id"] for e in evs if e["event"] == "quorum" and e["t"] > since and (
        (e.get("replica_id") != VICTIM[0] and VICTIM[0] not in e.get("participants", [VICTIM[0]]))
        or (e.get("replica_id") == VICTIM[0] and e.get("incarnation", 0) > 0))}
    done = {}
    for e in evs:
        rid = e.get("replica_id")
        if e["event"] == "commit" and rid != VICTIM[0] and e["t"] > since and e["quorum_id"] in free:
            done.setdefault(rid, e["t"])
    return max(done.values()) if len(done) == 2 else None


def one_run(args: argparse.Namespace, diagnose: bool, out: str) -> dict:
    proc = _launch(out, args, "--steps", str(args.steps), "--timeout", "300s",
                   *([] if diagnose else ["--no-diagnose"]))
    try:
        steady = _wait(out, proc, lambda evs: next((e for e in evs if e["event"] == "steady"), None), 180, "steady")
        _wait(out, proc, lambda evs: any(e["event"] == "commit" and e["step"] >= steady["step"] + 5 for e in evs),
              120, "a few more steps")
        pid = next(e["pid"] for e in _events(out) if e["event"] == "ready" and e["replica_id"] == VICTIM[0]
                   and e["rank"] == VICTIM[1] and e["incarnation"] == 0)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        load = os.getloadavg()[0]
        recommit = _wait(out, proc, lambda evs: _recommitted(evs, t0), 120, "the survivors' recommit")
        time.sleep(0.5)  # the last events reach the log
        evs = _events(out)
    finally:
        _stop(proc)
    key = f"{VICTIM[0]}/{VICTIM[1]}"
    named = next((e["t"] for e in evs if e["event"] == "verdict" and e["t"] > t0
                  and (key in e.get("ranks", []) or key in e.get("silent", []))), None)
    evicted = next((e["t"] for e in evs if e["event"] == "evict" and e["t"] > t0), None)
    row = {"diagnose": diagnose, "recommit_s": recommit - t0, "named_s": None if named is None else named - t0,
           "evicted_s": None if evicted is None else evicted - t0, "load": load}
    if diagnose:
        with open(os.path.join(out, "report.json")) as f:
            rep = json.load(f)
        d = rep.get("diagnosis_report") or {}
        row.update(records=d.get("records", 0), serve_s=d.get("serve_s", 0.0), wall_s=rep.get("wall_s"),
                   steps=rep.get("steps_reached"))
    return row


def record_cost_s(n: int = 200_000) -> float:
    class Clock:
        now = staticmethod(time.monotonic)
    rec = Recorder(Clock())
    rec.ftar_enter(1, 1 << 20, 3, 0, 8)
    t = time.perf_counter()
    for _ in range(n):
        rec.ftar_step(0, 1, 2048)
    return (time.perf_counter() - t) / n


def false_evictions(args: argparse.Namespace, out: str) -> dict:
    proc = _launch(out, args, "--steps", str(args.kill_steps), "--kill-every", args.kill_every, "--timeout", "600s")
    stdout = _stop_when_done(proc)
    f = json.loads(stdout.strip().splitlines()[-1])
    evs = _events(out)
    return {"steps": f.get("steps_reached"), "kills": f.get("failures_injected"), "complete": f.get("complete"),
            "false_evictions": sum(e["event"] == "evict" for e in evs),
            "evictions_ignored": sum(e["event"] == "evict_ignored" for e in evs),
            "hang_verdicts": sum(e["event"] == "verdict" and e["kind"] == "hang" for e in evs)}


def _stop_when_done(proc: subprocess.Popen) -> str:
    stdout, _ = proc.communicate(timeout=900)
    return stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=400, help="the job's goal (each run is stopped earlier)")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--kill-every", default="1.5s")
    p.add_argument("--kill-steps", type=int, default=120, help="steps of the false-eviction run (0: skip it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="diagnose-real-") as tmp:
        for i in range(args.runs):
            for diagnose in (True, False):
                try:
                    row = one_run(args, diagnose, os.path.join(tmp, f"run{i}-{'diag' if diagnose else 'base'}"))
                except RuntimeError as e:  # reported, not fatal: the other runs still count
                    row = {"diagnose": diagnose, "error": str(e)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        fe = false_evictions(args, os.path.join(tmp, "kills")) if args.kill_steps else None
    cost = record_cost_s()
    diag = [r for r in rows if r["diagnose"]]
    base = [r for r in rows if not r["diagnose"]]

    def med(rs, key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    rank_s = sum(6 * r["wall_s"] for r in diag if r.get("wall_s"))
    spent = sum(r["records"] * cost + r["serve_s"] for r in diag if r.get("wall_s"))
    figures = {
        "runs": args.runs, "named_s": med(diag, "named_s"), "evicted_s": med(diag, "evicted_s"),
        "recommit_s": med(diag, "recommit_s"), "survivors_commit_s": med(diag, "recommit_s"),
        "baseline_recommit_s": med(base, "recommit_s"), "load": med(rows, "load"),
        "named_in_all_runs": all(r.get("named_s") is not None for r in diag),
        "record_cost_us": cost * 1e6, "telemetry_records": sum(r["records"] for r in diag),
        "telemetry_serve_s": sum(r["serve_s"] for r in diag),
        "telemetry_cost_pct": 100 * spent / rank_s if rank_s else None,
        "false_eviction_run": fe, "rows": rows,
    }
    print(f"SIGSTOP of r1/1, median of {args.runs} runs: named {figures['named_s']}, evicted {figures['evicted_s']}, "
          f"survivors recommit {figures['recommit_s']} s; baseline (--no-diagnose) recommit "
          f"{figures['baseline_recommit_s']} s")
    print(f"telemetry: {figures['telemetry_cost_pct']}% of the ranks' time; false evictions: {fe}")
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
