"""`dsgrpo train` config handling and the example configs (every shipped YAML must load and validate)."""

import glob
import os

import pytest

from dsgrpo.cli import build_dataset, environment_factory, load_run_config, main, reward_source
from dsgrpo.rewards import RemoteReward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml"))))
def test_every_example_config_loads_and_validates(path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run, cfg = load_run_config(path, [])
    hosted = "environment" in run  # an env host gives the rows and the reward (issue 66)
    assert "model" in run and ("train_dataset" in run or hosted)
    assert "reward_funcs" in run or "environment_factory" in run or hosted
    if hosted:
        from dsgrpo.envhost import env_host_rollout

        rollout = env_host_rollout(run["environment"], **run.get("environment_host", {}))
        assert rollout.environment == run["environment"] and rollout.env_host is None  # started by the trainer
    assert open(path).readline().startswith("#")  # each example starts by saying how to run it
    assert "launch_scripts/train.sh" in open(path).read()
    if "peft_config" in run:  # the mapping becomes the LoraConfig the trainer gets
        from dsgrpo.engines.lora import as_lora_config

        assert as_lora_config(run["peft_config"]).r == run["peft_config"]["r"]


def test_overrides_reach_run_keys_and_config_fields(tmp_path):
    run, cfg = load_run_config(
        os.path.join(REPO, "examples", "cpu_demo.yaml"),
        ["--max_steps", "7", "--model=/some/where", "--train_dataset", "task:copy_digits"],
    )
    assert cfg.max_steps == 7 and run["model"] == "/some/where"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ntrain_dataset: task:copy_digits\n")
    with pytest.raises(ValueError, match="missing 'reward_funcs'"):
        load_run_config(str(bad), [])
    hosted = tmp_path / "hosted.yaml"
    hosted.write_text("model: x\nenvironment: verifiers:my_taskset\n")
    run, _ = load_run_config(str(hosted), [])  # neither train_dataset nor reward_funcs: the host gives both
    assert run["environment"] == "verifiers:my_taskset"
    with pytest.raises(ValueError, match="missing 'model'"):
        hosted.write_text("environment: verifiers:my_taskset\n")
        load_run_config(str(hosted), [])
    with pytest.raises(ValueError, match="Did you mean 'max_steps'"):
        load_run_config(os.path.join(REPO, "examples", "cpu_demo.yaml"), ["--max_step", "3"])
    qlora = tmp_path / "qlora.yaml"  # QLoRA from YAML: a run key, the trainer's argument (TRL's position)
    qlora.write_text(
        "model: x\ntrain_dataset: task:copy_digits\nreward_funcs: [accuracy_reward]\n"
        "peft_config: {r: 8}\nquantization_config: {load_in_4bit: true, bnb_4bit_quant_type: nf4}\n"
    )
    run, _ = load_run_config(str(qlora), [])
    assert run["quantization_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    _, cfg = load_run_config(
        str(qlora), ["--model_init_kwargs", "{quantization_config: {load_in_8bit: true}, attn_implementation: eager}"]
    )
    assert cfg.model_init_kwargs["quantization_config"] == {"load_in_8bit": True}
    kwargs = cfg.model_load_kwargs  # what every model loads with: the quantisation is the policy's alone
    assert kwargs["attn_implementation"] == "eager" and "quantization_config" not in kwargs


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


def test_an_environment_from_yaml_stands_in_for_reward_funcs(tmp_path):
    """environment_factory: 'module:Class' (or a mapping of them) becomes the factory; a config with one may leave
    reward_funcs out (its get_reward() is a reward source), one without needs them."""
    from dsgrpo.tasks import Door

    cfg = tmp_path / "env.yaml"
    cfg.write_text("model: x\ntrain_dataset: task:door\nenvironment_factory: dsgrpo.tasks:Door\n")
    run, _ = load_run_config(str(cfg), [])
    assert "reward_funcs" not in run and environment_factory(run["environment_factory"]) is Door
    assert environment_factory({"door": "dsgrpo.tasks:Door"}) == {"door": Door} and environment_factory(None) is None
    with pytest.raises(ValueError, match="environment_factory 'dsgrpo.tasks:Nope' cannot be imported"):
        environment_factory("dsgrpo.tasks:Nope")
    with pytest.raises(ValueError, match=r"'Door' is not 'package.module:Class'"):
        environment_factory("Door")
    data = build_dataset("task:door", "train")
    assert len(data) == 512 and set(data.column_names) == {"prompt", "locked"}


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


def write(path, text):
    path.write_text(text)
    return str(path)


RUN = "model: {model}\ntrain_dataset: task:copy_digits\nreward_funcs: [dsgrpo.tasks:copy_digits_reward]\n"


def test_a_configuration_error_is_one_block_on_rank_0_and_exit_2(tmp_path, capsys, monkeypatch):
    cfg = write(tmp_path / "a.yaml", RUN.format(model="/nowhere/m") + "learning_rat: 1e-5\n")
    monkeypatch.delenv("DSGRPO_DEBUG", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert err == (
        "dsgrpo: error: Unknown config key 'learning_rat'. Did you mean 'learning_rate'?\n"
        "(--debug or DSGRPO_DEBUG=1 shows the traceback)\n"
    )
    from dsgrpo import dist

    with monkeypatch.context() as m:  # every rank fails alike; one copy of the message is enough
        m.setattr(dist, "is_main", lambda: False)  # (a test before this one may have made a world of one)
        assert main(["train", cfg]) == 2
        assert capsys.readouterr().err == ""
    for argv, env in ((["train", cfg, "--debug"], None), (["train", cfg], "1")):
        if env:
            monkeypatch.setenv("DSGRPO_DEBUG", env)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):") and "check_known_keys" in err
        assert err.rstrip().endswith("dsgrpo: error: Unknown config key 'learning_rat'. Did you mean 'learning_rate'?")


def test_bad_yaml_names_file_line_and_column(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("DSGRPO_DEBUG", raising=False)
    cfg = write(tmp_path / "bad.yaml", "model: x\ntrain_dataset: [task:copy_digits\nreward_funcs: y\n")
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err.splitlines()[0]
    assert err.startswith(
        f"dsgrpo: error: {cfg}:3:13: invalid YAML: while parsing a flow sequence; expected ',' or ']'"
    ), err
    cfg = write(tmp_path / "indent.yaml", "model: x\n  beta: 0.1\n")
    assert main(["plan", cfg]) == 2
    assert f"{cfg}:2:7: invalid YAML: mapping values are not allowed here." in capsys.readouterr().err
    assert main(["train", write(tmp_path / "list.yaml", "- a\n- b\n")]) == 2
    assert "expected a mapping of field: value at the top level, got list" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "absent.yaml")]) == 2
    assert "Config file" in capsys.readouterr().err
    demo = os.path.join(REPO, "examples", "cpu_demo.yaml")
    assert main(["train", demo, "--beta", "[0.1"]) == 2
    assert "--beta '[0.1': the value is read as YAML and is not valid YAML" in capsys.readouterr().err


