#!/usr/bin/env bash
# One node (or a hostfile's nodes over ssh) with the deepspeed launcher.
#   launch_scripts/train.sh CONFIG.yaml [--key value ...]
#   NUM_PROCS=4 launch_scripts/train.sh examples/gsm8k_qwen2.5_0.5b.yaml --learning_rate 5e-7
#   HOSTFILE=hosts.txt launch_scripts/train.sh CONFIG.yaml       # "host slots=N" lines; needs passwordless ssh
# Knobs (environment, with defaults; printed at start):
#   NUM_PROCS    ranks on this node: the GPUs found, or 2 CPU ranks on a machine without one
#   MASTER_PORT  29500
#   HOSTFILE     (none: this node only)
#   PYTHON       the checkout's .venv/bin/python when there is one (`make setup` builds it), else `python`:
#                the interpreter whose deepspeed and dsgrpo are used; the first line of the log names it
# For Slurm use launch_scripts/slurm/train.sbatch instead.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [--key value ...]" >&2
  exit 2
fi
config=$1
shift
[[ -f "$config" ]] || { echo "$0: config file '$config' not found" >&2; exit 2; }

source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"
dsgrpo_python "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 2
echo "dsgrpo train.sh: python $PYTHON (from $PYTHON_FROM)"
# a machine without an NVIDIA device node (WSL2: /dev/dxg) is a CPU one: no need to import torch (2 s) to learn that
if { compgen -G "/dev/nvidia[0-9]*" >/dev/null || [[ -e /dev/dxg ]]; } && \
   "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  NUM_PROCS=${NUM_PROCS:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
else
  export DS_ACCELERATOR=cpu
  NUM_PROCS=${NUM_PROCS:-2}
fi
MASTER_PORT=${MASTER_PORT:-29500}
HOSTFILE=${HOSTFILE:-}
# vLLM runs inside each training process (colocated), not as a separate server.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

if [[ -n "$HOSTFILE" ]]; then
  launcher=("$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NUM_PROCS" --master_port "$MASTER_PORT"
            --hostfile "$HOSTFILE")
else
  # One node: the deepspeed launcher's node process (deepspeed.launcher.launch), which is all its runner starts
  # here, with the command line the runner would write. The runner imports DeepSpeed only to write it (1.4 s of
  # every start), and on one node it neither forwards SIGTERM nor respects CUDA_VISIBLE_DEVICES with --num_gpus;
  # the node process does both. Devices: the first NUM_PROCS of CUDA_VISIBLE_DEVICES when set (indices or UUIDs),
  # else 0..N-1.
  IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
  devices=()
  for ((i = 0; i < NUM_PROCS; i++)); do devices+=("${visible[i]:-$i}"); done
  world_info=$("$PYTHON" -c 'import base64, json, sys
print(base64.urlsafe_b64encode(json.dumps({"localhost": [int(d) if d.isdigit() else d for d in sys.argv[1:]]}).encode()).decode())' \
               "${devices[@]}")
  launcher=("$PYTHON" -u -m deepspeed.launcher.launch "--world_info=$world_info" --master_addr=127.0.0.1
            "--master_port=$MASTER_PORT")
fi
echo "dsgrpo train.sh: NUM_PROCS=$NUM_PROCS MASTER_PORT=$MASTER_PORT HOSTFILE=${HOSTFILE:-none}"
echo "dsgrpo train.sh: ${launcher[*]} --module dsgrpo.train $config $*"
exec "${launcher[@]}" --module dsgrpo.train "$config" "$@"
