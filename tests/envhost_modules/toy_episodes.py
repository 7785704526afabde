"""Episode functions the env host's python adapter runs in tests/test_envhost.py (standard library only: the host
imports nothing of dsgrpo's)."""

import asyncio
import json
import os
import urllib.request


def rows(limit):
    return [{"prompt": [{"role": "user", "content": f"Say {i}"}], "task_index": i} for i in range(limit or 3)]


async def echo(base_url, episode_id, row, model, api_key):
    print("an environment that prints to stdout")  # must not reach the protocol
    await asyncio.sleep(float(row.get("sleep", 0)))
    if row.get("fail"):
        raise ValueError("the environment broke")
    return {
        "reward": float(row["task_index"]),
        "metrics": {"seen": 1.0, "index": float(row["task_index"])},
        "branches": [],
        "echo": [base_url, episode_id, model, api_key, os.getpid()],
    }


async def die(base_url, episode_id, row, model, api_key):
    await asyncio.sleep(float(row.get("sleep", 0)))
    os._exit(3)


async def chat(base_url, episode_id, row, model, api_key):
    """Two chat calls against the trainer's endpoint, the second continuing the first (what an agent loop does)."""

    def post(body):
        req = urllib.request.Request(
            base_url + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Episode-Id": episode_id},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    messages = list(row["prompt"])
    reply = await asyncio.to_thread(post, {"model": model, "messages": messages, "max_tokens": 8})
    messages += [reply["choices"][0]["message"], {"role": "user", "content": "again"}]
    reply = await asyncio.to_thread(post, {"model": model, "messages": messages, "max_tokens": 8})
    return {"reward": float(len(reply["choices"][0]["message"]["content"] or "") % 3), "branches": row.get("branches")}


async def one_call(base_url, episode_id, row, model, api_key):
    """One chat call against the trainer's endpoint (bench/env_host.py: the protocol's cost beside in-process)."""

    def post():
        req = urllib.request.Request(
            base_url + "/chat/completions",
            data=json.dumps({"model": model, "messages": row["prompt"]}).encode(),
            headers={"Content-Type": "application/json", "X-Episode-Id": episode_id},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    reply = await asyncio.to_thread(post)
    return {"reward": float(len(reply["choices"][0]["message"]["content"] or ""))}
