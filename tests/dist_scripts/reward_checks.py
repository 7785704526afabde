"""Run under `torchrun --nproc_per_node 2`: reward models sharded with ZeRO-3 over 2 ranks, and a mixed list
of reward sources (function + reward model + remote scorer) through one training step. Results go to
OUT_DIR/result-<rank>.json for tests/test_rewards_dist.py. The remote scorer's URL comes in REMOTE_URL."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from datasets import Dataset  # noqa: E402

from dsgrpo import GRPOConfig, GRPOTrainer, dist  # noqa: E402
from dsgrpo.rewards import RemoteReward  # noqa: E402
from dsgrpo.rewards.models import RewardModel  # noqa: E402
from dsgrpo.testing import tiny_model  # noqa: E402
from recorder import recorder, training_rows  # noqa: E402

OUT = sys.argv[1]
results = {}
TEXTS_P = ["Write 3 numbers:", "Say hi", "Repeat this number: 384", "Count", "x", "long " * 20]
TEXTS_C = [" 1 2 3", " hi there", " 384", " 1 2 3 4 5 6 7", " y", " end"]
SHARDED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1}


check = recorder(results)


def length_bonus(prompts, completions, **kwargs):
    return [0.1 * len(c) for c in completions]


dist.init()
rank = dist.rank()


@check("sharded_reward_model")
def _():
    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=2, output_dir=os.path.join(OUT, "rm"))
    rm = RewardModel.sharded(tiny_model("qwen2-reward"), None, args=cfg, ds_spec=SHARDED, dtype=torch.float32)
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
    args = GRPOConfig(output_dir=os.path.join(OUT, "mixed"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=6, use_vllm=False, gradient_checkpointing=False,
                      reward_weights=[1.0, 0.5, 2.0], logging_steps=1, ref_deepspeed=SHARDED)
    trainer = GRPOTrainer(tiny_model("qwen2"), [length_bonus, tiny_model("qwen2-reward"), remote], args=args,
                          train_dataset=data)
    trainer.train()
    return {"names": trainer.rewards.names, "metrics": training_rows(trainer)[0]}


with open(os.path.join(OUT, f"result-{rank}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written")
