"""The TRL-compatibility surface of GRPOTrainer: what TRL (and transformers' Trainer) users read and call on a
trainer besides train() — the accessors (model, processing_class, optimizer, ref_model, ...), TRL's helper methods,
the callback plumbing, save_model and the summary row train() ends with. trainer.py mixes it in, so the loop there
reads as the story of a step."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

import torch

from . import dist
from .algorithms import entropy_mask, entropy_threshold, off_policy_mask, sapo_token_loss, vespo_weights
from .rollout.batch import Batch
from .timing import highest_peak


class TRLSurface:
    """Mixed into GRPOTrainer (it holds args, state, policy, reference, rewards, tokenizer, callbacks, update)."""

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
    def reward_funcs(self) -> list:
        return self.rewards.funcs

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL's: the weight of each reward source ([K]), environment-owned ones (1.0) included."""
        return torch.tensor(self.rewards.weights, dtype=torch.float32)

    # environment_factory (rollout/environments.py), under TRL's names
    @property
    def tools(self) -> list:
        if self.environment_set is not None:
            return self.environment_set.all_tools()
        return list(self.tool_runner.tools.values()) if self.tool_runner is not None else []

    @property
    def environments(self) -> Optional[list]:
        """The environment instances of this rank's latest rollout, one per completion (None without environments)."""
        return self.environment_set.last if self.environment_set is not None else None

    @property
    def _env_tools(self) -> dict:
        return self.environment_set.tools if self.environment_set is not None else {}

    @property
    def _environment_pool(self) -> dict:
        return self.environment_set.pool if self.environment_set is not None else {}

    @property
    def optimizer(self):
        return self.policy.engine.optimizer if self.placement.trains else None

    @property
    def lr_scheduler(self):
        return self.policy.engine.lr_scheduler if self.placement.trains else None

    @property
    def ref_model(self):
        """TRL's: the frozen reference's module; None at beta 0 and for a LoRA policy (its reference is itself with
        the adapter switched off)."""
        return self.reference.module if self.reference is not None else None

    @property
    def reference(self):
        """The frozen reference engine (policy.py); None at beta 0, for a LoRA policy and on a generating rank."""
        policy = getattr(self, "policy", None)
        return policy.reference if policy is not None else None

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
    def get_gamma_weights(
        advantages,
        log_ratio_per_token,
        mask,
        importance_sampling_ratio=None,
        k_pos=2.0,
        lambda_pos=3.0,
        k_neg=3.0,
        lambda_neg=2.0,
    ):
        return vespo_weights(
            advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg
        )

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

    def _log_summary(self, seconds: float, steps: int) -> None:
        """transformers' last log_history row: train_runtime, throughput and the mean loss of this train() call."""
        losses = [h["loss"] for h in self.state.log_history if "loss" in h and "train_runtime" not in h]
        rounds = max(1, self.state.generation_round - self._started_at[0])
        row = {
            "train_runtime": seconds,
            "train_samples_per_second": rounds * self.prompts_per_round / max(seconds, 1e-9),
            "train_steps_per_second": steps / max(seconds, 1e-9),
            "total_flos": self.state.total_flos,
            "train_loss": sum(losses) / len(losses) if losses else float("nan"),
            "epoch": self.state.epoch,
            "step": self.state.global_step,
        }
        peaks = dist.all_gather_object(highest_peak())  # against the start-up plan (bench/plan_vs_measured.py)
        row["memory/peak_bytes_max"] = max(peaks)
        if self.memory_plan is not None:
            row["memory/planned_peak_bytes"] = self.memory_plan.peak_bytes_per_device
        if dist.is_main():
            with open(os.path.join(self.args.output_dir, "memory.json"), "w") as fh:
                json.dump(
                    {
                        "measured_peak_bytes_per_rank": peaks,
                        "plan": self.memory_plan.to_json() if self.memory_plan is not None else None,
                    },
                    fh,
                    indent=1,
                )
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
        """save_model without the callback (a Hub push writes this)."""
        self.policy.write(output_dir)


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
