"""The Slurm path's pure parts: the batch scripts, the SLURM_* -> worker variable mapping, incarnations.

One Slurm batch job per replica plus one for the lighthouse (`ftrun slurm submit` writes and submits
them). Inside a replica's job a small wrapper (`python -m ftrun.launch.slurm replica`, the batch script's
only command) hosts the replica's rendezvous store, like torchrun's agent, and runs the replica's ranks as
one `srun` step; when a task dies, srun (--kill-on-bad-exit) ends the step and the wrapper starts a new
step in the same allocation, up to --max-restarts times. The job is submitted with `--requeue`, so a
node failure, a preemption or an `scontrol requeue` brings the whole replica back as a new run of the
same job (SLURM_RESTART_COUNT). Both kinds of restart are the replica's incarnations:

    incarnation = SLURM_RESTART_COUNT * (max_restarts + 1) + step attempt

which grows with every restart of either kind and never repeats. Every srun task maps Slurm's variables
onto the names one torchrun per replica sets (see ftrun.launch.worker_env): RANK = SLURM_PROCID,
WORLD_SIZE = SLURM_NTASKS (the replica's ranks), LOCAL_RANK = SLURM_LOCALID, GROUP_RANK = SLURM_NODEID,
TORCHELASTIC_RESTART_COUNT = the incarnation, MASTER_ADDR/PORT = the wrapper's store (a fresh one per step),
TORCHELASTIC_USE_AGENT_STORE=True (a script's own env:// init_process_group joins it as a client).
Nothing here does I/O.
"""

from __future__ import annotations

import enum
import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping

# TORCHELASTIC_USE_AGENT_STORE, as torchrun sets it: a script's env:// init_process_group joins MASTER_ADDR/PORT
# (the launcher's store of this replica incarnation) as a client instead of rank 0 listening there
AGENT_STORE = str(True)
NODE_HOST = "@node"  # --bind-host value: each process binds its node's Slurm name (SLURMD_NODENAME)
SLURM_HELP = ("run the ranks with `ftrun slurm submit` (one batch job per replica), or set FTRUN_REPLICA_ID=r<i>, "
              "FTRUN_NUM_REPLICAS, FTRUN_LIGHTHOUSE (or FTRUN_SLURM_LIGHTHOUSE_FILE) and FTRUN_TOKEN_FILE in the "
              "replica's batch script; see README 'Slurm'")
_PARTITION = re.compile(r"^[A-Za-z0-9_.\-,]+$")
_TIME = re.compile(r"^[0-9:\-]+$")


@dataclass(frozen=True, kw_only=True)
class SlurmJobPlan:
    """What `ftrun slurm submit` asks for. All paths absolute."""

    replicas: int
    ranks_per_replica: int
    command: tuple[str, ...]  # the rank's command line (python [-m] SCRIPT args...)
    python: str  # the interpreter that runs the wrappers
    run_dir: str  # shared by every node: token, lighthouse address, audit logs, job output
    token_file: str
    workdir: str
    nodes_per_replica: int = 1
    partition: str | None = None
    time_limit: str | None = None
    max_restarts: int = 3  # srun step restarts inside one allocation (requeues come on top)
    max_requeues: int = 1  # times a replica whose restarts are used up requeues itself (a new allocation)
    min_replicas: int | None = None  # the lighthouse's quorum size (default: all replicas)
    bind_host: str = NODE_HOST
    lighthouse: str | None = None  # host:port of a lighthouse that already runs: no lighthouse job
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("replicas", "ranks_per_replica", "nodes_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.nodes_per_replica > self.ranks_per_replica:
            raise ValueError(f"--nodes-per-replica {self.nodes_per_replica} exceeds --ranks-per-replica "
                             f"{self.ranks_per_replica}: every node needs a rank")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.max_requeues < 0:
            raise ValueError(f"--max-requeues must be >= 0, got {self.max_requeues}")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"--min-replicas must be in 1..{self.replicas}, got {self.min_replicas}")
        if self.partition is not None and not _PARTITION.match(self.partition):
            raise ValueError(f"--partition {self.partition!r} is not a Slurm partition name")
        if self.time_limit is not None and not _TIME.match(self.time_limit):
            raise ValueError(f"--time {self.time_limit!r} is not a Slurm time ([D-]HH:MM:SS or minutes)")
        if not self.command:
            raise ValueError("no training script given")
        for arg in self.sbatch_args:
            if not arg.startswith("--") or any(c in arg for c in "\n\r\0"):
                raise ValueError(f"--sbatch-arg {arg!r} must be one long sbatch option (--name=value) on one line")
        for name in ("python", "run_dir", "token_file", "workdir"):
            if not getattr(self, name).startswith("/"):
                raise ValueError(f"{name} must be an absolute path, got {getattr(self, name)!r}")
        for name in ("run_dir", "workdir"):  # they go into #SBATCH lines, which end at whitespace
            if any(c.isspace() for c in getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)!r} contains whitespace, which #SBATCH lines "
                                 "cannot hold")

    def slurm_dir(self) -> str:
        return f"{self.run_dir}/slurm"

    def lighthouse_file(self) -> str:
        return f"{self.slurm_dir()}/lighthouse.addr"

    def done_file(self, replica: int) -> str:
        return f"{self.slurm_dir()}/r{replica}.done"


