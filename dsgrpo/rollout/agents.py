"""Agents that run their own loop (issue 56): `agent_rollout(agent)` is a rollout_func that runs the user's agent once
per sample, with an OpenAI client pointed at this rank's policy (rollout/openai_endpoint.py) and the dataset row, and
trains what the endpoint recorded.

    async def agent(client, row) -> Optional[float]:          # or a plain def, run in a thread with a sync client
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"], tools=TOOLS)
        ...                                                   # as many calls as the agent likes, tools of its own
        return reward                                         # None: excluded from the advantage, as TRL does

    trainer = GRPOTrainer(model, reward_funcs=agent_reward, rollout_func=agent_rollout(agent), args=..., ...)

Each sample is an episode: the client sends its id with every call. The trained sequence is assembled from the
episode's recorded calls: while each call's prompt continues the previous one's prompt + sampled ids (the endpoint
builds it so when the agent appends to its conversation), the episode is one sequence, the sampled ids in the loss
and the tokens in between (tool results, new user messages) masked out. An agent that rewrote its history (dropped
or summarised turns) starts a new chain, and the episode is split: each chain trains as a sequence of its own, after
its own first prompt (base.Rollout.restarts; packed steps keep their contexts apart), all with the episode's reward
and advantage, its tokens weighed as one sample of the group's; such episodes are counted in `episode/rewritten`.
Nothing is re-tokenised. The chains of an episode hold at most max_completion_length tokens together (the endpoint
refuses a call past that). Padded micro-batches (token_budget=0) cannot keep two contexts apart in one row: there
the episode's last chain alone trains. Episodes run concurrently (an agent waits
on I/O), at most `max_concurrent` at once per rank; an agent that raises or outlives `timeout_s` scores None and is
counted in `env/errors` / `env/timeouts`, and the run goes on. Metrics: `episode/turns` (calls an episode),
`tools/calls_per_episode` (tool calls the model wrote), those two, and `episode/rewritten`. With partial_rollout
on GRPOTrainer, episodes outlive rounds in a background loop (`start`; rollout/agent_partial.py)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional

from .. import dist
from .base import SamplingConfig
from .openai_endpoint import Call, OpenAIEndpoint, chains_of
from .tool_formats import tool_call_format
from .tools import COUNTS

REWARD_COLUMN = "agent_reward"


def agent_reward(completions, agent_reward, **kwargs) -> List[Optional[float]]:
    """The reward each agent returned (the `agent_reward` column agent_rollout adds): pass as reward_funcs."""
    return [None if r is None else float(r) for r in agent_reward]


def _chain_tokens(chain: List[Call]) -> dict:
    """One chain as a completion after its first prompt: the sampled ids in the loss, the tokens in between (tool
    results, new user messages) masked out."""
    ids, logprobs, mask, versions = [], [], [], []
    for k, call in enumerate(chain):
        if k:
            before = chain[k - 1].prompt_ids + chain[k - 1].sampled.ids
            if call.prompt_ids[: len(before)] != before:  # the endpoint only marks a call `extends` when it does
                raise RuntimeError(
                    "an agent call marked as continuing its episode does not start with the previous "
                    "call's prompt and sampled ids"
                )
            inserted = call.prompt_ids[len(before) :]
            ids += inserted
            logprobs += [0.0] * len(inserted)
            mask += [0] * len(inserted)
            versions += [versions[-1] if versions else 0] * len(inserted)
        sampled = call.sampled
        ids += sampled.ids
        logprobs += sampled.logprobs
        mask += [1] * len(sampled.ids)
        versions += sampled.versions
    return {"completion_ids": ids, "logprobs": logprobs, "env_mask": mask, "versions": versions}


def assemble(calls: List[Call], fallback_prompt: List[int], whole: bool = True) -> dict:
    """One episode's trained sequence from its recorded calls (see the module docstring): every chain, the later
    ones as `restarts` ([at, prompt_ids]: base.Rollout.restarts), or (whole=False) the last chain alone. Returns
    prompt_ids, completion_ids, logprobs, env_mask, versions, restarts, the calls trained, whether the agent
    rewrote its history and the tool calls the model wrote in what trains."""
    if not calls:
        return {
            "prompt_ids": fallback_prompt,
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "versions": [],
            "restarts": [],
            "turns": 0,
            "rewritten": False,
            "tool_calls": 0,
        }
    episode = chains_of(calls)
    trained = episode if whole else episode[-1:]
    pieces = [(chain[0].prompt_ids, _chain_tokens(chain)) for chain in trained]
    pieces = [p for p in pieces if p[1]["completion_ids"]] or pieces[:1]  # a chain that sampled nothing trains nothing
    out = {
        "prompt_ids": pieces[0][0],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "versions": [],
        "restarts": [],
    }
    for k, (prompt_ids, tokens) in enumerate(pieces):
        if k:
            out["restarts"].append([len(out["completion_ids"]), prompt_ids])
        for key, values in tokens.items():
            out[key] += values
    used = [c for chain in trained for c in chain]
    out.update(
        turns=len(used),
        rewritten=len(episode) > 1,
        tool_calls=sum(len((c.sampled.answer or {}).get("tool_calls", [])) for c in used),
    )
    return out


class AgentRollout:
    """What `agent_rollout` returns: a rollout_func (TRL's contract, plus the dataset's columns when the trainer
    gives them) whose rows also carry tool counts for the metrics."""

    reports_tool_counts = True

    def __init__(
        self,
        agent: Callable,
        *,
        max_concurrent: int = 32,
        timeout_s: float = 600.0,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        model_name: str = "policy",
    ):
        if not callable(agent):
            raise TypeError(
                f"agent_rollout({agent!r}): pass the agent function, `async def agent(client, row)` or "
                "`def agent(client, row)`, returning the episode's reward (or None)."
            )
        if len(inspect.signature(agent).parameters) < 2:
            raise TypeError(
                f"agent_rollout: {getattr(agent, '__name__', agent)!r} must take (client, row): an "
                "OpenAI client for the policy and the dataset row."
            )
        if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
            raise ValueError(f"agent_rollout: max_concurrent={max_concurrent!r}; use a positive integer.")
        if host not in ("127.0.0.1", "localhost", "::1") and not token:
            raise ValueError(f"agent_rollout: host={host!r} exposes the policy beyond this machine; give a token too.")
        self.agent, self.max_concurrent, self.timeout_s = agent, max_concurrent, timeout_s
        self.host, self.port, self.token, self.model_name = host, port, token, model_name
        self.endpoint: Optional[OpenAIEndpoint] = None
        self.rounds = 0
        self.last_episodes: list = []  # the last round's episodes as recorded (their calls), for inspection
        self._warned: list = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # partial rollouts' episodes run here (start)
        self._background = None

    # ---- the endpoint, built on the first round from the trainer's engine
    def serving(self, trainer) -> OpenAIEndpoint:
        if self.endpoint is None:
            generator, tokenizer, args = trainer.generator, trainer.processing_class, trainer.args
            if generator is None:
                raise ValueError(
                    "agent_rollout needs this rank's generation engine (use_vllm with vllm_mode="
                    "'colocate', the default): the agents' calls are served by it."
                )
            self.endpoint = OpenAIEndpoint(
                generator,
                tokenizer,
                SamplingConfig.from_args(args),
                call_format=tool_call_format(tokenizer, args.tool_call_format),
                max_model_len=generator.max_model_len,
                model_name=self.model_name,
                host=self.host,
                port=self.port,
                token=self.token,
                chat_template_kwargs=args.chat_template_kwargs,
            )
        return self.endpoint

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    # ---- a round
    def __call__(self, prompts: List[Any], trainer, columns: Optional[Dict[str, list]] = None) -> dict:
        endpoint = self.serving(trainer)
        rows = [{"prompt": p, **{c: v[i] for c, v in (columns or {}).items()}} for i, p in enumerate(prompts)]
        ids = [self.open_episode(trainer) for _ in rows]
        outcomes = asyncio.run(self._run_all(endpoint, rows, ids))
        self.rounds += 1
        return self.rows_of(trainer, rows, ids, outcomes)[0]  # the sources label the versions of a plain round

    def open_episode(self, trainer) -> str:
        """A new episode on this rank's endpoint; its id (the client sends it with every call)."""
        # a rewritten episode trains every chain, each after its own prompt, in packed steps; padded micro-batches
        # cannot keep the chains' contexts apart, so there only its last chain trains
        episode_id = f"{dist.rank()}-{self.rounds}-{uuid.uuid4().hex[:12]}"
        self.serving(trainer).episodes.open(
            episode_id, trainer.args.max_completion_length, whole_episode=trainer.budget is not None
        )
        return episode_id

    def rows_of(self, trainer, rows: List[dict], ids: List[str], outcomes: List[tuple]) -> tuple:
        """Finished episodes (closed on the endpoint) as (rollout_func rows with their rewards and tool counts, the
        weight version of every completion token of each row)."""
        whole = trainer.budget is not None
        out: Dict[str, list] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            REWARD_COLUMN: [],
            "tool_counts": [],
            **({"restarts": []} if whole else {}),
        }
        tokenizer = trainer.processing_class
        self.last_episodes, versions = [], []
        for row, episode_id, (reward, how) in zip(rows, ids, outcomes):
            episode = self.endpoint.episodes.close(episode_id)
            reward, how = self.checked(episode_id, episode, reward, how)
            self.last_episodes.append(episode)
            seq = assemble(episode.calls, _prompt_ids(tokenizer, row["prompt"]), whole)
            for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask") + (("restarts",) if whole else ()):
                out[key].append(seq[key])
            versions.append(seq["versions"])
            out[REWARD_COLUMN].append(reward)
            counts = dict(
                calls=seq["tool_calls"],
                turns=seq["turns"],
                errors=int(how == "error"),
                timeouts=int(how == "timeout"),
                rewrites=int(seq["rewritten"]),
            )
            out["tool_counts"].append([counts.get(k, 0) for k in COUNTS])
        return out, versions

    def checked(self, episode_id: str, episode, reward: Optional[float], how: str) -> tuple:
        """(reward, how) of a finished episode after any check of its record (envhost: the host's own branches
        held against it)."""
        return reward, how

    async def play(self, base, row: dict, episode_id: str) -> Optional[float]:
        """One episode's reward: the agent run with the client bound to its episode."""
        client = base.with_options(default_headers={"X-Episode-Id": episode_id})
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(client, row)
        return await asyncio.to_thread(self.agent, client, row)

    def _client(self, endpoint: OpenAIEndpoint):
        import httpx
        import openai

        common = dict(base_url=endpoint.url, api_key=self.token or "dsgrpo", max_retries=0, timeout=self.timeout_s)
        if inspect.iscoroutinefunction(self.agent):
            return openai.AsyncOpenAI(**common, http_client=httpx.AsyncClient(trust_env=False))
        return openai.OpenAI(**common, http_client=httpx.Client(trust_env=False))

    async def _episode(self, base, gate: asyncio.Semaphore, row: dict, episode_id: str) -> tuple:
        """(reward, how it ended: ok, error or timeout) of one episode."""
        async with gate:
            try:
                reward = await asyncio.wait_for(self.play(base, row, episode_id), self.timeout_s)
                return (None if reward is None else float(reward)), "ok"
            except asyncio.TimeoutError:
                return None, "timeout"
            except Exception as exc:  # noqa: BLE001 - an agent's failure ends its episode, not the run
                if not self._warned:
                    self._warned.append(1)
                    print(
                        f"dsgrpo: warning: an agent episode raised {type(exc).__name__}: {exc} (it scores "
                        "None; counted in env/errors)",
                        flush=True,
                    )
                return None, "error"

    async def _run_all(self, endpoint: OpenAIEndpoint, rows: List[dict], ids: List[str]):
        gate = asyncio.Semaphore(self.max_concurrent)
        base = self._client(endpoint)
        try:
            return await asyncio.gather(
                *(self._episode(base, gate, row, episode_id) for row, episode_id in zip(rows, ids))
            )
        finally:
            if inspect.iscoroutinefunction(self.agent):
                await base.close()
            else:
                base.close()

    # ---- episodes that outlive a round (partial rollouts: rollout/agent_partial.py)
    def start(self, trainer, row: dict) -> tuple:
        """Run one episode in the background (an event loop of its own, kept across rounds): (its id, a
        concurrent.futures.Future of (reward, how)). Its calls wait while the endpoint is paused."""
        endpoint = self.serving(trainer)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="agent-episodes", daemon=True).start()

            async def made():  # the client and the bound on episodes belong to the loop that uses them
                return self._client(endpoint), asyncio.Semaphore(self.max_concurrent)

            self._background = asyncio.run_coroutine_threadsafe(made(), self._loop).result()
        episode_id = self.open_episode(trainer)
        base, gate = self._background
        return episode_id, asyncio.run_coroutine_threadsafe(self._episode(base, gate, row, episode_id), self._loop)

    def discard(self, episode_id: str, future) -> None:
        """An episode that will not train (over-stale): cancelled, and closed on the endpoint."""
        future.cancel()
        self.endpoint.episodes.close(episode_id)


def _prompt_ids(tokenizer, prompt) -> List[int]:
    """The row's prompt as the policy sees it (an episode that made no call trains nothing but keeps its row)."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def agent_rollout(agent: Callable, **options) -> AgentRollout:
    """A rollout_func that runs `agent(client, row)` once per sample against this rank's policy (module docstring).
    Options: max_concurrent (episodes in flight per rank, 32), timeout_s (an episode's limit, 600), host/port/token
    of the endpoint (loopback, a free port, none), model_name ("policy")."""
    return AgentRollout(agent, **options)
