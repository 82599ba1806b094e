"""FTConfig.device: the pure device choice, its errors, and what the CPU path of the pieces that move
tensors does (tests/gpu/test_gpu_train.py runs the CUDA path)."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch

from ftrun.train.api import FTConfig, init_from_env
from ftrun.train.device import check_device_name, host_buffer, resolve_device, synchronize, to_device
from ftrun.train.grads import FlatGrads


@pytest.mark.parametrize("name, slot, count, want", [
    ("cpu", 3, 0, "cpu"), ("cpu", 0, 8, "cpu"),
    ("cuda", 0, 1, "cuda:0"), ("cuda", 2, 1, "cuda:0"), ("cuda", 5, 4, "cuda:1"), ("cuda", 3, 8, "cuda:3"),
    ("cuda:0", 7, 1, "cuda:0"), ("cuda:3", 0, 4, "cuda:3"),
])
def test_resolve_device(name, slot, count, want):
    assert resolve_device(name, slot=slot, device_count=count) == torch.device(want)


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:01", "cuda:x", "cpu:0", " cpu", "", None, 0,
                                 "mps"])
def test_bad_device_names_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="FTConfig.device must be 'cpu', 'cuda' or 'cuda:N', got " + repr(bad).replace(
            "(", r"\(")):
        check_device_name(bad)
    with pytest.raises(ValueError, match="FTConfig.device"):
        FTConfig(device=bad)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:2"])
def test_a_cuda_device_without_a_gpu_is_refused(name):
    with pytest.raises(ValueError, match=rf"FTConfig.device='{name}' but torch sees no CUDA GPU"):
        resolve_device(name, slot=0, device_count=0)


def test_a_gpu_index_beyond_the_hosts_gpus_is_refused():
    with pytest.raises(ValueError, match=r"FTConfig.device='cuda:2' but torch sees 2 CUDA GPU\(s\) \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2", slot=0, device_count=2)
    with pytest.raises(ValueError, match="host slot -1"):
        resolve_device("cuda", slot=-1, device_count=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
@pytest.mark.timeout(30)
def test_init_from_env_with_cuda_and_no_gpu_raises_the_clear_error(tmp_path):
    with pytest.raises(ValueError, match="FTConfig.device='cuda' but torch sees no CUDA GPU"):
        init_from_env(FTConfig(device="cuda", run_dir=str(tmp_path), num_threads=None))


def test_the_cpu_host_buffer_is_plain_numpy_and_synchronize_is_a_no_op():
    buf = host_buffer(5, torch.device("cpu"))
    assert buf.dtype == np.float32 and buf.flags.c_contiguous and not buf.any() and buf.shape == (5,)
    synchronize(torch.device("cpu"))


def test_to_device_moves_nested_batches_and_keeps_their_types():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)], "p": Pair(torch.ones(1), "s")}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][0].is_meta and moved["b"][1][1] == 3
    assert isinstance(moved["b"], list) and isinstance(moved["b"][1], tuple)
    assert isinstance(moved["p"], Pair) and moved["p"].x.is_meta and moved["p"].y == "s"
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t  # the CPU path copies nothing


def test_flat_grads_needs_one_device():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert FlatGrads(model.parameters()).device == torch.device("cpu")
    model[1].to("meta")
    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        FlatGrads(model.parameters())


@pytest.mark.timeout(30)
def test_wrap_refuses_a_model_that_is_not_on_the_jobs_device(tmp_path):
    model = torch.nn.Linear(2, 1, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with init_from_env(FTConfig(run_dir=str(tmp_path), num_threads=None)) as job:
        assert job.device == torch.device("cpu")
        with pytest.raises(ValueError, match=r"wrap: the model has parameters on \['meta'\], FTConfig.device is 'cpu'"):
            job.wrap(model, opt)
