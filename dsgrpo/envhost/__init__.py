"""Environment ecosystems in their own Python (issue 66), each behind one small protocol:

- venvs.py: an ecosystem's virtual environment, built from a pinned requirements file on first use, cached by hash.
- host.py: the host program that runs in that venv (standard library + the ecosystem; never imports dsgrpo).
- process.py: the trainer's side: starts, speaks to and supervises a host.
- rollout.py: env_host_rollout, an agent_rollout whose episodes the host plays against the rank's endpoint.
"""

from .rollout import env_host_dataset, env_host_rollout

__all__ = ["env_host_dataset", "env_host_rollout"]
