"""What must hold after a chaos schedule, checked over what the run left behind. Pure: no I/O.

The driver (driver.py) collects an Observation: every event the ranks printed (tagged with replica_id,
incarnation and rank), the audit records of every replica, the final ledger, the loader_state found on
disk, whether the services still answer, and the processes and /dev/shm files of the run still there
after it was torn down. `check` turns it into a Verdict:

- no fork: one lineage per step. Every committed step (per the ranks' step events and the audit's commit
  records) has one lineage, and every rank position one param_hash for it. The one allowed exception is
  the lighthouse's full restart (decide rule 8: every replica holding the job's state died, the fresh
  ones rewind the job to its durable state, here step 0 or a checkpoint): the steps after it are
  retrained on a new lineage. So the check runs per epoch, an epoch starting at each quorum the
  lighthouse marked `rewind`, and the rewinds are counted;
- exactly-once data: the audit of the final ledger's lineage finds no duplicated or skipped batch and
  no problem;
- the job finished: it reached its steps within the time limit, and every replica that ended there holds
  the same state (param_hash per rank, ledger lineage);
- the loader_state on disk is the final ledger's (same step and lineage);
- services up, no leaked process, no leaked /dev/shm file.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ftrun.data.audit import Commit, Record, audit
from ftrun.data.loader_state import DataError, LoaderState


@dataclass
class Observation:
    steps: int  # the job's goal
    events: list[dict]
    audit_records: list[Record] = field(default_factory=list)
    audit_problems: list[str] = field(default_factory=list)  # unreadable audit files
    disk_ledger: tuple[int, str] | None = None  # (step, lineage) of the newest readable loader_state slot
    disk_error: str | None = None  # why no slot could be read
    services_down: list[str] = field(default_factory=list)  # "lighthouse: why"
    leaked_processes: list[str] = field(default_factory=list)
    leaked_shm: list[str] = field(default_factory=list)
    timed_out: bool = False
    rewinds: list[int] = field(default_factory=list)  # quorum ids of the lighthouse's full restarts


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    forks: int = 0  # steps with more than one lineage (or param_hash per rank)
    duplicate_batches: int = 0
    skipped_batches: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


def fork_steps(events: list[dict], records: list[Record], rewinds: list[int] = ()) -> dict[tuple[int, int], str]:
    """(epoch, step) -> what forked there: more than one lineage, or more than one param_hash for a rank.

    Epoch e holds the quorums from the e-th rewind on (quorum ids in `rewinds`). An audit commit record
    carries no quorum id: it counts in the epoch of a step event with its lineage, or in epoch 0 when
    there was no rewind (else it is left out: its writer died before saying which quorum it was in)."""
    starts = sorted(set(rewinds))

    def epoch(quorum_id: int) -> int:
        return sum(1 for q in starts if q <= quorum_id)

    lineages: dict[tuple[int, int], set[str]] = defaultdict(set)
    hashes: dict[tuple[int, int, int], set[str]] = defaultdict(set)
    epoch_of: dict[str, int] = {}
    for ev in events:
        if ev.get("event") == "step" and ev.get("committed"):
            e = epoch(ev.get("quorum_id", 0))
            if ev.get("lineage") is not None:
                lineages[(e, ev["step"])].add(ev["lineage"])
                epoch_of[ev["lineage"]] = e
            if ev.get("param_hash") is not None:
                hashes[(e, ev["step"], ev.get("rank", 0))].add(ev["param_hash"])
    for rec in records:
        if isinstance(rec, Commit):
            e = epoch_of.get(rec.lineage, None if starts else 0)
            if e is not None:
                lineages[(e, rec.step)].add(rec.lineage)
    out: dict[tuple[int, int], str] = {}
    for (e, step), seen in lineages.items():
        if len(seen) > 1:
            out[(e, step)] = f"step {step} committed under {len(seen)} lineages ({', '.join(sorted(seen))})"
    for (e, step, rank), seen in sorted(hashes.items()):
        if len(seen) > 1 and (e, step) not in out:
            out[(e, step)] = f"step {step} rank {rank} has {len(seen)} different param_hashes"
    return out


def finals_at_goal(events: list[dict], steps: int) -> list[dict]:
    return [e for e in events if e.get("event") == "final" and e.get("step") == steps]


def check(obs: Observation) -> Verdict:
    v = Verdict()
    forks = fork_steps(obs.events, obs.audit_records, obs.rewinds)
    v.forks = len(forks)
    v.violations += [f"fork: {why}" for _, why in sorted(forks.items())]

    finals = finals_at_goal(obs.events, obs.steps)
    if obs.timed_out:
        v.violations.append("liveness: the job did not finish within the time limit")
    if not finals:
        top = max((e.get("step", 0) for e in obs.events if e.get("event") == "final"), default=None)
        v.violations.append(f"liveness: no replica finished at step {obs.steps} (furthest final: {top})")
        ledger = None
    else:
        by_rank: dict[int, set[str]] = defaultdict(set)
        lineages = set()
        for e in finals:
            by_rank[e.get("rank", 0)].add(e.get("param_hash"))
            lineages.add((e.get("loader_state") or {}).get("lineage"))
        if any(len(h) > 1 for h in by_rank.values()) or len(lineages) > 1:
            v.violations.append(f"divergence: the replicas that finished hold different states "
                                f"({sorted((e['replica_id'], e.get('rank', 0), e.get('param_hash', '')[:12]) for e in finals)})")
        ledger = finals[0].get("loader_state")

    if ledger is not None:
        try:
            final = LoaderState.from_dict(ledger)
        except DataError as e:
            v.violations.append(f"exactly-once: the final ledger is unreadable: {e}")
            final = None
        if final is not None:
            report = audit(obs.audit_records, final=final)
            v.duplicate_batches, v.skipped_batches = len(report.duplicates), len(report.gaps)
            if not report.ok or obs.audit_problems:
                v.violations.append(f"exactly-once: {report.summary()}"
                                    + "".join(f"; {p}" for p in obs.audit_problems[:3]))
            if obs.disk_ledger != (final.step, final.lineage):
                v.violations.append(f"loader_state: on disk {obs.disk_ledger}, final ledger "
                                    f"{(final.step, final.lineage)}"
                                    + (f" ({obs.disk_error})" if obs.disk_error else ""))

    v.violations += [f"service down: {s}" for s in obs.services_down]
    v.violations += [f"leaked process: {p}" for p in obs.leaked_processes]
    v.violations += [f"leaked /dev/shm file: {f}" for f in obs.leaked_shm]
    return v
