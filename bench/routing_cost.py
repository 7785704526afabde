"""What routing replay costs: seconds per round of a MoE policy (tiny local Qwen3-MoE or a wider one built here,
random weights) sampling with its own generate on 2 ranks, ZeRO-3, with the routing tap removed (what dsgrpo did
before issue 31), with routes captured and compared (routing_replay='off', the default for MoE policies), and
replayed (routing_replay='rollout'). Each variant trains the same rounds in one process, one after the other; the
first 2 rounds of each are left out (start-up); "no tap" runs before and after the others (the mean of both is the
base). Figures, not assertions.

    torchrun --nproc_per_node 2 bench/routing_cost.py [--steps 12] [--width 256] [--completion 32] [--bf16]

Prints one line per variant (generate and train phase seconds per round, moe/router_agreement) and
`RESULT ...` last."""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def build_model(width: int, out: str) -> str:
    """A Qwen3-MoE of `width` with the tiny test model's tokenizer (random weights, 4 layers, 8 experts, top 2)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dsgrpo.testing import tiny_model

    base = tiny_model("qwen3-moe")
    config = AutoConfig.from_pretrained(base)
    config.update(
        dict(
            hidden_size=width,
            intermediate_size=2 * width,
            moe_intermediate_size=width // 2,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=width // 4,
            num_experts=8,
            num_experts_per_tok=2,
        )
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()

    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer, dist
    from dsgrpo.engines import routing

    out = os.path.join(tempfile.gettempdir(), "dsgrpo_routing_cost")
    model = os.path.join(out, f"model-{a.width}")
    dist.init()
    if dist.is_main() and not os.path.isdir(model):
        build_model(a.width, model)
    dist.barrier("model built")
    prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])

    def reward(prompts, completions, **kw):
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    attach = routing.attach
    rows = {}
    # a first, unreported variant warms the process up (allocator, thread pools): the first trainer of a process
    # ran ~10% slower than the same one later
    for name, mode in (
        ("warm-up", "off"),
        ("no tap", "off"),
        ("compare (off)", "off"),
        ("replay (rollout)", "rollout"),
        ("no tap again", "off"),
    ):
        routing.attach = (lambda engine, replace: None) if name.startswith("no tap") else attach
        args = GRPOConfig(
            output_dir=os.path.join(out, name.split()[0]),
            max_steps=a.steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=a.completion,
            learning_rate=1e-3,
            logging_steps=1,
            gradient_checkpointing=False,
            seed=0,
            use_vllm=False,
            routing_replay=mode,
            bf16=a.bf16,
            save_strategy="no",
            report_to=[],
            deepspeed="zero3.json",
        )
        t = GRPOTrainer(model, reward, train_dataset=prompts, args=args)
        t.train()
        hist = [h for h in t.state.log_history if "loss" in h and "train_runtime" not in h][2:]
        rows[name] = {k: statistics.mean(h[k] for h in hist) for k in ("time/generate", "time/train")}
        rows[name]["agreement"] = statistics.mean(h.get("moe/router_agreement", float("nan")) for h in hist)
        rows[name]["own"] = statistics.mean(h.get("moe/router_own_agreement", float("nan")) for h in hist)
    routing.attach = attach
    rows.pop("warm-up")
    if dist.is_main():
        for name, r in rows.items():
            print(
                f"{name:18s} generate {r['time/generate']:.3f} s  train {r['time/train']:.3f} s  "
                f"router_agreement {r['agreement']:.4f}  own {r['own']:.4f}",
                flush=True,
            )
        base = {k: (rows["no tap"][k] + rows["no tap again"][k]) / 2 for k in ("time/generate", "time/train")}
        print(
            "RESULT "
            + " ".join(
                f"{n.split()[0]}_{k.split('/')[1]}_vs_no_tap={rows[n][k] / base[k]:.3f}"
                for n in ("compare (off)", "replay (rollout)")
                for k in ("time/generate", "time/train")
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
