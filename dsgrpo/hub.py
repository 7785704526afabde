"""push_to_hub: uploads to the Hugging Face Hub as transformers' hub_strategy says, from a background thread so
training never waits for the network; everything that can fail early (no token, an unreachable Hub, a repository
that cannot be created) fails at start-up, before a model is loaded, never after a day of training.

    end              the final model (output_dir), once
    every_save       the model at every checkpoint and at the end
    checkpoint       also the latest checkpoint folder, as last-checkpoint/
    all_checkpoints  every checkpoint folder under its own name

Rank 0 talks to the Hub; the checks' outcome is shared with every rank, so all of them stop together."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Callable, List, Optional

# what never goes to the Hub from output_dir (checkpoints are pushed separately, by strategy)
IGNORED = ["checkpoint-*/**", ".checkpoint-*/**", "latest", "initial_model/**", "*.partial/**", "completions.jsonl"]


class HubError(RuntimeError):
    """The Hub cannot take this run's uploads."""


class HubPusher:
    def __init__(self, args, api=None):
        """`api`: an object with HfApi's whoami/create_repo/upload_folder (a test passes a recording one)."""
        self.args = args
        self.strategy = args.hub_strategy
        self.repo_id: Optional[str] = None
        self.api = api
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsgrpo-hub")
        self.pending: List[concurrent.futures.Future] = []

    def check(self) -> None:
        """Token, reachability and the repository, now (rank 0). Raises HubError naming what to fix."""
        try:
            from huggingface_hub import HfApi, get_token
        except ImportError:
            raise HubError("push_to_hub=True needs huggingface_hub (`pip install huggingface_hub`).") from None
        token = self.args.hub_token or get_token()
        if not token and self.api is None:
            raise HubError(
                "push_to_hub=True but no Hub token was found: set hub_token, export HF_TOKEN, or run "
                "`huggingface-cli login`; or set push_to_hub=False."
            )
        self.api = self.api or HfApi(token=token)
        try:
            user = self.api.whoami()
        except Exception as exc:  # noqa: BLE001 - any failure here means uploads would fail later
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
            raise HubError(
                f"push_to_hub=True but the Hub at {endpoint} did not accept the token ({type(exc).__name__}: "
                f"{exc}). Check the network and hub_token, or set push_to_hub=False."
            ) from None
        name = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        self.repo_id = name if "/" in name else f"{user['name']}/{name}"
        try:
            self.api.create_repo(self.repo_id, private=self.args.hub_private_repo, exist_ok=True)
        except Exception as exc:  # noqa: BLE001
            raise HubError(
                f"push_to_hub=True: cannot create or open the Hub repository {self.repo_id!r} "
                f"({type(exc).__name__}: {exc}). Check hub_model_id and the token's rights."
            ) from None

    # ---- what to push when
    def on_save(self, checkpoint: str, model_dir: str, write_model: Callable[[], None]) -> None:
        """After a checkpoint (every rank: `write_model` gathers the model when the strategy pushes it)."""
        from . import dist

        if self.strategy == "end":
            return
        write_model()  # collective: the model of this step into output_dir
        if not dist.is_main():
            return
        step = os.path.basename(checkpoint)
        self._submit(model_dir, None, f"Training in progress, {step}", ignore=IGNORED)
        if self.strategy == "checkpoint":
            self._submit(checkpoint, "last-checkpoint", f"Training in progress, {step}")
        elif self.strategy == "all_checkpoints":
            self._submit(checkpoint, step, f"Training in progress, {step}")

    def on_end(self, model_dir: str) -> None:
        from . import dist

        if dist.is_main():
            self._submit(model_dir, None, "End of training", ignore=IGNORED, always=True)

    def _submit(
        self, folder: str, path_in_repo: Optional[str], message: str, ignore=None, always: bool = False
    ) -> None:
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]
        busy = any(not f.done() for f in self.pending)
        if busy and not (always or self.args.hub_always_push):
            print(
                f"dsgrpo: hub: the previous upload is still running; skipping {message!r} (hub_always_push=True "
                "queues it instead)",
                flush=True,
            )
            return
        self.pending.append(
            self.pool.submit(
                self.api.upload_folder,
                repo_id=self.repo_id,
                folder_path=folder,
                path_in_repo=path_in_repo,
                commit_message=message,
                revision=self.args.hub_revision,
                ignore_patterns=ignore,
            )
        )

    def finish(self) -> None:
        """Wait for the uploads in flight; an upload that failed is an error now."""
        self.pool.shutdown(wait=True)
        for future in self.pending:
            exc = future.exception()
            if exc is not None:
                raise HubError(
                    f"an upload to the Hub repository {self.repo_id!r} failed: {type(exc).__name__}: {exc}. "
                    "The checkpoints and the final model are on disk in output_dir."
                ) from exc


def make_pusher(args, api=None) -> Optional[HubPusher]:
    """A checked HubPusher when push_to_hub is set (collective: every rank learns rank 0's outcome), else None."""
    from . import dist

    if not args.push_to_hub:
        return None
    pusher = HubPusher(args, api)
    problem = None
    if dist.is_main():
        try:
            pusher.check()
        except HubError as exc:
            problem = str(exc)
    problem = dist.broadcast_object(problem, src=0)
    if problem:
        raise HubError(problem)
    return pusher
