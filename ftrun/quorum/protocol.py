"""Messages between a replica leader and the lighthouse, and their validation. Pure.

Leader -> lighthouse: hello {token, replica_id}, heartbeat {}, quorum {step, commit_failed,
last_quorum_id, data_addrs, own_failures?, fresh?}, finished {step} (the replica committed the job's
final step; answered by finished_ack). Lighthouse -> leader: welcome {quorum_id}, quorum {decision},
error {error}, job_finished {step, error} (a stale request: ftrun.quorum.decide rule 0), and unasked: hung {replica_id, quorum_id} (a participant of that quorum
stopped heartbeating or its connection dropped). A malformed message gets an error reply naming what
was wrong; the connection stays open.

Every number and size is range-checked here, at decode time, so nothing a peer sends can make the
lighthouse's state unencodable: steps and ids a replica sends are at most MAX_REQUEST_COUNTER (2^52),
which leaves 2^52 quorum-id bumps (centuries at one per millisecond) before MAX_COUNTER (2^53 - 1,
the largest integer a JSON reader or a Prometheus gauge holds exactly), and far below msgpack's 2^64.
"""

from __future__ import annotations

from typing import Any

from ftrun.env.base import Message
from ftrun.quorum.decide import Decision, Participant

MAX_COUNTER = 2**53 - 1  # any quorum id or step the lighthouse hands out or persists
MAX_REQUEST_COUNTER = 2**52  # any step or quorum id a replica may send
MAX_REPLICA_ID_CHARS = 256
MAX_ADDRS = 65_536  # ranks per replica
MAX_ADDR_CHARS = 1_024  # one rank's encoded endpoints


class BadRequest(ValueError):
    """A message from a replica that breaks the protocol; the text names the problem."""


def _field(msg: Message, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise BadRequest(f"{msg.get('type', '?')} message needs {what} in {name!r}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _counter(msg: Message, name: str, limit: int) -> int:
    value = _field(msg, name, int, f"a non-negative integer at most {limit}")
    if not 0 <= value <= limit:
        raise BadRequest(f"{msg.get('type', '?')} message needs a non-negative integer at most {limit} in "
                         f"{name!r}, got {_short(value)}")
    return value


def check_replica_id(replica_id: Any) -> str:
    """A replica id as the lighthouse accepts it: a non-empty printable string of bounded length."""
    if not isinstance(replica_id, str) or not replica_id:
        raise BadRequest(f"a replica id must be a non-empty string, got {_short(replica_id)}")
    if len(replica_id) > MAX_REPLICA_ID_CHARS or not replica_id.isprintable():
        raise BadRequest(f"a replica id must be printable and at most {MAX_REPLICA_ID_CHARS} characters, "
                         f"got {_short(replica_id)}")
    return replica_id


def parse_hello(msg: Message) -> tuple[str, str]:
    """(token, replica_id) of a hello."""
    if msg.get("type") != "hello":
        raise BadRequest(f"first message must be 'hello', got {_short(msg.get('type'))}")
    token = _field(msg, "token", str, "the job token")
    return token, check_replica_id(msg.get("replica_id"))


def parse_quorum_request(msg: Message) -> tuple[int, bool, int, tuple[str, ...], int, bool]:
    """(step, commit_failed, last_quorum_id, data_addrs, own_failures, fresh) of a quorum request.
    own_failures (optional, default 0): failed commits by the replica's own fault since its last commit.
    fresh (optional, default false): a new incarnation's first request (ftrun.quorum.decide rule 8)."""
    step = _counter(msg, "step", MAX_REQUEST_COUNTER)
    last_quorum_id = _counter(msg, "last_quorum_id", MAX_REQUEST_COUNTER)
    commit_failed = _field(msg, "commit_failed", bool, "a boolean")
    own_failures = _counter(msg, "own_failures", MAX_REQUEST_COUNTER) if "own_failures" in msg else 0
    fresh = msg.get("fresh", False)
    if not isinstance(fresh, bool):
        raise BadRequest(f"quorum message needs a boolean in 'fresh', got {_short(fresh)}")
    addrs = msg.get("data_addrs", [])
    if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS:
        raise BadRequest(f"quorum message needs a list of at most {MAX_ADDRS} addresses in 'data_addrs'")
    if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs):
        raise BadRequest(f"quorum message needs address strings of at most {MAX_ADDR_CHARS} characters "
                         "in 'data_addrs'")
    return step, commit_failed, last_quorum_id, tuple(addrs), own_failures, fresh


def parse_finished(msg: Message) -> int:
    """The step of a `finished` report: the replica committed the job's final step and exits."""
    return _counter(msg, "step", MAX_REQUEST_COUNTER)


def encode_decision(d: Decision) -> Message:
    return {
        "type": "quorum",
        "quorum_id": d.quorum_id,
        "max_step": d.max_step,
        "min_replicas": d.min_replicas,
        "reason": d.reason,
        "behind": list(d.behind),
        "participants": [[p.replica_id, p.step, list(p.data_addrs)] for p in d.participants],
    }


def decode_decision(msg: Message) -> Decision:
    """A decision from the lighthouse, checked as strictly as the lighthouse checks its requests."""
    if msg.get("type") != "quorum":
        raise BadRequest(f"a quorum decision needs type 'quorum', got {_short(msg.get('type'))}")
    reason = _field(msg, "reason", str, "a string")
    quorum_id, max_step = _counter(msg, "quorum_id", MAX_COUNTER), _counter(msg, "max_step", MAX_COUNTER)
    min_replicas = _counter(msg, "min_replicas", MAX_COUNTER) if "min_replicas" in msg else 1
    behind = _field(msg, "behind", list, "a list of replica ids")
    rows = _field(msg, "participants", list, "a list of [replica_id, step, addresses]")
    participants = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[2], list)):
            raise BadRequest(f"a decision's participant must be [replica_id, step, addresses], got {_short(row)}")
        rid, step, addrs = check_replica_id(row[0]), row[1], row[2]
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_COUNTER:
            raise BadRequest(f"participant {rid!r} has step {_short(step)}, not an integer in [0, {MAX_COUNTER}]")
        if not all(isinstance(a, str) for a in addrs):
            raise BadRequest(f"participant {rid!r} has a non-string address")
        participants.append(Participant(rid, step, tuple(addrs)))
    ids = {p.replica_id for p in participants}
    if len(ids) != len(participants) or not all(isinstance(r, str) and r in ids for r in behind):
        raise BadRequest("a decision's participants must be distinct and include every replica behind")
    return Decision(ready=True, reason=reason, quorum_id=quorum_id, participants=tuple(participants),
                    max_step=max_step, behind=tuple(behind), min_replicas=max(min_replicas, 1))
