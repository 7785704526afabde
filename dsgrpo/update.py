"""The update stage of a round: num_iterations passes over the round's micro-batches, gradient_accumulation_steps
micro-batches per optimizer step, each a forward of the policy engine, the GRPO loss (algorithms/policy_loss.py)
and DeepSpeed's backward and step.

What crosses ranks here, every rank in the same order: the active-token counts of the round's optimizer steps
(dapo/cispo/vespo normalise by them, one collective per round), the high-entropy threshold of a micro-batch
(top_entropy_quantile < 1: TRL's quantile over every rank's active tokens), the step's entropy for adaptive entropy
control, and the metric reduction at the end."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from . import device, dist
from .algorithms import (AdaptiveEntropyCoef, LossHyperparams, Truncation, entropy_mask, entropy_threshold,
                         policy_loss)
from .engines import policy_forward
from .metrics import MetricAccumulator


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops instead of training on."""


class PolicyUpdate:
    def __init__(self, args, policy, world: int, state, on_optimizer_step: Callable[[], None],
                 truncation: Optional[Truncation] = None):
        """`state` is the trainer's TrainerState (its global_step and max_steps bound the round);
        `on_optimizer_step()` is called after every optimizer step (it advances the step count); `truncation`:
        the sampler's top_k / top_p / min_p, applied to the policy's log-probs (algorithms/truncation.py)."""
        self.args, self.policy, self.world, self.state = args, policy, world, state
        self.truncation = truncation
        self.aux_coef = router_aux_coef(args, policy.module.config)
        self.on_optimizer_step = on_optimizer_step
        a = args
        self.hyperparams = LossHyperparams(
            epsilon_low=a.epsilon, epsilon_high=a.effective_epsilon_high, delta=a.delta,
            sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
            vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
            vespo_lambda_neg=a.vespo_lambda_neg)
        self.entropy_coef = AdaptiveEntropyCoef(a.entropy_coef, a.use_adaptive_entropy, a.entropy_coef_min,
                                                a.entropy_coef_max, a.entropy_coef_delta, a.entropy_target)
        self.sampler_correction = a.vllm_importance_sampling_mode if (
            a.use_vllm and a.vllm_importance_sampling_correction) else None
        self.last_checkpoint: Optional[str] = None  # named in a non-finite error
        self._window = self._new_window()           # the optimizer step being accumulated (may span rounds)
        self._plan: List[Callable[[], tuple]] = []  # the round's micro-steps not yet run (next_micro_step)

    @staticmethod
    def _new_window() -> dict:
        return {"micro": 0, "loss": 0.0, "policy_loss": 0.0,
                "entropy": torch.zeros(2, dtype=torch.float64)}  # Σ entropy, tokens

    @property
    def at_step_boundary(self) -> bool:
        """No optimizer step is half accumulated (a checkpoint now loses nothing)."""
        return self._window["micro"] == 0

    def _step_tokens(self, masks: List[torch.Tensor]) -> torch.Tensor:
        """[micro-batches]: the normaliser of dapo/cispo/vespo for each micro-batch, the active tokens of its
        optimizer step over all ranks (DAPO's definition) when the round's micro-batches make whole steps. When a
        step spans rounds its later micro-batches are not generated yet, so TRL's estimate is used: the round's
        tokens scaled to one accumulation window (tokens × GA / micro-batches per round)."""
        GA = self.args.gradient_accumulation_steps
        counts = torch.stack([m.sum() for m in masks])
        if len(masks) % GA == 0:
            per_step = dist.all_reduce_sum(counts.view(-1, GA).sum(1))                    # [steps]
            return per_step.repeat_interleave(GA)
        total = dist.all_reduce_sum(counts.sum().reshape(1))[0]
        return (total * GA / len(masks)).expand(len(masks))

    def run(self, micro: List[dict], truncated: List[bool], advantages: torch.Tensor, old_logps, ref_logps,
            micro_step: Optional[Callable[[], torch.Tensor]] = None) -> Dict[str, float]:
        """One round's passes. An optimizer step is every gradient_accumulation_steps micro-batches, counted by
        DeepSpeed across rounds: when steps_per_generation is not a multiple of it (TRL accepts that), a step's
        accumulation carries on into the next round. `micro_step()` is called once per micro-step and must run
        `next_micro_step()` (the trainer passes its TRL-named `training_step` hook); None: run them directly."""
        args, B = self.args, self.args.per_device_train_batch_size
        masks = [self._loss_mask(mb, truncated[j * B:(j + 1) * B]) for j, mb in enumerate(micro)]
        step_tokens = self._step_tokens(masks)  # one collective
        acc = self._acc_of_round = MetricAccumulator()

        def planned(j: int):  # micro-batch j's forward, loss and backward
            return lambda: self._micro_step(micro[j], masks[j], advantages[j * B:(j + 1) * B],
                                            old_logps[j] if old_logps else None, ref_logps[j] if ref_logps else None,
                                            step_tokens[j], acc, self._window["entropy"])
        self._plan = [planned(j) for _ in range(args.num_iterations) for j in range(len(micro))]
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
        stepping = self.policy.is_gradient_accumulation_boundary()  # this micro-batch ends an optimizer step
        loss, policy = self._plan.pop(0)()
        self._window["micro"] += 1
        self._window["loss"] += loss
        self._window["policy_loss"] += policy
        if stepping:
            self._end_optimizer_step(self._window["loss"], self._window["policy_loss"], self._acc_of_round,
                                     self._window["entropy"])
            self._window = self._new_window()
        return torch.tensor(loss)

    def _micro_step(self, mb: dict, mask: torch.Tensor, advantages, old_logps, ref_logps, step_tokens, acc,
                    entropy_window) -> tuple:
        """Forward, loss and backward of one micro-batch; returns its share of the optimizer step's (loss, policy loss)."""
        args = self.args
        bonus = self.entropy_coef.enabled
        truncated = self.truncation is not None and self.truncation.active
        forward = policy_forward(self.policy, mb["input_ids"], mb["attention_mask"], mask.shape[1], args.temperature,
                                 with_entropy=True, entropy_grad=bonus, truncation=self.truncation,
                                 with_full=truncated and args.beta != 0, router_aux=self.aux_coef != 0.0,
                                 chunk_tokens=args.logprob_chunk_tokens)
        logps, entropy = forward.logps, forward.entropy
        keep = None
        if args.top_entropy_quantile < 1.0:
            # TRL's threshold: the quantile of every rank's active-token entropies of this micro-batch
            active = entropy.detach()[mask.bool()]
            threshold = entropy_threshold(dist.all_gather_ragged(active.float()), args.top_entropy_quantile)
            keep = entropy_mask(entropy.detach(), mask, args.top_entropy_quantile, threshold=threshold).float()
        loss, metrics = policy_loss(
            logps, old_logps, advantages, mask, loss_type=args.loss_type, hyperparams=self.hyperparams,
            importance_sampling_level=args.importance_sampling_level, beta=args.beta, ref_per_token_logps=ref_logps,
            kl_estimator=args.kl_estimator, kl_bias_correction=args.use_bias_correction_kl,
            kl_per_token_logps=forward.full_logps,
            sampler_per_token_logps=mb["sampler_logps"], vllm_is_mode=self.sampler_correction,
            vllm_is_clip_max=args.vllm_importance_sampling_clip_max,
            vllm_is_clip_min=args.vllm_importance_sampling_clip_min,
            off_policy_mask_threshold=args.off_policy_mask_threshold, keep_mask=keep,
            entropies=entropy if bonus else None, entropy_coef=self.entropy_coef.applied() if bonus else 0.0,
            max_completion_length=args.max_completion_length, num_items_in_batch=step_tokens,
            num_processes=self.world, gradient_accumulation_steps=args.gradient_accumulation_steps)
        if forward.aux_loss is not None:  # the router's load balancing, scaled like the loss for accumulation
            metrics["aux_loss"] = forward.aux_loss.detach()
            loss = loss + self.aux_coef * forward.aux_loss / args.gradient_accumulation_steps
        self.policy.backward(loss, scale_wrt_gas=False)  # the loss already carries its share of the step
        if self.policy.is_gradient_accumulation_boundary():
            # CPU: the step's fp32 copies (16-bit gradients as fp32, AdamW's denominator) would otherwise stack on
            # the backward's freed heap (Qwen2.5-0.5B shape, 2 ranks: 10.5 -> 9.05 GiB; W1 3.49 -> 3.23). Re-faulting
            # the pages in the next forward costs W1 ~0.4 s of a 4.2 s train phase and is lost in W2's noise.
            device.return_freed_memory()
        self.policy.step()                               # DeepSpeed only steps at the accumulation boundary
        tokens = float(mb["completion_mask"].sum())
        acc.add("entropy", (entropy.detach() * mb["completion_mask"]).sum() / max(tokens, 1.0), tokens)
        effective = mask if keep is None else mask * keep
        entropy_window += torch.stack([(entropy.detach() * effective).sum(), effective.sum()]).double()
        # how far the generator's log-probs are from the trainer's for the same tokens (TRL's names): a weight
        # sync that went wrong shows up here first
        gap = ((logps.detach() if old_logps is None else old_logps) - mb["sampler_logps"]).abs()[mb["completion_mask"].bool()]
        gap = gap[~torch.isnan(gap)]  # tokens whose sampler log-prob is unknown (a generate that returns no scores)
        if gap.numel():
            acc.add("sampling/sampling_logp_difference/mean", gap.mean(), gap.numel())
            acc.add("sampling/sampling_logp_difference/max", gap.max())
        policy_share = float(metrics.pop("policy_loss", loss.detach()))
        for name, value in metrics.items():
            acc.add(name, value, float(mask.sum()))
        return loss.item(), policy_share

    def _end_optimizer_step(self, step_loss: float, step_policy_loss: float, acc: MetricAccumulator,
                            entropy_window: torch.Tensor) -> None:
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
            raise NonFiniteError(f"Non-finite training values at optimizer step {step}: {bad}. Last checkpoint: "
                                 f"{self.last_checkpoint or 'none saved yet'}. Lower learning_rate, check the rewards "
                                 "for NaN/inf, or use fp32; the run was stopped rather than continued.")


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
    return ("; ".join(parts) + ": the policy is barely learning. Causes: a sampling setting the trainer does not "
            "reproduce (repetition_penalty, a logits processor in generation_kwargs), a weight sync that failed, or "
            "bf16 numerics (vllm_importance_sampling_mode='token_truncate' bounds the damage).")


def router_aux_coef(args, config) -> float:
    """The weight of a MoE router's load-balancing loss in the GRPO loss (TRL's rule): router_aux_loss_coef, else
    the model config's own coefficient; 0 for a model that has no router. Setting it for a dense model is an error."""
    text = getattr(config, "text_config", None) or config
    is_moe = hasattr(text, "output_router_logits")
    if args.router_aux_loss_coef and not is_moe:
        raise ValueError(f"router_aux_loss_coef={args.router_aux_loss_coef}: {type(config).__name__} is not a "
                         "mixture-of-experts model (its config has no router). Leave router_aux_loss_coef unset.")
    if not is_moe:
        return 0.0
    coef = args.router_aux_loss_coef
    return float(getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef)
