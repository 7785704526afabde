"""Ranks that start as a trainer's do (dist.init, then the heartbeat and its watcher) and then wait: what a test
kills the launcher of (tests/test_stopped_rank_dist.py). Prints `READY <rank> <pid>` once its watcher runs."""

import os
import time

from dsgrpo import dist, watchdog

dist.init(timeout_s=60)
watchdog.start(dist.rank(), dist.world_size(), step=lambda: 0)
print(f"READY {dist.rank()} {os.getpid()}", flush=True)
time.sleep(300)
