"""The pure parts of a multi-host launch: the hosts file and the agent's request checks."""

import pytest

from ftrun.launch.agent import BadRequest, check_hello, parse_request
from ftrun.launch.multihost import parse_hosts


def test_hosts_file_one_address_per_line_with_comments():
    assert parse_hosts("# rack 1\n10.0.0.1\n\nnode-2.cluster  # gpu box\n") == ["10.0.0.1", "node-2.cluster"]


@pytest.mark.parametrize("text, message", [
    ("", "lists no host"),
    ("10.0.0.1 10.0.0.2\n", "line 1: expected one address per line"),
    ("10.0.0.1\n0.0.0.0\n", "line 2: 0.0.0.0 is not an address"),
    ("10.0.0.1\nbad/host\n", "line 2: 'bad/host' is neither"),
    ("10.0.0.1\n10.0.0.1\n", "a host twice"),
])
def test_bad_hosts_file_names_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hosts(text)


def test_agent_requests_are_checked():
    ok = parse_request({"type": "start", "id": 1, "job": "run1", "argv": ["-m", "x"], "env": {"A": "1"},
                        "stdout": "r0.0.0.out", "stderr": "r0.0.0.log"})
    assert ok["argv"] == ["-m", "x"] and ok["job"] == "run1"
    read = parse_request({"type": "read", "job": "j", "where": "run", "name": "audit-r0.jsonl", "offset": 5})
    assert read["offset"] == 5
    assert parse_request({"type": "bye"}) == {"type": "bye"}
    assert parse_request({"type": "store", "replica": "r3"}) == {"type": "store", "replica": "r3"}


@pytest.mark.parametrize("msg, message", [
    ({"type": "exec"}, "unknown request type"),
    ({"type": "read", "job": "j", "where": "run", "name": "../etc/passwd", "offset": 0}, "name must be a plain file"),
    ({"type": "read", "job": "j", "where": "run", "name": "a/b", "offset": 0}, "name must be a plain file"),
    ({"type": "read", "job": "j", "where": "root", "name": "a", "offset": 0}, "where must be"),
    ({"type": "read", "job": "j", "where": "logs", "name": "a", "offset": -1}, r"offset must be an integer in \[0, "),
    ({"type": "read", "job": "j", "where": "logs", "name": "a", "offset": 2**63}, r"offset must be an integer in"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["x\0"], "env": {}, "stdout": "o", "stderr": "e"}, "without NUL"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["x"], "env": {"A=B": "1"}, "stdout": "o", "stderr": "e"}, "env must"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["x"], "env": {"": "1"}, "stdout": "o", "stderr": "e"}, "env must"),
    ({"type": "start", "id": 1, "job": "j", "argv": [], "env": {}, "stdout": "o", "stderr": "e"}, "argv must not"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["x"], "env": {"A": 1}, "stdout": "o", "stderr": "e"}, "env must"),
    ({"type": "poll", "ids": ["1"]}, "ids must be"),
    ({"type": "store"}, "replica must be"),
    ("start", "must be a map"),
])
def test_bad_agent_requests_say_what_is_wrong(msg, message):
    with pytest.raises(BadRequest, match=message):
        parse_request(msg)


def test_hello_needs_the_token():
    check_hello({"type": "hello", "token": "s3cret"}, "s3cret")
    with pytest.raises(BadRequest, match="wrong job token"):
        check_hello({"type": "hello", "token": "guess"}, "s3cret")
    with pytest.raises(BadRequest, match="first message"):
        check_hello({"type": "start"}, "s3cret")


def test_prepare_needs_an_argv():
    assert parse_request({"type": "prepare", "argv": ["-m", "x"]}) == {"type": "prepare", "argv": ["-m", "x"]}
    with pytest.raises(BadRequest, match="argv must not be empty"):
        parse_request({"type": "prepare", "argv": []})
