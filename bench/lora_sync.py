"""What a LoRA policy's weight sync costs: peak bytes held gathered at once and seconds per sync, for the merged
stream (engines/lora.py) beside the plain stream of a full fine-tune, on a ZeRO-3 policy of a real model's shape
(random weights: no download).

    torchrun --nproc_per_node 2 bench/lora_sync.py [--shape qwen2.5-0.5b] [--bucket-mb 64] [--r 16] [--repeat 2]

Prints one line per stream and `RESULT lora_peak_gathered_mb=<...> model_mb=<...>` last."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SHAPES = {  # Hugging Face config fields of real models
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()

    import deepspeed
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsgrpo import GRPOConfig, device, dist
    from dsgrpo.engines.builder import build_policy_engine, resolve
    from dsgrpo.engines.gather import GatherStats
    from dsgrpo.engines.weights import named_full_parameters
    from dsgrpo.engines.lora import wrap_with_lora

    device.prepare_process(dist.local_world_size(), None)
    dist.init()
    dtype = torch.bfloat16 if device.use_bf16(None) else torch.float32
    args = GRPOConfig(
        output_dir="/tmp/dsgrpo_bench_lora",
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_checkpointing=False,
    )
    shape = dict(SHAPES[a.shape])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    ds = resolve(args.deepspeed, args, config.hidden_size, "deepspeed", train=True, world_size=dist.world_size())
    bucket = int(a.bucket_mb * 2**20)
    results = {}
    for kind in ("full", "lora"):
        with deepspeed.zero.Init(config_dict_or_path=ds, dtype=dtype):  # partitioned as it is built
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if kind == "lora":
            model = wrap_with_lora(model, LoraConfig(r=a.r, lora_alpha=2 * a.r, target_modules="all-linear"), 0)
        engine = build_policy_engine(model, args, ds)
        weights_dtype = next(engine.module.parameters()).dtype
        seconds = []
        for _ in range(a.repeat):
            GatherStats.reset()
            start = time.perf_counter()
            total = sum(t.numel() * t.element_size() for _, t in named_full_parameters(engine.module, bucket, True))
            seconds.append(time.perf_counter() - start)
        results[kind] = (GatherStats.peak_bytes, total, min(seconds))
        if dist.is_main():
            print(
                f"{a.shape} {kind:4s} stream: {total / 2**20:8.1f} MB sent, peak gathered "
                f"{GatherStats.peak_bytes / 2**20:7.1f} MB (bucket {a.bucket_mb:g} MB), {min(seconds):.2f} s/sync "
                f"over {dist.world_size()} ranks ({weights_dtype})",
                flush=True,
            )
        del engine, model
    if dist.is_main():
        peak, total, _ = results["lora"]
        print(f"RESULT lora_peak_gathered_mb={peak / 2**20:.1f} model_mb={total / 2**20:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
