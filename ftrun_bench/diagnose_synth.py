"""Synthetic telemetry summaries of a whole job with one injected fault, for the analysis benchmark
and tests (pure: numpy and a seeded Generator, no I/O).

`JobShape` is the job (replicas x ranks per replica, ranks per host, step and all-reduce time, FTAR
pipeline depth); `scenario(shape, kind, seed)` returns the `Snapshot` the collector would gather
`hang_age_s` after the fault, the `Layout`, and the `Truth` the verdict must name. The counters follow
what the runtime records (see summary.py): in a ring held up by one rank, every rank downstream has
read all its previous rank sent, the rank upstream has a send that its next rank does not take.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ftrun.diagnose.model import CANDIDATES, HANG, NO_HANG, SLOW_HOST, SLOW_LINK, Layout, Snapshot
from ftrun.diagnose.summary import DONE, FAILED, HIST_LEN, RUNNING, empty_hist, empty_summary
from ftrun.diagnose.telemetry import Ev

KINDS = ("none", "hang_rank", "stuck_rank", "never_joined", "lost_chunk", "hang_host", "killed_rank",
         "building_cut", "slow_host", "slow_link", "hang_in_vote", "stuck_in_vote", "hang_host_before_entry",
         "hang_rank_at_op_end")
_TREE_FANOUT = 16


@dataclass(frozen=True, kw_only=True)
class JobShape:
    num_replicas: int = 12
    ranks_per_replica: int = 8192
    ranks_per_host: int = 8
    step_s: float = 2.0  # one training step
    compute_s: float = 1.6  # of which forward/backward
    num_chunks: int = 4  # FTAR C
    num_partitions: int = 2
    grad_bytes: int = 256 << 20
    hang_age_s: float = 3.0  # the collector's snapshot comes this long after the fault

    @property
    def num_ranks(self) -> int:
        return self.num_replicas * self.ranks_per_replica

    @property
    def num_messages(self) -> int:
        """Chunk sends (and receives) per rank per all-reduce."""
        return (2 * self.num_replicas - 2) * self.num_chunks * self.num_partitions


@dataclass(frozen=True)
class Truth:
    kind: str  # the verdict kind that names it exactly
    ranks: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    candidate_kind: str = ""  # a kind that counts as a candidate-set hit (sender/receiver ambiguity)
    lag_s: float = 0.0  # slow kinds: the injected delay per step


@lru_cache(maxsize=4)
def layout(shape: JobShape) -> Layout:
    """One Layout per shape, as a live job's collector keeps one per membership (its ring table is
    computed once). Callers must not modify its arrays."""
    r = np.arange(shape.num_ranks)
    replica = (r // shape.ranks_per_replica).astype(np.int32)
    return Layout(replica=replica, group=(r % shape.ranks_per_replica).astype(np.int32),
                  host=(r // shape.ranks_per_host).astype(np.int32), ring_pos=replica.copy())


def healthy(shape: JobShape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """(summary, hist, now) of a job in the middle of a healthy all-reduce."""
    n, k, per = shape.num_ranks, HIST_LEN, shape.ranks_per_replica
    t0 = 1000.0
    enter = t0 + np.arange(k + 1)[None, :] * shape.step_s + np.abs(rng.normal(0, 0.01 * shape.step_s, (n, k + 1)))
    ring_last = enter.reshape(shape.num_replicas, per, k + 1).max(axis=0)
    ftar_s = shape.step_s - shape.compute_s
    hist = np.repeat(empty_hist(k)[None, :], n, axis=0)
    hist["qid"], hist["cid"], hist["step"] = 3, np.arange(k)[None, :], 100 + np.arange(k)[None, :]
    hist["enter"] = enter[:, :k]
    hist["done"] = np.tile(ring_last[:, :k], (shape.num_replicas, 1)) + ftar_s * 0.8
    sent_bytes = 2 * (shape.num_replicas - 1) / shape.num_replicas * shape.grad_bytes
    hist["sent_bytes"] = sent_bytes
    hist["busy"] = 0.5 * ftar_s * rng.uniform(0.8, 1.2, (n, k))
    s = np.repeat(empty_summary(), n)
    now = t0 + k * shape.step_s + 0.1 * shape.step_s + ftar_s * 0.5
    m = shape.num_messages
    s["f_qid"], s["f_cid"], s["f_step"], s["f_state"] = 3, k, 100 + k, RUNNING
    s["f_ring"], s["f_index"] = shape.num_replicas, np.arange(n) // per
    s["f_total"] = m + shape.num_chunks * shape.num_partitions
    s["f_enter"] = enter[:, k]
    done = rng.uniform(0, 1, n)
    s["f_sent"] = s["f_sends"] = (done * m).astype(np.int32)
    s["f_recvd"] = s["f_used"] = np.maximum(s["f_sent"] - shape.num_chunks, 0)
    s["f_steps"] = s["f_sent"] + 1
    s["f_last"] = now - rng.uniform(0, 0.2, n)
    s["now"] = now
    s["t_cid"], s["t_ev"], s["t_t"] = 2 * (100 + k), Ev.DONE, enter[:, k] - 0.05
    return s, hist, now


def _ring(shape: JobShape, j: int) -> np.ndarray:
    """Global ranks of j's ring, starting at j and going downstream."""
    per, n = shape.ranks_per_replica, shape.num_replicas
    pos = j // per
    return np.array([((pos + d) % n) * per + j % per for d in range(n)])


