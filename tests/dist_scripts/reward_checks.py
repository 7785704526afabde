"""Run under `torchrun --nproc_per_node 2`: reward models sharded with ZeRO-3 over 2 ranks, and a mixed list
of reward sources (function + reward model + remote scorer) through one training step. Results go to
OUT_DIR/result-<rank>.json for tests/test_rewards_dist.py. The remote scorer's URL comes in REMOTE_URL."""

import json
import os
import sys

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from dsgrpo.rewards import RemoteReward
from dsgrpo.rewards.models import RewardModel
from dsgrpo.testing import tiny_model
from recorder import recorder, training_rows

OUT = sys.argv[1]
results = {}
TEXTS_P = ["Write 3 numbers:", "Say hi", "Repeat this number: 384", "Count", "x", "long " * 20]
TEXTS_C = [" 1 2 3", " hi there", " 384", " 1 2 3 4 5 6 7", " y", " end"]
SHARDED = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 1,
}


check = recorder(results)


def length_bonus(prompts, completions, **kwargs):
    return [0.1 * len(c) for c in completions]


class Unjudgeable:
    """A reward that cannot judge every other completion it sees (code_reward's sandbox, when it fails): None there,
    counted by reason for the trainer (pop_errors), as rewards/<name>/errors."""

    __name__ = "unjudgeable"

    def __init__(self):
        self.seen, self.errors = 0, {}

    def __call__(self, prompts, completions, **kwargs):
        out = []
        for _ in completions:
            self.seen += 1
            out.append(None if self.seen % 2 else 1.0)
            if self.seen % 2:
                self.errors["the judge failed"] = self.errors.get("the judge failed", 0) + 1
        return out

    def pop_errors(self):
        errors, self.errors = self.errors, {}
        return errors


dist.init()
rank = dist.rank()


@check("sharded_reward_model")
def _():
    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=2, output_dir=os.path.join(OUT, "rm"))
    rm = RewardModel.sharded(
        tiny_model("qwen2-reward"), None, args=cfg, ds_spec=SHARDED, dtype=torch.float32, world_size=2
    )
    local = [int(p.ds_tensor.numel()) < int(p.ds_numel) for p in rm.forward.module.parameters() if p.ds_numel > 1]
    sharded = rm(TEXTS_P, TEXTS_C)
    # the same model in one process, no DeepSpeed
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ref = AutoModelForSequenceClassification.from_pretrained(tiny_model("qwen2-reward"), num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2-reward"))
    tok.padding_side = "right"
    with torch.no_grad():
        single = [ref(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(TEXTS_P, TEXTS_C)]
    return {"sharded": sharded, "single": single, "all_partitioned": all(local)}


@check("mixed_step")
def _():
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(16)])
    remote = RemoteReward(os.environ["REMOTE_URL"], timeout=10, retries=1, name="remote_length")
    args = GRPOConfig(
        output_dir=os.path.join(OUT, "mixed"),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        use_vllm=False,
        gradient_checkpointing=False,
        reward_weights=[1.0, 0.5, 2.0],
        logging_steps=1,
        ref_deepspeed=SHARDED,
    )
    trainer = GRPOTrainer(
        tiny_model("qwen2"), [length_bonus, tiny_model("qwen2-reward"), remote], args=args, train_dataset=data
    )
    trainer.train()
    return {"names": trainer.rewards.names, "metrics": training_rows(trainer)[0]}


@check("flapping_scorer")
def _():
    """Every other request to this scorer fails (HTTP 500): the retries (with backoff) hide it from training, and
    each round's metrics count them."""
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(16)])
    remote = RemoteReward(os.environ["FLAPPING_URL"], timeout=10, retries=3, backoff=0.01, name="flapping")
    args = GRPOConfig(
        output_dir=os.path.join(OUT, "flapping"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        use_vllm=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = GRPOTrainer(tiny_model("qwen2"), [length_bonus, remote, Unjudgeable()], args=args, train_dataset=data)
    trainer.train()
    rows = training_rows(trainer)
    return {
        "errors": [r["rewards/unjudgeable/errors"] for r in rows],
        "unjudged_mean": [r["rewards/unjudgeable/mean"] for r in rows],
        "retries": [r["rewards/flapping/retries"] for r in rows],
        "remote": [r["rewards/flapping/mean"] for r in rows],
        "local": [r["rewards/length_bonus/mean"] for r in rows],
    }


@check("scorer_down_at_start")
def _():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    from dsgrpo.rewards.remote import RemoteRewardError

    args = GRPOConfig(
        output_dir=os.path.join(OUT, "down"),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        use_vllm=False,
        gradient_checkpointing=False,
    )
    try:
        GRPOTrainer(
            tiny_model("qwen2"),
            [RemoteReward(f"http://127.0.0.1:{port}/score", timeout=2)],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        )
    except RemoteRewardError as exc:
        return {"error": None, "message": str(exc), "engine_built": os.path.exists(os.path.join(OUT, "down"))}
    return {"error": "the trainer started with its scorer down"}


with open(os.path.join(OUT, f"result-{rank}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
