"""Is the CPU demo's learning curve robust? Runs examples/cpu_demo.yaml (launch_scripts/train.sh, 2 ranks) for each
seed under this CPU's own instruction set and under a forced lower one. For each instruction set the warm-up model
is built under it too (`python -m dsgrpo.tasks warmup`); per run it prints the mean reward of the first and last 5
generation rounds (the trainer's summary line), the held-out greedy pass@1 before and after
(`dsgrpo.tasks.evaluate_copy`, 200 numbers the training set never shows) and the wall time from launch to exit.

    .venv/bin/python bench/demo_robustness.py [--seeds 0,1,2,3,4] [--isa native,forced] [--out DIR] [-- overrides]

Goal (issue 54): every run's last 5 rounds ≥ 0.8 mean reward, ≤ 3 minutes from launch, held-out greedy pass@1 up
by ≥ 0.3, and no run settled on a wrong answer.

The forced instruction set: on an AVX-512 CPU it is AVX2 (the other common x86 server ISA): torch's vectorised
kernels (ATEN_CPU_CAPABILITY=avx2), MKL's GEMMs (MKL_CBWR=AVX2, MKL's own switch for a fixed code path) and oneDNN
(ONEDNN_MAX_CPU_ISA=AVX2). An AVX2 CPU cannot run AVX-512, so there MKL's GEMMs are forced down to its
SSE2-compatible path (MKL_CBWR=COMPATIBLE) and oneDNN to SSE4.1; torch's own kernels stay AVX2, because
ATEN_CPU_CAPABILITY=default breaks the C++ that torch.compile generates for vLLM's sampler (torch 2.13: `at::vec`
undeclared). MKL_ENABLE_INSTRUCTIONS changed no result on an AMD EPYC and is not used. The ranks inherit these
through the launcher; vLLM's own CPU kernels (attention) keep the ISA they were built for. Figures, not
assertions."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"first 5 rounds: ([0-9.]+)\s+last 5 rounds: ([0-9.]+)")


def has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "avx512f" in fh.read()
    except OSError:
        return False


def forced_isa() -> tuple:
    """(name, environment) of the instruction set one step below this CPU's."""
    if has_avx512():
        return "AVX2 (forced)", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    return "SSE GEMMs (forced)", {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def run(seed: int, isa: str, out: str, extra: list) -> dict:
    env = dict(os.environ)
    name = "AVX-512 (native)" if has_avx512() else "AVX2 (native)"
    if isa == "forced":
        name, forced = forced_isa()
        env.update(forced)
    run_dir = os.path.join(out, f"{isa}-seed{seed}")
    init = os.path.join(out, f"init_model-{isa}")
    cmd = [
        "bash",
        "launch_scripts/train.sh",
        "examples/cpu_demo.yaml",
        "--model",
        init,
        "--output_dir",
        run_dir,
        "--seed",
        str(seed),
        *extra,
    ]
    found, wall, error = launch(cmd, run_dir, env)
    if error:
        return {"seed": seed, "isa": name, "error": error, "wall": wall}
    first, last = found
    after = held_out(run_dir, env)
    return {
        "seed": seed,
        "isa": name,
        "first": first,
        "last": last,
        "ratio": last / max(first, 1e-9),
        "wall": wall,
        "pass_after": after["greedy_pass@1"],
        "sampled_after": after["sampled_reward"],
    }


def launch(cmd: list, run_dir: str, env: dict = None) -> tuple:
    """Run a train.sh command, keep its output in run_dir/stdout.log: ((first 5, last 5) mean rewards from the
    trainer's summary line, wall seconds, None), or (None, wall seconds, what went wrong)."""
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.time() - start
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "stdout.log"), "w") as fh:
        fh.write(proc.stdout + proc.stderr)
    found = SUMMARY.search(proc.stdout)
    if proc.returncode or not found:
        return None, wall, f"exit {proc.returncode}; see {run_dir}/stdout.log"
    return (float(found.group(1)), float(found.group(2))), wall, None


def isa_env(isa: str) -> dict:
    return {**os.environ, **(forced_isa()[1] if isa == "forced" else {})}


def held_out(model_dir: str, env: dict) -> dict:
    """dsgrpo.tasks.evaluate_copy in a child process under the run's instruction set."""
    code = "import json, sys; from dsgrpo.tasks import evaluate_copy; print(json.dumps(evaluate_copy(sys.argv[1])))"
    proc = subprocess.run(
        [sys.executable, "-c", code, model_dir], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--isa", default="native,forced", help="native, forced, or both (comma-separated)")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "demo_robustness"))
    parser.add_argument("extra", nargs="*", help="more overrides for the demo config, after --")
    args = parser.parse_args()
    unknown = set(args.isa.split(",")) - {"native", "forced"}
    if unknown:
        parser.error(f"--isa {args.isa}: {sorted(unknown)} unknown; use native, forced or native,forced")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for isa in args.isa.split(","):
        init = os.path.join(args.out, f"init_model-{isa}")
        subprocess.run(
            [sys.executable, "-m", "dsgrpo.tasks", "warmup", "--out", init], cwd=REPO, check=True, env=isa_env(isa)
        )
        before = held_out(init, isa_env(isa))
        print(
            f"warm-up ({isa}): held-out greedy pass@1 {before['greedy_pass@1']:.2f}, sampled reward "
            f"{before['sampled_reward']:.2f}",
            flush=True,
        )
        for seed in (int(s) for s in args.seeds.split(",")):
            row = run(seed, isa, args.out, args.extra)
            rows.append(row)
            if "error" in row:
                print(f"{row['isa']:24s} seed {seed}: {row['error']}", flush=True)
                continue
            row["pass_before"] = before["greedy_pass@1"]
            lift = row["pass_after"] - row["pass_before"]
            ok = row["last"] >= 0.8 and lift >= 0.3 and row["wall"] <= 180
            print(
                f"{row['isa']:24s} seed {seed}: first 5 {row['first']:.3f}  last 5 {row['last']:.3f}  "
                f"({row['ratio']:.1f}x)  held-out greedy pass@1 {row['pass_before']:.2f} -> {row['pass_after']:.2f}"
                f"  {row['wall']:.0f} s  {'ok' if ok else 'MISSED'}",
                flush=True,
            )
    done = [r for r in rows if "error" not in r]
    if done:
        print(
            f"range: last 5 {min(r['last'] for r in done):.2f}–{max(r['last'] for r in done):.2f}, ratio "
            f"{min(r['ratio'] for r in done):.1f}–{max(r['ratio'] for r in done):.1f}x, held-out greedy pass@1 "
            f"after {min(r['pass_after'] for r in done):.2f}–{max(r['pass_after'] for r in done):.2f}, wall "
            f"{min(r['wall'] for r in done):.0f}–{max(r['wall'] for r in done):.0f} s over {len(done)} runs"
        )
    with open(os.path.join(args.out, "robustness.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
