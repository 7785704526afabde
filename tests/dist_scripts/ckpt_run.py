"""One run of the checkpoint tests, under `torchrun --nproc_per_node 2`.

    ckpt_run.py OUTPUT_DIR [FAULT]     FAULT: KIND@AT[:RANK[:stop]]   KIND: gen | backward | sync | save | usr1 | enospc

The run trains a tiny model with real ZeRO-3 + in-process vLLM for 3 epochs of 8 prompts (6 optimizer steps,
a checkpoint every 2 = every epoch boundary), resuming from the latest checkpoint when there is one. A fault
is injected on BOTH ranks at the same logical point (so the whole job dies as a node failure would), or with
:RANK on that rank alone (the others must notice, name it and exit): gen@R SIGKILLs during generation round R,
backward@S during the backward of step S, sync@S while the weights of step S are sent to vLLM, save@S after the
shards of checkpoint S are written but before it is published, usr1@S sends SIGUSR1 after step S (preemption);
`:stop` sends SIGSTOP instead of SIGKILL (a hung rank). enospc@S:RANK makes that rank's shard writes of
checkpoint S fail as a full disk does, the other rank's succeed. Launchers' own arguments (--local_rank=N) are ignored.
At the end rank 0 writes the policy's log-probs of a fixed sequence to OUTPUT_DIR/final_logps.json.
"""

import json
import os
import signal
import sys
import time

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from dsgrpo.engines import completion_logprobs
from dsgrpo.process_exit import say_line
from dsgrpo.rollout import Rollout
from dsgrpo.testing import tiny_model
from dsgrpo.watchdog import RANK_LOST_EXIT_CODE, RankLostError
from recorder import digit_fraction, training_rows

ARGV = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
OUT = ARGV[0]
FAULT = ARGV[1] if len(ARGV) > 1 else ""
kind, _, where = FAULT.partition("@")
at, _, target = where.partition(":")
at = int(at or 0)
target, _, how = target.partition(":")


def die():
    if target and int(target) != dist.rank():
        return
    say_line(f"FAULT rank {dist.rank()} {'stops' if how == 'stop' else 'dies'} at {FAULT} t={time.time():.3f}")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


class Usr1:
    def on_step_end(self, args, state, control, **kw):
        if kind == "usr1" and state.global_step == at:
            os.kill(os.getpid(), signal.SIGUSR1)


args = GRPOConfig(
    output_dir=OUT,
    num_train_epochs=3,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=8,
    learning_rate=5e-3,
    lr_scheduler_type="linear",
    warmup_steps=1,
    gradient_checkpointing=False,
    logging_steps=1,
    save_steps=2,
    save_total_limit=2,
    seed=3,
    resume_from_checkpoint="latest",
    vllm_kv_cache_bytes=32 * 2**20,
    ddp_timeout=int(os.environ.get("CKPT_DDP_TIMEOUT", 1800)),  # the chaos tests' bound
    deepspeed={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
)
data = Dataset.from_list([{"prompt": f"Numbers please, {i}:"} for i in range(8)])
trainer = GRPOTrainer(tiny_model("qwen2"), digit_fraction, args=args, train_dataset=data, callbacks=[Usr1()])

if kind == "gen":
    original_generate = trainer.generator.generate

    def generate(*a, **k):
        if trainer.state.generation_round == at - 1:  # rounds count from 0; round R produces step R
            die()
        return original_generate(*a, **k)

    trainer.generator.generate = generate
elif kind == "backward":

    def hook(module, inputs, output):
        if torch.is_grad_enabled() and trainer.state.global_step == at - 1:
            die()

    trainer.policy.module.register_forward_hook(hook)
elif kind == "sync":
    original_sync = trainer.source.sync_weights

    def sync_weights(module, round, *a, **k):
        if trainer.state.global_step == at:
            die()
        return original_sync(module, round, *a, **k)

    trainer.source.sync_weights = sync_weights
elif kind == "save":
    original_save = trainer.policy.engine.save_checkpoint

    def save_checkpoint(*a, **k):
        result = original_save(*a, **k)
        if trainer.state.global_step == at:
            die()  # the shards are on disk, the checkpoint is not yet published
        return result

    trainer.policy.engine.save_checkpoint = save_checkpoint

elif kind == "enospc":
    engine_save = trainer.policy.engine.checkpoint_engine.save

    def full_disk_save(state_dict, path, *a, **k):
        if trainer.state.global_step == at and int(target) == dist.rank():
            raise OSError(28, "No space left on device", path)
        return engine_save(state_dict, path, *a, **k)

    trainer.policy.engine.checkpoint_engine.save = full_disk_save

resumed_from = trainer.resume_path
try:
    trainer.train()
except RankLostError as exc:  # a peer was killed or stopped: what the survivor says, and when
    say_line(f"SURVIVOR rank {dist.rank()} t={time.time():.3f}: {exc}")
    os._exit(RANK_LOST_EXIT_CODE)

r = Rollout([[1, 5, 9, 12]], [[30, 31, 32, 33, 34]], [[0.0] * 5], [True])
t = r.tensors(trainer.tokenizer.pad_token_id)
with torch.no_grad():
    lp, _ = completion_logprobs(trainer.policy.engine, t["input_ids"], t["attention_mask"], 5)
if dist.is_main():
    with open(os.path.join(OUT, "final_logps.json"), "w") as fh:
        json.dump(
            {
                "logps": lp[0].tolist(),
                "resumed_from": resumed_from,
                "steps": trainer.state.global_step,
                "history_steps": [h["step"] for h in training_rows(trainer)],
            },
            fh,
        )
dist.barrier("final log-probs written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
