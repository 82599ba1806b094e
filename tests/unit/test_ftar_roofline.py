"""The FTAR kernels' roofline model (ftrun/ftar/roofline.py): table of ops and launch shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftrun.ftar.roofline import DEVICES, DeviceModel, device_for, estimate

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# 100 GB/s moved and 1 TB/s stored per SM (the store ceiling binds only where a test says so)
DEV = DeviceModel(name="test", hbm_gbps=1000.0, num_sms=4, sm_clock_ghz=1.0, sm_bytes_per_clk=100.0,
                  sm_store_bytes_per_clk=1000.0, latency_ns=1000.0)


@pytest.mark.parametrize("op, itemsize, blocks, threads, bytes_per_elem, mem_gbps, limit", [
    # in flight = blocks x threads x 8 x 16 x reads; latency ceiling = in flight / 1000 ns x (r + w) / r
    ("copy", 4, 1, 32, 8, 8.192, "latency"),  # 4096 B / 1000 ns x 2
    ("reduce", 4, 1, 32, 12, 12.288, "latency"),  # 8192 B / 1000 ns x 1.5
    ("reduce_copy", 2, 1, 32, 8, 16.384, "latency"),  # 8192 B / 1000 ns x 2
    ("reduce", 2, 2, 1024, 6, 200.0, "sm"),  # latency 786 GB/s; 2 SMs x 100
    ("copy", 1, 8, 1024, 2, 400.0, "sm"),  # blocks beyond the SM count share the 4 SMs
    ("reduce", 4, 64, 1024, 12, 400.0, "sm"),
])
def test_estimate_picks_the_lowest_ceiling(op, itemsize, blocks, threads, bytes_per_elem, mem_gbps, limit):
    e = estimate(op, itemsize, blocks, threads, DEV)
    assert (e.bytes_per_elem, e.limit) == (bytes_per_elem, limit)
    assert e.mem_gbps == pytest.approx(mem_gbps)
    reads_writes = {"copy": 2, "reduce": 3, "reduce_copy": 4}[op]
    assert e.payload_gbps == pytest.approx(mem_gbps / reads_writes)


def test_store_ceiling_scales_with_the_share_of_writes():
    dev = DeviceModel(name="slow stores", hbm_gbps=1000.0, num_sms=4, sm_clock_ghz=2.0, sm_bytes_per_clk=100.0,
                      sm_store_bytes_per_clk=10.0, latency_ns=1.0)
    copy, reduce = estimate("copy", 4, 1, 512, dev), estimate("reduce", 4, 1, 512, dev)
    assert (copy.limit, copy.mem_gbps) == ("store", pytest.approx(40.0))  # 20 GB/s written x 2
    assert (reduce.limit, reduce.mem_gbps) == ("store", pytest.approx(60.0))  # 20 GB/s written x 3


def test_hbm_bounds_a_wide_launch():
    dev = DeviceModel(name="slow hbm", hbm_gbps=50.0, num_sms=132, sm_clock_ghz=1.0, sm_bytes_per_clk=200.0,
                      sm_store_bytes_per_clk=200.0, latency_ns=100.0)
    e = estimate("reduce", 4, 132, 1024, dev)
    assert (e.limit, e.mem_gbps) == ("hbm", 50.0)


@pytest.mark.parametrize("name, key", [("cuda_kernels_h100.json", "h100"), ("cuda_kernels_h200.json", "h200")])
def test_model_matches_the_measured_kernels_at_few_sms(name, key):
    """The per-SM ceilings explain the measured GB/s: within 6% at 1 to 8 blocks of 512 threads, within
    15% at 16 (half-precision reduce falls behind first)."""
    rows = json.loads((RESULTS / name).read_text())["results"]
    checked = 0
    for r in rows:
        if r["blocks"] <= 16:
            e = estimate(r["op"], {"float32": 4, "float16": 2, "bfloat16": 2}[r["dtype"]], r["blocks"], r["threads"],
                         DEVICES[key])
            low = 0.94 if r["blocks"] <= 8 else 0.85
            assert low <= r["gbps"] / e.payload_gbps <= 1.05, (r, e)
            checked += 1
    assert checked == 45  # 3 ops x 3 dtypes x 1, 2, 4, 8, 16 blocks


def test_default_launch_is_bound_by_the_sm_port_far_below_design_200_gbps():
    """DESIGN's 'reduce at 2 SMs x 512 threads >= 200 GB/s' needs 600 GB/s of traffic on two SMs."""
    e = estimate("reduce", 4, 2, 512, DEVICES["h100"])
    assert e.limit == "sm" and e.payload_gbps < 85.0
    assert estimate("reduce", 4, 6, 512, DEVICES["h100"]).payload_gbps >= 200.0  # 6 SMs would do


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), (None, "h100")])
def test_device_for_a_torch_name(name, key):
    assert device_for(name) is DEVICES[key]


@pytest.mark.parametrize("args, match", [
    (("scatter", 4, 1, 1), "unknown op"),
    (("copy", 3, 1, 1), "itemsize"),
    (("copy", 4, 0, 1), "blocks and threads"),
])
def test_bad_arguments_say_what_is_wrong(args, match):
    with pytest.raises(ValueError, match=match):
        estimate(*args, DEV)


def test_device_model_checks_its_fields():
    with pytest.raises(ValueError, match="latency_ns"):
        DeviceModel(name="x", hbm_gbps=1.0, num_sms=1, sm_clock_ghz=1.0, sm_bytes_per_clk=1.0,
                    sm_store_bytes_per_clk=1.0, latency_ns=0.0)
    with pytest.raises(ValueError, match="sm_store_bytes_per_clk"):
        DeviceModel(name="x", hbm_gbps=1.0, num_sms=1, sm_clock_ghz=1.0, sm_bytes_per_clk=1.0,
                    sm_store_bytes_per_clk=0.0, latency_ns=1.0)


def test_benchmark_without_a_gpu_prints_the_model_labelled_as_such(capsys):
    from tests.benchmark_scripts import load

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark measures instead")
    bench = load("cuda_kernels")
    assert bench.main(["--blocks", "2", "--dtypes", "float16", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("ROOFLINE MODEL ONLY") for line in out)
    report = json.loads(out[-1])
    assert "skipped" in report and report["model_device"] == DEVICES["h100"].name
    reduce_row = next(r for r in report["model"] if r["op"] == "reduce")
    assert reduce_row["bytes_per_elem"] == 6
    assert reduce_row["model_gbps"] == pytest.approx(estimate("reduce", 2, 2, 512, DEVICES["h100"]).payload_gbps)
