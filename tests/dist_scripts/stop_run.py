"""A stopped rank, in a named phase: `stop_run.py OUTPUT_DIR PHASE` under `torchrun --nproc_per_node 2`.

A tiny ZeRO-2 run (the CPU demo's optimizer path: DeepSpeed's own gradient reduction and step) where rank 1
SIGSTOPs itself at step 2 in PHASE: generate (inside generate), reward (inside the reward function), reduce (in the
training forward: rank 0 goes on into ZeRO-2's allreduce_bucket and waits there), step (as the optimizer step
starts: rank 0 waits in DeepSpeed's step), sync (as the weight sync starts), checkpoint (as the engine's checkpoint
starts), each once rank 0 waits for it (WAITS_IN). Rank 0 must then be ended by its watcher after ddp_timeout
(STOP_DDP_TIMEOUT, default 10 s; DEEPSPEED_TIMEOUT, when set, gives the collectives themselves longer) with exit
code 3 and a message naming rank 1 and its phase. `FAULT rank 1 stops in PHASE t=<unix time>` marks the stop.
With STOP_DUMP_S, rank 0 dumps its stacks that long after it reaches the stop (what it waits in). Only `sync` runs
vLLM (the other phases wait in the same collectives with transformers' generate, which starts faster)."""

import os
import signal
import sys
import time

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from dsgrpo.process_exit import say_line
from dsgrpo.testing import tiny_model
from dsgrpo.watchdog import RANK_LOST_EXIT_CODE, RankLostError

ARGV = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
OUT, PHASE = ARGV[0], ARGV[1]
AT = 2  # the step (1-based) whose PHASE rank 1 stops in


# where rank 0 waits for a rank 1 stopped in each phase: rank 1 stops once rank 0's heartbeat says it is there, so
# the message names where rank 0 waits, not where a slower rank 0 happened to be (a loaded machine's ranks drift)
WAITS_IN = {
    "generate": "reward",
    "reward": "reward",
    "reduce": "train",
    "step": "train",
    "sync": "round end",
    "checkpoint": "checkpoint",
}


def stop(step: int) -> None:
    if dist.rank() == 0 and step == AT and os.environ.get("STOP_DUMP_S"):  # what rank 0 then waits in
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["STOP_DUMP_S"]), exit=False)
    if dist.rank() == 1 and step == AT:
        from dsgrpo import watchdog

        deadline = time.time() + 120
        while watchdog._heartbeat[0].read()[0].phase != WAITS_IN[PHASE] and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # (its collective entered)
        say_line(f"FAULT rank 1 stops in {PHASE} t={time.time():.3f}")
        os.kill(os.getpid(), signal.SIGSTOP)


def reward(prompts, completions, **kwargs):
    if PHASE == "reward":
        stop(trainer.state.global_step + 1)
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


args = GRPOConfig(
    output_dir=OUT,
    max_steps=4,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=5e-3,
    gradient_checkpointing=False,
    logging_steps=1,
    save_steps=AT,
    seed=3,
    vllm_kv_cache_bytes=32 * 2**20,
    use_vllm=PHASE == "sync",  # transformers' generate elsewhere: a faster start, the same collectives
    ddp_timeout=int(os.environ.get("STOP_DDP_TIMEOUT", 10)),
    deepspeed={
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
)
data = Dataset.from_list([{"prompt": f"Numbers please, {i}:"} for i in range(8)])
trainer = GRPOTrainer(tiny_model("qwen2"), reward, args=args, train_dataset=data)


def before(obj, name, step_of):
    original = getattr(obj, name)

    def wrapped(*a, **k):
        stop(step_of())
        return original(*a, **k)

    setattr(obj, name, wrapped)


next_step = lambda: trainer.state.global_step + 1  # noqa: E731 - the step being made
if PHASE == "generate":
    before(trainer.generator, "generate", next_step)
elif PHASE == "reduce":
    trainer.policy.module.register_forward_hook(lambda *_: stop(next_step()) if torch.is_grad_enabled() else None)
elif PHASE == "step":
    before(trainer.policy.engine, "step", next_step)
elif PHASE == "sync":
    before(trainer.source, "sync_weights", lambda: trainer.state.global_step)
elif PHASE == "checkpoint":
    before(trainer.policy.engine, "save_checkpoint", lambda: trainer.state.global_step)
try:
    trainer.train()
except RankLostError as exc:  # the collective timed out first (what `dsgrpo train` does with it)
    say_line(f"dsgrpo: error: {exc}")
    os._exit(RANK_LOST_EXIT_CODE)
say_line(f"rank {dist.rank()} finished: the stop did not end the job")
from dsgrpo.process_exit import leave  # noqa: E402

leave(0)
