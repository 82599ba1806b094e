"""GB/s of the FTAR CUDA kernels per op, dtype and block count (SMs), against torch measured in the
same run: `dst.copy_(src)`, `dst.add_(src)`, and add_ + copy_ for the fused reduce_copy.

Usage: python benchmarks/cuda_kernels.py [--size-mb 64] [--blocks 1,2,4,8,16,32] [--threads 512]
                                        [--dtypes float32,float16,bfloat16] [--iters 50] [--json]
GB/s counts payload bytes (the op's nbytes per second); mem GB/s counts every byte read and
written (copy 2x, reduce 3x, reduce_copy 4x payload). ratio = ours / torch (torch uses every SM).
Each row also shows the roofline model's GB/s for that op, dtype and launch (ftrun/ftar/roofline.py:
bytes moved per element and the binding ceiling: hbm, per-SM traffic, per-SM stores or bytes in flight /
latency),
and `of_model` = measured / model. Without a GPU or the built library it says why and prints the
model alone, labelled as a model (exit 0; the JSON line then has "skipped" and "model").
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftrun.ftar import cuda_kernels  # noqa: E402
from ftrun.ftar.kernels import DType, KernelUnavailableError  # noqa: E402
from ftrun.ftar.roofline import DEVICES, DeviceModel, device_for, estimate  # noqa: E402

TRAFFIC = {"copy": 2, "reduce": 3, "reduce_copy": 4}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64.0)
    p.add_argument("--blocks", default="1,2,4,8,16,32")
    p.add_argument("--threads", type=int, default=cuda_kernels.DEFAULT_THREADS)
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model-device", choices=sorted(DEVICES), default=None,
                   help="device the model assumes (default: the GPU's name, else h100)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def model_rows(args: argparse.Namespace, device: DeviceModel) -> list[dict[str, Any]]:
    """The roofline model for every (op, dtype, blocks) the benchmark measures."""
    rows = []
    for name in args.dtypes.split(","):
        dtype = DType.parse(name)
        for blocks in (int(b) for b in args.blocks.split(",")):
            for op in TRAFFIC:
                e = estimate(op, dtype.itemsize, blocks, args.threads, device)
                rows.append({"op": op, "dtype": dtype.name.lower(), "blocks": blocks, "threads": args.threads,
                             "bytes_per_elem": e.bytes_per_elem, "model_gbps": e.payload_gbps,
                             "model_mem_gbps": e.mem_gbps, "model_limit": e.limit})
    return rows


def print_model(rows: list[dict[str, Any]], device: DeviceModel) -> None:
    print(f"ROOFLINE MODEL ONLY (nothing measured): {device.name}, HBM {device.hbm_gbps:g} GB/s, "
          f"{device.sm_gbps:.1f} GB/s moved and {device.sm_store_gbps:.1f} stored per SM, {device.latency_ns:g} ns latency, {rows[0]['threads']} threads per block")
    for r in rows:
        print(f"{r['op']:12s} {r['dtype']:9s} blocks={r['blocks']:<4d} {r['bytes_per_elem']:2d} B/elem moved  "
              f"model {r['model_gbps']:8.1f} GB/s (mem {r['model_mem_gbps']:7.1f}, {r['model_limit']}-bound)")


def time_per_call(torch: Any, fn: Callable[[], None], iters: int) -> float:
    """Seconds per call, from CUDA events around `iters` calls after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def ops(torch: Any, k: Any, dst: Any, src: Any, out: Any, nbytes: int, dtype: DType) -> dict[str, tuple]:
    """op name -> (ours, torch baseline), each a zero-argument callable."""
    return {
        "copy": (lambda: k.copy(dst, 0, src, 0, nbytes), lambda: dst.copy_(src)),
        "reduce": (lambda: k.reduce(dst, 0, src, 0, nbytes, dtype), lambda: dst.add_(src)),
        "reduce_copy": (lambda: k.reduce_copy(dst, 0, src, 0, out, 0, nbytes, dtype),
                        lambda: out.copy_(dst.add_(src))),
    }


def measure(args: argparse.Namespace, torch: Any) -> list[dict[str, Any]]:
    nbytes = int(args.size_mb * (1 << 20)) // 4 * 4
    rows = []
    for name in args.dtypes.split(","):
        dtype = DType.parse(name)
        tdtype = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
        count = nbytes // dtype.itemsize
        # Small values: repeated adds stay finite for every dtype.
        dst, src, out = (torch.full((count,), 1e-3, dtype=tdtype, device="cuda") for _ in range(3))
        baseline: dict[str, float] = {}
        for blocks in (int(b) for b in args.blocks.split(",")):
            k = cuda_kernels.CudaKernels(blocks=blocks, threads=args.threads)
            for op, (ours, theirs) in ops(torch, k, dst, src, out, nbytes, dtype).items():
                if op not in baseline:
                    baseline[op] = time_per_call(torch, theirs, args.iters)
                t = time_per_call(torch, ours, args.iters)
                rows.append({"op": op, "dtype": dtype.name.lower(), "blocks": blocks, "threads": args.threads,
                             "gbps": nbytes / t / 1e9, "mem_gbps": TRAFFIC[op] * nbytes / t / 1e9,
                             "torch_gbps": nbytes / baseline[op] / 1e9, "ratio": baseline[op] / t})
    return rows


def with_model(rows: list[dict[str, Any]], model: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured rows joined with the model's row of the same op, dtype and blocks."""
    by_key = {(m["op"], m["dtype"], m["blocks"]): m for m in model}
    out = []
    for r in rows:
        m = by_key[(r["op"], r["dtype"], r["blocks"])]
        out.append(r | {k: m[k] for k in ("bytes_per_elem", "model_gbps", "model_limit")}
                   | {"of_model": r["gbps"] / m["model_gbps"]})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    try:
        if not torch.cuda.is_available():
            raise KernelUnavailableError("no CUDA GPU is visible to torch")
        cuda_kernels.load_library()
    except KernelUnavailableError as e:
        model_device = DEVICES[args.model_device or "h100"]
        model = model_rows(args, model_device)
        print(f"cuda_kernels benchmark skipped: {e}")
        print_model(model, model_device)
        if args.json:
            print(json.dumps({"skipped": str(e), "model_device": model_device.name, "model": model}))
        return 0
    device = torch.cuda.get_device_name()
    model_device = DEVICES[args.model_device] if args.model_device else device_for(device)
    rows = with_model(measure(args, torch), model_rows(args, model_device))
    print(f"{device}, {args.size_mb:g} MB per op, {args.threads} threads per block; model: {model_device.name}")
    for r in rows:
        print(f"{r['op']:12s} {r['dtype']:9s} blocks={r['blocks']:<4d} {r['gbps']:8.1f} GB/s "
              f"(mem {r['mem_gbps']:7.1f})  model {r['model_gbps']:8.1f} ({r['model_limit']}, "
              f"{r['of_model']:.2f} of it)  torch {r['torch_gbps']:8.1f} GB/s  ratio {r['ratio']:.2f}")
    if args.json:
        print(json.dumps({"device": device, "size_bytes": int(args.size_mb * (1 << 20)),
                          "model_device": model_device.name, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
