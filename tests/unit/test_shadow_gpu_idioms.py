"""The GPU idioms of a training script under the shadow loader, one test each: what a script asks torch for on
a GPU is answered on the host (shadow.cuda_tensors, shadow.cuda_dist) or by the torch.cuda shim's modeled
device (shadow.cuda_shim).
ci/gpu_host_check.sh runs this file with a real CUDA torch too, where nothing here may touch the GPU."""

from __future__ import annotations

import inspect

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
    # the stand-in inside, also under torch's own name for it; the real one is put back after
    assert dist.init_process_group is dist.distributed_c10d.init_process_group
    assert dist.init_process_group is not inspect.unwrap(dist.init_process_group)


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


# -- FSDP2 on a CUDA mesh, is_cuda, torch.accelerator, record_stream ------------------------------------------
def _blocks() -> "torch.nn.Module":
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _sharded_steps(torch, mesh, steps: int = 3) -> list[float]:
    """fully_shard each Linear, then the root, on `mesh`; train `steps` AdamW steps on CUDA batches."""
    from torch.distributed.fsdp import fully_shard

    model = _blocks().cuda()
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_cuda_mesh_of_a_replicas_ranks_is_a_one_rank_host_mesh_fsdp2_trains_on(gpu_host):
    torch = gpu_host
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("shard",))  # ci-small: replicas of 8 ranks
    assert mesh.device_type == "cpu" and mesh.size() == 1 and mesh.mesh_dim_names == ("shard",)
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert dist.init_device_mesh is init_device_mesh  # torch.distributed's name answers the same
    losses = _sharded_steps(torch, mesh)
    assert losses[-1] < losses[0]  # FSDP2's hooks ran the steps over the one rank
    from torch.distributed.fsdp import fully_shard

    model = _blocks().cuda()
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())


def test_an_hsdp_mesh_is_the_replicas_by_a_replicas_ranks_and_fsdp2_trains_on_it(gpu_host):
    torch = gpu_host
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cuda", (4, 8), mesh_dim_names=("replicate", "shard"))
    assert mesh.shape == (1, 1) and mesh["shard"].size() == 1 and mesh["replicate"].size() == 1
    losses = _sharded_steps(torch, mesh)
    assert losses[-1] < losses[0]
    model = _blocks().cuda()
    fully_shard(model, mesh=mesh)
    assert next(model.parameters()).placements == (Replicate(), Shard(0))


def test_the_context_destroys_the_group_a_cuda_mesh_made_on_exit():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as real

    with shadow.active(load_profile("ci-small")):
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cuda", (8,))
        assert dist.is_initialized()
    assert not dist.is_initialized()
    from torch.distributed.device_mesh import init_device_mesh

    assert init_device_mesh is real


@pytest.mark.parametrize("shape, match", [
    ((4,), r"4 replicas of 8 ranks.*use \(8,\)"), ((8, 4), r"use \(4, 8\)"), ((2, 8), r"use \(4, 8\)"),
    ((4, 2, 4), "3 dimensions"), ((0,), "int >= 1"), ((8.0,), "int >= 1")])
def test_a_cuda_mesh_that_is_not_the_profiles_layout_is_refused_by_name(gpu_host, shape, match):
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"init_device_mesh\('cuda', .*" + match):
        init_device_mesh("cuda", shape)
    import torch.distributed as dist

    assert not dist.is_initialized()  # nothing made for a refused mesh


def test_a_cuda_mesh_with_a_backend_override_is_refused_by_name(gpu_host):
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="backend_override.*leave backend_override out"):
        init_device_mesh("cuda", (8,), backend_override={0: "nccl"})


def test_without_a_profile_any_one_or_two_dimensional_cuda_mesh_is_one_rank_per_dimension():
    import torch.distributed as dist

    with shadow.active():
        from torch.distributed.device_mesh import init_device_mesh

        assert init_device_mesh("cuda:0", (3, 5), mesh_dim_names=("dp", "fsdp")).shape == (1, 1)
        with pytest.raises(ValueError, match="3 dimensions"):
            init_device_mesh("cuda", (1, 1, 1))
    assert not dist.is_initialized()


def test_a_cpu_mesh_goes_to_torch_as_it_is(gpu_host):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))  # not the profile's layout: torch decides, and accepts it
        assert mesh.device_type == "cpu" and mesh.size() == 1
    finally:
        dist.destroy_process_group()


