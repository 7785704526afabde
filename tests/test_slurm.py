"""The launch scripts against a real Slurm (Debian's slurm-wlm, two slurmd on this host) and the deepspeed
launcher. Marked `slurm` (and `dist`): the quick suite skips them; `make test` and CI run them. The cluster is
started by the fixture and always torn down, taking any job process with it."""

import json
import os
import subprocess
import sys
import time

import pytest

from launch import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.dist]
CLUSTER = os.path.join(REPO, "tests", "slurm", "local_cluster.sh")
SBATCH = os.path.join(REPO, "launch_scripts", "slurm", "train.sbatch")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    if os.getuid() != 0:
        pytest.skip("the local Slurm cluster needs root (munged, slurmd)")
    subprocess.run(["bash", CLUSTER, "start", str(state)], check=True, timeout=300)
    env = dict(
        os.environ,
        SLURM_CONF=str(state / "slurm.conf"),
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        DEEPSPEED_TIMEOUT="3",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    try:
        yield env
    finally:
        subprocess.run(["bash", CLUSTER, "stop", str(state)], timeout=120)
        for _ in range(40):  # SIGKILLed processes take a moment to be reaped
            left = subprocess.run(
                ["pgrep", "-af", "slurmctld|slurmd|slurmstepd|munged|dsgrpo.train|vllm-serve"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if not left:
                break
            time.sleep(0.25)
        assert not left, f"processes outlived the cluster: {left}"


def config(tmp_path, **over):
    from dsgrpo.testing import tiny_model

    values = dict(
        model=tiny_model("qwen2"),
        train_dataset="task:copy_digits",
        reward_funcs=["dsgrpo.tasks:copy_digits_reward"],
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        logging_steps=1,
        save_steps=2,
        vllm_kv_cache_bytes=32 * 2**20,
    )
    values.update(over)
    path = tmp_path / "job.yaml"
    path.write_text("# test job\n" + "".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


def submit(env, tmp_path, cfg, *sbatch_args, ranks_per_node=2, **knobs):
    # submitted from the checkout, as a user does: the job finds its .venv there (SLURM_SUBMIT_DIR)
    out = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", *sbatch_args, SBATCH, str(cfg)],
        env=dict(env, RANKS_PER_NODE=str(ranks_per_node), **knobs),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return out.stdout.strip().split(";")[0]


def job_field(env, job, field):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    for token in out.split():
        if token.startswith(field + "="):
            return token.split("=", 1)[1]
    return None


def wait_state(env, job, states, timeout=400):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_field(env, job, "JobState")
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} not in {states} after {timeout} s (now {job_field(env, job, 'JobState')})")


def job_log(tmp_path, job):
    path = tmp_path / f"dsgrpo-{job}.out"
    # both ranks write progress bars (multi-byte block characters) into one file: bytes can interleave
    return path.read_text(errors="replace") if path.exists() else f"(no log {path})"


def steps(run_dir):
    return [json.loads(l)["step"] for l in open(run_dir / "metrics.jsonl") if l.strip() and "reward" in json.loads(l)]


def test_one_node_job_trains_and_exports(slurm, tmp_path):
    # a newcomer's environment: PYTHON unset and the .venv not on PATH; the job uses the checkout's .venv
    env = dict(slurm, PATH="/usr/local/bin:/usr/bin:/bin")
    env.pop("PYTHON", None)
    job = submit(env, tmp_path, config(tmp_path), "--nodes=1")
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_log(tmp_path, job)[-3000:]
    log = job_log(tmp_path, job)
    venv_python = os.path.join(REPO, ".venv", "bin", "python")
    if os.path.realpath(sys.executable) == os.path.realpath(venv_python):
        assert log.splitlines()[0] == f"=== python {venv_python} (from the checkout's .venv)", log[:500]
    assert (
        "=== command: srun --nodes=1 --relative=0 --ntasks-per-node=2" in log
        and "=== config" in log
        and "max_steps: 4" in log
    )
    assert steps(tmp_path / "run") == [1, 2, 3, 4]
    assert (tmp_path / "run" / "model.safetensors").exists() and (tmp_path / "run" / "config.json").exists()


def test_two_node_job_forms_one_world(slurm, tmp_path):
    job = submit(slurm, tmp_path, config(tmp_path), "--nodes=2", ranks_per_node=1)
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_log(tmp_path, job)[-3000:]
    state = json.load(open(tmp_path / "run" / "checkpoint-4" / "trainer_state.json"))
    assert state["identity"]["world_size"] == 2
    assert job_field(slurm, job, "NodeList") == "node[1-2]"
    assert steps(tmp_path / "run") == [1, 2, 3, 4]


def test_one_node_serves_vllm_and_the_other_trains(slurm, tmp_path):
    job = submit(
        slurm,
        tmp_path,
        config(tmp_path),
        "--nodes=2",
        SERVER_NODES="1",
        SERVER_ARGS=f"--kv-cache-bytes {32 * 2**20}",
        DSGRPO_VLLM_TOKEN="tok-7f3a9c",
    )
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_log(tmp_path, job)[-3000:]
    log = job_log(tmp_path, job)
    assert "=== server on node1" in log and "dsgrpo vllm-serve: serving" in log
    assert "--vllm_mode server --vllm_server_host node1" in log and "vLLM server at http://node1:" in log
    assert "tok-7f3a9c" not in log  # the server binds 0.0.0.0 with the token, which stays out of the log
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "reward" in line]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sampling/sampling_logp_difference/max"] <= 1e-4 for r in rows)  # the server follows each push
    state = json.load(open(tmp_path / "run" / "checkpoint-4" / "trainer_state.json"))
    assert state["identity"]["world_size"] == 2  # both training ranks on node2; the server is no rank of theirs


def test_preempted_job_checkpoints_requeues_and_resumes(slurm, tmp_path):
    cfg = config(tmp_path, max_steps=20, save_steps=100)  # long enough that the signal lands mid-run
    job = submit(slurm, tmp_path, cfg, "--nodes=1")
    run = tmp_path / "run"
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(steps(run)) >= 2):
        assert time.time() < deadline, "the job never started training"
        time.sleep(0.5)
    # what Slurm's --signal=B:USR1@T does before the time limit
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    deadline = time.time() + 300
    while job_field(slurm, job, "Restarts") in (None, "0"):
        assert time.time() < deadline, f"never requeued: {job_log(tmp_path, job)[-3000:]}"
        time.sleep(0.5)
    # Skip most of the 120 s requeue hold, not all of it: slurmd revokes the old run's credential with a
    # whole-second timestamp, and a relaunch within that same second is killed as "Job credential revoked".
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"], env=slurm)
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_log(tmp_path, job)[-3000:]
    log = job_log(tmp_path, job)
    assert "USR1 received" in log and "requeueing job" in log and "(restart 1/3)" in log
    assert "resumed from" in log  # the second run continued, it did not restart
    assert steps(run) == list(range(1, 21))  # the configured step count, each step once


def test_train_sh_runs_the_demo_config_on_two_cpu_ranks(tmp_path):
    from dsgrpo.testing import tiny_model

    env = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        PYTHONPATH=REPO,
        MASTER_PORT=str(29700 + os.getpid() % 200),
        DEEPSPEED_TIMEOUT="3",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "launch_scripts", "train.sh"),
            "examples/cpu_demo.yaml",
            "--model",
            tiny_model("qwen2"),
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--output_dir",
            str(tmp_path / "demo"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NUM_PROCS=2" in proc.stdout + proc.stderr
    assert steps(tmp_path / "demo") == [1, 2, 3]
    assert "learning curve" in proc.stdout


def test_train_sh_gives_its_ranks_the_visible_devices_and_its_sigterm(tmp_path):
    """On one node train.sh execs the deepspeed launcher's node process (the runner it replaced did neither): the
    ranks get the devices CUDA_VISIBLE_DEVICES names, and a SIGTERM to train.sh (a scheduler's, a Ctrl-C's) ends
    every rank in seconds."""
    import signal
    import threading

    import psutil

    from dsgrpo.testing import tiny_model

    env = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        PYTHONPATH=REPO,
        MASTER_PORT=str(29500 + os.getpid() % 190),
        DEEPSPEED_TIMEOUT="3",
        CUDA_VISIBLE_DEVICES="5,7",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [
            "bash",
            os.path.join(REPO, "launch_scripts", "train.sh"),
            "examples/cpu_demo.yaml",
            "--model",
            tiny_model("qwen2"),
            "--max_steps",
            "1000",
            "--logging_steps",
            "1",
            "--output_dir",
            str(tmp_path / "demo"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        while not any(line.startswith("step 2/") for line in list(lines)) and time.time() < deadline:
            assert proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if any(a.startswith("--local_rank=") for a in p.cmdline())
        ]
        assert len(ranks) == 2, "".join(lines)[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, [r.cmdline() for r in alive]
    finally:
        try:  # whatever is left of the launch (its own session): a failed run must not outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=10)
    assert "Setting CUDA_VISIBLE_DEVICES=5,7" in "".join(lines)


def test_a_rank_killed_under_srun_is_named_and_the_job_fails_in_bounded_time(slurm, tmp_path):
    """No launcher kills the survivors under srun: rank 0 must notice rank 1's death by itself, name it and the
    phase, and exit (3), so the job fails instead of hanging until its time limit."""
    import re
    from datetime import datetime

    env = {k: v for k, v in slurm.items() if k != "DEEPSPEED_TIMEOUT"}  # ddp_timeout decides
    cfg = config(tmp_path, reward_funcs=["fault_rewards:digits_or_fault"], ddp_timeout=30, save_steps=1)
    job = submit(
        env,
        tmp_path,
        cfg,
        "--nodes=1",
        PYTHONPATH=f"{REPO}:{REPO}/tests/dist_scripts",
        FAULT_RANK="1",
        FAULT_STEP="2",
        FAULT_SIGNAL="KILL",
    )
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "FAILED", job_log(tmp_path, job)[-3000:]
    log = job_log(tmp_path, job)
    fault = re.search(r"FAULT rank 1 SIGKILL in reward at step 2 t=([\d.]+)", log)
    assert fault, log[-3000:]
    said = re.search(
        r"^0: dsgrpo: error: (lost rank 1 \(pid \d+ on \S+\) in phase 'reward' at step 2: the process "
        r"is gone \(killed or crashed\).*)$",
        log,
        re.M,
    )
    assert said, log[-3000:]
    ended = datetime.strptime(job_field(slurm, job, "EndTime"), "%Y-%m-%dT%H:%M:%S").timestamp()
    assert ended - float(fault.group(1)) <= 2 * 30, (ended - float(fault.group(1)), said.group(1))
    assert "=== finished with exit code" in log and "exit code 0" not in log
    assert (tmp_path / "run" / "latest").read_text().strip() == "checkpoint-2"
