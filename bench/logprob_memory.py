"""Peak memory of the log-prob step, before and after chunking (engines/forward.py): one forward + backward of a
random-init model of a real shape through the full-logits path (the [B, T, V] fp32 logits and their log-softmax,
dsgrpo before issue 16) and through the chunked path, each in a fresh process; the figure is the process's peak
resident memory (CPU) or torch.cuda.max_memory_allocated (GPU) above what it held once the model was built, less
the parameters' gradients (the same on both paths).

    python bench/logprob_memory.py [--shape qwen2.5-0.5b] [--rows 4] [--completion 512] [--prompt 64]

Prints one line per path and `RESULT full_peak_gib=... chunked_peak_gib=... ratio=...` last. The model's layers run
with gradient checkpointing so that the head dominates, as in a long-completion GRPO step."""

import argparse
import json
import os
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.lora_sync import SHAPES  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(a) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsgrpo.engines.forward import policy_forward

    torch.manual_seed(0)
    shape = dict(SHAPES[a.shape])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if gpu else torch.float32).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    T, B = a.completion, a.rows
    ids = torch.randint(0, config.vocab_size, (B, a.prompt + T), device=dev)
    mask = torch.ones_like(ids)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    if a.path == "full":
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=T + 1, use_cache=False
        )
        logits = out.logits[:, :-1, :].float()
        logps = torch.log_softmax(logits, -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    else:
        logps = policy_forward(model, ids, mask, T).logps
    logps.sum().backward()
    if gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {
        "path": a.path,
        "peak_bytes": int(peak - grads),
        "logit_bytes": B * T * config.vocab_size * 4,
        "device": "cuda" if gpu else "cpu",
        "grad_bytes": int(grads),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--path", choices=("full", "chunked"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.path:
        print("JSON " + json.dumps(worker(a)), flush=True)
        return 0
    results = {}
    for path in ("full", "chunked"):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--path",
            path,
            "--shape",
            a.shape,
            "--rows",
            str(a.rows),
            "--completion",
            str(a.completion),
            "--prompt",
            str(a.prompt),
        ]
        # a fixed mmap threshold: glibc returns every large freed block at once, so the resident peak is the live peak
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        line = [x for x in out.stdout.splitlines() if x.startswith("JSON ")]
        if out.returncode or not line:
            print(out.stdout[-3000:], out.stderr[-3000:])
            return 1
        results[path] = json.loads(line[-1][5:])
        r = results[path]
        print(
            f"{path:8s} peak above the built model and its gradients ({r['grad_bytes'] / 2**30:.2f} GiB): "
            f"{r['peak_bytes'] / 2**30:6.2f} GiB "
            f"(one fp32 copy of the [B, T, V] logits: {r['logit_bytes'] / 2**30:.2f} GiB; {r['device']})",
            flush=True,
        )
    full, chunked = results["full"]["peak_bytes"], results["chunked"]["peak_bytes"]
    print(
        f"RESULT shape={a.shape} rows={a.rows} completion={a.completion} full_peak_gib={full / 2**30:.2f} "
        f"chunked_peak_gib={chunked / 2**30:.2f} ratio={full / max(1, chunked):.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
