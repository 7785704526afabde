"""`GRPOTrainer`: TRL's signature over a hand-written loop on DeepSpeed engines and a colocated generator.

One generation round (`_grpo_step`) is the story of the product:

    rollout → rewards → advantages → reference / old log-probs → policy update → weight sync → metrics

Everything it calls is a module named after its stage: rollout/ (sources, samplers, generators), rewards/,
algorithms/, update.py (the policy update), engines/; schedule.py says when to log, evaluate and save.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from . import checkpoint, compat, device, dist, layout, sequence_parallel, watchdog
from .algorithms import (Truncation, compute_advantages, entropy_mask, entropy_threshold, nan_std, off_policy_mask,
                         sapo_token_loss, vespo_weights)
from .callbacks import CallbackHandler, TrainerControl, TrainerState
from .config import GRPOConfig
from .data import PromptSource, load_dataset_spec, make_prompt_source
from .engines import ModelLoader, build_inference_engine, build_policy_engine, completion_logprobs, is_zero3, resolve
from .engines import lora, routing
from .engines.builder import prepare_model
from .engines.forward import packed_forward, packing_leak
from .engines.weights import named_full_parameters
from .hub import make_pusher
from .logging import MetricSinks, set_log_levels
from . import evaluation
from .plan import ASSUMED_PROMPT_LENGTH, Hardware, check_at_start as check_memory_at_start, choose_deepspeed
from .preemption import Preemption
from .rewards import RewardStack
from .rollout import SamplingConfig, check_against_checkpoint, connect_generator, make_generator
from .rollout.batch import Batch, BatchBuilder
from .rollout.generating_rank import GeneratingRank
from .rollout.samplers import make_sampler
from .rollout.sources import GenerationSource, RolloutSetup
from .rollout.tools import ToolRunner
from .schedule import Schedule
from .timing import PhaseTimer, highest_peak, phase, step_breakdown
from .update import NonFiniteError, PolicyUpdate, learning_alarm, router_aux_coef

__all__ = ["GRPOTrainer", "NonFiniteError", "save_hf_model"]


@dataclass
class RoundEnd:
    """What follows a round, agreed by every rank."""
    log: bool
    evaluate: bool
    save: bool
    stop: bool
    preempted: bool


class GRPOTrainer:
    # How each round's batch is made (rollout/sources.py). AsyncGRPOTrainer's one difference is its source.
    rollout_source = GenerationSource

    def __init__(self, model, reward_funcs, args: Optional[GRPOConfig] = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None, tools=None, rollout_func=None):
        lora.check_lora_model(model, peft_config)
        self.peft_config = lora.as_lora_config(peft_config) if peft_config is not None else None
        adapter_config = self.peft_config or (model.peft_config[model.active_adapter] if lora.is_peft_model(model) else None)
        self.adapter = lora.fingerprint(adapter_config) if adapter_config is not None else None  # a LoRA policy's shape
        if rollout_func is not None and not callable(rollout_func):
            raise TypeError(f"rollout_func must be a function (prompts, trainer) -> dict, not {type(rollout_func).__name__}.")
        if rollout_func is not None and tools:
            raise ValueError("rollout_func replaces the trainer's generation, so the trainer cannot run `tools` for "
                             "it: call the tools inside rollout_func (and return env_mask), or drop rollout_func.")
        self.rollout_func = rollout_func
        self.args = args = args or GRPOConfig()
        if rollout_func is not None and not args.eval_do_sample:
            raise ValueError("eval_do_sample=False makes evaluation greedy, but rollout_func generates the "
                             "completions itself: sample greedily inside rollout_func, or leave eval_do_sample=True.")
        # --- checks and cheap set-up first: every error is raised before a model is loaded -------------------
        self._check_supported(args, tools)
        device.prepare_process(dist.local_world_size(), args.num_threads)
        device.set_tf32(args.tf32)
        dist.init(timeout_s=args.ddp_timeout)
        # every rank's heartbeat, so a failed collective can name the rank that was lost and where (watchdog.py)
        watchdog.start(dist.rank(dist.EVERYONE), dist.world_size(dist.EVERYONE),
                       step=lambda: self.state.global_step if hasattr(self, "state") else 0)
        set_log_levels(args)
        if dist.is_main():
            compat.warn_if_untested()
        self.rollout_source = self.rollout_source.chosen_by(args)  # an option may ask for a variant of the source
        self.placement = self.rollout_source.placement(args)  # split placement makes its process groups here
        self.world = self.placement.trainers
        args.validate(world_size=self.world)
        self.dtype = device.train_dtype(args.bf16, args.fp16)
        unused_dtype = args.ignored_dtype(self.dtype)
        if unused_dtype and dist.is_main():
            print(f"dsgrpo: warning: {unused_dtype}", file=sys.stderr, flush=True)
        self.hub = make_pusher(args) if self.placement.trains else None  # a Hub that cannot take uploads fails now
        self.server = connect_generator(args)  # so does a vLLM server that is missing or refuses the token
        self.model_path, model_config = self._model_source(model, processing_class)
        router_aux_coef(args, model_config)  # router_aux_loss_coef on a dense model is refused before loading
        self.tokenizer = self._tokenizer(processing_class)
        self.rewards = RewardStack(reward_funcs, args.reward_weights, reward_processing_classes, args.reward_errors_as_none,
                                   trust_remote_code=args.trust_remote_code, code_sandbox=args.code_sandbox)
        self.tool_runner = ToolRunner(tools, args.tool_timeout_s) if tools else None  # checks the schemas now
        self.train_prompts, self.eval_prompts = self._prompt_sources(train_dataset, eval_dataset, model_config)
        self.correctness_column = evaluation.check(args, self.rewards.names)  # pass@k's right / wrong
        checkpoint.check_best_metric(args, evaluation.metric_names(args, list(self.eval_prompts or {}), self.rewards.names))
        hidden = getattr(model_config, "hidden_size", None)
        self.resume_path = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir)
        ds_spec, ref_ds_spec = self._deepspeed_specs(args, model_config, adapter_config)
        self.ds_config = resolve(ds_spec, args, hidden, "deepspeed", train=True, world_size=self.world)
        self.sp_size = sequence_parallel.requested_size(args, self.ds_config)
        self.ds_config.pop("sequence_parallel_size", None)  # data parallelism stays the world's (sequence_parallel.py)
        sequence_parallel.check(self.sp_size, args, self.world, model_config, split=dist.is_split())
        routing.check_replay(args, model_config, rollout_func=rollout_func is not None,
                             on_gpu=device.on_gpu())
        if self.ds_config.get("gradient_accumulation_steps", args.gradient_accumulation_steps) != args.gradient_accumulation_steps:
            raise ValueError(f"deepspeed config sets gradient_accumulation_steps={self.ds_config['gradient_accumulation_steps']} "
                             f"but the GRPOConfig has {args.gradient_accumulation_steps}. Set it to \"auto\" in the JSON.")
        self.frozen_ds_spec = ref_ds_spec  # the reference's and the reward models' engines
        frozen_ds_config = resolve(ref_ds_spec, args, hidden, "ref_deepspeed", train=False, world_size=self.world)
        frozen_ds_config.pop("sequence_parallel_size", None)
        self.ref_ds_config = frozen_ds_config if args.beta and not self.lora_policy else None
        self.memory_plan = check_memory_at_start(  # resolves gradient_checkpointing 'auto'
            args, model_config, self.ds_config, ref_ds_config=frozen_ds_config,
            reward_configs=self.rewards.model_configs(), lora_config=adapter_config,
            asynchronous=self.rollout_source.generates_while_training, world=dist.world_size(dist.EVERYONE),
            local_world=dist.local_world_size(), prompt_length=self.train_prompts.longest_prompt())
        plan = self.memory_plan
        device.choose_heap_trimming(plan.peak_bytes_per_device / plan.hardware.device_bytes if plan else None)
        if args.sync_ref_model and self.lora_policy:
            raise ValueError("sync_ref_model=True with a LoRA policy: its reference is the base model with the adapter "
                             "switched off, which has nothing to mix into. Drop sync_ref_model or train without LoRA.")
        self.tied = bool(getattr(model_config, "tie_word_embeddings", False))
        if self.resume_path:  # refuse a checkpoint this run cannot continue before anything is written
            checkpoint.check_resume(self.resume_path, args, self.world, model_config, self.adapter, self.rollout_source)
        self.spg = args.resolved_steps_per_generation(self.world)
        self.prompts_per_round = args.resolved_generation_batch_size(self.world) // args.num_generations
        total = self._total_steps()
        self.schedule = Schedule.from_args(args, total)
        self.state = TrainerState(max_steps=total, is_world_process_zero=dist.is_main(),
                                  is_local_process_zero=dist.local_rank() == 0, logging_steps=self.schedule.logging_every,
                                  save_steps=self.schedule.save_every, eval_steps=self.schedule.eval_every,
                                  train_batch_size=args.per_device_train_batch_size, num_train_epochs=args.num_train_epochs)
        self.control = TrainerControl()
        self.callbacks = CallbackHandler(callbacks)
        self.timer = PhaseTimer()
        self.sampling = SamplingConfig.from_args(args)
        self.rollout_source.check(args, placement=self.placement, prompts_per_round=self.prompts_per_round,
                                  reward_models=self.rewards.has_models,
                                  evaluates=bool(self.eval_prompts) and args.eval_strategy != "no",
                                  streaming=self.train_prompts.streaming)
        if dist.is_main():
            args.save(os.path.join(args.output_dir, "resolved_config.yaml"))
        # --- the models, the generator and the rollout source -----------------------------------------------
        policy = self._build_engines(model, optimizers) if self.placement.trains else None
        self.generator = make_generator(args, self.placement, model_path=self.model_path,
                                        policy_engine=policy, tokenizer=self.tokenizer,
                                        dtype=self.dtype, zero3=is_zero3(self.ds_config), tied=self.tied,
                                        connected=self.server, total_steps=self.state.max_steps)
        self.sampler = make_sampler(self.generator, self.sampling, tokenizer=self.tokenizer, tool_runner=self.tool_runner,
                                    max_tool_calling_iterations=args.max_tool_calling_iterations,
                                    rollout_func=rollout_func, trainer=self)
        setup = RolloutSetup(
            args=args, prompts=self.train_prompts, sampler=self.sampler, generator=self.generator,
            build_batch=BatchBuilder(self.tokenizer, args.per_device_train_batch_size, args.pad_to_multiple_of),
            reward_matrix=self._reward_matrix, scores_anywhere=not self.rewards.has_models, placement=self.placement,
            prompts_per_round=self.prompts_per_round, steps_per_round=self._steps_per_round(),
            max_steps=self.state.max_steps, tied=self.tied, timer=self.timer)
        # a split-placement generating rank runs its own small loop (vLLM only); every other rank trains
        self.generating_rank = GeneratingRank(setup) if not self.placement.trains else None
        self.source = self.rollout_source(setup) if self.placement.trains else None
        # the sampler's truncation, which the trainer's log-probs reproduce (vLLM's order, or transformers')
        self.truncation = Truncation(self.sampling.top_k, self.sampling.top_p, self.sampling.min_p,
                                     order="vllm" if args.use_vllm else "hf")
        self.budget = self._token_budget(model_config)
        self.update = (PolicyUpdate(args, self.policy, self.world, self.state, self._end_optimizer_step,
                                    self.truncation, self.budget) if self.placement.trains else None)
        self.sinks = MetricSinks(args, self.state.max_steps, enabled=dist.is_main())
        self._save_pending = False  # a due checkpoint waiting for an optimizer-step boundary
        self._last_evaluation = None  # (step, metrics) of the newest evaluation
        self._since_log: List[Dict[str, float]] = []  # rounds since the last logging step (the summary row's)
        self._completion_rows: List[dict] = []  # log_completions: the last round's rows until a logging step
        self.control = self.callbacks.fire("on_init_end", args, self.state, self.control)

    def _check_supported(self, args, tools) -> None:
        """Settings GRPOConfig accepts (TRL's) that this trainer cannot act on yet: refused before anything starts."""
        if args.partial_rollout and (tools or self.rollout_func is not None):
            raise ValueError("partial_rollout=True continues plain completions token by token across rounds; tool "
                             "turns and rollout_func make their own. Set partial_rollout=False.")
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
            if tools:
                raise NotImplementedError("tools with vllm_tensor_parallel_size > 1: the ranks of one engine must make "
                                          "the same generate calls, and tool turns continue per rank. Use "
                                          "vllm_tensor_parallel_size=1 with tools for now.")
            local = dist.local_world_size()
            if local % args.vllm_tensor_parallel_size:
                raise ValueError(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: an engine's ranks must "
                                 f"share a node, but this node runs {local} ranks. Choose a divisor of {local}.")

    @property
    def last_checkpoint(self) -> Optional[str]:
        return self.update.last_checkpoint if self.update is not None else None

    @last_checkpoint.setter
    def last_checkpoint(self, path: Optional[str]) -> None:
        self.update.last_checkpoint = path

    @property
    def lora_policy(self) -> bool:
        """A LoRA policy: only its adapter trains, and its reference is itself with the adapter switched off."""
        return self.adapter is not None

    @property
    def trains(self) -> bool:
        """False on a split-placement generating rank."""
        return self.placement.trains

    @property
    def model(self):
        """The policy as TRL users read it: the (ZeRO-3 partitioned) Hugging Face module inside the engine."""
        return self.policy.module if self.placement.trains else None

    @property
    def processing_class(self):
        return self.tokenizer

    @property
    def reward_processing_classes(self) -> list:
        return self.rewards.processing_classes

    @property
    def reward_func_names(self) -> list:
        return self.rewards.names

    @property
    def optimizer(self):
        return self.policy.optimizer if self.placement.trains else None

    @property
    def lr_scheduler(self):
        return self.policy.lr_scheduler if self.placement.trains else None

    @property
    def ref_model(self):
        """TRL's: the frozen reference's module; None at beta 0 and for a LoRA policy (its reference is itself with
        the adapter switched off)."""
        return self.reference.module if getattr(self, "reference", None) is not None else None

    # TRL's helpers, which users and tests call, over dsgrpo.algorithms
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's instance method: the active tokens whose entropy is at or above the `threshold` quantile of every
        rank's active-token entropies (a collective: every rank calls it). Uses nothing of `self` but the ranks,
        so TRL's tests may call it on a stand-in trainer."""
        active = entropies[mask.bool()].float()
        cut = entropy_threshold(dist.all_gather_ragged(active), 1.0 - threshold)
        return entropy_mask(entropies, mask, 1.0 - threshold, threshold=cut)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)

    @staticmethod
    def get_sapo_token_loss(unclipped_token_loss: torch.Tensor, temperature: float) -> torch.Tensor:
        """TRL's (newer than 1.16) signature: SAPO's gate σ(τ(w - 1))·4/τ of the ratio w, before the advantage
        and the sign (sapo_token_loss applies them)."""
        return -sapo_token_loss(unclipped_token_loss, torch.ones_like(unclipped_token_loss), temperature, temperature)

    @staticmethod
    def get_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio=None, k_pos=2.0,
                          lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
        return vespo_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos, lambda_pos,
                             k_neg, lambda_neg)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """TRL's (transformers') per-micro-step hook, called by the update once per micro-step with the round's
        generation batch as TRL passes it (this rank's dataset rows, each prompt repeated num_generations times):
        it runs the next micro-step (forward, loss, backward, and the optimizer step it completes) and returns
        its loss. Wrap or override it to watch micro-steps; the micro-batch itself comes from the round's
        rollouts."""
        return self.update.next_micro_step()

    def add_callback(self, callback) -> None:
        self.callbacks.add(callback)

    def pop_callback(self, callback):
        return self.callbacks.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callbacks.pop(callback)

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

    # ================================================================================================ the loop
    def train(self, resume_from_checkpoint=None) -> TrainerState:
        """Train to max_steps. `resume_from_checkpoint` (TRL's argument): True for the newest complete checkpoint
        in output_dir, a checkpoint path, or None for what the config says."""
        if resume_from_checkpoint not in (None, False):
            self.resume_path = checkpoint.resolve_resume(resume_from_checkpoint, self.args.output_dir)
            if self.resume_path:
                checkpoint.check_resume(self.resume_path, self.args, self.world, self.policy.module.config
                                        if self.placement.trains else None, self.adapter, self.rollout_source)
        try:
            if self.generating_rank is not None:  # split placement: this rank samples for the trainers until they stop
                resumed = checkpoint.generator_state(self.resume_path, dist.rank(dist.EVERYONE)) if self.resume_path else None
                if self.generating_rank.run(resumed):
                    raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
                return self.state
            try:
                return self._train()
            finally:
                self.source.close()
        except RuntimeError as exc:  # a collective failed (a peer's socket closed, or ddp_timeout): who is lost?
            lost = watchdog.explain(exc)
            if lost is None:
                raise
            raise lost from exc

    def _train(self) -> TrainerState:
        args, state = self.args, self.state
        if self.resume_path:
            self._resume(self.resume_path)
        start, steps_before = time.perf_counter(), state.global_step
        self.control = self.callbacks.fire("on_train_begin", args, state, self.control)
        if args.eval_on_start and self.eval_prompts:
            self.evaluate()
        with Preemption() as preemption:
            while state.global_step < state.max_steps and not self.control.should_training_stop:
                step_before, epochs_before = state.global_step, self._epochs_completed()
                metrics = self._grpo_step()
                if not self.train_prompts.streaming:
                    state.epoch = state.generation_round / self.train_prompts.rounds_per_epoch(self.prompts_per_round)
                state.log_history.append({"step": state.global_step, "epoch": state.epoch, **metrics})
                self._since_log.append(metrics)
                end = self._round_end(step_before, epochs_before, preemption.requested)
                if end.log:
                    self.sinks.log(state.global_step, metrics)
                    if args.log_completions:
                        self._log_completions()
                    if not end.stop:  # the last round's rows also go into the summary row, as TRL's do
                        self._since_log = []
                    self.control = self.callbacks.fire("on_log", args, state, self.control, logs=metrics)
                if end.evaluate:
                    self.evaluate()
                self.source.end_round(save=end.save, stop=end.stop, preempted=end.preempted)
                if end.save:
                    self.save_checkpoint()
                if end.preempted:
                    self.sinks.close()
                    raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
        if args.load_best_model_at_end:
            self._load_best_model()
        self.save_model(args.output_dir)
        if self.hub is not None:
            self.hub.on_end(args.output_dir)
            self.hub.finish()  # uploads in flight end here; one that failed is an error now
        self._log_summary(time.perf_counter() - start, state.global_step - steps_before)
        self.control = self.callbacks.fire("on_train_end", args, state, self.control)
        self.sinks.close()
        return state

    def _round_end(self, step_before: int, epochs_before: int, preempt_requested: bool) -> RoundEnd:
        """What follows this round: the schedule's choices (schedule.py), or'ed with what callbacks asked for
        through TrainerControl (should_log / should_evaluate / should_save / should_training_stop) and with a
        preemption signal. One collective: a signal or a callback's wish may reach only some ranks, and all ranks
        must agree (a checkpoint or an evaluation is collective)."""
        s, c = self.state, self.control
        log, evaluate, save = self.schedule.due(step_before, s.global_step, epochs_before, self._epochs_completed())
        wanted = torch.tensor([float(preempt_requested), float(c.should_log or log), float(c.should_evaluate or evaluate),
                               float(c.should_save or save or self._save_pending),
                               float(c.should_training_stop or s.global_step >= s.max_steps)])
        preempted, log, evaluate, save, stop = (dist.all_reduce_max(wanted) > 0).tolist()
        c.should_log = c.should_evaluate = c.should_save = False  # done; a callback asks again for a later round
        c.should_training_stop = stop
        # a checkpoint waits for a round that ends on an optimizer-step boundary (steps that span rounds): DeepSpeed
        # does not save half-accumulated gradients. A preemption cannot wait; it drops the partial step.
        self._save_pending = save and not preempted and not self.update.at_step_boundary and not stop
        save = save and not self._save_pending
        return RoundEnd(log=log, evaluate=evaluate and bool(self.eval_prompts), save=save or preempted,
                        stop=stop or preempted, preempted=preempted)

    def _epochs_completed(self) -> int:
        if self.train_prompts.streaming:
            return 0
        return int(self.state.generation_round // self.train_prompts.rounds_per_epoch(self.prompts_per_round))

    def save_checkpoint(self) -> str:
        """checkpoint-<step>/ with engine, trainer, rollout-source and RNG states (every rank calls it)."""
        planned = os.path.join(self.args.output_dir, checkpoint.checkpoint_name(self.state.global_step))
        best_before = checkpoint.consider_best(self.state, self.args, self._last_evaluation, planned)
        try:
            with self.source.paused(), phase("checkpoint"):  # a still source: it holds exactly what was sampled so far
                self.source.check_before_save()
                path = checkpoint.save(self)
        except BaseException:
            if best_before is not None:  # the record must not name a checkpoint that was never written
                for key, value in zip(checkpoint.BEST_FIELDS, best_before):
                    setattr(self.state, key, value)
            raise
        self.update.last_checkpoint = path
        if self.hub is not None:
            self.hub.on_save(path, self.args.output_dir, lambda: self.write_model(self.args.output_dir))
        self.control = self.callbacks.fire("on_save", self.args, self.state, self.control, checkpoint=path)
        return path

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the final model is the best checkpoint's (transformers' behaviour)."""
        best, state = self.state.best_model_checkpoint, self.state
        if best is None or not os.path.isdir(best):
            if dist.is_main():
                why = best or "no evaluation ran at a checkpoint"
                print(f"dsgrpo: warning: load_best_model_at_end: no best checkpoint ({why}); the final model is the "
                      "last step's.", flush=True)
            return
        if dist.is_main():
            print(f"dsgrpo: load_best_model_at_end: the final model is {best} (step {state.best_global_step}, "
                  f"{self.args.metric_for_best_model} {state.best_metric:.4g})", flush=True)
        with phase("checkpoint"):
            checkpoint.load_weights(self, best)

    def _resume(self, path: str) -> None:
        with phase("resume"):
            checkpoint.load(self, path)
        # the generator was built from the initial weights: give it the resumed ones before it generates
        self.source.sync_weights(self.policy.module, self.state.generation_round - 1)
        self.sinks.resumed(path, self.state.global_step)

    def _grpo_step(self) -> Dict[str, float]:
        """One generation round: sample, score, update (num_iterations × the round's optimizer steps), sync."""
        args, timer, state = self.args, self.timer, self.state
        step_start = time.perf_counter()
        with timer("generate"):
            batch = self.source.next_batch(state.generation_round)
        with timer("reward"):
            advantages, reward_metrics = self._score(batch, args.num_generations)
        step_before = state.global_step
        with timer("reference"):
            ref_logps = self._reference_logprobs(batch) if args.beta != 0 else None
            # π_old differs from π_θ only when an optimizer step can fall inside the round
            GA = args.gradient_accumulation_steps
            several = args.num_iterations > 1 or self.spg > GA or GA % self.spg != 0
            old_logps = self._logprobs(self.policy, batch, self.truncation) if several else None
        with timer("train"):
            rows = generation_batch_rows(batch)
            train_metrics = self.update.run(batch.micro, batch.rollout.truncated, advantages, old_logps, ref_logps,
                                            micro_step=lambda: self.training_step(self.model, rows))
        alarm = learning_alarm(train_metrics)
        if alarm and dist.is_main():
            print(f"dsgrpo: warning: step {state.global_step}: {alarm}", flush=True)
        with timer("sync"):  # only new weights are sent; the last round's are never sampled from
            self.source.sync_weights(self.policy.module, state.generation_round,
                                     needed=step_before < state.global_step < state.max_steps)
        state.generation_round += 1
        times = self.timer.pop()
        step_s = time.perf_counter() - step_start
        times["completion_tok_per_s"] = reward_metrics.pop("_completion_tokens") / max(1e-9, step_s)
        tokens = int(reward_metrics.pop("_tokens"))
        state.num_input_tokens_seen += tokens
        times.update(step_breakdown(times, tokens, dist.world_size(), step_s), **self.source.sync_metrics())
        return {**batch.metrics, **reward_metrics, **train_metrics, **times, "num_tokens": float(state.num_input_tokens_seen)}

    # ============================================================================================ the stages
    def _reward_matrix(self, batch: Batch) -> torch.Tensor:
        """[L, K]: every reward source on this rank's completions (collective when a reward model is sharded)."""
        return self.rewards(batch.prompts, batch.completions, batch.rollout.completion_ids, batch.columns,
                            trainer_state=self.state)

    def _score(self, batch: Batch, group: int):
        """Rewards (the source's, when it scored) → advantages. Rewards are gathered from every rank so each
        group's statistics are exact."""
        args = self.args
        local = self._reward_matrix(batch) if batch.rewards is None else batch.rewards                    # [L, K]
        r = batch.rollout
        extra = torch.stack([r.lengths(), torch.tensor(r.truncated, dtype=torch.float32),
                             torch.tensor([len(p) for p in r.prompt_ids], dtype=torch.float32)], dim=1)  # [L, 3]
        gathered = dist.all_gather(torch.cat([local, extra], dim=1))                                       # [N, K+3]
        rewards, lengths, truncated, prompt_lens = gathered[:, :-3], gathered[:, -3], gathered[:, -2], gathered[:, -1]
        adv, stats = compute_advantages(rewards, group, reward_weights=args.reward_weights,
                                        scale_rewards=args.scale_rewards_mode,
                                        multi_objective_aggregation=args.multi_objective_aggregation)
        self._scored = (stats["rewards"], rewards)  # every rank's weighted totals [N] and per function [N, K]
        L = len(r)
        mine = adv[dist.rank() * L:(dist.rank() + 1) * L]
        metrics = {"reward": torch.nanmean(stats["rewards"]).item(), "reward_std": stats["std_per_group"].mean().item(),
                   "frac_reward_zero_std": stats["frac_reward_zero_std"].item(),
                   "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
                   "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item(),
                   "_completion_tokens": lengths.sum().item(), "_tokens": (lengths.sum() + prompt_lens.sum()).item()}
        for k, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
            metrics[f"rewards/{name}/std"] = nan_std(rewards[:, k], dim=0).item()
        if self.rewards.remote_names:  # a flapping scorer shows as retries before it fails a step
            retries = dist.all_reduce_sum(torch.tensor(self.rewards.pop_retries()))
            metrics.update({f"rewards/{name}/retries": n.item() for name, n in zip(self.rewards.remote_names, retries)})
        if args.log_completions:  # the rows of this round (written at the next logging step) or evaluation
            offset = dist.rank() * L
            self._completion_rows = [{"prompt": str(p), "completion": str(c), "advantage": float(mine[i]),
                                      "reward": float(stats["rewards"][offset + i]), "rank": dist.rank()}
                                     for i, (p, c) in enumerate(zip(batch.prompts, batch.completions))]
        return mine, metrics

    def _log_completions(self) -> None:
        """TRL's completions table at a logging step (or an evaluation): the last scored rows of every rank (a
        collective), written by rank 0."""
        rows, self._completion_rows = self._completion_rows, []
        self.sinks.log_completions(self.state.global_step, [r for part in dist.all_gather_object(rows) for r in part])

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

    @torch.no_grad()
    def _logprobs(self, engine, batch: Batch, truncation=None) -> List[torch.Tensor]:
        """Per-token log-probs of every micro-batch under a frozen view of `engine`: π_old (with the sampler's
        truncation) or the reference (without: the KL term compares untruncated distributions)."""
        if self.budget is not None:
            return layout.packed_logprobs(
                lambda step, owner: packed_forward(engine, step, self.args.temperature, truncation=truncation,
                                                   chunk_tokens=self.args.logprob_chunk_tokens, sp=self.budget.sp,
                                                   owner=owner).logps,
                batch.micro, self.budget)
        return [completion_logprobs(engine, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1],
                                    self.args.temperature, truncation=truncation,
                                    chunk_tokens=self.args.logprob_chunk_tokens, routes=mb.get("routes"))[0]
                for mb in batch.micro]

    def _reference_logprobs(self, batch: Batch) -> List[torch.Tensor]:
        if self.lora_policy:  # the reference is the base model: the same engine with its adapters switched off
            with self.policy.module.disable_adapter():
                return self._logprobs(self.policy, batch)
        return self._logprobs(self.reference, batch)

    def _end_optimizer_step(self) -> None:
        """After each optimizer step (PolicyUpdate calls it)."""
        a, state = self.args, self.state
        state.global_step += 1
        if a.sync_ref_model and self.reference is not None and state.global_step % a.ref_model_sync_steps == 0:
            mix_reference(self.reference, self.policy, a.ref_model_mixup_alpha)
        if a.torch_empty_cache_steps and state.global_step % a.torch_empty_cache_steps == 0:
            device.empty_cache()
        self.sinks.advance()
        self.control = self.callbacks.fire("on_step_end", a, state, self.control)

    def evaluate(self) -> Dict[str, float]:
        """Generate on every eval set (each split across ranks) and log eval_reward and per-function means; a dict
        of named sets logs eval_<name>_reward and so on for each."""
        group = evaluation.eval_group(self.args)
        out = {}
        for name, prompts in self.eval_prompts.items():
            with self.source.paused(), phase("evaluate"):  # evaluation shares the engine
                batch = self.source.evaluation_batch(prompts, group)
                _, metrics = self._score(batch, group)
                if self.args.log_completions:  # an evaluation logs its table at once, as TRL's evaluate does
                    self._log_completions()
            prefix = f"eval_{name}_" if name else "eval_"
            out[f"{prefix}reward"] = metrics["reward"]
            out.update({f"{prefix}{k}": v for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean")})
            totals, per_function = self._scored
            decides = totals if self.correctness_column is None else per_function[:, self.correctness_column]
            if self.args.eval_pass_at_k:
                out.update({f"{prefix}{k}": v for k, v in evaluation.sample_metrics(
                    totals, decides, group, self.args.eval_pass_at_k, self.args.eval_correct_threshold).items()})
            if self.args.eval_maj_at_k:  # every rank's answers, in the order of the gathered rewards
                answers = [a for part in dist.all_gather_object([evaluation.final_answer(c) for c in batch.completions])
                           for a in part]
                out.update({f"{prefix}{k}": v for k, v in evaluation.majority_metrics(
                    answers, decides, group, self.args.eval_maj_at_k, self.args.eval_correct_threshold).items()})
        self.state.log_history.append({"step": self.state.global_step, "epoch": self.state.epoch, **out})
        self._last_evaluation = (self.state.global_step, out)  # ranks the checkpoint of this step (checkpoint.py)
        self.sinks.log(self.state.global_step, out)
        self.control = self.callbacks.fire("on_evaluate", self.args, self.state, self.control, metrics=out)
        return out

    def _log_summary(self, seconds: float, steps: int) -> None:
        """transformers' last log_history row: train_runtime, throughput and the mean loss of this train() call."""
        losses = [h["loss"] for h in self.state.log_history if "loss" in h and "train_runtime" not in h]
        rounds = max(1, math.ceil(steps / max(1, self._steps_per_round())))
        row = {"train_runtime": seconds, "train_samples_per_second": rounds * self.prompts_per_round / max(seconds, 1e-9),
               "train_steps_per_second": steps / max(seconds, 1e-9), "total_flos": self.state.total_flos,
               "train_loss": sum(losses) / len(losses) if losses else float("nan"),
               "epoch": self.state.epoch, "step": self.state.global_step}
        peaks = dist.all_gather_object(highest_peak())  # against the start-up plan (bench/plan_vs_measured.py)
        row["memory/peak_bytes_max"] = max(peaks)
        if self.memory_plan is not None:
            row["memory/planned_peak_bytes"] = self.memory_plan.peak_bytes_per_device
        if dist.is_main():
            with open(os.path.join(self.args.output_dir, "memory.json"), "w") as fh:
                json.dump({"measured_peak_bytes_per_rank": peaks, "plan": self.memory_plan.to_json()
                           if self.memory_plan is not None else None}, fh, indent=1)
        # TRL's last row also carries the mean of the metrics of the rounds since the last logging step (its log()
        # merges what it accumulated): users and TRL's tests read log_history[-1]["reward"] and the like. The sinks
        # get the summary alone (those rounds' rows are in log_history already)
        self.state.log_history.append({**mean_metrics(self._since_log), **row})
        self._since_log = []
        self.sinks.log(self.state.global_step, {k: v for k, v in row.items() if k != "step"})

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Hugging Face format (config, safetensors, tokenizer), loadable by AutoModelForCausalLM and vLLM. A LoRA
        policy saves its adapter in PEFT's format (as TRL does), and with `save_merged_model` the merged model in
        output_dir/merged too. Every rank takes part in the gathers; rank 0 writes."""
        self.write_model(output_dir or self.args.output_dir)
        self.control = self.callbacks.fire("on_save", self.args, self.state, self.control)

    def write_model(self, output_dir: str) -> None:
        """save_model without the callback (checkpoints with save_only_model write this)."""
        module, bucket = self.policy.module, self.args.weight_sync_bucket_bytes
        if self.lora_policy:
            lora.save_adapter(module, output_dir, bucket, dist.is_main())
            if self.args.save_merged_model:
                save_hf_model(module, os.path.join(output_dir, "merged"), bucket, self.tokenizer)
        else:
            save_hf_model(module, output_dir, bucket)
        if dist.is_main():
            self.tokenizer.save_pretrained(output_dir)
        dist.barrier("model saved before anyone reads it")

    # ================================================================================================ set-up
    def _deepspeed_specs(self, args, model_config, adapter_config):
        """The policy's and the frozen engines' DeepSpeed configs: "auto" is chosen by the memory plan (whole weights
        where they fit, plan.choose_deepspeed), or kept from the checkpoint being resumed; recorded in checkpoints."""
        ds_spec, ref_ds_spec, auto_choice = choose_deepspeed(
            args, model_config, Hardware.this_run(), world=self.world, reward_configs=self.rewards.model_configs(),
            lora_config=adapter_config, asynchronous=self.rollout_source.generates_while_training,
            prompt_length=self.train_prompts.longest_prompt(),
            resumed=checkpoint.deepspeed_auto_of(self.resume_path) if self.resume_path else None)
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
        context = args.vllm_max_model_length or getattr(model_config, "max_position_embeddings", None)
        common = dict(max_prompt_length=args.max_prompt_length, context_length=context,
                      max_completion_length=args.max_completion_length, chat_template_kwargs=template_kwargs,
                      keep_columns=not args.remove_unused_columns)
        train = make_prompt_source(load_dataset_spec(train_dataset), self.tokenizer, **common)
        if train.streaming:
            streaming_limits(args)
        if self.tool_runner is not None and not train.conversational:
            raise ValueError("tools need conversational prompts (lists of messages): the chat template is what shows "
                             "the model the tools. Give train_dataset a 'prompt' column of message lists.")
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

    def _steps_per_round(self) -> float:
        """Optimizer steps a round feeds (fractional when steps_per_generation is not a multiple of
        gradient_accumulation_steps: a step's accumulation then spans rounds)."""
        a = self.args
        steps = a.num_iterations * self.spg / a.gradient_accumulation_steps
        return int(steps) if steps == int(steps) else steps

    def _total_steps(self) -> int:
        a = self.args
        if a.max_steps > 0:
            return a.max_steps
        rounds = math.ceil(a.num_train_epochs * self.train_prompts.rounds_per_epoch(self.prompts_per_round))
        return max(1, int(rounds * self._steps_per_round()))


def generation_batch_rows(batch: Batch) -> List[dict]:
    """The round's dataset rows, one per completion (the `inputs` TRL's training_step receives)."""
    return [{"prompt": p, **{k: v[i] for k, v in batch.columns.items()}} for i, p in enumerate(batch.prompts)]


def mean_metrics(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """Each metric's mean over the rows that have it (NaN-free values only)."""
    sums: Dict[str, List[float]] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


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


@torch.no_grad()
def mix_reference(reference, policy, alpha: float) -> None:
    """TR-DPO's reference update, π_ref ← α·π_θ + (1 − α)·π_ref, on each rank's own partitions when both engines
    partition the same architecture over the same ranks (nothing is gathered), else on gathered whole tensors
    (engines/weights.py: mix_partitions)."""
    from .engines.weights import mix_partitions
    mix_partitions(reference.module, policy.module, alpha)


def save_hf_model(module, output_dir: str, bucket_bytes: int, tokenizer=None, gathers_on_every_rank: bool = True) -> None:
    """Full (for a LoRA policy: merged) weights of `module` in Hugging Face format. With `gathers_on_every_rank`
    every rank iterates the (collective) gathers and rank 0 writes; without, the caller alone does both."""
    writes = dist.is_main() or not gathers_on_every_rank
    state_dict = {}
    for name, tensor in named_full_parameters(module, bucket_bytes):
        if writes:
            state_dict[name] = tensor
    if writes:
        model = module.get_base_model() if lora.is_peft_model(module) else module
        model.config.use_cache = True  # gradient checkpointing turned it off for training only
        model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
