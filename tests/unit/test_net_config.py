"""NetConfig (bind vs advertised address) and the job token's sources: env, 0600 file, never argv/URL."""

from __future__ import annotations

import argparse
import os

import pytest

from ftrun.net import NetConfig, TokenError, load_token, read_token_file, token_matches, write_token_file
from ftrun.quorum import cli as lighthouse_cli


@pytest.mark.parametrize("net, listen, advertised", [
    (NetConfig(), "127.0.0.1:4242", "127.0.0.1:4242"),
    (NetConfig(bind_host="10.7.0.2"), "10.7.0.2:80", "10.7.0.2:80"),
    (NetConfig(bind_host="0.0.0.0", advertise_host="10.7.0.2"), "0.0.0.0:5000", "10.7.0.2:5000"),
    (NetConfig(bind_host="0.0.0.0", advertise_host="node-3.rack1"), "http://0.0.0.0:81", "http://node-3.rack1:81"),
    (NetConfig(advertise_host="10.0.0.9"), "unix:/tmp/x.sock", "unix:/tmp/x.sock"),
])
def test_advertise_keeps_the_port_and_swaps_the_host(net, listen, advertised):
    assert net.advertise(listen) == advertised


@pytest.mark.parametrize("kwargs, message", [
    ({"bind_host": "0.0.0.0"}, "needs an advertise_host"),
    ({"bind_host": "::"}, "bind_host must be a host name or IPv4 address"),
    ({"bind_host": "10.0.0.1", "advertise_host": "0.0.0.0"}, "must be routable"),
    ({"bind_host": ""}, "bind_host must be a host name"),
    ({"bind_host": "a b"}, "bind_host must be a host name"),
    ({"advertise_host": "x;y=z"}, "advertise_host must be a host name"),
])
def test_bad_net_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NetConfig(**kwargs)


def test_net_config_round_trips_through_the_environment():
    assert NetConfig.from_environ({}) == NetConfig()
    net = NetConfig(bind_host="0.0.0.0", advertise_host="10.1.2.3")
    assert NetConfig.from_environ(net.to_environ()) == net
    assert net.bind() == "0.0.0.0:0" and net.bind(29510) == "0.0.0.0:29510" and net.advertised == "10.1.2.3"


def _token_file(tmp_path, mode, text="s3cret\n"):
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_token_file_must_be_private(tmp_path):
    assert read_token_file(_token_file(tmp_path, 0o600)) == "s3cret"
    assert read_token_file(_token_file(tmp_path, 0o400)) == "s3cret"
    for mode in (0o640, 0o604, 0o644, 0o660):
        with pytest.raises(TokenError, match=r"group or others can read it; run `chmod 600"):
            read_token_file(_token_file(tmp_path, mode))


@pytest.mark.parametrize("text, message", [("", "one non-empty word"), ("a b", "one non-empty word"),
                                           ("\xe9t\xe9", "not ASCII")])
def test_bad_token_file_content(tmp_path, text, message):
    path = tmp_path / "token"
    path.write_bytes(text.encode("latin-1"))
    os.chmod(path, 0o600)
    with pytest.raises(TokenError, match=message):
        read_token_file(str(path))


