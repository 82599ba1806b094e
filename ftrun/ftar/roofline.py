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
- sm: blocks x what one SM's port to L2 moves (reads + writes: bytes per clock x SM clock);
- store: blocks x what one SM writes (bytes per clock x SM clock), scaled by traffic / writes;
- latency (Little's law): the bytes each thread has in flight (kUnroll 16-byte loads per operand it
  reads) x threads x blocks / DRAM latency, for the loads, scaled by traffic / loads for the stores.
At FTAR's 2 x 512 the per-SM ceilings bind, not bytes in flight: keeping more loads in flight (a ring
of cp.async or bulk-copy stages in shared memory) measured slower, not faster (README "CUDA kernels").
"""

from __future__ import annotations

from dataclasses import dataclass

VEC_BYTES = 16  # csrc/ftar_bodies.cuh kVecBytes
UNROLL = 8  # csrc/ftar_bodies.cuh kUnroll (FTAR_UNROLL_LOADS)

# op -> (elements read, elements written) per element of payload
TRAFFIC = {"copy": (1, 1), "reduce": (2, 1), "reduce_copy": (2, 2)}


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """What the model assumes about a GPU. hbm_gbps, num_sms and sm_clock_ghz are the vendor's figures;
    the per-SM bytes per clock are what DEVICES says they are; latency is a typical value."""

    name: str
    hbm_gbps: float
    num_sms: int
    sm_clock_ghz: float  # SM clock under load
    sm_bytes_per_clk: float  # bytes one SM moves to and from L2 per clock (reads + writes)
    sm_store_bytes_per_clk: float  # bytes one SM writes per clock
    latency_ns: float  # DRAM load latency under load

    def __post_init__(self) -> None:
        for field in ("hbm_gbps", "sm_clock_ghz", "sm_bytes_per_clk", "sm_store_bytes_per_clk", "latency_ns"):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceModel.{field} must be > 0, got {getattr(self, field)}")
        if self.num_sms < 1:
            raise ValueError(f"DeviceModel.num_sms must be >= 1, got {self.num_sms}")

    @property
    def sm_gbps(self) -> float:
        """GB/s one SM moves to and from L2 (reads + writes)."""
        return self.sm_bytes_per_clk * self.sm_clock_ghz

    @property
    def sm_store_gbps(self) -> float:
        """GB/s one SM writes."""
        return self.sm_store_bytes_per_clk * self.sm_clock_ghz


# NVIDIA datasheets: H100 SXM5 3.35 TB/s HBM3 and 132 SMs; H200 4.8 TB/s HBM3e and 132 SMs; both run their
# SMs at up to 1980 MHz. Per-SM bytes per clock from the csrc/ kernels at 1 to 8 blocks of 512 threads (fp32,
# 256 MB; benchmarks/results/cuda_kernels_h{100,200}.json): reduce moves 118-120 GB/s per SM (60.4 B/clk)
# and copy and reduce_copy write 48.6-49.4 GB/s per SM (24.6 B/clk), on both devices.
# latency_ns: a loaded DRAM round trip (assumed).
DEVICES = {
    "h100": DeviceModel(name="H100 SXM (model)", hbm_gbps=3350.0, num_sms=132, sm_clock_ghz=1.98,
                        sm_bytes_per_clk=60.4, sm_store_bytes_per_clk=24.6, latency_ns=700.0),
    "h200": DeviceModel(name="H200 (model)", hbm_gbps=4800.0, num_sms=132, sm_clock_ghz=1.98,
                        sm_bytes_per_clk=60.4, sm_store_bytes_per_clk=24.6, latency_ns=700.0),
}


def device_for(gpu_name: str | None) -> DeviceModel:
    """The model for a torch device name ('NVIDIA H200', ...); H100 when unknown or None."""
    name = (gpu_name or "").lower()
    return DEVICES["h200"] if "h200" in name else DEVICES["h100"]


@dataclass(frozen=True)
class Estimate:
    op: str
    itemsize: int
    blocks: int
    threads: int
    bytes_per_elem: int  # bytes moved (read + written) per element
    mem_gbps: float  # modeled memory traffic
    payload_gbps: float  # modeled payload (op's nbytes per second, what the benchmark's GB/s counts)
    limit: str  # "hbm", "sm", "store" or "latency": the ceiling that binds


def estimate(op: str, itemsize: int, blocks: int, threads: int, device: DeviceModel) -> Estimate:
    """The model's GB/s for one op at one launch shape. Raises ValueError for an unknown op or shape."""
    if op not in TRAFFIC:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(TRAFFIC)}")
    if itemsize not in (1, 2, 4):
        raise ValueError(f"itemsize must be 1, 2 or 4, got {itemsize}")
    if blocks < 1 or threads < 1:
        raise ValueError(f"blocks and threads must be >= 1, got {blocks} x {threads}")
    reads, writes = TRAFFIC[op]
    in_flight = blocks * threads * UNROLL * VEC_BYTES * reads  # load bytes outstanding
    sms = min(blocks, device.num_sms)
    ceilings = {
        "hbm": device.hbm_gbps,
        "sm": sms * device.sm_gbps,
        "store": sms * device.sm_store_gbps * (reads + writes) / writes,
        "latency": in_flight / device.latency_ns * (reads + writes) / reads,  # bytes/ns == GB/s
    }
    limit = min(ceilings, key=ceilings.__getitem__)
    mem = ceilings[limit]
    return Estimate(op=op, itemsize=itemsize, blocks=blocks, threads=threads,
                    bytes_per_elem=(reads + writes) * itemsize, mem_gbps=mem,
                    payload_gbps=mem / (reads + writes), limit=limit)
