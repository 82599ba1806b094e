"""GlooComm: the torch.distributed ReplicaComm, two ranks as two processes (as in a real replica)."""

from __future__ import annotations

import json

from tests.integration.rank_procs import run_ranks

RANK_MAIN = """
import datetime, json, sys
import torch.distributed as dist
from ftrun.replica.comm import GlooComm
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=30))
comm = GlooComm(store=store, prefix="replica-a/0/", rank=rank, world_size=2, timeout_s=30.0)
out = [comm.all_reduce_int([rank, -rank], "max"), comm.all_reduce_int([rank + 1], "min"),
       comm.broadcast_bytes(b"decision" if rank == 0 else None).decode(),
       [b.decode() for b in comm.all_gather_bytes(f"addr-{rank}".encode() * (rank + 1))],
       comm.broadcast_bytes(b"").decode(),
       comm.gather_bytes(str(rank).encode()) is None if rank else [b.decode() for b in comm.gather_bytes(b"0")],
       comm.scatter_bytes([b"zero", b"one"] if rank == 0 else None).decode(),
       [len(comm.broadcast_bytes(bytes(range(256)) * (n // 256) + b"z" * (n % 256) if rank == 0 else None))
        for n in (4087, 4088, 4089, 70_000)],
       comm.broadcast_bytes(b"ab" * 3000 if rank == 0 else None) == b"ab" * 3000]
comm.close()
print(json.dumps(out))
"""


def test_gloo_collectives_round_trip():
    done = run_ranks(lambda r, port: ["-c", RANK_MAIN, str(r), str(port)], 2, timeout_s=60)
    assert [code for code, _, _ in done] == [0, 0], "\n".join(err[-2000:] for _, _, err in done)
    results = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]
    common = [[1, 0], [1], "decision", ["addr-0", "addr-1addr-1"], ""]
    long = [[4087, 4088, 4089, 70_000], True]  # within one collective, at its edge, and past it (two)
    assert results == [common + [["0", "1"], "zero"] + long, common + [True, "one"] + long]