def _header(plan: SlurmJobPlan, name: str, out: str, *, nodes: int, ntasks: int) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={ntasks}",
             "#SBATCH --requeue", "#SBATCH --open-mode=append", f"#SBATCH --output={out}",
             f"#SBATCH --chdir={plan.workdir}"]
    if plan.partition:
        lines.append(f"#SBATCH --partition={plan.partition}")
    if plan.time_limit:
        lines.append(f"#SBATCH --time={plan.time_limit}")
    lines += [f"#SBATCH {arg}" for arg in plan.sbatch_args]
    return lines


def _exports(values: Mapping[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in values.items()]


def replica_script(plan: SlurmJobPlan, replica: int) -> str:
    """The batch script of replica `replica` (r<i>): the wrapper hosts the store and runs the srun steps."""
    if not 0 <= replica < plan.replicas:
        raise ValueError(f"replica {replica} is outside 0..{plan.replicas - 1}")
    rid = f"r{replica}"
    env = {"FTRUN_REPLICA_ID": rid, "FTRUN_NUM_REPLICAS": str(plan.replicas), "FTRUN_TOKEN_FILE": plan.token_file,
           "FTRUN_RUN_DIR": plan.run_dir, "FTRUN_SLURM_MAX_RESTARTS": str(plan.max_restarts),
           "FTRUN_SLURM_MAX_REQUEUES": str(plan.max_requeues),
           "FTRUN_BIND_HOST": plan.bind_host}
    if plan.lighthouse:
        env["FTRUN_LIGHTHOUSE"] = plan.lighthouse
    else:
        env["FTRUN_SLURM_LIGHTHOUSE_FILE"] = plan.lighthouse_file()
    wrapper = [plan.python, "-m", "ftrun.launch.slurm", "replica", "--done-file", plan.done_file(replica), "--",
               *plan.command]
    lines = _header(plan, f"ftrun-{rid}", f"{plan.slurm_dir()}/{rid}-%j.out", nodes=plan.nodes_per_replica,
                    ntasks=plan.ranks_per_replica)
    lines += [f"# ftrun replica {rid} of {plan.replicas} ({plan.ranks_per_replica} ranks): store + srun steps, "
              f"each failed step restarted up to {plan.max_restarts} times; requeues restart the whole replica",
              "unset FTRUN_TOKEN", *_exports(env), "exec " + shlex.join(wrapper), ""]
    return "\n".join(lines)


def lighthouse_script(plan: SlurmJobPlan) -> str:
    """The lighthouse's batch script: it publishes its address in the run dir and stops once every
    replica's wrapper has finished."""
    if plan.lighthouse:
        raise ValueError("the plan uses an existing lighthouse (--lighthouse): there is no lighthouse job")
    env = {"FTRUN_TOKEN_FILE": plan.token_file, "FTRUN_BIND_HOST": plan.bind_host}
    wrapper = [plan.python, "-m", "ftrun.launch.slurm", "lighthouse", "--addr-file", plan.lighthouse_file(),
               "--state-dir", f"{plan.slurm_dir()}/lighthouse-state",
               "--min-replicas", str(plan.min_replicas or plan.replicas),
               *[a for i in range(plan.replicas) for a in ("--done-file", plan.done_file(i))]]
    lines = _header(plan, "ftrun-lighthouse", f"{plan.slurm_dir()}/lighthouse-%j.out", nodes=1, ntasks=1)
    lines += ["# ftrun lighthouse: quorum service for the replica jobs; ends when all of them have",
              "unset FTRUN_TOKEN", *_exports(env), "exec " + shlex.join(wrapper), ""]
    return "\n".join(lines)


def incarnation(restart_count: int, attempt: int, max_restarts: int) -> int:
    """The replica's incarnation: requeues (SLURM_RESTART_COUNT) times the step attempts one allocation
    may make, plus this allocation's step attempt. Raises ValueError for values out of range."""
    if restart_count < 0 or max_restarts < 0 or not 0 <= attempt <= max_restarts:
        raise ValueError(f"incarnation needs restart_count >= 0 and 0 <= attempt <= max_restarts, got "
                         f"{restart_count}, {attempt}, {max_restarts}")
    return restart_count * (max_restarts + 1) + attempt


class StepAction(str, enum.Enum):
    DONE = "done"  # the step succeeded: the replica has finished
    RESTART = "restart"  # run a new srun step in this allocation (the next incarnation)
    REQUEUE = "requeue"  # restarts used up here: requeue the job (a new allocation, maybe other nodes)
    FAIL = "fail"  # give up (restarts and requeues used up, or Slurm is stopping/requeueing the job)


@dataclass(frozen=True)
class StepDecision:
    action: StepAction
    reason: str


def step_decision(returncode: int, attempt: int, max_restarts: int, *, stopping: bool, requeues: int = 0,
                  max_requeues: int = 0) -> StepDecision:
    """What the replica wrapper does after its srun step `attempt` ended with `returncode`; `requeues`
    is the job's SLURM_RESTART_COUNT."""
    if returncode == 0:
        return StepDecision(StepAction.DONE, "the step exited 0")
    if stopping:
        return StepDecision(StepAction.FAIL, f"the step exited {returncode} while Slurm stops or requeues the job")
    if attempt >= max_restarts and requeues < max_requeues:
        return StepDecision(StepAction.REQUEUE, f"the step exited {returncode}; all {max_restarts} restarts used, "
                            f"requeue {requeues + 1} of {max_requeues}")
    if attempt >= max_restarts:
        return StepDecision(StepAction.FAIL, f"the step exited {returncode}; all {max_restarts} restarts and "
                            f"{max_requeues} requeues used")
    return StepDecision(StepAction.RESTART, f"the step exited {returncode}; restart {attempt + 1} of {max_restarts}")


def resolve_host(value: str, environ: Mapping[str, str]) -> str:
    """A --bind-host value as this process binds it: @node is the node's Slurm name."""
    if value != NODE_HOST:
        return value
    node = environ.get("SLURMD_NODENAME")
    if not node:
        raise ValueError(f"FTRUN_BIND_HOST={NODE_HOST} outside a Slurm job: SLURMD_NODENAME is not set; set "
                         "FTRUN_BIND_HOST to this host's address")
    return node


def _need(environ: Mapping[str, str], name: str, why: str) -> str:
    value = environ.get(name)
    if not value:
        raise ValueError(f"{name} is not set ({why})")
    return value


def _int(environ: Mapping[str, str], name: str, why: str, default: int | None = None) -> int:
    if default is not None and not environ.get(name):
        return default
    raw = _need(environ, name, why)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def task_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables one srun task of a replica adds to its environment before it runs the rank's command
    (the torchrun names WorkerSpec.from_environ reads). Raises ValueError naming what is missing."""
    srun = "the rank must run as an srun task inside the replica's batch job"
    if not environ.get("FTRUN_REPLICA_ID") or not environ.get("FTRUN_NUM_REPLICAS"):
        raise ValueError(f"FTRUN_REPLICA_ID/FTRUN_NUM_REPLICAS are not set: {SLURM_HELP}")
    rank = _int(environ, "SLURM_PROCID", srun)
    ntasks = _int(environ, "SLURM_NTASKS", srun)
    if rank >= ntasks:
        raise ValueError(f"SLURM_PROCID={rank} is outside SLURM_NTASKS={ntasks}")
    wrapper = "set by the replica wrapper, python -m ftrun.launch.slurm replica"
    max_restarts = _int(environ, "FTRUN_SLURM_MAX_RESTARTS", wrapper)
    attempt = _int(environ, "FTRUN_SLURM_ATTEMPT", wrapper)
    inc = incarnation(_int(environ, "SLURM_RESTART_COUNT", "", default=0), attempt, max_restarts)
    out = {
        "RANK": str(rank),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": str(_int(environ, "SLURM_LOCALID", srun)),
        "GROUP_RANK": str(_int(environ, "SLURM_NODEID", srun)),
        "TORCHELASTIC_RESTART_COUNT": str(inc),
        "MASTER_ADDR": _need(environ, "MASTER_ADDR", wrapper),
        "MASTER_PORT": str(_int(environ, "MASTER_PORT", wrapper)),
        "TORCHELASTIC_USE_AGENT_STORE": AGENT_STORE,
        "FTRUN_LIGHTHOUSE": _need(environ, "FTRUN_LIGHTHOUSE", f"the lighthouse's host:port; {SLURM_HELP}"),
    }
    if environ.get("FTRUN_BIND_HOST"):
        out["FTRUN_BIND_HOST"] = resolve_host(environ["FTRUN_BIND_HOST"], environ)
    if environ.get("SLURM_JOB_ID"):
        out["FTRUN_SLURM_JOB_ID"] = environ["SLURM_JOB_ID"]
    return out


def srun_command(environ: Mapping[str, str], command: list[str], python: str) -> list[str]:
    """The srun line that runs one step of the replica: every task of the allocation, each through the
    task mapping; the whole step ends when one task fails."""
    ntasks = _int(environ, "SLURM_NTASKS", "the replica wrapper must run inside the replica's batch job")
    nodes = _int(environ, "SLURM_JOB_NUM_NODES", "the replica wrapper must run inside the replica's batch job",
                 default=1)
    return ["srun", "--kill-on-bad-exit=1", f"--ntasks={ntasks}", f"--nodes={nodes}",
            python, "-m", "ftrun.launch.slurm", "task", "--", *command]
