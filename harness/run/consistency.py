"""Did every failure scenario end with the same state everywhere? Pure checks over a recorder's events.

The emulator trains no tensors, so "identical state" is defined by what determines the state: a
replica's model after n steps is fixed by its history of steps, each the average of the gradients of
that step's contributors (the quorum's participants minus those healing, which contribute zeros). So
each replica incarnation carries a hash chain, digest(n) = H(digest(n-1), n, quorum_id, contributors),
extended at each of its commits, reset to the genesis at a (re)start and replaced at a heal by the
digest the job committed for the step it healed to (the state its sources serve). Checked:

replicas (`check_replicas`):
- a commit extends the replica's own state (it commits step n from step n-1, under the quorum it entered);
- every commit of step n, by any replica, has the same digest: no step was committed by two groups with
  different contributors or on top of different histories (this is what a split brain looks like);
- a heal goes to a step the job committed, and a quorum's recorded step is the replica's own step;
- at the end, every live participant of the last step's quorum holds the final step and its digest
  (live: its incarnation was not killed and did not fail).
quorum history (`check_quorum_history`), over the lighthouses' decisions (across restarts, in order):
- quorum ids never decrease and each id names exactly one participant set (no split brain);
- every quorum a replica entered is the one the lighthouse decided under that id, and each replica
  incarnation sees quorum ids that never decrease.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

GENESIS = "0" * 16
MAX_VIOLATIONS = 20
ENDED = ("kill", "failed")  # job records that end an incarnation before the job does


def step_digest(prev: str, step: int, quorum_id: int, contributors: Iterable[str]) -> str:
    """The state digest after committing `step` on top of `prev`."""
    doc = json.dumps([prev, step, quorum_id, sorted(contributors)], separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


@dataclass
class _Inc:
    step: int = 0
    digest: str = GENESIS
    quorum: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None  # (id, participants, behind)
    ended: bool = False


@dataclass
class ReplicaConsistency:
    consistent: bool
    final_step: int
    final_digest: str | None
    live_replicas: list[str]
    violations: list[str] = field(default_factory=list)


@dataclass
class QuorumHistoryConsistency:
    consistent: bool
    num_quorums: int  # distinct quorum ids the lighthouses decided
    num_lighthouses: int
    violations: list[str] = field(default_factory=list)


def check_replicas(events: list[dict[str, Any]]) -> ReplicaConsistency:
    """Replay the leaders' quorum / heal / commit events and the job's start / kill / failed records."""
    incs: dict[tuple[str, int], _Inc] = {}
    committed: dict[int, tuple[str, str]] = {}  # step -> (digest, who first committed it)
    final_quorums: dict[int, set[tuple]] = {}  # step -> quorums it was committed under
    bad: list[str] = []
    for e in events:
        kind, rid = e["event"], e.get("replica_id")
        if kind not in ("start", "quorum", "heal", "commit", *ENDED) or rid is None:
            continue
        key = (rid, e.get("incarnation", 0))
        inc = incs.setdefault(key, _Inc())
        who = f"{rid}.{key[1]}"
        if kind == "start":
            incs[key] = _Inc()
        elif kind in ENDED:
            inc.ended = True
        elif kind == "quorum":
            if e["step"] != inc.step:
                bad.append(f"{who} entered quorum {e['quorum_id']} at step {e['step']}, its commits say {inc.step}")
            inc.quorum = (e["quorum_id"], tuple(e["participants"]), tuple(e.get("behind", ())))
        elif kind == "heal":
            to = e["to_step"]
            if to == 0 or to in committed:
                inc.step, inc.digest = to, committed[to][0] if to else GENESIS
            else:
                bad.append(f"{who} healed to step {to}, which no replica committed")
        else:  # commit
            n = e["step"]
            if inc.quorum is None or inc.quorum[0] != e["quorum_id"] or rid not in inc.quorum[1]:
                bad.append(f"{who} committed step {n} under quorum {e['quorum_id']} it did not enter")
                continue
            if n != inc.step + 1:
                bad.append(f"{who} committed step {n} from its state at step {inc.step}")
            qid, participants, behind = inc.quorum
            contributors = [p for p in participants if p not in behind]
            inc.step, inc.digest = n, step_digest(inc.digest, n, qid, contributors)
            final_quorums.setdefault(n, set()).add(inc.quorum)
            first = committed.setdefault(n, (inc.digest, f"{who} (quorum {qid}, contributors {contributors})"))
            if first[0] != inc.digest:
                bad.append(f"step {n} diverged: {who} (quorum {qid}, contributors {contributors}) "
                           f"vs {first[1]}")
    final = max(committed, default=0)
    live: set[str] = set()
    for qid, participants, behind in sorted(final_quorums.get(final, ())):
        for key, inc in sorted(incs.items()):  # the incarnations that entered the last quorum and were not killed
            if key[0] not in participants or inc.ended or inc.quorum is None or inc.quorum[0] != qid:
                continue
            live.add(key[0])
            if (inc.step, inc.digest) != (final, committed[final][0]):
                bad.append(f"{key[0]}.{key[1]} was live in the last quorum {qid} but ended at step {inc.step} "
                           f"digest {inc.digest}; the job's final state is step {final} digest {committed[final][0]}")
    return ReplicaConsistency(consistent=not bad, final_step=final,
                              final_digest=committed[final][0] if final else None,
                              live_replicas=sorted(live), violations=bad[:MAX_VIOLATIONS])


def check_quorum_history(events: list[dict[str, Any]]) -> QuorumHistoryConsistency:
    """The lighthouses' decisions (`lighthouse_quorum`, in the order the lighthouses made them) against
    each other and against the quorums the replicas entered (`quorum`)."""
    bad: list[str] = []
    decided: dict[int, tuple[str, ...]] = {}
    last_id, lighthouses = -1, set()
    for e in events:
        if e["event"] != "lighthouse_quorum":
            continue
        qid, members = e["quorum_id"], tuple(sorted(e["participants"]))
        lighthouses.add(e.get("lighthouse", 0))
        if qid < last_id:
            bad.append(f"quorum id went back from {last_id} to {qid} at t={e['t']:.6f}")
        last_id = max(last_id, qid)
        if decided.setdefault(qid, members) != members:
            bad.append(f"quorum {qid} decided twice with different participants: {list(decided[qid])} "
                       f"and {list(members)} (split brain)")
    seen: dict[tuple[str, int], int] = {}
    for e in events:
        if e["event"] != "quorum" or "replica_id" not in e:
            continue
        qid, members, key = e["quorum_id"], tuple(sorted(e["participants"])), (e["replica_id"], e.get("incarnation", 0))
        if decided.get(qid) != members:
            bad.append(f"{key[0]}.{key[1]} entered quorum {qid} with {list(members)}; the lighthouse decided "
                       f"{list(decided[qid]) if qid in decided else 'no such quorum'}")
        if qid < seen.get(key, -1):
            bad.append(f"{key[0]}.{key[1]} went back from quorum {seen[key]} to {qid}")
        seen[key] = max(seen.get(key, -1), qid)
    return QuorumHistoryConsistency(consistent=not bad, num_quorums=len(decided),
                                    num_lighthouses=len(lighthouses), violations=bad[:MAX_VIOLATIONS])
