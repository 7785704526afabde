"""`dsgrpo report RUN_DIR [RUN_DIR ...] [--out DIR]`: pictures of finished (or running) runs.

Reads what every run writes to its output_dir (metrics.jsonl; completions.jsonl with log_completions;
resolved_config.yaml; memory.json) and writes one self-contained `report.html` (the PNGs are embedded, nothing
is fetched) plus the same PNGs beside it. Several run folders are overlaid, one colour per run, for comparison.

Figures: reward and each reward function, KL, entropy, completion lengths and the clipped ratio, loss and
grad norm, learning rate, tokens/s, the time of each phase (stacked), tool and environment health, async metrics,
eval curves; then a table of sampled completions with their rewards, and multi-turn episodes (tools, environments)
group by group, side by side, each turn with its tool calls and the answers. A figure whose metrics no run logged is
left out and named under "Not logged" (KL needs beta > 0, eval curves an eval_dataset, the table
log_completions)."""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

MAX_TABLE_ROWS = 12  # completions shown per run and step (the first and the last logged step)
MAX_GROUPS = 4  # groups of multi-turn episodes shown per run (of its last logged step)
TOOL_HEALTH = (
    "tools/calls_per_episode",
    "tools/failure_frequency",
    "tools/parse_failures",
    "env/errors",
    "env/timeouts",
    "env/step_s",
    "episode/turns",
)


@dataclass
class Run:
    path: str
    name: str
    rows: List[dict]  # training rounds: step + metrics
    evals: List[dict]  # evaluation rows (eval_* keys)
    summary: dict  # the closing row (train_runtime, memory/...)
    config: dict = field(default_factory=dict)
    completions: List[dict] = field(default_factory=list)

    def series(self, key: str, rows: Optional[List[dict]] = None):
        rows = self.rows if rows is None else rows
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    def keys(self) -> List[str]:
        return sorted({k for r in self.rows for k in r if k != "step"})


def load_run(path: str, name: Optional[str] = None) -> Run:
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(
            f"{path}: no metrics.jsonl. Pass a run's output_dir (where training wrote "
            "metrics.jsonl and resolved_config.yaml)."
        )
    by_step: Dict[int, dict] = {}
    evals: Dict[int, dict] = {}
    summary: dict = {}
    with open(metrics) as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                continue
            if "train_runtime" in record:
                summary = record
            elif any(k.startswith("eval_") for k in record):
                evals.setdefault(record["step"], {}).update(record)
            else:
                by_step.setdefault(record["step"], {}).update(record)  # the latest write of a step wins
    config = {}
    if os.path.isfile(os.path.join(path, "resolved_config.yaml")):
        import yaml

        with open(os.path.join(path, "resolved_config.yaml")) as fh:
            config = yaml.safe_load(fh) or {}
    completions = []
    if os.path.isfile(os.path.join(path, "completions.jsonl")):
        with open(os.path.join(path, "completions.jsonl")) as fh:
            completions = [json.loads(line) for line in fh if line.strip()]
    label = name or os.path.basename(os.path.normpath(path)) or path
    return Run(
        path,
        label,
        [by_step[s] for s in sorted(by_step)],
        [evals[s] for s in sorted(evals)],
        summary,
        config,
        completions,
    )


