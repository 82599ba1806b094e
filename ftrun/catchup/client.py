"""Fetch a published step's state from healthy HTTP sources (the shared fetch protocol over HTTP links).

    state = fetch_state(step, sources, token, timeouts)           # dict name -> tensor
    result = fetch(step, sources, token, timeouts, config=...)    # + metadata, bytes per source, failures

The protocol (manifest, long-poll, plan, CRC, re-plan, deadline) is ftrun.catchup.fetcher; the links
are ftrun.catchup.http_transport. The returned tensors are views into one flat uint8 buffer (`buffer`
if given and large enough — reuse it across fetches so a steady-state fetch allocates nothing).
Blocks the calling task; `env` (default: a RealEnv) runs the per-source tasks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupUsageError
from ftrun.catchup.fetcher import FetchResult, fetch_with
from ftrun.catchup.http_transport import HttpTransport
from ftrun.catchup.net_transport import BytePayloads
from ftrun.catchup.wire import split_url
from ftrun.config import Timeouts
from ftrun.env.base import Env

__all__ = ["FetchResult", "fetch", "fetch_state"]


def fetch_state(step: int, sources: Sequence[str], token: str, timeouts: Timeouts, *,
                config: CatchupConfig | None = None, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The state of `step` as name -> tensor. See `fetch`."""
    return fetch(step, sources, token, timeouts, config=config, buffer=buffer).tensors


def fetch(step: int, sources: Sequence[str], token: str, timeouts: Timeouts, *,
          config: CatchupConfig | None = None, buffer: torch.Tensor | None = None,
          env: Env | None = None) -> FetchResult:
    """Fetch the state of `step` from `sources` ("http://host:port" catch-up endpoints).

    Args:
        timeouts: bounds the whole fetch (catchup_timeout_s) and each connect (connect_timeout_s).
        config: stall_s, long_poll_s and max_source_failures (its own timeouts are not used).
        buffer: a CPU uint8 tensor to receive into (used when large enough). The next fetch into it
            overwrites these tensors: hand them to a TrainState.load (which may keep them as its
            optimizer state, ftrun.train.state) only from a fetch without `buffer`.
    Raises:
        CatchupUsageError: bad arguments. CatchupAuthError: token refused. CatchupStepError: no source
        has the step. CatchupTimeout: past catchup_timeout_s. CatchupError: every source failed.
    """
    if step < 0 or not sources or len(set(sources)) != len(sources):
        raise CatchupUsageError(f"need a step >= 0 and distinct sources, got step {step}, {list(sources)}")
    try:
        for s in sources:
            split_url(s)
    except ValueError as e:
        raise CatchupUsageError(str(e)) from None
    config = replace(config or CatchupConfig(), timeouts=timeouts)
    if env is None:
        from ftrun.env.real import RealEnv

        env = RealEnv()
    transport = HttpTransport(env=env, token=token, config=config, payloads=BytePayloads(buffer))
    try:
        return fetch_with(env, transport, step, sources, config)
    finally:
        transport.close()  # a one-off client: nothing to keep its connections for
