"""QLoRA (issue 67) on 2 ranks, on the CPU: bitsandbytes 0.50's CPU backend under real DeepSpeed and real
in-process vLLM. One launch of tests/dist_scripts/qlora_checks.py trains the tiny Qwen2 with a rank-8 adapter on
every linear layer of a 4-bit nf4 base under ZeRO-3 and of an 8-bit base under ZeRO-2 (3 steps each, beta 0.04, a
checkpoint at step 2, then a resume from it) and records the numbers asserted below."""

import json

import pytest

from launch import part, torchrun

pytestmark = pytest.mark.dist
RUNS = ("qlora_4bit_zero3", "qlora_8bit_zero2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora_checks")
    checks = "qlora_4bit_zero3,qlora_8bit_zero2,qlora_instance"
    torchrun("tests/dist_scripts/qlora_checks.py", str(out), checks, timeout=600)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora_split")  # split placement gives ranks roles for the process's life
    torchrun("tests/dist_scripts/qlora_checks.py", str(out), "qlora_split", timeout=600)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", RUNS)
def test_the_adapter_trains_on_a_quantised_base_that_stays_byte_for_byte(results, name):
    layer, stored = {"qlora_4bit_zero3": ("Linear4bit", "uint8"), "qlora_8bit_zero2": ("Linear8bitLt", "int8")}[name]
    for r in part(results, name):
        assert r["quantised_layers"] == [layer] and f"torch.{stored}" in r["base_dtypes"], r
        assert not r["reference_engine"]  # the reference is the policy with its adapter off
        assert r["frozen_identical"] and r["frozen_count"] > 0  # the packed base, byte for byte, after 3 updates
        assert r["moved_trainable"] > 1e-3  # the adapter moved
        history = r["history"]
        assert [h["step"] for h in history] == [1, 2, 3]
        assert all(0 <= h["reward"] <= 1 and abs(h["loss"]) < 10 for h in history), history
        kl = [h["kl"] for h in history]
        assert abs(kl[0]) < 1e-7 and kl[2] > 0, kl  # B starts at zero: the policy is its base at the first step


@pytest.mark.parametrize("name", RUNS)
def test_vllm_samples_the_dequantised_base_and_merged_adapter(results, name):
    """vLLM loaded the checkpoint in full precision: a sync before the first round gives it the weights the policy
    computes with (the quantised base, dequantised), so the sampler's log-probs are the trainer's to rounding, not
    to the quantisation error; every later sync adds the merged adapter."""
    for r in part(results, name):
        assert max_diff(r["at_start"]["vllm"], r["at_start"]["policy"]) > 1e-3  # what the first sync removes
        assert [s["round"] for s in r["syncs"]] == [-1, 0, 1]  # before round 1, after rounds 1 and 2
        for s in r["syncs"]:
            assert max_diff(s["vllm"], s["policy"]) <= 1e-4, s
        assert max_diff(r["syncs"][-1]["policy"], r["syncs"][0]["policy"]) > 1e-3  # the adapter's change arrived
        for h in r["history"]:
            assert h["sampling/sampling_logp_difference/max"] <= 1e-5, h  # quantisation error is ~1e-2 nats here


@pytest.mark.parametrize("name", RUNS)
def test_checkpoint_resumes_exactly_and_the_adapter_loads_in_peft(results, name):
    for r in part(results, name):
        assert r["resume_adapter_diff"] == 0.0 and r["resume_frozen_identical"], r
        assert r["resumed_steps"] == [1, 2, 3]
    main = part(results, name)[0]
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(main["saved_files"])
    assert "model.safetensors" not in main["saved_files"]
    # save_merged_model: the dequantised base with the adapter merged, a plain model that is the trained policy
    assert max_diff(main["reloaded_merged"], main["final_policy"]) <= 1e-4
    # the adapter on the full-precision base: the trained policy up to the base's quantisation error
    assert max_diff(main["reloaded_on_full_precision"], main["final_policy"]) < 0.2


def test_a_model_passed_loaded_in_4_bits_trains_and_vllm_starts_from_its_dequantised_weights(results):
    for r in part(results, "qlora_instance"):
        assert not r["initial_config_quantised"]  # initial_model is a plain checkpoint vLLM loads
        assert max_diff(r["at_start"]["vllm"], r["at_start"]["policy"]) <= 1e-4
        assert [h["step"] for h in r["history"]] == [1] and 0 <= r["history"][0]["reward"] <= 1


def test_split_placement_generators_start_from_the_dequantised_base(split_results):
    trainer, generator = part(split_results, "qlora_split")
    assert trainer["trains"] and not generator["trains"]
    assert [h["step"] for h in trainer["history"]] == [1, 2, 3]
    sent, loaded = trainer["by_version"], generator["by_version"]
    assert "0" in sent and "0" in loaded  # the weights before the first round, sent because the base is quantised
    assert max_diff(loaded["before"], sent["0"]) > 1e-3  # vLLM's checkpoint was the full-precision one
    for v in sorted(set(sent) & set(loaded), key=int):
        assert max_diff(sent[v], loaded[v]) <= 1e-4, v
    assert len(set(sent) & set(loaded)) >= 2