def unique_names(paths: Sequence[str]) -> List[str]:
    """Each run's label: its folder's name, with as many parent folders as it takes to tell them apart."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(i) for i in range(len(paths))]


# ------------------------------------------------------------------------------------------------ figures
@dataclass
class Figure:
    slug: str
    title: str
    caption: str
    png: bytes


def _smooth(values: List[float]) -> List[float]:
    """A trailing mean over ~1/20 of the run: the trend beside the raw (noisy) per-round values."""
    window = max(1, len(values) // 20)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class Plotter:
    def __init__(self, runs: List[Run]):
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed (a Slurm node, CI)
        import matplotlib.pyplot as plt

        self.plt = plt
        self.runs = runs
        self.colors = palette(runs)

    def _png(self, fig) -> bytes:
        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=100)
        self.plt.close(fig)
        return buffer.getvalue()

    def lines(self, panels: List[tuple], rows_of: Callable[[Run], List[dict]] = None) -> Optional[bytes]:
        """One subplot per (metric key, y-label) panel, every run overlaid: raw values thin, their trend bold.
        None when no run logged any of the keys."""
        rows_of = rows_of or (lambda run: run.rows)
        panels = [(k, label) for k, label in panels if any(run.series(k, rows_of(run))[0] for run in self.runs)]
        if not panels:
            return None
        cols = min(len(panels), 2)
        rows = math.ceil(len(panels) / cols)
        fig, axes = self.plt.subplots(rows, cols, figsize=(6.4 * cols, 3.4 * rows), squeeze=False)
        for ax, (key, label) in zip(axes.flat, panels):
            for run in self.runs:
                steps, values = run.series(key, rows_of(run))
                if not steps:
                    continue
                color = self.colors[run.name]
                if len(values) > 20:
                    ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                    ax.plot(steps, _smooth(values), color=color, linewidth=1.8, label=run.name)
                else:
                    ax.plot(steps, values, color=color, linewidth=1.6, marker="o", markersize=3, label=run.name)
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(self.runs) > 1:
                ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        return self._png(fig)

    def time_breakdown(self) -> Optional[bytes]:
        """Seconds per round by phase (time/*), stacked: one subplot per run."""
        runs = [run for run in self.runs if any(k.startswith("time/") for k in run.keys())]
        if not runs:
            return None
        fig, axes = self.plt.subplots(len(runs), 1, figsize=(12.8, 3.4 * len(runs)), squeeze=False)
        for ax, run in zip(axes.flat, runs):
            phases = [k for k in run.keys() if k.startswith("time/")]
            steps = [r["step"] for r in run.rows]
            stacks = [[float(r.get(k) or 0.0) for r in run.rows] for k in phases]
            ax.stackplot(steps, stacks, labels=[k[len("time/") :] for k in phases], alpha=0.85)
            ax.set_title(f"seconds per round by phase — {run.name}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("s")
            ax.legend(fontsize=8, loc="upper left", ncol=min(len(phases), 6))
            ax.grid(alpha=0.3)
        return self._png(fig)


def figures(runs: List[Run]) -> tuple:
    """(figures made, names of those no run logged)."""
    plot = Plotter(runs)
    keys = sorted({k for run in runs for k in run.keys()})
    reward_fns = sorted({k for k in keys if k.startswith("rewards/") and k.endswith("/mean")})
    async_keys = [k for k in keys if k.startswith("async/")]
    eval_keys = sorted({k for run in runs for r in run.evals for k in r if k.startswith("eval_")})
    specs = [
        (
            "reward",
            "Reward",
            "Mean reward of each round's completions, and its spread within groups (reward_std).",
            lambda: plot.lines(
                [
                    ("reward", "reward"),
                    ("reward_std", "reward std within groups"),
                    ("frac_reward_zero_std", "groups with zero reward std (no learning signal)"),
                ]
            ),
        ),
        (
            "reward_functions",
            "Each reward function",
            "Mean of each reward function (rewards/<name>/mean).",
            lambda: plot.lines([(k, k[len("rewards/") : -len("/mean")]) for k in reward_fns]),
        ),
        (
            "kl",
            "KL to the reference",
            "The per-token KL estimate against the reference model (logged when beta > 0).",
            lambda: plot.lines([("kl", "kl")]),
        ),
        (
            "entropy",
            "Entropy",
            "Mean per-token entropy of the policy on the completions.",
            lambda: plot.lines([("entropy", "entropy")]),
        ),
        (
            "lengths",
            "Completion lengths",
            "Mean, min and max completion length in tokens, and the fraction of "
            "completions cut at max_completion_length.",
            lambda: plot.lines(
                [
                    ("completions/mean_length", "mean length"),
                    ("completions/max_length", "max length"),
                    ("completions/min_length", "min length"),
                    ("completions/clipped_ratio", "clipped ratio (hit max_completion_length)"),
                ]
            ),
        ),
        (
            "optimizer",
            "Loss, grad norm, learning rate",
            "The GRPO loss, the gradient norm before clipping and the learning rate of each step.",
            lambda: plot.lines([("loss", "loss"), ("grad_norm", "grad norm"), ("learning_rate", "learning rate")]),
        ),
        (
            "clipping",
            "Clipped ratios",
            "Fraction of tokens whose importance ratio was clipped (low / high / region).",
            lambda: plot.lines([(k, k) for k in keys if k.startswith("clip_ratio/")]),
        ),
        (
            "throughput",
            "Tokens per second",
            "Completion tokens generated per second of the whole round.",
            lambda: plot.lines([("completion_tok_per_s", "completion tokens / s")]),
        ),
        (
            "time",
            "Time per phase",
            "Seconds each phase of a round took (generate, reward, reference, train, sync, ...), stacked.",
            plot.time_breakdown,
        ),
        (
            "async",
            "Async rollouts",
            "AsyncGRPOTrainer: staleness of the trained groups, pooled / moved / stolen / "
            "dropped groups and completions generated per rank.",
            lambda: plot.lines([(k, k[len("async/") :]) for k in async_keys]),
        ),
        (
            "eval",
            "Evaluation",
            "Mean reward (per-function means; pass@k, avg@n, maj@k when asked) on the eval set at each evaluation.",
            lambda: plot.lines([(k, k) for k in eval_keys], rows_of=lambda run: run.evals),
        ),
    ]
    if any(k in keys for k in TOOL_HEALTH):  # only runs with tools or environments log these: no "not logged" line
        specs.insert(
            -2,
            (
                "tools",
                "Tool and environment health",
                "Per episode (a completion with all its turns): "
                "tool calls, calls that could not be parsed, tool or environment errors, timeouts and "
                "sampled turns; the failed share of calls and the seconds a call took (env/step_s).",
                lambda: plot.lines([(k, k) for k in TOOL_HEALTH if k in keys]),
            ),
        )
    made, missing = [], []
    for slug, title, caption, draw in specs:
        png = draw()
        if png is None:
            missing.append(title)
        else:
            made.append(Figure(slug, title, caption, png))
    return made, missing


# ------------------------------------------------------------------------------------------------ the page
CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1320px; padding: 16px 24px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left;
vertical-align: top; } th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 14px 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; } .muted { color: #777; } code, pre { font-size: 12.5px; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px; }
td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 520px; }
td.episode { min-width: 220px; max-width: 360px; } .turn { margin: 4px 0; padding: 3px 6px; border-radius: 4px; }
.turn pre { white-space: pre-wrap; margin: 2px 0; } .turn.assistant { background: #eef4ff; }
.turn.tool { background: #f3f3f3; } .who { font-size: 11px; color: #666; } .call { color: #0b5; font-size: 12.5px; }
th[data-reward] { cursor: pointer; }
"""

# Marks on <body> what the browser made of the page: how many plots decoded, so a reader (or a test in a headless
# browser) can tell a broken image from a missing one.
SCRIPT = """
window.addEventListener("load", () => {
  // an episodes table re-sorts its columns by reward when a header is clicked (best first, then worst first)
  document.querySelectorAll("table.episodes").forEach((table) => {
    table.querySelectorAll("th[data-reward]").forEach((th) => th.addEventListener("click", () => {
      const [head, body] = table.rows;
      const order = Array.from(head.cells).map((c, i) => [parseFloat(c.dataset.reward), i]);
      const ascending = table.dataset.ascending !== "1";
      order.sort((a, b) => ascending ? a[0] - b[0] : b[0] - a[0]);
      table.dataset.ascending = ascending ? "1" : "0";
      const heads = order.map(([, i]) => head.cells[i]), cells = order.map(([, i]) => body.cells[i]);
      heads.forEach((c) => head.appendChild(c)); cells.forEach((c) => body.appendChild(c));
    }));
  });
  const images = Array.from(document.querySelectorAll("figure img"));
  const decoded = images.filter((img) => img.complete && img.naturalWidth > 0);
  document.body.dataset.plots = String(images.length);
  document.body.dataset.plotsDecoded = String(decoded.length);
  images.filter((img) => !decoded.includes(img)).forEach((img) => {
    const note = document.createElement("p");
    note.textContent = "this plot failed to load: " + img.alt;
    img.replaceWith(note);
  });
});
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _summary_table(runs: List[Run], colors: Dict[str, str]) -> str:
    head = ["run", "model / config", "steps", "reward: first → last 10%", "runtime", "peak memory / rank"]
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for run in runs:
        steps, rewards = run.series("reward")
        k = max(1, len(rewards) // 10)
        reward = f"{sum(rewards[:k]) / k:.3f} → {sum(rewards[-k:]) / k:.3f}" if rewards else "—"
        c = run.config
        what = ", ".join(
            f"{key}={c[key]}"
            for key in ("loss_type", "beta", "num_generations", "learning_rate", "max_completion_length", "temperature")
            if key in c
        )
        runtime = run.summary.get("train_runtime")
        peak = run.summary.get("memory/peak_bytes_max")
        out.append(
            f"<tr><td><span class='swatch' style='background:{colors[run.name]}'></span>{html.escape(run.name)}"
            f"<br><span class='muted'>{html.escape(os.path.abspath(run.path))}</span></td>"
            f"<td>{html.escape(what) or '—'}</td><td class='num'>{steps[-1] if steps else 0}</td>"
            f"<td class='num'>{reward}</td>"
            f"<td class='num'>{f'{runtime:.0f} s' if runtime else 'unfinished'}</td>"
            f"<td class='num'>{f'{peak / 2**30:.2f} GiB' if peak else '—'}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _completions_table(run: Run) -> str:
    if not run.completions:
        return ""
    steps = sorted({row["step"] for row in run.completions})
    picked = [steps[0]] + ([steps[-1]] if steps[-1] != steps[0] else [])
    parts = [f"<h3>{html.escape(run.name)}</h3>"]
    for step in picked:
        rows = [r for r in run.completions if r["step"] == step]
        shown = sorted(rows, key=lambda r: -float(r.get("reward", 0.0)))[:MAX_TABLE_ROWS]
        parts.append(f"<p>step {step}: {len(shown)} of {len(rows)} completions, best reward first</p>")
        parts.append(
            "<table class='completions'><tr><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>"
        )
        for r in shown:
            parts.append(
                f"<tr><td class='text'>{html.escape(str(r.get('prompt', '')))}</td>"
                f"<td class='text'>{html.escape(str(r.get('completion', '')))}</td>"
                f"<td class='num'>{_fmt(r.get('reward', ''))}</td>"
                f"<td class='num'>{_fmt(r.get('advantage', ''))}</td></tr>"
            )
        parts.append("</table>")
    return "\n".join(parts)


def _turn_html(message: dict) -> str:
    """One turn of an episode: the policy's text and its tool calls, or the answer a tool or environment gave."""
    role = str(message.get("role", ""))
    text = html.escape(str(message.get("content") or ""))
    if role == "tool":
        return (
            f"<div class='turn tool'><span class='who'>{html.escape(str(message.get('name') or 'tool'))} "
            f"answered</span><pre>{text}</pre></div>"
        )
    calls = "".join(
        f"<div class='call'>&rarr; {html.escape(str(c.get('function', c).get('name')))}"
        f"({html.escape(json.dumps(c.get('function', c).get('arguments'), ensure_ascii=False))})</div>"
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    )
    return (
        f"<div class='turn {html.escape(role)}'><span class='who'>{html.escape(role)}</span>"
        f"<pre>{text}</pre>{calls}</div>"
    )


def _episodes(run: Run) -> str:
    """Multi-turn episodes as people read them: each group of the last logged step side by side, best reward first
    (a click on a reward header re-sorts), every turn with its tool calls, the answers and the rewards."""
    rows = [r for r in run.completions if r.get("messages")]
    if not rows:
        return ""
    step = max(r["step"] for r in rows)
    groups: Dict[str, List[dict]] = {}
    for r in rows:
        if r["step"] == step:
            groups.setdefault(str(r.get("group", r.get("prompt"))), []).append(r)
    parts = [f"<h3>{html.escape(run.name)}: step {step}, {len(groups)} groups</h3>"]
    for label, members in list(groups.items())[:MAX_GROUPS]:
        members = sorted(members, key=lambda r: -float(r.get("reward", 0.0)))
        parts.append(
            f"<p class='muted'>prompt: {html.escape(members[0].get('prompt', '')[:300])}</p>"
            "<table class='episodes sortable'><tr>"
        )
        for r in members:
            own = ", ".join(f"{html.escape(k)} {_fmt(v)}" for k, v in (r.get("rewards") or {}).items() if v is not None)
            parts.append(
                f"<th data-reward='{float(r.get('reward', 0.0))}'>reward {_fmt(r.get('reward', ''))} "
                f"<span class='muted'>({own}; advantage {_fmt(r.get('advantage', ''))})</span></th>"
            )
        parts.append("</tr><tr>")
        for r in members:
            parts.append("<td class='episode'>" + "".join(_turn_html(m) for m in r["messages"]) + "</td>")
        parts.append("</tr></table>")
    return "\n".join(parts)


def render_html(runs: List[Run], made: List[Figure], missing: List[str], colors: Dict[str, str]) -> str:
    title = "dsgrpo report: " + ", ".join(run.name for run in runs)
    body = [f"<h1>{html.escape(title)}</h1>", _summary_table(runs, colors)]
    for fig in made:
        data = base64.b64encode(fig.png).decode()
        body.append(
            f"<h2 id='{fig.slug}'>{html.escape(fig.title)}</h2><figure>"
            f"<img alt='{html.escape(fig.title)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(fig.caption)} ({fig.slug}.png)</figcaption></figure>"
        )
    tables = [t for t in (_completions_table(run) for run in runs) if t]
    body.append("<h2 id='completions'>Sampled completions</h2>")
    body.append(
        "\n".join(tables)
        if tables
        else "<p class='muted'>No completions.jsonl: run with <code>log_completions: true</code> to see them here.</p>"
    )
    episodes = [t for t in (_episodes(run) for run in runs) if t]
    if episodes:
        body.append("<h2 id='episodes'>Episodes</h2>" + "\n".join(episodes))
    if missing:
        body.append(
            "<h2>Not logged</h2><p class='muted'>No run logged the metrics of: "
            + html.escape(", ".join(missing))
            + ".</p>"
        )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + f"\n<script>{SCRIPT}</script>\n</body></html>\n"
    )


def write_report(paths: Sequence[str], out_dir: Optional[str] = None) -> str:
    """Write report.html and the PNGs for the runs at `paths`; returns the report's path."""
    if not paths:
        raise ValueError("dsgrpo report needs at least one run folder (an output_dir with metrics.jsonl).")
    runs = [load_run(p, name) for p, name in zip(paths, unique_names(paths))]
    if not any(run.rows for run in runs):
        raise ValueError(f"{', '.join(paths)}: metrics.jsonl has no training rounds yet (nothing to plot).")
    out_dir = out_dir or (os.path.join(paths[0], "report") if len(paths) == 1 else "report")
    os.makedirs(out_dir, exist_ok=True)
    made, missing = figures(runs)
    for fig in made:
        with open(os.path.join(out_dir, f"{fig.slug}.png"), "wb") as fh:
            fh.write(fig.png)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as fh:
        fh.write(render_html(runs, made, missing, palette(runs)))
    return path


def palette(runs: List[Run]) -> Dict[str, str]:
    """Each run's colour, in the plots and the summary table alike."""
    import matplotlib

    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    return {run.name: cycle[i % len(cycle)] for i, run in enumerate(runs)}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsgrpo report",
        description="Plots of one or more runs in one self-contained report.html (several runs are overlaid).",
    )
    parser.add_argument("runs", nargs="+", help="run folders (each an output_dir with metrics.jsonl)")
    parser.add_argument(
        "--out", help="folder for report.html and the PNGs (default RUN_DIR/report for one run, ./report for several)"
    )
    args = parser.parse_args(argv)
    path = write_report(args.runs, args.out)
    print(f"report written to {path}")
    return 0
