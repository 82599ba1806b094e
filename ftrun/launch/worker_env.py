"""The contract between a launcher and a rank process: environment variables, torchrun-compatible.

One contract for every launcher: torchrun's names describe the REPLICA's world, as one torchrun per
replica sets them (in FT-HSDP a replica is a torchrun world; traffic between replicas is FTAR's), and
ftrun's FTRUN_* names carry the replica layout:
- RANK / WORLD_SIZE: the rank inside the replica and the replica's ranks; LOCAL_WORLD_SIZE the
  replica's ranks on this host; LOCAL_RANK the rank's host slot (its place among all the ranks started
  on this host, by which FTConfig.device="cuda" picks its GPU) or, where no launcher gave one, the rank;
  GROUP_RANK the node inside the replica (as torchrun's);
- MASTER_ADDR / MASTER_PORT: a rendezvous store of this replica incarnation alone, hosted by the
  launcher (torchrun's agent store), with TORCHELASTIC_USE_AGENT_STORE=True so that a script's own
  `dist.init_process_group()` (env://) joins it as a client: a torchrun-style script makes the replica's
  group itself, which `init_from_env` then adopts. A restarted replica gets a fresh store;
- TORCHELASTIC_RESTART_COUNT: the replica's incarnation;
- FTRUN_REPLICA_ID ("r<i>"), FTRUN_NUM_REPLICAS, FTRUN_LIGHTHOUSE, the token (FTRUN_TOKEN or
  FTRUN_TOKEN_FILE): the replica's identity in the job.

The launchers:
- `ftrun launch` (a replica's ranks on one host: GROUP_RANK 0) also sets FTRUN_REPLICA_INDEX /
  FTRUN_REPLICA_RANK / FTRUN_RANKS_PER_REPLICA, the layout outright, and FTRUN_HOST_SLOT (= LOCAL_RANK):
  on each host, the replicas placed there in index order, their ranks in order, so replicas sharing a
  host spread over its GPUs. A store per replica incarnation: Job.replica_store.
- One `torchrun` per replica (plus `ftrun lighthouse`): torchrun sets its names, ftrun's come from the
  user; torchrun's restarts are the replica's incarnations.
- Slurm (ftrun.launch.slurm_plan.task_environ): Slurm's variables mapped to the same names, the replica
  wrapper hosting a store per srun step.
The network identity (FTRUN_BIND_HOST, FTRUN_ADVERTISE_HOST) is ftrun.net.NetConfig. Only entry points
call `WorkerSpec.from_environ`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Mapping

from ftrun.launch.slurm_plan import AGENT_STORE, SLURM_HELP
from ftrun.net import NetConfig, load_token

TORCHRUN_HELP = (
    "started by torchrun without ftrun's replica settings: run one torchrun per replica, each with "
    "FTRUN_REPLICA_ID=r<i> (i = 0..N-1), FTRUN_NUM_REPLICAS=N, FTRUN_LIGHTHOUSE=host:port (from `ftrun "
    "lighthouse`) and FTRUN_TOKEN_FILE=<0600 file> (or FTRUN_TOKEN); see README 'torchrun'"
)
_REPLICA_ID = re.compile(r"^r(0|[1-9][0-9]*)$")
# The variables that say which rank a process is (the rest of a launcher's environment is the same for
# every rank of a job): a zygote's prepared spare runs a script without them until it is claimed.
IDENTITY_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "FTRUN_REPLICA_ID", "FTRUN_REPLICA_INDEX", "FTRUN_REPLICA_RANK", "FTRUN_HOST_SLOT", "FTRUN_BIND_HOST",
    "FTRUN_ADVERTISE_HOST", "FTRUN_FORKED_AT",
})


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    replica_id: str
    replica_index: int
    num_replicas: int
    rank: int  # rank inside the replica
    ranks_per_replica: int
    incarnation: int  # how many times this replica was restarted
    lighthouse: str
    token: str
    store_addr: str
    store_port: int
    run_dir: str
    max_steps: int | None = None  # stop after this many committed steps (None: the script decides)
    diagnose: str | None = None  # the diagnosis collector to serve telemetry to (FTRUN_DIAGNOSE; None: off)
    fault_file: str | None = None  # `ftrun launch --inject`'s fault plan for the script (FTRUN_FAULT_FILE)
    # this rank's place among the ranks started on its host (FTRUN_HOST_SLOT, or torchrun's LOCAL_RANK);
    # None: no launcher said (see device_slot)
    host_slot: int | None = None
    net: NetConfig = field(default_factory=NetConfig)

    @property
    def device_slot(self) -> int:
        """The slot FTConfig.device="cuda" picks this rank's GPU by (cuda:{slot % GPUs}, ftrun.train.device):
        the host slot, or the rank inside the replica where no launcher gave one."""
        return self.rank if self.host_slot is None else self.host_slot

    def for_rank(self, rank: int) -> "WorkerSpec":
        """The spec of rank `rank` of this rank's replica: its host slot moves with the rank (a replica's
        ranks take consecutive slots), the rest is the replica's."""
        if not 0 <= rank < self.ranks_per_replica:
            raise ValueError(f"rank {rank} is outside a replica of {self.ranks_per_replica} ranks")
        slot = None if self.host_slot is None else self.host_slot - self.rank + rank
        return replace(self, rank=rank, host_slot=slot)

    def to_environ(self) -> dict[str, str]:
        """What `ftrun launch` sets for this rank (torchrun's names for the replica's world, plus ftrun's)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.device_slot),
            "WORLD_SIZE": str(self.ranks_per_replica),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_replica),
            "GROUP_RANK": "0",
            "MASTER_ADDR": self.store_addr,
            "MASTER_PORT": str(self.store_port),
            "TORCHELASTIC_USE_AGENT_STORE": AGENT_STORE,
            "TORCHELASTIC_RESTART_COUNT": str(self.incarnation),
            "FTRUN_REPLICA_ID": self.replica_id,
            "FTRUN_REPLICA_INDEX": str(self.replica_index),
            "FTRUN_REPLICA_RANK": str(self.rank),
            "FTRUN_RANKS_PER_REPLICA": str(self.ranks_per_replica),
            "FTRUN_NUM_REPLICAS": str(self.num_replicas),
            "FTRUN_LIGHTHOUSE": self.lighthouse,
            "FTRUN_TOKEN": self.token,
            "FTRUN_RUN_DIR": self.run_dir,
            **self.net.to_environ(),
            **({"FTRUN_MAX_STEPS": str(self.max_steps)} if self.max_steps is not None else {}),
            **({"FTRUN_DIAGNOSE": self.diagnose} if self.diagnose else {}),
            **({"FTRUN_FAULT_FILE": self.fault_file} if self.fault_file else {}),
            **({"FTRUN_HOST_SLOT": str(self.host_slot)} if self.host_slot is not None else {}),
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "WorkerSpec":
        """The spec `ftrun launch` or a per-replica torchrun describes (see the module docstring).
        Raises ValueError naming the variable that is missing or wrong."""
        if "FTRUN_REPLICA_ID" not in environ and ("TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ):
            raise ValueError(TORCHRUN_HELP)
        if "FTRUN_REPLICA_ID" not in environ and "SLURM_PROCID" in environ:
            raise ValueError(f"started by Slurm without ftrun's replica settings: {SLURM_HELP}")
        replica_id = _need(environ, "FTRUN_REPLICA_ID")
        num_replicas = _int(environ, "FTRUN_NUM_REPLICAS", minimum=1)
        index = _int(environ, "FTRUN_REPLICA_INDEX") if "FTRUN_REPLICA_INDEX" in environ else _index(replica_id)
        if index >= num_replicas:
            raise ValueError(f"replica {replica_id} (index {index}) is outside FTRUN_NUM_REPLICAS={num_replicas}")
        size = _int(environ, "WORLD_SIZE", minimum=1, default=1)
        rank = _int(environ, "RANK", default=0)
        if "FTRUN_RANKS_PER_REPLICA" in environ:  # ftrun launch: the layout is explicit, and torchrun's agrees
            size = _agree(environ, "FTRUN_RANKS_PER_REPLICA", "WORLD_SIZE", size, minimum=1)
            rank = _agree(environ, "FTRUN_REPLICA_RANK", "RANK", rank)
            slot_var = "FTRUN_HOST_SLOT"
        else:  # one torchrun per replica (or a hand-started rank): its LOCAL_RANK is the host slot
            slot_var = "FTRUN_HOST_SLOT" if "FTRUN_HOST_SLOT" in environ else "LOCAL_RANK"
        if rank >= size:
            raise ValueError(f"rank {rank} is outside a replica of {size} ranks (RANK/WORLD_SIZE)")
        token = load_token(environ)
        if token is None:
            raise ValueError("rank process started without a job token: set FTRUN_TOKEN_FILE (a 0600 file) or FTRUN_TOKEN")
        return cls(
            replica_id=replica_id, replica_index=index, num_replicas=num_replicas, rank=rank, ranks_per_replica=size,
            incarnation=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
            lighthouse=_need(environ, "FTRUN_LIGHTHOUSE"), token=token,
            store_addr=_need(environ, "MASTER_ADDR") if size > 1 else environ.get("MASTER_ADDR", ""),
            store_port=_int(environ, "MASTER_PORT") if size > 1 else _int(environ, "MASTER_PORT", default=0),
            run_dir=environ.get("FTRUN_RUN_DIR", "."),
            max_steps=_int(environ, "FTRUN_MAX_STEPS") if "FTRUN_MAX_STEPS" in environ else None,
            net=NetConfig.from_environ(environ), diagnose=environ.get("FTRUN_DIAGNOSE") or None,
            host_slot=_int(environ, slot_var) if slot_var in environ else None,
        )


def first_host_slots(placement: Mapping[str, int], ranks_per_replica: int) -> dict[str, int]:
    """Replica id -> the host slot of its rank 0, for replicas placed on hosts (replica id "r<i>" -> host
    index): on each host, the replicas placed there in index order, each taking `ranks_per_replica`
    consecutive slots. Pure."""
    if ranks_per_replica < 1:
        raise ValueError(f"ranks_per_replica must be >= 1, got {ranks_per_replica}")
    taken: dict[int, int] = {}
    first = {}
    for rid in sorted(placement, key=_index):
        host = placement[rid]
        first[rid] = taken.get(host, 0)
        taken[host] = first[rid] + ranks_per_replica
    return first


def _agree(environ: Mapping[str, str], name: str, torchrun_name: str, torchrun_value: int, *,
           minimum: int = 0) -> int:
    """ftrun's variable `name`, which must say what torchrun's does where both are set (torchrun's names
    describe the replica's world, module docstring)."""
    value = _int(environ, name, minimum=minimum) if name in environ else torchrun_value
    if torchrun_name in environ and value != torchrun_value:
        raise ValueError(f"{name}={value} but {torchrun_name}={torchrun_value}: {torchrun_name} must be the "
                         f"replica's (the rank inside it, its size), not the whole job's")
    return value


def _need(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise ValueError(f"rank process started without the {name} environment variable")
    return value


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None and default is not None:
        return default
    raw = _need(environ, name)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _index(replica_id: str) -> int:
    m = _REPLICA_ID.match(replica_id)
    if m is None:
        raise ValueError(f"FTRUN_REPLICA_ID={replica_id!r} must be r<i> (r0, r1, ...) or come with FTRUN_REPLICA_INDEX")
    return int(m.group(1))
