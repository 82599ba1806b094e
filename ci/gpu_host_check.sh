#!/usr/bin/env bash
# The host-slot GPU choice and `ftrun emulate SCRIPT --script-args "--device cuda"` on a machine with a real
# CUDA torch (about 2 minutes on a 16-core H100/H200 host): the unit tests of the slot choice and of the
# shadow loader's GPU tensors and a script's GPU idioms (there torch.cuda really exists, so the shim and the
# host-tensor mode must still keep everything off the GPU), every example emulated with --device cpu and cuda
# and tests/integration/gpu_user_loop.py and fsdp2_mesh_loop.py (its own CUDA mesh) with --device cuda,
# torchrun_fsdp2_loop.py (init_process_group("nccl") from the environment, fully_shard without a mesh and on a
# DeviceMesh("cuda", ...) built directly: on a CUDA build FSDP2 asks for a CUDA default mesh), and the two GPU
# launch tests (3 replicas x 1 rank, one killed and restarted: replica i on cuda:{i % GPUs}). Extra packages
# (faker) come from the caller's PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
uptime
timeout 120 python3 -m pytest -q tests/unit/test_worker_env.py tests/unit/test_device.py tests/unit/test_shadow.py \
  tests/unit/test_shadow_gpu_idioms.py
echo "unit rc=$?"
timeout 200 python3 -m pytest -q tests/integration/test_examples_shadow.py -k rejoins
echo "examples under the shadow loader rc=$?"
timeout 300 python3 -m pytest -q -rs tests/gpu/test_gpu_train.py -k three_replicas --durations=3
echo "gpu launch rc=$?"