def test_a_cuda_mesh_under_a_bigger_default_group_is_refused(gpu_host, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
        with pytest.raises(RuntimeError, match="one rank, but its default process group has 8"):
            init_device_mesh("cuda", (8,))
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_an_nccl_new_group_is_a_gloo_group_on_the_host(gpu_host):
    torch = gpu_host
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for group in (dist.new_group(backend="nccl"), dist.new_group([0], backend="cpu:gloo,cuda:nccl"),
                      dist.new_group(ranks=[0], backend="nccl", device_id=torch.device("cuda", 1))):
            assert dist.get_backend(group) == "gloo"
            t = torch.full((2,), 3.0, device="cuda")
            dist.all_reduce(t, group=group)
            assert torch.equal(t, torch.full((2,), 3.0))
    finally:
        dist.destroy_process_group()


def test_is_cuda_answers_the_script_for_the_tensors_it_made_for_a_gpu(gpu_host):
    torch = gpu_host
    host = torch.ones(2)
    on_gpu = torch.ones(2, device="cuda")
    assert on_gpu.is_cuda and not host.is_cuda and on_gpu.device.type == "cpu"
    assert torch.zeros(1, device=1).is_cuda and torch.randn(2, device="cuda:1").is_cuda
    assert (on_gpu * 2 + 1).is_cuda and on_gpu.sum().is_cuda and torch.zeros_like(on_gpu).is_cuda
    assert on_gpu.to(torch.float16).is_cuda and (on_gpu + host).is_cuda and not (host * 2).is_cuda
    moved = host.cuda()
    assert moved.is_cuda and not host.is_cuda and host.to("cuda").is_cuda and not host.is_cuda  # copies
    back = on_gpu.cpu()
    assert not back.is_cuda and not on_gpu.to("cpu").is_cuda and on_gpu.is_cuda
    back.add_(1)
    assert torch.equal(on_gpu, torch.ones(2))  # .cpu() of a GPU tensor is a copy, as on a GPU host
    assert not torch.ones(2, device="cpu").is_cuda and not torch.empty(1, device="meta").is_cuda
    buffer = torch.zeros(2)
    buffer.copy_(on_gpu, non_blocking=True)
    assert not buffer.is_cuda and torch.equal(buffer, on_gpu)  # in place: a host buffer stays on the host
    model = torch.nn.Linear(2, 2)
    assert not model.weight.is_cuda
    model.to("cuda")
    assert model.weight.is_cuda and model.bias.is_cuda and isinstance(model.weight, torch.nn.Parameter)
    with torch.device("cuda"):
        assert torch.nn.Linear(2, 2).weight.is_cuda and torch.arange(3).is_cuda
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2, device="cuda")).sum().backward()
    opt.step()
    assert opt.state[model.weight]["exp_avg"].is_cuda  # made by the optimizer from a GPU parameter
    assert model.weight.grad.is_cuda and model.bias.grad.is_cuda  # autograd's, noted as they are read
    host_model = torch.nn.Linear(2, 2)
    host_model(torch.ones(1, 2)).sum().backward()
    assert not host_model.weight.grad.is_cuda


def test_is_cuda_follows_set_default_device():
    import torch

    with shadow.active(load_profile("ci-small")):
        assert not torch.zeros(1).is_cuda
        torch.set_default_device("cuda")
        assert torch.zeros(1).is_cuda and torch.tensor([1.0]).is_cuda and torch.nn.Linear(1, 1).weight.is_cuda
        assert not torch.zeros(1, device="cpu").is_cuda
        torch.set_default_device("cpu")
        assert not torch.zeros(1).is_cuda
    assert torch.get_default_device().type == "cpu"


def test_is_cuda_asked_by_torchs_own_code_is_the_hosts_answer(gpu_host):
    torch = gpu_host
    x = torch.ones(2, device="cuda")
    as_torch = {"__name__": "torch.optim.optimizer", "x": x}  # code of a torch module
    assert x.is_cuda and eval("x.is_cuda", as_torch) is False


def test_torch_accelerator_answers_the_script_for_the_modeled_gpus(gpu_host):
    torch = gpu_host
    acc = torch.accelerator
    assert acc.is_available() and acc.current_accelerator() == torch.device("cuda")
    assert acc.current_accelerator(check_available=True).type == "cuda" and acc.device_count() == 2
    acc.set_device_index(1)
    assert acc.current_device_index() == 1 == torch.cuda.current_device()
    with acc.device_index(0):
        assert acc.current_device_index() == 0
    assert acc.current_device_index() == 1
    acc.synchronize()
    assert acc.current_stream() is torch.cuda.current_stream()
    if hasattr(acc, "memory_allocated"):
        assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0


