"""Root-cause analysis at scale: accuracy and time over seeded synthetic fault scenarios.

Usage: python benchmarks/diagnose_analysis.py [--replicas 12] [--ranks-per-replica 8192] [--scenarios 40]
                                              [--fault-free 10] [--seed 0] [--ftar-mb 32] [--json]
Each scenario synthesizes the telemetry summaries the collector would gather from every rank of a
replicas x ranks job (FTAR ring per rank index across replicas) with one injected fault of a random
kind and place (ftrun_bench.diagnose_synth), runs the pure analysis and checks the verdict against the
injected culprit. Fault-free runs count false positives, and the eviction rule is applied to every
verdict to count false evictions. Also measured in the same run: the cost of one telemetry record, the
bytes per rank held (ring buffer) and collected (summary), and an FTAR all-reduce (threads on loopback)
with telemetry off and on, alternating.
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftrun.diagnose.act import decide_eviction  # noqa: E402
from ftrun.diagnose.analysis import CANDIDATES, NO_HANG, analyze  # noqa: E402
from ftrun.diagnose.summary import HIST, HIST_LEN, SUMMARY  # noqa: E402
from ftrun_bench.diagnose_synth import KINDS, JobShape, scenario  # noqa: E402
from ftrun.diagnose.telemetry import Recorder  # noqa: E402


WAIT_LIMIT_S = 10.0  # EvictionConfig's default: the FTAR timeout


class _Clock:
    now = staticmethod(time.perf_counter)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def ns_per_record(n: int = 200_000) -> float:
    rec = Recorder(_Clock())
    t = time.perf_counter_ns()
    rec.ftar_enter(1, 1 << 20, 12, 0, n)
    for _ in range(n // 2):
        rec.ftar_step(0, 3, 4096)
        rec.ftar_sent(1, 4096)
    return (time.perf_counter_ns() - t) / (n + 1)


def ftar_overhead(mb: float, num_ranks: int = 3, iters: int = 12) -> dict:
    """Seconds per FTAR all-reduce of `mb` MB over `num_ranks` engines (threads, loopback sockets, CPU
    kernels) with telemetry off and on, alternating in the same run; and the records per all-reduce."""
    from ftrun.env.real import RealEnv
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarConfig, FtarEngine
    env = RealEnv()
    engs = [FtarEngine(env=env, kernels=CpuKernels(), token="bench", config=FtarConfig(chunk_bytes=1 << 20))
            for _ in range(num_ranks)]
    recs = [Recorder(env.clock) for _ in engs]
    ring = [e.addr for e in engs]
    tasks = [env.spawn(lambda e=e, i=i: e.reconfigure(epoch=1, ring=ring, index=i), name="ring")
             for i, e in enumerate(engs)]
    assert all(t.join(30) for t in tasks)
    bufs = [np.ones(int(mb * (1 << 20)) // 4, np.float32) for _ in engs]
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * iters):
        on = bool(i % 2)
        for e, r in zip(engs, recs):
            e.telemetry = r if on else None
        t = time.perf_counter()
        tasks = [env.spawn(lambda e=e, b=b: e.all_reduce(b), name="ar") for e, b in zip(engs, bufs)]
        assert all(tk.join(60) for tk in tasks) and all(tk.exception is None for tk in tasks)
        times[on].append(time.perf_counter() - t)
    for e in engs:
        e.close()
    off, on_ = float(np.min(times[False])), float(np.min(times[True]))  # min: the least disturbed run
    return {"mb": mb, "ranks": num_ranks, "s_off": off, "s_on": on_, "overhead": on_ / off - 1,
            "records_per_all_reduce": recs[0].written // iters}


def judge(verdict, truth) -> str:
    """'exact', 'candidate' or 'miss'."""
    if truth.candidate_kind:
        ok = verdict.kind == CANDIDATES and set(truth.ranks) <= set(verdict.ranks) and len(verdict.ranks) <= 4
        return "candidate" if ok else "miss"
    if verdict.kind != truth.kind:
        return "miss"
    if truth.kind == NO_HANG or set(verdict.ranks) == set(truth.ranks):
        return "exact"
    return "miss"


def run(args: argparse.Namespace) -> dict:
    shape = JobShape(num_replicas=args.replicas, ranks_per_replica=args.ranks_per_replica)
    rng = np.random.default_rng(args.seed)
    faulty = [k for k in KINDS if k != "none"]
    jobs = [(str(rng.choice(faulty)), args.seed * 100_000 + i) for i in range(args.scenarios)]
    jobs += [("none", args.seed * 100_000 + args.scenarios + i) for i in range(args.fault_free)]
    times, exact, cand, cand_total, fp, misses = [], 0, 0, 0, 0, []
    by_kind: dict[str, float] = {}
    false_evictions = should_not_evict = 0
    for kind, seed in jobs:
        snap, layout, truth = scenario(shape, kind, seed)
        t = time.perf_counter()
        verdict = analyze(snap, layout)
        times.append(time.perf_counter() - t)
        by_kind[kind] = max(by_kind.get(kind, 0.0), times[-1])
        got = judge(verdict, truth)
        # as if the same verdict had held for 10 s: would the eviction rule evict a replica that is
        # healthy, or slow but under the wait limit (the FTAR timeout, 10 s), or only maybe at fault?
        evicted = decide_eviction(snap.now, verdict, snap.now - 10.0, args.replicas).replicas
        if kind in ("none", "slow_host", "slow_link", "lost_chunk") and truth.lag_s < WAIT_LIMIT_S:
            should_not_evict += 1
            false_evictions += bool(evicted)
        if kind == "none":
            fp += got != "exact"
        elif truth.candidate_kind:
            cand_total += 1
            cand += got == "candidate"
        else:
            exact += got == "exact"
        if got == "miss":
            misses.append({"seed": seed, "kind": kind, "place": list(truth.ranks[:8]), "verdict": verdict.kind,
                           "named": list(verdict.ranks[:8]), "reason": verdict.reason[:200]})
    exact_total = args.scenarios - cand_total
    return {
        "ranks": shape.num_ranks, "scenarios": args.scenarios, "fault_free_runs": args.fault_free,
        "accuracy": exact / exact_total if exact_total else None, "exact": exact, "exact_total": exact_total,
        "candidate_hits": cand, "candidate_total": cand_total, "false_positive_runs": fp,
        "false_evictions": false_evictions, "eviction_checks": should_not_evict,
        "analysis_s_p50": float(np.percentile(times, 50)), "analysis_s_p99": float(np.percentile(times, 99)),
        "analysis_s_first": times[0], "analysis_s_max_by_kind": by_kind,
        "telemetry_bytes_per_rank": Recorder(_Clock()).nbytes,
        "collected_bytes_per_rank": SUMMARY.itemsize + HIST_LEN * HIST.itemsize,
        "record_ns": ns_per_record(), "misses": misses,
        "ftar": ftar_overhead(args.ftar_mb) if args.ftar_mb > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=12)
    p.add_argument("--ranks-per-replica", type=int, default=8192)
    p.add_argument("--scenarios", type=int, default=40)
    p.add_argument("--fault-free", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ftar-mb", type=float, default=32.0, help="FTAR overhead measurement size; 0 skips it")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.replicas < 3 or args.ranks_per_replica < 8 or args.scenarios < 1 or args.fault_free < 0:
        p.error("need --replicas >= 3, --ranks-per-replica >= 8, --scenarios >= 1, --fault-free >= 0")
    out = run(args)
    print(f"{out['ranks']} ranks: exact {out['exact']}/{out['exact_total']}, candidate sets "
          f"{out['candidate_hits']}/{out['candidate_total']}, false positives {out['false_positive_runs']}/"
          f"{out['fault_free_runs']}, false evictions {out['false_evictions']}/{out['eviction_checks']}; analysis p50 {out['analysis_s_p50'] * 1e3:.1f} ms, p99 "
          f"{out['analysis_s_p99'] * 1e3:.1f} ms; telemetry {out['telemetry_bytes_per_rank']} B/rank held, "
          f"{out['collected_bytes_per_rank']} B/rank collected; {out['record_ns']:.0f} ns/record")
    if out["ftar"]:
        f = out["ftar"]
        print(f"FTAR {f['mb']:g} MB x {f['ranks']} ranks: {f['s_off'] * 1e3:.1f} ms off, {f['s_on'] * 1e3:.1f} ms with "
              f"telemetry ({100 * f['overhead']:+.1f}%, {f['records_per_all_reduce']} records per all-reduce)")
    print("  slowest analysis per kind (ms): " + ", ".join(
        f"{k} {1e3 * t:.0f}" for k, t in sorted(out["analysis_s_max_by_kind"].items())) +
        f"; the first (ring table built) {1e3 * out['analysis_s_first']:.0f}")
    for m in out["misses"]:
        print(f"  miss: seed {m['seed']} {m['kind']} at {m['place']}: got {m['verdict']} {m['named']}: {m['reason']}")
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