def _stall_ring(s: np.ndarray, shape: JobShape, j: int, m0: int, now: float) -> np.ndarray:
    """Counters of a ring held up at j (j sent m0 + C chunks, then nothing): downstream ranks read all
    their previous rank sent; the rank upstream of j has one send j does not take. Returns the ring."""
    ring, c, m = _ring(shape, j), shape.num_chunks, shape.num_messages
    sent = min(m0 + c, m)
    s["f_recvd"][j] = s["f_used"][j] = m0
    s["f_sent"][j] = s["f_sends"][j] = sent
    for r in ring[1:]:
        s["f_recvd"][r] = s["f_used"][r] = sent
        sent = min(sent + c, m)
        s["f_sent"][r] = s["f_sends"][r] = sent
    s["f_sends"][ring[-1]] += 1
    s["f_state"][ring] = RUNNING
    s["f_last"][ring] = now - shape.hang_age_s
    s["f_enter"][ring] = np.minimum(s["f_enter"][ring], now - shape.hang_age_s - 0.05)
    s["f_steps"][ring] = s["f_used"][ring] + c
    return ring


def _late(s: np.ndarray, shape: JobShape, ranks: np.ndarray, now: float, wait: float) -> None:
    """`ranks` have not entered the current all-reduce yet; their ring peers entered `wait` ago and wait."""
    for j in ranks:
        ring = _stall_ring(s, shape, int(j), 0, now)
        s["f_enter"][ring] = s["f_last"][ring] = now - wait
        s["f_cid"][j] -= 1
        s["f_state"][j] = DONE


def _vote_waits(s: np.ndarray, since: float, who: np.ndarray) -> None:
    """`who` entered the commit vote (tree collective) after their all-reduce and wait in it since `since`."""
    s["t_cid"][who] += 1
    s["t_ev"][who] = Ev.ENTER
    s["t_t"][who] = since


def _vote_hang(s: np.ndarray, shape: JobShape, lay: Layout, j: int, now: float, answering: bool) -> None:
    """Every all-reduce done; the replica's ranks in the commit vote, held up by j: j did not answer (and
    never entered), or j entered, its children sent up and it did not."""
    s["f_state"], s["f_last"] = DONE, now - shape.hang_age_s
    mates = lay.replica == lay.replica[j]
    _vote_waits(s, now - shape.hang_age_s, mates)
    s["t_ev"][mates] = Ev.SEND
    g, base = int(lay.group[j]), j - int(lay.group[j])
    while g > 0:  # j's ancestors still wait for j's subtree
        g = (g - 1) // _TREE_FANOUT
        s["t_ev"][base + g] = Ev.ENTER
    s["t_ev"][j] = Ev.ENTER
    if not answering:
        s["t_cid"][j] -= 1
        s["t_ev"][j] = Ev.DONE


def scenario(shape: JobShape, kind: str, seed: int) -> tuple[Snapshot, Layout, Truth]:
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {KINDS}")
    rng = np.random.default_rng(seed)
    s, hist, now = healthy(shape, rng)
    lay = layout(shape)
    answered = np.ones(shape.num_ranks, bool)
    j = int(rng.integers(shape.num_ranks))
    m0 = int(rng.integers(0, shape.num_messages - shape.num_chunks))
    before = s["f_last"].copy()
    truth = _inject(kind, shape, s, hist, answered, lay, j, m0, now, rng)
    if kind in ("hang_rank", "stuck_rank", "never_joined", "lost_chunk", "hang_host", "building_cut",
                "hang_rank_at_op_end"):
        others = (s["f_last"] == before) & (s["t_ev"] == Ev.DONE)  # every rank outside the held-up rings ...
        s["f_state"][others] = DONE  # ... finished its all-reduce and waits in the commit vote
        s["f_steps"][others] = s["f_total"][others]
        _vote_waits(s, now - shape.hang_age_s + 0.1, others)
    return Snapshot(now=now, answered=answered, summary=s, hist=hist), lay, truth


