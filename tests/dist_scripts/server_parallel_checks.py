"""One training process (real DeepSpeed ZeRO-3, fp32) against a `dsgrpo vllm-serve` server of 2 ranks the test
started: --tensor-parallel-size 2 (one engine sharded over both) or --data-parallel-size 2 (two engines splitting
each request). Records the server's log-probs against the policy's after every push in OUT/result-0.json.

Usage: torchrun --nproc_per_node 1 tests/dist_scripts/server_parallel_checks.py OUT PORT GROUP_PORT
"""

import json
import os
import sys

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer
from dsgrpo.http import request_json
from dsgrpo.testing import tiny_model
from recorder import FIXED, SHARDED_ZERO3, after_each_sync, digit_fraction, policy_logps, recorder, training_rows

OUT, PORT, GROUP_PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
URL = f"http://127.0.0.1:{PORT}"
results = {}
check = recorder(results)


def server_logps():
    return request_json(URL + "/score", {"token_ids": FIXED}, timeout=120)["logprobs"]


@check("parallel_server")
def _():
    prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    args = GRPOConfig(
        output_dir=os.path.join(OUT, "run"),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=2e-3,
        logging_steps=1,
        gradient_checkpointing=False,
        seed=1,
        deepspeed=SHARDED_ZERO3,
        save_steps=10**6,
        vllm_mode="server",
        vllm_server_port=PORT,
        vllm_group_port=GROUP_PORT,
        vllm_server_timeout=120,
    )
    t = GRPOTrainer(tiny_model("qwen2-tied"), digit_fraction, train_dataset=prompts, args=args)
    syncs = [{"server": server_logps(), "policy": policy_logps(t.policy.engine)}]
    after_each_sync(
        t, lambda needed: needed and syncs.append({"server": server_logps(), "policy": policy_logps(t.policy.engine)})
    )
    t.train()
    return {"syncs": syncs, "history": training_rows(t), "health": request_json(URL + "/health")}


with open(os.path.join(OUT, "result-0.json"), "w") as fh:
    json.dump(results, fh)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
