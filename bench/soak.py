"""A soak: the CPU demo for many steps with frequent checkpoints, watching every rank's resources over time.

    .venv/bin/python bench/soak.py [--steps 2000] [--save-steps 100] [--out outputs/soak] [--interval 5]

Runs examples/cpu_demo.yaml through launch_scripts/train.sh (2 ZeRO-3 ranks + colocated vLLM) with
save_steps / save_total_limit 2, and samples each rank process every `interval` seconds: resident memory
(VmRSS), open file descriptors, threads, and the processes of the job. Prints a table over time, then per rank
the RSS slope after warm-up (a least-squares line over the samples past 10% of the run, in MiB per 1,000 steps),
the ranges of fds and threads, and what is left after exit (processes, DeepSpeed's /dev/shm files, checkpoints
beyond the limit). Figures, not assertions: the closing note reports them."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def proc_status(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]), "fds": fds}


def descendants(pid: int) -> list:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children, rows = {}, {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2:
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
            rows[int(parts[0])] = parts[2] if len(parts) > 2 else ""
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, rows[child]))
            todo.append(child)
    return found


def ranks_of(pid: int) -> dict:
    """{rank: pid} of the training processes under the launcher."""
    out = {}
    for child, args in descendants(pid):
        if "dsgrpo.train" in args and "--local_rank=" in args:
            out[int(args.split("--local_rank=")[1].split()[0])] = child
    return out


def steps_done(out_dir: str) -> int:
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
            return max([json.loads(l)["step"] for l in fh if l.strip() and '"reward"' in l] or [0])
    except (OSError, ValueError):
        return 0


def slope(points: list) -> float:
    """Least-squares slope of (x, y) points."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "soak"))
    p.add_argument("--interval", type=float, default=5.0)
    a = p.parse_args()
    init = os.path.join(REPO, "outputs", "demo", "init_model")
    if not os.path.isdir(init):
        subprocess.run([sys.executable, "-m", "dsgrpo.tasks", "warmup", "--out", init], check=True, cwd=REPO)
    shm_before = set(glob.glob("/dev/shm/*"))
    cmd = [
        "bash",
        os.path.join(REPO, "launch_scripts", "train.sh"),
        "examples/cpu_demo.yaml",
        "--max_steps",
        str(a.steps),
        "--save_steps",
        str(a.save_steps),
        "--save_total_limit",
        "2",
        "--output_dir",
        a.out,
        "--logging_steps",
        "10",
    ]
    log = open(os.path.join(os.path.dirname(a.out) or ".", "soak.log"), "w")
    launcher = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHON=sys.executable)
    )
    samples, start = [], time.time()
    print(
        f"{'t/s':>6} {'step':>6} "
        + " ".join(f"{f'r{r} rss':>9} {f'r{r} fds':>7} {f'r{r} thr':>7}" for r in (0, 1))
        + f" {'procs':>6}",
        flush=True,
    )
    while launcher.poll() is None:
        time.sleep(a.interval)
        ranks = ranks_of(launcher.pid)
        row = {
            "t": time.time() - start,
            "step": steps_done(a.out),
            "procs": len(descendants(launcher.pid)),
            "ranks": {},
        }
        for r, pid in sorted(ranks.items()):
            status = proc_status(pid)
            if status:
                row["ranks"][r] = status
        if len(row["ranks"]) == 2:
            samples.append(row)
            if len(samples) % 6 == 1:
                print(
                    f"{row['t']:6.0f} {row['step']:6d} "
                    + " ".join(
                        f"{row['ranks'][r]['rss_mib']:9.1f} {row['ranks'][r]['fds']:7d} {row['ranks'][r]['threads']:7d}"
                        for r in (0, 1)
                    )
                    + f" {row['procs']:6d}",
                    flush=True,
                )
    wall = time.time() - start
    time.sleep(3)
    left = [
        l
        for l in subprocess.run(["pgrep", "-af", "dsgrpo.train"], capture_output=True, text=True).stdout.splitlines()
        if "pgrep" not in l
    ]
    shm_left = sorted(set(glob.glob("/dev/shm/*")) - shm_before)
    checkpoints = sorted(d for d in os.listdir(a.out) if d.startswith("checkpoint-")) if os.path.isdir(a.out) else []
    print(f"\nexit code {launcher.returncode}; {steps_done(a.out)} steps in {wall:.0f} s; {len(samples)} samples")
    warm = [s for s in samples if s["step"] >= a.steps * 0.1]
    for r in (0, 1):
        rss = [(s["step"], s["ranks"][r]["rss_mib"]) for s in warm]
        if rss:
            print(
                f"rank {r}: RSS {rss[0][1]:.1f} → {rss[-1][1]:.1f} MiB after warm-up "
                f"(step {rss[0][0]} → {rss[-1][0]}), "
                f"slope {1000 * slope(rss):+.2f} MiB per 1,000 steps; fds {min(s['ranks'][r]['fds'] for s in warm)}"
                f"–{max(s['ranks'][r]['fds'] for s in warm)}; threads {min(s['ranks'][r]['threads'] for s in warm)}"
                f"–{max(s['ranks'][r]['threads'] for s in warm)}"
            )
    if warm:
        print(f"job processes {min(s['procs'] for s in warm)}–{max(s['procs'] for s in warm)}")
    print(
        f"left after exit: {len(left)} dsgrpo.train processes {left}; new /dev/shm files: {shm_left}; "
        f"checkpoints kept: {checkpoints}"
    )
    with open(os.path.join(a.out, "soak_samples.json"), "w") as fh:
        json.dump(samples, fh)
    return launcher.returncode


if __name__ == "__main__":
    sys.exit(main())
