"""One run of the async chaos tests, under `torchrun --nproc_per_node 2`.

    async_fault_run.py OUTPUT_DIR PLACEMENT [FAULT]     PLACEMENT: colocate | split
                                                        FAULT: worker@N:R | worker@vV:R[:save] | kill@N:R

AsyncGRPOTrainer, on-policy (max_staleness=0; 1 with :save), 6 rounds, a checkpoint every 2, resuming from the
latest one when there is one. worker@N:R: the N-th reward call on rank R raises inside its rollout worker, mid-chunk
(claimed and generated, not yet pooled); worker@vV:R: the first one on policy version V or later; with :save rank R
holds the next checkpoint until its worker has died (a worker lost between a weight sync and a save). kill@N:R: rank
R SIGKILLs itself at that point (split placement: a generating rank). Each training rank appends what it trained
(per round, the prompt positions of the trained groups) and how the run ended to OUTPUT_DIR/attempts-<rank>.jsonl.
"""

import json
import os
import signal
import sys
import time

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOConfig, dist
from dsgrpo.process_exit import say_line
from dsgrpo.testing import tiny_model
from dsgrpo.watchdog import RankLostError
from recorder import SHARDED_ZERO3, digit_fraction

OUT, PLACEMENT = sys.argv[1], sys.argv[2]
FAULT = sys.argv[3] if len(sys.argv) > 3 else ""
kind, _, where = FAULT.partition("@")
call_no, _, target = where.partition(":")
target, _, hold = target.partition(":")  # worker@vV:R:save — rank R's main thread waits for the fault before saving
calls = {"n": 0}


def fault_due() -> bool:
    """worker@vV: the first reward call on a policy version >= V (on-policy: round V or later), whichever groups
    rank R happened to claim before; load balancing makes "the N-th call" land in different rounds run to run."""
    if call_no.startswith("v"):
        return trainer.source.worker.version >= int(call_no[1:])
    return calls["n"] == int(call_no)


def reward(prompts, completions, **kwargs):
    calls["n"] += 1
    if FAULT and dist.rank(dist.EVERYONE) == int(target) and fault_due():
        say_line(f"FAULT rank {target} {kind} at reward call {calls['n']} t={time.time():.3f}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ZeroDivisionError("the rollout worker dies mid-chunk, on purpose")
    return digit_fraction(prompts, completions)


args = GRPOConfig(
    output_dir=OUT,
    max_steps=6,
    save_steps=2,
    per_device_train_batch_size=8 if PLACEMENT == "colocate" else 16,
    num_generations=4,
    max_completion_length=8,
    learning_rate=2e-3,
    logging_steps=1,
    gradient_checkpointing=False,
    seed=1,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=32 * 2**20,
    async_placement=PLACEMENT,
    max_staleness=1 if hold else 0,  # :save: room for rank 1 to claim
    async_chunk_groups=1,
    resume_from_checkpoint="latest",
    ddp_timeout=60,
)
data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])
trainer = AsyncGRPOTrainer(tiny_model("qwen2"), reward, args=args, train_dataset=data)
rounds = []
if hold == "save" and dist.rank(dist.EVERYONE) == int(target):
    original_save = trainer.save_checkpoint

    def save_checkpoint():
        # the worker dies between the weight sync and the checkpoint, every time: this rank waits before the save
        # pauses its worker (a paused worker claims nothing), while the other rank's save waits for it
        deadline = time.time() + 60
        while trainer.source.worker.error is None and time.time() < deadline:
            time.sleep(0.05)
        return original_save()

    trainer.save_checkpoint = save_checkpoint
if trainer.trains:
    original = trainer.source.next_batch

    def next_batch(round_index):
        out = original(round_index)
        rounds.append({"round": round_index, "positions": sorted(p for _, p, _ in trainer.source.last_plan.chosen)})
        return out

    trainer.source.next_batch = next_batch

ended = {"how": "finished"}
try:
    trainer.train()
except RankLostError as exc:
    ended = {"how": "rank lost", "message": str(exc), "t": time.time()}
except RuntimeError as exc:
    ended = {"how": "error", "message": str(exc), "t": time.time()}
if trainer.trains:
    with open(os.path.join(OUT, f"attempts-{dist.rank(dist.EVERYONE)}.jsonl"), "a") as fh:
        fh.write(json.dumps({"fault": FAULT, "resumed_from": trainer.resume_path, "rounds": rounds, **ended}) + "\n")
say_line(f"ENDED rank {dist.rank(dist.EVERYONE)}: {ended['how']}")
if ended["how"] != "finished":
    os._exit(3)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
