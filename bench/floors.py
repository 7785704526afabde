"""The floors a GRPO step is measured against, on this machine: the fp32 matmul peak, plain-torch forward + backward
+ AdamW of one step's training tokens (no DeepSpeed, no vLLM, no GRPO), and generation's FLOP floor.

    python bench/floors.py --model /tmp/m32 [--completions 32] [--prompt 12] [--completion 128] [--threads 2]

(m32: `python -m dsgrpo.testing make --hidden 512 --layers 8 --heads 8 --vocab 1000 --out /tmp/m32`, the W1 model.)
The train floor runs the step's completions as micro-batches of --micro rows in one process with --threads threads
(the machine's cores); compare with `time/train` of bench/throughput.py on the same workload. The generation floor is
2 × parameters × generated tokens (+ attention over the context) at the matmul peak. Prints `RESULT ...` last."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_peak(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--completions", type=int, default=32, help="completions per optimizer step (all ranks)")
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--prompt", type=int, default=12)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    peak = matmul_peak(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.train()
    n_params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    L = a.prompt + a.completion
    vocab = model.config.vocab_size
    best = float("inf")
    for _ in range(a.repeat):
        start = time.perf_counter()
        for _ in range(a.completions // a.micro):
            ids = torch.randint(0, vocab, (a.micro, L))
            logits = model(input_ids=ids, logits_to_keep=a.completion + 1, use_cache=False).logits[:, :-1].float()
            logps = torch.log_softmax(logits, -1).gather(-1, ids[:, -a.completion :, None]).squeeze(-1)
            logps.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    tokens = a.completions * L
    train_flops = 6 * n_params * tokens
    cfg = model.config
    gen_tokens = a.completions * a.completion
    attention = 2 * cfg.num_hidden_layers * cfg.hidden_size * (a.prompt + a.completion / 2) * 2  # QK^T and AV
    gen_flops = gen_tokens * (2 * n_params + attention)
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s ({a.threads} threads, fp32)")
    print(f"model {a.model}: {n_params / 1e6:.1f}M parameters; {tokens} training tokens a step, {gen_tokens} generated")
    print(
        f"train floor (plain torch forward + backward + AdamW): {best:.3f} s = {train_flops / best / 1e9:.1f} GFLOP/s "
        f"({train_flops / best / peak:.0%} of the matmul peak)"
    )
    print(f"generation FLOP floor at the matmul peak: {gen_flops / peak:.3f} s ({gen_flops / 1e9:.1f} GFLOP)")
    print(
        f"RESULT peak_gflops={peak / 1e9:.1f} train_floor_s={best:.3f} generation_flop_floor_s={gen_flops / peak:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
