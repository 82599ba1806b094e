"""`ftrun launch` refuses bad flags with a message naming the flag (exit 2, no traceback), shows its
defaults in --help, and `ftrun --version` answers. Fast: nothing is started."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

import ftrun
from ftrun.cli import main
from ftrun.launch import cli as launch_cli
from ftrun.launch.interrupts import Interrupts

SCRIPT = ["-m", "ftrun.train.ft_worker"]


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "0", "--steps", "5"], "argument --replicas: must be >= 1, got 0"),
    (["--ranks-per-replica", "0", "--steps", "5"], "argument --ranks-per-replica: must be >= 1, got 0"),
    (["--steps", "-1"], "argument --steps: must be >= 1, got -1"),
    (["--steps", "many"], "argument --steps: expected an integer, got 'many'"),
    (["--steps", "5", "--min-replicas", "4"], "--min-replicas 4: must be between 1 and --replicas (3)"),
    (["--steps", "5", "--min-replicas", "0"], "argument --min-replicas: must be >= 1, got 0"),
    (["--steps", "5", "--kill-at", "replica=r9"], "argument --kill-at: 'replica=r9': expected step=N[,replica=ID]"),
    (["--steps", "5", "--kill-at", "step=1,replica=r9"], "--kill-at step=1,replica=r9: no replica 'r9' (this job has r0..r2)"),
    (["--steps", "5", "--kill-at", "step=x"], "argument --kill-at: 'step=x': step must be an integer"),
    (["--steps", "5", "--kill-at", "step=-2"], "argument --kill-at: step must be >= 0, got -2"),
    (["--steps", "5", "--kill-at", "step=5"], "--kill-at step=5: the job ends at step 5 (--steps), so it would never fire"),
    (["--steps", "5", "--kill-every", "0s"], "argument --kill-every: must be > 0, got '0s'"),
    (["--steps", "5", "--kill-random-mean", "soon"], "argument --kill-random-mean: bad duration 'soon'"),
    (["--steps", "5", "--kill-every", "1s", "--kill-random-mean", "1s"], "--kill-every and --kill-random-mean: choose one"),
    (["--steps", "5", "--max-kills", "2"], "--max-kills: needs a kill option"),
    (["--steps", "5", "--max-kills", "-1", "--kill-every", "1s"], "argument --max-kills: must be >= 0, got -1"),
    (["--steps", "5", "--timeout", "0"], "argument --timeout: must be > 0, got '0'"),
    (["--steps", "5", "--restart-delay", "x"], "argument --restart-delay: bad duration 'x'"),
    (["--steps", "5", "--max-startup-failures", "0"], "argument --max-startup-failures: must be >= 1, got 0"),
    (["--steps", "5", "--start-method", "fork"], "argument --start-method: invalid choice: 'fork'"),
    (["--steps", "5", "--stop-file", "/no/such/folder/stop"], "--stop-file /no/such/folder/stop: its folder does not exist"),
])
def test_bad_flags_exit_2_with_a_message_naming_the_flag(argv, message, capsys):
    assert exit_status(["launch", *argv, *SCRIPT]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_script_is_refused_before_anything_starts(tmp_path, capsys):
    assert exit_status(["launch", "--steps", "5", str(tmp_path / "nosuch.py")]) == 2
    assert f"SCRIPT '{tmp_path / 'nosuch.py'}': no such file (use -m to run a module)" in capsys.readouterr().err


@pytest.mark.parametrize("make", ["below a file", "a file"])
def test_an_unwritable_out_is_refused_naming_the_flag(tmp_path, capsys, make):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out" if make == "below a file" else tmp_path / "file"
    assert exit_status(["launch", "--steps", "5", "--out", str(out), *SCRIPT]) == 2
    err = capsys.readouterr().err
    assert f"ftrun launch: error: --out {out}: cannot write there" in err and "Traceback" not in err


def test_every_option_shows_its_default_in_help():
    parser = argparse.ArgumentParser(prog="ftrun launch")
    launch_cli.add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.nargs != 0 and action.dest != "help":
            assert "default" in action.help or "required" in action.help, action.option_strings
    text = parser.format_help()
    assert "(default: 3)" in text and "(default: 0.5s)" in text
    assert "--timeout DURATION" in text and "no limit" in text  # no hidden limit that ends real jobs
    assert parser.parse_args(["--steps", "5", "x.py"]).timeout is None


def test_version(capsys):
    assert exit_status(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ftrun {ftrun.__version__}"


def test_the_first_signal_asks_to_stop_and_a_second_quits_at_once(capsys):
    before = signal.getsignal(signal.SIGTERM)
    stop = Interrupts()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGTERM" and stop.exit_code == 128 + signal.SIGTERM
        assert "SIGTERM: stopping the job and writing the partial report" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_sigint_the_process_was_started_ignoring_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = Interrupts()
        stop.install()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
    finally:
        signal.signal(signal.SIGINT, before)


def test_netns_hosts_refuses_kill_at_and_bad_buildings():
    from ftrun.launch.netns_job import netns_problems

    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    args = parser.parse_args(["--netns-hosts", "3", "--steps", "5", "--kill-at", "step=2", "x.py"])
    assert any("--kill-at with --netns-hosts" in p for p in netns_problems(args))
    args = parser.parse_args(["--steps", "5", "x.py"])
    assert netns_problems(args) == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--netns-hosts", "3", "--steps", "5", "--host-faults", "host_nap", "x.py"])


def test_the_listener_caps_reach_the_launchers_services_and_a_host_agent(tmp_path, monkeypatch):
    """--max-connections / --max-pending cap the env the lighthouse, the diagnosis monitor and the status page run
    on (one env for the job), and a host agent's (--host-index > 0). Nothing is started: both are intercepted."""
    from ftrun.env.admission import ListenLimits
    from ftrun.launch import multihost

    seen = {}

    def launch(env, *rest):
        seen["job"] = env.net.limits
        return 0

    monkeypatch.setattr(launch_cli, "_launch", launch)

    class Agent:
        def __init__(self, *, env, **kw):
            seen["agent"], self.addr = env.net.limits, "127.0.0.1:1"

        def serve(self):
            pass

    monkeypatch.setattr(multihost, "Agent", Agent)
    monkeypatch.setenv("FTRUN_TOKEN", "job-token")
    caps = ["--max-connections", "40", "--max-pending", "5"]
    assert exit_status(["launch", "--steps", "5", "--out", str(tmp_path / "job"), *caps, *SCRIPT]) == 0
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.2\n")
    assert exit_status(["launch", "--steps", "5", "--out", str(tmp_path / "agent"), "--hosts", str(hosts),
                        "--host-index", "1", *caps, *SCRIPT]) == 0
    assert seen == {"job": ListenLimits(max_connections=40, max_pending=5),
                    "agent": ListenLimits(max_connections=40, max_pending=5)}
