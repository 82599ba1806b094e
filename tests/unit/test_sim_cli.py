"""`ftrun sim spare-mc` and `ftrun sim ttt` through the top-level entry point."""

from __future__ import annotations

import json

import pytest

from ftrun.cli import main

pytestmark = pytest.mark.timeout(60)

TINY_TTT = ["--set", "system.num_groups=60", "--set", "system.train_horizon_h=4",
            "--set", "sweep.redundancies=[1, 2, 3]", "--set", "sweep.num_seeds=1", "--set", "sweep.mc_trials=200"]


def last_json(capsys) -> tuple[str, dict]:
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_spare_mc_one_cell_json(capsys):
    assert main(["sim", "spare-mc", "--n", "200", "--r", "4", "--trials", "500", "--seed", "3", "--json"]) == 0
    out, figures = last_json(capsys)
    assert {"n", "r", "mean_failures", "closed_form", "mean_stack"} <= set(figures)
    assert (figures["n"], figures["r"]) == (200, 4)
    assert figures["closed_form"] == pytest.approx(48.205, abs=1e-3)
    assert figures["mean_failures"] == pytest.approx(figures["closed_form"], rel=0.05)
    assert 1.8 < figures["mean_stack"] <= 2.2
    assert "Thm 4.1" in out  # the readable table comes first


def test_spare_mc_is_deterministic(capsys):
    argv = ["sim", "spare-mc", "--n", "100", "--r", "3", "--trials", "300", "--stack-trials", "2", "--seed", "9",
            "--json"]
    main(argv)
    _, first = last_json(capsys)
    main(argv)
    _, second = last_json(capsys)
    assert first == second


def test_spare_mc_grid_json(capsys):
    assert main(["sim", "spare-mc", "--n", "50", "100", "--r", "2", "3", "--trials", "200", "--stack-trials", "1",
                 "--controller-trials", "1", "--json"]) == 0
    _, figures = last_json(capsys)
    assert [(c["n"], c["r"]) for c in figures["cells"]] == [(50, 2), (50, 3), (100, 2), (100, 3)]
    assert all(c["patch_rate"] is not None for c in figures["cells"])


def test_spare_mc_rejects_an_impossible_ruler(capsys):
    assert main(["sim", "spare-mc", "--n", "20", "--r", "6", "--trials", "10"]) == 2
    assert "order 6" in capsys.readouterr().err


def test_ttt_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "ttt.png"
    assert main(["sim", "ttt", *TINY_TTT, "--plot", str(png), "--json"]) == 0
    out, figures = last_json(capsys)
    assert "Rep+CKPT" in out and "FT-HSDP" in out
    assert {"ckpt_only", "ft_hsdp", "rep", "spare", "best"} <= set(figures)
    assert [row["redundancy"] for row in figures["spare"]] == [1, 2, 3]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ttt_bad_override_names_the_field(capsys):
    assert main(["sim", "ttt", "--set", "failures.weibull_shape=0"]) == 2
    assert "failures.weibull_shape" in capsys.readouterr().err
