"""The client's side of HTTP/1.1, as pure functions: encode a GET, parse a response head.

The catch-up client speaks just enough HTTP/1.1 to talk to its own server (aiohttp): GET with keep-alive,
responses framed by Content-Length (no chunked encoding, no compression). Owning this lets the body go
straight from the socket into the destination tensor (see conn.py). A head that does not parse raises
CatchupPeerError.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ftrun.catchup.errors import CatchupPeerError

MAX_HEAD_BYTES = 64 * 1024
MAX_LENGTH_DIGITS = 18  # a Content-Length below 10**18 bytes
HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class ResponseHead:
    status: int
    reason: str
    headers: dict[str, str]  # names lower-cased
    content_length: int
    keep_alive: bool


def split_url(url: str) -> tuple[str, int]:
    """(host, port) of "http://host:port"; ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
        raise ValueError(f"a catch-up source must look like http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


def encode_get(host: str, port: int, path: str, token: str) -> bytes:
    if any(c in path + token for c in "\r\n "):
        raise ValueError("path and token must not contain spaces or line breaks")
    return (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Accept-Encoding: identity\r\n\r\n").encode("latin-1")


def parse_head(raw: bytes) -> ResponseHead:
    """Parse a response head (status line and headers, ending with a blank line)."""
    try:
        lines = raw.decode("latin-1").split("\r\n")
        version, status, *reason = lines[0].split(" ", 2)
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(status) != 3 or not _is_number(status, 3) \
                or status[0] == "0":
            raise ValueError(f"bad status line {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            if line:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ValueError(f"bad header line {line!r}")
                headers[name.strip().lower()] = value.strip()
    except (UnicodeDecodeError, ValueError) as e:
        raise CatchupPeerError(f"malformed HTTP response head: {e}") from None
    if headers.get("transfer-encoding", "identity").lower() != "identity":
        raise CatchupPeerError(f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}")
    length = headers.get("content-length", "")
    if not _is_number(length, MAX_LENGTH_DIGITS):
        raise CatchupPeerError(f"response without a valid Content-Length ({length[:32]!r})")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return ResponseHead(int(status), reason[0] if reason else "", headers, int(length), keep_alive)


def _is_number(text: str, max_digits: int) -> bool:
    """ASCII digits only (str.isdigit also accepts '²' and other digits int() refuses), not too many."""
    return 0 < len(text) <= max_digits and text.isascii() and text.isdigit()
