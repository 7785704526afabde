"""`dsgrpo train` config handling and the example configs (every shipped YAML must load and validate)."""

import glob
import os

import pytest

from dsgrpo.cli import build_dataset, load_run_config, main, reward_source
from dsgrpo.rewards import RemoteReward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml"))))
def test_every_example_config_loads_and_validates(path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run, cfg = load_run_config(path, [])
    assert {"model", "train_dataset", "reward_funcs"} <= set(run)
    assert open(path).readline().startswith("#")  # each example starts by saying how to run it
    assert "launch_scripts/train.sh" in open(path).read()
    if "peft_config" in run:  # the mapping becomes the LoraConfig the trainer gets
        from dsgrpo.engines.lora import as_lora_config
        assert as_lora_config(run["peft_config"]).r == run["peft_config"]["r"]


def test_overrides_reach_run_keys_and_config_fields(tmp_path):
    run, cfg = load_run_config(os.path.join(REPO, "examples", "cpu_demo.yaml"),
                               ["--max_steps", "7", "--model=/some/where", "--train_dataset", "task:copy_digits"])
    assert cfg.max_steps == 7 and run["model"] == "/some/where"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ntrain_dataset: task:copy_digits\n")
    with pytest.raises(ValueError, match="missing 'reward_funcs'"):
        load_run_config(str(bad), [])
    with pytest.raises(ValueError, match="Did you mean 'max_steps'"):
        load_run_config(os.path.join(REPO, "examples", "cpu_demo.yaml"), ["--max_step", "3"])


def test_reward_sources_and_tasks_from_yaml():
    from dsgrpo.tasks import copy_digits_reward
    assert reward_source("dsgrpo.tasks:copy_digits_reward") is copy_digits_reward
    assert reward_source("accuracy_reward") == "accuracy_reward"  # resolved by the reward stack
    remote = reward_source({"remote": "http://127.0.0.1:9/score", "timeout": 3, "retries": 1})
    assert isinstance(remote, RemoteReward) and remote.timeout == 3
    data = build_dataset("task:copy_digits", "train")
    assert len(data) == 512 and set(data.column_names) == {"prompt", "answer"}
    with pytest.raises(ValueError, match="Unknown task 'nope'"):
        build_dataset("task:nope", "train")


def test_gsm8k_task_from_the_shared_files():
    path = os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl")
    if not os.path.exists(path):
        pytest.skip("shared/data/gsm8k not beside the repo")
    data = build_dataset(f"task:gsm8k:{path}", "train")
    assert len(data) == 1319 and data[0]["prompt"][1]["role"] == "user" and "####" in data[0]["solution"]


def test_help_lists_fields(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "num_generations" in out and "serve-reward" in out


@pytest.mark.slow
def test_dsgrpo_train_runs_a_world_of_one(tmp_path):
    import json
    import subprocess
    import sys

    from dsgrpo.testing import tiny_model
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {tiny_model('qwen2')}\ntrain_dataset: task:copy_digits\n"
                   "reward_funcs: [dsgrpo.tasks:copy_digits_reward]\nmax_steps: 2\nper_device_train_batch_size: 4\n"
                   "num_generations: 2\nmax_completion_length: 4\nuse_vllm: false\ngradient_checkpointing: false\n"
                   "logging_steps: 1\n")
    script = os.path.join(os.path.dirname(sys.executable), "dsgrpo")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([script, "train", str(cfg), "--output_dir", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "learning curve" in proc.stdout and "Model saved to" in proc.stdout
    lines = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
    assert [l["step"] for l in lines if "reward" in l] == [1, 2]
    assert "train_runtime" in lines[-1] and "train_loss" in lines[-1]  # transformers' summary row, last
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "resolved_config.yaml").exists()
