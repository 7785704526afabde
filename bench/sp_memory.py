"""Memory of the training side of a step with sequence parallelism (issue 28): every rank trains on one long
completion, with and without a sequence-parallel group of both ranks, and the train phase's rise above its start is
read from the trainer's `memory/rise_gib/train` (the larger rank's).

    python -m dsgrpo.testing make --hidden 256 --layers 4 --heads 4 --max-positions 32768 --out /tmp/m_sp
    torchrun --nproc_per_node 2 bench/sp_memory.py --model /tmp/m_sp --length 8192 --sp 1
    torchrun --nproc_per_node 2 bench/sp_memory.py --model /tmp/m_sp --length 8192 --sp 2
    ... --lengths 8192,10240,12288 --cap-gib 1.0   a sweep, then the longest completion whose rise stays in the cap

The rollouts come from a rollout_func (one completion of --length tokens per prompt, no generation), so the figures
are the training side's alone. fp32, gradient checkpointing off, token_budget one row. One line per length:
`RESULT sp=<N> length=<L> train_rise_gib=<...> train_peak_gib=<...> train_s=<...>`, and with --cap-gib
`LONGEST sp=<N> cap_gib=<C> length=<L>`.

The processes run with a fixed glibc mmap threshold (MALLOC_MMAP_THRESHOLD_, set here unless --resident-heap):
every freed activation buffer then goes back to the OS at once, so the resident high-water mark is the live peak,
as the CUDA allocator's max_memory_allocated is on GPU. With glibc's default sliding threshold, freed buffers of up
to 32 MiB stay in the heap, and the resident peak carries ~0.5 GiB of fragmentation at 8k tokens that does not
shrink with N (measured: 1.43 vs 0.99 GiB, 0.70x, where the live figures are 1.01 vs 0.55 GiB, 0.54x).
dsgrpo itself leaves glibc's default in place: the fixed threshold page-faults every large allocation (W2's step
20% slower)."""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(model: str, length: int, sp: int, steps: int) -> dict:
    import torch
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer, dist

    prompts = Dataset.from_list([{"prompt": f"Count from {i}:"} for i in range(64)])

    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        g = torch.Generator().manual_seed(dist.rank())
        ids = [tok(p)["input_ids"] for p in prompts]
        return {
            "prompt_ids": ids,
            "completion_ids": [torch.randint(10, 500, (length,), generator=g).tolist() for _ in prompts],
            "logprobs": [[-3.0] * length for _ in prompts],
        }

    def reward(completions, **kw):
        return [float(i % 2) for i in range(len(completions))]

    longest = 16 + length
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="sp-bench-"),
        max_steps=steps,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=length,
        max_prompt_length=16,
        learning_rate=1e-6,
        logging_steps=1,
        bf16=False,
        use_vllm=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        token_budget=-(-longest // sp),
        parallelism_config={"sp_backend": "deepspeed", "sp_size": sp} if sp > 1 else None,
    )
    trainer = GRPOTrainer(model, reward, args=args, train_dataset=prompts, rollout_func=rollout_func)
    trainer.train()
    rows = [h for h in trainer.state.log_history if "memory/rise_gib/train" in h]
    mine = torch.tensor(
        [
            max(h["memory/rise_gib/train"] for h in rows),
            max(h["memory/peak_gib/train"] for h in rows),
            sum(h["time/train"] for h in rows[1:]) / max(1, len(rows) - 1),
        ]
    )
    worst = dist.all_reduce_max(mine)
    return {"rise": float(worst[0]), "peak": float(worst[1]), "train_s": float(worst[2])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--lengths", default="", help="a comma-separated sweep instead of --length")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cap-gib", type=float, default=0.0, help="report the longest swept length whose rise fits")
    p.add_argument("--resident-heap", action="store_true", help="keep glibc's sliding mmap threshold")
    a = p.parse_args()
    if not a.resident_heap and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc reads it at start: re-exec this process (same pid, so torchrun keeps watching it)
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576"))
    from dsgrpo import dist

    fits = []
    for length in [int(x) for x in a.lengths.split(",")] if a.lengths else [a.length]:
        r = measure(a.model, length, a.sp, a.steps)
        if r["rise"] <= a.cap_gib:
            fits.append(length)
        if dist.is_main():
            print(
                f"RESULT sp={a.sp} length={length} train_rise_gib={r['rise']:.3f} train_peak_gib={r['peak']:.3f} "
                f"train_s={r['train_s']:.2f}",
                flush=True,
            )
    if a.cap_gib and dist.is_main():
        print(f"LONGEST sp={a.sp} cap_gib={a.cap_gib} length={max(fits, default=0)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
