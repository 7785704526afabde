"""Metric sinks, fed only on rank 0 with metrics already reduced over ranks: the console (a progress bar),
`metrics.jsonl` in output_dir, and wandb when `report_to` names it."""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional


class MetricSinks:
    def __init__(self, args, total_steps: int, enabled: bool):
        self.enabled = enabled
        self.print_rows = args.num_completions_to_print
        self.unique_prompts = args.log_unique_prompts
        self.jsonl = None
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(args.output_dir, "metrics.jsonl"), "a")
        if "wandb" in args.report_sinks():
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", args.project), name=args.run_name,
                                    config=args.to_dict(), dir=args.output_dir)
        if not args.disable_tqdm:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total_steps, desc="GRPO", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward", "loss", "kl") if k in metrics})

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
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        print(f"dsgrpo: resumed from {path} at step {step}", file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def log_completions(self, step: int, rows: List[dict]) -> None:
        """Every rank's rows of a round (TRL's completions table): to completions.jsonl and wandb; at most
        num_completions_to_print of them printed; with log_unique_prompts, one row per distinct prompt."""
        if not self.enabled:
            return
        if self.unique_prompts:
            rows = list({r["prompt"]: r for r in reversed(rows)}.values())[::-1]
        shown = rows if self.print_rows is None else rows[:self.print_rows]
        for r in shown:
            print(f"[step {step}] reward {r['reward']:.3f}  advantage {r['advantage']:+.3f}\n  prompt: {r['prompt']}\n"
                  f"  completion: {r['completion']}", file=sys.stderr, flush=True)
        path = os.path.join(os.path.dirname(self.jsonl.name), "completions.jsonl")
        with open(path, "a") as fh:
            for row in rows:
                fh.write(json.dumps({"step": step, **row}) + "\n")
        if self.wandb is not None:
            import wandb
            cols = list(rows[0]) if rows else []
            self.wandb.log({"completions": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


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
        chunk = rewards[s:s + window]
        value = sum(chunk) / len(chunk)
        lines.append(f"  step {history[s]['step']:>5d}  reward {value:6.3f}  " + "#" * int(round(40 * max(0.0, min(1.0, value)))))
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    lines.append(f"first {window} rounds: {first:.3f}   last {window} rounds: {last:.3f}   "
                 f"ratio: {last / first:.2f}x" if first > 0 else f"first: {first:.3f}  last: {last:.3f}")
    return "\n".join(lines)
