"""The update stage of a round: num_iterations passes over the round's micro-batches, gradient_accumulation_steps
micro-batches per optimizer step, each a forward of the policy engine, the GRPO loss (algorithms/policy_loss.py)
and DeepSpeed's backward and step.

What crosses ranks here, every rank in the same order: the active-token counts of the round's optimizer steps
(dapo/cispo/vespo normalise by them, one collective per round), the high-entropy threshold of a micro-batch
(top_entropy_quantile < 1: TRL's quantile over every rank's active tokens), the step's entropy for adaptive entropy
control, and the metric reduction at the end."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from . import device, dist, layout, sequence_parallel
from .algorithms import (
    AdaptiveEntropyCoef,
    LossHyperparams,
    Truncation,
    aggregation_weights,
    entropy_bonus_weights,
    entropy_mask,
    entropy_threshold,
    policy_loss,
)
from .engines import policy_forward, routing
from .engines.forward import packed_forward
from .metrics import MetricAccumulator
from .steps import StepPlan


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops instead of training on."""


@dataclass
class Rows:
    """What the loss needs of the rows one forward scored ([S, T] per token, [S] per row): a padded micro-batch, or
    a packed step's sequences with their micro-batches' token weights."""

    mask: torch.Tensor  # tokens the loss counts
    completion: torch.Tensor  # completion tokens (the entropy and gap metrics)
    advantages: torch.Tensor  # [S]
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    sampler: torch.Tensor
    keep: Optional[torch.Tensor]  # top_entropy_quantile's high-entropy tokens
    step_tokens: Optional[torch.Tensor]  # the normaliser of dapo/cispo/vespo (padded)
    weights: Optional[torch.Tensor] = None  # packed: each token's weight in the loss
    bonus_weights: Optional[torch.Tensor] = None
    versions: Optional[torch.Tensor] = None  # the policy version each token was sampled with (partial rollouts)
    accumulation: int = 1  # padded: micro-steps in this one's optimizer step (its loss's divisor)


