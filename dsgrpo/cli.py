"""`dsgrpo train CONFIG.yaml [--key value ...]`.

The YAML holds GRPOConfig fields plus the run's inputs (RUN_KEYS): the model, the datasets and the reward
functions. `--key value` overrides either kind. Under `deepspeed` (which appends --local_rank=N) or torchrun
every rank runs the same command; plain `dsgrpo train` runs a world of one.

A configuration or input error (an unknown key, a missing file, a dataset without a prompt column, bad YAML, a
checkpoint that cannot continue the run) is reported as one `dsgrpo: error: ...` block by rank 0 alone, with
exit code 2 and no traceback; `--debug` or DSGRPO_DEBUG=1 prints the traceback on every rank as well."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from .config import GRPOConfig, load_yaml_mapping, parse_cli_overrides
from .errors import CheckpointError
from .importing import import_object
from .watchdog import RANK_LOST_EXIT_CODE, RankLostError

RUN_KEYS = {
    "model": "Hub id or local path of the policy.",
    "train_dataset": "A .jsonl/.json/.parquet file, a hub id (cached), or 'task:NAME[:ARG]' for a built-in task "
    "(task:copy_digits, task:gsm8k, task:gsm8k:path/to/train.jsonl).",
    "eval_dataset": "Same forms as train_dataset (optional).",
    "reward_funcs": "List of reward sources: 'package.module:function', a built-in name (accuracy_reward, ...), "
    "a reward-model path / hub id, or {remote: URL, timeout: S, retries: N, token: T}.",
    "dataset_split": "Split to read when a dataset is a hub id (default 'train').",
    "trainer": "'grpo' (GRPOTrainer, the default) or 'async' (AsyncGRPOTrainer: background, load-balanced rollouts).",
    "environment_factory": "TRL's environment_factory: 'package.module:Class' (one instance per rollout; its public "
    "methods are the tools), or {name: 'module:Class'} picked by the dataset's 'environment' "
    "column. reward_funcs may then be left out when the environment has get_reward().",
    "environment": "An environment of another ecosystem, run in an env host of its own Python (issue 66): "
    "'verifiers:TASKSET_MODULE' (a verifiers v1 taskset) or 'python:MODULE:FUNCTION'. train_dataset defaults to "
    "its rows, reward_funcs to its reward (agent_reward).",
    "environment_host": "Options of the env host: {paths: [...], requirements: FILE, python: PATH, "
    "start_timeout_s: S, max_restarts: N, max_concurrent: N, timeout_s: S}.",
    "peft_config": "Train a LoRA adapter: peft.LoraConfig's fields, e.g. "
    "{r: 16, lora_alpha: 32, target_modules: all-linear}.",
    "quantization_config": "QLoRA: load the policy 4- or 8-bit with bitsandbytes (needs peft_config): "
    "BitsAndBytesConfig's fields, e.g. {load_in_4bit: true, bnb_4bit_quant_type: nf4, bnb_4bit_use_double_quant: "
    "true}.",
}
TRAINERS = ("grpo", "async")


def split_config(values: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    run = {k: values[k] for k in values if k in RUN_KEYS}
    rest = {k: v for k, v in values.items() if k not in RUN_KEYS}
    return run, rest


def load_run_config(path: str, overrides: List[str]) -> Tuple[Dict[str, Any], GRPOConfig]:
    values = load_yaml_mapping(path)
    values.update(parse_cli_overrides(overrides, extra_keys=tuple(RUN_KEYS)))
    run, rest = split_config(values)
    hosted = "environment" in run  # the env host gives the rows and the reward
    needed = ("model",) + (() if hosted else ("train_dataset",))
    needed += () if hosted or "environment_factory" in run else ("reward_funcs",)
    for key in needed:
        if key not in run:
            raise ValueError(f"{path}: missing '{key}' ({RUN_KEYS[key]})")
    return run, GRPOConfig.from_dict(rest)


def reward_source(spec):
    """A YAML reward entry → what GRPOTrainer accepts."""
    if isinstance(spec, dict) and "remote" in spec:
        from .rewards import RemoteReward

        return RemoteReward(spec["remote"], **{k: v for k, v in spec.items() if k != "remote"})
    if isinstance(spec, str) and ":" in spec and not spec.startswith((".", "/")):
        return import_object(spec)
    return spec  # a built-in name or a reward-model path: the reward stack resolves it


def environment_factory(spec):
    """A YAML environment_factory ('module:Class', or {name: 'module:Class'}) → what GRPOTrainer accepts."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {name: environment_factory(entry) for name, entry in spec.items()}
    if not (isinstance(spec, str) and ":" in spec):
        raise ValueError(
            f"environment_factory: {spec!r} is not 'package.module:Class' (or a mapping of names to "
            "those); write the import path of the environment's class or factory function."
        )
    return import_object(spec, "environment_factory")


