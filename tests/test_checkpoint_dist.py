"""Exact resume, proven by killing 2-rank runs (real ZeRO-3 + vLLM) at several points and comparing the final
weights with an uninterrupted run; preemption by SIGUSR1; export; refused resumes. One chain of launches:

    reference: 6 steps, never interrupted
    chain:     gen@3 (SIGKILL of both ranks while generating step 3) → resumes checkpoint-2 (an epoch boundary)
               gen@3:1 (SIGKILL of rank 1 alone) → rank 0 names it and exits; resumes checkpoint-2
               sync@3:0 (SIGKILL of rank 0 while step 3's weights go to vLLM) → rank 1 names it
               backward@4:1:stop (SIGSTOP of rank 1 in step 4's backward: rank 0's watcher ends it after ddp_timeout)
               save@4:1 (SIGKILL of rank 1 while checkpoint-4 is being written) → latest must still be checkpoint-2
               usr1@5 (SIGUSR1 after step 5: checkpoint-5, exit 75)
               (no fault) → resumes checkpoint-5 and finishes

Each one-rank fault must end the run with the survivor's RankLostError naming the lost rank and its phase,
within 2 × ddp_timeout (30 s here; DEEPSPEED_TIMEOUT unset so ddp_timeout decides) of the fault.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from launch import REPO, torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist_scripts/ckpt_run.py"


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ref, chain = root / "reference", root / "chain"
    torchrun(SCRIPT, str(ref), timeout=600)
    seen = {}
    for fault in FAULTS:
        # a stopped rank: the collectives keep launch's DEEPSPEED_TIMEOUT (3 minutes), so the survivor's watcher,
        # at ddp_timeout, is what ends it (as it must where a collective never times out)
        env = {"CKPT_DDP_TIMEOUT": str(DDP_TIMEOUT)} if fault.endswith(":stop") else CHAOS_ENV
        proc = torchrun(SCRIPT, str(chain), fault, timeout=600, check=False, env=env)
        assert proc.returncode != 0, f"{fault}: the injected fault did not stop the run"
        seen[fault] = {
            "stderr": proc.stderr,
            "latest": (chain / "latest").read_text().strip(),
            "listing": sorted(os.listdir(chain)),
            "ended": time.time(),
        }
    torchrun(SCRIPT, str(chain), timeout=600)
    return {"ref": ref, "chain": chain, "seen": seen}


FAULTS = ("gen@3", "gen@3:1", "sync@3:0", "backward@4:1:stop", "save@4:1", "usr1@5")
DDP_TIMEOUT = 30
CHAOS_ENV = {"DEEPSPEED_TIMEOUT": None, "CKPT_DDP_TIMEOUT": str(DDP_TIMEOUT)}
PHASE = {"gen": "generate", "sync": "sync", "backward": "train", "save": "checkpoint"}


def survivor_report(stderr: str, fault: str, ended: float = 0.0):
    """(seconds from the fault to the survivor's report, the report) from the two marked lines ckpt_run prints, or,
    when the survivor's watcher ended it (no SURVIVOR line), its `dsgrpo: error:` line and the time the run ended."""
    import re

    died = re.search(r"^FAULT rank (\d) (?:dies|stops) at \S+ t=([\d.]+)$", stderr, re.M)
    said = re.search(r"SURVIVOR rank (\d) t=([\d.]+): (.*)$", stderr, re.M)
    watched = re.search(r"^dsgrpo: error: (lost rank \d .*its watcher ends it.*)$", stderr, re.M)
    assert died and (said or watched), f"{fault}: no fault/survivor line\n{stderr[-3000:]}"
    if said is None:
        return ended - float(died.group(2)), watched.group(1)
    assert died.group(1) != said.group(1)
    return float(said.group(2)) - float(died.group(2)), said.group(3)


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.count(":")])
def test_a_lost_rank_is_named_with_its_phase_within_twice_the_timeout(runs, fault):
    seen = runs["seen"][fault]
    seconds, report = survivor_report(seen["stderr"], fault, seen["ended"])
    kind, rank = fault.split("@")[0], fault.split(":")[1]
    assert report.startswith(f"lost rank {rank} (pid "), report
    assert f"in phase '{PHASE[kind]}'" in report, report
    state = "the process is stopped (SIGSTOP" if fault.endswith(":stop") else "the process is gone (killed or crashed)"
    assert state in report, report
    assert seconds <= 2 * DDP_TIMEOUT, (seconds, report)
    if fault.endswith(":stop"):  # the survivor's watcher waited ddp_timeout without the peer's beats, and no longer
        assert DDP_TIMEOUT - 2 <= seconds and "its watcher ends it (exit code 3)" in report, (seconds, report)
    else:  # a killed peer's socket closes at once: no waiting for the timeout
        assert seconds < DDP_TIMEOUT / 2, (seconds, report)
    assert seen["latest"] == "checkpoint-2"


