#!/usr/bin/env bash
# Training on a CUDA GPU (FTConfig.device): tests/gpu/test_gpu_train.py, then the step time of
# examples/train_llama_tiny.py under `ftrun launch` (3 replicas x 1 rank, no kills) with --device cuda
# (replica i on cuda:{i % GPUs}: all three on cuda:0 with one GPU) against --device cpu (one torch thread
# per rank), same model and seed.
# About 3 minutes on a 16-core H100/H200 host. Extra packages (faker) come from the caller's PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else "(no GPU)")'
uptime

timeout 300 python3 -m pytest -q -s -rs tests/gpu/test_gpu_train.py --durations=6
echo "pytest tests/gpu/test_gpu_train.py rc=$?"

# Why the launcher's fork server finds more than one thread here (it then spawns rank processes): the
# threads (their names) after each stage of the zygote's preload, with the zygote's environment.
OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout 60 python3 - <<'PY'
import os
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
import torch
print("zygote threads after import torch:", threads())
import torch._dynamo  # noqa: F401
print("zygote threads after import torch._dynamo:", threads())
from ftrun.launch.zygote import preload
preload("examples/train_llama_tiny.py", module=False)
print("zygote threads after the preload (imports + warm-up step):", threads())
PY

MODEL=(--dim 256 --layers 2 --heads 8 --seq-len 128 --batch-size 8 --corpus-chars 200000)
CACHE=$(mktemp -d /tmp/ftrun-gpu-train-cache.XXXX)
python3 -c "from tests.unit.test_train_api import load_example; load_example().load_tokens('$CACHE', seed=0, num_chars=200000)"
# "cuda spawn" runs only if the forked (zygote) cuda launch failed: tells a fork/CUDA problem from others
for device in cuda "cuda spawn" cpu; do
  set -- $device
  device=$1; extra=()
  if [ $# -gt 1 ]; then
    [ "${cuda_rc:-0}" -eq 0 ] && continue
    extra=(--start-method spawn)
  fi
  out=$(mktemp -d /tmp/ftrun-gpu-train-$device.XXXX)
  timeout 150 python3 -m ftrun.cli launch --replicas 3 --steps 40 --out "$out" --json --no-progress "${extra[@]}" \
    examples/train_llama_tiny.py --device $device "${MODEL[@]}" --cache-dir "$CACHE" > "$out/figures.json"
  rc=$?
  [ "$device" = cuda ] && [ ${#extra[@]} -eq 0 ] && cuda_rc=$rc
  echo "launch --device $device ${extra[*]} rc=$rc (out $out)"
  python3 -c "import json, sys; f = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(sys.argv[2], {k: f.get(k) for k in ('complete', 'steps_reached', 'median_step_s', 'wall_s', 'final_loss',
                                            'replicas_identical', 'identity_checks', 'duplicate_batches')})" \
    "$out/figures.json" $device
done
uptime
