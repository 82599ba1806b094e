"""The FTAR kernels' roofline model (ftrun/ftar/roofline.py): table of ops and launch shapes."""

from __future__ import annotations

import pytest

from ftrun.ftar.roofline import DEVICES, DeviceModel, device_for, estimate, load_bytes_in_flight

DEV = DeviceModel(name="test", hbm_gbps=1000.0, num_sms=4, sm_gbps=100.0, latency_ns=1000.0)


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


def test_per_sm_stores_bound_copy_and_reduce_copy_on_the_measured_devices():
    # H200, 1 block: copy 48.8 and reduce_copy 24.4 GB/s payload (store-bound), reduce 39.8 (traffic-bound)
    dev = DEVICES["h200"]
    got = {op: estimate(op, 4, 1, 512, dev) for op in ("copy", "reduce", "reduce_copy")}
    assert {op: e.limit for op, e in got.items()} == {"copy": "store", "reduce": "sm", "reduce_copy": "store"}
    assert got["copy"].payload_gbps == pytest.approx(dev.sm_store_gbps)
    assert got["reduce_copy"].payload_gbps == pytest.approx(dev.sm_store_gbps / 2)
    assert got["reduce"].payload_gbps == pytest.approx(dev.sm_gbps / 3)
    assert estimate("reduce", 4, 2, 512, dev).payload_gbps < 100  # DESIGN's 200 GB/s at 2 SMs is out of reach


def test_hbm_bounds_a_wide_launch():
    dev = DeviceModel(name="slow hbm", hbm_gbps=50.0, num_sms=132, sm_gbps=200.0, latency_ns=100.0)
    e = estimate("reduce", 4, 132, 1024, dev)
    assert (e.limit, e.mem_gbps) == ("hbm", 50.0)


def test_staged_variant_keeps_its_ring_less_one_stage_in_flight():
    # reduce at 512 threads in 227 KB: 14 stages of 1 vector per operand; 13 x 2 x 512 x 16 B in flight
    assert load_bytes_in_flight(2, 512, 1, DEVICES["h100"]) == 13 * 2 * 512 * 16
    assert load_bytes_in_flight(2, 512, 2, DEVICES["h100"]) == 13 * 2 * 512 * 16  # bulk: the same ring
    assert load_bytes_in_flight(1, 512, 2, DEVICES["h100"]) == 13 * 2 * 512 * 16  # copy: 14 x 2 vectors
    assert load_bytes_in_flight(2, 512, 0, DEVICES["h100"]) == 8 * 2 * 512 * 16  # registers: 8 loads per operand
    small = DeviceModel(name="small smem", hbm_gbps=1000.0, num_sms=4, sm_gbps=100.0, latency_ns=1000.0,
                        smem_per_block=1024)
    assert load_bytes_in_flight(2, 512, 1, small) == load_bytes_in_flight(2, 512, 0, small)  # falls back
    dev = DeviceModel(name="fast sm", hbm_gbps=5000.0, num_sms=132, sm_gbps=10000.0, latency_ns=700.0)
    registers, staged = (estimate("reduce", 4, 2, 512, dev, variant=v) for v in (0, 1))
    assert staged.limit == registers.limit == "latency"
    assert staged.mem_gbps == pytest.approx(registers.mem_gbps * 13 / 8)


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), (None, "h100")])
def test_device_for_a_torch_name(name, key):
    assert device_for(name) is DEVICES[key]


@pytest.mark.parametrize("args, match", [
    (("scatter", 4, 1, 1), "unknown op"),
    (("copy", 3, 1, 1), "itemsize"),
    (("copy", 4, 0, 1), "blocks and threads"),
    (("copy", 4, 1, 1, DEV, 3), "variant=3 is not a kernel variant"),
])
def test_bad_arguments_say_what_is_wrong(args, match):
    with pytest.raises(ValueError, match=match):
        estimate(*args) if len(args) > 4 else estimate(*args, DEV)


def test_device_model_checks_its_fields():
    with pytest.raises(ValueError, match="latency_ns"):
        DeviceModel(name="x", hbm_gbps=1.0, num_sms=1, sm_gbps=1.0, latency_ns=0.0)


def test_benchmark_without_a_gpu_prints_the_model_labelled_as_such(capsys):
    import importlib.util
    import json
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark measures instead")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_kernels.py"
    spec = importlib.util.spec_from_file_location("cuda_kernels_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--blocks", "2", "--dtypes", "float16", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("ROOFLINE MODEL ONLY") for line in out)
    report = json.loads(out[-1])
    assert "skipped" in report and report["model_device"] == DEVICES["h100"].name
    reduce_row = next(r for r in report["model"] if r["op"] == "reduce")
    assert reduce_row["bytes_per_elem"] == 6
    assert reduce_row["model_gbps"] == pytest.approx(estimate("reduce", 2, 2, 512, DEVICES["h100"]).payload_gbps)
