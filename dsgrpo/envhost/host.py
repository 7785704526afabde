"""The environment host's program (issue 66): runs in an ecosystem's own virtual environment, so it imports nothing
of dsgrpo's and nothing beyond the standard library but the ecosystem it hosts. The trainer starts it
(envhost/process.py) and speaks JSON lines to it: requests on stdin, answers on the file descriptor given as
--answers (the program's own stdout goes to stderr, so an environment that prints cannot corrupt the protocol).

    {"op": "hello"}                              -> {"op": "hello", "adapter": ..., "versions": {...}}
    {"op": "rows", "limit": N}                   -> {"op": "rows", "rows": [{prompt, task_index, ...}, ...]}
    {"op": "episode", "id": K, "row": {...}, "base_url": ..., "episode_id": ..., "model": ..., "tokenizer": ...}
                                                 -> {"op": "episode", "id": K, "reward", "metrics", "branches",
                                                     "error"}
    {"op": "cancel", "id": K}                    -> (nothing: episode K is cancelled; the trainer gave up on it)
    {"op": "stop"}

Episodes run concurrently on one event loop. An episode's model calls go to the trainer's endpoint (the base_url)
with the trainer's episode id in X-Episode-Id, so the endpoint records them for training; the branches the
ecosystem reports (token ids, which were sampled, their log-probs) come back for the trainer to hold against that
record. The adapters:

- verifiers:TASKSET_ID   a verifiers v1 taskset (an importable module exporting its Taskset): its Taskset gives the
                         rows, each episode runs the plain chat harness in a subprocess runtime against the
                         endpoint's /inference/v1/generate route (verifiers' own TrainClient renders the prompts), and
                         its Task's rewards score.
- python:MODULE:FUNCTION `async def episode(base_url, episode_id, row, model, api_key) -> {"reward", "metrics",
                         "branches"}` (and `rows(limit)` in MODULE, optional): any ecosystem with a loop of its own.
"""

import argparse
import asyncio
import importlib
import json
import os
import sys
import threading
import traceback

KEY_VARIABLE = "DSGRPO_ENDPOINT_KEY"  # the endpoint's token reaches the ecosystem's client through this variable


class PythonAdapter:
    def __init__(self, target: str):
        module, _, function = target.rpartition(":")
        if not module:
            raise ValueError(f"python:{target}: write python:MODULE:FUNCTION")
        self.module = importlib.import_module(module)
        self.function = getattr(self.module, function)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def versions(self) -> dict:
        return {"python": sys.version.split()[0]}

    def rows(self, limit):
        rows = getattr(self.module, "rows", None)
        if rows is None:
            raise ValueError(f"{self.module.__name__} defines no rows(limit): give the trainer a dataset")
        return list(rows(limit))

    async def episode(self, request: dict) -> dict:
        return await self.function(
            request["base_url"], request["episode_id"], request["row"], request["model"], os.environ.get(KEY_VARIABLE)
        )


