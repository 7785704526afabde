"""Everything that talks to torch.distributed. Collectives are called by every rank, in the same order, from
the training loop; nothing here branches on rank except `is_main()` for printing and file writes.

`init()` works under torchrun, the deepspeed launcher (it passes --local_rank), srun wrappers that export
RANK/WORLD_SIZE, and a plain `python script.py` (a world of one on a free local port)."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init() -> None:
    """Initialise the default process group (idempotent). Must run BEFORE the vLLM engine is created."""
    if dist.is_available() and dist.is_initialized():
        return
    adopt_slurm_env()
    if "RANK" not in os.environ:  # plain `python script.py` or a notebook: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    import warnings

    import deepspeed

    # DeepSpeed 0.19 calls torch.distributed APIs that torch 2.13 deprecates, once per collective
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..* is deprecated")
    timeout = datetime.timedelta(minutes=float(os.environ.get("DEEPSPEED_TIMEOUT", "30")))
    deepspeed.init_distributed(dist_backend=device.dist_backend(), timeout=timeout)
    if device.on_gpu():
        torch.cuda.set_device(local_rank())


def adopt_slurm_env() -> None:
    """An `srun` task per rank (launch_scripts/slurm/train.sbatch): take rank and world from Slurm's variables.
    MASTER_ADDR/MASTER_PORT come from the batch script."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0])


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    adopt_slurm_env()
    # torchrun exports LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", os.environ.get("WORLD_SIZE", 1))))


def is_main() -> bool:
    """Safe without a process group."""
    return rank() == 0


def barrier(reason: str) -> None:
    """A barrier with a reason, so a hang in a log points at its cause."""
    if is_initialized() and world_size() > 1:
        dist.barrier()


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate an equally shaped tensor from every rank along dim 0, in rank order."""
    if not is_initialized() or world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_initialized() and world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if is_initialized() and world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(obj, src: int = 0):
    if not is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> List:
    if not is_initialized() or world_size() == 1:
        return [obj]
    out: List = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_metrics(metrics: Dict[str, float], weights: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Weighted mean of each metric over ranks. `weights[name]` is how many items this rank's value averages
    (default 1). Names ending in /min or /max reduce as such. A rank may lack a metric (say, no active token in
    its micro-batches): the names are agreed first, and a missing value counts with weight 0."""
    names = sorted(set().union(*all_gather_object(sorted(metrics))))
    if not names:
        return {}
    have = torch.tensor([n in metrics for n in names])
    w = torch.tensor([float((weights or {}).get(n, 1.0)) if n in metrics else 0.0 for n in names], dtype=torch.float64)
    v = torch.tensor([float(metrics.get(n, 0.0)) for n in names], dtype=torch.float64)
    is_min = torch.tensor([n.endswith("/min") for n in names])
    is_max = torch.tensor([n.endswith("/max") for n in names])
    n = len(names)
    # one SUM collective for weighted sums and weights, one MAX collective for extremes (min as max of -v)
    summed = all_reduce_sum(torch.cat([torch.where(is_min | is_max, 0.0, v * w), w]))
    extremes = all_reduce_max(torch.where(have, torch.where(is_min, -v, v), -torch.inf))
    mean = summed[:n] / summed[n:].clamp(min=1e-12)
    out = torch.where(is_max, extremes, torch.where(is_min, -extremes, mean))
    return {name: out[i].item() for i, name in enumerate(names)}
