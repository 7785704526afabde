"""Metric sinks, fed only on rank 0 with metrics already reduced over ranks: `metrics.jsonl` (and
`completions.jsonl`) in output_dir, the console's progress, and the trackers `report_to` names (wandb,
tensorboard, trackio). Every tracker gets the same metric names as metrics.jsonl.

The console shows a progress bar when it is a terminal; otherwise (a Slurm log, CI, a pipe) it prints one plain
line per logging step (step/total, reward, kl, tokens/s, ETA), which stays readable where carriage-return bars
turn into noise."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from datetime import datetime
from typing import Dict, List, Optional

from . import dist


class MetricSinks:
    def __init__(self, args, total_steps: int, enabled: bool):
        self.enabled = enabled
        self.print_rows = args.num_completions_to_print
        self.unique_prompts = args.log_unique_prompts
        self.jsonl = None
        self.trackers: List = []
        self.progress = None
        if not enabled:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(args.output_dir, "metrics.jsonl"), "a")
        self.trackers = [TRACKERS[name](args) for name in args.report_sinks() if name in TRACKERS]
        self.progress = make_progress(args, total_steps)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        closed = self.jsonl.closed  # after train(): a user's trainer.evaluate() still lands in metrics.jsonl
        if closed:
            self.jsonl = open(self.jsonl.name, "a")
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if closed:  # the trackers and the progress display ended with the run
            self.jsonl.close()
            return
        numbers = {k: v for k, v in record.items() if k != "step" and v is not None}
        for tracker in self.trackers:
            tracker.log(step, numbers)
        self.progress.show(step, numbers)

    def resumed(self, path: str, step: int) -> None:
        """Drop records the interrupted run wrote after its checkpoint: they are about to be redone."""
        if not self.enabled:
            return
        name = self.jsonl.name
        self.jsonl.close()
        with open(name) as fh:
            kept = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(name, "w") as fh:
            fh.writelines(kept)
        self.jsonl = open(name, "a")
        self.progress.resumed(step)
        print(f"dsgrpo: resumed from {path} at step {step}", file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.progress is not None:
            self.progress.advance(steps)

    def log_completions(self, step: int, rows: List[dict]) -> None:
        """Every rank's rows of a round (TRL's completions table): to completions.jsonl and the trackers; at most
        num_completions_to_print of them printed; with log_unique_prompts, one row per distinct prompt."""
        if not self.enabled:
            return
        if self.unique_prompts:
            rows = list({r["prompt"]: r for r in reversed(rows)}.values())[::-1]
        shown = rows if self.print_rows is None else rows[: self.print_rows]
        for r in shown:
            print(
                f"[step {step}] reward {r['reward']:.3f}  advantage {r['advantage']:+.3f}\n  prompt: {r['prompt']}\n"
                f"  completion: {r['completion']}",
                file=sys.stderr,
                flush=True,
            )
        path = os.path.join(os.path.dirname(self.jsonl.name), "completions.jsonl")
        with open(path, "a") as fh:
            for row in rows:
                fh.write(json.dumps({"step": step, **row}) + "\n")
        if rows:
            for tracker in self.trackers:
                tracker.table(step, rows)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.jsonl is not None:
            self.jsonl.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _plain(v) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ trackers
class WandbTracker:
    def __init__(self, args):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", args.project),
            name=args.run_name,
            config=args.to_dict(),
            dir=args.output_dir,
        )

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, rows: List[dict]) -> None:
        self.run.log({"completions": self.wandb.Table(*_columns_and_data(rows))}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Event files under TENSORBOARD_LOGGING_DIR, else output_dir/runs/<date>_<host> (transformers' layout), so
    `tensorboard --logdir output_dir/runs` shows every run of that folder."""

    def __init__(self, args):
        from torch.utils.tensorboard import SummaryWriter

        logdir = os.environ.get("TENSORBOARD_LOGGING_DIR") or os.path.join(
            args.output_dir, "runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname()
        )
        self.writer = SummaryWriter(log_dir=os.path.expanduser(logdir))
        self.writer.add_text("args", "```\n" + json.dumps(args.to_dict(), indent=1, default=str) + "\n```")

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def table(self, step: int, rows: List[dict]) -> None:
        cols, _ = _columns_and_data(rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731 (one markdown cell)
        text = "\n".join(
            ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
        )
        self.writer.add_text("completions", text, global_step=step)

    def close(self) -> None:
        self.writer.close()


class TrackioTracker:
    """trackio's local store (TRACKIO_DIR, else its cache folder); a Space or bucket when the config names one,
    as transformers' TrackioCallback does (project, run_name, trackio_space_id, trackio_bucket_id)."""

    def __init__(self, args):
        import trackio

        self.trackio = trackio
        trackio.init(
            project=args.project,
            name=args.run_name,
            config=args.to_dict(),
            resume="allow",
            space_id=args.trackio_space_id,
            bucket_id=args.trackio_bucket_id,
        )

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def table(self, step: int, rows: List[dict]) -> None:
        self.trackio.log({"completions": self.trackio.Table(*_columns_and_data(rows))}, step=step)

    def close(self) -> None:
        self.trackio.finish()


def _columns_and_data(rows: List[dict]):
    """The completions table as (columns, rows of values): what wandb's and trackio's Table take."""
    cols = list(rows[0])
    return cols, [[r[c] for c in cols] for r in rows]


TRACKERS = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "trackio": TrackioTracker}