def test_torch_accelerator_asked_by_torchs_own_code_is_the_real_builds_answer():
    """torch's own code (a DataLoader choosing where to pin) handles host tensors: it gets the answers of the
    torch that is installed (a CPU build: no accelerator; a CUDA one: its GPUs). Except, on a CUDA build, the
    device count: torch.accelerator.device_count() asks torch.get_device_module("cuda"), which inside the
    context is the shim (seen on an H200 with torch 2.11: 2 modeled GPUs, not the host's 1)."""
    import torch

    real = (torch.accelerator.is_available(), torch.accelerator.current_accelerator(), torch.accelerator.device_count())
    with shadow.active(load_profile("ci-small")):
        as_torch = {"__name__": "torch.utils.data.dataloader", "acc": torch.accelerator}  # code of a torch module
        expected = real if real[1] is None else (*real[:2], 2)
        assert eval("acc.is_available(), acc.current_accelerator(), acc.device_count()", as_torch) == expected
        assert torch.accelerator.device_count() == 2


def test_record_stream_on_the_shims_stream_records_nothing(gpu_host):
    torch = gpu_host
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2
    y.record_stream(side)
    x.record_stream(torch.cuda.current_stream())
    assert torch.equal(y, torch.full((4,), 2.0))


def test_the_mesh_and_accelerator_stand_ins_are_put_back_after():
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    real = (dist.new_group, dist.init_device_mesh, device_mesh.init_device_mesh, torch.accelerator.device_count,
            torch.accelerator.current_accelerator)
    with shadow.active():
        assert "record_stream" in vars(torch.Tensor) and dist.new_group is not real[0]
        assert torch.accelerator.device_count is not real[3]
    assert (dist.new_group, dist.init_device_mesh, device_mesh.init_device_mesh, torch.accelerator.device_count,
            torch.accelerator.current_accelerator) == real
    assert "record_stream" not in vars(torch.Tensor)  # torch's own, inherited, again


# -- torchrun-style scripts: the launcher's environment, fully_shard without a mesh, DeviceMesh built directly -----
def _launched(monkeypatch) -> None:
    """What a launcher sets for rank 3 of 32, with a store nothing listens on: a rendezvous through it would
    wait for 31 peers that never come."""
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "32"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "9")):
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("call", ["env", "init_method", "ranks"])
def test_a_torchrun_style_process_group_is_a_one_rank_group_on_the_host(gpu_host, monkeypatch, call):
    """init_process_group("nccl") reading RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (or an init_method, or
    the script's own rank and world_size) rendezvouses with no one: the script's process is the one rank it
    traces. The context destroys the group if the script does not."""
    torch = gpu_host
    import torch.distributed as dist

    _launched(monkeypatch)
    kwargs = {"env": {}, "init_method": {"init_method": "tcp://127.0.0.1:9"},
              "ranks": {"rank": 3, "world_size": 32}}[call]
    dist.init_process_group("nccl", **kwargs)
    assert dist.get_backend() == "gloo" and dist.get_rank() == 0 and dist.get_world_size() == 1
    torch.cuda.set_device(int(torch.cuda.device_count() - 1))  # LOCAL_RANK-style: a modeled GPU, no real one
    t = torch.full((2,), 5.0, device="cuda")
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 5.0))


def test_a_process_group_of_more_ranks_on_the_scripts_own_store_is_refused_by_name(gpu_host):
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"init_process_group\(store=\.\.\., world_size=8\).*one rank.*leave "
                                         r"store, rank and world_size out"):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=8)
    assert not dist.is_initialized()


def test_the_context_destroys_a_torchrun_style_group_the_script_left():
    import torch.distributed as dist

    with shadow.active(load_profile("ci-small"), environ={"RANK": "0", "WORLD_SIZE": "32", "MASTER_ADDR": "127.0.0.1",
                                                          "MASTER_PORT": "9"}):
        dist.init_process_group()
        assert dist.get_world_size() == 1
    assert not dist.is_initialized()


def test_a_stand_in_a_module_kept_past_the_context_calls_torchs_own(monkeypatch):
    """A module first imported inside the context keeps the stand-in it bound: outside, that is torch's function
    again (here: init_process_group's env:// rendezvous, refused without RANK)."""
    import torch.distributed as dist

    with shadow.active():
        kept = dist.init_process_group
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK expected"):
        kept("gloo")
    assert not dist.is_initialized()


