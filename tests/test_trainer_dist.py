"""GRPOTrainer on 2 ranks with real DeepSpeed ZeRO-3 and real in-process vLLM (fp32, CPU). One launch of
tests/dist_scripts/trainer_checks.py records numbers; each test below asserts on one part of them."""

import json
import os

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_checks")
    torchrun("tests/dist_scripts/trainer_checks.py", str(out), timeout=900)
    per_rank = [json.load(open(out / f"result-{r}.json")) for r in range(2)]
    for r in per_rank:
        for name, value in r.items():
            assert not (isinstance(value, dict) and "error" in value), f"check {name} failed:\n{value['error']}"
    return {"out": out, "ranks": per_rank, **per_rank[0]}


def test_zero3_really_shards(results):
    for r in results["ranks"]:
        for name, full, local, placeholder in r["sharding"]["params"]:
            assert local == -(-full // 2), (name, full, local)  # ceil(numel / world): this rank's share only
            assert placeholder == 0, name  # the module's own tensor is an empty placeholder
    assert results["sharding"]["has_reference"] is True


def test_vllm_logprobs_match_the_policy_after_every_sync(results):
    assert results["vllm_run"]["eager"] is False  # the compiled engine (vllm_enforce_eager=False) takes the syncs
    history = results["vllm_run"]["history"]
    gaps = [h["sampling/sampling_logp_difference/max"] for h in history]
    assert len(gaps) == results["vllm_run"]["max_steps"] >= 10
    assert max(gaps) <= 1e-4, gaps
    # ... while the weights really changed between syncs
    before, after = results["initial_logps"], results["vllm_run"]["final_logps"]
    assert max(abs(a - b) for a, b in zip(before, after)) > 0.05


def test_reference_kl_is_zero_first_and_positive_later(results):
    kl = [h["kl"] for h in results["vllm_run"]["history"]]
    assert abs(kl[0]) < 1e-6, kl[:3]
    assert kl[-1] > 1e-4, kl[-3:]


def test_short_run_learns(results):
    rewards = [h["reward"] for h in results["vllm_run"]["history"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # a random model writes ~25% digit characters; 40 steps of RL push that well up
    assert last >= first + 0.12 and last >= 1.4 * first, (first, last, rewards)


def test_callbacks_and_metrics_jsonl_use_trl_names(results):
    run = results["vllm_run"]
    assert run["callback_steps"] == list(range(1, run["max_steps"] + 1))
    assert (run["began"], run["ended"], run["callback_logs"]) == (1, 1, run["max_steps"])
    assert run["columns_ok"]
    records = [json.loads(l) for l in open(results["out"] / "vllm_run" / "metrics.jsonl")]
    lines = [r for r in records if "reward" in r]
    assert [l["step"] for l in lines] == list(range(1, run["max_steps"] + 1))
    names = {
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/digit_fraction_with_column/mean",
        "rewards/digit_fraction_with_column/std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "time/generate",
        "time/reward",
        "time/reference",
        "time/train",
        "time/sync",
        "completion_tok_per_s",
    }
    assert names <= set(lines[0]), names - set(lines[0])
    assert lines[-1]["num_tokens"] > lines[0]["num_tokens"] > 0


def test_hf_backend_has_the_same_logprob_semantics(results):
    for r in results["ranks"]:
        assert r["hf_logprob_semantics"]["tokens"] > 0
        assert r["hf_logprob_semantics"]["max_gap"] <= 1e-4


def test_one_step_gradient_equals_single_process_dapo(results):
    for r in results["ranks"]:
        g = r["gradient"]
        assert g["max_grad"] > 1e-3  # the comparison is not vacuous
        assert g["max_abs_diff"] <= 2e-5, g
        assert abs(g["loss"] - g["ref_loss"]) <= 1e-5 and abs(g["ref_loss"]) > 1e-3, g


def test_exported_model_loads_in_transformers_and_vllm(results):
    from launch import REPO
    import subprocess
    import sys

    path = str(results["out"] / "vllm_run")
    code = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained({path!r}); t = AutoTokenizer.from_pretrained({path!r})
assert m.config.tie_word_embeddings and t.chat_template
from vllm import LLM, SamplingParams
llm = LLM(model={path!r}, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 * 2**20, max_model_len=256)
out = llm.generate(["Write some numbers 3:"], SamplingParams(max_tokens=4, temperature=0))
print("GENERATED", len(out[0].outputs[0].token_ids))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert "GENERATED" in proc.stdout, proc.stderr[-3000:]


def test_eval_and_wandb_offline(results):
    run = results["vllm_run"]
    evals = run["evals"]
    assert len(evals) == run["max_steps"] // 20
    assert all(0.0 <= e["eval_reward"] <= 1.0 and "eval_rewards/digit_fraction_with_column/mean" in e for e in evals)
    records = [json.loads(l) for l in open(results["out"] / "vllm_run" / "metrics.jsonl")]
    assert [r["step"] for r in records if "eval_reward" in r] == [20 * (i + 1) for i in range(len(evals))]
    runs = list((results["out"] / "vllm_run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), runs


def test_zero2_trains_too(results):
    for r in results["ranks"]:
        z = r["zero2"]
        assert z["stage"] == 2 and z["steps"] == 2
        assert z["moved"] > 1e-4 and all(abs(x) < 1e3 for x in z["loss"])