def test_killed_and_resumed_run_ends_with_the_uninterrupted_weights(runs):
    a, b = weights(runs["ref"]), weights(runs["chain"])
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, worst
    from dsgrpo.testing import tiny_model

    moved = max((a[k] - v).abs().max().item() for k, v in weights(tiny_model("qwen2")).items())
    assert moved > 1e-3  # training really changed the weights
    ref = json.load(open(runs["ref"] / "final_logps.json"))
    got = json.load(open(runs["chain"] / "final_logps.json"))
    assert max(abs(x - y) for x, y in zip(ref["logps"], got["logps"])) <= 1e-6
    assert got["resumed_from"].endswith("checkpoint-5") and got["steps"] == 6
    # what ref_deepspeed 'auto' chose (whole weights: the plan fits them) is recorded, and a resume keeps it
    latest = runs["chain"] / (runs["chain"] / "latest").read_text().strip()
    assert json.load(open(latest / "trainer_state.json"))["deepspeed_auto"] == {"ref_deepspeed": "inference.json"}


def test_a_rank_killed_under_the_deepspeed_launcher_is_named(tmp_path):
    """The deepspeed launcher polls its children every second and SIGTERMs the rest when one fails: the survivor
    still names the lost rank (the diagnosis holds the signal) before it goes. Under this launcher DeepSpeed's CPU
    allreduce runs over /dev/shm segments it never unlinks: dsgrpo unlinks them once mapped, so even a killed job
    leaves none (compat.unlink_deepspeed_cpu_shm_segment)."""
    out = tmp_path / "run"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "CKPT_DDP_TIMEOUT": str(DDP_TIMEOUT),
    }
    env.pop("DEEPSPEED_TIMEOUT", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    port = 29400 + os.getpid() % 90
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        os.path.join(REPO, SCRIPT),
        str(out),
        "backward@3:1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode != 0
    seconds, report = survivor_report(proc.stdout + proc.stderr, "backward@3:1")
    assert report.startswith("lost rank 1 (pid ") and "in phase 'train' at step 2" in report, report
    assert "the process is gone (killed or crashed)" in report and seconds < DDP_TIMEOUT / 2, (seconds, report)
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


def test_kills_leave_a_valid_latest(runs):
    seen = runs["seen"]
    assert seen["gen@3"]["latest"] == "checkpoint-2"
    assert seen["backward@4:1:stop"]["latest"] == "checkpoint-2"
    # rank 1 killed during the save of checkpoint-4: the partial folder is there, unpublished; latest unchanged
    assert seen["save@4:1"]["latest"] == "checkpoint-2"
    assert ".checkpoint-4.partial" in seen["save@4:1"]["listing"] and "checkpoint-4" not in seen["save@4:1"]["listing"]


def test_sigusr1_checkpoints_and_exits_75(runs):
    usr1 = runs["seen"]["usr1@5"]
    assert usr1["latest"] == "checkpoint-5"
    assert "exitcode  : 75" in usr1["stderr"] or "exitcode: 75" in usr1["stderr"], usr1["stderr"][-2000:]
    assert "checkpoint-4" in usr1["listing"]  # it saved on schedule before the signal, then pruned to 2


def test_resume_at_an_epoch_boundary_trains_the_remaining_steps(runs):
    # 8 prompts, 4 per round: checkpoint-2 and checkpoint-4 sit on epoch boundaries; every step 1..6 was trained
    records = [json.loads(l) for l in open(runs["chain"] / "metrics.jsonl")]
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4, 5, 6]  # training rounds (no summary rows)
    kept = sorted(p for p in os.listdir(runs["chain"]) if p.startswith("checkpoint-"))
    assert kept == ["checkpoint-5", "checkpoint-6"]  # save_total_limit=2, pruned after each complete save


