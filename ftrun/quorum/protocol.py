"""Messages between a replica leader and the lighthouse, and their validation. Pure.

Leader -> lighthouse: hello {token, replica_id}, heartbeat {}, quorum {step, commit_failed,
last_quorum_id, data_addrs}. Lighthouse -> leader: welcome {quorum_id}, quorum {decision}, error {error}.
A malformed message gets an error reply naming what was wrong; the connection stays open.
"""

from __future__ import annotations

from typing import Any

from ftrun.env.base import Message
from ftrun.quorum.decide import Decision, Participant


class BadRequest(ValueError):
    """A message from a replica that breaks the protocol; the text names the problem."""


def _field(msg: Message, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise BadRequest(f"{msg.get('type', '?')} message needs {what} in {name!r}, got {value!r}")
    return value


def parse_hello(msg: Message) -> tuple[str, str]:
    """(token, replica_id) of a hello."""
    if msg.get("type") != "hello":
        raise BadRequest(f"first message must be 'hello', got {msg.get('type')!r}")
    token = _field(msg, "token", str, "the job token")
    replica_id = _field(msg, "replica_id", str, "a non-empty replica id")
    if not replica_id:
        raise BadRequest("hello message needs a non-empty replica id in 'replica_id'")
    return token, replica_id


def parse_quorum_request(msg: Message) -> tuple[int, bool, int, tuple[str, ...]]:
    """(step, commit_failed, last_quorum_id, data_addrs) of a quorum request."""
    step = _field(msg, "step", int, "a non-negative integer")
    last_quorum_id = _field(msg, "last_quorum_id", int, "a non-negative integer")
    if step < 0 or last_quorum_id < 0:
        raise BadRequest(f"quorum message needs non-negative 'step' and 'last_quorum_id', got {step}, {last_quorum_id}")
    commit_failed = _field(msg, "commit_failed", bool, "a boolean")
    addrs = msg.get("data_addrs", [])
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        raise BadRequest(f"quorum message needs a list of address strings in 'data_addrs', got {addrs!r}")
    return step, commit_failed, last_quorum_id, tuple(addrs)


def encode_decision(d: Decision) -> Message:
    return {
        "type": "quorum",
        "quorum_id": d.quorum_id,
        "max_step": d.max_step,
        "reason": d.reason,
        "behind": list(d.behind),
        "participants": [[p.replica_id, p.step, list(p.data_addrs)] for p in d.participants],
    }


def decode_decision(msg: Message) -> Decision:
    try:
        return Decision(
            ready=True,
            reason=str(msg["reason"]),
            quorum_id=int(msg["quorum_id"]),
            max_step=int(msg["max_step"]),
            behind=tuple(str(r) for r in msg["behind"]),
            participants=tuple(Participant(str(r), int(s), tuple(a)) for r, s, a in msg["participants"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"malformed quorum decision: {e!r}") from e
