"""The GPU idioms of a training script under the shadow loader, one test each: what a script asks torch for on
a GPU is answered on the host (shadow.cuda_tensors) or by the torch.cuda shim's modeled device (shadow.cuda_shim).
ci/gpu_host_check.sh runs this file with a real CUDA torch too, where nothing here may touch the GPU."""

from __future__ import annotations

import pytest

import shadow
from harness.profile import load_profile

@pytest.fixture
def gpu_host():
    """Inside shadow.active at ci-small (2 GPUs per host); afterwards the real torch.cuda was not
    initialized by anything the test did (on a CUDA build: nothing touched the GPU)."""
    import torch

    real_cuda = torch.cuda
    was_initialized = real_cuda.is_initialized()
    with shadow.active(load_profile("ci-small")):
        yield torch
    assert torch.cuda is real_cuda and (was_initialized or not real_cuda.is_initialized())


def test_a_torch_device_cuda_context_makes_host_tensors(gpu_host):
    torch = gpu_host
    with torch.device("cuda"):
        assert torch.zeros(2).device.type == "cpu" and torch.nn.Linear(2, 2).weight.device.type == "cpu"
        assert torch.randn(2).device.type == "cpu" and torch.get_default_device().type == "cpu"
        with torch.device("meta"):  # a model built on meta inside it stays there
            assert torch.nn.Linear(2, 2).weight.is_meta
    with torch.device("cuda:1"):
        assert torch.arange(3).device.type == "cpu" and torch.get_default_device() == torch.device("cuda", 1)


def test_set_default_device_cuda_makes_host_tensors_and_exit_puts_the_default_back():
    import torch

    torch.set_default_device("meta")  # the default found on entry
    try:
        with shadow.active(load_profile("ci-small")):
            torch.set_default_device("cuda")
            assert torch.zeros(2).device.type == "cpu" and torch.nn.Linear(2, 2).weight.device.type == "cpu"
            assert torch.get_default_device().type == "cpu"
            with torch.device("meta"):
                assert torch.nn.Linear(2, 2).weight.is_meta
            torch.set_default_device(torch.device("cuda", 1))
            assert torch.ones(1).device.type == "cpu"
        assert torch.zeros(1).is_meta and torch.set_default_device.__module__ == "torch"
    finally:
        torch.set_default_device(None)
    with shadow.active():
        torch.set_default_device("cuda:0")
    assert torch.get_default_device().type == "cpu" and torch.zeros(1).device.type == "cpu"


def test_a_generator_for_a_gpu_is_a_host_generator_that_isinstance_still_accepts(gpu_host):
    torch = gpu_host
    real_generator = type(torch.default_generator)
    g = torch.Generator(device="cuda").manual_seed(1)
    assert g.device.type == "cpu" and torch.Generator("cuda:1").device.type == "cpu"
    a = torch.randn(3, generator=g, device="cuda")
    assert torch.equal(a, torch.randn(3, generator=torch.Generator(device=torch.device("cuda")).manual_seed(1)))
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert isinstance(g, real_generator) and torch.Generator is not real_generator
    loader = torch.utils.data.DataLoader(range(4), shuffle=True, generator=g)  # torch's own checks accept it
    assert sorted(int(x) for x in loader) == [0, 1, 2, 3]


def test_new_and_like_of_a_meta_tensor_for_a_gpu_stay_on_meta(gpu_host):
    torch = gpu_host
    m = torch.empty(3, 2, device="meta")
    for t in (m.new_zeros(2, device="cuda"), m.new_empty((2, 2), device="cuda:1"), m.new_ones(2, device=0),
              m.new_full((2,), 7.0, device="cuda"), torch.zeros_like(m, device="cuda"),
              torch.empty_like(m, device=torch.device("cuda", 1)), torch.randn_like(m, device="cuda")):
        assert t.is_meta
    host = torch.ones(2)
    assert host.new_zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones_like(host, device="cuda").device.type == "cpu"


def test_cuda_seeding_seeds_the_gpus_generators_and_leaves_the_hosts_alone(gpu_host):
    torch = gpu_host
    torch.cuda.manual_seed(3)
    host_state = torch.get_rng_state()
    a = torch.randn(4, device="cuda")
    assert torch.equal(torch.get_rng_state(), host_state)  # the GPU's draws are not the host's
    torch.cuda.manual_seed(3)
    assert torch.equal(torch.randn(4, device="cuda"), a) and torch.cuda.initial_seed() == 3
    torch.cuda.manual_seed_all(5)
    with torch.cuda.device(1):
        on_1 = torch.randint(0, 1000, (8,), device="cuda")
    assert torch.equal(torch.randint(0, 1000, (8,), device="cuda:0"), on_1)  # same seed on both
    torch.manual_seed(7)  # seeds every device, as on a GPU host
    assert torch.cuda.initial_seed() == 7 and torch.cuda.default_generators[1].initial_seed() == 7
    state = torch.cuda.get_rng_state()
    b = torch.rand(2, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(2, device="cuda"), b)
    states = torch.cuda.get_rng_state_all()
    assert len(states) == 2
    with torch.random.fork_rng(devices=range(2), device_type="cuda"):
        torch.randperm(5, device="cuda")
    assert all(torch.equal(x, y) for x, y in zip(torch.cuda.get_rng_state_all(), states))
    with pytest.raises(RuntimeError, match="invalid device ordinal 2"):
        torch.randn(1, device="cuda:2")


