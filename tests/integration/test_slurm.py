"""`ftrun slurm submit` against a real Slurm (Debian's slurmctld/slurmd/munge, `ci/install_slurm.sh`).

A private cluster in a temporary folder: munged with its own key and socket, slurmctld and slurmd on
free ports of 127.0.0.1, one node (localhost), proctrack/linuxproc, no accounting. The job: the lighthouse
job plus 2 replica jobs of 2 ranks (srun tasks) each. r1's srun step is SIGKILLed with scancel: its
wrapper starts a new step (incarnation 1) and r1 heals from r0. Then r0's job is requeued with
`scontrol requeue` (released at once instead of after Slurm's requeue delay): it comes back as
SLURM_RESTART_COUNT=1, incarnation 1 * (max_restarts + 1) = 4, and heals from r1. Then one process (r1's
rank 1) is SIGKILLed: srun ends the step and r1 comes back as incarnation 2. Every job completes,
the replicas are identical per rank and the exactly-once audit holds. Needs root and the packages; skips
with the reason otherwise. Run with `make test-slurm`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol", "squeue", "sinfo")
MAX_RESTARTS = 3


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _conf(d: Path, ctld_port: int, slurmd_port: int) -> str:
    return "\n".join([
        "ClusterName=ftruntest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge/sock", "CredType=cred/munge", f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool", f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log", "SlurmctldDebug=info",
        "SlurmdDebug=info", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
        "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "ReturnToService=2", "KillWait=5", "SlurmdParameters=config_overrides",
        "NodeName=localhost NodeAddr=127.0.0.1 CPUs=16 RealMemory=1000 State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8", ""])


class Cluster:
    def __init__(self, d: Path) -> None:
        self.d = d
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf"), "OMP_NUM_THREADS": "1"}
        self.run_dir: Path | None = None  # the job's, for failure messages
        self.env.pop("FTRUN_TOKEN", None)
        self.env.pop("FTRUN_TOKEN_FILE", None)

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{cmd} failed: {done.stderr}")
        return done.stdout

    def pid(self, name: str) -> int | None:
        try:
            return int((self.d / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def jobs(self) -> dict[str, str]:
        out = self.run("squeue", "-h", "-o", "%i %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def log_tail(self) -> str:
        logs = [f"{p.name}: {p.read_text()[-800:]}" for p in self.d.glob("*.log")]
        for p in sorted(self.run_dir.glob("slurm/*.out")) if self.run_dir else []:
            lines = p.read_text(errors="replace").splitlines()
            keep = [ln for ln in lines if '"event": "slurm"' in ln or "Error" in ln or "error" in ln][-10:]
            logs.append(f"{p.name}: " + "\n".join(keep + lines[-5:]))
        return "\n".join(logs)

    def release(self, job: str) -> None:
        """Start a requeued job now instead of after Slurm's requeue delay (BeginTime): repeated while it
        still waits, as the requeue may set its BeginTime after an early update."""
        deadline = time.monotonic() + 60
        while self.run("squeue", "-h", "-j", job, "-o", "%T %r", check=False).split() == ["PENDING", "BeginTime"]:
            assert time.monotonic() < deadline, f"job {job} still held by its BeginTime"
            self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(cond, timeout: float, what: str, cluster: Cluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}\n{cluster.log_tail() if cluster else ''}")
        time.sleep(0.5)


@pytest.fixture
def cluster(tmp_path_factory):
    missing = [c for c in DAEMONS if shutil.which(c) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing): run ci/install_slurm.sh as root")
    if os.geteuid() != 0:
        pytest.skip("the private Slurm cluster runs slurmd as root: needs root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir()
    os.chmod(d / "munge", 0o700)
    (d / "munge" / "key").write_bytes(os.urandom(128))
    os.chmod(d / "munge" / "key", 0o600)
    ctld_port, slurmd_port = _free_ports(2)
    (d / "slurm.conf").write_text(_conf(d, ctld_port, slurmd_port))
    c = Cluster(d)
    started: list[int] = []
    try:
        m = d / "munge"
        c.run("munged", "-f", f"--socket={m}/sock", f"--key-file={m}/key", f"--log-file={d}/munged.log",
              f"--pid-file={m}/pid", f"--seed-file={m}/seed", "--num-threads=2", check=False)
        if (pid := c.pid("munge/pid")) is None:
            pytest.skip(f"munged did not start: {c.log_tail()}")
        started.append(pid)
        c.run("slurmctld", "-i", check=False)
        _wait(lambda: c.pid("slurmctld.pid") is not None, 20, "slurmctld's pid file", c)
        started.append(c.pid("slurmctld.pid"))
        c.run("slurmd", "-N", "localhost", check=False)
        _wait(lambda: c.pid("slurmd.pid") is not None, 20, "slurmd's pid file", c)
        started.append(c.pid("slurmd.pid"))
        _wait(lambda: c.run("sinfo", "-h", "-o", "%T", check=False).strip() == "idle", 30, "the node idle", c)
    except AssertionError as e:
        _stop(c, started)
        pytest.skip(f"the Slurm daemons could not start: {e}")
    yield c
    _stop(c, started)
    assert not [pid for pid in started if _alive(pid)], "a Slurm daemon outlived the test"
    left = lambda: _processes_mentioning(f"{d.parent}/")  # noqa: E731 (the cluster's and the job's folders)
    deadline = time.monotonic() + 15
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == [], "a process of the test's cluster or job is left"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{proc.name}: {cmd}")
    return found


def _stop(c: Cluster, pids: list[int]) -> None:
    if pids[1:]:
        c.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + 30
        while c.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
    for pid in reversed(pids):  # slurmd, slurmctld, munged
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _events(out: Path) -> list[dict]:
    events = []
    for path in sorted(out.parent.glob(out.name)):
        for line in path.read_bytes().split(b"\n"):
            if line.startswith(b"{"):
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    return events


def _rank_pid(run: Path, rid: str, *, rank: int) -> int:
    """The pid of the live rank process `rank` of replica `rid` of this job (found by its environment)."""
    want = {b"FTRUN_REPLICA_ID=" + rid.encode(), b"RANK=%d" % rank, b"FTRUN_RUN_DIR=" + str(run).encode()}
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0")) if proc.name.isdigit() else set()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if want <= environ and b"ftrun.train.ft_worker" in cmd and b"ftrun.launch.slurm" not in cmd:
            return int(proc.name)
    raise AssertionError(f"no live rank {rank} of {rid}")


def _submit(c: Cluster, run: Path, *worker: str, replicas: int = 2, ranks: int = 2,
            max_restarts: int = MAX_RESTARTS) -> dict[str, str]:
    cmd = [sys.executable, "-m", "ftrun.cli", "slurm", "submit", "--replicas", str(replicas), "--ranks-per-replica",
           str(ranks), "--run-dir", str(run), "--bind-host", "127.0.0.1", "--max-restarts", str(max_restarts),
           "--max-requeues", "1", "--json", "-m", "ftrun.train.ft_worker", *worker]
    out = c.run(*cmd)
    return json.loads(out.strip().splitlines()[-1])["jobs"]


def test_replicas_as_slurm_jobs_restart_and_requeue_as_incarnations(cluster, tmp_path):
    run = cluster.run_dir = tmp_path / "run"
    jobs = _submit(cluster, run, "--steps", "100000", "--step-time", "0.05", "--ftar-timeout", "3",
                   "--stop-file", str(run / "stop"))
    assert sorted(jobs) == ["lighthouse", "r0", "r1"]
    out = {r: run / "slurm" / f"{r}-{jobs[r]}.out" for r in ("r0", "r1")}
    assert (run / "token").stat().st_mode & 0o777 == 0o600
    token = (run / "token").read_text().strip()
    assert not [p for p in (run / "slurm").glob("*.sbatch") if token in p.read_text()]

    def commits(rid: str, incarnation_start: int = 0) -> set[int]:
        evs = _events(out[rid])
        starts = [i for i, e in enumerate(evs) if e.get("event") == "slurm" and e["phase"] == "start"
                  and e["incarnation"] >= incarnation_start]
        if not starts:
            return set()
        return {e["step"] for e in evs[starts[0]:] if e.get("event") == "step" and e.get("committed")}

    _wait(lambda: len(commits("r1")) >= 3, 150, "r1's first commits", cluster)
    # SIGKILL r1's srun step (every task): its wrapper starts step 1 in the same allocation = incarnation 1
    cluster.run("scancel", "--signal=KILL", f"{jobs['r1']}.0")
    _wait(lambda: len(commits("r1", 1)) >= 2, 150, "r1 restarted as a new srun step and committing", cluster)
    heals = [e for e in _events(out["r1"]) if e.get("event") == "catchup"]
    assert heals, "the restarted step heals from r0"
    assert (run / "audit-r1-1.jsonl").exists(), "the new srun step is incarnation 1"

    # requeue r0's whole job: Slurm runs it again with SLURM_RESTART_COUNT=1 = incarnation 4
    cluster.run("scontrol", "requeue", jobs["r0"])
    _wait(lambda: cluster.jobs().get(jobs["r0"]) == "PENDING", 60, "r0 requeued", cluster)
    cluster.release(jobs["r0"])  # skip Slurm's requeue delay
    inc = 1 * (MAX_RESTARTS + 1)
    _wait(lambda: len(commits("r0", inc)) >= 2, 180, "r0 requeued, back and committing", cluster)
    assert (run / f"audit-r0-{inc}.jsonl").exists(), "a requeue counts as the next incarnations"

    # SIGKILL one task (r1's rank 1) from outside: srun --kill-on-bad-exit ends the step, step 2 starts
    victim = _rank_pid(run, "r1", rank=1)
    os.kill(victim, signal.SIGKILL)
    _wait(lambda: len(commits("r1", 2)) >= 2, 150, "r1 back after one task was SIGKILLed", cluster)
    assert (run / "audit-r1-2.jsonl").exists()

    stop = max(commits("r0", inc) | commits("r1", 2)) + 3
    (run / ".stop").write_text(str(stop))
    os.replace(run / ".stop", run / "stop")
    _wait(lambda: not cluster.jobs(), 120, "every job (replicas and lighthouse) finished", cluster)
    assert [(run / "slurm" / f"r{i}.done").read_text().strip() for i in range(2)] == ["0", "0"]

    finals = {(rid, e["rank"]): e for rid in ("r0", "r1") for e in _events(out[rid]) if e.get("event") == "final"}
    assert sorted(finals) == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1)]
    for rank in (0, 1):
        assert finals[("r0", rank)]["param_hash"] == finals[("r1", rank)]["param_hash"]
    assert len({json.dumps(e["loader_state"], sort_keys=True) for e in finals.values()}) == 1
    final = LoaderState.from_dict(finals[("r0", 0)]["loader_state"])
    assert final.step == stop and final.layout.num_replicas == 2 and final.layout.ranks_per_replica == 2
    assert {p.name for p in run.glob("audit-*.jsonl")} == {"audit-r0-0.jsonl", f"audit-r0-{inc}.jsonl",
                                                           "audit-r1-0.jsonl", "audit-r1-1.jsonl", "audit-r1-2.jsonl"}
    records = [r for path in sorted(run.glob("audit-*.jsonl")) for r in read_log(path.read_bytes())[0]]
    report = audit(records, final=final)
    assert report.ok, report.summary()
    print(f"slurm recovery (printed, not asserted): {_recovery(out['r1'], 1)} (scancel of the step), "
          f"{_recovery(out['r0'], inc)} (requeue, after StartTime=now), {_recovery(out['r1'], 2)} (one task killed)")


def _recovery(out: Path, inc: int) -> str:
    """Seconds from the wrapper starting incarnation `inc` to that incarnation's first committed step."""
    evs = _events(out)
    start = next(i for i, e in enumerate(evs) if e.get("event") == "slurm" and e.get("incarnation") == inc)
    first = next(e for e in evs[start:] if e.get("event") == "step" and e.get("committed"))
    return f"{first['t'] - evs[start]['t']:.1f}s to the first commit of incarnation {inc}"


