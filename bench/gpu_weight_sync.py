"""Issue 45's GPU cases, for a session lent a GPU machine (bench/gpu_check.sh runs it; no vLLM there, so the engine's
side is a plain copy into buffers of the same shapes, which is what vLLM's load does for unquantised weights):

  colocated  the policy (ZeRO-3 under DeepSpeed, one rank) → the sync's WeightSource, a decoder layer at a time,
             each tensor copied into the "engine's" buffer in the same process (dsgrpo's in-process backend: the
             tensors by reference, no IPC handle); goal for the 7B shape: < 0.5 s
  ipc        the same groups handed to another process on the same GPU as CUDA IPC handles (vLLM's ipc backend's
             transport), which copies them into its buffers
  nccl       with two GPUs: the groups broadcast over NCCL to a process on the second GPU (vLLM's nccl backend's
             transport), which copies them into its buffers

    python bench/gpu_weight_sync.py [--shape qwen2.5-7b] [--cases colocated,ipc,nccl] [--repeat 3]
    DS_ACCELERATOR=cpu python bench/gpu_weight_sync.py --shape qwen2.5-0.5b --cases colocated   # CPU smoke test

Prints one line per case (seconds per sync, against a device memcpy of the same bytes) and `RESULT ...` last."""

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.lora_sync import SHAPES  # noqa: E402


def build_policy(shape: str):
    """A random bf16 policy of `shape`, partitioned under ZeRO-3 as it is built (one rank)."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsgrpo import device, dist

    dist.init()
    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    ds = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
    }
    with deepspeed.zero.Init(config_dict_or_path=ds, remote_device=None, dtype=torch.bfloat16, config=ds):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(device.torch_device()) if not any(hasattr(p, "ds_id") for p in model.parameters()) else model


def engine_buffers(source, where):
    import torch

    return {m.name: torch.empty(m.shape, dtype=m.dtype, device=where) for m in source.metadata()}


def memcpy_s(nbytes: int, where) -> float:
    import torch

    from dsgrpo import device

    src = torch.ones(nbytes, dtype=torch.uint8, device=where)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        device.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        device.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def colocated(source, buffers, repeat: int) -> float:
    from dsgrpo import device
    from dsgrpo.rollout.weight_source import prefetched

    best = float("inf")
    for _ in range(repeat):
        device.synchronize()
        t = time.perf_counter()
        for group in prefetched(source, ahead=True):
            for name, tensor in zip(group.names, group.tensors):
                buffers[name].copy_(tensor, non_blocking=True)
            group.release()
        device.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def _ipc_receiver(conn, shapes):
    """The other process: rebuild each group's tensors from their IPC handles, copy them into its buffers."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: F401 - the handles' rebuild function

    buffers = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        for name, (rebuild, args) in message:
            buffers[name].copy_(rebuild(*args))
        torch.cuda.synchronize()
        conn.send("done")


def ipc(source, repeat: int) -> float:
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    from dsgrpo.rollout.weight_source import prefetched

    if not torch.cuda.is_available():
        raise RuntimeError("the ipc case needs a GPU (CUDA IPC handles)")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    shapes = {m.name: (tuple(m.shape), m.dtype) for m in source.metadata()}
    proc = ctx.Process(target=_ipc_receiver, args=(child, shapes))
    proc.start()
    parent.recv()
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for group in prefetched(source, ahead=True):
            held = [t_.contiguous() for t_ in group.tensors]  # a handle shares a whole allocation: keep them alive
            torch.cuda.synchronize()
            parent.send([(n, reduce_tensor(h)) for n, h in zip(group.names, held)])
            parent.recv()
            group.release()
        best = min(best, time.perf_counter() - t)
    parent.send(None)
    proc.join()
    return best


def nccl(source, repeat: int) -> float:
    """Two GPUs: this process (GPU 0) broadcasts each group to a receiver on GPU 1 over a group of their own."""
    import torch
    import torch.multiprocessing as mp

    from dsgrpo.rollout.weight_source import prefetched

    if torch.cuda.device_count() < 2:
        raise RuntimeError("the nccl case needs two GPUs")
    ctx = mp.get_context("spawn")
    port = 29600 + os.getpid() % 1000
    shapes = [(tuple(m.shape), m.dtype) for m in source.metadata()]
    proc = ctx.Process(target=_nccl_receiver, args=(port, shapes, repeat))
    proc.start()
    group = _nccl_group(port, rank=0)
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for prepared in prefetched(source, ahead=True):
            for tensor in prepared.tensors:
                group.broadcast([tensor.contiguous()], _root(0)).wait()
            prepared.release()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    proc.join()
    return best


def _root(rank: int):
    import torch.distributed as tdist

    opts = tdist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = rank, 0
    return opts


def _nccl_group(port: int, rank: int):
    import datetime

    import torch.distributed as tdist

    from dsgrpo import compat

    store = tdist.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    return compat.standalone_group("nccl", store, rank, 2, datetime.timedelta(seconds=120))


def _nccl_receiver(port, shapes, repeat):
    import torch

    torch.cuda.set_device(1)
    group = _nccl_group(port, rank=1)
    buffers = [torch.empty(s, dtype=d, device="cuda") for s, d in shapes]
    for _ in range(repeat):
        for b in buffers:
            group.broadcast([b], _root(0)).wait()
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--cases", default="colocated,ipc,nccl")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    from dsgrpo import device
    from dsgrpo.engines.gather import DeepSpeedGather
    from dsgrpo.rollout.weight_source import Zero3WeightSource

    where = device.torch_device()
    policy = build_policy(a.shape)
    source = Zero3WeightSource(policy, bool(SHAPES[a.shape].get("tie_word_embeddings")), DeepSpeedGather())
    nbytes = source.total_bytes()
    copy_s = memcpy_s(nbytes, where)
    results = {}
    for case in a.cases.split(","):
        try:
            if case == "colocated":
                seconds = colocated(source, engine_buffers(source, where), a.repeat)
            elif case == "ipc":
                seconds = ipc(source, a.repeat)
            elif case == "nccl":
                seconds = nccl(source, a.repeat)
            else:
                raise ValueError(f"unknown case {case!r}")
        except Exception as exc:  # noqa: BLE001 - reported, the other cases still run
            print(f"{case}: {type(exc).__name__}: {exc}", flush=True)
            continue
        results[case] = seconds
        print(
            f"{a.shape} {case:10s} {nbytes / 2**30:6.2f} GiB ({where}): {seconds:.3f} s/sync, "
            f"{seconds / copy_s:.1f}× a memcpy ({copy_s:.3f} s)",
            flush=True,
        )
    print("RESULT " + " ".join(f"{k}_s={v:.3f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