def test_autocast_for_cuda_enters_and_leaves_host_tensors_in_their_dtype(gpu_host):
    import warnings

    torch = gpu_host
    assert torch.cuda.is_bf16_supported()
    x = torch.ones(2, 2, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert (x @ x).dtype == torch.float32  # host tensors: CUDA autocast does not cast them
    with torch.amp.autocast(device_type="cuda", dtype=torch.float16):
        assert torch.is_autocast_enabled("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated in favour of the above
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cuda")
    assert not torch.is_autocast_enabled("cuda")


def test_a_grad_scaler_for_cuda_steps_a_host_model(gpu_host):
    import warnings

    torch = gpu_host
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scalers = [torch.amp.GradScaler("cuda"), torch.cuda.amp.GradScaler(init_scale=1024.0)]
    for scaler in scalers:
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.ones(2, 4, device="cuda")).pow(2).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert scaler.is_enabled() and not torch.equal(model.weight, before)  # the step was applied
    assert scalers[1].get_scale() == 1024.0


def test_cuda_event_timing_is_the_devices_zero_and_needs_recorded_timing_events(gpu_host):
    torch = gpu_host
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record()
    torch.ones(2, device="cuda").sum()
    end.record(torch.cuda.current_stream())
    end.synchronize()
    assert start.elapsed_time(end) == 0.0  # the shim's device does no work: it takes no time
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)


def test_memory_figures_are_the_modeled_devices(gpu_host):
    torch = gpu_host
    torch.ones(1000, device="cuda")  # a host tensor: nothing is allocated on the modeled device
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    assert torch.cuda.max_memory_allocated() == 0 and torch.cuda.max_memory_allocated(1) == 0
    assert torch.cuda.memory_reserved() == torch.cuda.max_memory_reserved() == 0
    total = torch.cuda.get_device_properties(0).total_memory
    assert total == 80 * 1024**3 and torch.cuda.mem_get_info(1) == (total, total)
    assert torch.cuda.get_device_properties(torch.device("cuda", 1)).total_memory == total


def test_backend_flags_for_cuda_are_set_as_on_a_gpu_host(gpu_host):
    torch = gpu_host
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
        x = torch.ones(2, 2, device="cuda")
        assert torch.equal(x @ x, torch.full((2, 2), 2.0))
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved[:3]
        torch.set_float32_matmul_precision(saved[3])


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")  # a CPU build of torch
def test_pinned_memory_and_non_blocking_copies_are_host_copies(gpu_host):
    torch = gpu_host
    src = torch.arange(4.0).pin_memory()
    dst = torch.empty(4, device="cuda")
    dst.copy_(src, non_blocking=True)
    assert torch.equal(dst, src) and src.to("cuda:1", non_blocking=True).device.type == "cpu"
    loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=3, pin_memory=True)
    assert [b.to("cuda", non_blocking=True).tolist() for b in loader] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_a_cuda_device_context_selects_the_device_by_index_string_or_device(gpu_host):
    torch = gpu_host
    for dev in (1, "cuda:1", torch.device("cuda", 1)):
        with torch.cuda.device(dev):
            assert torch.cuda.current_device() == 1 and torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.cuda.current_device() == 0
    torch.cuda.set_device("cuda:1")
    assert torch.cuda.current_device() == 1
    with pytest.raises(ValueError, match="expected a cuda device"):
        torch.cuda.set_device("cpu")


def test_device_properties_answer_for_every_modeled_gpu(gpu_host):
    torch = gpu_host
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        assert props.total_memory == 80 * 1024**3 and (props.major, props.minor) == (9, 0)
        assert torch.cuda.get_device_name(i) == props.name and torch.cuda.get_device_capability(i) == (9, 0)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.get_device_properties(2)


def test_an_nccl_process_group_bound_to_a_gpu_is_a_gloo_group_on_the_host(gpu_host):
    torch = gpu_host
    import torch.distributed as dist

    real_init = dist.distributed_c10d.init_process_group
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 1))
        try:
            assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
            t = torch.ones(3, device="cuda")
            dist.all_reduce(t)
            assert torch.equal(t, torch.ones(3))
        finally:
            dist.destroy_process_group()
    assert dist.init_process_group is not real_init  # the stand-in inside; the real one is put back after


def test_nvtx_ranges_nest_with_nothing_to_record_them(gpu_host):
    torch = gpu_host
    nvtx = torch.cuda.nvtx
    assert nvtx.range_push("step") == 0 and nvtx.range_push("forward") == 1
    assert nvtx.range_pop() == 1 and nvtx.range_pop() == 0 and nvtx.range_pop() == -1
    with nvtx.range("step {}", 3):
        nvtx.mark("here")
    nvtx.range_end(nvtx.range_start("io"))


def test_the_stand_ins_are_put_back_after():
    import torch
    import torch.distributed as dist

    real = (torch.Generator, torch.set_default_device, dist.init_process_group)
    with shadow.active():
        assert (torch.Generator, torch.set_default_device, dist.init_process_group) != real
    assert (torch.Generator, torch.set_default_device, dist.init_process_group) == real


def test_torchs_device_module_lookup_answers_the_shim_inside_and_the_real_module_after():
    """torch.get_device_module caches its answers (torch 2.13): fork_rng & co. must not keep the torch.cuda
    found before the context (a real GPU) or inside it (the shim)."""
    import torch

    real_cuda = torch.get_device_module("cuda")
    with shadow.active(load_profile("ci-small")):
        assert torch.get_device_module("cuda") is torch.cuda is not real_cuda
        with torch.random.fork_rng(devices=[1], device_type="cuda"):  # the shim's generators, no GPU
            torch.cuda.manual_seed_all(1)
    assert torch.get_device_module("cuda") is real_cuda is torch.cuda
