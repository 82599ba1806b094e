"""`ftrun emulate` (the built-in default: ci-small with a replica kill and rejoin) end to end."""

from __future__ import annotations

import json

from ftrun.cli import main

KEYS = {"steps_committed", "get_quorum_p50_ms", "get_quorum_p99_ms", "stall_per_failure_s", "rejoin_stall_s",
        "effective_training_time", "wall_s", "peak_rss_mb", "ranks"}


def run_default(capsys, *extra):
    assert main(["emulate", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_default_dry_run_kills_and_rejoins(capsys):
    f = run_default(capsys)
    assert KEYS <= f.keys() and f["complete"] and f["ranks"] == 32 and f["kills"] == 1
    per_step = f["participants_per_step"]
    assert min(per_step[1:]) == 3 and per_step[-1] == 4, "one replica out, then back"
    assert f["rejoin_s"] is not None and f["rejoin_stall_s"] < f["step_time_s"]
    assert f["stall_per_failure_s"] < f["step_time_s"]


def test_inject_override_and_determinism(capsys):
    a = run_default(capsys, "--inject", "kill replica=2 step=4", "--steps", "8", "--seed", "3")
    b = run_default(capsys, "--inject", "kill replica=2 step=4", "--steps", "8", "--seed", "3")
    assert a["steps_committed"]["r2"] < 8 and a["steps"] == 8
    same = lambda f: {k: v for k, v in f.items() if k in ("steps_committed", "participants_per_step", "kills")}
    assert same(a) == same(b)


def test_bad_inject_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match=r"unknown fault 'kill everything'.*kill replica=R \[rank=K\] step=S"):
        main(["emulate", "--inject", "kill everything"])
    with pytest.raises(SystemExit, match=r"replica=9 .*the profile has replicas 0\.\.3"):
        main(["emulate", "--inject", "kill replica=9 step=1"])