class PolicyUpdate:
    def __init__(
        self,
        args,
        policy,
        world: int,
        state,
        on_optimizer_step: Callable[[], None],
        truncation: Optional[Truncation] = None,
        budget: Optional[layout.TokenBudget] = None,
        steps: Optional[StepPlan] = None,
    ):
        """`state` is the trainer's TrainerState (its global_step and max_steps bound the round);
        `on_optimizer_step()` is called after every optimizer step (it advances the step count); `truncation`:
        the sampler's top_k / top_p / min_p, applied to the policy's log-probs (algorithms/truncation.py);
        `budget`: packed token-budget steps (layout.py) instead of padded micro-batches; `steps`: which micro-steps
        each optimizer step accumulates (steps.py; None: every gradient_accumulation_steps, as DeepSpeed counts)."""
        self.args, self.policy, self.world, self.state = args, policy, world, state
        self.steps = steps
        self.budget = budget
        self.sp = budget.sp if budget is not None else None  # sequence parallelism: steps run on shards
        self.truncation = truncation
        self.aux_coef = router_aux_coef(args, policy.module.config)
        self.on_optimizer_step = on_optimizer_step
        a = args
        self.hyperparams = LossHyperparams(
            epsilon_low=a.epsilon,
            epsilon_high=a.effective_epsilon_high,
            delta=a.delta,
            sapo_temperature_pos=a.sapo_temperature_pos,
            sapo_temperature_neg=a.sapo_temperature_neg,
            vespo_k_pos=a.vespo_k_pos,
            vespo_lambda_pos=a.vespo_lambda_pos,
            vespo_k_neg=a.vespo_k_neg,
            vespo_lambda_neg=a.vespo_lambda_neg,
        )
        self.entropy_coef = AdaptiveEntropyCoef(
            a.entropy_coef,
            a.use_adaptive_entropy,
            a.entropy_coef_min,
            a.entropy_coef_max,
            a.entropy_coef_delta,
            a.entropy_target,
        )
        self.sampler_correction = (
            a.vllm_importance_sampling_mode if (a.use_vllm and a.vllm_importance_sampling_correction) else None
        )
        # partial rollouts: completions mix policy versions; IcePop's band on token ratios, and the gap by age
        self.token_band = tuple(a.partial_rollout_token_band) if a.partial_rollout else None
        self.last_checkpoint: Optional[str] = None  # named in a non-finite error
        self._window = self._new_window()  # the optimizer step being accumulated (may span rounds)
        self._plan: List[tuple] = []  # the round's micro-steps not yet run: (run, ends the optimizer step or None)
        self._window_micro_batches = 0  # packed: logical micro-batches already in the open optimizer step

    @staticmethod
    def _new_window() -> dict:
        return {
            "micro": 0,
            "loss": 0.0,
            "policy_loss": 0.0,
            "entropy": torch.zeros(2, dtype=torch.float64),
        }  # Σ entropy, tokens

    @property
    def at_step_boundary(self) -> bool:
        """No optimizer step is half accumulated (a checkpoint now loses nothing)."""
        return self._window["micro"] == 0

    @property
    def _by_epoch(self) -> bool:
        """The plan says where optimizer steps end (epochs of whole rounds: the last step of each may be short)."""
        return self.steps is not None and self.steps.rounds_per_epoch is not None

    def _open_micro_steps(self) -> int:
        """Logical micro-steps already accumulated in the open optimizer step (from earlier rounds)."""
        return self._window_micro_batches if self.budget is not None else self._window["micro"]

    def _windows(self, order: List[int], round_start: int) -> List[tuple]:
        """(micro-steps in its optimizer step, whether it ends that step) of each of the round's micro-steps, in
        order; `round_start`: the round's first micro-step position in its epoch (StepPlan.round_start). Without
        epochs every step is gradient_accumulation_steps micro-steps, counted on from the open step."""
        if self._by_epoch:
            return [self.steps.window(round_start + i) for i in range(len(order))]
        GA, before = self.args.gradient_accumulation_steps, self._open_micro_steps()
        return [(GA, (before + i + 1) % GA == 0) for i in range(len(order))]

    def _step_tokens(self, masks: List[torch.Tensor], order: List[int], windows: List[tuple]) -> torch.Tensor:
        """[micro-steps]: the normaliser of dapo/cispo/vespo for each of the round's micro-steps, the active tokens of
        its optimizer step over all ranks (DAPO's definition) when the round's micro-steps make whole steps. When a
        step spans rounds its other micro-batches are not generated yet, so TRL's estimate is used: the round's
        tokens scaled to the step's accumulation (tokens × its micro-steps / micro-batches per round)."""
        counts = torch.stack([m.sum() for m in masks])
        lengths = torch.tensor([float(n) for n, _ in windows], dtype=counts.dtype)
        if order and self._open_micro_steps() == 0 and windows[-1][1]:
            ids = torch.tensor([0] + [int(ends) for _, ends in windows[:-1]]).cumsum(0)  # each micro-step's step
            per_step = dist.all_reduce_sum(
                torch.zeros(int(ids[-1]) + 1, dtype=counts.dtype).index_add_(0, ids, counts[torch.tensor(order)])
            )
            return per_step[ids]
        total = dist.all_reduce_sum(counts.sum().reshape(1))[0]
        return total * lengths / len(masks)

    def run(
        self,
        micro: List[dict],
        truncated: List[bool],
        advantages: torch.Tensor,
        old_logps,
        ref_logps,
        micro_step: Optional[Callable[[], torch.Tensor]] = None,
        round_start: int = 0,
    ) -> Dict[str, float]:
        """One round's passes. An optimizer step accumulates gradient_accumulation_steps micro-steps, fewer for the
        last of an epoch (steps.py, TRL's count): when steps_per_generation is not a multiple of it (TRL accepts
        that), a step's accumulation carries on into the next round. `round_start`: the position of the round's
        first micro-step (StepPlan.round_start). `micro_step()` is called once per micro-step and must run
        `next_micro_step()` (the trainer passes its TRL-named `training_step` hook); None: run them directly."""
        args, B = self.args, self.args.per_device_train_batch_size
        if args.routing_replay == "rollout" and any("routes" not in mb for mb in micro):
            raise RuntimeError(
                "routing_replay='rollout', but this round's completions came without the sampler's "
                "routes (a generator that does not capture them, or a rollout made without one). Set "
                "routing_replay='off'."
            )
        masks = [self._loss_mask(mb, truncated[j * B : (j + 1) * B]) for j, mb in enumerate(micro)]
        order = [j for _ in range(args.num_iterations) for j in range(len(micro))]  # the round's micro-steps
        windows = self._windows(order, round_start)
        step_tokens = self._step_tokens(masks, order, windows)  # one collective
        acc = self._acc_of_round = MetricAccumulator()
        if self.budget is not None:
            self._plan = self._packed_plan(
                micro, masks, advantages, old_logps, ref_logps, step_tokens, acc, order, windows
            )
        else:

            def planned(p: int, j: int):  # micro-step p: micro-batch j's forward, loss and backward
                return lambda: self._micro_step(
                    micro[j],
                    masks[j],
                    advantages[j * B : (j + 1) * B],
                    old_logps[j] if old_logps else None,
                    ref_logps[j] if ref_logps else None,
                    step_tokens[p],
                    acc,
                    self._window["entropy"],
                    windows[p][0],
                )

            # with epochs the plan says where steps end (the last of an epoch is short); else DeepSpeed counts
            self._plan = [(planned(p, j), windows[p][1] if self._by_epoch else None) for p, j in enumerate(order)]
        while self._plan and self.state.global_step < self.state.max_steps:
            (micro_step or self.next_micro_step)()
        self._plan = []
        metrics = {**acc.reduce(), "learning_rate": self.policy.get_lr()[0]}
        if self.entropy_coef.enabled:
            metrics["entropy_coef"] = self.entropy_coef.coef
        self._check_finite(metrics, step=self.state.global_step)
        return metrics

    def next_micro_step(self) -> torch.Tensor:
        """Run the round's next planned micro-step (and the optimizer step it completes); its loss."""
        run, ends_step = self._plan.pop(0)
        if ends_step is not None:  # packed steps: their count per optimizer step varies, so the plan says
            self.policy.set_gradient_accumulation_boundary(ends_step)
        stepping = self.policy.is_gradient_accumulation_boundary()  # this micro-step ends an optimizer step
        loss, policy = run()
        self._window["micro"] += 1
        self._window["loss"] += loss
        self._window["policy_loss"] += policy
        if stepping:
            self._end_optimizer_step(
                self._window["loss"], self._window["policy_loss"], self._acc_of_round, self._window["entropy"]
            )
            self._window = self._new_window()
        return torch.tensor(loss)

    def _micro_step(
        self,
        mb: dict,
        mask: torch.Tensor,
        advantages,
        old_logps,
        ref_logps,
        step_tokens,
        acc,
        entropy_window,
        accumulation: int,
    ) -> tuple:
        """Forward, loss and backward of one padded micro-batch, one of `accumulation` micro-steps of its optimizer
        step; returns its share of the step's (loss, policy loss)."""
        args = self.args
        forward = policy_forward(
            self.policy,
            mb["input_ids"],
            mb["attention_mask"],
            mask.shape[1],
            args.temperature,
            routes=mb.get("routes"),
            **self._forward_options(),
        )
        keep = None
        if args.top_entropy_quantile < 1.0:
            keep = self._high_entropy(forward.entropy, mask)
        return self._train(
            forward,
            Rows(
                mask,
                mb["completion_mask"],
                advantages,
                old_logps,
                ref_logps,
                mb["sampler_logps"],
                keep,
                step_tokens,
                versions=mb.get("token_versions"),
                accumulation=accumulation,
            ),
            1.0 / accumulation,
            acc,
            entropy_window,
        )

    def _forward_options(self, owner: Optional[int] = None) -> dict:
        """The policy forward's options; `owner`: the group member whose packed step it is (sequence parallelism)."""
        args = self.args
        truncated = self.truncation is not None and self.truncation.active
        options = dict(
            with_entropy=True,
            entropy_grad=self.entropy_coef.enabled,
            truncation=self.truncation,
            with_full=truncated and args.beta != 0,
            router_aux=self.aux_coef != 0.0,
            chunk_tokens=args.logprob_chunk_tokens,
        )
        return options if self.sp is None else dict(options, sp=self.sp, owner=owner)

    def _high_entropy(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """TRL's top_entropy_quantile: the quantile of every rank's active-token entropies of this micro-batch."""
        active = entropy.detach()[mask.bool()]
        threshold = entropy_threshold(dist.all_gather_ragged(active.float()), self.args.top_entropy_quantile)
        return entropy_mask(entropy.detach(), mask, self.args.top_entropy_quantile, threshold=threshold).float()

    # -------------------------------------------------------------------------------------- packed token budget
    def _packed_plan(
        self, micro, masks, advantages, old_logps, ref_logps, step_tokens, acc, order: List[int], windows: List[tuple]
    ) -> List[tuple]:
        """The round's micro-steps as packed steps. The round's micro-steps (`order`: its logical micro-batches,
        num_iterations passes) are cut where optimizer steps end (`windows`); each piece's sequences are packed under
        the budget (layout.plan_steps: the same count on every rank), and each packed step's loss weighs its tokens
        as their own micro-step would (aggregation_weights), so the optimizer step's gradient is the padded path's.
        The logical lists below are indexed by micro-step (a micro-batch appears once per pass)."""
        args, B = self.args, self.args.per_device_train_batch_size
        pieces, piece = [], []
        for p in range(len(order)):
            piece.append(p)
            if windows[p][1]:
                pieces.append((piece, True))
                piece = []
        if piece:
            pieces.append((piece, False))
        # micro-steps left open for the next round to close: those after the round's last step end
        ends = [p for p, (_, closes) in enumerate(windows) if closes]
        self._window_micro_batches = len(order) - 1 - ends[-1] if ends else self._window_micro_batches + len(order)
        by_step = lambda values: None if values is None else [values[j] for j in order]  # noqa: E731
        step_micro, step_masks = by_step(micro), by_step(masks)
        widths = [m.shape[1] for m in step_masks]
        steps = layout.plan_steps(
            [layout.sequences_of(step_micro, piece) for piece, _ in pieces],
            self.budget.step_tokens,
            self.budget.hidden,
            self.budget.pad_id,
            widths,
        )
        weights = [
            aggregation_weights(
                args.loss_type,
                m,
                max_completion_length=args.max_completion_length,
                num_items_in_batch=step_tokens[p],
                num_processes=self.world,
                gradient_accumulation_steps=windows[p][0],
            )
            for p, m in enumerate(step_masks)
        ]
        logical = dict(
            masks=step_masks,
            completion=[mb["completion_mask"] for mb in step_micro],
            advantages=[advantages[j * B : (j + 1) * B] for j in order],
            old=by_step(old_logps),
            ref=by_step(ref_logps),
            sampler=[mb["sampler_logps"] for mb in step_micro],
            weights=weights,
            versions=[mb["token_versions"] for mb in step_micro] if self.token_band and micro else None,
        )
        plan, me = [], self.sp.rank if self.sp is not None else None
        for (piece, closes), piece_steps in zip(pieces, steps):
            shared = {}  # the piece's high-entropy masks and bonus weights, made at its start (same weights)
            aux_scale = len(piece) / (windows[piece[0]][0] * len(piece_steps))
            # each of this rank's steps; with sequence parallelism every member's, run by the group on shards
            runs, piece_runs = list(sequence_parallel.each_member(piece_steps, self.sp)), []
            for i, (owner, step) in enumerate(runs):

                def run(
                    step=step,
                    owner=owner,
                    first=i == 0,
                    piece=piece,
                    piece_steps=piece_steps,
                    shared=shared,
                    aux_scale=aux_scale,
                ):
                    if first:
                        keep = (
                            self._piece_keep(piece, piece_steps, step_masks)
                            if args.top_entropy_quantile < 1.0
                            else None
                        )
                        shared["keep"], shared["bonus"] = keep, None
                        if self.entropy_coef.enabled:
                            shared["bonus"] = [
                                entropy_bonus_weights(m, None if keep is None else keep[p], windows[p][0])
                                for p, m in enumerate(step_masks)
                            ]
                    if owner != me:  # another member's step: this rank computes its shard, and learns nothing
                        return self._stand_in(
                            packed_forward(self.policy, step, self.args.temperature, **self._forward_options(owner))
                        )
                    return self._packed_step(step, logical, shared["keep"], shared["bonus"], aux_scale, acc)

                if self.sp is not None:  # forward and backward both sharded (recomputation included)
                    run = sequence_parallel.sharded(run)
                piece_runs.append((run, closes and i == len(runs) - 1))
            plan += self._per_micro_step(piece_runs, len(piece))
        return plan

    def _per_micro_step(self, runs: List[tuple], micro_steps: int) -> List[tuple]:
        """A piece's packed steps as `micro_steps` plan entries, so the training_step hook is called once per
        logical micro-step, as TRL calls it, however many packed steps the piece became: entry i runs the packed
        steps [i·n/k, (i+1)·n/k) (none, one or several), each with its own accumulation boundary."""
        n, entries = len(runs), []
        for i in range(micro_steps):
            mine = runs[i * n // micro_steps : (i + 1) * n // micro_steps]

            def entry(mine=mine) -> tuple:
                loss = policy = 0.0
                for run, ends in mine:
                    self.policy.set_gradient_accumulation_boundary(ends)
                    a, b = run()
                    loss, policy = loss + a, policy + b
                return loss, policy

            entries.append((entry, bool(mine) and mine[-1][1]))
        return entries

    @torch.no_grad()
    def _piece_keep(self, piece: List[int], steps, masks) -> List[Optional[torch.Tensor]]:
        """top_entropy_quantile over packed steps: the entropies of the piece's micro-batches under the current
        weights (one no-grad pass), then each micro-batch's threshold over every rank, as the padded path takes it."""
        me, values = (self.sp.rank if self.sp is not None else None), []
        for owner, step in sequence_parallel.each_member(steps, self.sp):
            entropy = packed_forward(
                self.policy,
                step,
                self.args.temperature,
                with_entropy=True,
                truncation=self.truncation,
                chunk_tokens=self.args.logprob_chunk_tokens,
                sp=self.sp,
                owner=owner,
            ).entropy
            if owner == me:
                values.append(entropy)
        entropies = layout.scatter(steps, values, [m.shape for m in masks])
        keep: List[Optional[torch.Tensor]] = [None] * len(masks)
        for j in dict.fromkeys(piece):  # each micro-batch once, in order: the same collectives on every rank
            keep[j] = self._high_entropy(entropies[j], masks[j])
        return keep

    def _packed_step(self, step, logical: dict, keep, bonus, aux_scale: float, acc) -> tuple:
        forward = packed_forward(
            self.policy, step, self.args.temperature, **self._forward_options(None if self.sp is None else self.sp.rank)
        )
        if step.empty:  # a stand-in: every rank runs as many steps
            return self._stand_in(forward)
        forward.logps, forward.entropy, forward.full_logps = (
            step.rows(v) for v in (forward.logps, forward.entropy, forward.full_logps)
        )
        if forward.routes_agreed is not None:
            forward.routes_agreed = step.rows(forward.routes_agreed.float()) > 0.5
        g = step.gather
        rows = Rows(
            g(logical["masks"]),
            g(logical["completion"]),
            g(logical["advantages"]),
            g(logical["old"]),
            g(logical["ref"]),
            g(logical["sampler"]),
            None if keep is None else g(keep),
            None,
            g(logical["weights"]),
            g(bonus),
            None if logical["versions"] is None else g([v.float() for v in logical["versions"]]),
        )
        return self._train(forward, rows, aux_scale, acc, self._window["entropy"])

    def _stand_in(self, forward) -> tuple:
        """A micro-step with nothing of this rank's to learn: its loss reaches every parameter with weight 0, so
        the backward's collectives (ZeRO-3's, Ulysses') run as on every other rank."""
        loss = forward.logps.sum() * 0.0 + (0.0 if forward.aux_loss is None else forward.aux_loss * 0.0)
        self._backward_and_step(loss)
        return 0.0, 0.0

    # ------------------------------------------------------------------------------------------------ both layouts
    def _train(self, forward, rows: "Rows", aux_scale: float, acc, entropy_window) -> tuple:
        """The GRPO loss of rows whose forward ran, its backward and the optimizer step it may complete; metrics into
        `acc`. Returns the rows' share of the optimizer step's (loss, policy loss)."""
        args = self.args
        bonus = self.entropy_coef.enabled
        logps, entropy, mask, keep = forward.logps, forward.entropy, rows.mask, rows.keep
        loss, metrics = policy_loss(
            logps,
            rows.old,
            rows.advantages,
            mask,
            loss_type=args.loss_type,
            hyperparams=self.hyperparams,
            importance_sampling_level=args.importance_sampling_level,
            beta=args.beta,
            ref_per_token_logps=rows.ref,
            kl_estimator=args.kl_estimator,
            kl_bias_correction=args.use_bias_correction_kl,
            kl_per_token_logps=forward.full_logps,
            sampler_per_token_logps=rows.sampler,
            vllm_is_mode=self.sampler_correction,
            vllm_is_clip_max=args.vllm_importance_sampling_clip_max,
            vllm_is_clip_min=args.vllm_importance_sampling_clip_min,
            off_policy_mask_threshold=args.off_policy_mask_threshold,
            token_band=self.token_band,
            keep_mask=keep,
            entropies=entropy if bonus else None,
            entropy_coef=self.entropy_coef.applied() if bonus else 0.0,
            max_completion_length=args.max_completion_length,
            num_items_in_batch=rows.step_tokens,
            num_processes=self.world,
            gradient_accumulation_steps=rows.accumulation,
            token_weights=rows.weights,
            bonus_weights=rows.bonus_weights,
        )
        if forward.aux_loss is not None:  # the router's load balancing, scaled like the loss for accumulation
            metrics["aux_loss"] = forward.aux_loss.detach()
            loss = loss + self.aux_coef * forward.aux_loss * aux_scale
        self._backward_and_step(loss)
        tokens = float(rows.completion.sum())
        acc.add("entropy", (entropy.detach() * rows.completion).sum() / max(tokens, 1.0), tokens)
        effective = mask if keep is None else mask * keep
        entropy_window += torch.stack([(entropy.detach() * effective).sum(), effective.sum()]).double()
        # how far the generator's log-probs are from the trainer's for the same tokens (TRL's names): a weight
        # sync that went wrong shows up here first
        per_token_gap = ((logps.detach() if rows.old is None else rows.old) - rows.sampler).abs()
        scored = rows.completion.bool() & ~torch.isnan(per_token_gap)  # NaN: a generate that returns no scores
        gap = per_token_gap[scored]
        if gap.numel():
            acc.add("sampling/sampling_logp_difference/mean", gap.mean(), gap.numel())
            acc.add("sampling/sampling_logp_difference/max", gap.max())
        if self.token_band is not None and rows.versions is not None:
            version_gap_metrics(acc, per_token_gap, scored, rows.versions, self.state.generation_round)
        if forward.route_counts is not None:
            moe_route_metrics(acc, forward.route_counts, forward.routes_agreed, per_token_gap, scored)
        policy_share = float(metrics.pop("policy_loss", loss.detach()))
        for name, value in metrics.items():
            acc.add(name, value, float(mask.sum()))
        return loss.item(), policy_share

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        self.policy.backward(loss, scale_wrt_gas=False)  # the loss already carries its share of the step
        routing.release(self.policy)  # MoE: the routes the backward's recomputation needed
        if self.policy.is_gradient_accumulation_boundary():
            # CPU: the step's fp32 copies (16-bit gradients as fp32, AdamW's denominator) would otherwise stack on
            # the backward's freed heap (Qwen2.5-0.5B shape, 2 ranks: 10.5 -> 9.05 GiB; W1 3.49 -> 3.23). Re-faulting
            # the pages in the next forward costs W1 ~0.4 s of a 4.2 s train phase and is lost in W2's noise.
            device.return_freed_memory()
        self.policy.step()  # DeepSpeed only steps at the accumulation boundary

    def _end_optimizer_step(
        self, step_loss: float, step_policy_loss: float, acc: MetricAccumulator, entropy_window: torch.Tensor
    ) -> None:
        grad_norm = self.policy.get_global_grad_norm()  # global over ranks: every rank sees the same value
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        if not math.isfinite(grad_norm):
            self._check_finite({"grad_norm": grad_norm, "loss": step_loss}, step=self.state.global_step + 1)
        acc.add("loss", step_loss)
        acc.add("grad_norm", grad_norm)
        if self.entropy_coef.enabled:
            acc.add("policy_loss", step_policy_loss)
        if self.entropy_coef.adaptive:  # the step's entropy over every rank's tokens moves the coefficient
            total = dist.all_reduce_sum(entropy_window)
            self.entropy_coef.update(float(total[0] / total[1].clamp(min=1.0)))
        self.on_optimizer_step()

    def _loss_mask(self, mb: dict, truncated: List[bool]) -> torch.Tensor:
        mask = mb["completion_mask"]
        if self.args.mask_truncated_completions:
            mask = mask * (1.0 - torch.tensor(truncated, dtype=mask.dtype)).unsqueeze(1)
        return mask

    def _check_finite(self, metrics: Dict[str, float], step: int) -> None:
        bad = {k: v for k, v in metrics.items() if k in ("loss", "grad_norm") and not math.isfinite(v)}
        if bad:
            raise NonFiniteError(
                f"Non-finite training values at optimizer step {step}: {bad}. Last checkpoint: "
                f"{self.last_checkpoint or 'none saved yet'}. Lower learning_rate, check the rewards "
                "for NaN/inf, or use fp32; the run was stopped rather than continued."
            )


# Alarm thresholds: fp32 engines agree to ~1e-5 nats a token; bf16 ones to ~0.5. Past these, the sampler correction's
# weights are near zero and the policy barely moves.
GAP_ALARM_NATS = 1.0
WEIGHT_ALARM = 0.1


def learning_alarm(metrics: Dict[str, float]) -> Optional[str]:
    """A line to print when a round's metrics say the policy is barely learning because the sampler and the
    trainer disagree about the sampled tokens' probabilities (None otherwise)."""
    gap = metrics.get("sampling/sampling_logp_difference/mean")
    weight = metrics.get("sampling/importance_sampling_ratio/mean")
    if (gap is None or gap <= GAP_ALARM_NATS) and (weight is None or weight >= WEIGHT_ALARM):
        return None
    parts = []
    if gap is not None:
        parts.append(f"the sampler's log-probs differ from the trainer's by {gap:.2f} nats a token")
    if weight is not None:
        parts.append(f"the sampler correction's mean weight is {weight:.3g}")
    return (
        "; ".join(parts) + ": the policy is barely learning. Causes: a sampling setting the trainer does not "
        "reproduce (repetition_penalty, a logits processor in generation_kwargs), a weight sync that failed, or "
        "bf16 numerics (vllm_importance_sampling_mode='token_truncate' bounds the damage)."
    )


def version_gap_metrics(
    acc, per_token_gap: torch.Tensor, scored: torch.Tensor, versions: torch.Tensor, version: int
) -> None:
    """partial/sampler_gap/age{0,1,2+}: the sampler–trainer log-prob gap of the tokens sampled that many policy
    versions before the one training (a partial rollout's carried tokens are older)."""
    ages = version - versions.to(per_token_gap.device).round().long()
    for name, inside in (("0", ages == 0), ("1", ages == 1), ("2+", ages >= 2)):
        gap = per_token_gap[scored & inside]
        if gap.numel():
            acc.add(f"partial/sampler_gap/age{name}", gap.mean(), gap.numel())


def moe_route_metrics(
    acc: MetricAccumulator, counts: tuple, agreed: torch.Tensor, gap: torch.Tensor, scored: torch.Tensor
) -> None:
    """A MoE forward that had the sampler's routes (engines/routing.py): the fraction of (token, layer) routes whose
    experts the forward used were the sampler's (`moe/router_agreement`: 1 with routing_replay), the fraction the
    trainer's router chose on its own as the sampler did (`moe/router_own_agreement`, the same without replay), and
    the sampler gap of the tokens whose predicting state the router routed as the sampler did in every layer, next
    to the rest's."""
    own, used, compared = counts
    if compared:
        acc.add("moe/router_agreement", used / compared, compared)
        acc.add("moe/router_own_agreement", own / compared, compared)
    scored_agreed = scored & agreed.to(scored.device)
    scored_other = scored & ~agreed.to(scored.device)
    n_agreed, n_other = int(scored_agreed.sum()), int(scored_other.sum())
    if n_agreed + n_other:
        acc.add("moe/tokens_routed_as_sampled", n_agreed / (n_agreed + n_other), n_agreed + n_other)
    if n_agreed:
        acc.add("moe/sampling_logp_difference/routes_agreed", gap[scored_agreed].mean(), n_agreed)
    if n_other:
        acc.add("moe/sampling_logp_difference/routes_differed", gap[scored_other].mean(), n_other)


def router_aux_coef(args, config) -> float:
    """The weight of a MoE router's load-balancing loss in the GRPO loss (TRL's rule): router_aux_loss_coef, else
    the model config's own coefficient; 0 for a model that has no router. Setting it for a dense model is an error."""
    text = getattr(config, "text_config", None) or config
    is_moe = hasattr(text, "output_router_logits")
    if args.router_aux_loss_coef and not is_moe:
        raise ValueError(
            f"router_aux_loss_coef={args.router_aux_loss_coef}: {type(config).__name__} is not a "
            "mixture-of-experts model (its config has no router). Leave router_aux_loss_coef unset."
        )
    if not is_moe:
        return 0.0
    coef = args.router_aux_loss_coef
    return float(getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef)
