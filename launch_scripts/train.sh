#!/usr/bin/env bash
# One node, N ranks, with the deepspeed launcher.
#   launch_scripts/train.sh CONFIG.yaml [--key value ...]
#   NUM_PROCS=4 launch_scripts/train.sh examples/gsm8k_qwen2.5_0.5b.yaml --learning_rate 5e-7
# NUM_PROCS defaults to the GPUs on this node, or 2 CPU ranks on a machine without one.
# Assumes a prepared environment (`make setup`, or the GPU install in README.md) with `deepspeed` on PATH.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [--key value ...]" >&2
  exit 2
fi
config=$1
shift
[[ -f "$config" ]] || { echo "$0: config file '$config' not found" >&2; exit 2; }

if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  nprocs=${NUM_PROCS:-$(python -c 'import torch; print(torch.cuda.device_count())')}
else
  export DS_ACCELERATOR=cpu
  nprocs=${NUM_PROCS:-2}
fi
# vLLM runs inside each training process (colocated), not as a separate server.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

exec deepspeed --num_gpus "$nprocs" --master_port "${MASTER_PORT:-29500}" --module dsgrpo.train "$config" "$@"
