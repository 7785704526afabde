"""Check, then build: `preflight(...)` turns what GRPOTrainer was given (model, rewards, args, datasets, tools,
environments) into a `RunPlan` — every derived setting, the chosen rollout source, the DeepSpeed configs, the memory
plan, the step counts — or one clear error, before any model loads. The trainer builds from the plan (startup.py).

What it does besides deciding, in this order (later steps rely on earlier ones):
- the process group and every rank's heartbeat (dist.init, watchdog) before anything collective;
- the Hub pusher and the vLLM server's connection, before a model loads (a refusing server fails now);
- a model given as an instance is saved once (`<output_dir>/initial_model`) so vLLM can load it;
- `<output_dir>/resolved_config.yaml`, last: only a run that passed every check writes it."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Optional

from . import checkpoint, compat, device, dist, evaluation, quantization, sequence_parallel, watchdog
from .callbacks import TrainerState
from .config import GRPOConfig
from .data import PromptSource, load_dataset_spec, make_prompt_source
from .engines import lora, resolve, routing
from .engines.export import save_hf_model
from .hub import make_pusher
from .logging import set_log_levels
from .plan import Hardware, check_at_start as check_memory_at_start, choose_deepspeed
from .rewards import RewardStack
from .timing import startup_mark
from .rollout import SamplingConfig, connect_generator
from .rollout.agents import AgentRollout
from .rollout.choice import choose_source
from .rollout.environments import Environments, check_data_source, environment_prompts
from .rollout.server_client import check_server_context
from .rollout.tools import ToolRunner
from .run_identity import deepspeed_auto_of
from .schedule import Schedule, warmup_steps
from .steps import StepPlan
from .update import router_aux_coef


@dataclass(frozen=True)
class RunPlan:
    """Everything decided about a run before anything heavy is built; GRPOTrainer keeps each field under its name."""

    args: GRPOConfig
    rollout_func: Optional[Callable]
    peft_config: Any  # LoRA settings to wrap the model with, or None
    quantization: Any  # the BitsAndBytesConfig the policy loads with (QLoRA), or None
    quantised: bool  # the policy's base is quantised (loaded so, or passed loaded in 4/8 bits): vLLM needs it first
    adapter: Optional[Dict[str, Any]]  # a LoRA policy's shape (recorded in checkpoints), or None: not LoRA
    rollout_source: type  # the source class, a variant when an option asks for one (rollout/choice.py)
    placement: Any  # which ranks train and which generate (split placement's groups made)
    world: int  # training ranks
    dtype: Any  # the engines' dtype
    hub: Any  # the Hub pusher, or None
    server: Any  # the connected vLLM server, or None (colocated)
    model_path: str  # what vLLM and the engines load
    model_config: Any
    tokenizer: Any
    environment_set: Optional[Environments]
    rewards: RewardStack  # its models are loaded later, with the engines
    tool_runner: Optional[ToolRunner]
    train_prompts: Any
    eval_prompts: Dict[str, PromptSource]
    correctness_column: Optional[str]  # pass@k's right / wrong
    resume_path: Optional[str]
    deepspeed_auto: Dict[str, Any]  # the configs "auto" chose, recorded in checkpoints
    ds_config: dict  # the policy's, resolved
    sp_size: int  # sequence parallelism
    frozen_ds_spec: Any  # the reference's and the reward models' engines
    ref_ds_config: Optional[dict]  # None: no reference engine (beta 0, or LoRA's adapters switched off)
    memory_plan: Any
    tied: bool  # input and output embeddings share their weights
    spg: int  # optimizer steps a generation round feeds
    prompts_per_round: int
    step_plan: StepPlan
    schedule: Schedule
    sampling: SamplingConfig

    def items(self):
        """(name, value) of every field, shallow (dataclasses.asdict would copy the tokenizer and the rewards)."""
        return ((f.name, getattr(self, f.name)) for f in fields(self))

    def trainer_state(self) -> TrainerState:
        """The TrainerState callbacks read from the start: the run's length, its schedule and this rank's place."""
        return TrainerState(
            max_steps=self.step_plan.max_steps,
            is_world_process_zero=dist.is_main(),
            is_local_process_zero=dist.local_rank() == 0,
            logging_steps=self.schedule.logging_every,
            save_steps=self.schedule.save_every,
            eval_steps=self.schedule.eval_every,
            train_batch_size=self.args.per_device_train_batch_size,
            num_train_epochs=self.args.num_train_epochs,
        )


def preflight(
    model,
    reward_funcs=None,
    args: Optional[GRPOConfig] = None,
    train_dataset=None,
    eval_dataset=None,
    processing_class=None,
    reward_processing_classes=None,
    quantization_config=None,
    peft_config=None,
    tools=None,
    rollout_func=None,
    environment_factory=None,
    *,
    rollout_source: type,
    step: Callable[[], int] = lambda: 0,
) -> RunPlan:
    """GRPOTrainer's arguments (less callbacks and optimizers) → RunPlan. `rollout_source` is the trainer's source
    class; `step` tells the watchdog the run's optimizer step."""
    return _Preflight(args or GRPOConfig(), rollout_func).run(
        model,
        reward_funcs,
        train_dataset,
        eval_dataset,
        processing_class,
        reward_processing_classes,
        quantization_config,
        peft_config,
        tools,
        environment_factory,
        rollout_source,
        step,
    )


