"""A roofline model of the csrc/ FTAR kernels: the GB/s each op can reach on a given GPU and launch.

Pure arithmetic, no device. `benchmarks/cuda_kernels.py` prints it next to measured GB/s (or alone,
labelled as a model, without a GPU).

Per element of `itemsize` bytes an op moves (reads + writes, in units of itemsize):
- copy: read src, write dst = 2;
- reduce (dst += src): read dst and src, write dst = 3;
- reduce_copy (dst += src; out = dst): read dst and src, write dst and out = 4.
Each does at most one add per element, so every op is memory bound: at 0.33 flop/byte for float32
the roofline's ridge point is two orders of magnitude away.

With the few SMs FTAR runs on (FT-HSDP §4.2: 2 x 512), the kernel cannot reach HBM bandwidth, and
four ceilings apply to the memory traffic; the lowest wins:
- hbm: the device's DRAM bandwidth;
- sm: blocks x what one SM moves to and from L2 (reads + writes);
- store: blocks x what one SM writes, scaled by traffic / writes;
- latency (Little's law): the load bytes in flight x blocks / DRAM latency, scaled by traffic / loads
  for the stores. Variant 0 (registers) keeps kUnroll 16-byte loads per operand it reads per thread;
  variants 1 (staged) and 2 (bulk) keep all but the stage being consumed of their shared-memory ring
  (`stage_plan`).
Neither variant keeps its loads in flight all the time (variant 0 drains them before it stores), so
the latency ceiling is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.ftar.kernels import check_variant

VEC_BYTES = 16  # csrc/ftar_bodies.cuh kVecBytes
UNROLL = 8  # csrc/ftar_bodies.cuh kUnroll (FTAR_UNROLL_LOADS)
MAX_STAGES = 16  # csrc/ftar_kernels.h FTAR_MAX_STAGES
MAX_STAGE_VECS = 8  # csrc/ftar_bodies.cuh kMaxStageVecs
SMEM_OPTIN_SM90 = 232448  # opt-in shared memory per block on sm_90 (227 KB), what the staged launchers ask for
BULK_RESERVED = 256  # csrc/ftar_kernels.cu kBarrierBytes: the bulk variant's mbarriers before its ring

# op -> (elements read, elements written) per element of payload
TRAFFIC = {"copy": (1, 1), "reduce": (2, 1), "reduce_copy": (2, 2)}


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """What the model assumes about a GPU. hbm_gbps and num_sms are the vendor's figures; latency is
    a typical value; the per-SM rates are what the DEVICES entries say they are."""

    name: str
    hbm_gbps: float
    num_sms: int
    sm_gbps: float  # bytes one SM moves to and from L2 per second (reads + writes), in GB/s
    latency_ns: float  # DRAM load latency under load
    sm_store_gbps: float = float("inf")  # bytes one SM writes per second, in GB/s
    smem_per_block: int = SMEM_OPTIN_SM90  # opt-in shared memory per block, bytes (the staged ring's budget)

    def __post_init__(self) -> None:
        for field in ("hbm_gbps", "sm_gbps", "latency_ns", "smem_per_block", "sm_store_gbps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceModel.{field} must be > 0, got {getattr(self, field)}")
        if self.num_sms < 1:
            raise ValueError(f"DeviceModel.num_sms must be >= 1, got {self.num_sms}")


# NVIDIA datasheets: H100 SXM5 3.35 TB/s HBM3 and 132 SMs; H200 4.8 TB/s HBM3e and 132 SMs.
# Per-SM rates measured on an H200 (GPU run of 2026-11-27, benchmarks/cuda_kernels.py --size-mb 256, fp32,
# one block of 512 threads, variant 0): copy 48.8 GB/s payload (97.6 moved), reduce 39.8 (119.5 moved),
# reduce_copy 24.4 (97.6 moved): one SM writes at most ~48.8 GB/s and moves at most ~119.5 GB/s in all;
# 2 blocks give exactly twice that, and the H100 80GB HBM3 gave the same 2-block figures (README).
# latency_ns: a loaded DRAM round trip (assumed).
DEVICES = {
    "h100": DeviceModel(name="H100 SXM (model)", hbm_gbps=3350.0, num_sms=132, sm_gbps=119.5, latency_ns=700.0,
                        sm_store_gbps=48.8),
    "h200": DeviceModel(name="H200 (model)", hbm_gbps=4800.0, num_sms=132, sm_gbps=119.5, latency_ns=700.0,
                        sm_store_gbps=48.8),
}


def device_for(gpu_name: str | None) -> DeviceModel:
    """The model for a torch device name ('NVIDIA H200', ...); H100 when unknown or None."""
    name = (gpu_name or "").lower()
    return DEVICES["h200"] if "h200" in name else DEVICES["h100"]


def stage_plan(operands: int, threads: int, smem_budget: int, max_stages: int = MAX_STAGES) -> tuple[int, int]:
    """(stages, vectors per operand per thread per stage) of the staged variants' ring, as
    csrc/ftar_bodies.cuh plan_stages computes it; (0, 0) when not even two stages fit (the launcher
    then runs variant 0). tests/unit/test_csrc_host_kernels.py checks the two agree."""
    slots = smem_budget // (operands * threads * VEC_BYTES)
    if slots < 2:
        return 0, 0
    vecs = min(-(-slots // max_stages), MAX_STAGE_VECS)
    return min(slots // vecs, max_stages), vecs


def load_bytes_in_flight(reads: int, threads: int, variant: int, device: DeviceModel,
                         max_stages: int = MAX_STAGES) -> int:
    """Load bytes one block keeps in flight at most: variant 0's registers, or variant 1's or 2's ring
    (at most `max_stages` stages in device.smem_per_block) less the stage being consumed."""
    check_variant(variant)
    reserved = BULK_RESERVED if variant == 2 else 0
    stages, vecs = stage_plan(reads, threads, device.smem_per_block - reserved, max_stages) if variant else (0, 0)
    if stages == 0:
        return threads * UNROLL * VEC_BYTES * reads
    return (stages - 1) * vecs * reads * threads * VEC_BYTES


@dataclass(frozen=True)
class Estimate:
    op: str
    itemsize: int
    blocks: int
    threads: int
    variant: int
    bytes_per_elem: int  # bytes moved (read + written) per element
    mem_gbps: float  # modeled memory traffic
    payload_gbps: float  # modeled payload (op's nbytes per second, what the benchmark's GB/s counts)
    limit: str  # "hbm", "sm", "store" or "latency": the ceiling that binds


def estimate(op: str, itemsize: int, blocks: int, threads: int, device: DeviceModel, variant: int = 0,
             max_stages: int = MAX_STAGES) -> Estimate:
    """The model's GB/s for one op at one launch shape and kernel variant (0: registers, 1: staged, 2: bulk;
    the staged ones' ring of at most `max_stages` stages). Raises ValueError for an unknown op, shape or
    variant."""
    if op not in TRAFFIC:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(TRAFFIC)}")
    if itemsize not in (1, 2, 4):
        raise ValueError(f"itemsize must be 1, 2 or 4, got {itemsize}")
    if blocks < 1 or threads < 1:
        raise ValueError(f"blocks and threads must be >= 1, got {blocks} x {threads}")
    reads, writes = TRAFFIC[op]
    in_flight = blocks * load_bytes_in_flight(reads, threads, variant, device, max_stages)  # load bytes outstanding
    sms = min(blocks, device.num_sms)
    ceilings = {
        "hbm": device.hbm_gbps,
        "sm": sms * device.sm_gbps,
        "store": sms * device.sm_store_gbps * (reads + writes) / writes,
        "latency": in_flight / device.latency_ns * (reads + writes) / reads,  # bytes/ns == GB/s
    }
    limit = min(ceilings, key=ceilings.__getitem__)
    mem = ceilings[limit]
    return Estimate(op=op, itemsize=itemsize, blocks=blocks, threads=threads, variant=variant,
                    bytes_per_elem=(reads + writes) * itemsize, mem_gbps=mem,
                    payload_gbps=mem / (reads + writes), limit=limit)