def test_export_loads_in_vllm_with_the_policys_logprobs(runs, tmp_path):
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "dsgrpo.cli", "export", str(runs["chain"] / "checkpoint-6"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "can run code" in proc.stderr  # a checkpoint's shards are pickles: said once
    exported = weights(out)
    final = weights(runs["chain"])
    assert max((exported[k] - final[k]).abs().max().item() for k in final) == 0.0
    code = f"""
import os, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model={str(out)!r}, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 * 2**20, max_model_len=128)
ids = [1, 5, 9, 12, 30, 31, 32, 33, 34]
res = llm.generate([{{"prompt_token_ids": ids}}], SamplingParams(max_tokens=1, prompt_logprobs=0))
print("LOGPS", json.dumps([res[0].prompt_logprobs[i][ids[i]].logprob for i in range(4, 9)]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("LOGPS")]
    assert line, proc.stderr[-3000:]
    vllm_logps = json.loads(line[0][len("LOGPS ") :])
    policy = json.load(open(runs["chain"] / "final_logps.json"))["logps"]
    assert max(abs(a - b) for a, b in zip(vllm_logps, policy)) <= 1e-4


def test_bad_resumes_are_refused_and_touch_nothing(runs, tmp_path):
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer
    from dsgrpo.checkpoint import CheckpointCanRunCodeWarning, CheckpointError
    from dsgrpo.testing import tiny_model

    chain = runs["chain"]
    before = {p: os.path.getmtime(chain / p) for p in os.listdir(chain)}
    data = Dataset.from_list([{"prompt": "x"}])

    def trainer(**kw):
        base = dict(
            output_dir=str(chain),
            per_device_train_batch_size=4,
            num_generations=2,
            seed=3,
            max_steps=8,
            use_vllm=False,
            gradient_checkpointing=False,
        )
        return GRPOTrainer(
            tiny_model("qwen2"),
            lambda prompts, completions, **k: [0.0] * len(completions),
            args=GRPOConfig(**{**base, **kw}),
            train_dataset=data,
        )

    with pytest.raises(CheckpointError, match=r"num_generations: checkpoint 2, this run 4"):
        trainer(num_generations=4, resume_from_checkpoint="latest")
    # one rank may continue two ranks' checkpoint, but only with a round's prompts and steps kept (4 prompts)
    with pytest.raises(
        CheckpointError,
        match=r"prompts_per_round: checkpoint 4, this run 2.*on 1 rank\(s\) set "
        r"per_device_train_batch_size × gradient_accumulation_steps = 8",
    ):
        trainer(resume_from_checkpoint=str(chain / "checkpoint-6"))
    with pytest.warns(CheckpointCanRunCodeWarning, match="not written by this run.*can run code"):  # said once
        with pytest.raises(CheckpointError, match=r"prompts_per_round"):
            trainer(output_dir=str(tmp_path / "elsewhere"), resume_from_checkpoint=str(chain / "checkpoint-6"))
    with pytest.raises(CheckpointError, match="model_config"):
        GRPOTrainer(
            tiny_model("llama"),
            lambda prompts, completions, **k: [0.0] * len(completions),
            args=GRPOConfig(
                output_dir=str(chain),
                per_device_train_batch_size=4,
                num_generations=2,
                seed=3,
                use_vllm=False,
                resume_from_checkpoint="latest",
            ),
            train_dataset=data,
        )
    with pytest.raises(CheckpointError, match="no such directory"):
        trainer(resume_from_checkpoint=str(tmp_path / "checkpoint-99"))
    partial = tmp_path / "checkpoint-6"
    shutil.copytree(chain / "checkpoint-6", partial)
    os.remove(partial / "COMPLETE")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        trainer(resume_from_checkpoint=str(partial))
    assert {p: os.path.getmtime(chain / p) for p in os.listdir(chain)} == before


# ------------------------------------------------------------------------------------------- damage and disk full
def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_engine(runs, tmp_path):
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer
    from dsgrpo.checkpoint_integrity import CheckpointError, DamagedCheckpointError, damage
    from dsgrpo.testing import tiny_model

    chain = runs["chain"]
    assert damage(str(chain / "checkpoint-6")) is None  # the chain's own checkpoints are intact

    def trainer(out, resume):
        args = GRPOConfig(
            output_dir=str(out),
            per_device_train_batch_size=4,
            num_generations=2,
            seed=3,
            max_steps=8,
            use_vllm=False,
            gradient_checkpointing=False,
            resume_from_checkpoint=resume,
        )
        return GRPOTrainer(
            tiny_model("qwen2"),
            lambda prompts, completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "x"}]),
        )

    truncated = tmp_path / "truncated" / "checkpoint-6"
    shutil.copytree(chain / "checkpoint-6", truncated)
    shard = truncated / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(
        DamagedCheckpointError,
        match=f"engine/zero_pp_rank_1_mp_rank_00_optim_states.pt has {size // 2} bytes, {size} were written",
    ) as err:
        trainer(tmp_path / "out1", str(truncated))
    assert "It was not loaded" in str(err.value)
    export = subprocess.run(
        [sys.executable, "-m", "dsgrpo.cli", "export", str(truncated), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert export.returncode == 2 and "optim_states.pt has" in export.stderr and "Traceback" not in export.stderr

    # one changed byte in the trainer state, and `latest` pointing at it: the older intact checkpoint is named
    out = tmp_path / "latest_damaged"
    out.mkdir()
    for name in ("checkpoint-5", "checkpoint-6", "latest"):
        (shutil.copytree if (chain / name).is_dir() else shutil.copy)(chain / name, out / name)
    state = out / "checkpoint-6" / "trainer_state.json"
    raw = bytearray(state.read_bytes())
    at = raw.index(b'"global_step": 6') + len(b'"global_step": ')
    raw[at : at + 1] = b"7"  # still valid JSON, and the wrong step: only the checksum can tell
    state.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        trainer(out, "latest")
    text = str(err.value)
    assert (
        f"the newest checkpoint, {out / 'checkpoint-6'}, is damaged: trainer_state.json does not match its sha256"
        in text
    )
    assert f"The newest intact one is {out / 'checkpoint-5'}: resume from it with resume_from_checkpoint=" in text


def tmpfs(path, size):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


@pytest.mark.skipif(os.getuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_write_that_fails_on_one_rank_only_fails_the_save_on_both_without_a_hang(tmp_path):
    """Rank 1's shards hit a full disk, rank 0's are written: DeepSpeed's save ends in a barrier the failing rank
    used to skip, so the next collective paired with the wrong one and the job hung until the collective timeout
    (seen in the full-disk test when the two ranks raced for the last bytes of a small tmpfs)."""
    proc = torchrun(SCRIPT, str(tmp_path / "run"), "enospc@2:1", timeout=600, check=False)
    assert proc.returncode != 0
    said = [l for l in proc.stderr.splitlines() if "CheckpointWriteError: writing checkpoint-2 failed" in l]
    assert {l.split("]")[0] for l in said} == {"[rank0", "[rank1"}, proc.stderr[-3000:]
    assert "rank 1: [Errno 28] No space left on device" in said[0] and "timeout" not in proc.stderr.lower()
    assert not [n for n in os.listdir(tmp_path / "run") if "checkpoint" in n]


def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_latest(tmp_path):
    from dsgrpo.checkpoint_integrity import damage

    small, tiny = tmp_path / "small", tmp_path / "tiny"
    tmpfs(small, "12m")  # one checkpoint (6.6 MiB) fits, a second does not
    tmpfs(tiny, "4m")  # not even the first
    try:
        proc = torchrun(SCRIPT, str(small / "run"), timeout=600, check=False)
        assert proc.returncode != 0
        said = [l for l in proc.stderr.splitlines() if "CheckpointWriteError: writing checkpoint-4 failed" in l]
        assert {l.split("]")[0] for l in said} == {"[rank0", "[rank1"}, proc.stderr[-3000:]  # both ranks stop alike
        assert "no room for checkpoint-4" in said[0] and "checkpoint-2 took" in said[0]
        assert "latest and the older checkpoints" in said[0]
        left = sorted(os.listdir(small / "run"))
        assert "checkpoint-2" in left and not [n for n in left if "checkpoint-4" in n], left
        assert (small / "run" / "latest").read_text().strip() == "checkpoint-2"
        assert damage(str(small / "run" / "checkpoint-2")) is None

        proc = torchrun(SCRIPT, str(tiny / "run"), timeout=600, check=False)
        assert proc.returncode != 0
        said = [l for l in proc.stderr.splitlines() if "CheckpointWriteError: writing checkpoint-2 failed" in l]
        assert len(said) == 2 and "MiB free there" in said[0], proc.stderr[-3000:]
        left = sorted(os.listdir(tiny / "run"))
        assert "latest" not in left and not [n for n in left if "checkpoint" in n], left  # no partial folder left
    finally:
        for path in (small, tiny):
            subprocess.run(["umount", "-l", str(path)])
