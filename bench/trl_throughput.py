"""TRL 1.16's GRPOTrainer on the workload of bench/throughput.py, for side-by-side figures on the same machine:
the same synthetic prompts, the same digit-fraction reward, fp32, temperature 1.0; generation with transformers
(--vllm for colocated vLLM, which fails on vLLM-CPU at TRL's first weight sync).

    python bench/trl_throughput.py --model /tmp/m32 --steps 5 --num-generations 8 --max-completion-length 128 \\
        --batch-size 32 [--gradient-checkpointing]
    torchrun --nproc_per_node 2 bench/trl_throughput.py ...      # two processes (DDP over gloo)

Prints `RESULT sec_per_step=<mean over steps 2..N> completion_tok_per_s=<...>` last (rank 0). Needs trl installed
(the test extras have it)."""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.throughput import digit_fraction, long_tail_kwargs, stop_ids  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="completions per optimizer step, all ranks")
    p.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off unless given")
    p.add_argument("--stop-ids", type=int, default=0, help="long-tailed lengths, as bench/throughput.py's")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="colocated vLLM (vLLM-CPU 0.32: TRL's weight sync calls the "
        "live model's load_weights, which the CPU backend's repacked "
        "layers refuse; so on CPU TRL generates with transformers)",
    )
    a = p.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = Dataset.from_list([{"prompt": f"Count from {i} and keep going:"} for i in range(512)])
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size // world,
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        temperature=1.0,
        learning_rate=1e-6,
        gradient_checkpointing=a.gradient_checkpointing,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        use_vllm=a.vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        generation_kwargs=long_tail_kwargs(a.stop_ids, hf=not a.vllm) or None,
    )
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    model = a.model
    if a.stop_ids:
        # TRL ends a completion (its mask, its length metric) at the ids in the model's generation_config, not at
        # generation_kwargs' eos list: without this its completions end at the stop ids yet count as full length
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32")
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = ([eos] if isinstance(eos, int) else list(eos or [])) + stop_ids(
            a.stop_ids
        )
    trainer = GRPOTrainer(
        model=model, reward_funcs=digit_fraction, args=args, train_dataset=prompts, callbacks=[Clock()]
    )
    start = time.perf_counter()
    trainer.train()
    steps = [t1 - t0 for t0, t1 in zip([start] + stamps[:-1], stamps)][1:]
    history = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [h["completions/mean_length"] * a.batch_size for h in history][1:]
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"TRL {a.model}: world {world}, {a.batch_size} completions/step, checkpointing {a.gradient_checkpointing}"
        )
        print(f"RESULT sec_per_step={sum(steps) / len(steps):.3f} completion_tok_per_s={sum(tokens) / sum(steps):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
