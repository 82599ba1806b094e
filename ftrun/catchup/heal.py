"""Wiring catch-up into the replica manager: who publishes, where a behind replica fetches from.

A training loop using ftrun.replica.manager.Manager wires it like this (rank r of replica R):

    server = CatchupServer(env=env, token=token, config=cfg)
    endpoints = {"catchup": server.start(), ...}            # -> Manager(data_addr=encode_endpoints(...))
    fetch = functools.partial(fetch_state, token=token, timeouts=cfg.timeouts, config=cfg)
    manager = Manager(..., heal=make_heal(fetch=fetch, load_state=load, rank=r))

    q = manager.start_step()                 # a behind replica fetches + loads inside, via the hook
    if should_publish(q):                    # someone is behind: the healthy ranks serve step q.step
        server.publish(q.step, state_dict_of(model, optimizer, rng), {"loader": ...})
    ... forward / backward / all-reduce (a healed replica contributes a zero gradient) ...
    if manager.should_commit():
        optimizer.step(); server.retire(q.step)

`q.step` is the number of steps the healthy replicas have committed, so the state they hold before the
optimizer step of step q.step is exactly what a behind replica needs ("the end of step n-1").
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ftrun.catchup.errors import CatchupError
from ftrun.replica.endpoints import decode_endpoints
from ftrun.replica.manager import HealFn, StepQuorum

FetchFn = Callable[[int, Sequence[str]], Mapping[str, torch.Tensor]]  # (step, sources) -> state
LoadFn = Callable[[Mapping[str, torch.Tensor]], None]

ENDPOINT = "catchup"


def catchup_sources(q: StepQuorum, endpoint: str = ENDPOINT) -> list[str]:
    """This rank's catch-up sources: the same rank's endpoint in every healthy (not behind) participant
    (from q.peer_addrs), pure.

    Rotated by this replica's place in the quorum, so behind replicas start at different sources.
    Participants that published no such endpoint for this rank are skipped.
    """
    sources = []
    for p, peer in zip(q.participants, q.peer_addrs):
        if p.step == q.step and peer:
            addr = decode_endpoints(peer).get(endpoint)
            if addr:
                sources.append(addr)
    if not sources:
        return []
    k = q.replica_index % len(sources)
    return sources[k:] + sources[:k]


def should_publish(q: StepQuorum) -> bool:
    """True for a healthy replica whose quorum has a behind participant (it must serve its state)."""
    return not q.healed and any(p.step < q.step for p in q.participants)


def should_reserve(q: StepQuorum, num_replicas: int) -> bool:
    """True when the quorum lacks some of the job's `num_replicas` replicas: one of them will join (a
    restart, a late starter) and this replica will publish its state for it, so it prepares the snapshot
    buffer now rather than on the joiner's critical path (SnapshotStore.reserve). Pure."""
    return len(q.participants) < num_replicas


def make_heal(*, fetch: FetchFn, load_state: LoadFn, rank: int, endpoint: str = ENDPOINT) -> HealFn:
    """A Manager heal hook: fetch step q.step from the healthy replicas' same-rank sources, then load it.

    Raises CatchupError when no healthy participant offers a source, or whatever `fetch` raises.
    """

    def heal(q: StepQuorum) -> None:
        sources = catchup_sources(q, endpoint)
        if not sources:
            raise CatchupError(f"step {q.step}: no healthy participant of quorum {q.quorum_id} has a "
                               f"{endpoint!r} endpoint for rank {rank}")
        load_state(fetch(q.step, sources))

    return heal
