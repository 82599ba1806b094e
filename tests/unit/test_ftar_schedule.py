"""The pure FTAR ring schedule: structure, counts, and all-reduce results on numpy arrays."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from ftrun.ftar.kernels import DType
from ftrun.ftar.schedule import (
    CopyFromSlot,
    CopyToSlot,
    Recv,
    Reduce,
    ReduceCopy,
    Send,
    SimulationError,
    execute,
    partitions,
    schedule,
)

# Machine epsilon (2^-(p-1)) per dtype, for the recursive-summation error bound below.
EPS = {DType.FLOAT32: 2.0**-23, DType.FLOAT16: 2.0**-10, DType.BFLOAT16: 2.0**-7}


def ring(num_ranks, nbytes, elem_size=4, chunk_bytes=64, num_chunks=3):
    return [schedule(num_ranks, r, nbytes, elem_size=elem_size, chunk_bytes=chunk_bytes, num_chunks=num_chunks)
            for r in range(num_ranks)]


def make_inputs(num_ranks, count, dtype, seed=0):
    """Per-rank arrays of `dtype` (half types as uint16 bits) and their exact float64 values."""
    gen = torch.Generator().manual_seed(seed)
    tdtype = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
    tensors = [torch.randn(count, generator=gen).to(tdtype) for _ in range(num_ranks)]
    exact = [t.double().numpy() for t in tensors]
    arrays = [t.numpy() if dtype is DType.FLOAT32 else t.view(torch.int16).numpy().view(np.uint16) for t in tensors]
    return arrays, exact


def as_float64(array, dtype):
    if dtype is DType.FLOAT32:
        return array.astype(np.float64)
    tdtype = torch.float16 if dtype is DType.FLOAT16 else torch.bfloat16
    return torch.from_numpy(array.view(np.int16)).view(tdtype).double().numpy()


def check_all_reduce(num_ranks, count, dtype, *, chunk_bytes=64, num_chunks=3, rng=None, seed=0):
    arrays, exact = make_inputs(num_ranks, count, dtype, seed)
    scheds = ring(num_ranks, count * dtype.itemsize, dtype.itemsize, chunk_bytes, num_chunks)
    execute(scheds, arrays, dtype=dtype, rng=rng)
    for r in range(1, num_ranks):  # one rank forms each sum; the others only copy it
        assert np.array_equal(arrays[r].view(np.uint8), arrays[0].view(np.uint8)), f"rank {r} differs"
    got = as_float64(arrays[0], dtype)
    want = np.sum(exact, axis=0)
    # Recursive summation of N terms: |error| <= (N-1) * u * sum|x_i| (u = eps/2; eps gives slack).
    bound = (num_ranks - 1) * EPS[dtype] * np.sum(np.abs(exact), axis=0) + 1e-30
    assert np.all(np.abs(got - want) <= bound), f"max excess {np.max(np.abs(got - want) - bound)}"


# ---- structure --------------------------------------------------------------------------------

STRUCTURE_CASES = [  # (num_ranks, nbytes, elem_size, chunk_bytes, num_chunks)
    (1, 400, 4, 64, 2), (2, 0, 4, 64, 2), (3, 4, 4, 64, 2), (4, 12, 4, 64, 4), (5, 996, 4, 64, 3),
    (7, 2 * 997, 2, 48, 2), (16, 4 * 1009, 4, 32, 4), (3, 3 * 64 * 4 * 2 + 6, 2, 64, 4), (2, 10, 2, 6, 5),
]


def random_cases(n, seed, max_count=3000, chunk_elems=(1, 3, 8, 16, 24, 64)):
    rnd = random.Random(seed)
    for _ in range(n):
        elem = rnd.choice([2, 4])
        chunk = elem * rnd.choice(chunk_elems)
        yield rnd.randint(1, 16), elem * rnd.randint(0, max_count), elem, chunk, rnd.randint(1, 5)


@pytest.mark.parametrize("case", STRUCTURE_CASES + list(random_cases(150, seed=7)))
def test_partitions_tile_the_buffer_within_paper_limits(case):
    num_ranks, nbytes, elem, chunk_bytes, num_chunks = case
    parts = partitions(num_ranks, nbytes, elem_size=elem, chunk_bytes=chunk_bytes, num_chunks=num_chunks)
    full = chunk_bytes * num_chunks * num_ranks
    assert len(parts) == -(-nbytes // full)
    cursor = 0
    for i, part in enumerate(parts):
        assert (part.index, part.offset) == (i, cursor) and 0 < part.nbytes <= full
        assert len(part.segments) == num_ranks and 1 <= part.num_chunks <= num_chunks
        for seg in part.segments:
            assert seg.offset == cursor and len(seg.chunks) == part.num_chunks
            for c in seg.chunks:
                assert c.offset == cursor and c.nbytes <= chunk_bytes
                assert c.offset % elem == 0 and c.nbytes % elem == 0  # never split an element
                if chunk_bytes % 16 == 0 and c.nbytes:
                    assert c.offset % 16 == 0  # aligned for 16-byte vector kernels
                cursor += c.nbytes
        if part.nbytes == full:  # a full partition: C chunks of exactly S per segment
            assert all(c.nbytes == chunk_bytes for s in part.segments for c in s.chunks)
    assert cursor == nbytes


@pytest.mark.parametrize("case", STRUCTURE_CASES + list(random_cases(40, 11, 600, (4, 8, 24))))
def test_every_rank_writes_each_byte_once_and_messages_pair_up(case):
    num_ranks, nbytes, elem, chunk_bytes, num_chunks = case
    scheds = ring(num_ranks, nbytes, elem, chunk_bytes, num_chunks)
    if num_ranks == 1 or nbytes == 0:
        assert all(not s.steps for s in scheds)
        return
    ops = [list(s.ops()) for s in scheds]
    for s in scheds:
        written = np.zeros(nbytes, np.int32)
        sends = [op for op in ops[s.rank] if isinstance(op, Send)]
        recvs = [op for op in ops[s.rank] if isinstance(op, Recv)]
        assert [op.seq for op in sends] == list(range(len(sends)))
        assert [op.seq for op in recvs] == list(range(len(recvs)))
        assert {op.peer for op in sends} == {s.next_rank} and {op.peer for op in recvs} == {s.prev_rank}
        for op in ops[s.rank]:
            assert 0 <= op.slot < s.num_slots and 0 < op.nbytes <= s.slot_bytes
            if isinstance(op, (ReduceCopy, CopyFromSlot)):
                written[op.offset:op.offset + op.nbytes] += 1
        assert np.all(written == 1)  # data is only written with final values, once
        got = [op.nbytes for op in ops[s.next_rank] if isinstance(op, Recv)]
        assert got == [op.nbytes for op in sends]  # FIFO pairing by seq matches sizes
        # The partition helper predicts the message count without materializing ops.
        assert sum(p.hop_messages(s.rank, h) for p in s.partitions for h in range(2 * num_ranks - 2)) == len(sends)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_full_partitions_send_2n_minus_2_times_c_messages_and_2_n_minus_1_over_n_bytes(num_ranks):
    S, C, num_parts = 64, 3, 2
    nbytes = S * C * num_ranks * num_parts
    for s in ring(num_ranks, nbytes, 4, S, C):
        sends = [op for op in s.ops() if isinstance(op, Send)]
        assert len(sends) == (2 * num_ranks - 2) * C * num_parts
        assert sum(op.nbytes for op in sends) == 2 * (num_ranks - 1) * nbytes // num_ranks


def test_each_chunk_runs_the_documented_op_sequence_with_the_fused_step():
    n = 4
    s = schedule(n, 1, 4 * 64 * 2 * n, elem_size=4, chunk_bytes=64, num_chunks=2)
    kinds = {}
    for step in s.steps:
        kinds.setdefault(step.hop, set()).add(tuple(type(op) for op in step.ops))
        assert step.segment == (1 - step.hop) % n
        assert {op.slot for op in step.ops} == {2 * step.chunk + step.hop % 2}
    assert kinds == {
        0: {(CopyToSlot, Send)},
        1: {(Recv, Reduce, Send)}, 2: {(Recv, Reduce, Send)},
        3: {(Recv, ReduceCopy, Send)},  # last RS step: into data and the slot the first AG send uses
        4: {(Recv, CopyFromSlot, Send)}, 5: {(Recv, CopyFromSlot, Send)},
        6: {(Recv, CopyFromSlot)},
    }


@pytest.mark.parametrize("kwargs", [
    dict(num_ranks=0, rank=0, nbytes=8), dict(num_ranks=2, rank=2, nbytes=8), dict(num_ranks=2, rank=-1, nbytes=8),
    dict(num_ranks=2, rank=0, nbytes=6), dict(num_ranks=2, rank=0, nbytes=-4),
    dict(num_ranks=2, rank=0, nbytes=8, chunk_bytes=6), dict(num_ranks=2, rank=0, nbytes=8, num_chunks=0),
    dict(num_ranks=2, rank=0, nbytes=8, elem_size=0),
])
def test_bad_arguments_raise_value_error(kwargs):
    args = dict(elem_size=4, chunk_bytes=64, num_chunks=2) | kwargs
    with pytest.raises(ValueError):
        schedule(args.pop("num_ranks"), args.pop("rank"), args.pop("nbytes"), **args)


# ---- results --------------------------------------------------------------------------------

def awkward_counts(n):
    """Element counts: zero, one, below one chunk, not divisible by N, primes, several partitions."""
    return sorted({0, 1, n - 1, n + 1, 7, 13, 97, 1009, 3 * 16 * 3 * n + 5})


@pytest.mark.parametrize("num_ranks", range(2, 17))
def test_float32_all_reduce_equals_the_sum_for_awkward_sizes(num_ranks):
    for count in awkward_counts(num_ranks):
        check_all_reduce(num_ranks, count, DType.FLOAT32, seed=count)


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
@pytest.mark.parametrize("num_ranks", [2, 3, 5, 8, 13, 16])
def test_half_types_all_reduce_within_summation_tolerance(dtype, num_ranks):
    for count in (1, num_ranks + 1, 1009):
        check_all_reduce(num_ranks, count, dtype, chunk_bytes=48, num_chunks=2, seed=count)


@pytest.mark.parametrize("seed", range(4))
def test_result_does_not_depend_on_the_interleaving(seed):
    rnd = random.Random(seed)
    num_ranks, count = rnd.randint(2, 9), rnd.randint(1, 600)
    check_all_reduce(num_ranks, count, DType.FLOAT32, chunk_bytes=32, num_chunks=rnd.randint(1, 4),
                     rng=random.Random(seed), seed=seed)


def test_one_rank_and_empty_buffers_are_no_ops():
    a = np.arange(5, dtype=np.float32)
    execute(ring(1, a.nbytes), [a], dtype="float32")
    assert np.array_equal(a, np.arange(5, dtype=np.float32))
    execute(ring(3, 0), [np.zeros(0, np.float32)] * 3, dtype="float32")


def test_simulator_reports_mismatched_and_missing_messages():
    def arrays():
        return [np.ones(64, np.float32) for _ in range(3)]

    bad = ring(3, 256)
    steps = list(bad[1].steps)
    first_send = next(i for i, st in enumerate(steps) if isinstance(st.ops[-1], Send))
    ops = list(steps[first_send].ops)
    ops[-1] = replace(ops[-1], seq=ops[-1].seq + 1)
    steps[first_send] = replace(steps[first_send], ops=tuple(ops))
    with pytest.raises(SimulationError, match="expected seq"):
        execute([bad[0], replace(bad[1], steps=tuple(steps)), bad[2]], arrays(), dtype="float32")
    starved = ring(3, 256)
    with pytest.raises(SimulationError, match="deadlock"):
        execute([starved[0], replace(starved[1], steps=()), starved[2]], arrays(), dtype="float32")
