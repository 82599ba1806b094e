"""FT-HSDP training end to end: 3 replicas x 1 rank of ftrun.train.ft_worker as real processes on 127.0.0.1.

The real runtime (lighthouse, quorum, catch-up over HTTP, FTAR, 2PC, DCP checkpoints) runs under the
launcher's ReplicaProcesses; the test is the supervisor: it restarts a replica whose process died and
ends every replica at the same step (the worker's stop file). Faults are scripted through the worker's
fault file (ftrun.train.inject): a replica SIGKILLs itself in a given phase of a step, a catch-up source
corrupts a shard or dies mid-transfer.

A rank process costs ~4 CPU-seconds to start (torch, torch._dynamo on the first optimizer call, numba),
so the scenarios share one long-running job (module fixture, checkpointing every 20 steps) and each
injects its faults into it: one job that survives every phase kill in a row (the checkpoint writer's
included), a dying and a lying catch-up source, and a full restart from its checkpoint. Each scenario
leaves all three replicas up, so none depends on another. After every scenario: every committed step's
parameters are bitwise identical in every replica that committed it (a fingerprint of all parameter bytes, per
step and ledger lineage), and the exactly-once audit over every replica's records holds; when the job
ends, for its final ledger. Run with -s to see the measured figures.
"""

from __future__ import annotations

import json
import os
import secrets
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.data.audit import Commit, audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse

pytestmark = pytest.mark.timeout(60)

IDS = ("r0", "r1", "r2")
STEP_TIME = 0.05  # simulated compute per step: survivors keep stepping while a replica restarts
WORKER = ["-m", "ftrun.train.ft_worker", "--steps", "100000", "--step-time", str(STEP_TIME), "--ftar-timeout", "3"]


