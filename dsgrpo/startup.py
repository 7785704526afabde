"""GRPOTrainer's start-up: the checks that refuse a run before anything is built, and the pieces __init__ builds
(the model source and tokenizer, the prompt sets, the DeepSpeed specs, the engines, the packed-step budget, the
step counts). trainer.py mixes it in; __init__ there says in which order they run."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from . import dist, layout, sequence_parallel
from .data import PromptSource, load_dataset_spec, make_prompt_source
from .engines import ModelLoader, build_inference_engine, build_policy_engine, is_zero3
from .engines import lora, routing
from .engines.builder import prepare_model
from .engines.export import save_hf_model
from .engines.forward import packing_leak
from .plan import ASSUMED_PROMPT_LENGTH, Hardware, choose_deepspeed
from .run_identity import deepspeed_auto_of
from .steps import StepPlan
from .rollout import check_against_checkpoint
from .rollout.environments import environment_prompts
from .rollout.server_client import check_server_context


class TrainerSetup:
    """Mixed into GRPOTrainer: the start-up steps its __init__ runs."""

    def _check_supported(self, args) -> None:
        """Settings GRPOConfig accepts (TRL's) that this trainer cannot act on yet: refused before anything starts."""
        if args.partial_rollout and self.rollout_func is not None:
            raise ValueError("partial_rollout=True continues completions token by token across rounds; a rollout_func "
                             "makes its own. Set partial_rollout=False.")
        if args.use_vllm and args.vllm_mode == "server":
            if args.async_placement == "split":
                raise ValueError("async_placement='split' makes some of the trainer's ranks generate, and "
                                 "vllm_mode='server' generates on the server: use async_placement='colocate' (the "
                                 "default) with a server.")
            if args.vllm_tensor_parallel_size > 1 and dist.is_main():
                print("dsgrpo: warning: vllm_tensor_parallel_size applies to vllm_mode='colocate' (as in TRL); a "
                      "server's engine is sharded by `dsgrpo vllm-serve --tensor-parallel-size`.", flush=True)
        elif args.vllm_tensor_parallel_size > 1:
            if not args.use_vllm:
                raise ValueError("vllm_tensor_parallel_size > 1 shards a vLLM engine; use_vllm=False generates with "
                                 "the policy itself. Set vllm_tensor_parallel_size=1.")
            local = dist.local_world_size()
            if local % args.vllm_tensor_parallel_size:
                raise ValueError(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: an engine's ranks must "
                                 f"share a node, but this node runs {local} ranks. Choose a divisor of {local}.")

    def _build_engines(self, model, optimizers):
        """Policy (ZeRO-3 partitioned at load; LoRA-wrapped before DeepSpeed), frozen reference (none for a LoRA
        policy: its adapters are switched off instead), reward models. Returns the policy engine."""
        args = self.args
        policy_model = (ModelLoader(self.ds_config, self.dtype).load(self.model_path, **args.model_load_kwargs)
                        if isinstance(model, str) else model)
        if self.peft_config is not None:
            policy_model = lora.wrap_with_lora(policy_model, self.peft_config, args.seed)
        elif self.lora_policy:
            lora.check_lora_layers(policy_model)
        if self.lora_policy and dist.is_main():
            print(f"dsgrpo: {lora.adapter_summary(policy_model)}", flush=True)
        prepare_model(policy_model, args)
        self.policy = build_policy_engine(policy_model, args, self.ds_config, optimizers[0], optimizers[1], self.state.max_steps)
        self.zero3 = is_zero3(self.ds_config)
        self.reference = None
        if self.ref_ds_config:
            reference = ModelLoader(self.ref_ds_config, self.dtype).load(self.model_path, **args.model_load_kwargs)
            prepare_model(reference, args)
            self.reference = build_inference_engine(reference, self.ref_ds_config)
        # MoE: the sampler's routes (when the generator captures them) are replayed or compared in every forward
        for engine in (self.policy, self.reference):
            if engine is not None:
                routing.attach(engine, replace=args.routing_replay == "rollout")
        self.rewards.load_models(args=args, ds_spec=self.frozen_ds_spec, dtype=self.dtype, world_size=self.world)
        if args.use_vllm and args.vllm_mode == "colocate":  # a server checks its own (ServerGenerator.attach)
            check_against_checkpoint(self.policy.module, self.model_path, self.tied)
        self.callbacks.context.update(model=self.policy.module, processing_class=self.tokenizer,
                                      optimizer=self.policy.optimizer, lr_scheduler=self.policy.lr_scheduler)
        return self.policy

    # a packed sequence's states may move this much (relative) when its neighbour changes: fp32 (True) and half
    # precision (False) rounding of MoE experts' token-grouped GEMMs; measured leaks are ≥ 0.01 (Bloom) to 0.6
    PACKING_LEAK_TOLERANCE = {True: 1e-4, False: 4e-3}

    def _token_budget(self, model_config) -> Optional[layout.TokenBudget]:
        """Packed steps under token_budget (layout.py), or None for padded micro-batches."""
        args = self.args
        longest_prompt = self.train_prompts.longest_prompt() or args.max_prompt_length or ASSUMED_PROMPT_LENGTH
        tokens = layout.resolve_budget(args.token_budget, args.per_device_train_batch_size, longest_prompt,
                                       args.max_completion_length, sp_size=self.sp_size)
        if tokens is None:
            return None
        text = getattr(model_config, "text_config", None) or model_config
        if self.placement.trains:  # packing is exact only if attention stays inside each sequence: measure it
            engines = [self.policy] + ([self.reference] if self.reference is not None else [])
            leak = max(packing_leak(e, int(getattr(text, "vocab_size", 0) or 2)) for e in engines)
            for engine in engines:  # ZeRO-3 kept the first module's weights gathered after the probe's forwards
                engine.empty_partition_cache()
            if leak > self.PACKING_LEAK_TOLERANCE[self.dtype == torch.float32]:
                name = type(getattr(self.policy, "module", self.policy)).__name__
                if args.token_budget is not None or self.sp_size > 1:
                    raise ValueError(
                        f"token_budget={args.token_budget} (sequence parallelism {self.sp_size}): {name} (attn_implementation "
                        f"{getattr(model_config, '_attn_implementation', None)!r}) lets packed sequences attend to "
                        f"each other (a packed sequence's hidden states moved by {leak:.2g} of their scale when its "
                        "neighbour changed), so packed steps would train on the wrong context. Set token_budget=0 "
                        "(padded micro-batches), or an attn_implementation with packed-sequence support (sdpa, "
                        "eager or flash_attention_2 on a model that uses transformers' masking utilities).")
                if dist.is_main():
                    print(f"dsgrpo: {name} does not keep packed sequences apart (a leak of {leak:.2g}): training on "
                          "padded micro-batches (token_budget=0).", flush=True)
                return None
        # sequence parallelism: each packed step is run by the group on shards (sequence_parallel.py)
        sp = sequence_parallel.start(self.sp_size, self.policy.module.config, self.tokenizer.pad_token_id) \
            if self.sp_size > 1 else None
        return layout.TokenBudget(tokens, int(getattr(text, "hidden_size", 0) or 0), self.tokenizer.pad_token_id, sp)

    def _deepspeed_specs(self, args, model_config, adapter_config):
        """The policy's and the frozen engines' DeepSpeed configs: "auto" is chosen by the memory plan (whole weights
        where they fit, plan.choose_deepspeed), or kept from the checkpoint being resumed; recorded in checkpoints."""
        ds_spec, ref_ds_spec, auto_choice = choose_deepspeed(
            args, model_config, Hardware.this_run(), world=self.world, reward_configs=self.rewards.model_configs(),
            lora_config=adapter_config, asynchronous=self.rollout_source.generates_while_training,
            prompt_length=self.train_prompts.longest_prompt(),
            resumed=deepspeed_auto_of(self.resume_path) if self.resume_path else None)
        self.deepspeed_auto = {k: v for k, v in (("deepspeed", ds_spec), ("ref_deepspeed", ref_ds_spec))
                               if getattr(args, k) in (None, "auto")}
        if auto_choice and dist.is_main():
            print(f"dsgrpo: {auto_choice}", flush=True)
        return ds_spec, ref_ds_spec

    def _prompt_sources(self, train_dataset, eval_dataset, model_config):
        """The training prompts (and evaluation prompts, or None), tokenised and checked against the context."""
        args = self.args
        template_kwargs = dict(args.chat_template_kwargs or {})
        if self.tool_runner is not None:
            template_kwargs["tools"] = self.tool_runner.schemas  # the chat template lists them in the prompt
        elif self.environment_set is not None:  # each rollout's prompt is rendered with its own environment's tools;
            template_kwargs["tools"] = self.environment_set.all_schemas()  # these are for the length checks
            train_dataset = environment_prompts(train_dataset, args.resolved_generation_batch_size(self.world)
                                                // args.num_generations)
        context = args.vllm_max_model_length or getattr(model_config, "max_position_embeddings", None)
        common = dict(max_prompt_length=args.max_prompt_length, context_length=context,
                      max_completion_length=args.max_completion_length, chat_template_kwargs=template_kwargs,
                      keep_columns=not args.remove_unused_columns)
        train = make_prompt_source(load_dataset_spec(train_dataset), self.tokenizer, **common)
        if train.streaming:
            streaming_limits(args)
        if self.environment_set is not None:
            self.environment_set.check_dataset(train)
        if (self.tool_runner is not None or self.environment_set is not None) and not train.conversational:
            raise ValueError("tools need conversational prompts (lists of messages): the chat template is what shows "
                             "the model the tools. Give train_dataset a 'prompt' column of message lists.")
        if self.server is not None:  # the server's context against the prompts it will be sent, before any load
            check_server_context(self.server.max_model_len, args, self.server.url, train.longest_prompt())
        # eval_dataset: one set, or a dict of named sets (metrics then prefixed eval_<name>_, as transformers does)
        named = eval_dataset if isinstance(eval_dataset, dict) else ({"": eval_dataset} if eval_dataset is not None else {})
        evaluation = {name: PromptSource(materialised(load_dataset_spec(ds)), self.tokenizer,
                                         field=f"eval_dataset[{name!r}]" if name else "eval_dataset", **common)
                      for name, ds in named.items()}
        return train, evaluation

    def _model_source(self, model, processing_class=None):
        """(path vLLM can load, model config). A PreTrainedModel (or PeftModel) instance is saved once, with its
        tokenizer, so vLLM can load it."""
        from transformers import AutoConfig, PreTrainedModel

        from .engines.builder import check_model_source
        if isinstance(model, str):
            check_model_source(model)
            try:
                return model, AutoConfig.from_pretrained(model, trust_remote_code=self.args.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise OSError(f"model={model!r}: cannot read its config ({exc}). Pass a folder saved with "
                              "save_pretrained or a cached hub id.") from None
        if not isinstance(model, PreTrainedModel) and not lora.is_peft_model(model):
            raise TypeError(f"model must be a hub id, a local path, a PreTrainedModel or a PeftModel, not "
                            f"{type(model).__name__}.")
        path = os.path.join(self.args.output_dir, "initial_model")
        tokenizer = processing_class or self._tokenizer_of(model)  # every rank: an error stops them all here
        if dist.is_main():  # a PeftModel's initial weights for vLLM: its adapter merged in
            save_hf_model(model, path, self.args.weight_sync_bucket_bytes, tokenizer, gathers_on_every_rank=False)
        dist.barrier("initial model on disk before vLLM loads it", group=dist.EVERYONE)
        return path, model.config

    @staticmethod
    def _tokenizer_of(model):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(model.name_or_path)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"model is a {type(model).__name__} whose name_or_path {model.name_or_path!r} has no "
                             f"tokenizer ({exc}). Pass processing_class=<its tokenizer>.") from None

    def _tokenizer(self, processing_class):
        from transformers import AutoTokenizer

        tok = processing_class or AutoTokenizer.from_pretrained(self.model_path,
                                                                trust_remote_code=self.args.trust_remote_code)
        tok.padding_side = "left"
        if tok.pad_token is None:
            warnings.warn(f"The tokenizer has no pad token; using eos ({tok.eos_token!r}) for padding.")
            tok.pad_token = tok.eos_token
        if tok.eos_token_id is None:
            raise ValueError("The tokenizer has no eos token: completions could never end. Set tokenizer.eos_token.")
        return tok

    def _step_plan(self) -> StepPlan:
        """How many optimizer steps the run makes and which micro-steps each accumulates, as TRL counts (steps.py)."""
        rounds = None if self.train_prompts.streaming else self.train_prompts.rounds_per_epoch(self.prompts_per_round)
        return StepPlan.from_args(self.args, self.prompts_per_round, self.spg, rounds)


def streaming_limits(args) -> None:
    """An IterableDataset has no length: what needs one is refused before anything is built."""
    if args.max_steps <= 0:
        raise ValueError("train_dataset is an IterableDataset, which has no length to count epochs in: set max_steps.")
    for name in ("save_strategy", "logging_strategy", "eval_strategy"):
        if getattr(args, name) == "epoch":
            raise ValueError(f"{name}='epoch' with an IterableDataset: a stream has no epochs to count. Use 'steps'.")


def materialised(dataset):
    """An evaluation set read whole (evaluation goes over every prompt; a stream is read into a Dataset once)."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(dataset))
    return dataset
