"""TRL's own small GRPO setting in one process (marked slow: it trains 51 steps): a reference model at a high
learning rate with a sequence-classification reward model. TRL trains it with finite values; dsgrpo used to stop at
step 30 with grad_norm inf and loss nan (the KL's exponential of a padded position's log-ratio overflowed)."""

import math

import pytest
import torch

pytestmark = pytest.mark.slow

# the opening words of the Zen of Python's lines, as TRL's small test set has them: standard (non-chat) prompts
ZEN = [
    "Beautiful is better than",
    "Explicit is",
    "Simple is better than",
    "Complex is",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one-- and preferably",
    "Although that way may not",
    "Now is better",
    "Although never is often",
    "If the implementation is hard",
]


def test_a_reference_at_a_high_learning_rate_stays_finite(tmp_path):
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer
    from dsgrpo.engines.weights import named_full_parameters
    from dsgrpo.testing import tiny_model

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        beta=0.1,
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        vllm_kv_cache_bytes=64 * 2**20,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        tiny_model("qwen2-reward"),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in ZEN]),
    )
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(rows) == 51  # TRL's run: 17 prompts, 3 epochs, one prompt a step
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and math.isfinite(h["kl"]) for h in rows)
    assert max(h["kl"] for h in rows) > 0.1  # the policy did move far from the reference
    assert all(torch.isfinite(t).all() for _, t in named_full_parameters(trainer.policy.module, 1 << 30))
