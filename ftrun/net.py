"""Where a process listens, what address it hands its peers, and where its job token comes from.

`NetConfig(bind_host, advertise_host)` is one process's network identity: every listener it opens (FTAR
ring, catch-up server, status page) binds `bind_host` and publishes `advertise_host` in its endpoints.
Loopback is the single-host default; on a real cluster bind the host's interface (or 0.0.0.0) and
advertise the address other hosts route to. Only entry points call `NetConfig.from_environ` or
`load_token`; everything else receives the objects.

The job token comes from FTRUN_TOKEN or a file named by FTRUN_TOKEN_FILE that only its owner can read
(mode 0600 or stricter); never from argv (visible to every local user through ps) nor a URL.

`WarnLimiter` rate-limits a service's warnings about peers it refuses (the HTTP servers, the lighthouse).
"""

from __future__ import annotations

import hmac
import os
import re
import stat
from dataclasses import dataclass
from typing import Mapping

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0",)
_HOST = re.compile(r"^[A-Za-z0-9.\-_]+$")  # a host name or an IPv4 address (the real Env's sockets are IPv4)


def _check_host(field: str, host: str) -> None:
    if not isinstance(host, str) or not _HOST.match(host):
        raise ValueError(f"NetConfig.{field} must be a host name or IPv4 address, got {host!r}")


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """bind_host: the interface listeners bind (a wildcard binds all of them).
    advertise_host: the address peers are given (default: bind_host; required with a wildcard bind)."""

    bind_host: str = LOOPBACK
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        _check_host("bind_host", self.bind_host)
        if self.advertise_host is not None:
            _check_host("advertise_host", self.advertise_host)
            if self.advertise_host in WILDCARDS:
                raise ValueError(f"NetConfig.advertise_host must be routable, got the wildcard {self.advertise_host!r}")
        elif self.bind_host in WILDCARDS:
            raise ValueError(f"NetConfig: binding the wildcard {self.bind_host!r} needs an advertise_host "
                             "(FTRUN_ADVERTISE_HOST): the address peers should connect to")

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.bind_host

    def bind(self, port: int = 0) -> str:
        """The "host:port" a listener binds (port 0: any free port)."""
        return f"{self.bind_host}:{port}"

    def advertise(self, listen_addr: str) -> str:
        """The address to publish for a listener bound at `listen_addr` ("host:port", or "http://host:port"):
        its port on the advertised host. Unix-socket addresses are returned unchanged."""
        if listen_addr.startswith("unix:"):
            return listen_addr
        scheme, sep, rest = listen_addr.rpartition("://")
        _, colon, port = rest.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"cannot advertise {listen_addr!r}: expected 'host:port'")
        return f"{scheme}{sep}{self.advertised}:{port}"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "NetConfig":
        """FTRUN_BIND_HOST (default loopback) and FTRUN_ADVERTISE_HOST (default: the bind host)."""
        return cls(bind_host=environ.get("FTRUN_BIND_HOST") or LOOPBACK,
                   advertise_host=environ.get("FTRUN_ADVERTISE_HOST") or None)

    def to_environ(self) -> dict[str, str]:
        out = {"FTRUN_BIND_HOST": self.bind_host}
        if self.advertise_host is not None:
            out["FTRUN_ADVERTISE_HOST"] = self.advertise_host
        return out


class TokenError(ValueError):
    """The job token is missing, empty, or in a file other users can read."""


def require_token(token: object, service: str) -> str:
    """`token` when it is a non-empty string, else TokenError naming `service`: a service given an empty token
    would take an empty one (or, over HTTP, no Authorization header at all) as the right one."""
    if not isinstance(token, str) or not token:
        got = "an empty string" if token == "" else type(token).__name__  # never any of a token's characters
        raise TokenError(f"{service} needs a non-empty job token (a str), got {got}")
    return token


def token_matches(given: object, token: str) -> bool:
    """Whether `given`, what a peer sent as its token (of any type), is the job token `token`; compared in
    constant time, so the time a refusal takes says nothing about how much of a guess was right (a lone surrogate
    in `given` is compared, never raised on)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode())


def read_token_file(path: str) -> str:
    """The token in `path` (surrounding whitespace stripped). Raises TokenError when the file is missing,
    empty, not a regular file, or readable or writable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise TokenError(f"cannot open the token file {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"the token file {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise TokenError(f"the token file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others "
                             f"can read it; run `chmod 600 {path}`")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenError(f"the token file {path!r} is not ASCII text") from None
    if not token or len(data) > 4096 or any(c.isspace() for c in token):
        raise TokenError(f"the token file {path!r} must hold one non-empty word of at most 4096 bytes")
    return token


def load_token(environ: Mapping[str, str], *, file: str | None = None) -> str | None:
    """The job token: `file` (a flag), else FTRUN_TOKEN_FILE, else FTRUN_TOKEN; None when none is set.
    Raises TokenError for a bad file or an empty FTRUN_TOKEN."""
    path = file or environ.get("FTRUN_TOKEN_FILE")
    if path:
        return read_token_file(path)
    token = environ.get("FTRUN_TOKEN")
    if token is None:
        return None
    if not token.strip() or any(c.isspace() for c in token):
        raise TokenError("FTRUN_TOKEN is set but empty or contains whitespace")
    return token


def write_token_file(path: str, token: str) -> None:
    """Create `path` with mode 0600 holding `token`; refuses to replace an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


class WarnLimiter:
    """At most one log line per `every_s`. Pure: the caller passes `now`."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: float | None = None
        self.suppressed = 0

    def allow(self, now: float) -> int | None:
        """None if this event is suppressed; else how many were suppressed since the last allowed one."""
        if self._last is not None and now - self._last < self.every_s:
            self.suppressed += 1
            return None
        self._last, count, self.suppressed = now, self.suppressed, 0
        return count