def _inject(kind, shape, s, hist, answered, lay, j, m0, now, rng) -> Truth:
    host = int(lay.host[j])
    if kind == "none":
        return Truth(NO_HANG)
    if kind in ("hang_rank", "stuck_rank", "lost_chunk", "killed_rank"):
        ring = _stall_ring(s, shape, j, m0, now)
        if kind == "hang_rank":
            answered[j] = False
        elif kind == "stuck_rank":
            s["f_recvd"][j] += 1  # it took a chunk in and never finished reducing it
        elif kind == "lost_chunk":
            s["f_sent"][ring[-1]] += 1  # sent, never arrived
            s["f_sends"][ring[-1]] = s["f_sent"][ring[-1]]
            return Truth(CANDIDATES, (int(ring[-1]), j), candidate_kind=CANDIDATES)
        else:
            answered[j] = False
            s["f_state"][ring] = FAILED
            s["f_last"][ring] = now - shape.hang_age_s + rng.uniform(0, 0.01, len(ring))
        return Truth(HANG, (j,), (host,))
    if kind == "hang_rank_at_op_end":  # hung before its last send of the all-reduce: its next rank waits at
        ring = _stall_ring(s, shape, j, 0, now)  # its last receive; the others finished, entered the next one,
        d1, d2 = int(ring[1]), int(ring[2])  # sent their first chunks and wait (the rank after d1 on d1)
        s["f_cid"][d1] -= 1
        s["f_sent"][d1] = s["f_sends"][d1] = shape.num_messages
        s["f_recvd"][d1] = s["f_used"][d1] = shape.num_messages - 1
        s["f_steps"][d1] = s["f_total"][d1] - 1
        s["f_recvd"][d2] = s["f_used"][d2] = 0
        answered[j] = False
        return Truth(HANG, (j,), (host,))
    if kind == "never_joined":
        _stall_ring(s, shape, j, 0, now)
        s["f_cid"][j] -= 1
        s["f_state"][j] = DONE
        s["t_ev"][j] = 0
        return Truth(HANG, (j,), (host,))
    if kind in ("hang_host", "building_cut"):
        ranks = np.flatnonzero(lay.host == host) if kind == "hang_host" else \
            np.flatnonzero(lay.replica == lay.replica[j])
        for r in ranks:
            _stall_ring(s, shape, int(r), m0, now)
        answered[ranks] = False
        return Truth(HANG, tuple(int(r) for r in ranks), tuple(sorted({int(h) for h in lay.host[ranks]})))
    if kind == "hang_host_before_entry":  # hung early in compute: the lighthouse aborted the quorum on the lost
        ranks = np.flatnonzero(lay.host == host)  # heartbeat before the ring peers entered the all-reduce; they
        mates = np.flatnonzero((lay.replica == lay.replica[j]) & (lay.host != host))  # stay in the last (done),
        s["f_state"], s["f_steps"] = DONE, s["f_total"]  # the replica's live ranks entered the next and failed
        s["f_cid"][mates] += 1
        s["f_state"][mates] = FAILED
        s["f_enter"][mates] = s["f_last"][mates] = now - shape.hang_age_s + rng.uniform(0, 0.01, len(mates))
        answered[ranks] = False
        return Truth(HANG, tuple(int(r) for r in ranks), (host,))
    if kind == "slow_host":
        ranks = np.flatnonzero(lay.host == host)
        factor = rng.uniform(2, 10)
        hist["enter"][ranks] += (factor - 1) * shape.compute_s
        if rng.random() < 0.5:  # caught while its ring peers wait for it, as every step (less than usual)
            _late(s, shape, ranks, now, wait=rng.uniform(0.2, 0.9) * (factor - 1) * shape.compute_s)
        return Truth(SLOW_HOST, tuple(int(r) for r in ranks), (host,), lag_s=(factor - 1) * shape.compute_s)
    if kind in ("hang_in_vote", "stuck_in_vote"):
        _vote_hang(s, shape, lay, j, now, answering=kind == "stuck_in_vote")
        others = (lay.group == 0) & (lay.replica != lay.replica[j])  # the other replicas committed and ask
        s["t_ev"][others], s["q_ev"][others], s["q_t"][others] = Ev.DONE, Ev.ENTER, now - shape.hang_age_s + 0.5
        s["q_step"][others] = s["f_step"][others] + 1
        answered[j] = kind == "stuck_in_vote"
        return Truth(HANG, (j,), (host,))
    factor = rng.uniform(3.5, 10)
    hist["busy"][j] *= factor
    nxt = int(_ring(shape, j)[1])
    return Truth(SLOW_LINK, (j, nxt), tuple(sorted({host, int(lay.host[nxt])})))
