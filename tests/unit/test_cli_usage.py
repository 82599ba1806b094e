"""Bad command-line input ends a command with exit 2 and a message naming what was wrong, no traceback."""

from __future__ import annotations

from ftrun.cli import main


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