# ------------------------------------------------------------------------------------------------ the console
def console_is_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


def set_log_levels(args) -> None:
    """log_level (rank 0) / log_level_replica (the others) for transformers' and dsgrpo's loggers. Off a terminal
    (or with disable_tqdm) the libraries' own bars (loading and saving shards, dataset maps) are off on every
    rank too: in a log file each is a run of carriage returns."""
    import logging

    import datasets
    import huggingface_hub
    import transformers

    if args.disable_tqdm or not console_is_terminal():
        transformers.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        datasets.disable_progress_bars()
    level = args.log_level if dist.is_main() else args.log_level_replica
    if level == "passive":
        return
    transformers.logging.set_verbosity(getattr(logging, level.upper()))
    logging.getLogger("dsgrpo").setLevel(getattr(logging, level.upper()))


def make_progress(args, total_steps: int):
    """A bar on a terminal (unless disable_tqdm); plain lines anywhere else."""
    if console_is_terminal() and not args.disable_tqdm:
        try:
            return ProgressBar(total_steps)
        except ImportError:
            pass
    return ProgressLines(total_steps)


class ProgressBar:
    def __init__(self, total_steps: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, desc="GRPO", dynamic_ncols=True, file=sys.stderr)

    def show(self, step: int, metrics: Dict[str, float]) -> None:
        self.bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward", "loss", "kl") if k in metrics})

    def advance(self, steps: int) -> None:
        self.bar.update(steps)

    def resumed(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """`step 40/400 (10%) | reward 0.312 | kl 0.0021 | 1.2e+03 tok/s | 1m05s elapsed | ETA 9m45s` at each
    logging step, `eval at step N: ...` after an evaluation, and one closing line; to stdout, flushed."""

    SHOWN = ("reward", "loss", "kl", "entropy")

    def __init__(self, total_steps: int, stream=None):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self.first_step = 0  # the step this process started from (a resumed run's ETA counts only its own steps)

    def show(self, step: int, metrics: Dict[str, float]) -> None:
        elapsed = time.monotonic() - self.started
        if "train_runtime" in metrics:  # the summary row
            line = f"done: step {step}/{self.total} in {_duration(metrics['train_runtime'])}"
        elif any(k.startswith("eval_") for k in metrics):
            line = f"eval at step {step}: " + " | ".join(
                f"{k} {v:.4g}" for k, v in metrics.items() if k.endswith("reward") or k.endswith("/mean")
            )
        else:
            parts = [f"step {step}/{self.total} ({100 * step / max(1, self.total):.0f}%)"]
            parts += [f"{k} {metrics[k]:.4g}" for k in self.SHOWN if k in metrics]
            if "completion_tok_per_s" in metrics:
                parts.append(f"{metrics['completion_tok_per_s']:.4g} tok/s")
            parts.append(f"{_duration(elapsed)} elapsed")
            done = step - self.first_step
            if done > 0 and step < self.total:
                parts.append(f"ETA {_duration(elapsed / done * (self.total - step))}")
            line = " | ".join(parts)
        print(line, file=self.stream, flush=True)

    def advance(self, steps: int) -> None:
        pass

    def resumed(self, step: int) -> None:
        self.first_step = step
        self.started = time.monotonic()

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def learning_curve_summary(history: List[Dict[str, float]], rows: int = 8, window: int = 5) -> str:
    """A short text learning curve: mean reward over a few evenly spaced windows of steps, and the ratio of
    the last window to the first."""
    history = [h for h in history if "reward" in h]  # training rounds (not evaluation or the summary row)
    if not history:
        return "no steps were run"
    rewards = [h["reward"] for h in history]
    window = max(1, min(window, len(rewards) // 2 or 1))
    starts = sorted({round(i * (len(rewards) - window) / max(1, rows - 1)) for i in range(rows)})
    lines = ["learning curve (mean reward over windows of %d generation rounds):" % window]
    for s in starts:
        chunk = rewards[s : s + window]
        value = sum(chunk) / len(chunk)
        lines.append(
            f"  step {history[s]['step']:>5d}  reward {value:6.3f}  " + "#" * int(round(40 * max(0.0, min(1.0, value))))
        )
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    lines.append(
        f"first {window} rounds: {first:.3f}   last {window} rounds: {last:.3f}   ratio: {last / first:.2f}x"
        if first > 0
        else f"first: {first:.3f}  last: {last:.3f}"
    )
    return "\n".join(lines)