def build_dataset(spec, split: str):
    if spec is None:
        return None
    if isinstance(spec, str) and spec.startswith("task:"):  # task:NAME or task:NAME:ARGUMENT
        from .tasks import TASKS

        name, _, argument = spec[len("task:") :].partition(":")
        if name not in TASKS:
            raise ValueError(f"Unknown task {name!r}; known: {sorted(TASKS)}.")
        return TASKS[name](argument) if argument else TASKS[name]()
    from .data import load_dataset_spec

    return load_dataset_spec(spec, split)


def check_model_exists(run: Dict[str, Any]) -> None:
    """A local model path that is not there fails now; when the run trains a built-in task that has a warm-up
    model (the CPU demo's), the message says how to build it."""
    from .engines.builder import check_model_source
    from .tasks import WARMUP_TASKS

    model = run["model"]
    if not isinstance(model, str):
        return
    try:
        check_model_source(model)
    except FileNotFoundError as exc:
        spec = run.get("train_dataset")
        task = spec[len("task:") :].partition(":")[0] if isinstance(spec, str) and spec.startswith("task:") else None
        if task not in WARMUP_TASKS:
            raise
        python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
        which = "`make demo`" if task == "copy_digits" else "the example"
        raise FileNotFoundError(
            f"{exc}\nIt is the warm-up model of task:{task} (what {which} builds first). "
            f"Build it with:\n    {python} -m dsgrpo.tasks warmup --task {task} --out {model}"
        ) from None


