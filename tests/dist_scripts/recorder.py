"""What the 2-rank check scripts share: a decorator that records each check's numbers (or its traceback, so the
other checks still run and the pytest side names the one that failed), and the ZeRO-3 config that really shards
tiny models (persistence threshold 0)."""

import traceback

SHARDED_ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto"}


def recorder(results: dict, only=None):
    """`@check(name)` runs the function now and stores its return value in results[name]; with `only`, checks
    whose name is not in it are skipped."""
    def check(name):
        def wrap(fn):
            if only and name not in only:
                return fn
            try:
                results[name] = fn()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            return fn
        return wrap
    return check
