"""Environments of other ecosystems, each in its own Python (issue 66): `env_host_rollout("verifiers:my_taskset")`
is an agent_rollout whose agent is an environment host (envhost/host.py in the ecosystem's venv). Each sample is
one episode in the host against this rank's endpoint (its /inference/v1/generate route for verifiers' TrainClient,
the chat route for others), with this rank's episode id; what trains is the endpoint's record of the episode's
calls (rollout/agents.py: token-exact, environment tokens masked, a rewritten history split into chains), and the
host's own branches (what the ecosystem says it sampled) must equal that record, token for token and mask for mask,
or the episode is refused by name (scores None, counted in env/errors), never re-tokenised. The reward is the
ecosystem's. A host that dies fails its episodes (env/errors) and is started again; one that cannot start is an
error before training. Partial rollouts and the async trainer work as for agent_rollout.

    rollout = env_host_rollout("verifiers:my_taskset", paths=["envs/"])      # the taskset's module on a path
    trainer = GRPOTrainer(model, agent_reward, rollout_func=rollout, train_dataset=env_host_dataset(rollout), ...)

YAML: `environment: verifiers:my_taskset` (and `environment_host: {paths: [...], requirements: ..., python: ...}`);
train_dataset and reward_funcs may then be left out."""

from __future__ import annotations

import os
import threading
from typing import List, Optional

from .. import dist
from ..rollout.agents import AgentRollout, _chain_tokens
from ..rollout.openai_endpoint import chains_of
from .process import EnvHost, python_of


class EnvironmentEpisodeError(RuntimeError):
    """The ecosystem reported its episode failed (its error is the message)."""


def branch_mismatch(calls, branches: List[dict]) -> Optional[str]:
    """Why the host's branches are not the endpoint's record of the episode (None when each branch is one recorded
    chain: its prompt then completion ids, exactly; sampled tokens where the chain samples; the same log-probs)."""
    chains = []
    for chain in chains_of(calls) if calls else []:
        tokens = _chain_tokens(chain)
        prompt = chain[0].prompt_ids
        chains.append(
            (
                list(prompt) + tokens["completion_ids"],
                [False] * len(prompt) + [bool(m) for m in tokens["env_mask"]],
                [lp for lp, m in zip(tokens["logprobs"], tokens["env_mask"]) if m],
            )
        )
    if len(branches) != len(chains):
        return f"the host reports {len(branches)} branch(es), the endpoint recorded {len(chains)} chain(s)"
    unmatched = list(range(len(chains)))
    for k, branch in enumerate(branches):
        ids = list(branch.get("token_ids") or [])
        same = [j for j in unmatched if chains[j][0] == ids]
        if not same:
            best = max(
                (
                    next(
                        (i for i, (a, b) in enumerate(zip(chains[j][0], ids)) if a != b),
                        min(len(chains[j][0]), len(ids)),
                    )
                )
                for j in unmatched
            )
            return f"branch {k} ({len(ids)} tokens) differs from every recorded chain (first at token {best})"
        j = same[0]
        unmatched.remove(j)
        mask = [bool(m) for m in branch.get("sampled_mask") or []]
        if mask != chains[j][1]:
            return f"branch {k}'s sampled tokens are not the ones the endpoint sampled"
        logprobs = branch.get("logprobs")
        if logprobs:
            sampled = [lp for lp, m in zip(logprobs, mask) if m]
            if len(sampled) != len(chains[j][2]) or any(abs(a - b) > 1e-5 for a, b in zip(sampled, chains[j][2])):
                return f"branch {k}'s log-probs are not the endpoint's"
    return None


