"""DeepSpeed 0.19.8: its comm module global, ZeRO-3 parameter fields, engine checkpoints, the launcher.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
from typing import Optional, Tuple


def confine_deepspeed_comm(group) -> None:
    """Split placement: DeepSpeed calls some collectives without a group (barriers in initialize and
    save_checkpoint, ZeRO-3's consistency checks), meaning the whole world, which the generating ranks never join.
    Its torch backend reaches torch.distributed through its module global `torch`: give it a view in which a
    missing or WORLD group means `group`. Nothing outside DeepSpeed's comm backend is affected."""
    import deepspeed.comm.torch  # noqa: F401 (the attribute path resolves to torch itself; use sys.modules)
    import torch

    backend = sys.modules["deepspeed.comm.torch"]
    real = torch.distributed

    class TrainingDist:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if not callable(attr) or isinstance(attr, type):
                return attr
            try:
                signature = inspect.signature(attr)
            except (TypeError, ValueError):
                return attr
            if "group" not in signature.parameters:
                return attr

            @functools.wraps(attr)
            def confined(*args, **kwargs):
                bound = signature.bind_partial(*args, **kwargs)
                if bound.arguments.get("group") in (None, real.GroupMember.WORLD):
                    bound.arguments["group"] = group
                return attr(*bound.args, **bound.kwargs)

            return confined

    class TorchView(types.ModuleType):
        distributed = TrainingDist()

        def __getattr__(self, name):
            return getattr(torch, name)

    backend.torch = TorchView("torch")


def ignore_compiling_in_other_threads() -> None:
    """ZeRO-3 skips recording its module trace while `torch.compiler.is_compiling()` is true, and that flag is
    process-wide. When vLLM compiles a kernel in the async trainer's rollout thread, the training thread's
    forward on one rank skipped part of its trace while the other rank recorded it, and the ranks' next
    collectives no longer matched (measured: a deadlock in the first forward of the CPU demo, timing-dependent).
    The training thread never compiles, so DeepSpeed's checks answer for the thread asking."""
    import deepspeed.runtime.compiler as ds_compiler
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.utils.nvtx as nvtx

    original = ds_compiler.is_compiling
    if getattr(original, "_dsgrpo", False):
        return

    def is_compiling() -> bool:
        return threading.current_thread() is not threading.main_thread() and original()

    is_compiling._dsgrpo = True
    for module in (ds_compiler, coordinator, nvtx):
        module.is_compiling = is_compiling


def is_zero3_param(p) -> bool:
    """A parameter ZeRO-3 partitioned (it carries ds_id)."""
    return hasattr(p, "ds_id")


def full_shape(p) -> Tuple[int, ...]:
    """The unpartitioned shape of a (possibly ZeRO-3 partitioned) parameter."""
    return tuple(getattr(p, "ds_shape", p.shape))


def full_numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def local_partition(p):
    """This rank's ZeRO-3 partition of a parameter as a flat tensor (its `ds_tensor`), or the parameter itself."""
    return p.ds_tensor.data if hasattr(p, "ds_tensor") else p.data


def held_whole(p) -> bool:
    """A ZeRO-3 parameter whose full copy is materialised right now (a persistent small parameter, or one being
    used): the forward reads that copy, not the partition."""
    return is_zero3_param(p) and p.ds_status.name == "AVAILABLE"


def pin_grad_accumulators(params) -> list:
    """Build each trainable ZeRO-3 parameter's gradient accumulator while the parameter is gathered, and return
    them for the engine to keep (torch 2.13 with deepspeed 0.19.8).

    torch's AccumulateGrad node records its leaf's shape when it is created and is cached on the leaf while
    anything holds it; ZeRO-3 shrinks a partitioned parameter's data to shape [0] between uses. A user who keeps
    an autograd-tracked copy of a partitioned parameter (`{n: p.clone() for n, p in model.named_parameters()}`,
    what TRL's tests and many callbacks do) keeps alive an accumulator that says [0], and the next backward dies
    ("LinearFunctionForZeroStage3Backward returned an invalid gradient ... expected shape compatible with [0]").
    Accumulators made at the full shape and held for the run are the ones every later graph reuses. Collective
    (the gathers): every rank calls it with the same parameters."""
    import deepspeed

    pinned = []
    for p in params:
        if not (p.requires_grad and is_zero3_param(p)):
            continue
        with deepspeed.zero.GatheredParameters([p]):
            pinned.append(p.view_as(p).grad_fn.next_functions[0][0])
    return pinned


@contextlib.contextmanager
def gathered_without_hooks(engine):
    """The whole ZeRO-3 policy gathered, with ZeRO-3's module hooks lifted, for one HF generate call
    (ds3_gather_for_generation; deepspeed 0.19.8, the same move as TRL's unwrap_model_for_generation).

    With the hooks in place each module's post-forward hook partitions the parameters it just used, even inside
    GatheredParameters, and the next forward's prefetch starts gathering them again; a prefetch still in flight
    when the gathered region ends fails partitioning ("Cannot partition a param in flight"), after a round of
    several micro-steps. Collective: every rank enters with the same engine."""
    import deepspeed

    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        if offload is None:  # no ZeRO-3 optimizer yet: nothing hooks the modules
            yield
            return
        for p in engine.module.parameters():
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


def save_engine_checkpoint(engine, save_dir: str, tag: str, **kwargs) -> None:
    """engine.save_checkpoint, made safe for a write that fails on some ranks only (deepspeed 0.19.8).

    DeepSpeed's save is collective: a barrier once rank 0 has made `save_dir`, each rank's writes, a barrier at the
    end. A rank whose write fails (a full disk) leaves before the final barrier while the others wait in it, and
    the next collective pairs with the wrong one: a hang until the collective timeout, not an error. Here
    `save_dir` exists before the call (nothing before the first barrier can fail) and a failing rank makes up the
    final barrier before it re-raises, so every rank leaves the save together and can agree on the failure."""
    import os

    from deepspeed import comm

    os.makedirs(save_dir, exist_ok=True)
    try:
        engine.save_checkpoint(save_dir, tag=tag, **kwargs)
    except (OSError, RuntimeError):  # torch's zip writer reports a full disk as a RuntimeError
        comm.barrier()
        raise


def load_universal_engine_checkpoint(engine, load_dir: str, tag: str, **kwargs):
    """engine.load_checkpoint of a universal checkpoint (deepspeed 0.19.8): DeepSpeed reads the config's
    load_universal flag inside load_checkpoint, so it is set for this one load only (a later same-world load,
    e.g. load_best_model_at_end, reads the engine's own files)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    finally:
        config.load_universal_checkpoint = before


def convert_to_universal(engine_dir: str, out_dir: str, workers: int = 1) -> None:
    """DeepSpeed's ds_to_universal (deepspeed 0.19.8) in a child process: the per-rank ZeRO shards of `engine_dir`
    become one file per parameter and state in `out_dir`, loadable on any number of ranks. A child, so its
    memory (every shard read once) is returned when it ends; raises RuntimeError with its last output lines."""
    import os
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        engine_dir,
        "--output_folder",
        out_dir,
        "--num_extract_workers",
        str(workers),
        "--num_merge_workers",
        str(workers),
        "--inject_missing_state",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    latest = os.path.join(os.path.dirname(os.path.normpath(out_dir)), "latest_universal")
    if os.path.isfile(latest):
        os.remove(latest)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"deepspeed.checkpoint.ds_to_universal failed (exit {proc.returncode}):\n{tail}")


def deepspeed_runner_above(pid: int) -> Optional[int]:
    """The pid of DeepSpeed's runner (`deepspeed --num_gpus N`) when `pid` (a rank's parent) is the node launcher
    (deepspeed.launcher.launch) it started, else None. On one node the runner starts the node launcher with
    subprocess.Popen and passes no signal on to it (only its PDSH multi-node path does), so a SIGTERM to the runner
    leaves the node launcher and the ranks running (deepspeed 0.19.8: runner.main, launch.main)."""

    def cmdline(p):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                return fh.read().decode(errors="replace").split("\0")
        except OSError:
            return []

    def parent(p):
        try:
            with open(f"/proc/{p}/stat") as fh:
                return int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None

    if "deepspeed.launcher.launch" not in cmdline(pid):
        return None
    above = parent(pid)
    args = cmdline(above) if above else []
    is_runner = "deepspeed.launcher.runner" in args or any(a.rsplit("/", 1)[-1] == "deepspeed" for a in args[:2])
    return above if is_runner else None