def test_token_sources_in_order(tmp_path):
    path = _token_file(tmp_path, 0o600, "from-file")
    assert load_token({}) is None
    assert load_token({"FTRUN_TOKEN": "from-env"}) == "from-env"
    assert load_token({"FTRUN_TOKEN": "from-env", "FTRUN_TOKEN_FILE": path}) == "from-file"
    assert load_token({"FTRUN_TOKEN_FILE": "/nonexistent/x"}, file=path) == "from-file"
    with pytest.raises(TokenError, match="cannot open the token file"):
        load_token({"FTRUN_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(TokenError, match="FTRUN_TOKEN is set but empty"):
        load_token({"FTRUN_TOKEN": ""})
    with pytest.raises(TokenError, match="not a regular file"):
        os.chmod(tmp_path, 0o700)
        load_token({"FTRUN_TOKEN_FILE": str(tmp_path)})


def test_written_token_file_is_0600_and_never_replaced(tmp_path):
    path = str(tmp_path / "t")
    write_token_file(path, "abc")
    assert os.stat(path).st_mode & 0o777 == 0o600 and read_token_file(path) == "abc"
    with pytest.raises(FileExistsError):
        write_token_file(path, "other")


def _lighthouse_args(argv):
    p = argparse.ArgumentParser()
    lighthouse_cli.add_arguments(p)
    return p.parse_args(argv)


def test_lighthouse_refuses_a_token_on_argv():
    with pytest.raises(TokenError, match="--token is refused.*FTRUN_TOKEN_FILE"):
        lighthouse_cli.resolve_token(_lighthouse_args(["--token", "T"]), {})


def test_lighthouse_token_from_env_file_or_a_new_private_file(tmp_path):
    path = _token_file(tmp_path, 0o600, "ok")
    assert lighthouse_cli.resolve_token(_lighthouse_args([]), {"FTRUN_TOKEN_FILE": path})[0] == "ok"
    assert lighthouse_cli.resolve_token(_lighthouse_args([]), {"FTRUN_TOKEN": "e"})[0] == "e"
    fresh = str(tmp_path / "new.token")
    token, note = lighthouse_cli.resolve_token(_lighthouse_args(["--token-file", fresh]), {})
    assert read_token_file(fresh) == token and fresh in note and token not in note
    given = str(tmp_path / "given.token")  # a missing file is created with $FTRUN_TOKEN when set
    assert lighthouse_cli.resolve_token(_lighthouse_args(["--token-file", given]), {"FTRUN_TOKEN": "e"})[0] == "e"
    assert read_token_file(given) == "e"
    state = tmp_path / "state"
    token, note = lighthouse_cli.resolve_token(_lighthouse_args(["--state-dir", str(state)]), {})
    [made] = list(state.iterdir())
    assert read_token_file(str(made)) == token and str(made) in note and token not in note


@pytest.mark.parametrize("argv, environ, bind, http, advertised", [
    ([], {}, "127.0.0.1:29510", "127.0.0.1:0", "127.0.0.1"),
    ([], {"FTRUN_BIND_HOST": "10.9.0.1"}, "10.9.0.1:29510", "10.9.0.1:0", "10.9.0.1"),
    (["--bind", "0.0.0.0:7000", "--advertise-host", "lh.example"], {}, "0.0.0.0:7000", "0.0.0.0:0", "lh.example"),
    (["--bind", "0.0.0.0:7000"], {"FTRUN_ADVERTISE_HOST": "10.0.0.5"}, "0.0.0.0:7000", "0.0.0.0:0", "10.0.0.5"),
    (["--http-bind", "127.0.0.1:8080"], {}, "127.0.0.1:29510", "127.0.0.1:8080", "127.0.0.1"),
])
def test_lighthouse_addresses_from_flags_or_environment(argv, environ, bind, http, advertised):
    net, got_bind, got_http = lighthouse_cli.resolve_net(_lighthouse_args(argv), environ)
    assert (got_bind, got_http, net.advertised) == (bind, http, advertised)


def test_lighthouse_wildcard_bind_without_advertise_is_an_error():
    with pytest.raises(ValueError, match="needs an advertise_host"):
        lighthouse_cli.resolve_net(_lighthouse_args(["--bind", "0.0.0.0:1"]), {})


@pytest.mark.parametrize("given, matches", [
    ("s3cret", True), ("s3cre", False), ("s3cret ", False), ("", False), (None, False), (7, False),
    (b"s3cret", False), (["s3cret"], False), ("s3cr\ud800", False),
])
def test_token_matches_only_the_token_itself(given, matches):
    assert token_matches(given, "s3cret") is matches


def _services():
    from ftrun.catchup.net_transport import NetCatchupServer
    from ftrun.catchup.server import CatchupServer
    from ftrun.config import LighthouseConfig
    from ftrun.diagnose.collect import Collector, TelemetryServer
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarEngine
    from ftrun.launch.agent import Agent
    from ftrun.quorum.http import StatusServer
    from ftrun.quorum.service import Lighthouse
    from ftrun.replica.tree_comm import TreeComm

    return {
        "Lighthouse": lambda env, t: Lighthouse(env=env, config=LighthouseConfig(), token=t),
        "StatusServer": lambda env, t: StatusServer(env=env, lighthouse=None, token=t),
        "FtarEngine": lambda env, t: FtarEngine(env=env, kernels=CpuKernels(), token=t),
        "the diagnose collector service": lambda env, t: Collector(env=env, token=t),
        "the diagnose telemetry service": lambda env, t: TelemetryServer(env=env, token=t, ranks={}),
        "the launch agent": lambda env, t: Agent(env=env, token=t, bind="127.0.0.1:0", out="/nonexistent"),
        "CatchupServer": lambda env, t: CatchupServer(env=env, token=t),
        "NetCatchupServer": lambda env, t: NetCatchupServer(env=env, token=t),
        "TreeComm": lambda env, t: TreeComm.build(env=env, rank=0, world_size=1, listener=None, addrs=["-"], token=t),
    }


@pytest.mark.parametrize("service", list(_services()))
@pytest.mark.parametrize("token, got", [("", "an empty string"), (None, "NoneType"), (b"s3cret", "bytes")])
def test_every_service_refuses_an_empty_job_token_before_it_listens(service, token, got):
    """With an empty token, hmac.compare_digest(b"", b"") would let in every peer that sends an empty one (and
    an HTTP request with no Authorization header at all). The error names the type, never the value."""
    from ftrun.env.real import RealEnv

    with pytest.raises(TokenError, match=f"{service} needs a non-empty job token \\(a str\\), got {got}$"):
        _services()[service](RealEnv(), token)
