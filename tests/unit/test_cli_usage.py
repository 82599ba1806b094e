"""Bad command-line input ends a command with exit 2 and a message naming what was wrong, no traceback."""

from __future__ import annotations

from ftrun.cli import main


def test_a_mistyped_profile_names_the_known_ones(capsys):
    assert main(["emulate", "meta98k", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no scale profile 'meta98k'" in err and "meta-98k" in err and "Traceback" not in err


def test_a_bad_profile_override_names_the_key(capsys):
    assert main(["emulate", "--set", "train.step_compute_s=-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step_compute_s" in err and "Traceback" not in err