class _Preflight:
    """The steps of `preflight`; each sets what later ones read."""

    def __init__(self, args: GRPOConfig, rollout_func):
        self.args, self.rollout_func = args, rollout_func

    def run(
        self,
        model,
        reward_funcs,
        train_dataset,
        eval_dataset,
        processing_class,
        reward_processing_classes,
        quantization_config,
        peft_config,
        tools,
        environment_factory,
        rollout_source,
        step,
    ) -> RunPlan:
        args = self.args
        adapter_config = self._model_kind(model, quantization_config, peft_config)
        self._check_rollout_func(tools, environment_factory)
        self._check_supported(args)
        check_data_source(train_dataset, environment_factory, args)
        startup_mark("argument checks")
        self._start_process(step)
        startup_mark("process group")
        if (
            args.partial_rollout
            and isinstance(self.rollout_func, AgentRollout)
            and rollout_source.generates_while_training
        ):
            raise ValueError(
                "partial_rollout=True with agent_rollout on AsyncGRPOTrainer: its worker already runs the "
                "agents beside training. Use GRPOTrainer for agents' partial rollouts, or set "
                "partial_rollout=False."
            )
        # an option may ask for a variant of it
        self.rollout_source = choose_source(args, rollout_source, self.rollout_func)
        self.placement = self.rollout_source.placement(args)  # split placement makes its process groups here
        self.world = self.placement.trainers
        args.validate(world_size=self.world)
        self.dtype = device.train_dtype(args.bf16, args.fp16)
        self.quantization = quantization.bnb_config(*self.quantization_given, self.dtype)
        self.quantised = self.quantization is not None or self.loaded_quantised
        unused_dtype = args.ignored_dtype(self.dtype)
        if unused_dtype and dist.is_main():
            print(f"dsgrpo: warning: {unused_dtype}", file=sys.stderr, flush=True)
        self.hub = make_pusher(args) if self.placement.trains else None  # a Hub that cannot take uploads fails now
        self.server = connect_generator(args)  # so does a vLLM server that is missing or refuses the token
        self.model_path, self.model_config = self._model_source(model, processing_class)
        router_aux_coef(args, self.model_config)  # router_aux_loss_coef on a dense model is refused before loading
        self.tokenizer = self._tokenizer(processing_class)
        self._rewards_and_tools(reward_funcs, reward_processing_classes, tools, environment_factory)
        self.train_prompts, self.eval_prompts = self._prompt_sources(train_dataset, eval_dataset)
        self.correctness_column = evaluation.check(args, self.rewards.names)
        checkpoint.check_best_metric(args, evaluation.metric_names(args, list(self.eval_prompts), self.rewards.names))
        self.resume_path = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir)
        self._deepspeed(adapter_config)
        self.tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        if self.resume_path:  # refuse a checkpoint this run cannot continue before anything is written
            checkpoint.check_resume(
                self.resume_path, args, self.world, self.model_config, self.adapter, self.rollout_source
            )
        self._steps()
        self.sampling = SamplingConfig.from_args(args)
        self.rollout_source.check(
            args,
            placement=self.placement,
            prompts_per_round=self.prompts_per_round,
            reward_models=self.rewards.has_models,
            evaluates=bool(self.eval_prompts) and args.eval_strategy != "no",
            streaming=self.train_prompts.streaming,
        )
        if dist.is_main():
            args.save(os.path.join(args.output_dir, "resolved_config.yaml"))
        return RunPlan(**{f.name: getattr(self, f.name) for f in fields(RunPlan)})

    # ---- the steps, in run()'s order
    def _model_kind(self, model, quantization_config, peft_config):
        """Quantization and LoRA: what the model is and how it will be wrapped. Returns the adapter's config."""
        ignored = quantization.check(model, quantization_config, self.args.model_init_kwargs, peft_config)
        # a model passed loaded is trained as it is (TRL ignores the setting then too)
        self.loaded_quantised = bool(
            getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        )
        self.quantization_given = (
            (quantization_config, self.args.model_init_kwargs) if isinstance(model, str) else (None, None)
        )
        if ignored:
            print(f"dsgrpo: warning: {ignored}", file=sys.stderr, flush=True)
        lora.check_lora_model(model, peft_config)
        self.peft_config = lora.as_lora_config(peft_config) if peft_config is not None else None
        adapter_config = self.peft_config or (
            model.peft_config[model.active_adapter] if lora.is_peft_model(model) else None
        )
        self.adapter = lora.fingerprint(adapter_config) if adapter_config is not None else None
        return adapter_config

    def _check_rollout_func(self, tools, environment_factory) -> None:
        rollout_func = self.rollout_func
        if rollout_func is None:
            return
        if not callable(rollout_func):
            raise TypeError(
                f"rollout_func must be a function (prompts, trainer) -> dict, not {type(rollout_func).__name__}."
            )
        if tools or environment_factory is not None:
            raise ValueError(
                "rollout_func replaces the trainer's generation, so the trainer cannot run `tools` or "
                "environments for it: call them inside rollout_func (and return env_mask), or drop "
                "rollout_func."
            )
        if not self.args.eval_do_sample:
            raise ValueError(
                "eval_do_sample=False makes evaluation greedy, but rollout_func generates the "
                "completions itself: sample greedily inside rollout_func, or leave eval_do_sample=True."
            )

    def _check_supported(self, args) -> None:
        """Settings GRPOConfig accepts (TRL's) that this trainer cannot act on yet: refused before anything starts."""
        if args.partial_rollout and self.rollout_func is not None and not isinstance(self.rollout_func, AgentRollout):
            raise ValueError(
                "partial_rollout=True continues completions token by token across rounds; a rollout_func "
                "makes its own (agent_rollout's agents are the exception: their episodes pause between "
                "calls). Set partial_rollout=False."
            )
        if args.use_vllm and args.vllm_mode == "server":
            if args.async_placement == "split":
                raise ValueError(
                    "async_placement='split' makes some of the trainer's ranks generate, and "
                    "vllm_mode='server' generates on the server: use async_placement='colocate' (the "
                    "default) with a server."
                )
            if args.vllm_tensor_parallel_size > 1 and dist.is_main():
                print(
                    "dsgrpo: warning: vllm_tensor_parallel_size applies to vllm_mode='colocate' (as in TRL); a "
                    "server's engine is sharded by `dsgrpo vllm-serve --tensor-parallel-size`.",
                    flush=True,
                )
        elif args.vllm_tensor_parallel_size > 1:
            if not args.use_vllm:
                raise ValueError(
                    "vllm_tensor_parallel_size > 1 shards a vLLM engine; use_vllm=False generates with "
                    "the policy itself. Set vllm_tensor_parallel_size=1."
                )
            local = dist.local_world_size()
            if local % args.vllm_tensor_parallel_size:
                raise ValueError(
                    f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: an engine's ranks must "
                    f"share a node, but this node runs {local} ranks. Choose a divisor of {local}."
                )

    def _start_process(self, step) -> None:
        """Threads, the process group, every rank's heartbeat (so a failed collective can name the rank that was
        lost and where: watchdog.py), log levels."""
        args = self.args
        device.prepare_process(dist.local_world_size(), args.num_threads)
        device.set_tf32(args.tf32)
        dist.init(timeout_s=args.ddp_timeout)
        watchdog.start(
            dist.rank(dist.EVERYONE), dist.world_size(dist.EVERYONE), step=step, lost_after_s=args.ddp_timeout
        )
        set_log_levels(args)
        if dist.is_main():
            compat.warn_if_untested()

    def _model_source(self, model, processing_class=None):
        """(path vLLM can load, model config). A PreTrainedModel (or PeftModel) instance is saved once, with its
        tokenizer, so vLLM can load it."""
        from transformers import AutoConfig, PreTrainedModel

        from .engines.builder import check_model_source

        if isinstance(model, str):
            check_model_source(model)
            try:
                return model, AutoConfig.from_pretrained(model, trust_remote_code=self.args.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise OSError(
                    f"model={model!r}: cannot read its config ({exc}). Pass a folder saved with "
                    "save_pretrained or a cached hub id."
                ) from None
        if not isinstance(model, PreTrainedModel) and not lora.is_peft_model(model):
            raise TypeError(
                f"model must be a hub id, a local path, a PreTrainedModel or a PeftModel, not {type(model).__name__}."
            )
        path = os.path.join(self.args.output_dir, "initial_model")
        tokenizer = processing_class or _tokenizer_of(model)  # every rank: an error stops them all here
        if dist.is_main():  # a PeftModel's initial weights for vLLM: its adapter merged in
            save_hf_model(model, path, self.args.weight_sync_bucket_bytes, tokenizer, gathers_on_every_rank=False)
        dist.barrier("initial model on disk before vLLM loads it", group=dist.EVERYONE)
        return path, model.config

    def _tokenizer(self, processing_class):
        from transformers import AutoTokenizer

        tok = processing_class or AutoTokenizer.from_pretrained(
            self.model_path, trust_remote_code=self.args.trust_remote_code
        )
        tok.padding_side = "left"
        if tok.pad_token is None:
            warnings.warn(f"The tokenizer has no pad token; using eos ({tok.eos_token!r}) for padding.")
            tok.pad_token = tok.eos_token
        if tok.eos_token_id is None:
            raise ValueError("The tokenizer has no eos token: completions could never end. Set tokenizer.eos_token.")
        return tok

    def _rewards_and_tools(self, reward_funcs, reward_processing_classes, tools, environment_factory) -> None:
        """Environments are probed now (reset, tools' schemas); those that own a reward add a source of weight 1."""
        args = self.args
        self.environment_set = (
            Environments(environment_factory, tools or [], args.tool_timeout_s, args.environment_reset_timeout_s)
            if environment_factory is not None
            else None
        )
        self.rewards = RewardStack(
            reward_funcs,
            args.reward_weights,
            reward_processing_classes,
            args.reward_errors_as_none,
            trust_remote_code=args.trust_remote_code,
            code_sandbox=args.code_sandbox,
            extra_sources=self.environment_set.reward_sources if self.environment_set else (),
        )
        if (
            self.environment_set is not None
            and self.rewards.has_models
            and self.rollout_source.generates_while_training
        ):
            raise NotImplementedError(
                "environment_factory with a reward model on AsyncGRPOTrainer: its rollouts are "
                "scored away from the worker that keeps their environments. Use GRPOTrainer, "
                "or reward functions (and get_reward) instead of a reward model."
            )
        self.tool_runner = (
            ToolRunner(tools, args.tool_timeout_s)  # checks the schemas now
            if tools and self.environment_set is None
            else None
        )

    def _prompt_sources(self, train_dataset, eval_dataset):
        """The training prompts (and evaluation prompts, by name), tokenised and checked against the context."""
        args = self.args
        template_kwargs = dict(args.chat_template_kwargs or {})
        if self.tool_runner is not None:
            template_kwargs["tools"] = self.tool_runner.schemas  # the chat template lists them in the prompt
        elif self.environment_set is not None:  # each rollout's prompt is rendered with its own environment's tools;
            template_kwargs["tools"] = self.environment_set.all_schemas()  # these are for the length checks
            train_dataset = environment_prompts(
                train_dataset, args.resolved_generation_batch_size(self.world) // args.num_generations
            )
        context = args.vllm_max_model_length or getattr(self.model_config, "max_position_embeddings", None)
        common = dict(
            max_prompt_length=args.max_prompt_length,
            context_length=context,
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=template_kwargs,
            keep_columns=not args.remove_unused_columns,
        )
        train = make_prompt_source(load_dataset_spec(train_dataset), self.tokenizer, **common)
        if train.streaming:
            streaming_limits(args)
        if self.environment_set is not None:
            self.environment_set.check_dataset(train)
        if (self.tool_runner is not None or self.environment_set is not None) and not train.conversational:
            raise ValueError(
                "tools need conversational prompts (lists of messages): the chat template is what shows "
                "the model the tools. Give train_dataset a 'prompt' column of message lists."
            )
        if self.server is not None:  # the server's context against the prompts it will be sent, before any load
            check_server_context(self.server.max_model_len, args, self.server.url, train.longest_prompt())
        # eval_dataset: one set, or a dict of named sets (metrics then prefixed eval_<name>_, as transformers does)
        named = (
            eval_dataset if isinstance(eval_dataset, dict) else ({"": eval_dataset} if eval_dataset is not None else {})
        )
        evaluation_sets = {
            name: PromptSource(
                materialised(load_dataset_spec(ds)),
                self.tokenizer,
                field=f"eval_dataset[{name!r}]" if name else "eval_dataset",
                **common,
            )
            for name, ds in named.items()
        }
        return train, evaluation_sets

    def _deepspeed(self, adapter_config) -> None:
        """The policy's and the frozen engines' DeepSpeed configs ("auto" chosen by the memory plan where whole
        weights fit, plan.choose_deepspeed, or kept from the checkpoint being resumed), sequence parallelism, and the
        memory plan they make."""
        args, model_config, lora_policy = self.args, self.model_config, self.adapter is not None
        ds_spec, ref_ds_spec, auto_choice = choose_deepspeed(
            args,
            model_config,
            Hardware.this_run(),
            world=self.world,
            reward_configs=self.rewards.model_configs(),
            lora_config=adapter_config,
            asynchronous=self.rollout_source.generates_while_training,
            prompt_length=self.train_prompts.longest_prompt(),
            resumed=deepspeed_auto_of(self.resume_path) if self.resume_path else None,
            quantised_bytes=quantization.bytes_per_weight(self.quantization),
        )
        self.deepspeed_auto = {
            k: v
            for k, v in (("deepspeed", ds_spec), ("ref_deepspeed", ref_ds_spec))
            if getattr(args, k) in (None, "auto")
        }
        if auto_choice and dist.is_main():
            print(f"dsgrpo: {auto_choice}", flush=True)
        hidden = getattr(model_config, "hidden_size", None)
        self.ds_config = resolve(ds_spec, args, hidden, "deepspeed", train=True, world_size=self.world)
        self.sp_size = sequence_parallel.requested_size(args, self.ds_config)
        self.ds_config.pop("sequence_parallel_size", None)  # data parallelism stays the world's (sequence_parallel.py)
        sequence_parallel.check(self.sp_size, args, self.world, model_config, split=dist.is_split())
        routing.check_replay(args, model_config, rollout_func=self.rollout_func is not None, on_gpu=device.on_gpu())
        ga = self.ds_config.get("gradient_accumulation_steps", args.gradient_accumulation_steps)
        if ga != args.gradient_accumulation_steps:
            raise ValueError(
                f"deepspeed config sets gradient_accumulation_steps={ga} but the GRPOConfig has "
                f'{args.gradient_accumulation_steps}. Set it to "auto" in the JSON.'
            )
        self.frozen_ds_spec = ref_ds_spec
        frozen_ds_config = resolve(ref_ds_spec, args, hidden, "ref_deepspeed", train=False, world_size=self.world)
        frozen_ds_config.pop("sequence_parallel_size", None)
        self.ref_ds_config = frozen_ds_config if args.beta and not lora_policy else None
        self.memory_plan = plan = check_memory_at_start(  # resolves gradient_checkpointing 'auto'
            args,
            model_config,
            self.ds_config,
            ref_ds_config=frozen_ds_config,
            reward_configs=self.rewards.model_configs(),
            lora_config=adapter_config,
            asynchronous=self.rollout_source.generates_while_training,
            world=dist.world_size(dist.EVERYONE),
            local_world=dist.local_world_size(),
            prompt_length=self.train_prompts.longest_prompt(),
            quantised_bytes=quantization.bytes_per_weight(self.quantization),
        )
        device.choose_heap_trimming(plan.peak_bytes_per_device / plan.hardware.device_bytes if plan else None)
        if args.sync_ref_model and lora_policy:
            raise ValueError(
                "sync_ref_model=True with a LoRA policy: its reference is the base model with the adapter "
                "switched off, which has nothing to mix into. Drop sync_ref_model or train without LoRA."
            )

    def _steps(self) -> None:
        """How many optimizer steps the run makes and which micro-steps each accumulates, as TRL counts (steps.py),
        and when it logs, evaluates and saves; said once on rank 0."""
        args = self.args
        self.spg = args.resolved_steps_per_generation(self.world)
        self.prompts_per_round = args.resolved_generation_batch_size(self.world) // args.num_generations
        rounds = None if self.train_prompts.streaming else self.train_prompts.rounds_per_epoch(self.prompts_per_round)
        self.step_plan = StepPlan.from_args(args, self.prompts_per_round, self.spg, rounds)
        total = self.step_plan.max_steps
        self.schedule = Schedule.from_args(args, total)
        if dist.is_main():  # the arithmetic a TRL user plans by
            rows = None if self.train_prompts.streaming else len(self.train_prompts)
            print(
                "dsgrpo: plan: "
                + self.step_plan.describe(
                    rows, args.num_generations, str(args.lr_scheduler_type), warmup_steps(args, total)
                ),
                flush=True,
            )


def _tokenizer_of(model):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.name_or_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"model is a {type(model).__name__} whose name_or_path {model.name_or_path!r} has no "
            f"tokenizer ({exc}). Pass processing_class=<its tokenizer>."
        ) from None


def streaming_limits(args) -> None:
    """An IterableDataset has no length: what needs one is refused before anything is built."""
    if args.max_steps <= 0:
        raise ValueError("train_dataset is an IterableDataset, which has no length to count epochs in: set max_steps.")
    for name in ("save_strategy", "logging_strategy", "eval_strategy"):
        if getattr(args, name) == "epoch":
            raise ValueError(f"{name}='epoch' with an IterableDataset: a stream has no epochs to count. Use 'steps'.")


def materialised(dataset):
    """An evaluation set read whole (evaluation goes over every prompt; a stream is read into a Dataset once)."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(dataset))
    return dataset