def test_a_replica_out_of_restarts_requeues_its_job(cluster, tmp_path):
    """--max-restarts 0: r0's rank dies at step 2 of incarnation 0, so its wrapper requeues the job itself
    (`scontrol requeue`); the next run (SLURM_RESTART_COUNT=1, incarnation 1) resumes and finishes."""
    run = cluster.run_dir = tmp_path / "run"
    cluster.env["FTRUN_DIE_AT"] = "step=2,phase=backward,replica=r0,incarnation=0"
    jobs = _submit(cluster, run, "--steps", "6", "--step-time", "0.05", replicas=1, ranks=1, max_restarts=0)
    out = run / "slurm" / f"r0-{jobs['r0']}.out"
    def requeued() -> list[dict]:
        assert jobs["r0"] in cluster.jobs(), "r0's job ended instead of requeueing itself"
        return [e for e in _events(out) if e.get("event") == "slurm" and e.get("decision") == "requeue"]

    _wait(lambda: bool(requeued()) and cluster.jobs().get(jobs["r0"]) == "PENDING", 150, "r0 requeued itself", cluster)
    assert "requeue 1 of 1" in requeued()[0]["reason"]
    assert not (run / "slurm" / "r0.done").exists(), "a requeued replica has not finished"
    cluster.release(jobs["r0"])  # skip Slurm's requeue delay
    _wait(lambda: not cluster.jobs(), 150, "r0's second run and the lighthouse finished", cluster)
    assert (run / "slurm" / "r0.done").read_text().strip() == "0"
    starts = [e["incarnation"] for e in _events(out) if e.get("event") == "slurm" and e.get("phase") == "start"]
    assert starts == [0, 1]
    finals = [e for e in _events(out) if e.get("event") == "final"]
    assert [e["step"] for e in finals] == [6]
    final = LoaderState.from_dict(finals[0]["loader_state"])
    records = [r for path in sorted(run.glob("audit-*.jsonl")) for r in read_log(path.read_bytes())[0]]
    assert {p.name for p in run.glob("audit-*.jsonl")} == {"audit-r0-0.jsonl", "audit-r0-1.jsonl"}
    report = audit(records, final=final)
    assert report.ok, report.summary()
