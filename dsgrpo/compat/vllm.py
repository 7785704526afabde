"""vLLM 0.32.0: weight reloads, sampling, the engine build, CPU shared memory, and the in-process weight transfer.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

import contextlib
from typing import Iterable


def reload_vllm_weights(llm, named_tensors: Iterable) -> None:
    """Replace a live engine's weights with HF-named full tensors, in place, through the worker's reload_weights.
    A tied model's `lm_head.weight` (which the trainer sends: vLLM's Qwen2 and Llama keep an lm_head aliased to the
    embedding, and logits were 1.7 nats off without it) is left out for models vLLM builds without an lm_head at
    all (Gemma 2 computes logits from the embedding; its loader refuses the name)."""
    if not _vllm_has_lm_head(llm):
        named_tensors = ((name, t) for name, t in named_tensors if name != "lm_head.weight")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True})
    llm.collective_rpc(_repack_cpu_moe_experts)


def vllm_weights_not_held(llm) -> set:
    """Checkpoint names the engine's model has no parameter for and drops on load: a tied lm_head (Gemma 2)."""
    return set() if _vllm_has_lm_head(llm) else {"lm_head.weight"}


def _vllm_has_lm_head(llm) -> bool:
    if not hasattr(llm, "_dsgrpo_has_lm_head"):
        llm._dsgrpo_has_lm_head = all(llm.collective_rpc(_worker_has_lm_head))
    return llm._dsgrpo_has_lm_head


def _worker_has_lm_head(worker) -> bool:
    return hasattr(worker.model_runner.get_model(), "lm_head")


