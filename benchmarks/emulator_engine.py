"""Emulator engine throughput at scale: N ranks (default 98,304, the meta-98k layout) as greenlet tasks
doing a tree gather + broadcast (fan-out 16) over the emulated network, a few rounds.

Every rank listens, connects to its tree parent and accepts its children through the Env API (what the
runtime will do), then each round gathers a sum up the tree and broadcasts it down: about 2N control
messages per round. Prints wall and process-CPU time for setup and rounds (CPU time is the steadier
number on a shared box), events/s (heap events + task resumes), messages/s, modeled (virtual) time per
round, RSS at the end (psutil) and peak RSS (getrusage); `--json` prints one JSON object last.

    PYTHONPATH=. .venv/bin/python benchmarks/emulator_engine.py [--ranks 98304] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.engine import EmulatedWorld  # noqa: E402
from harness.profile import load_profile  # noqa: E402
from harness.topology import Topology  # noqa: E402

TIMEOUT_S = 600.0


def tree_children(rank: int, num_ranks: int, fanout: int) -> range:
    first = rank * fanout + 1
    return range(first, min(first + fanout, num_ranks))


def rank_main(env, rank: int, n: int, fanout: int, rounds: int, shared: dict) -> float:
    """One rank: listen, wire up the tree, then `rounds` of gather-sum + broadcast. Returns the total."""
    listener = env.net.listen("127.0.0.1:0")
    shared["addrs"][rank] = listener.addr
    shared["listening"][0] += 1
    if shared["listening"][0] == n:
        shared["all_listening"].set()
    shared["all_listening"].wait(TIMEOUT_S)
    parent = None
    if rank > 0:
        parent = env.net.connect(shared["addrs"][(rank - 1) // fanout], timeout=TIMEOUT_S)
        parent.send({"hello": rank})
    kids = {}
    for _ in tree_children(rank, n, fanout):
        conn = listener.accept(timeout=TIMEOUT_S)
        kids[conn.recv(TIMEOUT_S)["hello"]] = conn
    listener.close()
    children = [kids[k] for k in sorted(kids)]
    total = 0.0
    for r in range(rounds):
        acc = float(rank)
        for c in children:
            acc += c.recv(TIMEOUT_S)["sum"]
        if parent is not None:
            parent.send({"round": r, "sum": acc})
            total = parent.recv(TIMEOUT_S)["total"]
        else:
            total = acc
            shared["round_done_at"].append(env.clock.now())
            shared["round_wall"].append(time.perf_counter())
            shared["round_cpu"].append(time.process_time())
        for c in children:
            c.send({"round": r, "total": total})
    return total


def raw_greenlet_baseline(num_tasks: int, rounds: int) -> float:
    """Seconds per resume of bare greenlets (no engine): `num_tasks` suspended greenlets resumed in
    turn, `rounds` times. The floor any greenlet emulator pays at this many tasks (cache-cold stacks)."""
    import greenlet

    main = greenlet.getcurrent()

    def body() -> None:
        while True:
            main.switch()

    glets = [greenlet.greenlet(body) for _ in range(num_tasks)]
    for g in glets:
        g.switch()
    t0 = time.process_time()
    for _ in range(rounds):
        for g in glets:
            g.switch()
    per_resume = (time.process_time() - t0) / (num_tasks * rounds)
    for g in glets:
        g.throw(greenlet.GreenletExit)
    return per_resume


def run(num_ranks: int, fanout: int, rounds: int, profile_name: str, cpu_charging: bool,
        cpu_clock: str = "thread") -> dict:
    profile = load_profile(profile_name)
    topo = Topology.from_profile(profile)
    gph = profile.topology.gpus_per_host
    if num_ranks > len(topo.hosts) * gph:
        raise SystemExit(f"{num_ranks} ranks do not fit on {len(topo.hosts)} hosts x {gph} GPUs")
    world = EmulatedWorld(profile.seed, topo, network=profile.network, cpu_charging=cpu_charging,
                          host_cpu_cores=profile.emulation.host_cpu_cores, cpu_clock=cpu_clock)
    driver = world.host_env(topo.hosts[0])
    shared = {"addrs": [None] * num_ranks, "listening": [0], "all_listening": driver.event(), "round_done_at": [],
              "round_wall": [], "round_cpu": []}

    def main() -> float:
        tasks = [world.host_env(topo.hosts[i // gph]).spawn(rank_main, world.host_env(topo.hosts[i // gph]), i,
                                                            num_ranks, fanout, rounds, shared, name=f"rank{i}")
                 for i in range(num_ranks)]
        assert all(t.join(TIMEOUT_S) for t in tasks)
        bad = [t for t in tasks if t.exception is not None]
        if bad:
            raise RuntimeError(f"{len(bad)} ranks failed, first: {bad[0].name}: {bad[0].exception!r}")
        return tasks[-1].result

    t0, c0 = time.perf_counter(), time.process_time()
    total = driver.run(main)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    expected = num_ranks * (num_ranks - 1) / 2
    assert total == expected, (total, expected)
    stats = world.stats()
    raw = raw_greenlet_baseline(num_ranks, 4)
    engine_per_resume = cpu / stats["resumes"]
    done, walls = shared["round_done_at"], [t0] + shared["round_wall"]
    rss = psutil.Process().memory_info().rss
    return {
        "ranks": num_ranks, "fanout": fanout, "rounds": rounds, "profile": profile_name,
        "hosts": stats["hosts"], "cpu_charging": cpu_charging, "cpu_clock": cpu_clock,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),  # process CPU time: less sensitive than wall to other load on the box
        "events": stats["events"] + stats["resumes"],
        "events_per_s": round((stats["events"] + stats["resumes"]) / wall),
        "events_per_cpu_s": round((stats["events"] + stats["resumes"]) / cpu),
        "messages": stats["frames"], "messages_per_s": round(stats["frames"] / wall),
        "virtual_s": round(stats["virtual_s"], 6),
        "virtual_round_s": [round(b - a, 6) for a, b in zip(done, done[1:])],
        "cpu_us_per_resume": round(engine_per_resume * 1e6, 2),
        "raw_greenlet_us_per_resume": round(raw * 1e6, 2),  # baseline measured in this run
        "ratio_vs_raw_greenlets": round(engine_per_resume / raw, 1),
        "rss_mb": round(rss / 2**20, 1),  # psutil, at the end
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # psutil has no peak
        "setup_wall_s": round(walls[1] - walls[0], 3),  # spawn, listen, connect, accept + first round
        "round_wall_s": [round(b - a, 3) for a, b in zip(walls[1:], walls[2:])],
        "round_cpu_s": [round(b - a, 3) for a, b in zip(shared["round_cpu"], shared["round_cpu"][1:])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=98_304)
    ap.add_argument("--fanout", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="meta-98k")
    ap.add_argument("--no-cpu-charging", action="store_true", help="deterministic virtual time")
    ap.add_argument("--cpu-clock", choices=("thread", "perf"), default="thread",
                    help="what CPU charging measures: wall time of a slice, or the thread's CPU time")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    out = run(args.ranks, args.fanout, args.rounds, args.profile, not args.no_cpu_charging, args.cpu_clock)
    print(f"{out['ranks']} ranks on {out['hosts']} hosts, fan-out {out['fanout']}, {out['rounds']} rounds: "
          f"wall {out['wall_s']} s (cpu {out['cpu_s']} s), {out['events_per_s']:,} events/s, "
          f"{out['messages_per_s']:,} msgs/s, "
          f"{out['messages']:,} msgs, peak RSS {out['peak_rss_mb']} MB, virtual {out['virtual_s']} s; "
          f"setup+round 1 {out['setup_wall_s']} s, later rounds {out['round_wall_s']} s wall, "
          f"{out['round_cpu_s']} s cpu; {out['cpu_us_per_resume']} us cpu per task resume = "
          f"{out['ratio_vs_raw_greenlets']}x a bare greenlet resume at this task count (same run)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
