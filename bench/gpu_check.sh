#!/usr/bin/env bash
# Issue 16's one prepared device check, for the GPU machine the `device` tool lends (one H200; Python 3.12 with
# torch + CUDA, transformers, peft; no vLLM, no DeepSpeed, no network). Under 10 minutes: ZeRO-3 GRPO steps of the
# Qwen2.5-0.5B shape in bf16 with the HF-generate backend (peak torch.cuda.max_memory_allocated against the
# planner's prediction) and the chunked log-prob's peak against the full logits' (bench/gpu_check.py).
#
# Prepare here once; the wheels travel in .whl, which git ignores:
#   echo /.whl/ >> .git/info/exclude
#   bash bench/gpu_check.sh --fetch-wheels
# Then, through the device tool:  run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."

# What the GPU image lacks (its package list: the device tool's KINDS.md): DeepSpeed (an sdist: built here as a pure-
# Python wheel; it JIT-builds its CUDA ops there) and its pydantic / hjson; datasets and its dill / multiprocess;
# transformers and huggingface-hub at the versions dsgrpo pins. Every version is the GPU lock's
# (requirements/gpu-lock.txt, what `make setup-gpu` installs), so the check runs what users install.
pin() { grep -iE "^$1==" requirements/gpu-lock.txt || { echo "gpu_check.sh: $1 is not in requirements/gpu-lock.txt" >&2; exit 2; }; }
WHEELS="$(pin hjson) $(pin pydantic) $(pin pydantic-core) $(pin annotated-types) $(pin typing-inspection)
$(pin datasets) $(pin dill) $(pin multiprocess) $(pin transformers) $(pin huggingface-hub) $(pin tokenizers)"

if [ "${1:-}" = "--fetch-wheels" ]; then
  PIP="${PYTHON:-.venv/bin/python} -m pip"
  mkdir -p .whl
  # a fresh build (the install's cached wheel carries the CPU shm op compiled for this Python)
  DS_BUILD_OPS=0 $PIP wheel --no-deps --no-cache-dir "$(pin deepspeed)" -w .whl
  # shellcheck disable=SC2086
  $PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
  du -sh .whl
  exit 0
fi

OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, deepspeed, transformers, datasets; print('torch', torch.__version__, '| deepspeed', \
deepspeed.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
timeout 540 python3 bench/gpu_check.py --out "$OUT" --timeout 300 2>&1 | tee "$OUT/gpu_check.txt"

# Weight sync (issue 45): the 7B shape under ZeRO-3, a decoder layer at a time, into an engine in the same process
# (dsgrpo's in-process backend; goal < 0.5 s), through CUDA IPC handles to another process, and over NCCL to a
# second GPU when there is one. (No vLLM here: the engine's side is a copy into buffers of the same shapes.)
timeout 300 python3 bench/gpu_weight_sync.py --shape qwen2.5-7b --cases colocated,ipc,nccl 2>&1 \
  | tee "$OUT/weight_sync.txt" || true

# Sequence parallelism (issue 28) needs two GPUs (one rank a device): on a machine with them, one long completion
# per rank at SP 1 and SP 2 (flash-attention's varlen path if installed, else sdpa), the train phase's peak.
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m dsgrpo.testing make --hidden 1024 --layers 8 --heads 16 --max-positions 65536 --out /tmp/m_sp
  for sp in 1 2; do
    timeout 240 python3 -m torch.distributed.run --nproc_per_node 2 bench/sp_memory.py --model /tmp/m_sp \
      --lengths 8192,32768 --sp $sp 2>&1 | grep RESULT | tee -a "$OUT/sp_memory.txt" || true
  done
else
  echo "sequence parallelism: skipped (one GPU; it needs two ranks on two devices)" | tee -a "$OUT/sp_memory.txt"
fi
