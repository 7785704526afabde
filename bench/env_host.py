"""Episodes a second in-process against through the environment host (issue 66), one process, one engine: the
tiny Qwen2 on vLLM-CPU behind the agents' endpoint (rollout/openai_endpoint.py), and the same number of one-call
episodes run three ways, each with the same concurrency:

- in-process: an async agent in the trainer's process (what agent_rollout runs), one chat call an episode;
- host (python): the env host in this interpreter, its python adapter making the same call (the protocol's cost);
- verifiers (dsgrpo_chat): the verifiers venv's host, the chat loop inside the host (envhost/plugins/dsgrpo_chat.py),
  verifiers' interception and TrainClient on /inference/v1/generate (tests/envhost_modules/dsgrpo_vf_digits);
- verifiers (null): the same with verifiers' own chat harness, a program started per episode.

    .venv/bin/python bench/env_host.py [--episodes 64] [--concurrency 16] [--max-tokens 16]

The verifiers venv is built first if it is not cached (dsgrpo env-host build verifiers)."""

import argparse
import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = os.path.join(os.path.dirname(HERE), "tests", "envhost_modules")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    a = parser.parse_args()
    import httpx
    import openai
    import torch
    from transformers import AutoTokenizer

    from dsgrpo import GRPOConfig
    from dsgrpo.envhost.process import EnvHost
    from dsgrpo.envhost.venvs import ensure_venv
    from dsgrpo.rollout.base import SamplingConfig
    from dsgrpo.rollout.openai_endpoint import OpenAIEndpoint
    from dsgrpo.rollout.tool_formats import tool_call_format
    from dsgrpo.rollout.vllm_engine import VLLMGenerator
    from dsgrpo.testing import tiny_model

    path = tiny_model("qwen2")
    args = GRPOConfig(output_dir="/tmp/dsgrpo-bench-env-host", max_completion_length=a.max_tokens, report_to=[])
    generator = VLLMGenerator(path, args, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    endpoint = OpenAIEndpoint(
        generator,
        tok,
        SamplingConfig.from_args(args),
        call_format=tool_call_format(tok, args.tool_call_format),
        max_model_len=generator.max_model_len,
    )
    rows = [
        {"prompt": [{"role": "user", "content": f"Write {i % 16 + 1} digits."}], "task_index": i % 16}
        for i in range(a.episodes)
    ]

    def open_all(tag):
        ids = [f"{tag}-{i}" for i in range(a.episodes)]
        for e in ids:
            endpoint.episodes.open(e, a.max_tokens)
        return ids

    async def in_process(ids):
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="x", http_client=httpx.AsyncClient(trust_env=False))
        gate = asyncio.Semaphore(a.concurrency)

        async def one(row, e):
            async with gate:
                await client.with_options(default_headers={"X-Episode-Id": e}).chat.completions.create(
                    model="policy", messages=row["prompt"]
                )

        await asyncio.gather(*(one(r, e) for r, e in zip(rows, ids)))
        await client.close()

    async def hosted(host, ids):
        gate = asyncio.Semaphore(a.concurrency)

        async def one(row, e):
            async with gate:
                answer = await asyncio.wait_for(
                    host.episode(row, base_url=endpoint.url, episode_id=e, model="policy", tokenizer=path), 300
                )
                assert not answer.get("error"), answer["error"]

        await asyncio.gather(*(one(r, e) for r, e in zip(rows, ids)))

    figures = {}

    def timed(name, run, tag):
        ids = open_all(tag)
        start = time.perf_counter()
        asyncio.run(run(ids))
        seconds = time.perf_counter() - start
        calls = sum(len(endpoint.episodes.close(e).calls) for e in ids)
        figures[name] = {"episodes_per_s": round(a.episodes / seconds, 2), "seconds": round(seconds, 2), "calls": calls}
        print(f"{name:20s} {a.episodes / seconds:7.2f} episodes/s  ({seconds:.1f} s, {calls} engine calls)", flush=True)

    timed("warm-up", in_process, "w")
    timed("in-process", in_process, "a")
    python_host = EnvHost("python:toy_episodes:one_call", sys.executable, paths=[MODULES]).start()
    try:
        timed("host (python)", lambda ids: hosted(python_host, ids), "b")
    finally:
        python_host.close()
    start = time.perf_counter()
    verifiers_python = ensure_venv("verifiers")
    venv_s = time.perf_counter() - start
    figures["verifiers_venv_ready_s"] = round(venv_s, 2)
    for harness in ("dsgrpo_chat", "null"):
        start = time.perf_counter()
        vf_host = EnvHost(
            "verifiers:dsgrpo_vf_digits",
            str(verifiers_python),
            paths=[MODULES],
            env={"DSGRPO_VERIFIERS_HARNESS": harness},
        ).start()
        figures[f"verifiers_host_start_s ({harness})"] = round(time.perf_counter() - start, 2)
        try:
            timed(f"verifiers ({harness})", lambda ids, h=vf_host: hosted(h, ids), f"c{harness}")
        finally:
            vf_host.close()
    endpoint.close()
    figures["settings"] = vars(a)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
