"""The one place that decides CPU or GPU: the torch device, the collective backend, the default dtype and the
CPU thread budget. Everything else asks here."""

from __future__ import annotations

import os
from typing import Optional

import torch


def on_gpu() -> bool:
    """True when CUDA is usable and DeepSpeed was not told to use the CPU accelerator."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def accelerator_name() -> str:
    return "cuda" if on_gpu() else "cpu"


def torch_device(local_rank: int = 0) -> torch.device:
    return torch.device("cuda", local_rank) if on_gpu() else torch.device("cpu")


def synchronize() -> None:
    """Wait for the device's queued work (a no-op on CPU): timings of device work end here."""
    if on_gpu():
        torch.cuda.synchronize()


def dist_backend() -> str:
    return "nccl" if on_gpu() else "gloo"


def use_bf16(requested, fp16: bool = False) -> bool:
    """bf16 default: on for GPU, off for CPU (tests compare to fp32 references) and off when fp16 is asked for."""
    if fp16:
        return False
    return on_gpu() if requested is None else bool(requested)


def train_dtype(bf16, fp16: bool = False) -> torch.dtype:
    """The dtype the engines hold weights in. fp16 needs a GPU (DeepSpeed's loss scaling; CPU kernels lack it)."""
    if fp16:
        if not on_gpu():
            raise ValueError("fp16=True needs a GPU; on CPU train in fp32 (the default) or bf16=True.")
        return torch.float16
    return torch.bfloat16 if use_bf16(bf16) else torch.float32


def set_tf32(allowed) -> None:
    """TrainingArguments.tf32: TF32 matmuls on Ampere+ GPUs (None leaves torch's default)."""
    if allowed is not None and on_gpu():
        torch.backends.cuda.matmul.allow_tf32 = bool(allowed)
        torch.backends.cudnn.allow_tf32 = bool(allowed)


def empty_cache() -> None:
    if on_gpu():
        torch.cuda.empty_cache()


# glibc's malloc keeps freed blocks under its mmap threshold (which slides up to 32 MiB) in its heap, so on CPU a
# phase's freed transients (ZeRO-3's gathered layers, a backward's activations) stay resident beside the next
# phase's and the resident peak sits GBs above the live peak (Qwen2.5-0.5B shape on 2 ranks: 10.5-11 GiB resident
# at the optimizer step for 9.2 live). The trainer trims at the end of each phase and before each optimizer step.
# A fixed low threshold instead (MALLOC_MMAP_THRESHOLD_ of 1 MiB or 64 KiB) returns them too but page-faults every
# large allocation: W2's step 20% slower.
def _libc():
    global _libc_handle
    if _libc_handle is None:
        try:
            import ctypes

            _libc_handle = ctypes.CDLL("libc.so.6")
            _libc_handle.malloc_trim  # noqa: B018 (glibc's, not musl's)
        except (OSError, AttributeError):
            _libc_handle = False
    return _libc_handle


_libc_handle = None

# The trims cost: the pages handed back fault in again at the next phase (the CPU demo: ~0.2 s of a 0.87 s step; W1
# ~0.4 s of a 4.2 s train phase). So they run where the room is needed: when the start-up plan's peak takes more
# than TRIM_HEAP_ABOVE of a rank's memory, or when there is no plan. DSGRPO_TRIM_HEAP=1 always trims (what
# bench/plan_vs_measured.py compares with the plan is then the live peak), =0 never.
TRIM_HEAP_ABOVE = 0.5
_trim_heap = True


def choose_heap_trimming(planned_fraction: Optional[float]) -> bool:
    """Decide once at start-up whether return_freed_memory trims; `planned_fraction` is the plan's peak over a
    rank's memory (None: no plan). Returns the choice."""
    global _trim_heap
    forced = os.environ.get("DSGRPO_TRIM_HEAP", "")
    if forced not in ("", "0", "1"):
        raise ValueError(
            f"DSGRPO_TRIM_HEAP={forced!r}: set it to 1 (always trim the CPU heap), 0 (never) or unset it "
            f"(trim when the memory plan's peak is over {TRIM_HEAP_ABOVE:.0%} of a rank's memory)."
        )
    _trim_heap = forced == "1" if forced else planned_fraction is None or planned_fraction > TRIM_HEAP_ABOVE
    return _trim_heap


def return_freed_memory() -> None:
    """CPU: hand the pages of freed heap blocks back to the OS (glibc's malloc_trim: microseconds, plus re-faulting
    what is allocated again). Each phase and each optimizer step then start from live memory. A no-op when
    choose_heap_trimming decided the room is not needed."""
    libc = None if on_gpu() or not _trim_heap else _libc()
    if libc:
        libc.malloc_trim(0)


def prepare_process(local_world_size: int, num_threads=None) -> int:
    """Set the CPU thread budget before torch/vLLM spin up pools: vLLM replaces torch.set_num_threads with a no-op
    once its engine exists, and DeepSpeed's launcher does not set OMP_NUM_THREADS. By default the machine's cores
    are shared among the node's ranks, and a rank never gets more threads than the cores it may run on (a Slurm task's
    or a container's cpuset: os.cpu_count() is the whole machine's). Returns the count."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator_name())
    if on_gpu():
        return torch.get_num_threads()
    share = max(1, min(len(os.sched_getaffinity(0)), (os.cpu_count() or 1) // max(1, local_world_size)))
    n = num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or share
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    keep_freed_heap()
    return n


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks above it are mapped and unmapped each time
HEAP_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def keep_freed_heap() -> bool:
    """CPU: glibc's defaults hand freed heap back to the OS on its own (its trim threshold, and a mmap threshold that
    starts at 128 KiB), so the next step's tensors fault their pages in again and the kernel zeroes each one: on W1
    over 2 ranks `clear_page` was 14% of a rank's samples and the train phase 12.8 s, 11.3 s with this (one process:
    no change). Freed heap is kept instead; return_freed_memory still trims where the memory plan needs the room. A
    user's own glibc settings (GLIBC_TUNABLES glibc.malloc.*, MALLOC_*_ variables) are left as they are. Returns
    whether it set them."""
    if (
        on_gpu()
        or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
        or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ)
    ):
        return False
    libc = _libc()
    if not libc:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    )
