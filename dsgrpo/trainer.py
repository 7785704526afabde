"""`GRPOTrainer`: TRL's signature over a hand-written loop on DeepSpeed engines and a colocated generator.

One generation round (`_grpo_step`) is the story of the product:

    rollout → rewards → advantages → reference / old log-probs → policy update → weight sync → metrics

Everything it calls is a module named after its stage: rollout/, rewards/, algorithms/, engines/.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from . import checkpoint, compat, device, dist
from .algorithms import compute_advantages, entropy_mask, nan_std, policy_loss
from .callbacks import CallbackHandler, TrainerControl, TrainerState
from .config import GRPOConfig
from .data import PromptSource, load_dataset_spec
from .engines import ModelLoader, build_inference_engine, build_policy_engine, completion_logprobs, is_zero3, resolve
from .engines import lora
from .engines.weights import named_full_parameters
from .logging import MetricSinks
from .metrics import MetricAccumulator
from .preemption import Preemption
from .rewards import RewardStack
from .rollout import SamplingConfig, check_against_checkpoint, make_generator
from .rollout.batch import Batch, BatchBuilder
from .rollout.generating_rank import GeneratingRank
from .rollout.samplers import make_sampler
from .rollout.sources import GenerationSource, RolloutSetup
from .rollout.tools import ToolRunner
from .timing import PhaseTimer


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops instead of training on."""


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
        # --- checks and cheap set-up first: every error is raised before a model is loaded -------------------
        device.prepare_process(dist.local_world_size(), args.num_threads)
        dist.init()
        if dist.is_main():
            compat.warn_if_untested()
        self.placement = self.rollout_source.placement(args)  # split placement makes its process groups here
        self.world = self.placement.trainers
        args.validate(world_size=self.world)
        self.model_path, model_config = self._model_source(model, processing_class)
        self.tokenizer = self._tokenizer(processing_class)
        self.rewards = RewardStack(reward_funcs, args.reward_weights, reward_processing_classes, args.reward_errors_as_none)
        context = args.vllm_max_model_len or getattr(model_config, "max_position_embeddings", None)
        self.tool_runner = ToolRunner(tools, args.tool_timeout_s) if tools else None  # checks the schemas now
        template_kwargs = dict(args.chat_template_kwargs or {})
        if self.tool_runner is not None:
            template_kwargs["tools"] = self.tool_runner.schemas  # the chat template lists them in the prompt
        lengths = dict(max_prompt_length=args.max_prompt_length, context_length=context,
                       max_completion_length=args.max_completion_length, chat_template_kwargs=template_kwargs)
        self.train_prompts = PromptSource(load_dataset_spec(train_dataset), self.tokenizer, **lengths)
        if self.tool_runner is not None and not self.train_prompts.conversational:
            raise ValueError("tools need conversational prompts (lists of messages): the chat template is what shows "
                             "the model the tools. Give train_dataset a 'prompt' column of message lists.")
        self.eval_prompts = (PromptSource(load_dataset_spec(eval_dataset), self.tokenizer, field="eval_dataset", **lengths)
                             if eval_dataset is not None else None)
        hidden = getattr(model_config, "hidden_size", None)
        self.ds_config = resolve(args.deepspeed, args, hidden, "deepspeed", train=True)
        if self.ds_config.get("gradient_accumulation_steps", args.gradient_accumulation_steps) != args.gradient_accumulation_steps:
            raise ValueError(f"deepspeed config sets gradient_accumulation_steps={self.ds_config['gradient_accumulation_steps']} "
                             f"but the GRPOConfig has {args.gradient_accumulation_steps}. Set it to \"auto\" in the JSON.")
        self.ref_ds_config = (resolve(args.ref_deepspeed, args, hidden, "ref_deepspeed", train=False)
                              if args.beta and not self.lora_policy else None)
        self.tied = bool(getattr(model_config, "tie_word_embeddings", False))
        self.resume_path = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir)
        if self.resume_path:  # refuse a checkpoint this run cannot continue before anything is written
            checkpoint.check_resume(self.resume_path, args, self.world, model_config, self.adapter)
        self.spg = args.resolved_steps_per_generation(self.world)
        self.prompts_per_round = args.resolved_generation_batch_size(self.world) // args.num_generations
        self.state = TrainerState(max_steps=self._total_steps(), is_world_process_zero=dist.is_main())
        self.control = TrainerControl()
        self.callbacks = CallbackHandler(callbacks)
        self.timer = PhaseTimer()
        self.sampling = SamplingConfig.from_args(args)
        self.dtype = torch.bfloat16 if device.use_bf16(args.bf16) else torch.float32
        self.rollout_source.check(args, placement=self.placement, prompts_per_round=self.prompts_per_round,
                                  reward_models=self.rewards.has_models,
                                  evaluates=self.eval_prompts is not None and args.eval_strategy != "no")
        if dist.is_main():
            args.save(os.path.join(args.output_dir, "resolved_config.yaml"))
        # --- the models, the generator and the rollout source -----------------------------------------------
        policy = self._build_engines(model, optimizers) if self.placement.trains else None
        self.generator = make_generator(args, self.placement, model_path=self.model_path,
                                        policy_engine=policy, tokenizer=self.tokenizer,
                                        dtype=self.dtype, zero3=is_zero3(self.ds_config))
        self.sampler = make_sampler(self.generator, self.sampling, tokenizer=self.tokenizer, tool_runner=self.tool_runner,
                                    max_tool_calling_iterations=args.max_tool_calling_iterations,
                                    rollout_func=rollout_func, trainer=self)
        setup = RolloutSetup(
            args=args, prompts=self.train_prompts, sampler=self.sampler, generator=self.generator,
            build_batch=BatchBuilder(self.tokenizer, args.per_device_train_batch_size),
            reward_matrix=self._reward_matrix, scores_anywhere=not self.rewards.has_models, placement=self.placement,
            prompts_per_round=self.prompts_per_round, steps_per_round=args.num_iterations * self.spg // args.gradient_accumulation_steps,
            max_steps=self.state.max_steps, tied=self.tied, timer=self.timer)
        # a split-placement generating rank runs its own small loop (vLLM only); every other rank trains
        self.generating_rank = GeneratingRank(setup) if not self.placement.trains else None
        self.source = self.rollout_source(setup) if self.placement.trains else None
        self.sinks = MetricSinks(args, self.state.max_steps, enabled=dist.is_main())
        self.last_checkpoint: Optional[str] = None

    @property
    def lora_policy(self) -> bool:
        """A LoRA policy: only its adapter trains, and its reference is itself with the adapter switched off."""
        return self.adapter is not None

    @property
    def trains(self) -> bool:
        """False on a split-placement generating rank."""
        return self.placement.trains

    def _build_engines(self, model, optimizers):
        """Policy (ZeRO-3 partitioned at load; LoRA-wrapped before DeepSpeed), frozen reference (none for a LoRA
        policy: its adapters are switched off instead), reward models. Returns the policy engine."""
        args = self.args
        policy_model = (ModelLoader(self.ds_config, self.dtype).load(self.model_path, **(args.model_init_kwargs or {}))
                        if isinstance(model, str) else model)
        if self.peft_config is not None:
            policy_model = lora.wrap_with_lora(policy_model, self.peft_config, args.seed)
        elif self.lora_policy:
            lora.check_lora_layers(policy_model)
        if self.lora_policy and dist.is_main():
            print(f"dsgrpo: {lora.adapter_summary(policy_model)}", flush=True)
        self.policy = build_policy_engine(policy_model, args, self.ds_config, optimizers[0], optimizers[1], self.state.max_steps)
        self.zero3 = is_zero3(self.ds_config)
        self.reference = (build_inference_engine(ModelLoader(self.ref_ds_config, self.dtype).load(self.model_path),
                                                 self.ref_ds_config) if self.ref_ds_config else None)
        self.rewards.load_models(args=args, ds_spec=args.ref_deepspeed, dtype=self.dtype)
        if args.use_vllm:
            check_against_checkpoint(self.policy.module, self.model_path, self.tied)
        return self.policy

    # ================================================================================================ the loop
    def train(self) -> TrainerState:
        if self.generating_rank is not None:  # split placement: this rank samples for the trainers until they stop
            resumed = checkpoint.generator_state(self.resume_path, dist.rank(dist.EVERYONE)) if self.resume_path else None
            if self.generating_rank.run(resumed):
                raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
            return self.state
        try:
            return self._train()
        finally:
            self.source.close()

    def _train(self) -> TrainerState:
        args, state = self.args, self.state
        if self.resume_path:
            self._resume(self.resume_path)
        self.control = self.callbacks.fire("on_train_begin", args, state, self.control)
        with Preemption() as preemption:
            while state.global_step < state.max_steps and not self.control.should_training_stop:
                step_before = state.global_step
                metrics = self._grpo_step()
                state.log_history.append({"step": state.global_step, **metrics})
                end = self._round_end(step_before, preemption.requested)
                if end.log:
                    self.sinks.log(state.global_step, metrics)
                    self.control = self.callbacks.fire("on_log", args, state, self.control, logs=metrics)
                if end.evaluate:
                    self.evaluate()
                self.source.end_round(save=end.save, stop=end.stop, preempted=end.preempted)
                if end.save:
                    self.save_checkpoint()
                if end.preempted:
                    self.sinks.close()
                    raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
        self.save_model(args.output_dir)
        self.control = self.callbacks.fire("on_train_end", args, state, self.control)
        self.sinks.close()
        return state

    def _round_end(self, step_before: int, preempt_requested: bool) -> RoundEnd:
        """What follows this round: the schedule's choices, or'ed with what callbacks asked for through
        TrainerControl (should_log / should_evaluate / should_save / should_training_stop) and with a preemption
        signal. One collective: a signal or a callback's wish may reach only some ranks, and all ranks must
        agree (a checkpoint or an evaluation is collective)."""
        a, s, c = self.args, self.state, self.control
        wanted = torch.tensor([
            float(preempt_requested),
            float(c.should_log or s.global_step % a.logging_steps == 0 or s.global_step >= s.max_steps
                  or s.generation_round == 1),
            float(c.should_evaluate or self._eval_due()),
            float(c.should_save or s.global_step // a.save_steps > step_before // a.save_steps),
            float(c.should_training_stop or s.global_step >= s.max_steps)])
        preempted, log, evaluate, save, stop = (dist.all_reduce_max(wanted) > 0).tolist()
        c.should_log = c.should_evaluate = c.should_save = False  # done; a callback asks again for a later round
        c.should_training_stop = stop
        return RoundEnd(log=log, evaluate=evaluate and self.eval_prompts is not None, save=save or preempted,
                        stop=stop or preempted, preempted=preempted)

    def save_checkpoint(self) -> str:
        """checkpoint-<step>/ with engine, trainer, rollout-source and RNG states (every rank calls it)."""
        with self.source.paused():  # a still source: the checkpoint holds exactly what was sampled so far
            path = checkpoint.save(self)
        self.last_checkpoint = path
        self.control = self.callbacks.fire("on_save", self.args, self.state, self.control, checkpoint=path)
        return path

    def _resume(self, path: str) -> None:
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
        with timer("reference"):
            ref_logps = self._reference_logprobs(batch) if args.beta != 0 else None
            # π_old differs from π_θ only when one round feeds several optimizer steps
            several = args.num_iterations > 1 or self.spg > args.gradient_accumulation_steps
            old_logps = self._logprobs(self.policy, batch) if several else None
        with timer("train"):
            train_metrics = self._update(batch, advantages, old_logps, ref_logps)
        with timer("sync"):  # the last round's weights are never sampled from
            self.source.sync_weights(self.policy.module, state.generation_round, needed=state.global_step < state.max_steps)
        state.generation_round += 1
        times = self.timer.pop()
        times["completion_tok_per_s"] = reward_metrics.pop("_completion_tokens") / max(1e-9, time.perf_counter() - step_start)
        state.num_input_tokens_seen += int(reward_metrics.pop("_tokens"))
        return {**batch.metrics, **reward_metrics, **train_metrics, **times, "num_tokens": float(state.num_input_tokens_seen)}

    # ============================================================================================ the stages
    def _reward_matrix(self, batch: Batch) -> torch.Tensor:
        """[L, K]: every reward source on this rank's completions (collective when a reward model is sharded)."""
        return self.rewards(batch.prompts, batch.completions, batch.rollout.completion_ids, batch.columns)

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
        if args.log_completions and dist.is_main():
            self.sinks.log_completions(self.state.global_step, [
                {"prompt": str(p), "completion": str(c), "reward": float(stats["rewards"][i]), "advantage": float(mine[i])}
                for i, (p, c) in enumerate(zip(batch.prompts, batch.completions))])
        return mine, metrics

    @torch.no_grad()
    def _logprobs(self, engine, batch: Batch) -> List[torch.Tensor]:
        """Per-token log-probs of every micro-batch under a frozen view of `engine` (reference or π_old)."""
        return [completion_logprobs(engine, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1],
                                    self.args.temperature)[0] for mb in batch.micro]

    def _reference_logprobs(self, batch: Batch) -> List[torch.Tensor]:
        if self.lora_policy:  # the reference is the base model: the same engine with its adapters switched off
            with self.policy.module.disable_adapter():
                return self._logprobs(self.policy, batch)
        return self._logprobs(self.reference, batch)

    def _update(self, batch: Batch, advantages: torch.Tensor, old_logps, ref_logps) -> Dict[str, float]:
        """num_iterations passes over the round's micro-batches, GA micro-batches per optimizer step."""
        args, GA, B = self.args, self.args.gradient_accumulation_steps, self.args.per_device_train_batch_size
        masks = [self._loss_mask(mb, batch.rollout.truncated[j * B:(j + 1) * B]) for j, mb in enumerate(batch.micro)]
        # dapo/cispo normalise by the active tokens of each optimizer step over all ranks: one collective per round
        step_tokens = dist.all_reduce_sum(torch.stack([sum(masks[j].sum() for j in range(s, s + GA))
                                                       for s in range(0, len(masks), GA)]))
        acc = MetricAccumulator()
        for _ in range(args.num_iterations):
            for step, first in enumerate(range(0, len(batch.micro), GA)):
                if self.state.global_step >= self.state.max_steps:
                    break
                loss = sum(self._micro_step(batch.micro[j], masks[j], advantages[j * B:(j + 1) * B],
                                            old_logps[j] if old_logps else None, ref_logps[j] if ref_logps else None,
                                            step_tokens[step], acc) for j in range(first, first + GA))
                self._end_optimizer_step(loss, acc)
        metrics = {**acc.reduce(), "learning_rate": self.policy.get_lr()[0]}
        self._check_finite(metrics, step=self.state.global_step)
        return metrics

    def _micro_step(self, mb: dict, mask: torch.Tensor, advantages, old_logps, ref_logps, step_tokens, acc) -> float:
        """Forward, loss and backward of one micro-batch; returns its share of the optimizer step's loss."""
        args = self.args
        logps, entropy = completion_logprobs(self.policy, mb["input_ids"], mb["attention_mask"], mask.shape[1],
                                             args.temperature, with_entropy=True)
        if args.top_entropy_quantile < 1.0:
            mask = entropy_mask(entropy, mask, args.top_entropy_quantile).float()
        loss, metrics = policy_loss(
            logps, old_logps, advantages, mask, loss_type=args.loss_type, epsilon_low=args.epsilon,
            epsilon_high=args.effective_epsilon_high, delta=args.delta,
            importance_sampling_level=args.importance_sampling_level, beta=args.beta, ref_per_token_logps=ref_logps,
            kl_estimator=args.kl_estimator, sampler_per_token_logps=mb["sampler_logps"], vllm_is_mode=self._is_mode(),
            vllm_is_clip_max=args.vllm_importance_sampling_clip_max, max_completion_length=args.max_completion_length,
            num_items_in_batch=step_tokens, num_processes=self.world,
            gradient_accumulation_steps=args.gradient_accumulation_steps)
        self.policy.backward(loss, scale_wrt_gas=False)  # the loss already carries its share of the step
        self.policy.step()                               # DeepSpeed only steps at the accumulation boundary
        tokens = float(mb["completion_mask"].sum())
        acc.add("entropy", (entropy * mb["completion_mask"]).sum() / max(tokens, 1.0), tokens)
        # how far the generator's log-probs are from the trainer's for the same tokens (TRL's names): a weight
        # sync that went wrong shows up here first
        gap = ((logps.detach() if old_logps is None else old_logps) - mb["sampler_logps"]).abs()[mb["completion_mask"].bool()]
        if gap.numel():
            acc.add("sampling/sampling_logp_difference/mean", gap.mean(), gap.numel())
            acc.add("sampling/sampling_logp_difference/max", gap.max())
        for name, value in metrics.items():
            acc.add(name, value, float(mask.sum()))
        return loss.item()

    # ================================================================================================ helpers
    def _loss_mask(self, mb: dict, truncated: List[bool]) -> torch.Tensor:
        mask = mb["completion_mask"]
        if self.args.mask_truncated_completions:
            mask = mask * (1.0 - torch.tensor(truncated, dtype=mask.dtype)).unsqueeze(1)
        return mask

    def _is_mode(self) -> Optional[str]:
        a = self.args
        return a.vllm_importance_sampling_mode if (a.use_vllm and a.vllm_importance_sampling_correction) else None

    def _end_optimizer_step(self, step_loss: float, acc: MetricAccumulator) -> None:
        grad_norm = self.policy.get_global_grad_norm()  # global over ranks: every rank sees the same value
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        if not math.isfinite(grad_norm):
            self._check_finite({"grad_norm": grad_norm, "loss": step_loss}, step=self.state.global_step + 1)
        acc.add("loss", step_loss)
        acc.add("grad_norm", grad_norm)
        self.state.global_step += 1
        self.sinks.advance()
        self.control = self.callbacks.fire("on_step_end", self.args, self.state, self.control)

    def _check_finite(self, metrics: Dict[str, float], step: int) -> None:
        bad = {k: v for k, v in metrics.items() if k in ("loss", "grad_norm") and not math.isfinite(v)}
        if bad:
            raise NonFiniteError(f"Non-finite training values at optimizer step {step}: {bad}. "
                                 f"Last checkpoint: {self.last_checkpoint or 'none saved yet'}. Lower learning_rate, "
                                 "check the rewards for NaN/inf, or use fp32; the run was stopped rather than continued.")

    def _eval_due(self) -> bool:
        a = self.args
        return (self.eval_prompts is not None and a.eval_strategy == "steps"
                and self.state.global_step % (a.eval_steps or a.logging_steps) == 0)

    def evaluate(self) -> Dict[str, float]:
        """Generate on the whole eval set (split across ranks) and log eval_reward and per-function means."""
        group = self.args.num_generations_eval or self.args.num_generations
        with self.source.paused():  # evaluation shares the engine
            batch = self.source.evaluation_batch(self.eval_prompts, group)
            _, metrics = self._score(batch, group)
        out = {"eval_reward": metrics["reward"],
               **{f"eval_{k}": v for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean")}}
        self.sinks.log(self.state.global_step, out)
        self.control = self.callbacks.fire("on_evaluate", self.args, self.state, self.control, metrics=out)
        return out

    def save_model(self, output_dir: str) -> None:
        """Hugging Face format (config, safetensors, tokenizer), loadable by AutoModelForCausalLM and vLLM. A LoRA
        policy saves its adapter in PEFT's format (as TRL does), and with `save_merged_model` the merged model in
        output_dir/merged too. Every rank takes part in the gathers; rank 0 writes."""
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
        self.control = self.callbacks.fire("on_save", self.args, self.state, self.control)

    # ================================================================================================ set-up
    def _model_source(self, model, processing_class=None):
        """(path vLLM can load, model config). A PreTrainedModel (or PeftModel) instance is saved once, with its
        tokenizer, so vLLM can load it."""
        from transformers import AutoConfig, PreTrainedModel

        from .engines.builder import check_model_source
        if isinstance(model, str):
            check_model_source(model)
            try:
                return model, AutoConfig.from_pretrained(model)
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

        tok = processing_class or AutoTokenizer.from_pretrained(self.model_path)
        tok.padding_side = "left"
        if tok.pad_token is None:
            warnings.warn(f"The tokenizer has no pad token; using eos ({tok.eos_token!r}) for padding.")
            tok.pad_token = tok.eos_token
        if tok.eos_token_id is None:
            raise ValueError("The tokenizer has no eos token: completions could never end. Set tokenizer.eos_token.")
        return tok

    def _total_steps(self) -> int:
        a = self.args
        steps_per_round = a.num_iterations * self.spg // a.gradient_accumulation_steps
        if a.max_steps > 0:
            return a.max_steps
        rounds = math.ceil(a.num_train_epochs * len(self.train_prompts) / self.prompts_per_round)
        return rounds * steps_per_round


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
