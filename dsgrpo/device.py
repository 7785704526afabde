"""The one place that decides CPU or GPU: the torch device, the collective backend, the default dtype and the
CPU thread budget. Everything else asks here."""

from __future__ import annotations

import os

import torch


def on_gpu() -> bool:
    """True when CUDA is usable and DeepSpeed was not told to use the CPU accelerator."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def accelerator_name() -> str:
    return "cuda" if on_gpu() else "cpu"


def torch_device(local_rank: int = 0) -> torch.device:
    return torch.device("cuda", local_rank) if on_gpu() else torch.device("cpu")


def dist_backend() -> str:
    return "nccl" if on_gpu() else "gloo"


def use_bf16(requested) -> bool:
    """bf16 default: on for GPU, off for CPU (tests compare to fp32 references)."""
    return on_gpu() if requested is None else bool(requested)


def prepare_process(local_world_size: int, num_threads=None) -> int:
    """Pin the CPU thread budget before torch/vLLM spin up pools: vLLM replaces torch.set_num_threads with a
    no-op once its engine exists, and DeepSpeed's launcher does not set OMP_NUM_THREADS. Returns the count."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator_name())
    if on_gpu():
        return torch.get_num_threads()
    n = num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n
