"""Errors of the catch-up package, split by who is at fault.

    CatchupError                 base: the state could not be fetched (or served)
      CatchupUsageError          local misuse: bad arguments, a state that cannot be published
      CatchupAuthError           a source refused the job token (401): the caller's token is wrong
      CatchupStepError           a source does not have the step asked for (404/409/410)
      CatchupPeerError           a source broke the protocol: malformed HTTP or manifest, bad bytes
      CatchupTimeout             the whole fetch passed Timeouts.catchup_timeout_s

Bad config values raise ValueError, as everywhere in ftrun.
"""

from __future__ import annotations


class CatchupError(Exception):
    """Base of every catch-up error."""


class CatchupUsageError(CatchupError):
    """The caller misused the API (a state that cannot be published, a buffer too small, ...)."""


class CatchupAuthError(CatchupError):
    """A source answered 401: the job token is missing or wrong."""


class CatchupStepError(CatchupError):
    """A source does not have the step asked for: already retired (410) or not published in time (404)."""

    def __init__(self, message: str, *, status: int = 0, have: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.have = have


class CatchupPeerError(CatchupError):
    """A source broke the protocol: malformed response or manifest, wrong length, checksum mismatch."""


class CatchupTimeout(CatchupError, TimeoutError):
    """The fetch as a whole did not finish within its deadline."""
