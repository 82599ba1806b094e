"""ftrun.train.fingerprint and param_hash: equal bytes give equal fingerprints, any changed bit a different one."""

from __future__ import annotations

import torch

from ftrun.train.events import param_hash
from ftrun.train.fingerprint import fingerprint, tensor_bytes


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def test_param_hash_is_equal_for_equal_parameters_and_sees_one_flipped_bit():
    a, b = model(), model()
    assert param_hash(a) == param_hash(b)
    assert len(param_hash(a)) == 32  # 128 bits
    with torch.no_grad():
        bits = b[2].bias.view(torch.int32)
        bits[1] ^= 1  # the lowest mantissa bit of one parameter
    assert param_hash(a) != param_hash(b)


def test_tensor_bytes_reads_contiguous_tensors_in_place_and_handles_odd_ones():
    t = torch.arange(12, dtype=torch.float32)
    view = tensor_bytes(t)
    assert view.dtype.name == "uint8" and view.nbytes == 48
    t[0] = 5.0  # a view, not a copy
    assert bytes(view[:4]) == torch.tensor([5.0]).numpy().tobytes()
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous: copied in order
    assert bytes(tensor_bytes(strided)) == strided.contiguous().numpy().tobytes()
    assert tensor_bytes(torch.zeros(0, 4)).nbytes == 0
    assert tensor_bytes(torch.tensor(2.5, dtype=torch.bfloat16)).nbytes == 2
    assert tensor_bytes(torch.tensor([True, False])).tolist() == [1, 0]


def test_fingerprint_prefix_and_order_matter():
    x, y = torch.ones(4), torch.zeros(4)

    def digest(prefix: bytes, *ts: torch.Tensor) -> str:
        h = fingerprint(prefix)
        for t in ts:
            h.update(tensor_bytes(t))
        return h.hexdigest()

    assert digest(b"a", x, y) == digest(b"a", x, y)
    assert digest(b"a", x, y) != digest(b"b", x, y)
    assert digest(b"a", x, y) != digest(b"a", y, x)
