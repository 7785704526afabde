"""LoRA policies (`peft_config`) on 2 ranks with real DeepSpeed ZeRO-3 and real in-process vLLM (fp32, CPU). One
launch of tests/dist_scripts/lora_checks.py trains the tiny Qwen2 with a rank-8 adapter on every linear layer
(3 steps, beta 0.04, a checkpoint at step 2, then a resume from it, then an AsyncGRPOTrainer run) and records the
numbers asserted below."""

import json
import os
import subprocess
import sys

import pytest
import torch

from launch import part, torchrun

pytestmark = pytest.mark.dist
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist_scripts"))
BUCKET = 64 * 1024  # tests/dist_scripts/lora_checks.py's weight_sync_bucket_bytes


COLOCATE_CHECKS = "lora_gradients,lora,resume_other_adapter,peft_model_instance,async_lora"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_checks")
    torchrun("tests/dist_scripts/lora_checks.py", str(out), COLOCATE_CHECKS, timeout=600)
    return out


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_split")
    torchrun("tests/dist_scripts/lora_checks.py", str(out), "split_lora", timeout=600)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def results(run_dir):
    return [json.load(open(run_dir / f"result-{r}.json")) for r in range(2)]


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_adapter_gradients_under_zero3_equal_one_process(results):
    for r in part(results, "lora_gradients"):
        assert r["names_match"]
        assert r["min_grad_norm"] > 1e-4  # every adapter matrix has a gradient to compare
        assert r["max_diff"] <= 1e-6, r


def test_only_the_adapter_trains_and_only_it_has_optimizer_state(results):
    for r in part(results, "lora"):
        assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
        assert r["moved_frozen"] == 0.0  # base weights bit-identical after 3 updates
        assert r["moved_lora_B"] > 1e-3  # the adapter did move
    ranks = part(results, "lora")
    adapter = ranks[0]["adapter_numel"]
    optimizer = sum(r["optimizer_numel_here"] for r in ranks)  # each rank's fp32 partition of what it optimizes
    assert adapter <= optimizer <= adapter + 2 * 64, (optimizer, adapter)
    assert optimizer < ranks[0]["frozen_numel"] / 10


def test_reference_is_the_policy_with_adapters_off(results):
    for r in part(results, "lora"):
        assert not r["reference_engine"] and not r["ref_ds_config"]  # no second engine, no second config
        kl = [h["kl"] for h in r["history"]]
        assert abs(kl[0]) < 1e-7, kl  # B starts at zero: policy == base at the first step
        assert kl[1] > 1e-4 and kl[2] > kl[1], kl  # and drifts from it once the adapter trains


def test_vllm_serves_the_merged_weights_after_every_sync(results):
    for r in part(results, "lora"):
        assert max_diff(r["at_start"]["vllm"], r["at_start"]["policy"]) <= 1e-4
        assert [s["round"] for s in r["syncs"]] == [0, 1]  # after rounds 1 and 2 (the last round's is not sampled)
        for s in r["syncs"]:
            assert max_diff(s["vllm"], s["policy"]) <= 1e-4, s
        assert max_diff(r["syncs"][-1]["policy"], r["at_start"]["policy"]) > 1e-3  # the synced weights changed
        for h in r["history"]:
            assert h["sampling/sampling_logp_difference/max"] <= 1e-3


def test_merge_sync_gathers_one_layer_at_a_time(results):
    r = part(results, "lora")[0]
    for s in r["syncs"]:
        print(f"peak gathered {s['peak_gathered_bytes']} B of a {r['model_bytes']} B model (bucket {BUCKET} B)")
        # one decoder layer's full weights (base and adapters: the merge's unit is the layer) and one bucket at most
        assert s["peak_gathered_bytes"] <= r["largest_layer_bytes"] + BUCKET
        assert r["largest_layer_bytes"] >= r["largest_unit_bytes"]
        assert s["peak_gathered_bytes"] < r["model_bytes"] / 2
    names = r["unit_names"]  # the merged stream carries the base model's checkpoint names, nothing of peft's
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert not [n for n in names if "lora_" in n or "base_layer" in n or n.startswith("base_model.")]