class EnvHostRollout(AgentRollout):
    """What env_host_rollout returns (module docstring)."""

    def __init__(
        self,
        environment: str,
        *,
        python: Optional[str] = None,
        requirements: Optional[str] = None,
        paths: Optional[List[str]] = None,
        env: Optional[dict] = None,
        start_timeout_s: float = 300.0,
        max_restarts: int = 3,
        **options,
    ):
        kind, _, target = environment.partition(":")
        if kind not in ("verifiers", "python") or not target:
            raise ValueError(
                f"environment={environment!r}: write 'verifiers:TASKSET_MODULE' (a verifiers v1 taskset) or "
                "'python:MODULE:FUNCTION' (an episode function of your own), run in the env host"
            )
        super().__init__(self._no_agent, **options)
        self.environment = environment
        self.host_options = dict(
            python=python,
            requirements=requirements,
            paths=list(paths or []),
            env=env,
            start_timeout_s=start_timeout_s,
            max_restarts=max_restarts,
        )
        self.env_host: Optional[EnvHost] = None
        self.branches: dict = {}  # episode id -> the host's branches, until the episode is checked
        self.metrics: dict = {}  # the ecosystem's own metrics, summed over this rank's finished episodes
        self._metric_window: dict = {}  # name -> [sum, episodes] since the trainer last logged them
        self._metrics_lock = threading.Lock()  # episodes finish on the agents' loop; the trainer reads on its own
        self.branch_checks = {"matched": 0, "refused": 0}  # episodes whose host branches were held to the record

    @staticmethod
    def _no_agent(client, row):  # the host plays the episodes (play); AgentRollout wants a callable
        raise NotImplementedError

    def started_host(self, log_dir: Optional[str] = None) -> EnvHost:
        """This rank's host, started now if it is not (the venv built first if it is not cached)."""
        if self.env_host is None:
            o = self.host_options
            python = python_of(self.environment, o["python"], o["requirements"])
            log_path = None
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                log_path = os.path.join(log_dir, f"env_host_rank{dist.rank()}.log")
            self.env_host = EnvHost(
                self.environment,
                python,
                paths=o["paths"],
                env=o["env"],
                log_path=log_path,
                start_timeout_s=o["start_timeout_s"],
                max_restarts=o["max_restarts"],
            ).start()
        return self.env_host

    def serving(self, trainer):
        """The endpoint (AgentRollout's), this rank's host, and the tokenizer files the ecosystem renders with:
        every round and every background episode comes through here first."""
        endpoint = super().serving(trainer)
        self.started_host(os.path.join(trainer.args.output_dir, "env_host"))
        self._tokenizer_path = _tokenizer_path(trainer)
        return endpoint

    async def play(self, base, row: dict, episode_id: str) -> Optional[float]:
        answer = await self.env_host.episode(
            row,
            base_url=self.endpoint.url,
            episode_id=episode_id,
            model=self.model_name,
            tokenizer=self._tokenizer_path,
        )
        self.branches[episode_id] = answer.get("branches")  # None: the ecosystem reports no token ids
        with self._metrics_lock:
            for name, value in (answer.get("metrics") or {}).items():
                self.metrics[name] = self.metrics.get(name, 0.0) + float(value)
                window = self._metric_window.setdefault(name, [0.0, 0])
                window[0] += float(value)
                window[1] += 1
        if answer.get("error"):
            raise EnvironmentEpisodeError(answer["error"])
        return answer.get("reward")

    def round_metrics(self) -> tuple:
        """The ecosystem's own metrics for the trainer's log, `env_metrics/<name>`: each the mean over this rank's
        episodes that reported it since the last call (with the async trainer or partial rollouts, the episodes
        that finished in that time, trained or not), and its weight (those episodes) for the mean over ranks."""
        with self._metrics_lock:
            window, self._metric_window = self._metric_window, {}
        means = {f"env_metrics/{name}": total / count for name, (total, count) in window.items()}
        return means, {f"env_metrics/{name}": float(count) for name, (_, count) in window.items()}

    def checked(self, episode_id: str, episode, reward: Optional[float], how: str) -> tuple:
        branches = self.branches.pop(episode_id, None)
        if how != "ok" or branches is None:
            return reward, how
        why = branch_mismatch(episode.calls, branches)
        self.branch_checks["refused" if why else "matched"] += 1
        if why is None:
            return reward, how
        if len(self._warned) < 2:
            self._warned.append(why)
            print(f"dsgrpo: warning: refused an env-host episode: {why} (it scores None; counted in env/errors)")
        return None, "error"

    def close(self) -> None:
        super().close()
        if self.env_host is not None:
            self.env_host.close()
            self.env_host = None


def _tokenizer_path(trainer) -> str:
    """What the ecosystem's renderer loads to tokenize as the policy does: the policy's own tokenizer files."""
    tokenizer = trainer.processing_class
    return getattr(tokenizer, "name_or_path", None) or trainer.args.output_dir


def env_host_rollout(environment: str, **options) -> EnvHostRollout:
    """A rollout_func that plays `environment` ('verifiers:TASKSET_MODULE' or 'python:MODULE:FUNCTION') in an env
    host of its own Python (module docstring). Options: python (an interpreter to use as it is), requirements (a
    pinned requirements file, or the name of a shipped one; default: the ecosystem's), paths (added to the host's
    PYTHONPATH), env (variables for the host), start_timeout_s (300), max_restarts (3), and agent_rollout's."""
    return EnvHostRollout(environment, **options)


def env_host_dataset(rollout: EnvHostRollout, limit: Optional[int] = None):
    """The environment's own rows (a verifiers Taskset's tasks: prompt, task_index) as a datasets.Dataset."""
    from datasets import Dataset

    return Dataset.from_list(rollout.started_host().rows(limit))