class Job:
    """A lighthouse and three replica processes; `pump` feeds events and restarts crashed replicas."""

    def __init__(self, run_dir: Path, *, checkpoint_every: int = 0) -> None:
        self.env, self.run_dir = RealEnv(), run_dir
        self.lighthouse = Lighthouse(env=self.env, token=(token := secrets.token_hex(8)), config=LighthouseConfig(
            min_replicas=len(IDS), timeouts=Timeouts(join_timeout_s=2.0)))  # the first quorum has everyone
        self.lighthouse.start()
        self.events = self.env.queue()
        argv = WORKER + ["--stop-file", str(run_dir / "stop"), "--fault-file", str(run_dir / "faults.json"),
                         "--checkpoint-every", str(checkpoint_every)]
        self.replicas = {rid: ReplicaProcesses(
            env=self.env, events=self.events, log_dir=str(run_dir), argv=argv,
            spec=WorkerSpec(replica_id=rid, replica_index=i, num_replicas=len(IDS), rank=0, ranks_per_replica=1,
                            incarnation=0, lighthouse=self.lighthouse.addr, token=token, store_addr="127.0.0.1",
                            store_port=0, run_dir=str(run_dir)))
            for i, rid in enumerate(IDS)}
        self.log: list[dict] = []
        self._by_kind: dict[str, list[dict]] = defaultdict(list)  # the log by event kind (scans stay cheap)
        self._max_step = 0
        self.exits: dict[tuple[str, int], int] = {}
        self.restarted_at: dict[tuple[str, int], float] = {}  # (replica, new incarnation) -> when
        self.t0 = self.env.clock.now()

    def __enter__(self) -> "Job":
        for rep in self.replicas.values():
            rep.start()
        return self

    def __exit__(self, *exc) -> None:
        self.lighthouse.stop()
        for rep in self.replicas.values():
            rep.kill()

    def pump(self, until: Callable[[], bool], timeout: float = 40.0) -> None:
        """Take events and restart crashed replicas until `until()` holds (checked after each batch)."""
        deadline = self.env.clock.now() + timeout
        while not until():
            if self.env.clock.now() > deadline:
                raise AssertionError(f"timed out; last events: {self.log[-8:]}\n{self.worker_logs()}")
            self._supervise()
            wait = 0.05
            while True:  # everything queued, so the test never lags behind the job
                try:
                    self._record(self.events.get(timeout=wait))
                except EnvTimeout:
                    break
                wait = 0.0

    def _record(self, ev: dict) -> None:
        self.log.append(ev)
        self._by_kind[ev["event"]].append(ev)
        if ev["event"] == "step" and ev["committed"]:
            self._max_step = max(self._max_step, ev["step"] + 1)

    def min_replicas(self, n: int) -> None:
        """The lighthouse's quorum floor (its main loop reads the config at every decision)."""
        self.lighthouse.config = replace(self.lighthouse.config, min_replicas=n)

    def _supervise(self) -> None:
        for rid, rep in self.replicas.items():
            code = rep.exited()[0]
            if code is None or (rid, rep.spec.incarnation) in self.exits:
                continue
            rep.drain()  # its last events (a clean exit's "final") are on the queue before the exit is recorded
            self.exits[(rid, rep.spec.incarnation)] = code
            if code != 0:  # a crash: restart the replica, as `ftrun launch` does
                rep.restart()
                self.restarted_at[(rid, rep.spec.incarnation)] = self.env.clock.now()

    def finish(self) -> None:
        """End every replica at the same step, a few steps ahead, and wait for clean exits."""
        self._write("stop", str(self.max_step() + 3))
        self.pump(lambda: all(self.exits.get((r, rep.spec.incarnation)) == 0 for r, rep in self.replicas.items()))

    def plan(self, *, die_at: str = "", catchup: str = "") -> None:
        """Replace the fault plan; every worker picks it up before its next step."""
        self._write("faults.json", json.dumps({"die_at": die_at, "catchup": catchup}))

    def _write(self, name: str, text: str) -> None:
        """Atomically: a worker must never read half a file."""
        (self.run_dir / f".{name}.tmp").write_text(text)
        os.replace(self.run_dir / f".{name}.tmp", self.run_dir / name)

    def incarnation(self, rid: str) -> int:
        return self.replicas[rid].spec.incarnation

    def restarts_since(self, t: float) -> set[tuple[str, int]]:
        return {k for k, at in self.restarted_at.items() if at >= t}

    def kill_all(self) -> None:
        """SIGKILL every replica, then start them all again."""
        for rid, rep in self.replicas.items():
            rep.kill()
            self.exits[(rid, rep.spec.incarnation)] = -9
        for rid, rep in self.replicas.items():
            rep.restart()
            self.restarted_at[(rid, rep.spec.incarnation)] = self.env.clock.now()

    # -- what happened ---------------------------------------------------------------------------
    def of(self, kind: str, rid: str | None = None, incarnation: int | None = None) -> list[dict]:
        return [e for e in self._by_kind[kind] if rid in (None, e["replica_id"])
                and incarnation in (None, e["incarnation"])]

    def commits(self, rid: str | None = None, incarnation: int | None = None) -> list[dict]:
        return [e for e in self.of("step", rid, incarnation) if e["committed"]]

    def max_step(self) -> int:
        """The most steps any replica has committed."""
        return self._max_step

    def rejoined(self, rid: str, incarnation: int, steps: int = 3) -> bool:
        """`rid`'s incarnation healed and then committed `steps` steps."""
        return bool(self.of("heal", rid, incarnation)) and len(self.commits(rid, incarnation)) >= steps

    def worker_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.run_dir.glob("*.log")))


def check_bitwise(job: Job) -> int:
    """Every committed (step, lineage) has one parameter hash across replicas and incarnations."""
    hashes: dict[tuple[int, str], set[str]] = defaultdict(set)
    for e in job.commits():
        hashes[(e["step"], e["lineage"])].add(e["param_hash"])
    diverged = {k: v for k, v in hashes.items() if len(v) > 1}
    assert not diverged, f"replicas diverged at {sorted(diverged)[:3]}"
    return len(hashes)


def check_exactly_once(job: Job, *, finished: bool):
    """The audit over every replica's records: for the final ledger once the job ended, else for the
    newest commit so far (records of the step in flight are not on the chain yet)."""
    def read_all() -> list:
        records = []
        for path in sorted(job.run_dir.glob("audit-*.jsonl")):
            got, problems = read_log(path.read_bytes(), name=path.name)
            records += got
            _, rid, incarnation = path.stem.split("-")
            assert not problems or not finished or job.exits[(rid, int(incarnation))] != 0, problems
        return records

    # While the job runs, the files are read one after another: take the commits from a first pass and the
    # attempts from a second, so every commit's contributors' attempts (written before their gradients entered
    # the all-reduce) are there even if a replica committed between reading one file and the next.
    commits = [r for r in read_all() if isinstance(r, Commit)]
    records = commits + [r for r in read_all() if not isinstance(r, Commit)]
    final = None
    if finished:
        finals = job.of("final")
        assert len(finals) == len(IDS) and len({e["param_hash"] for e in finals}) == 1
        assert len({json.dumps(e["loader_state"], sort_keys=True) for e in finals}) == 1, "ledgers differ"
        final = LoaderState.from_dict(finals[0]["loader_state"])
    report = audit(records, final=final)
    assert report.ok, report.summary()
    if final is not None:
        assert report.num_steps == final.step and sum(final.committed_batches) == len(report.trained)
    return report, final


