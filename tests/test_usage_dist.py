"""TRL users' sampling settings and policies on 2 ranks (real DeepSpeed ZeRO-3, real in-process vLLM, fp32 CPU).
One launch of tests/dist_scripts/usage_checks.py records numbers; each test asserts on one part of them."""

import json

import pytest

from launch import part, rank_results, torchrun

pytestmark = pytest.mark.dist


def launch(tmp_path_factory, checks):
    out = tmp_path_factory.mktemp("usage_checks")
    proc = torchrun("tests/dist_scripts/usage_checks.py", str(out), checks, timeout=900)
    per_rank = rank_results(out)
    per_rank[0]["_stdout"] = proc.stdout
    return per_rank


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, "truncated_sampling")


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    """MoE policies in a launch of their own: vLLM builds its expert-parallel group with the first engine of a
    process, so a MoE engine cannot follow a dense one in the same process (one engine per process in real runs)."""
    return launch(tmp_path_factory, "moe")


@pytest.mark.parametrize("setting", ["top_p", "top_k", "min_p"])
def test_truncated_sampling_keeps_learning(results, setting):
    for run in part(results, "truncated_sampling"):
        rows = run[setting]["history"]
        assert run[setting]["moved"] > 1e-2  # the weights move
        for h in rows:
            # the trainer scores the distribution vLLM sampled from: the gap is fp32 rounding, as unfiltered
            assert h["sampling/sampling_logp_difference/max"] <= 1e-3, h
            assert abs(h["sampling/importance_sampling_ratio/mean"] - 1.0) <= 1e-3, h
            assert h["grad_norm"] > 0.1, h


def test_the_old_behaviour_stopped_learning_and_now_says_so(results):
    """With the trainer scoring the unfiltered distribution (dsgrpo before), top_k=10 left a gap of about 4 nats a
    token, correction weights of 0 and a zero gradient; the run now prints why."""
    for run in part(results, "truncated_sampling"):
        rows = run["top_k_as_before"]["history"]
        assert all(h["sampling/sampling_logp_difference/mean"] > 1.0 for h in rows)
        assert all(h["sampling/importance_sampling_ratio/mean"] < 1e-3 and h["grad_norm"] < 1e-6 for h in rows)
    assert "the policy is barely learning" in results[0]["_stdout"]


FIXED = [1, 5, 9, 12, 30, 31, 32, 33, 34, 35]  # recorder.FIXED


def exported_logps(path):
    """log-probs of FIXED[1:] under the exported folder, through AutoModelForCausalLM and through vLLM (a process
    of its own)."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from launch import REPO

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([FIXED])
    with torch.no_grad():
        hf = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
    code = f"""
import os, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model={path!r}, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 * 2**20, max_model_len=128)
out = llm.generate([{{"prompt_token_ids": {FIXED}}}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
print("LOGPS", json.dumps([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], {FIXED}[1:])]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("LOGPS")][0]
    return hf, json.loads(line[len("LOGPS ") :])


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "qwen3-moe-lora"])
def test_a_moe_policy_trains_with_vllm_in_step(moe_results, name):
    """transformers keeps the experts fused; the sync sends them expert by expert (as the checkpoint and vLLM name
    them) and vLLM's log-probs equal the policy's after every sync, LoRA on the attention layers included."""
    for run in part(moe_results, "moe"):
        r = run[name]
        assert r["moved"] > 1e-2
        assert len(r["syncs"]) == 3  # at start, after steps 1 and 2 (the last step's weights are never sampled)
        for s in r["syncs"]:
            assert max(abs(a - b) for a, b in zip(s["vllm"], s["policy"])) <= 1e-4, s
        assert all(h["kl"] >= 0 for h in r["history"])
        # TRL's rule: a MoE policy's router load-balancing loss joins the loss (the config's coefficient)
        assert all(h["aux_loss"] > 0 for h in r["history"])


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
def test_a_moe_export_loads_in_transformers_and_vllm(moe_results, name):
    r = part(moe_results, "moe")[0][name]
    hf, vllm = exported_logps(r["export"])
    assert max(abs(a - b) for a, b in zip(hf, r["final_policy"])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(vllm, r["final_policy"])) <= 1e-4
