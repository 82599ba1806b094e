"""The shadow loader: GPU modules import as their mocks inside the context, everything is restored after;
the torch.cuda shim; the registry's contract (each mock exposes its real module's public API)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest

import shadow
from harness.profile import load_profile
from shadow.contract import api_mismatches, signature_problems
from shadow.registry import Registry, load_registry

REAL = "ftrun.ftar.cuda_kernels"


def test_import_hook_maps_registered_modules_inside_the_context_and_restores_after():
    import ftrun.ftar
    import ftrun.ftar.cuda_kernels as real

    with shadow.active(load_profile("ci-small")):
        import ftrun.ftar.cuda_kernels as inside
        from ftrun.ftar.cuda_kernels import CudaKernels

        assert inside is not real and inside.__shadow_of__ == "mocks.ftar_kernels"
        assert inside.__name__ == REAL and sys.modules[REAL] is inside and ftrun.ftar.cuda_kernels is inside
        k = CudaKernels()  # no GPU, no library: the mock models time instead
        assert k.computes_values is False
        assert k.reduce(0, 0, 0, 0, 1 << 20, "bf16") > 0
        assert inside.is_available() is True
    assert sys.modules[REAL] is real and ftrun.ftar.cuda_kernels is real
    assert importlib.import_module(REAL) is real


def test_a_module_first_imported_inside_is_dropped_after(monkeypatch):
    import ftrun.ftar

    monkeypatch.delitem(sys.modules, REAL, raising=False)
    monkeypatch.delattr(ftrun.ftar, "cuda_kernels", raising=False)
    with shadow.active():
        mod = importlib.import_module(REAL)
        assert mod.__shadow_of__ == "mocks.ftar_kernels"
    assert REAL not in sys.modules and not hasattr(ftrun.ftar, "cuda_kernels")
    assert not hasattr(importlib.import_module(REAL), "__shadow_of__")  # the real one imports again


def test_the_mock_module_itself_is_left_untouched():
    import mocks.ftar_kernels as mock

    with shadow.active():
        shadowed = importlib.import_module(REAL)
    assert shadowed is not mock and mock.__name__ == "mocks.ftar_kernels"
    assert mock.CudaKernels.__module__ == "mocks.ftar_kernels"


def test_torch_cuda_shim_inside_only():
    import torch

    real_cuda = torch.cuda
    with shadow.active(load_profile("ci-small")):  # 2 GPUs per host
        cuda = torch.cuda
        assert cuda is not real_cuda and sys.modules["torch.cuda"] is cuda
        assert cuda.is_available() and cuda.device_count() == 2 and cuda.current_device() == 0
        cuda.set_device(1)
        assert cuda.current_device() == 1
        with cuda.device(0):
            assert cuda.current_device() == 0
        with pytest.raises(RuntimeError):
            cuda.set_device(2)
        s = cuda.Stream()
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        with cuda.stream(s):
            start.record()
            end.record()
        s.synchronize()
        cuda.synchronize()
        assert end.query() and start.elapsed_time(end) == 0.0
        assert cuda.memory_allocated() == 0 and cuda.max_memory_allocated() == 0
        free, total = cuda.mem_get_info()
        assert free == total > 0 and cuda.get_device_properties(0).total_memory == total
        torch.manual_seed(0)  # torch itself reaches into torch.cuda's private helpers
        with pytest.raises(AttributeError, match="shim"):
            cuda.graphs_are_magic  # noqa: B018  a public name the shim does not provide
    assert torch.cuda is real_cuda and sys.modules["torch.cuda"] is real_cuda


def test_tensors_for_a_gpu_are_made_on_the_host_inside_only():
    import torch

    with shadow.active(load_profile("ci-small")):
        model = torch.nn.Linear(2, 3).to("cuda")
        assert model.weight.device.type == "cpu" and model.cuda(1).bias.device.type == "cpu"
        x = torch.zeros(3, device="cuda:1", pin_memory=True)
        assert x.device.type == "cpu" and not x.is_pinned() and x.pin_memory() is x
        assert torch.ones(2).to("cuda", non_blocking=True).device.type == "cpu"
        assert torch.ones(2).to(device=torch.device("cuda", 1)).device.type == "cpu"
        assert torch.ones(2).to(0).device.type == "cpu" and torch.full((2,), 1.0, device=0).device.type == "cpu"
        half = torch.ones(2).to(torch.device("cuda", 1), torch.float16)
        assert half.dtype == torch.float16 and half.device.type == "cpu"
        assert torch.randn_like(torch.ones(2), device="cuda").device.type == "cpu"
        assert torch.ones(2).to("meta").is_meta and torch.ones(2).to(torch.float64).dtype == torch.float64
        with torch.device("meta"):  # a model built on meta (mocks.script.meta_model) stays there
            assert torch.nn.Linear(2, 2).to("cuda").weight.is_meta
        assert torch.empty(2, device="meta").cuda().is_meta
    if not torch.cuda.is_available():  # after the context a CUDA tensor needs a GPU again
        with pytest.raises((AssertionError, RuntimeError)):
            torch.ones(1).to("cuda")


def test_the_device_seam_runs_unchanged_under_the_shim():
    """ftrun.train.device, as a rank of a script run with FTConfig.device="cuda" calls it: its GPU (ci-small's
    hosts have 2), the current device, a pinned host buffer, synchronize and batches moved."""
    import numpy as np
    import torch

    from ftrun.train.device import host_buffer, rank_device, synchronize, to_device

    with shadow.active(load_profile("ci-small")):
        device = rank_device("cuda", slot=3)
        assert device == torch.device("cuda", 1) and torch.cuda.current_device() == 1
        assert rank_device("cuda:0", slot=3) == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        buf = host_buffer(4, device)
        assert isinstance(buf, np.ndarray) and buf.dtype == np.float32 and not buf.any()
        synchronize(device)
        batch = to_device({"x": torch.ones(2), "y": [torch.zeros(1)]}, device)
        assert batch["x"].device.type == "cpu" and batch["y"][0].device.type == "cpu"
        with pytest.raises(ValueError, match="torch sees 2 CUDA GPU"):
            rank_device("cuda:2", slot=0)


def test_contexts_do_not_nest_and_a_failing_body_still_restores():
    import torch

    real_cuda = torch.cuda
    with pytest.raises(ValueError, match="boom"):
        with shadow.active():
            assert shadow.is_active()
            with pytest.raises(RuntimeError, match="nest"):
                with shadow.active():
                    pass
            raise ValueError("boom")
    assert not shadow.is_active() and torch.cuda is real_cuda
    assert not hasattr(sys.modules[REAL], "__shadow_of__") if REAL in sys.modules else True


def test_unmodified_training_code_runs_under_it(tmp_path, monkeypatch):
    """A 'GPU' training module, written against torch.cuda and the CUDA kernels, imported inside."""
    (tmp_path / "gpu_train_step.py").write_text(
        "import torch\n"
        "from ftrun.ftar.cuda_kernels import CudaKernels\n"
        "def run():\n"
        "    assert torch.cuda.is_available(), 'needs a GPU'\n"
        "    torch.cuda.set_device(torch.cuda.device_count() - 1)\n"
        "    k = CudaKernels(blocks=2, threads=512)\n"
        "    seconds = k.reduce(0, 0, 0, 0, 64 << 20, 'bf16') + k.synchronize()\n"
        "    torch.cuda.synchronize()\n"
        "    return seconds\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with shadow.active(load_profile("meta-98k")):
        mod = importlib.import_module("gpu_train_step")
        assert mod.run() == pytest.approx(5e-6 + (64 << 20) / 79.4e9)  # the mock's measured 2-block rate
    sys.modules.pop("gpu_train_step", None)


# -- the registry's contract --------------------------------------------------------------------

def test_every_registered_mock_exposes_its_real_modules_public_api():
    registry = load_registry()
    assert registry.modules, "the registry is empty"
    for real_name, mock_name in registry.modules.items():
        real, mock = importlib.import_module(real_name), importlib.import_module(mock_name)
        assert api_mismatches(real, mock) == [], f"{mock_name} cannot stand in for {real_name}"


def test_planned_entries_name_modules_that_do_not_exist_yet():
    registry = load_registry()
    for real_name, mock_name in registry.planned.items():
        assert importlib.util.find_spec(real_name) is None, (
            f"{real_name} exists now: move it from [planned] to [modules] in mocks/shadow_registry.toml")
        assert importlib.util.find_spec(mock_name) is not None, f"planned mock {mock_name} is missing"


def test_the_contract_check_catches_mismatches():
    real, mock = types.ModuleType("real_mod"), types.ModuleType("mock_mod")
    exec("__all__ = ['f', 'K', 'N', 'E']\n"
         "def f(a, b=1, *, c=2): pass\n"
         "class E(Exception): pass\n"
         "class K:\n"
         "    def __init__(self, *, x=1): pass\n"
         "    def go(self, n): pass\n"
         "N = 3\n", real.__dict__)
    exec("def f(a, b, *, c=2, d): pass\n"
         "class E(Exception): pass\n"
         "class K:\n"
         "    def __init__(self, *, x=1, extra=None): pass\n"
         "N = 4\n", mock.__dict__)
    problems = "\n".join(api_mismatches(real, mock))
    assert "'b' is optional in the real one" in problems
    assert "extra parameter 'd'" in problems
    assert "lacks method 'go'" in problems
    assert "N = 4" in problems
    assert "not (a subclass of) the real exception" in problems
    assert "extra" not in problems.replace("extra parameter 'd'", "")  # defaulted extras are fine
    assert signature_problems("g", lambda a, *, b=1: 0, lambda a, b=1, **kw: 0) == []


def test_registry_rejects_malformed_entries(tmp_path):
    with pytest.raises(ValueError, match="dotted"):
        Registry(modules={"ftrun.x": "not a module"})
    with pytest.raises(ValueError, match="itself"):
        Registry(modules={"a.b": "a.b"})
    bad = tmp_path / "r.toml"
    bad.write_text('[modules]\n"a.b" = "c.d"\n[extra]\n')
    with pytest.raises(ValueError, match="unknown table"):
        load_registry(bad)


def test_the_shim_answers_torch_internals_but_not_training_code_for_names_it_lacks():
    import torch

    from shadow.cuda_shim import make_cuda_shim

    shim = make_cuda_shim(device_count=2, real=torch.cuda)
    with pytest.raises(AttributeError, match="shadow loader's torch.cuda shim"):
        shim.set_stream  # noqa: B018  training code asking for something the shim does not model
    internal = types.ModuleType("torch._fake_internal")
    exec("def get(m):\n    return m.set_stream\n", internal.__dict__)
    assert internal.get(shim) is torch.cuda.set_stream  # torch's own tables (e.g. dynamo's) get the real one
    assert shim.synchronize is not shim.empty_cache and shim.manual_seed is not shim.seed  # one object per name


def test_environ_is_set_for_the_block_and_put_back_after(monkeypatch):
    import os

    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match="boom"):
        with shadow.active(cuda_shim=False, environ={"RANK": "0", "LOCAL_RANK": "0"}):
            assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("0", "0")
            raise ValueError("boom")
    assert os.environ["RANK"] == "5" and "LOCAL_RANK" not in os.environ


@pytest.mark.parametrize("environ", [{"RANK": 0}, {"": "1"}, {1: "1"}])
def test_environ_that_is_not_strings_is_refused_by_name(environ):
    with pytest.raises(ValueError, match=r"environ=.*must be strings"):
        with shadow.active(cuda_shim=False, environ=environ):
            pass
    assert not shadow.is_active()


def test_the_launcher_environ_of_an_emulated_script_is_ftrun_launchs_for_the_rank_it_traces():
    """`ftrun emulate` gives the script's process what `ftrun launch` sets for replica r0's rank 0, the rank its
    job.spec says it is (mocks.train_api.traced_rank), and nothing of the job's secrets or paths."""
    from dataclasses import replace
    from types import SimpleNamespace

    from ftrun.launch.worker_env import WorkerSpec
    from mocks.train_api import launcher_environ, traced_rank

    session = SimpleNamespace(replicas=4, ranks_per_replica=8, steps=20)
    environ = launcher_environ(session)
    assert {k: environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "FTRUN_MAX_STEPS")} == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "32",
                                                            "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
                                                            "FTRUN_MAX_STEPS": "20"}
    assert not {"FTRUN_TOKEN", "FTRUN_LIGHTHOUSE", "FTRUN_RUN_DIR"} & set(environ)
    # read back as a launched rank reads it, it is the spec the script's job has
    spec = WorkerSpec.from_environ({**environ, "FTRUN_TOKEN": "t", "FTRUN_LIGHTHOUSE": "emulated"})
    assert spec == replace(traced_rank(session), token="t", run_dir=".")
