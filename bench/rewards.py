"""Rewards per second of the built-in rewards on real data.

    .venv/bin/python bench/rewards.py [--gsm8k ../shared/data/gsm8k/test.jsonl] [--repeat 3]

Prints one line per reward and `RESULT accuracy_reward_per_s=<...>` last."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsgrpo.rewards import accuracy_reward, think_format_reward  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gsm8k", default=os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.gsm8k)]
    solutions = [r["answer"] for r in rows]
    # completions as a model would write them: the reasoning, then the final line (half of them wrong)
    completions = [s if i % 2 == 0 else s.rsplit("####", 1)[0] + "#### 0" for i, s in enumerate(solutions)]
    results = {}
    for name, fn, kwargs in (("accuracy_reward", accuracy_reward, {"solution": solutions}),
                             ("think_format_reward", think_format_reward, {})):
        best = float("inf")
        for _ in range(a.repeat):
            t = time.perf_counter()
            fn(completions, **kwargs)
            best = min(best, time.perf_counter() - t)
        results[name] = len(completions) / best
        print(f"{name:22s} {len(completions)} completions in {best:.3f} s = {results[name]:,.0f} rewards/s")
    print(f"RESULT accuracy_reward_per_s={results['accuracy_reward']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
