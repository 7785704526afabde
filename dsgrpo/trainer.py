"""`GRPOTrainer`: TRL's signature over a hand-written loop on DeepSpeed engines and a colocated generator.

One generation round (`_grpo_step`) is the story of the product:

    rollout → rewards → advantages → reference / old log-probs → policy update → weight sync → metrics

Everything it calls is a module named after its stage: rollout/ (sources, samplers, generators), rewards/,
algorithms/, update.py (the policy update), engines/; schedule.py says when to log, evaluate and save. What a
TRL user reads on a trainer besides the loop is in trl_surface.py, and the start-up's steps in startup.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from . import checkpoint, device, dist, layout, resume_guards, watchdog
from .algorithms import compute_advantages
from .callbacks import CallbackHandler, TrainerControl, TrainerState
from .config import GRPOConfig
from .engines import completion_logprobs
from .engines.export import save_hf_model
from .engines.forward import packed_forward
from .metrics import completion_rows, round_metrics
from . import evaluation
from .preemption import Preemption
from .preflight import preflight
from .process_exit import say_line
from .rollout.batch import Batch
from .rollout.sources import GenerationSource
from .startup import TrainerSetup
from .timing import PhaseTimer, StartupClock, phase, step_breakdown
from .trl_surface import TRLSurface, generation_batch_rows
from .update import NonFiniteError, learning_alarm

__all__ = ["GRPOTrainer", "NonFiniteError", "save_hf_model"]


@dataclass
class RoundEnd:
    """What follows a round, agreed by every rank."""

    log: bool
    evaluate: bool
    save: bool
    stop: bool
    preempted: bool


class GRPOTrainer(TrainerSetup, TRLSurface):
    # How each round's batch is made (rollout/sources.py). AsyncGRPOTrainer's one difference is its source.
    rollout_source = GenerationSource

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: Optional[GRPOConfig] = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        clock = StartupClock()  # launch to the first step, part by part: printed once built
        clock.mark("python, imports and the script")
        # --- every check and derived setting first (preflight.py): each error is raised before a model loads ----
        plan = preflight(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            quantization_config,
            peft_config,
            tools,
            rollout_func,
            environment_factory,
            rollout_source=self.rollout_source,
            step=lambda: self.state.global_step if hasattr(self, "state") else 0,
        )
        clock.mark("tokenizer, data, plan")
        for name, value in plan.items():
            setattr(self, name, value)
        self.state = plan.trainer_state()
        self.control, self.callbacks, self.timer = TrainerControl(), CallbackHandler(callbacks), PhaseTimer()
        self._started_at = (0, 0)  # (generation round, optimizer step) where train() starts; set again on resume
        # --- the models, the generator and the rollout source (startup.py) ---------------------------------------
        self._build(model, optimizers, plan.model_config)
        self.startup_seconds = clock.finish("sampler, source, update")
        if dist.is_main():  # one write: another rank's line cannot land inside it (process_exit.say_line)
            say_line(f"dsgrpo: {clock.line()}", fd=1)
        self._save_pending = False  # a due checkpoint waiting for an optimizer-step boundary
        self._last_evaluation = None  # (step, metrics) of the newest evaluation
        self._since_log: List[Dict[str, float]] = []  # rounds since the last logging step (the summary row's)
        self._completion_rows: List[dict] = []  # log_completions: the last round's rows until a logging step
        self.control = self.callbacks.fire("on_init_end", self.args, self.state, self.control)

    # ================================================================================================ the loop
    def train(self, resume_from_checkpoint=None) -> TrainerState:
        """Train to max_steps. `resume_from_checkpoint` (TRL's argument): True for the newest complete checkpoint
        in output_dir, a checkpoint path, or None for what the config says."""
        if resume_from_checkpoint not in (None, False):
            self.resume_path = checkpoint.resolve_resume(resume_from_checkpoint, self.args.output_dir)
            if self.resume_path:
                checkpoint.check_resume(
                    self.resume_path,
                    self.args,
                    self.world,
                    self.policy.module.config if self.placement.trains else None,
                    self.adapter,
                    self.rollout_source,
                )
        if self.environment_set is not None:  # every row names a known environment, before any round is generated
            self.environment_set.check_dataset(self.train_prompts, names_too=True)
        try:
            if self.generating_rank is not None:  # split placement: this rank samples for the trainers until they stop
                resumed = (
                    checkpoint.generator_state(self.resume_path, dist.rank(dist.EVERYONE)) if self.resume_path else None
                )
                if self.generating_rank.run(resumed, initial_weights=self.quantised):
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
        elif self.quantised:  # vLLM loaded the checkpoint; the policy computes with its quantised weights
            self.source.sync_weights(self.policy.module, state.generation_round - 1)
        start, steps_before = time.perf_counter(), state.global_step
        self._started_at = (state.generation_round, state.global_step)
        self.control = self.callbacks.fire("on_train_begin", args, state, self.control)
        if args.eval_on_start and self.eval_prompts:
            self.evaluate()
        with Preemption() as preemption:
            while state.global_step < state.max_steps and not self.control.should_training_stop:
                step_before, epochs_before = state.global_step, self._epochs_completed()
                metrics = self._grpo_step()
                if not self.train_prompts.streaming:
                    state.epoch = self._rounds_of_data() / self.train_prompts.rounds_per_epoch(self.prompts_per_round)
                state.log_history.append({"step": state.global_step, "epoch": state.epoch, **metrics})
                self._since_log.append(metrics)
                end = self._round_end(step_before, epochs_before, preemption.requested)
                if end.log:
                    self.sinks.log(state.global_step, metrics)
                    if args.log_completions:
                        with phase("log"):  # a collective: every rank's rows
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
        wanted = torch.tensor(
            [
                float(preempt_requested),
                float(c.should_log or log),
                float(c.should_evaluate or evaluate),
                float(c.should_save or save or self._save_pending),
                float(c.should_training_stop or s.global_step >= s.max_steps),
            ]
        )
        with phase("round end"):  # where a rank waits when a peer is lost after its own sync (the heartbeat says so)
            preempted, log, evaluate, save, stop = (dist.all_reduce_max(wanted) > 0).tolist()
        c.should_log = c.should_evaluate = c.should_save = False  # done; a callback asks again for a later round
        c.should_training_stop = stop
        # a checkpoint waits for a round that ends on an optimizer-step boundary (steps that span rounds): DeepSpeed
        # does not save half-accumulated gradients. A preemption cannot wait; it drops the partial step.
        self._save_pending = save and not preempted and not self.update.at_step_boundary and not stop
        save = save and not self._save_pending
        return RoundEnd(
            log=log,
            evaluate=evaluate and bool(self.eval_prompts),
            save=save or preempted,
            stop=stop or preempted,
            preempted=preempted,
        )

    def _epochs_completed(self) -> int:
        if self.train_prompts.streaming:
            return 0
        return int(self._rounds_of_data() // self.train_prompts.rounds_per_epoch(self.prompts_per_round))

    def _steps_after_round(self, round_index: int) -> int:
        """Optimizer steps completed once generation round `round_index` is trained (counted on from where this
        train() started: a resumed run's data rounds may restart at round_offset)."""
        (start_round, start_step), offset, plan = self._started_at, self.train_prompts.round_offset, self.step_plan
        return start_step + plan.steps_after(round_index + 1 - offset) - plan.steps_after(start_round - offset)

    def _rounds_of_data(self) -> int:
        """Rounds read from the train dataset (since its start: a reset_data_position resume restarts the count)."""
        return self.state.generation_round - self.train_prompts.round_offset

    def save_checkpoint(self) -> str:
        """checkpoint-<step>/ with engine, trainer, rollout-source and RNG states (every rank calls it)."""
        planned = os.path.join(self.args.output_dir, checkpoint.checkpoint_name(self.state.global_step))
        best_before = checkpoint.consider_best(self.state, self.args, self._last_evaluation, planned)
        try:
            with self.source.paused(), phase("checkpoint"):  # a still source: it holds exactly what was sampled so far
                self.source.check_before_save()
                path = checkpoint.save(self.policy, self.state, self.source, self._run_entries())
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
                print(
                    f"dsgrpo: warning: load_best_model_at_end: no best checkpoint ({why}); the final model is the "
                    "last step's.",
                    flush=True,
                )
            return
        if dist.is_main():
            print(
                f"dsgrpo: load_best_model_at_end: the final model is {best} (step {state.best_global_step}, "
                f"{self.args.metric_for_best_model} {state.best_metric:.4g})",
                flush=True,
            )
        with phase("checkpoint"):
            checkpoint.load_weights(self.policy, best)

    def _run_entries(self) -> dict:
        """What a checkpoint keeps of this run beside the policy, the state and the source (and a resume compares)."""
        return {
            "entropy_control": self.update.entropy_coef.state_dict(),
            "deepspeed_auto": self.deepspeed_auto,
            **resume_guards.recorded(self.train_prompts, self.rewards.names, self.args),
        }

    def _resume(self, path: str) -> None:
        with phase("resume"):
            saved = checkpoint.load(
                self.policy,
                self.state,
                self.source,
                path,
                prompts=self.train_prompts,
                run=self._run_entries(),
                prompts_per_round=self.prompts_per_round,
            )
        if "entropy_control" in saved:
            self.update.entropy_coef.load_state_dict(saved["entropy_control"])
        self.last_checkpoint = path
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
            old_logps = self._logprobs(self.policy.engine, batch, self.truncation) if several else None
        with timer("train"):
            rows = generation_batch_rows(batch)
            train_metrics = self.update.run(
                batch.micro,
                batch.rollout.truncated,
                advantages,
                old_logps,
                ref_logps,
                micro_step=lambda: self.training_step(self.model, rows),
                round_start=self.step_plan.round_start(self._rounds_of_data()),
            )
        alarm = learning_alarm(train_metrics)
        if alarm and dist.is_main():
            print(f"dsgrpo: warning: step {state.global_step}: {alarm}", flush=True)
        with timer("sync"):  # only new weights are sent; the last round's are never sampled from
            self.source.sync_weights(
                self.policy.module, state.generation_round, needed=step_before < state.global_step < state.max_steps
            )
        state.generation_round += 1
        times = self.timer.pop()
        step_s = time.perf_counter() - step_start
        times["completion_tok_per_s"] = reward_metrics.pop("_completion_tokens") / max(1e-9, step_s)
        tokens = int(reward_metrics.pop("_tokens"))
        state.num_input_tokens_seen += tokens
        times.update(step_breakdown(times, tokens, dist.world_size(), step_s), **self.source.sync_metrics())
        return {
            **batch.metrics,
            **reward_metrics,
            **train_metrics,
            **times,
            "num_tokens": float(state.num_input_tokens_seen),
        }

    # ============================================================================================ the stages
    def _reward_matrix(self, batch: Batch) -> torch.Tensor:
        """[L, K]: every reward source on this rank's completions (collective when a reward model is sharded)."""
        return self.rewards(
            batch.prompts, batch.completions, batch.rollout.completion_ids, batch.columns, trainer_state=self.state
        )

    def _score(self, batch: Batch, group: int):
        """Rewards (the source's, when it scored) → advantages. Rewards are gathered from every rank so each
        group's statistics are exact."""
        args = self.args
        local = self._reward_matrix(batch) if batch.rewards is None else batch.rewards  # [L, K]
        r = batch.rollout
        extra = torch.stack(
            [
                r.lengths(),
                torch.tensor(r.truncated, dtype=torch.float32),
                torch.tensor([len(p) for p in r.prompt_ids], dtype=torch.float32),
            ],
            dim=1,
        )  # [L, 3]
        gathered = dist.all_gather(torch.cat([local, extra], dim=1))  # [N, K+3]
        rewards, lengths, truncated, prompt_lens = gathered[:, :-3], gathered[:, -3], gathered[:, -2], gathered[:, -1]
        adv, stats = compute_advantages(
            rewards,
            group,
            reward_weights=self.rewards.weights,
            scale_rewards=args.scale_rewards_mode,
            multi_objective_aggregation=args.multi_objective_aggregation,
        )
        self._scored = (stats["rewards"], rewards)  # every rank's weighted totals [N] and per function [N, K]
        L = len(r)
        mine = adv[dist.rank() * L : (dist.rank() + 1) * L]
        metrics = round_metrics(stats, rewards, self.rewards.names, lengths, truncated, prompt_lens)
        if self.rewards.remote_names:  # a flapping scorer shows as retries before it fails a step
            retries = dist.all_reduce_sum(torch.tensor(self.rewards.pop_retries()))
            metrics.update({f"rewards/{name}/retries": n.item() for name, n in zip(self.rewards.remote_names, retries)})
        if self.rewards.counted_names:  # rows a sandbox could not judge: None, never a 0 that reads as wrong
            errors = dist.all_reduce_sum(torch.tensor(self.rewards.pop_errors()))
            metrics.update({f"rewards/{name}/errors": n.item() for name, n in zip(self.rewards.counted_names, errors)})
        if args.log_completions:  # the rows of this round (written at the next logging step) or evaluation
            offset = dist.rank() * L
            self._completion_rows = completion_rows(
                batch,
                mine,
                stats["rewards"][offset : offset + L],
                rewards[offset : offset + L],
                self.rewards.names,
                group,
                dist.rank(),
            )
        return mine, metrics

    def _log_completions(self) -> None:
        """TRL's completions table at a logging step (or an evaluation): the last scored rows of every rank (a
        collective), written by rank 0."""
        rows, self._completion_rows = self._completion_rows, []
        self.sinks.log_completions(self.state.global_step, [r for part in dist.all_gather_object(rows) for r in part])

    @torch.no_grad()
    def _logprobs(self, engine, batch: Batch, truncation=None) -> List[torch.Tensor]:
        """Per-token log-probs of every micro-batch under a frozen view of `engine`: π_old (with the sampler's
        truncation) or the reference (without: the KL term compares untruncated distributions)."""
        if self.budget is not None:
            return layout.packed_logprobs(
                lambda step, owner: (
                    packed_forward(
                        engine,
                        step,
                        self.args.temperature,
                        truncation=truncation,
                        chunk_tokens=self.args.logprob_chunk_tokens,
                        sp=self.budget.sp,
                        owner=owner,
                    ).logps
                ),
                batch.micro,
                self.budget,
            )
        return [
            completion_logprobs(
                engine,
                mb["input_ids"],
                mb["attention_mask"],
                mb["completion_mask"].shape[1],
                self.args.temperature,
                truncation=truncation,
                chunk_tokens=self.args.logprob_chunk_tokens,
                routes=mb.get("routes"),
            )[0]
            for mb in batch.micro
        ]

    def _reference_logprobs(self, batch: Batch) -> List[torch.Tensor]:
        with self.policy.reference_view() as engine:  # a LoRA policy's: its own engine, its adapter switched off
            return self._logprobs(engine, batch)

    def _end_optimizer_step(self) -> None:
        """After each optimizer step (PolicyUpdate calls it)."""
        a, state = self.args, self.state
        state.global_step += 1
        if a.sync_ref_model and self.reference is not None and state.global_step % a.ref_model_sync_steps == 0:
            self.policy.mix_into_reference(a.ref_model_mixup_alpha)  # TR-DPO
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
            out.update(
                {f"{prefix}{k}": v for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean")}
            )
            totals, per_function = self._scored
            decides = totals if self.correctness_column is None else per_function[:, self.correctness_column]
            if self.args.eval_pass_at_k:
                out.update(
                    {
                        f"{prefix}{k}": v
                        for k, v in evaluation.sample_metrics(
                            totals, decides, group, self.args.eval_pass_at_k, self.args.eval_correct_threshold
                        ).items()
                    }
                )
            if self.args.eval_maj_at_k:  # every rank's answers, in the order of the gathered rewards
                answers = [
                    a
                    for part in dist.all_gather_object([evaluation.final_answer(c) for c in batch.completions])
                    for a in part
                ]
                out.update(
                    {
                        f"{prefix}{k}": v
                        for k, v in evaluation.majority_metrics(
                            answers, decides, group, self.args.eval_maj_at_k, self.args.eval_correct_threshold
                        ).items()
                    }
                )
        self.state.log_history.append({"step": self.state.global_step, "epoch": self.state.epoch, **out})
        self._last_evaluation = (self.state.global_step, out)  # ranks the checkpoint of this step (checkpoint.py)
        self.sinks.log(self.state.global_step, out)
        self.control = self.callbacks.fire("on_evaluate", self.args, self.state, self.control, metrics=out)
        return out
