"""`ftrun diagnose bench` and `ftrun emulate --diagnose` on the emulator: one emulated job runs scenarios
one after another (inject, wait for the symptom, collect over the modeled network, analyze, score,
release), and the verdicts reach the emulate report and trace. ci-small is deterministic (no CPU
charging), so its results are asserted exactly; design-4k is the `scale`-marked run."""

from __future__ import annotations

import json

import pytest

from ftrun import cli as ftrun_cli
from harness.diagbench import run_bench
from harness.profile import load_profile

KEYS = {"scenarios", "accuracy", "candidate_hits", "false_positive_runs", "analysis_s_p50", "analysis_s_p99",
        "telemetry_bytes_per_rank", "misses"}


@pytest.mark.timeout(120)
def test_bench_at_ci_small_names_every_injected_culprit(capsys):
    code = ftrun_cli.main(["diagnose", "bench", "--profile", "ci-small", "--scenarios", "5", "--seed", "1",
                           "--fault-free", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= out.keys()
    # seed 1 draws slow host, slow link, kill rank, hang rank, cut building: ci-small's tiny all-reduce
    # never waits on the wire (the socket buffer absorbs it), so the link has no wire time: unscored
    assert out["scenarios"] == 4 and [u["kind"] for u in out["unscored"]] == ["slow_link"]
    assert out["accuracy"] == 1.0 and out["misses"] == [], out["misses"]
    assert out["false_positive_runs"] == 0 and out["false_evictions"] == 0 and out["fault_free_runs"] == 2
    assert out["telemetry_bytes_per_rank"] <= 1_000_000 and out["analysis_s_p99"] is not None
    assert out["errors"] == [] and out["stalled"] == []
    assert (out["ftar_detail"], out["cpu_charging"], out["fault_places"]) == ("full", False, "every host")
    assert out["ftar_chunk_mb"] > 0


@pytest.mark.timeout(120)
def test_emulate_diagnose_puts_the_verdict_in_the_report_and_trace(tmp_path, capsys):
    code = ftrun_cli.main(["emulate", "ci-small", "--steps", "14", "--no-progress", "--ftar-detail", "full",
                           "--diagnose", "0.5", "--inject", "hang replica=0 rank=5 time=4 duration=3", "--out", str(tmp_path),
                           "--json"])
    f = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and f["complete"]
    hangs = [v for v in f["diagnosis"]["verdicts"] if v["kind"] == "hang"]
    assert hangs and hangs[0]["ranks"] == ["r0/5"] and "did not answer" in hangs[0]["reason"]
    assert f["diagnosis"]["telemetry_bytes_per_rank"] <= 1_000_000
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["diagnosis"]["verdicts"] == f["diagnosis"]["verdicts"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"verdict: hang", "hang replica=0 rank=5 time=4 duration=3"} <= names  # as `ftrun launch`'s trace


def test_bench_usage_errors(capsys):
    assert ftrun_cli.main(["diagnose", "bench", "--profile", "nope", "--scenarios", "1"]) == 2
    assert "no scale profile 'nope'" in capsys.readouterr().err
    assert ftrun_cli.main(["diagnose", "bench", "--scenarios", "-1"]) == 2
    assert ftrun_cli.main(["diagnose"]) == 2
    assert ftrun_cli.main(["diagnose", "bench", "--scenarios", "4", "--only", "4"]) == 2  # before any job runs
    assert "--only names scenario indexes in [0, 4)" in capsys.readouterr().err


@pytest.mark.scale
@pytest.mark.timeout(3600)
def test_bench_at_design_4k():
    out = run_bench(load_profile("design-4k"), scenarios=12, seed=1, fault_free=6)
    assert out["scenarios"] + len(out["unscored"]) == 12
    assert out["accuracy"] >= 0.9, out["misses"]
    assert out["false_evictions"] == 0 and out["telemetry_bytes_per_rank"] <= 1_000_000
