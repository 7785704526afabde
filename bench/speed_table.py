"""Issue 29's table in one run: dsgrpo at its defaults beside TRL 1.16 on the same machine, one process and two
ranks, each phase against its floor (bench/floors.py), plus the long-tailed workload (packed against padded).

    python bench/speed_table.py [--workloads W1,W2,LT] [--steps 6] [--skip-trl] [--models /tmp]

Workloads (completion tokens per second; --batch-size completions an optimizer step over all ranks):
    W1  train-heavy: hidden 512 x 8 layers, vocab 1000 (34.6M parameters), G 8, L 128, 32 a step
    W2  generation-heavy: hidden 256 x 4 layers, G 8, L 512, 16 a step
    LT  long-tailed: W2's model, generation also stops at 13 ids (most completions short, a few up to 512)
Each configuration runs alone, one after the other (≈ 25 min for all three on 2 cores). The floors: plain torch
forward + backward + AdamW of the step's tokens (per rank: its share of the completions on its share of the
threads), and generation's FLOP floor at the matmul peak. Machines vary by ±15% between runs an hour apart: compare
ratios within one table. Prints a markdown table last."""

import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2"]

WORKLOADS = {
    "W1": dict(model="m32", make="--hidden 512 --layers 8 --heads 8 --vocab 1000", length=128, batch=32, stop=0),
    "W2": dict(model="m_w2", make="--hidden 256 --layers 4 --heads 4", length=512, batch=16, stop=0),
    "LT": dict(model="m_w2", make="--hidden 256 --layers 4 --heads 4", length=512, batch=16, stop=13),
}
PHASES = ("generate", "reward", "train", "sync")


def run(cmd, timeout: int) -> str:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"failed (exit {out.returncode}) after {time.perf_counter() - start:.0f} s:\n{text[-3000:]}")
    return text


def parse(text: str) -> dict:
    """The RESULT line's figures, the phases' mean seconds and the mean completion length of a bench run's output."""
    results = [ln for ln in text.splitlines() if ln.startswith("RESULT")]
    if not results:
        raise RuntimeError(f"no RESULT line in the run's output:\n{text[-3000:]}")
    line = results[-1]
    values = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
    for phase in PHASES:
        m = re.search(rf"time/{phase}\s+([\d.]+)", text)
        if m:
            values[phase] = float(m.group(1))
    m = re.search(r"mean completion length ([\d.]+)", text)
    if m:
        values["length"] = float(m.group(1))
    return values


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="W1,W2,LT")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--models", default="/tmp", help="where the tiny models are made (kept between runs)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one configuration may take")
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for name in a.workloads.split(","):
        w = WORKLOADS[name]
        model = os.path.join(a.models, w["model"])
        if not os.path.exists(os.path.join(model, "config.json")):
            run([PY, "-m", "dsgrpo.testing", "make", *w["make"].split(), "--out", model], a.timeout)
        batch = w["batch"]
        args = [
            "--model",
            model,
            "--steps",
            str(a.steps),
            "--num-generations",
            "8",
            "--max-completion-length",
            str(w["length"]),
            "--batch-size",
            str(batch),
        ]
        if w["stop"]:
            args += ["--stop-ids", str(w["stop"])]
        configs = [] if a.skip_trl else [("TRL", 1, []), ("TRL", 2, [])]
        configs += [("dsgrpo", 1, []), ("dsgrpo", 2, [])]
        if w["stop"]:
            configs.append(("dsgrpo padded", 1, ["--token-budget", "0"]))
        for who, world, extra in configs:
            script = "bench/trl_throughput.py" if who == "TRL" else "bench/throughput.py"
            launcher = [PY] if world == 1 else TORCHRUN
            values = parse(run(launcher + [script] + args + extra, a.timeout))
            if who != "TRL" and "length" in values:  # the floors of this run's tokens, per rank
                floor = parse(
                    run(
                        [
                            PY,
                            "bench/floors.py",
                            "--model",
                            model,
                            "--completions",
                            str(batch // world),
                            "--micro",
                            str(batch // world),
                            "--completion",
                            str(round(values["length"])),
                            "--threads",
                            str(max(1, cores // world)),
                            "--repeat",
                            "2",
                        ],
                        a.timeout,
                    )
                )
                values["train_floor"], values["gen_floor"] = floor["train_floor_s"], floor["generation_flop_floor_s"]
            rows.append((name, who, world, values))
            print(f"  {name} {who} x{world}: {values}", flush=True)
    print(f"\n{cores} cores; completion tokens/s (mean of steps 2..{a.steps}); phases in s a step, floor in brackets\n")
    print(
        "| workload | run | ranks | tok/s | vs TRL best | generate [FLOP floor] | train [torch floor] | reward | sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, who, world, v in rows:
        trl = [r[3]["completion_tok_per_s"] for r in rows if r[0] == name and r[1] == "TRL"]
        vs = f"{v['completion_tok_per_s'] / max(trl):.2f}×" if trl and who != "TRL" else ""
        gen = f"{v['generate']:.2f} [{v['gen_floor']:.2f}]" if "gen_floor" in v else ""
        train = f"{v['train']:.2f} [{v['train_floor']:.2f}]" if "train_floor" in v else ""
        print(
            f"| {name} | {who} | {world} | {v['completion_tok_per_s']:.1f} | {vs} | {gen} | {train} | "
            f"{v.get('reward', float('nan')):.2f} | {v.get('sync', float('nan')):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
