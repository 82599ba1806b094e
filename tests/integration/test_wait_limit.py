"""The catch-up wait limit (paper §6.1) end to end: 3 replicas x 1 rank as real processes on 127.0.0.1.

The job of test_ft_training (its Job harness, bitwise and exactly-once checks) with this module's
worker: ftrun.train.ft_worker with a wait limit (--wait-limit) and a slow heal: a restarted replica sleeps
between fetching and loading the state (--slow-heal-file, per replica and incarnation), which to the
healthy replicas is a fetch slower than a step. It also prints a "forward" event per forward/backward.

(a) the heal ends past the healthy replicas' compute but within the wait limit: they wait for it in the
    FTAR, the joiner contributes at that step, nothing is aborted;
(b) the heal ends past compute + wait limit: the healthy replicas give up after the wait limit (not
    ftar_timeout_s), that step is aborted once, and the joiner trains the retried step with them, which
    the healthy replicas run on their kept gradients (no second forward).
Both end with every replica bitwise identical and the exactly-once audit holding. Run with -s for the
measured figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

STEP_TIME = 0.2  # simulated compute per step
WAIT_LIMIT = 1.5
FTAR_TIMEOUT = 5.0  # far above the wait limit: a give-up at the limit is the limit's doing
SLOW_WITHIN = 0.7  # heal past the compute, within the limit
SLOW_PAST = 3.0  # heal past compute + limit (and well within the lighthouse's join timeout)
JOIN_TIMEOUT = 5.0


# -- the worker ----------------------------------------------------------------------------------
def worker_main(argv: list[str]) -> int:
    """ft_worker with a wait limit, a slow heal and forward events (see the module docstring)."""
    from ftrun.train import ft_worker

    p = argparse.ArgumentParser()
    p.add_argument("--wait-limit", type=float, required=True)
    p.add_argument("--slow-heal-file", required=True)
    ours, rest = p.parse_known_args(argv)
    config_from, on_phase = ft_worker.config_from, ft_worker.Faults.on_phase

    def slow_on_phase(self, phase: str, step: int) -> None:
        if phase == "forward":
            print(json.dumps({"event": "forward", "t": time.monotonic(), "step": step}), flush=True)
        if phase == "heal":
            try:
                plan = json.loads(Path(ours.slow_heal_file).read_text())
            except FileNotFoundError:
                plan = {}
            if (plan.get("replica"), plan.get("incarnation")) == (self.spec.replica_id, self.spec.incarnation):
                time.sleep(plan["seconds"])
        on_phase(self, phase, step)

    def with_wait_limit(args):
        cfg = config_from(args)
        return replace(cfg, catchup=replace(cfg.catchup, wait_limit_s=ours.wait_limit))

    ft_worker.config_from = with_wait_limit
    ft_worker.Faults.on_phase = slow_on_phase
    return ft_worker.main(rest)


if __name__ == "__main__":
    code = worker_main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)


# -- the tests -----------------------------------------------------------------------------------
from tests.integration.test_ft_training import IDS, Job, check_bitwise, check_exactly_once  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class WaitJob(Job):
    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        lh = self.lighthouse
        lh.config = replace(lh.config, timeouts=replace(lh.config.timeouts, join_timeout_s=JOIN_TIMEOUT))
        argv = ["-m", "tests.integration.test_wait_limit", "--steps", "100000", "--step-time", str(STEP_TIME),
                "--ftar-timeout", str(FTAR_TIMEOUT), "--stop-file", str(run_dir / "stop"),
                "--fault-file", str(run_dir / "faults.json"), "--wait-limit", str(WAIT_LIMIT),
                "--slow-heal-file", str(run_dir / "slow.json")]
        for rep in self.replicas.values():
            rep.argv = argv

    def slow_heal(self, rid: str, incarnation: int, seconds: float) -> None:
        self._write("slow.json", json.dumps({"replica": rid, "incarnation": incarnation, "seconds": seconds}))

    def at(self, kind: str, rid: str, step: int, incarnation: int | None = None) -> list[dict]:
        return [e for e in self.of(kind, rid, incarnation) if e.get("step") == step]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with WaitJob(tmp_path_factory.mktemp("wait")) as shared:
        shared.pump(lambda: bool(shared.commits()))
        shared.min_replicas(2)  # two go on while the third restarts
        yield shared
        shared.plan()
        shared.finish()
    check_bitwise(shared)
    check_exactly_once(shared, finished=True)


def rejoin_slowly(job: WaitJob, victim: str, seconds: float) -> tuple[int, int]:
    """Kill `victim` before a step, let it restart and heal `seconds` too slowly; returns (its new
    incarnation, the step it healed to) once it has committed three steps."""
    first = job.incarnation(victim)
    job.slow_heal(victim, first + 1, seconds)
    job.plan(die_at=f"step={job.max_step() + 2},phase=quorum,replica={victim},incarnation={first}")
    job.pump(lambda: job.rejoined(victim, first + 1), timeout=45.0)
    job.plan()
    assert job.exits[(victim, first)] == -9
    return first + 1, job.of("heal", victim, first + 1)[0]["to_step"]


def test_a_joiner_within_the_wait_limit_is_waited_for(job):
    """(a) r1's heal ends ~0.5 s after the healthy replicas' compute, within the 1.5 s limit: they wait
    in the FTAR, r1 contributes its zeros at that step and nothing is aborted."""
    victim, healthy = "r1", ("r0", "r2")
    incarnation, n = rejoin_slowly(job, victim, SLOW_WITHIN)
    joined = job.at("step", victim, n, incarnation)
    assert [(e["healed"], e["committed"], e["loss"]) for e in joined] == [(True, True, None)]
    for rid in healthy:
        assert [e["committed"] for e in job.at("step", rid, n)] == [True], rid  # no abort
        assert job.at("step", rid, n)[0]["participants"] == list(IDS)
        wait, = job.at("catchup_wait", rid, n)
        assert wait["action"] == "wait" and wait["behind"] == [victim], wait
        assert wait["stall_s"] > 0.1, wait  # it waited ("wait": within the limit, or it would say next_step)
        assert job.at("error", rid, n) == []
    check_bitwise(job)
    check_exactly_once(job, finished=False)
    stalls = [round(job.at("catchup_wait", rid, n)[0]["stall_s"], 3) for rid in healthy]
    print(f"\n[wait] {victim} healed to step {n} {SLOW_WITHIN}s late; healthy replicas waited {stalls}s "
          f"(limit {WAIT_LIMIT}s), step {n} committed by all three")


def test_a_joiner_past_the_wait_limit_joins_one_step_later(job):
    """(b) r2's heal ends past compute + limit: r0 and r1 give up after the 1.5 s limit (ftar_timeout_s
    is 5 s), step n is aborted once; r2, healed to n meanwhile, fails its own exchange at once, and
    trains the retried step n with them; r0 and r1 reuse their kept gradients (one forward each)."""
    victim, healthy = "r2", ("r0", "r1")
    incarnation, n = rejoin_slowly(job, victim, SLOW_PAST)
    joined = job.at("step", victim, n, incarnation)
    assert [(e["healed"], e["committed"]) for e in joined] == [(True, False), (False, True)], joined
    assert joined[1]["loss"] is not None and joined[1]["participants"] == list(IDS)  # it trains the retry
    assert len(job.at("forward", victim, n, incarnation)) == 1
    figures = {}
    for rid in healthy:
        attempts = job.at("step", rid, n)
        assert [e["committed"] for e in attempts] == [False, True], (rid, attempts)  # aborted once
        assert attempts[1]["participants"] == list(IDS) and attempts[0]["loss"] == attempts[1]["loss"]
        wait, = job.at("catchup_wait", rid, n)
        assert wait["action"] == "next_step" and wait["behind"] == [victim], wait
        assert 0.8 * WAIT_LIMIT <= wait["stall_s"] < FTAR_TIMEOUT, wait  # the limit, not ftar_timeout_s
        assert len(job.at("forward", rid, n)) == 1, rid  # the retry reused the kept gradient
        forward, = job.at("forward", rid, n)
        figures[rid] = {"stall_s": round(wait["stall_s"], 3), "abort_after_forward_s": round(
            attempts[0]["t"] - forward["t"], 3), "commit_after_forward_s": round(attempts[1]["t"] - forward["t"], 3)}
    # the joiner's own exchange of the aborted step failed at once, not after ftar_timeout_s
    heal, = job.of("heal", victim, incarnation)
    assert joined[0]["t"] - heal["t"] < FTAR_TIMEOUT, (heal, joined[0])
    check_bitwise(job)
    check_exactly_once(job, finished=False)
    print(f"\n[next step] {victim} healed to step {n} {SLOW_PAST}s late, voted no "
          f"{joined[0]['t'] - heal['t']:.3f}s after healing and trained the retry; healthy: {json.dumps(figures)}")