def _repack_cpu_moe_experts(worker) -> int:
    """vLLM 0.32 on CPU: a weight update of a mixture-of-experts layer copies the new expert weights into the
    parameter that held the CPU kernel's prepacked layout and skips the prepack (`_setup_kernel`'s
    is_weight_update branch), so the kernel then reads unpacked data as packed: the log-probs were off by 0.04 nats
    after reloading unchanged weights. Prepack again what the reload left unpacked. Returns the layers repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def vllm_sampling_param_names() -> set:
    """The fields SamplingParams takes (a msgspec Struct lists them in __struct_fields__)."""
    from vllm import SamplingParams

    return {f for f in SamplingParams.__struct_fields__ if not f.startswith("_")}


@contextlib.contextmanager
def engine_build_without_full_collections(enabled: bool = True):
    """While a vLLM engine is built: an explicit gc.collect() does nothing (on CPU; `enabled=False` elsewhere).

    vLLM 0.32's build collects garbage over every object in the process three times (after loading the weights,
    after sizing the cache, before freezing the heap): 1.0 s of a 2.2 s build of a tiny model on CPU, per rank and
    engine, and they find ~20 objects, which the heap freeze that follows then keeps (the freeze itself is kept: it
    makes later collections skip the start-up heap). On a GPU the first collection releases transient tensors
    before vLLM sizes its KV cache, so it stays there. Only the building thread calls gc.collect meanwhile."""
    import gc

    if not enabled:
        yield
        return
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


# vLLM 0.32 on CPU: a seeded request whose prompt is prefilled over two steps (the waiting prompts exceed a step's
# token budget: a round of long multi-turn episodes does) crashes the engine when the part-prefill's sampled token
# is thrown away and its generator rewound (GPUModelRunner._bookkeeping_sync; a CPU generator has no offset).
# dsgrpo seeds every request, so a CPU engine prefills whole prompts only.
CPU_WHOLE_PREFILLS = {"enable_chunked_prefill": False}


def eager_token_ranks_on_cpu() -> None:
    """The rank of each sampled token among the vocabulary, counted eagerly (CPU only; a second call changes
    nothing).

    vLLM 0.32's sampler counts, for every sampled token, the log-probs at least as large as its own through a
    torch.compile'd function (on GPU it saves a copy of the logits). On CPU its first call compiles it with inductor:
    2 s in one process, 3.5 s with two ranks compiling at once, all of it inside a run's first round. dsgrpo reads
    the sampled token's log-prob, never its rank; the same count eagerly costs microseconds at the batch sizes a CPU
    engine runs. GPU engines keep the compiled kernel."""
    import vllm.v1.sample.sampler as sampler

    if getattr(sampler.batched_count_greater_than, "_dsgrpo_eager", False):
        return

    def batched_count_greater_than(x, values):
        return (x >= values).sum(-1)

    batched_count_greater_than._dsgrpo_eager = True
    sampler.batched_count_greater_than = batched_count_greater_than


_exit_hook_registered = False


def skip_garbage_collection_at_exit() -> None:
    """From the first vLLM engine on: once the interpreter exits, an explicit gc.collect() does nothing.

    vLLM 0.32's engine shutdown, run at exit, makes two full collections over every object torch, transformers and
    vLLM created (cleanup_dist_env_and_memory, the model runner's shutdown): 1.1 s a process and engine on CPU, at
    the end of every run and test launch, to free memory the OS takes back anyway. The hook is registered after
    weakref.finalize's (atexit runs the last registered first), so it runs before the engine's finalizer. (The
    interpreter's teardown collects over everything once more; process_exit.leave skips it where dsgrpo owns the
    process.)"""
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    import atexit
    import gc
    import weakref

    weakref.finalize(skip_garbage_collection_at_exit, lambda: None)  # weakref's exit hook exists before ours
    atexit.register(setattr, gc, "collect", lambda generation=2: 0)
    _exit_hook_registered = True


def vllm_max_model_len(llm) -> int:
    return llm.llm_engine.model_config.max_model_len


def quiet_vllm_rotary_reload_warning() -> None:
    """Every in-place reload warns that RotaryEmbedding 'failed to load weights': it has none (its cos/sin
    cache is computed, not loaded). Drop exactly that record so real reload warnings stay visible."""
    import logging

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(getattr(f, "_dsgrpo", False) for f in logger.filters):

        def keep(record: logging.LogRecord) -> bool:
            return "RotaryEmbedding: Failed to load weights" not in record.getMessage()

        keep._dsgrpo = True
        logger.addFilter(keep)


SHM_DIR = "/dev/shm"


def unlink_deepspeed_cpu_shm_segment(rank: int) -> bool:
    """DeepSpeed's CPU allreduce between the ranks of one machine (deepspeed_shm_comm, used when the launcher's
    LOCAL_SIZE equals the world size) creates a 66 MiB /dev/shm segment per rank, named
    deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (ops/csrc/cpu/comm/shm.cpp), maps every
    rank's at init and never unlinks them: each 2-rank CPU job left 132 MiB of RAM in tmpfs until reboot (3.5 GiB
    after a day of runs here, enough for the OOM killer to stop a run that had fitted). Once every rank has mapped
    them (init returns only then; the caller passes a barrier first) the names can go: a mapping outlives its name,
    and the memory is freed when the last process holding it exits, killed or not. Returns whether it was there."""
    import os

    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def unique_cpu_shm_names() -> None:
    """vLLM-CPU names a tensor-parallel group's shared-memory segments after the port of its init method; under
    external_launcher that is "env://", so every TP engine on a machine gets the same names. A second TP job on the
    machine, or any TP job after one was killed (SIGKILL leaves its segments in /dev/shm), then fails at start with
    `create shm in SHMManager failed. errno: 17`. Name them after this world's MASTER_PORT instead (unique among the
    jobs running on a machine) and drop this rank's leftover segment of that name, which no running job can own."""
    import os

    from vllm.distributed.device_communicators import cpu_communicator

    cls = cpu_communicator._CPUSHMDistributed
    original = cls.make_group_name
    if getattr(original, "_dsgrpo", False):
        return

    def make_group_name(communicator) -> str:
        name = original(communicator)
        ident = os.environ.get("VLLM_DIST_IDENT", "")
        if ident.strip("/") or "MASTER_PORT" not in os.environ:
            return name  # a real port already (vLLM's own executors)
        name = f"dsgrpo{os.environ['MASTER_PORT']}{name[len(ident) :]}"
        leftover = os.path.join(SHM_DIR, f"{name}_{communicator.rank}")
        if os.path.exists(leftover):
            os.unlink(leftover)
        return name

    make_group_name._dsgrpo = True
    cls.make_group_name = staticmethod(make_group_name)


def join_vllm_startup_collectives(engine_args, *, world_size: int, rank: int, local_rank: int, backend: str) -> None:
    """Split placement, on a training rank: take part in the world-wide collectives the generating ranks' vLLM
    engines run while they start (under "external_launcher" vLLM builds its process groups over the whole torch
    world, and agrees on KV-cache memory with a MIN all-reduce over it) without building an engine. Mirrors vLLM
    0.32's start-up sequence (ExecutorWithExternalLauncher); the pins above fail a test when it moves."""
    import torch
    import torch.distributed as tdist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(engine_args.create_engine_config()):
        parallel_state.init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method="env://", local_rank=local_rank, backend=backend
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)
        memory = torch.tensor([2**62], dtype=torch.int64)  # no opinion: the generators' minimum wins
        tdist.all_reduce(memory, group=parallel_state.get_world_group().cpu_group, op=tdist.ReduceOp.MIN)


# ---------------------------------------------------------------------------------------------- vLLM weight transfer
INPROCESS_WEIGHT_BACKEND = "dsgrpo_inprocess"


