"""`GRPOConfig`: the one source of defaults for a dsgrpo run.

Field names and defaults follow TRL 1.16's `GRPOConfig` (and the `TrainingArguments` fields it uses), so a
TRL user changes an import and keeps their config. dsgrpo's own fields (DeepSpeed, the colocated vLLM engine,
weight sync) follow. YAML files and `--key value` command-line flags only override these defaults.

Validation runs once, in `__post_init__`, before any model is loaded: every error names the field, the
value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_MODES = ("colocate",)
ASYNC_PLACEMENTS = ("colocate", "split")
KL_ESTIMATORS = ("k1", "k2", "k3")
EVAL_STRATEGIES = ("no", "steps")
LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
REPORT_TO = ("none", "wandb", "jsonl")

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


@dataclass
class GRPOConfig:
    """Configuration of a GRPO run. Every field has a `help` in its metadata; `dsgrpo train --help` lists them."""

    # ------------------------------------------------------------------ output and bookkeeping
    output_dir: str = field(default="trainer_output", metadata=_help("Where checkpoints, metrics.jsonl, the resolved config and the final model go."))
    seed: int = field(default=42, metadata=_help("Seed for model init, data order and sampling."))
    logging_steps: int = field(default=10, metadata=_help("Log metrics every this many optimizer steps (TRL default 10)."))
    save_steps: int = field(default=500, metadata=_help("Save a checkpoint every this many optimizer steps."))
    save_total_limit: Optional[int] = field(default=None, metadata=_help("Keep at most this many checkpoints (None: keep all)."))
    report_to: Union[str, list] = field(default="none", metadata=_help("Metric sinks besides console and metrics.jsonl: 'none' or 'wandb' (or a list)."))
    run_name: Optional[str] = field(default=None, metadata=_help("Run name for wandb."))
    resume_from_checkpoint: Optional[str] = field(default=None, metadata=_help("Checkpoint directory to resume from."))

    # ------------------------------------------------------------------ optimisation (TrainingArguments names)
    learning_rate: float = field(default=1e-6, metadata=_help("Peak learning rate of AdamW (TRL default 1e-6)."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    adam_beta1: float = field(default=0.9, metadata=_help("AdamW beta1."))
    adam_beta2: float = field(default=0.999, metadata=_help("AdamW beta2."))
    adam_epsilon: float = field(default=1e-8, metadata=_help("AdamW epsilon."))
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm (0 disables clipping)."))
    lr_scheduler_type: str = field(default="linear", metadata=_help("Learning-rate schedule.", choices=LR_SCHEDULERS))
    warmup_ratio: float = field(default=0.0, metadata=_help("Fraction of total steps used for linear warm-up."))
    warmup_steps: int = field(default=0, metadata=_help("Warm-up steps; overrides warmup_ratio when > 0."))
    per_device_train_batch_size: int = field(default=8, metadata=_help("Completions per rank per micro-batch."))
    gradient_accumulation_steps: int = field(default=1, metadata=_help("Micro-batches per optimizer step."))
    max_steps: int = field(default=-1, metadata=_help("Total optimizer steps; -1 means num_train_epochs decides."))
    num_train_epochs: float = field(default=3.0, metadata=_help("Passes over the prompt set when max_steps is -1."))
    bf16: Optional[bool] = field(default=None, metadata=_help("bf16 weights and compute. None: True on GPU, False on CPU (CPU tests run fp32)."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Recompute activations in backward (TRL default True)."))
    eval_strategy: str = field(default="no", metadata=_help("'no' or 'steps'.", choices=EVAL_STRATEGIES))
    eval_steps: Optional[int] = field(default=None, metadata=_help("Evaluate every this many steps when eval_strategy='steps' (None: logging_steps)."))

    # ------------------------------------------------------------------ data and generation (TRL GRPOConfig)
    model_init_kwargs: Optional[dict] = field(default=None, metadata=_help("Keyword arguments for from_pretrained when the model is given by name."))
    num_generations: int = field(default=8, metadata=_help("Completions sampled per prompt (group size G)."))
    num_generations_eval: Optional[int] = field(default=None, metadata=_help("Group size at evaluation (None: num_generations)."))
    max_prompt_length: Optional[int] = field(default=None, metadata=_help("Prompts longer than this many tokens are an error (None: only the engine's context bounds them)."))
    max_completion_length: int = field(default=512, metadata=_help("Most tokens generated per completion."))
    shuffle_dataset: bool = field(default=True, metadata=_help("Shuffle the prompt set each epoch."))
    generation_batch_size: Optional[int] = field(default=None, metadata=_help("Completions generated per generation round, over all ranks. Exclusive with steps_per_generation."))
    steps_per_generation: Optional[int] = field(default=None, metadata=_help("Micro-steps one generation round feeds (default gradient_accumulation_steps). Exclusive with generation_batch_size."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature."))
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling mass, in (0, 1]."))
    top_k: Optional[int] = field(default=None, metadata=_help("Top-k sampling (None or 0 disables it)."))
    min_p: Optional[float] = field(default=None, metadata=_help("Min-p sampling, in [0, 1]."))
    repetition_penalty: float = field(default=1.0, metadata=_help("Repetition penalty (1.0 disables it)."))
    generation_kwargs: Optional[dict] = field(default=None, metadata=_help("Extra SamplingParams / GenerationConfig keyword arguments."))
    chat_template_kwargs: Optional[dict] = field(default=None, metadata=_help("Extra keyword arguments for apply_chat_template."))

    # ------------------------------------------------------------------ the objective (TRL GRPOConfig)
    beta: float = field(default=0.0, metadata=_help("KL coefficient; 0 skips the reference model entirely."))
    kl_estimator: str = field(default="k3", metadata=_help("KL estimator when beta != 0.", choices=KL_ESTIMATORS))
    num_iterations: int = field(default=1, metadata=_help("Policy updates per generated batch (mu in the GRPO paper)."))
    epsilon: float = field(default=0.2, metadata=_help("Lower clip range of the ratio."))
    epsilon_high: Optional[float] = field(default=None, metadata=_help("Upper clip range (None: epsilon). DAPO recommends 0.28."))
    delta: Optional[float] = field(default=None, metadata=_help("Two-sided clip: the ratio is capped at delta before the min (None: off)."))
    loss_type: str = field(default="dapo", metadata=_help("Loss aggregation.", choices=LOSS_TYPES))
    importance_sampling_level: str = field(default="token", metadata=_help("'token' (GRPO) or 'sequence' (GSPO) ratios.", choices=IMPORTANCE_SAMPLING_LEVELS))
    scale_rewards: Union[str, bool] = field(default="group", metadata=_help("Advantage scaling: 'group', 'batch' or 'none' (True/False accepted as TRL does).", choices=SCALE_REWARDS))
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata=_help("How several rewards become one advantage.", choices=MULTI_OBJECTIVE_AGGREGATIONS))
    reward_weights: Optional[list] = field(default=None, metadata=_help("One weight per reward function (None: all 1.0)."))
    reward_errors_as_none: bool = field(default=False, metadata=_help("Score a batch as None (no opinion) when a reward function raises, instead of stopping."))
    mask_truncated_completions: bool = field(default=False, metadata=_help("Exclude completions cut at max_completion_length from the loss."))
    top_entropy_quantile: float = field(default=1.0, metadata=_help("Train only on the top-rho quantile of tokens by entropy (1.0 keeps all)."))
    vllm_importance_sampling_correction: bool = field(default=True, metadata=_help("Correct for sampler/trainer logprob mismatch."))
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata=_help("How the sampler correction is applied.", choices=VLLM_IS_MODES))
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata=_help("Upper bound C of the sampler correction."))
    max_tool_calling_iterations: Optional[int] = field(default=None, metadata=_help("With `tools`: most rounds of tool calls per completion (None: until the model stops calling tools or max_completion_length is reached)."))
    tool_timeout_s: float = field(default=10.0, metadata=_help("With `tools`: seconds a tool call may run; a call past it is answered with an error message."))
    log_completions: bool = field(default=False, metadata=_help("Log a sample of (prompt, completion, reward) every logging step."))

    # ------------------------------------------------------------------ vLLM (TRL names)
    use_vllm: bool = field(default=True, metadata=_help("Generate with a colocated vLLM engine; False uses HF generate (slower, no extra memory)."))
    vllm_mode: str = field(default="colocate", metadata=_help("Only 'colocate' (one in-process engine per rank).", choices=VLLM_MODES))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_help("Fraction of GPU memory vLLM may take (GPU only; on CPU vllm_kv_cache_bytes bounds it)."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_help("vLLM tensor parallel size; only 1 is supported in colocate mode."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_help("Release vLLM's GPU memory while training (GPU only)."))

    # ------------------------------------------------------------------ dsgrpo's own
    deepspeed: Union[str, dict] = field(default="zero3.json", metadata=_help("Policy DeepSpeed config: a path, a file name in ds_configs/, or a dict. 'auto' values are filled from this config."))
    ref_deepspeed: Union[str, dict] = field(default="zero3_inference.json", metadata=_help("Reference-model DeepSpeed config (built only when beta != 0)."))
    vllm_kv_cache_bytes: Optional[int] = field(default=None, metadata=_help("KV-cache size per vLLM engine in bytes (None: sized from the machine, at most 1 GiB per rank on CPU)."))
    vllm_max_model_len: Optional[int] = field(default=None, metadata=_help("vLLM context length (None: max_prompt_length + max_completion_length, or the model's)."))
    weight_sync_bucket_bytes: int = field(default=64 * 2**20, metadata=_help("Bytes of parameters gathered from ZeRO-3 per weight-sync bucket."))
    save_merged_model: bool = field(default=False, metadata=_help("With `peft_config`: the final save writes the merged model (base + adapter, Hugging Face format) to output_dir/merged beside the adapter."))
    num_threads: Optional[int] = field(default=None, metadata=_help("CPU threads per rank (None: cores / local ranks)."))

    # ------------------------------------------------------------------ AsyncGRPOTrainer only
    async_placement: str = field(default="colocate", metadata=_help("'colocate': every rank trains and, in a background thread, generates the next batch; 'split': some ranks only generate, the others only train.", choices=ASYNC_PLACEMENTS))
    async_generator_ranks: Optional[int] = field(default=None, metadata=_help("'split' only: how many ranks (the highest-numbered) only generate (None: half the world)."))
    max_staleness: int = field(default=1, metadata=_help("Train on a group at most this many policy versions (weight syncs) after the one that generated it; older groups are dropped. 0 means on-policy."))
    async_load_balancing: bool = field(default=True, metadata=_help("Ranks claim prompt groups from one shared queue, so a fast rank takes work a slow one has not started; False gives each rank a fixed share."))
    async_chunk_groups: Optional[int] = field(default=None, metadata=_help("Prompt groups a rank claims and generates at once (None: a quarter of its share of a round, at least 1). Smaller balances better, larger batches vLLM better."))
    drop_zero_std_groups: bool = field(default=False, metadata=_help("DAPO dynamic sampling: discard groups whose rewards all agree and keep sampling until the batch is full of useful groups (AsyncGRPOTrainer)."))

    # ------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # Under a launcher (torchrun, deepspeed, srun wrappers) WORLD_SIZE is known before any process group
        # exists; the trainer validates again with the real world size.
        self.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))

    # -- derived values: computed, never stored, so there is one source of truth ----------------------
    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def scale_rewards_mode(self) -> str:
        if self.scale_rewards is True:
            return "group"
        if self.scale_rewards is False:
            return "none"
        return self.scale_rewards

    def resolved_steps_per_generation(self, world_size: int = 1) -> int:
        if self.generation_batch_size is not None:
            return self.generation_batch_size // (self.per_device_train_batch_size * world_size)
        return self.steps_per_generation or self.gradient_accumulation_steps

    def resolved_generation_batch_size(self, world_size: int = 1) -> int:
        """Completions per generation round, over all ranks."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return self.per_device_train_batch_size * world_size * self.resolved_steps_per_generation(world_size)

    # -- validation --------------------------------------------------------------------------------------
    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError/TypeError naming the field and the fix. Called at construction and again by the
        trainer once the world size is known."""
        self._check_types()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and not isinstance(value, bool) and value not in choices:
                if isinstance(value, list) and f.name == "report_to" and all(v in choices for v in value):
                    continue
                raise ValueError(f"{f.name}={value!r} is not one of {list(choices)}. Set {f.name} to one of them.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt to compute "
                "group-relative advantages. Set num_generations >= 2.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval={self.num_generations_eval} must be >= 1 (or None).")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "max_completion_length", "logging_steps", "save_steps", "weight_sync_bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} and steps_per_generation={self.steps_per_generation} "
                "are both set; they are two ways to say the same thing. Set only one of them.")
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            raise ValueError(f"max_steps={self.max_steps}, num_train_epochs={self.num_train_epochs}: nothing to train. "
                             "Set max_steps > 0 or num_train_epochs > 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1].")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (GRPO samples; greedy decoding gives identical groups).")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1].")
        if self.epsilon < 0 or self.effective_epsilon_high < 0:
            raise ValueError(f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high} must be >= 0.")
        if self.delta is not None and self.delta <= 1 + self.effective_epsilon_high:
            raise ValueError(f"delta={self.delta} must be > 1 + epsilon_high ({1 + self.effective_epsilon_high}); it caps "
                             "the ratio above the clip range. Raise delta or set it to None.")
        if self.vllm_importance_sampling_clip_max <= 0:
            raise ValueError(f"vllm_importance_sampling_clip_max={self.vllm_importance_sampling_clip_max} must be > 0.")
        if self.vllm_tensor_parallel_size != 1:
            raise ValueError(f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size}: colocate mode runs one engine "
                             "per rank; set vllm_tensor_parallel_size=1.")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) for w in self.reward_weights):
            raise TypeError(f"reward_weights={self.reward_weights!r} must be a list of numbers, one per reward function.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness} must be >= 0 (0 trains only on groups of the current policy).")
        if self.async_chunk_groups is not None and self.async_chunk_groups < 1:
            raise ValueError(f"async_chunk_groups={self.async_chunk_groups} must be >= 1 (or None).")
        if self.async_generator_ranks is not None and not 1 <= self.async_generator_ranks < max(2, world_size):
            raise ValueError(f"async_generator_ranks={self.async_generator_ranks} must leave at least one training rank "
                             f"and one generating rank in a world of {world_size}: set it between 1 and {world_size - 1}.")
        self._check_batch_divisibility(world_size)
        spg = self.resolved_steps_per_generation(world_size)
        if spg % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}: a generation round must feed whole optimizer steps. "
                "Make steps_per_generation (or generation_batch_size / (per_device_train_batch_size x world size)) "
                "a multiple of gradient_accumulation_steps.")

    def _check_batch_divisibility(self, world_size: int) -> None:
        per_step = self.per_device_train_batch_size * world_size
        if self.generation_batch_size is not None and self.generation_batch_size % per_step != 0:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} is not divisible by per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) x world size ({world_size}) = {per_step}. Make it a multiple of {per_step}.")
        gen_batch = self.resolved_generation_batch_size(world_size)
        if gen_batch % self.num_generations != 0:
            raise ValueError(
                f"The generation batch ({gen_batch} completions = per_device_train_batch_size {self.per_device_train_batch_size} "
                f"x world size {world_size} x steps_per_generation {self.resolved_steps_per_generation(world_size)}) is not "
                f"divisible by num_generations={self.num_generations}. Choose values whose product is a multiple of "
                f"{self.num_generations}, or change num_generations.")
        if self.num_generations_eval is not None and gen_batch % self.num_generations_eval != 0:
            raise ValueError(f"The generation batch ({gen_batch}) is not divisible by num_generations_eval="
                             f"{self.num_generations_eval}. Choose a divisor of {gen_batch}.")

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise TypeError(f"{f.name}={value!r} has type {type(value).__name__}; expected {_type_name(hints[f.name])}.")

    # -- (de)serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        """Write the resolved config as YAML (what the run really used)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            yaml.safe_dump(self.to_dict(), fh, sort_keys=False)

    @classmethod
    def from_dict(cls, values: dict) -> "GRPOConfig":
        """From YAML/CLI values: unknown keys are refused, and numbers YAML left as strings are read as numbers
        (YAML 1.1 reads `7e-4` as a string; only `7.0e-4` is a float)."""
        check_known_keys(values)
        hints = typing.get_type_hints(cls)
        return cls(**{k: _coerce_number(v, hints[k]) for k, v in values.items()})

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[list] = None) -> "GRPOConfig":
        """Load a YAML file, then apply `--key value` overrides (a list of argv strings)."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"Config file {path!r} does not exist. Pass the path of a YAML file (see examples/).")
        with open(path) as fh:
            values = yaml.safe_load(fh) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of field: value at the top level, got {type(values).__name__}.")
        values.update(parse_cli_overrides(overrides or []))
        return cls.from_dict(values)


def field_names() -> list:
    return [f.name for f in dataclasses.fields(GRPOConfig)]


def check_known_keys(values: dict) -> None:
    known = set(field_names())
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else " `dsgrpo train --help` lists the fields."
            raise ValueError(f"Unknown config key {key!r}.{hint}")


def parse_cli_overrides(argv: list, extra_keys: tuple = ()) -> dict:
    """`--key value` / `--key=value` pairs → {key: typed value}. Values are parsed as YAML scalars, so
    `--beta 0.04`, `--top_k null`, `--report_to [wandb]` and `--bf16 true` all work. `extra_keys` are accepted
    besides the GRPOConfig fields (the CLI's run keys)."""
    out: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"Expected an override of the form --key value, got {arg!r}.")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"Override --{key} has no value. Write --{key} VALUE.")
            raw = argv[i + 1]
            i += 1
        key = key.replace("-", "_")
        if key not in extra_keys:
            check_known_keys({key: None})
        out[key] = yaml.safe_load(raw)
        i += 1
    return out


# -------------------------------------------------------------------------- type checks for validation
def _coerce_number(value: Any, hint: Any) -> Any:
    if not isinstance(value, str) or _matches(value, hint):
        return value
    for number_type in (int, float):
        if _matches(number_type(0), hint):
            try:
                return number_type(value)
            except ValueError:
                continue
    return value


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def load_deepspeed_config(spec: Union[str, dict], field_name: str = "deepspeed") -> dict:
    """Resolve a DeepSpeed config given as a dict, a path, or a file name in ds_configs/ into a dict."""
    if isinstance(spec, dict):
        return json.loads(json.dumps(spec))  # a deep copy the caller may fill in
    path = spec if os.path.exists(spec) else os.path.join(DS_CONFIG_DIR, spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{field_name}={spec!r}: no such file, and no {spec!r} in {DS_CONFIG_DIR}. "
                                f"Pass a path to a DeepSpeed JSON or one of {sorted(os.listdir(DS_CONFIG_DIR))}.")
    with open(path) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field_name}={spec!r}: {path} is not valid JSON ({exc}). Fix the file.") from None