class VerifiersAdapter:
    """A verifiers v1 taskset, each task one episode of its single-agent env with the plain chat (null) harness run
    as a local subprocess: nothing leaves the machine but the model calls, which go to the trainer's endpoint."""

    def __init__(self, taskset_id: str):
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import environment_class

        self.vf = vf
        harness = os.environ.get("DSGRPO_VERIFIERS_HARNESS", "dsgrpo_chat")  # plugins/dsgrpo_chat.py, or `null`
        config = vf.SingleAgentEnvConfig.model_validate(
            {"taskset": {"id": taskset_id}, "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}}
        )
        self.env = environment_class(taskset_id)(config)
        self.tasks = None
        self._serving = None

    async def __aenter__(self):
        self._serving = self.env.serving()
        await self._serving.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._serving.__aexit__(*exc)

    def versions(self) -> dict:
        from importlib.metadata import version

        return {"python": sys.version.split()[0], "verifiers": version("verifiers")}

    def _tasks(self) -> list:
        if self.tasks is None:
            if not self.env.taskset.bounded:
                raise ValueError("the taskset is infinite: give the trainer a dataset with a task_index column")
            self.tasks = list(self.env.taskset)
        return self.tasks

    def rows(self, limit):
        rows = []
        for index, task in enumerate(self._tasks()[:limit]):
            data = task.data
            system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            prompt = data.prompt
            messages = (
                system + [{"role": "user", "content": prompt}]
                if isinstance(prompt, str) or prompt is None
                else system + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
            )
            rows.append({"prompt": messages, "task_index": index})
        return rows

    async def episode(self, request: dict) -> dict:
        vf = self.vf
        task = self._tasks()[int(request["row"]["task_index"])]
        client = vf.TrainClientConfig(
            base_url=request["base_url"],
            api_key_var=KEY_VARIABLE,
            headers={"X-Episode-Id": request["episode_id"]},
            renderer_model_name=request["tokenizer"],
        )
        episode = await self.env.run_episode(task, vf.ModelContext(model=request["model"], client=client))
        traces = [t for t in episode.traces if t.agent.trainable]
        errors = [f"{e.type}: {e.message}" for e in episode.errors] + [
            f"{e.type}: {e.message}" for t in traces for e in t.errors
        ]
        rewards = [t.reward for t in traces]
        metrics = {}
        for trace in traces:
            for name, value in trace.metrics.items():
                if isinstance(value, (int, float)):
                    metrics[name] = float(value)
        branches = [
            {"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask], "logprobs": b.logprobs}
            for t in traces
            for b in t.branches
            if b.trainable
        ]
        return {
            "reward": sum(rewards) / len(rewards) if rewards and not errors else None,
            "metrics": metrics,
            "branches": branches,
            "error": "; ".join(errors) or None,
        }


ADAPTERS = {"python": PythonAdapter, "verifiers": VerifiersAdapter}


def adapter_for(spec: str):
    kind, _, target = spec.partition(":")
    if kind not in ADAPTERS or not target:
        raise ValueError(f"environment {spec!r}: write one of {', '.join(k + ':...' for k in ADAPTERS)}")
    return ADAPTERS[kind](target)


class Answers:
    def __init__(self, fd: int):
        self.stream = os.fdopen(fd, "w", buffering=1)
        self.lock = threading.Lock()

    def send(self, message: dict) -> None:
        line = json.dumps(message, default=str)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


async def serve(spec: str, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue = asyncio.Queue()

    def read() -> None:  # stdin in a thread: the loop stays free for the episodes
        for line in sys.stdin:
            loop.call_soon_threadsafe(requests.put_nowait, line)
        loop.call_soon_threadsafe(requests.put_nowait, None)

    threading.Thread(target=read, name="requests", daemon=True).start()
    adapter = adapter_for(spec)
    running: dict = {}  # request id -> its episode's task

    async def episode(request: dict) -> None:
        try:
            result = await adapter.episode(request)
            answers.send({"op": "episode", "id": request["id"], "error": None, **result})
        except asyncio.CancelledError:
            print(f"dsgrpo env host: episode {request.get('episode_id')} cancelled (the trainer gave up on it)")
            raise
        except Exception as exc:  # noqa: BLE001 - an episode's failure is its answer, not the host's end
            message = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            answers.send({"op": "episode", "id": request["id"], "reward": None, "branches": [], "error": message})

    async with adapter:
        while True:
            line = await requests.get()
            if line is None:
                break
            request = json.loads(line)
            op = request.get("op")
            if op == "stop":
                break
            if op == "hello":
                answers.send({"op": "hello", "adapter": spec.partition(":")[0], "versions": adapter.versions()})
            elif op == "rows":
                try:
                    answers.send({"op": "rows", "id": request["id"], "rows": adapter.rows(request.get("limit"))})
                except Exception as exc:  # noqa: BLE001 - the trainer names it
                    answers.send({"op": "rows", "id": request["id"], "error": f"{type(exc).__name__}: {exc}"})
            elif op == "episode":
                task = asyncio.ensure_future(episode(request))
                running[request["id"]] = task
                task.add_done_callback(lambda _, key=request["id"]: running.pop(key, None))
            elif op == "cancel" and request.get("id") in running:
                running[request["id"]].cancel()
        for task in list(running.values()):
            task.cancel()


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    # run as a script, this folder is first on sys.path: only its plugins (harnesses an ecosystem loads by name)
    # should be importable from it, not its sibling modules
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here] + [os.path.join(here, "plugins")]
    parser = argparse.ArgumentParser(description="dsgrpo's environment host (started by the trainer)")
    parser.add_argument("environment")
    parser.add_argument("--answers", type=int, required=True, help="the file descriptor answers are written to")
    args = parser.parse_args(argv)
    answers = Answers(args.answers)
    os.dup2(2, 1)  # what the environment prints goes to the host's log, never into the protocol
    try:
        asyncio.run(serve(args.environment, answers))
    except Exception as exc:  # noqa: BLE001 - a host that cannot start says why on the protocol, then exits
        traceback.print_exc()
        answers.send({"op": "fatal", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