def register_inprocess_weight_engine() -> bool:
    """vLLM 0.32's native weight-transfer API (start_weight_update → update_weights → finish_weight_update, each a
    worker RPC) with a backend of dsgrpo's for an engine in the trainer's own process: update_weights hands the
    tensors over by reference (no copy, no serialization) and the worker loads them as a checkpoint-format layerwise
    update. Registered once per process, before the engine is built. False where vLLM has no such API (the reload
    path serves)."""
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if _registered.get("inprocess"):
        return True
    from dataclasses import dataclass as _dataclass
    from dataclasses import field as _field

    @_dataclass
    class InProcessInitInfo(WeightTransferInitInfo):
        pass

    @_dataclass
    class InProcessUpdateInfo(WeightTransferUpdateInfo):
        weights: list = _field(default_factory=list)  # [(checkpoint name, tensor)], by reference
        checksum: bool = False  # also record what arrived (verify_weight_sync)

    class InProcessWeightEngine(WeightTransferEngine):
        init_info_cls, update_info_cls = InProcessInitInfo, InProcessUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info) -> None:
            self.received = []

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.received = []
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # in-process: nothing to synchronise

        def receive_weights(self, update_info) -> None:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            if update_info.checksum:  # taken as the tensors arrive, before loading: what the trainer sent
                self.received.extend((n, tensor_checksum(t)) for n, t in update_info.weights)
            with disable_mtp_completeness_check():
                self.model.load_weights(update_info.weights)
            # the trainer reuses the memory these tensors live in once this returns
            detach_buffered_weights({id(t) for _, t in update_info.weights})

        def shutdown(self) -> None:
            pass

    try:
        WeightTransferEngineFactory.register_engine(INPROCESS_WEIGHT_BACKEND, InProcessWeightEngine)
    except ValueError:  # registered by an earlier import of this module (a reload in tests)
        pass
    _registered["inprocess"] = True
    return True


_registered: dict = {}


def tensor_checksum(t) -> list:
    """[sum, sum of squares, numel] in float64: the same for the same values whatever the order or place."""
    import torch

    x = t.detach().reshape(-1).to(torch.float64)
    return [float(x.sum()), float((x * x).sum()), int(x.numel())]


def vllm_native_weight_update(llm, groups, version: str, checksum: bool, on_group=None) -> list:
    """One weight update through the native API: start, one update_weights per group of (name, tensor), finish,
    then label the engine's weights `version`. `on_group(seconds)` after each group is loaded. Returns the
    checksums the engine took of what it received (with `checksum`), per tensor."""
    import time

    if not _vllm_has_lm_head(llm):
        groups = ([(n, t) for n, t in g if n != "lm_head.weight"] for g in groups)
    llm.collective_rpc("start_weight_update")
    try:
        for group in groups:
            start = time.perf_counter()
            llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": group, "checksum": checksum}})
            if on_group is not None:
                on_group(time.perf_counter() - start)
    finally:
        llm.collective_rpc("finish_weight_update")  # never leave the worker inside an update
    llm.collective_rpc(_repack_cpu_moe_experts)
    llm.llm_engine.set_weight_version(version)
    return llm.collective_rpc(_received_checksums)[0] if checksum else []


def detach_buffered_weights(ids) -> int:
    """Copy the tensors (by id) a layerwise update still holds for layers it has not processed yet (attention-like
    ones wait for finalize), so the caller may reuse their memory. Returns how many were copied."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in getattr(info, "loaded_weights", ()):
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and id(value) in ids:
                    bound.arguments[key] = value.clone()
                    copied += 1
    return copied


def _received_checksums(worker) -> list:
    return list(getattr(worker.weight_transfer_engine, "received", []))


def vllm_uses_inprocess_weight_engine(llm) -> bool:
    return bool(llm.collective_rpc(_has_inprocess_engine)[0])


def _has_inprocess_engine(worker) -> bool:
    engine = getattr(worker, "weight_transfer_engine", None)
    return type(engine).__name__ == "InProcessWeightEngine"


def vllm_add_request(llm, request_id: str, prompt_ids, params) -> None:
    """Queue one request of token ids on the engine, its outputs as deltas (what each step adds)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)


def vllm_step_deltas(llm) -> list:
    """One engine step: [(request id, new token ids, their log-probs, finished, cut by max_tokens)] for each
    single-completion request that moved."""
    moved = []
    for request in llm.llm_engine.step():
        for out in request.outputs:  # n = 1: one each
            tokens = list(out.token_ids)
            logprobs = [step[tok].logprob for step, tok in zip(out.logprobs or [], tokens)]
            moved.append((request.request_id, tokens, logprobs, bool(request.finished), out.finish_reason == "length"))
    return moved


def vllm_unfinished_requests(llm) -> int:
    return llm.llm_engine.get_num_unfinished_requests()


def vllm_abort_requests(llm, request_ids) -> None:
    llm.llm_engine.abort_request(list(request_ids))


def vllm_token_versions(completion, n_tokens: int):
    """The weight version each of a completion's tokens was sampled with (vLLM's spans), or None when the engine
    labelled none."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return None
    versions = [None] * n_tokens
    for span in spans:
        for i in range(max(0, span.start), min(n_tokens, span.end)):
            versions[i] = span.version
    return versions
