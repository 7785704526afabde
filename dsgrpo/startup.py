"""GRPOTrainer's build from its plan (preflight.py decided everything first): the engines (policy, reference,
reward models), the generator and its weight sync, the sampler, the rollout source, the packed-step budget, the
update. trainer.py mixes it in."""

from __future__ import annotations

from typing import Optional

import torch

from . import dist, layout, quantization, sequence_parallel
from .algorithms import Truncation
from .engines import ModelLoader, build_inference_engine, build_policy_engine, is_zero3
from .engines import lora, routing
from .engines.builder import prepare_model
from .engines.forward import packing_leak
from .logging import MetricSinks
from .plan import ASSUMED_PROMPT_LENGTH
from .policy import Policy
from .rollout import TrainerWeightSync, check_against_checkpoint, make_generator
from .rollout.batch import BatchBuilder
from .rollout.generating_rank import GeneratingRank
from .rollout.samplers import make_sampler
from .rollout.sources import RolloutSetup
from .timing import startup_mark
from .update import PolicyUpdate


class TrainerSetup:
    """Mixed into GRPOTrainer: what its __init__ builds, from the plan's fields it holds."""

    def _build(self, model, optimizers, model_config) -> None:
        """From the plan's fields (preflight.py): the engines, the generator and its weight sync, the sampler, the
        rollout source (or a split-placement generating rank's loop), the packed-step budget, the update, the
        metric sinks."""
        args = self.args
        policy = self._build_engines(model, optimizers) if self.placement.trains else None
        self.weight_sync = TrainerWeightSync(args, self.tied)  # the policy's weights into the engine, every step
        self.generator = make_generator(
            args,
            self.placement,
            model_path=self.model_path,
            policy_engine=policy,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            zero3=is_zero3(self.ds_config),
            tied=self.tied,
            connected=self.server,
            total_steps=self.state.max_steps,
            weight_sync=self.weight_sync,
        )
        startup_mark("generation engine")
        self.sampler = make_sampler(
            self.generator,
            self.sampling,
            tokenizer=self.tokenizer,
            tool_runner=self.tool_runner,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            rollout_func=self.rollout_func,
            trainer=self,
            environments=self.environment_set,
            tool_call_format=args.tool_call_format,
        )
        setup = RolloutSetup(
            args=args,
            prompts=self.train_prompts,
            sampler=self.sampler,
            generator=self.generator,
            build_batch=BatchBuilder(self.tokenizer, args.per_device_train_batch_size, args.pad_to_multiple_of),
            reward_matrix=self._reward_matrix,
            scores_anywhere=not self.rewards.has_models,
            placement=self.placement,
            prompts_per_round=self.prompts_per_round,
            steps_after_round=self._steps_after_round,
            max_steps=self.state.max_steps,
            tied=self.tied,
            timer=self.timer,
            reward_weights=self.rewards.weights,
            weight_sync=self.weight_sync,
        )
        # a split-placement generating rank runs its own small loop (vLLM only); every other rank trains
        self.generating_rank = GeneratingRank(setup) if not self.placement.trains else None
        self.source = self.rollout_source(setup) if self.placement.trains else None
        # the sampler's truncation, which the trainer's log-probs reproduce (vLLM's order, or transformers')
        self.truncation = Truncation(
            self.sampling.top_k, self.sampling.top_p, self.sampling.min_p, order="vllm" if args.use_vllm else "hf"
        )
        self.budget = self._token_budget(model_config)
        self.update = (
            PolicyUpdate(
                args,
                self.policy.engine,
                self.world,
                self.state,
                self._end_optimizer_step,
                self.truncation,
                self.budget,
                self.step_plan,
            )
            if self.placement.trains
            else None
        )
        self.sinks = MetricSinks(args, self.state.max_steps, enabled=dist.is_main())

    def _build_engines(self, model, optimizers):
        """Policy (ZeRO-3 partitioned at load; LoRA-wrapped before DeepSpeed), frozen reference (none for a LoRA
        policy: its adapters are switched off instead), reward models. Returns the policy engine."""
        args = self.args
        quantised = {"quantization_config": self.quantization} if self.quantization is not None else {}
        policy_model = (
            ModelLoader(self.ds_config, self.dtype).load(self.model_path, **args.model_load_kwargs, **quantised)
            if isinstance(model, str)
            else model
        )
        startup_mark("policy load")
        if self.quantised:
            quantization.prepare_loaded(policy_model)
        if self.peft_config is not None:
            policy_model = lora.wrap_with_lora(policy_model, self.peft_config, args.seed)
        elif self.lora_policy:
            lora.check_lora_layers(policy_model)
        if self.lora_policy and dist.is_main():
            print(f"dsgrpo: {lora.adapter_summary(policy_model)}", flush=True)
        prepare_model(policy_model, args)
        engine = build_policy_engine(
            policy_model, args, self.ds_config, optimizers[0], optimizers[1], self.state.max_steps
        )
        startup_mark("DeepSpeed (policy)")
        self.zero3 = is_zero3(self.ds_config)
        reference = None
        if self.ref_ds_config:
            reference_model = ModelLoader(self.ref_ds_config, self.dtype).load(
                self.model_path, **args.model_load_kwargs
            )
            prepare_model(reference_model, args)
            reference = build_inference_engine(reference_model, self.ref_ds_config)
            startup_mark("reference")
        self.policy = Policy(
            engine, reference, adapter=self.adapter, tokenizer=self.tokenizer, args=args, world=self.world
        )
        # MoE: the sampler's routes (when the generator captures them) are replayed or compared in every forward
        for each in (engine, reference):
            if each is not None:
                routing.attach(each, replace=args.routing_replay == "rollout")
        self.rewards.load_models(args=args, ds_spec=self.frozen_ds_spec, dtype=self.dtype, world_size=self.world)
        startup_mark("reward models")
        if args.use_vllm and args.vllm_mode == "colocate":  # a server checks its own (ServerGenerator.attach)
            check_against_checkpoint(self.policy.module, self.model_path, self.tied)
        self.callbacks.context.update(
            model=self.policy.module,
            processing_class=self.tokenizer,
            optimizer=engine.optimizer,
            lr_scheduler=engine.lr_scheduler,
        )
        return engine

    # a packed sequence's states may move this much (relative) when its neighbour changes: fp32 (True) and half
    # precision (False) rounding of MoE experts' token-grouped GEMMs; measured leaks are ≥ 0.01 (Bloom) to 0.6
    PACKING_LEAK_TOLERANCE = {True: 1e-4, False: 4e-3}

    def _token_budget(self, model_config) -> Optional[layout.TokenBudget]:
        """Packed steps under token_budget (layout.py), or None for padded micro-batches."""
        args = self.args
        longest_prompt = self.train_prompts.longest_prompt() or args.max_prompt_length or ASSUMED_PROMPT_LENGTH
        tokens = layout.resolve_budget(
            args.token_budget,
            args.per_device_train_batch_size,
            longest_prompt,
            args.max_completion_length,
            sp_size=self.sp_size,
        )
        if tokens is None:
            return None
        text = getattr(model_config, "text_config", None) or model_config
        if self.placement.trains:  # packing is exact only if attention stays inside each sequence: measure it
            engines = [self.policy.engine] + ([self.reference] if self.reference is not None else [])
            leak = max(packing_leak(e, int(getattr(text, "vocab_size", 0) or 2)) for e in engines)
            for engine in engines:  # ZeRO-3 kept the first module's weights gathered after the probe's forwards
                engine.empty_partition_cache()
            if leak > self.PACKING_LEAK_TOLERANCE[self.dtype == torch.float32]:
                name = type(self.policy.module).__name__
                if args.token_budget is not None or self.sp_size > 1:
                    raise ValueError(
                        f"token_budget={args.token_budget} (sequence parallelism {self.sp_size}): {name} "
                        f"(attn_implementation {getattr(model_config, '_attn_implementation', None)!r}) "
                        "lets packed sequences attend to "
                        f"each other (a packed sequence's hidden states moved by {leak:.2g} of their scale when its "
                        "neighbour changed), so packed steps would train on the wrong context. Set token_budget=0 "
                        "(padded micro-batches), or an attn_implementation with packed-sequence support (sdpa, "
                        "eager or flash_attention_2 on a model that uses transformers' masking utilities)."
                    )
                if dist.is_main():
                    print(
                        f"dsgrpo: {name} does not keep packed sequences apart (a leak of {leak:.2g}): training on "
                        "padded micro-batches (token_budget=0).",
                        flush=True,
                    )
                return None
        # sequence parallelism: each packed step is run by the group on shards (sequence_parallel.py)
        sp = (
            sequence_parallel.start(self.sp_size, self.policy.module.config, self.tokenizer.pad_token_id)
            if self.sp_size > 1
            else None
        )
        return layout.TokenBudget(tokens, int(getattr(text, "hidden_size", 0) or 0), self.tokenizer.pad_token_id, sp)
