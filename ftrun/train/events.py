"""The JSON event lines a rank prints on stdout (what `ftrun launch` reads): helpers shared by
`ft.train()` (ftrun.train.api) and the user's own loop (ftrun.train.own).

A "step" event: the step trained, its quorum, whether it committed, the loss, whether the replica
healed in it, the ledger's lineage, and after a commit `param_hash` (a fingerprint of this rank's
parameter bytes, its local shards under FSDP2: ftrun.train.fingerprint) and, in the user's own loop,
`user_state_hash` (the registered state's, ftrun.train.user_state). `ftrun launch` compares both across
replicas per (step, rank).
"""

from __future__ import annotations

import json
import sys

import torch

from ftrun.train.fingerprint import fingerprint, tensor_bytes
from ftrun.train.shard import local
from ftrun.train.trainer import StepResult


def param_hash(model: torch.nn.Module) -> str:
    """Fingerprint of this rank's parameter bytes (its local shards under FSDP2), in named_parameters order."""
    h = fingerprint()
    for _, p in model.named_parameters():
        h.update(tensor_bytes(local(p)))
    return h.hexdigest()


def print_event(event: dict) -> None:
    """One line in one write: a background checkpoint write's events may print beside the step's."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def step_event(r: StepResult, model: torch.nn.Module, now: float, *, rank: int) -> dict:
    event = {"event": "step", "t": now, "step": r.step, "quorum_id": r.quorum_id, "participants": list(r.participants),
             "committed": r.committed, "loss": r.loss, "healed": r.healed, "lineage": r.lineage, "rank": rank}
    if r.committed:
        event["param_hash"] = param_hash(model)
    return event