def test_the_demo_config_without_its_warm_up_model_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)  # where outputs/demo/init_model does not exist
    assert main(["train", os.path.join(REPO, "examples", "cpu_demo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model='outputs/demo/init_model': no such directory" in err
    assert "It is the warm-up model of task:copy_digits (what `make demo` builds first). Build it with:\n" in err
    assert "-m dsgrpo.tasks warmup --task copy_digits --out outputs/demo/init_model" in err
    # another task's missing model gets the plain message
    cfg = write(tmp_path / "g.yaml", RUN.format(model="./no/model").replace("task:copy_digits", "task:gsm8k"))
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert "model='./no/model': no such directory" in err and "warm-up" not in err


def test_an_error_raised_by_training_itself_keeps_its_traceback():
    from dsgrpo import cli

    def crashes_while_training(argv):
        cli._computing.add("train")  # what cli.train marks before trainer.train()
        raise ValueError("a reward function's own bug")

    with pytest.raises(ValueError, match="a reward function's own bug"):
        cli.run_reporting_errors(crashes_while_training, [])
    from dsgrpo.errors import CheckpointError

    def refused_at_resume(argv):
        cli._computing.add("train")
        raise CheckpointError("checkpoint-4 was written by another world size")

    assert cli.run_reporting_errors(refused_at_resume, []) == 2  # an input error, even once train() began


@pytest.mark.dist
def test_train_sh_finds_the_venv_and_reports_an_input_error_once(tmp_path):
    """A newcomer's shell: PYTHON unset, the .venv not on PATH. train.sh finds the checkout's .venv, both ranks
    start, the dataset lacks a prompt column: one error block (rank 0), exit 2, no traceback."""
    import subprocess
    import sys

    venv_python = os.path.join(REPO, ".venv", "bin", "python")
    if os.path.realpath(sys.executable) != os.path.realpath(venv_python):
        pytest.skip("the suite runs outside the checkout's .venv")
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1"}\n{"question": "2+2"}\n')
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHON", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", MASTER_PORT=str(29800 + os.getpid() % 150), DEEPSPEED_TIMEOUT="3")
    from dsgrpo.testing import tiny_model

    proc = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "launch_scripts", "train.sh"),
            "examples/cpu_demo.yaml",
            "--model",
            tiny_model("qwen2"),
            "--train_dataset",
            str(data),
            "--use_vllm",
            "false",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == f"dsgrpo train.sh: python {venv_python} (from the checkout's .venv)"
    assert proc.returncode == 2, out[-3000:]
    assert out.count("dsgrpo: error:") == 1 and "train_dataset has no 'prompt' column" in out, out[-3000:]
    assert "Traceback" not in out and "[rank" not in out


@pytest.mark.slow
def test_dsgrpo_train_runs_a_world_of_one(tmp_path):
    import json
    import subprocess
    import sys

    from dsgrpo.testing import tiny_model

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {tiny_model('qwen2')}\ntrain_dataset: task:copy_digits\n"
        "reward_funcs: [dsgrpo.tasks:copy_digits_reward]\nmax_steps: 2\nper_device_train_batch_size: 4\n"
        "num_generations: 2\nmax_completion_length: 4\nuse_vllm: false\ngradient_checkpointing: false\n"
        "logging_steps: 1\n"
    )
    script = os.path.join(os.path.dirname(sys.executable), "dsgrpo")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(
        [script, "train", str(cfg), "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "learning curve" in proc.stdout and "Model saved to" in proc.stdout
    lines = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
    assert [l["step"] for l in lines if "reward" in l] == [1, 2]
    assert "train_runtime" in lines[-1] and "train_loss" in lines[-1]  # transformers' summary row, last
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "resolved_config.yaml").exists()