def train(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsgrpo train", description="Train with GRPO from a YAML config.")
    parser.add_argument("config")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    known, overrides = parser.parse_known_args(argv)
    from . import AsyncGRPOTrainer, GRPOTrainer, dist

    dist.adopt_slurm_env()  # the config validates against the world size, known from Slurm before any init
    run, args = load_run_config(known.config, overrides)
    check_model_exists(run)
    from .logging import learning_curve_summary

    split = run.get("dataset_split", "train")
    funcs = run.get("reward_funcs") or []
    funcs = funcs if isinstance(funcs, list) else [funcs]
    kind = run.get("trainer", "grpo")
    if kind not in TRAINERS:
        raise ValueError(f"{known.config}: trainer={kind!r} is not one of {list(TRAINERS)}.")
    cls = AsyncGRPOTrainer if kind == "async" else GRPOTrainer
    rewards = [reward_source(f) for f in funcs] or None
    train_dataset, rollout = build_dataset(run.get("train_dataset"), split), None
    if "environment" in run:
        from . import agent_reward
        from .envhost import env_host_dataset, env_host_rollout

        rollout = env_host_rollout(run["environment"], **(run.get("environment_host") or {}))
        train_dataset = train_dataset if train_dataset is not None else env_host_dataset(rollout)
        rewards = rewards or [agent_reward]
    trainer = cls(
        run["model"],
        rewards,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=build_dataset(run.get("eval_dataset"), split),
        peft_config=run.get("peft_config"),
        quantization_config=run.get("quantization_config"),
        environment_factory=environment_factory(run.get("environment_factory")),
        rollout_func=rollout,
    )
    _computing.add("train")
    state = trainer.train()
    if dist.is_main():
        print(learning_curve_summary(state.log_history))
        print(f"Model saved to {args.output_dir}")
    return 0


def plan(argv: List[str]) -> int:
    """`dsgrpo plan CONFIG.yaml`: per-device memory of the run, from configs only (dsgrpo/plan.py)."""
    import json

    from . import plan as planner
    from .config import field_names, load_deepspeed_config

    parser = argparse.ArgumentParser(prog="dsgrpo plan", description="Predict a run's memory per device before launch.")
    parser.add_argument("config")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="Devices (ranks) per node (default: NUM_PROCS, else 8 GPUs, or 2 CPU ranks with --cpu).",
    )
    parser.add_argument("--gpu-memory", default="80GB", help="Memory of one GPU, e.g. 80GB, 24GB (default 80GB).")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="Plan for this machine's CPU ranks (--gpus-per-node of "
        "them share its memory; 2 by default, as train.sh runs).",
    )
    parser.add_argument(
        "--model-config", help="A config.json to read instead of the model's (a hub id this machine cannot reach)."
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    known, overrides = parser.parse_known_args(argv)
    known.gpus_per_node = _planned_ranks_per_node(known.gpus_per_node, known.cpu)
    values = load_yaml_mapping(known.config)
    values.update(parse_cli_overrides(overrides, extra_keys=tuple(RUN_KEYS) + ("model_name_or_path",)))
    model = values.get("model") or values.get("model_name_or_path")
    if not model and not known.model_config:
        raise ValueError(f"{known.config}: no 'model' (or TRL's model_name_or_path); or pass --model-config.")
    fields = set(field_names())
    args = planner.config_for_world(
        {k: v for k, v in values.items() if k in fields},  # script keys aside
        known.gpus_per_node * known.nodes,
    )
    model_config = planner.read_model_config(known.model_config or model, trust_remote_code=args.trust_remote_code)
    if known.cpu:
        hardware = planner.Hardware(
            known.gpus_per_node, known.nodes, planner.available_host_bytes() // known.gpus_per_node, gpu=False
        )
    else:
        hardware = planner.Hardware(known.gpus_per_node, known.nodes, planner.parse_bytes(known.gpu_memory), gpu=True)
    peft = values.get("peft_config")
    lora_config = lora_params = None
    if peft:
        from .engines.lora import as_lora_config

        lora_config = as_lora_config(peft)
        lora_params = planner.lora_parameter_count(model_config, lora_config)
    world = known.gpus_per_node * known.nodes
    asynchronous = values.get("trainer") == "async"
    from .quantization import bytes_per_weight, given

    quantised_bytes = bytes_per_weight(given(values.get("quantization_config"), args.model_init_kwargs))
    ds_spec, ref_ds_spec, auto_choice = planner.choose_deepspeed(
        args,
        model_config,
        hardware,
        world=world,
        lora_config=lora_config,
        asynchronous=asynchronous,
        quantised_bytes=quantised_bytes,
    )
    result = planner.plan(
        args,
        planner.ModelShape.from_config(model_config),
        load_deepspeed_config(ds_spec, "deepspeed", world),
        hardware,
        ref_ds_config=load_deepspeed_config(ref_ds_spec, "ref_deepspeed", world),
        lora_params=lora_params,
        asynchronous=asynchronous,
        quantised_bytes=quantised_bytes,
    )
    if auto_choice:
        result.notes.insert(0, auto_choice)
    print(json.dumps(result.to_json(), indent=2) if known.json else result.render())
    return 0 if result.fits else 1


def _planned_ranks_per_node(given: Optional[int], cpu: bool) -> int:
    """The ranks per node a plan is for: --gpus-per-node, else what launch_scripts/train.sh would start (NUM_PROCS,
    else 2 CPU ranks, or 8 GPUs), said on stderr when chosen."""
    if given is not None:
        return given
    if os.environ.get("NUM_PROCS", "").isdigit() and int(os.environ["NUM_PROCS"]) > 0:
        n, why = int(os.environ["NUM_PROCS"]), f"NUM_PROCS={os.environ['NUM_PROCS']}"
    else:
        n, why = (2, "train.sh's default on CPU") if cpu else (8, "the default; set --gpus-per-node")
    print(f"dsgrpo plan: {n} {'CPU ranks' if cpu else 'GPUs'} per node ({why}).", file=sys.stderr, flush=True)
    return n


# What a wrong config or input raises before any compute starts (and CheckpointError / MemoryPlanError at start
# of training): reported as `dsgrpo: error: <message>`, exit 2. Anything else is a crash and keeps its traceback.
INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)
USAGE_EXIT_CODE = 2
_computing: set = set()  # non-empty once a subcommand has started real work (cli.train: trainer.train())