@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
def test_fully_shard_without_a_mesh_shards_over_a_one_rank_host_mesh(gpu_host, monkeypatch, accelerator):
    """fully_shard(model) with no mesh=: FSDP2 makes the default group itself (torchrun-style, from the
    environment) and asks init_device_mesh for a mesh of the build's accelerator over it; on a CUDA build
    (accelerator "cuda", as on a GPU host) that is a host mesh too. The model trains on it."""
    torch = gpu_host
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    _launched(monkeypatch)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device(accelerator))
    model = _blocks().cuda()
    for unit in (model[0], model[2]):
        fully_shard(unit)
    fully_shard(model)
    assert dist.is_initialized() and dist.get_world_size() == 1
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.device_type == "cpu"
        assert p.device_mesh.size() == 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_fully_shard_without_a_mesh_reaches_the_stand_ins_without_importing_fsdp2_on_entry():
    """The context imports no FSDP2 (about a second per emulate): a fresh process that enters it has not loaded
    torch.distributed.fsdp or torch.distributed.tensor, and a fully_shard(model) after that still works."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys, torch, shadow
from harness.profile import load_profile
with shadow.active(load_profile("ci-small"), environ={"RANK": "0", "WORLD_SIZE": "32", "MASTER_ADDR": "127.0.0.1",
                                                      "MASTER_PORT": "9", "LOCAL_RANK": "0"}):
    loaded = [m for m in ("torch.distributed.fsdp", "torch.distributed.tensor") if m in sys.modules]
    from torch.distributed.fsdp import fully_shard
    model = torch.nn.Linear(4, 2).cuda()
    fully_shard(model)
    print(loaded, type(model.weight).__name__, model.weight.device_mesh.device_type)
"""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "DTensor", "cpu"]


@pytest.mark.parametrize("ranks, names, shape", [
    (lambda t: t.arange(8), ("shard",), (1,)),
    (lambda t: list(range(8)), None, (1,)),
    (lambda t: t.arange(32).view(4, 8), ("replicate", "shard"), (1, 1))])
def test_a_device_mesh_built_directly_on_cuda_is_a_one_rank_host_mesh_fsdp2_trains_on(gpu_host, ranks, names, shape):
    torch = gpu_host
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cuda", ranks(torch), mesh_dim_names=names)
    assert isinstance(mesh, DeviceMesh) and mesh.device_type == "cpu" and mesh.shape == shape
    assert mesh.mesh_dim_names == names and dist.get_world_size() == 1
    losses = _sharded_steps(torch, mesh)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("ranks, match", [
    (lambda t: t.arange(4), r"<a mesh of shape \(4,\)>\) under the shadow loader.*use \(8,\)"),
    (lambda t: t.arange(8).view(2, 4), r"use \(4, 8\)"),
    (lambda t: t.arange(32).view(2, 4, 4), "3 dimensions"),
    (lambda t: [0], r"use \(8,\).*get_world_size\(\) is 1")])
def test_a_device_mesh_that_is_not_the_profiles_layout_is_refused_by_name(gpu_host, ranks, match):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    with pytest.raises(ValueError, match=r"DeviceMesh\('cuda', .*" + match):
        DeviceMesh("cuda", ranks(gpu_host))
    assert not dist.is_initialized()


def test_a_device_mesh_built_directly_with_a_backend_override_is_refused_by_name(gpu_host):
    from torch.distributed.device_mesh import DeviceMesh

    with pytest.raises(ValueError, match=r"DeviceMesh\('cuda'.*backend_override.*leave backend_override out"):
        DeviceMesh("cuda", gpu_host.arange(8), backend_override=(("nccl", None),))


def test_a_cuda_mesh_sized_by_the_one_rank_world_is_refused_with_the_reason(gpu_host):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl")
    with pytest.raises(ValueError, match=r"init_device_mesh\('cuda', \(1,\)\).*use \(8,\).*get_world_size\(\) is 1"):
        init_device_mesh("cuda", (dist.get_world_size(),))


def test_the_torchrun_and_device_mesh_stand_ins_are_put_back_after():
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    real = (dist.distributed_c10d.init_process_group, device_mesh.init_process_group,
            device_mesh.DeviceMesh.__init__)
    with shadow.active():
        assert (dist.distributed_c10d.init_process_group, device_mesh.init_process_group,
                device_mesh.DeviceMesh.__init__) != real
    assert (dist.distributed_c10d.init_process_group, device_mesh.init_process_group,
            device_mesh.DeviceMesh.__init__) == real
