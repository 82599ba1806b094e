"""Per-rank data-plane endpoints, carried through the quorum as one string per rank.

A rank serves several things to its peers in other replicas (FTAR ring connections, catch-up state over
HTTP). The manager gathers each rank's endpoints once and the lighthouse hands them to every participant,
so rank r of replica A finds rank r of replica B. Encoded as "name=addr;name=addr" (names are
[a-z_]+, addresses have no ';' or '='). An address is what peers on other hosts connect to (the
listener's advertised host, ftrun.net.NetConfig): a wildcard or empty host is refused.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[a-z_]+$")
_UNROUTABLE = ("", "0.0.0.0", "::", "[::]")


def _host(addr: str) -> str | None:
    """The host of "host:port" or "scheme://host:port"; None for unix: addresses (this host only)."""
    if addr.startswith("unix:"):
        return None
    return addr.rpartition("://")[2].rpartition(":")[0]


def encode_endpoints(endpoints: dict[str, str]) -> str:
    for name, addr in endpoints.items():
        if not _NAME.match(name) or ";" in addr or "=" in addr:
            raise ValueError(f"bad endpoint {name!r}={addr!r}")
        if _host(addr) in _UNROUTABLE:
            raise ValueError(f"endpoint {name}={addr} is not routable from another host: advertise the host's "
                             "address (FTRUN_ADVERTISE_HOST)")
    return ";".join(f"{k}={v}" for k, v in sorted(endpoints.items()))


def decode_endpoints(encoded: str) -> dict[str, str]:
    if not encoded:
        return {}
    out = {}
    for part in encoded.split(";"):
        name, sep, addr = part.partition("=")
        if not sep or not _NAME.match(name):
            raise ValueError(f"malformed endpoint {part!r} in {encoded!r}")
        out[name] = addr
    return out
