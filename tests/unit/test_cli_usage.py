"""Bad command-line input ends a command with exit 2 and a message naming what was wrong, no traceback."""

from __future__ import annotations

import pytest

from ftrun.cli import listen_limits, main


def test_a_mistyped_profile_names_the_known_ones(capsys):
    assert main(["emulate", "meta98k", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no scale profile 'meta98k'" in err and "meta-98k" in err and "Traceback" not in err


def test_emulate_profile_flag_without_a_script_is_the_profile(capsys):
    """`--profile P` (as in `ftrun diagnose bench`) names the profile when no SCRIPT.py is given: it was
    ignored, and ci-small ran in its place. Given beside a PROFILE argument, it is refused."""
    assert main(["emulate", "--profile", "meta98k", "--no-progress"]) == 2
    assert "no scale profile 'meta98k'" in capsys.readouterr().err
    assert main(["emulate", "ci-small", "--profile", "meta-98k", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "two profiles given: 'ci-small' and --profile 'meta-98k'" in err and "Traceback" not in err


def test_a_bad_profile_override_names_the_key(capsys):
    assert main(["emulate", "--set", "train.step_compute_s=-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step_compute_s" in err and "Traceback" not in err


def test_emulate_and_the_diagnose_bench_share_the_emulators_flags():
    """One definition (ftrun.cli.add_emulation_arguments): the same flags and help, the bench's prefixed
    "bench: ", its CPU charging off by default."""
    import argparse

    from ftrun.diagnose import cli as diagnose_cli
    from harness import cli as emulate_cli

    def actions(module):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        return {a.option_strings[0]: a for a in p._actions if a.option_strings}

    emulate, bench = actions(emulate_cli), actions(diagnose_cli)
    for flag in ("--set", "--ftar-detail", "--fold-ranks", "--ftar-model", "--cpu-charging"):
        assert (emulate[flag].dest, emulate[flag].choices) == (bench[flag].dest, bench[flag].choices)
        assert bench[flag].help.startswith("bench: ") and not emulate[flag].help.startswith("bench")
    assert emulate["--set"].help == bench["--set"].help.removeprefix("bench: ")
    assert (emulate["--cpu-charging"].default, bench["--cpu-charging"].default) == (None, "off")


SERVICES = {"lighthouse": ["lighthouse"], "launch": ["launch", "--steps", "5", "-m", "ftrun.train.ft_worker"],
            "diagnose": ["diagnose", "--serve"]}


@pytest.mark.parametrize("command", sorted(SERVICES))
@pytest.mark.parametrize("flags, message", [
    (["--max-pending", "0"], "--max-pending must be a positive int, got 0"),
    (["--max-connections", "-1"], "--max-connections must be a positive int, got -1"),
    (["--max-hello-bytes", "0"], "--max-hello-bytes must be a positive int, got 0"),
    (["--max-connections", "8", "--max-pending", "16"], "--max-pending (16) must not exceed --max-connections (8)"),
    (["--max-pending", "many"], "argument --max-pending: invalid int value: 'many'"),
])
def test_a_service_commands_bad_listener_cap_exits_2_naming_the_flag(command, flags, message, capsys, monkeypatch):
    """`ftrun lighthouse`, `launch` and `diagnose --serve` refuse a cap ListenLimits refuses, before starting
    anything (no token is read or written, no job runs)."""
    monkeypatch.setenv("FTRUN_TOKEN", "job-token")
    argv = SERVICES[command]
    try:
        code = main([argv[0], *flags, *argv[1:]])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_the_service_commands_share_the_listener_cap_flags():
    """One definition (ftrun.cli.add_listen_arguments) for every command that runs services, its defaults
    ListenLimits' (what FTConfig.net_limits gives a rank by default)."""
    import argparse

    from ftrun.diagnose import cli as diagnose_cli
    from ftrun.env.admission import ListenLimits
    from ftrun.launch import options as launch_options
    from ftrun.quorum import cli as lighthouse_cli

    for module in (diagnose_cli, launch_options, lighthouse_cli):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        args = p.parse_args(["--steps", "1", "x.py"] if module is launch_options else [])
        assert listen_limits(args) == ListenLimits(), module.__name__
        args = p.parse_args(["--max-pending", "3", *(["--steps", "1", "x.py"] if module is launch_options else [])])
        assert listen_limits(args) == ListenLimits(max_pending=3), module.__name__