def test_exported_adapter_and_merged_model_reproduce_the_policy(results):
    r = part(results, "lora")[0]
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(r["saved_files"])
    assert "model.safetensors" not in r["saved_files"]  # the adapter alone, not the base model
    assert r["adapter_config"]["r"] == 8 and r["adapter_config"]["peft_type"] == "LORA"
    assert max_diff(r["reloaded_adapter"], r["final_policy"]) <= 1e-5
    assert max_diff(r["reloaded_merged"], r["final_policy"]) <= 1e-5
    assert max_diff(r["base_model"], r["final_policy"]) > 1e-3  # what would fail if the adapter were lost


def test_checkpoint_holds_the_adapter_and_resumes_exactly(results):
    for r in part(results, "lora"):
        assert r["checkpoint_bytes"] < r["frozen_numel"] * 4 / 2  # no copy of the frozen base weights
        assert r["resume_adapter_diff"] == 0.0 and r["resume_frozen_diff"] == 0.0
        assert r["resumed_steps"] == [1, 2, 3]
    for r in part(results, "resume_other_adapter"):
        assert r["error_type"] == "CheckpointError" and "'r': 4" in r["message"] and "adapter" in r["message"]


def test_a_peft_model_passed_as_model_trains_its_adapter(results):
    for r in part(results, "peft_model_instance"):
        # vLLM starts from the merged weights of the given adapter, and the policy is that PeftModel
        assert max_diff(r["at_start"]["vllm"], r["expected"]) <= 1e-4
        assert max_diff(r["at_start"]["policy"], r["expected"]) <= 1e-5
        assert not r["reference_engine"]
        assert r["kl"] > 1e-4  # the reference is the base: the given adapter already moved the policy from it


def test_async_trainer_trains_a_lora_policy(results):
    for r in part(results, "async_lora"):
        history = r["history"]
        assert [h["step"] for h in history] == [1, 2, 3]
        assert abs(history[0]["kl"]) < 1e-7 and history[2]["kl"] > 1e-4
        for h in history:  # max_staleness 0: vLLM samples from exactly the merged policy
            assert h["sampling/sampling_logp_difference/max"] <= 1e-3


def test_dsgrpo_export_turns_a_lora_checkpoint_into_adapter_and_merged_model(run_dir, results, tmp_path):
    """The resumed run's checkpoint-3 holds the final adapter (the resume is exact): `dsgrpo export --merged`
    rebuilds it in PEFT's format and merges it into the base, both reproducing the policy's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dsgrpo.testing import tiny_model
    from recorder import policy_logps

    out = tmp_path / "exported"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsgrpo.cli",
            "export",
            str(run_dir / "lora_resumed" / "checkpoint-3"),
            str(out),
            "--merged",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "adapter_model.safetensors").exists() and (out / "merged" / "model.safetensors").exists()
    final = part(results, "lora")[0]["final_policy"]  # lora_checks' policy_logps of the trained policy
    base = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    assert max_diff(policy_logps(PeftModel.from_pretrained(base, str(out)).eval()), final) <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    assert max_diff(policy_logps(merged), final) <= 1e-5


def test_split_placement_generators_receive_the_merged_weights(split_results):
    trainer, generator = part(split_results, "split_lora")
    assert trainer["trains"] and not generator["trains"]
    assert [h["step"] for h in trainer["history"]] == [1, 2, 3]
    versions = sorted(set(trainer["by_version"]) & set(generator["by_version"]), key=int)
    assert len(versions) >= 2, (trainer["by_version"].keys(), generator["by_version"].keys())
    for v in versions:  # after every broadcast vLLM on the generating rank scores like the trained policy
        assert max_diff(trainer["by_version"][v], generator["by_version"][v]) <= 1e-4, v
    assert max_diff(trainer["by_version"][versions[-1]], trainer["by_version"]["0"]) > 1e-3