def run_reporting_errors(command: Callable[[List[str]], int], argv: List[str]) -> int:
    """Run a subcommand; a configuration or input error becomes one `dsgrpo: error:` block on rank 0 (every
    rank parses the same config and fails the same way, so one copy is enough) and exit code 2."""
    argv = list(argv)
    debug = os.environ.get("DSGRPO_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        argv.remove("--debug")
        debug = True
    _computing.clear()
    try:
        return command(argv)
    except RankLostError as exc:  # a peer is gone: say who, then leave at once (shutdown could wait on it)
        from .process_exit import say_line

        say_line(f"dsgrpo: error: {exc}")
        sys.stdout.flush()
        os._exit(RANK_LOST_EXIT_CODE)
    except INPUT_ERRORS + _start_errors() as exc:
        if _computing and not isinstance(exc, _start_errors()):
            raise  # raised by training itself (a reward function, a kernel): a crash, with its traceback
        from . import dist

        dist.adopt_slurm_env()  # an srun task knows its rank from Slurm's variables
        if debug:
            traceback.print_exc()
        if dist.is_main():
            message = str(exc) or type(exc).__name__
            hint = "" if debug else "\n(--debug or DSGRPO_DEBUG=1 shows the traceback)"
            print(f"dsgrpo: error: {message}{hint}", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE


def _start_errors() -> tuple:
    from .plan import MemoryPlanError

    return (CheckpointError, MemoryPlanError)


def main(argv: List[str] | None = None) -> int:
    return run_reporting_errors(_dispatch, list(sys.argv[1:] if argv is None else argv))


def console_main() -> None:
    """The `dsgrpo` command: main(), then out of the process without the interpreter's teardown (process_exit)."""
    from .process_exit import leave

    leave(main())


def _dispatch(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: dsgrpo train CONFIG.yaml [--key value ...]\n"
            "       dsgrpo plan CONFIG.yaml [--gpus-per-node N --gpu-memory 80GB --nodes M | --cpu] [--json]\n"
            "       dsgrpo report RUN_DIR [RUN_DIR ...] [--out DIR]   (report.html: plots of the runs, overlaid)\n"
            "       dsgrpo export CHECKPOINT_DIR OUT_DIR [--merged]   (--merged: a LoRA run's merged model too)\n"
            "       dsgrpo serve-reward (--func MOD:FN | --builtin NAME | --model PATH) [--port P] [--token T]\n"
            "       dsgrpo vllm-serve --model M [--tensor-parallel-size N] [--data-parallel-size D] [--host H] "
            "[--port P] [--token T]   (vllm_mode='server')\n"
            "       dsgrpo env-host build NAME|REQUIREMENTS.txt   (an ecosystem's venv, ahead of its first use)"
            "\n\nRun keys:"
        )
        for k, v in RUN_KEYS.items():
            print(f"  {k:16s} {v}")
        print("\nGRPOConfig fields:")
        import dataclasses

        for f in dataclasses.fields(GRPOConfig):
            print(f"  {f.name:36s} {f.metadata.get('help', '')} (default {f.default!r})")
        return 0
    if argv[0] == "train":
        return train(argv[1:])
    if argv[0] == "env-host":
        if len(argv) != 3 or argv[1] != "build":
            print("usage: dsgrpo env-host build NAME|REQUIREMENTS.txt", file=sys.stderr)
            return 2
        from .envhost.venvs import ensure_venv

        print(f"ready: {ensure_venv(argv[2])}")
        return 0
    if argv[0] == "plan":
        return plan(argv[1:])
    if argv[0] == "report":
        from .report import main as report

        return report(argv[1:])
    if argv[0] == "export":
        merged = "--merged" in argv
        paths = [a for a in argv[1:] if a != "--merged"]
        if len(paths) != 2 or any(a.startswith("-") for a in paths):
            print("usage: dsgrpo export CHECKPOINT_DIR OUT_DIR [--merged]", file=sys.stderr)
            return 2
        from .checkpoint import export

        print(f"exported {export(paths[0], paths[1], merged=merged)}")
        return 0
    if argv[0] == "serve-reward":
        from .rewards.remote import serve_reward

        return serve_reward(argv[1:])
    if argv[0] == "vllm-serve":
        from .rollout.server import main as vllm_serve

        return vllm_serve(argv[1:])
    print(
        f"unknown command {argv[0]!r}; try `dsgrpo train CONFIG.yaml` or `dsgrpo serve-reward --help`", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
