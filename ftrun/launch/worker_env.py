"""The contract between the supervisor and a rank process: environment variables, torchrun-compatible.

torchrun's names (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT) keep their meaning: a "group" is one replica, MASTER_* is the store the
replica's ranks rendezvous on. ftrun adds FTRUN_* for the lighthouse and the replica identity. Only
entry points call `WorkerSpec.from_environ`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


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

    def to_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.replica_index * self.ranks_per_replica + self.rank),
            "LOCAL_RANK": str(self.rank),
            "WORLD_SIZE": str(self.num_replicas * self.ranks_per_replica),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_replica),
            "GROUP_RANK": str(self.replica_index),
            "MASTER_ADDR": self.store_addr,
            "MASTER_PORT": str(self.store_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.incarnation),
            "FTRUN_REPLICA_ID": self.replica_id,
            "FTRUN_NUM_REPLICAS": str(self.num_replicas),
            "FTRUN_LIGHTHOUSE": self.lighthouse,
            "FTRUN_TOKEN": self.token,
            "FTRUN_RUN_DIR": self.run_dir,
            **({"FTRUN_MAX_STEPS": str(self.max_steps)} if self.max_steps is not None else {}),
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "WorkerSpec":
        try:
            return cls(
                replica_id=environ["FTRUN_REPLICA_ID"],
                replica_index=int(environ["GROUP_RANK"]),
                num_replicas=int(environ["FTRUN_NUM_REPLICAS"]),
                rank=int(environ["LOCAL_RANK"]),
                ranks_per_replica=int(environ["LOCAL_WORLD_SIZE"]),
                incarnation=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                lighthouse=environ["FTRUN_LIGHTHOUSE"],
                token=environ["FTRUN_TOKEN"],
                store_addr=environ["MASTER_ADDR"],
                store_port=int(environ["MASTER_PORT"]),
                run_dir=environ.get("FTRUN_RUN_DIR", "."),
                max_steps=int(environ["FTRUN_MAX_STEPS"]) if "FTRUN_MAX_STEPS" in environ else None,
            )
        except KeyError as e:
            raise ValueError(f"rank process started without the {e.args[0]} environment variable") from None