def figures(job: Job, victim: str, incarnation: int, since: float) -> dict:
    """Measured figures of a kill and rejoin (printed; timing is not asserted)."""
    died = max(e["t"] for e in job.log if e["replica_id"] == victim and e["incarnation"] == incarnation - 1)
    survivors = [e["t"] for e in job.commits() if e["replica_id"] != victim and e["t"] > died]
    restart = job.restarted_at[(victim, incarnation)]
    ready = job.of("ready", victim, incarnation)[0]
    catchup = job.of("catchup", victim, incarnation)[0]
    first = job.commits(victim, incarnation)[0]
    out = {"survivor_next_commit_s": round(min(survivors) - died, 3),  # after the victim's last event
           "restart_to_ready_s": round(ready["t"] - restart, 3), "rejoin_s": round(first["t"] - restart, 3),
           "catchup_bytes": catchup["num_bytes"], "catchup_s": round(catchup["seconds"], 4),
           "healed_to_step": catchup["step"], "scenario_s": round(job.env.clock.now() - since, 1)}
    print(f"\n[{victim} incarnation {incarnation}] {json.dumps(out)}")
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job every scenario injects its faults into; at the end it stops cleanly and passes the
    final checks (bitwise equal finals, one ledger, the audit for it)."""
    with Job(tmp_path_factory.mktemp("job"), checkpoint_every=20) as shared:
        shared.pump(lambda: bool(shared.commits()))
        shared.min_replicas(2)  # from now on two survivors go on while the third restarts
        yield shared
        shared.plan()
        shared.finish()
    check_bitwise(shared)
    check_exactly_once(shared, finished=True)


VICTIM = {"backward": "r1", "exchange": "r2", "before_commit": "r0", "after_commit": "r1", "heal": "r2"}


@pytest.mark.parametrize("phase", list(VICTIM))
def test_replica_killed_in_any_phase_rejoins_bitwise_identical(job, phase):
    """(a) SIGKILL in every phase of a step (r0, the checkpoint/loader_state writer, included); the
    replica is restarted, catches up from the others and then holds their parameters bit for bit."""
    victim, since = VICTIM[phase], job.env.clock.now()
    first, at = job.incarnation(victim), job.max_step() + 2
    if phase == "heal":  # killed once to be behind, then killed again inside its catch-up
        job.plan(die_at=f"step={at},phase=before_commit,replica={victim},incarnation={first};"
                        f"phase=heal,replica={victim},incarnation={first + 1}")
    else:
        job.plan(die_at=f"step={at},phase={phase},replica={victim},incarnation={first}")
    last = first + (2 if phase == "heal" else 1)
    job.pump(lambda: job.rejoined(victim, last))
    job.plan()
    assert [job.exits[(victim, i)] for i in range(first, last)] == [-9] * (last - first)
    assert job.restarts_since(since) == {(victim, i) for i in range(first + 1, last + 1)}, "only the victim"
    if phase == "heal":
        assert job.of("catchup", victim, first + 1) == []  # it died between fetching and loading
    check_bitwise(job)
    check_exactly_once(job, finished=False)
    figures(job, victim, last, since)


def test_catchup_source_killed_mid_transfer_is_replanned(job):
    """(b) r1 rejoins; r0 serves half a shard of r1's catch-up and is SIGKILLed: the fetch replans onto
    r2, r1 heals, then r0 rejoins too."""
    since, victim, source = job.env.clock.now(), job.incarnation("r1"), job.incarnation("r0")
    job.plan(die_at=f"step={job.max_step() + 2},phase=after_commit,replica=r1,incarnation={victim}",
             catchup=f"kind=truncate,then=die,replica=r0,incarnation={source}")
    job.pump(lambda: job.rejoined("r1", victim + 1) and job.rejoined("r0", source + 1))
    job.plan()
    assert job.exits[("r1", victim)] == -9 and job.exits[("r0", source)] == -9
    assert job.restarts_since(since) == {("r1", victim + 1), ("r0", source + 1)}
    catchup = job.of("catchup", "r1", victim + 1)[0]
    served = {url: n for url, n in catchup["bytes_by_source"].items() if n}
    assert len(catchup["bytes_by_source"]) == 2 and list(served.values()) == [catchup["num_bytes"]]
    dead = next(url for url in catchup["bytes_by_source"] if url not in served)
    assert any(f.startswith(f"{dead} shard") for f in catchup["failures"]), catchup["failures"]
    # a survivor may steal all of the dead source's shards and finish before it is dropped: if anything else
    # failed, it was the dead source (every shard came from the live one, checked above)
    assert all(f.startswith((f"{dead} shard", f"dropped {dead}")) for f in catchup["failures"]), catchup["failures"]
    check_bitwise(job)
    check_exactly_once(job, finished=False)
    figures(job, "r1", victim + 1, since)


def test_corrupted_catchup_bytes_are_detected_and_refetched(job):
    """(c) r2 rejoins; r0 flips a byte in the first shard it serves: the CRC check catches it and the
    shard is fetched again; r2 ends bitwise equal to the others."""
    since, victim, source = job.env.clock.now(), job.incarnation("r2"), job.incarnation("r0")
    job.plan(die_at=f"step={job.max_step() + 2},phase=exchange,replica=r2,incarnation={victim}",
             catchup=f"kind=corrupt,replica=r0,incarnation={source}")
    job.pump(lambda: job.rejoined("r2", victim + 1))
    job.plan()
    assert job.restarts_since(since) == {("r2", victim + 1)}
    catchup = job.of("catchup", "r2", victim + 1)[0]
    assert len(catchup["failures"]) == 1 and "CRC32" in catchup["failures"][0], catchup["failures"]
    check_bitwise(job)
    check_exactly_once(job, finished=False)
    figures(job, "r2", victim + 1, since)


def test_full_restart_resumes_from_the_latest_checkpoint_exactly_once(job):
    """(d) every replica SIGKILLed at once, a few steps after a checkpoint; all restart from the latest
    complete DCP checkpoint and its ledger, retrain the lost steps bit for bit (same data, same lineage,
    same parameters), and the audit shows no lost or repeated batch on the lineage that goes on."""
    from ftrun.checkpoint import store

    since = job.env.clock.now()
    job.min_replicas(3)  # every restarted replica in the first quorum: the replay is the lost run's twin
    done = {e["step"] for e in job.of("checkpoint")}
    job.pump(lambda: any(e["step"] not in done and job.max_step() >= e["step"] + 3
                         for e in job.of("checkpoint")))
    waited_for = max(e["step"] for e in job.of("checkpoint"))
    old = {r: job.incarnation(r) for r in IDS}
    job.kill_all()
    latest = store.latest_complete(job.run_dir / "ckpt")
    assert latest is not None and latest.step >= waited_for and latest.step % 20 == 0
    new = {r: job.incarnation(r) for r in IDS}

    def killed_at() -> int:  # the lost run's progress (its last events may still be in the pipes)
        return max(e["step"] + 1 for r in IDS for e in job.commits(r, old[r]))

    job.pump(lambda: all(job.commits(r, i) and job.commits(r, i)[-1]["step"] > killed_at()
                         for r, i in new.items()))
    job.min_replicas(2)
    resumed = {(e["step"], e["lineage"]) for r in IDS for e in job.of("ready", r, new[r])}
    assert resumed == {(latest.step, latest.manifest.lineage)}  # the checkpoint's model and its ledger
    assert {job.commits(r, new[r])[0]["step"] for r in IDS} == {latest.step}  # nothing skipped
    assert job.restarts_since(since) == set(new.items())
    lost = {(e["step"], e["lineage"]): e["param_hash"] for r in IDS for e in job.commits(r, old[r])}
    replayed = [e for r in IDS for e in job.commits(r, new[r]) if e["step"] < killed_at()]
    assert replayed, (killed_at(), latest.step)
    assert all(lost[(e["step"], e["lineage"])] == e["param_hash"] for e in replayed), \
        "the retrained steps reproduce the lost ones bit for bit"
    check_bitwise(job)
    report, _ = check_exactly_once(job, finished=False)
    assert report.num_steps > killed_at()  # the chain runs through the restart, the lost branch is off it
    ready = max(e["t"] for r in IDS for e in job.of("ready", r, new[r]))
    print(f"\n[full restart] killed after step {killed_at()}, resumed at {latest.step} "
          f"({len(replayed) // len(IDS)} steps retrained bit for bit), all ready "
          f"{ready - job.restarted_at[('r0', new['r0'])]:.2f}s after the kill; "
          f"{len(report.trained)} batches exactly once so far")
