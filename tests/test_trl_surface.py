"""The TRL/TrainingArguments surface that needs no launch: the schedule (strategies, fractional steps), the
learning-rate schedules against transformers' own, callbacks, the Hub pusher's strategy (against a recording
stand-in for the Hub's API: a unit test of the pusher's own logic), model preparation, streaming prompts,
sampling overrides and the config's refusals and warnings."""

import math

import pytest
import torch

from dsgrpo import GRPOConfig
from dsgrpo.schedule import Schedule, lr_scheduler_factory, resolve_steps, warmup_steps


# ------------------------------------------------------------------------------------------------ the schedule
def test_fractional_steps_resolve_against_the_run():
    assert resolve_steps(0.1, 45) == 5  # ceil(4.5), transformers' rule
    assert resolve_steps(0.5, 1) == 1  # never 0
    assert resolve_steps(20, 45) == 20 and resolve_steps(None, 45) is None


def due_steps(args, total, rounds_per_epoch=None, steps_per_round=1):
    s = Schedule.from_args(args, total)
    out = {"log": [], "eval": [], "save": []}
    for r in range(total // steps_per_round):
        before, after = r * steps_per_round, (r + 1) * steps_per_round
        epochs = (lambda k: k // rounds_per_epoch) if rounds_per_epoch else (lambda k: 0)
        log, ev, save = s.due(before, after, epochs(r), epochs(r + 1))
        for name, flag in (("log", log), ("eval", ev), ("save", save)):
            if flag:
                out[name].append(after)
    return out


def test_strategies_steps_epoch_and_no():
    args = GRPOConfig(
        logging_steps=0.25, save_steps=0.5, eval_strategy="steps", eval_steps=3, eval_delay=4, logging_first_step=True
    )
    out = due_steps(args, 8)
    assert out["log"] == [1, 2, 4, 6, 8]  # 0.25 of 8 = every 2, the first step asked for, and the last
    assert out["save"] == [4, 8] and out["eval"] == [6]  # eval every 3, not before step 4
    args = GRPOConfig(logging_strategy="epoch", save_strategy="epoch", eval_strategy="epoch")
    out = due_steps(args, 6, rounds_per_epoch=2)  # an epoch every 2 rounds
    assert out["log"] == [2, 4, 6] and out["save"] == [2, 4, 6] and out["eval"] == [2, 4, 6]
    args = GRPOConfig(logging_strategy="no", save_strategy="no")
    assert due_steps(args, 4) == {"log": [], "eval": [], "save": []}


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("linear", {}),
        ("cosine", {}),
        ("constant_with_warmup", {}),
        ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
        ("warmup_stable_decay", {"num_decay_steps": 3}),
        ("polynomial", {"power": 2.0}),
    ],
)
def test_learning_rate_schedules_are_transformers_own(name, kwargs):
    from transformers import get_scheduler

    args = GRPOConfig(learning_rate=1e-3, lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=0.2)
    total = 10
    assert warmup_steps(args, total) == 2
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ours = lr_scheduler_factory(args, total)(ours_opt)
    ref = get_scheduler(name, ref_opt, num_warmup_steps=2, num_training_steps=total, scheduler_specific_kwargs=kwargs)
    for _ in range(total):
        assert ours.get_last_lr() == ref.get_last_lr()
        ours_opt.step(), ref_opt.step(), ours.step(), ref.step()


def test_a_schedule_missing_its_arguments_names_them():
    args = GRPOConfig(lr_scheduler_type="warmup_stable_decay")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(ValueError, match="lr_scheduler_type='warmup_stable_decay'.*lr_scheduler_kwargs"):
        lr_scheduler_factory(args, 10)(opt)


# ------------------------------------------------------------------------------------------------ config
def test_refusals_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="optim='adafactor'.*optimizers="):
        GRPOConfig(optim="adafactor")
    with pytest.raises(ValueError, match="report_to.*'comet_ml'.*silently"):
        GRPOConfig(report_to=["tensorboard", "comet_ml"])
    with pytest.raises(ValueError, match="save_steps=2.5: above 1"):
        GRPOConfig(save_steps=2.5)
    with pytest.raises(ValueError, match="clip_min=3.0 must be less than"):
        GRPOConfig(vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ValueError, match="vespo.*token_truncate"):  # sequence_mask cannot fold into its weight
        GRPOConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="bf16=True and fp16=True"):
        GRPOConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="is not one of"):
        GRPOConfig(save_strategy="best")


def test_vespo_left_unset_corrects_token_by_token_and_says_so_once(capsys):
    # TRL's own VESPO example: loss_type="vespo" and nothing else
    args = GRPOConfig(loss_type="vespo")
    assert args.vllm_importance_sampling_mode == "token_truncate"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "vllm_importance_sampling_mode='token_truncate'" in lines[0]
    assert GRPOConfig().vllm_importance_sampling_mode == "sequence_mask"  # TRL's default for every other loss
    assert (
        GRPOConfig(loss_type="vespo", vllm_importance_sampling_mode="token_mask").vllm_importance_sampling_mode
        == "token_mask"
    )
    assert capsys.readouterr().err == ""  # said only when dsgrpo chose


def test_inert_fields_warn_once_naming_the_field(capsys):
    GRPOConfig(torch_compile=True, dataloader_num_workers=4, use_liger_kernel=False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("dsgrpo: warning: torch_compile=True has no effect:")
    assert "dataloader_num_workers=4" in lines[1]
    GRPOConfig()
    assert capsys.readouterr().err == ""  # defaults never warn


def test_report_to_all_means_the_installed_sinks():
    cfg = GRPOConfig(report_to="all")
    assert cfg.report_sinks() == ["jsonl", "wandb", "tensorboard", "trackio"]  # all installed here (the lock pins them)
    assert GRPOConfig(report_to="none").report_sinks() == []


def test_report_to_a_sink_that_is_not_installed_names_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(
        ValueError,
        match=r"report_to names 'trackio' but the trackio package is not installed: "
        r"`pip install trackio`",
    ):
        GRPOConfig(report_to=["tensorboard", "trackio"])
    with pytest.raises(ValueError, match="dsgrpo has no 'mlflow' sink yet"):
        GRPOConfig(report_to="mlflow")


def test_model_load_kwargs_carry_trust_remote_code_and_leave_dtype_to_the_engines():
    cfg = GRPOConfig(
        model_init_kwargs={"attn_implementation": "eager", "torch_dtype": "bfloat16"}, trust_remote_code=True
    )
    assert cfg.model_load_kwargs == {"attn_implementation": "eager", "trust_remote_code": True}
    # the trainer says so once, naming the precision the engines use and the fix
    line = cfg.ignored_dtype(torch.float32)
    assert (
        "torch_dtype='bfloat16' is not used" in line
        and "in float32 (chosen by bf16=None" in line
        and "bf16=True" in line
    )
    assert GRPOConfig(bf16=True, model_init_kwargs={"dtype": torch.bfloat16}).ignored_dtype(torch.bfloat16) is None
    assert (
        GRPOConfig(model_init_kwargs={"dtype": "auto"})
        .ignored_dtype(torch.float32)
        .startswith("model_init_kwargs dtype='auto' is not used")
    )
    assert GRPOConfig().ignored_dtype(torch.float32) is None


def test_generation_kwargs_override_the_sampling_fields():
    from dsgrpo.rollout.base import SamplingConfig

    s = SamplingConfig.from_args(
        GRPOConfig(
            top_k=5, generation_kwargs={"top_k": 10, "max_new_tokens": 7, "num_beams": 1, "presence_penalty": 0.5}
        )
    )
    assert (s.top_k, s.max_tokens) == (10, 7)
    assert s.extra == {"num_beams": 1, "presence_penalty": 0.5}


@pytest.mark.slow
def test_only_the_keys_each_backend_knows_reach_it():
    from dsgrpo.rollout.base import SamplingConfig
    from dsgrpo.rollout.hf_generate import hf_generate_kwargs
    from dsgrpo.rollout.vllm_engine import vllm_sampling_kwargs

    s = SamplingConfig.from_args(
        GRPOConfig(generation_kwargs={"num_beams": 1, "presence_penalty": 0.5}, vllm_structured_outputs_regex="[0-9]+")
    )
    vllm = vllm_sampling_kwargs(s)
    assert vllm["presence_penalty"] == 0.5 and "num_beams" not in vllm and vllm["structured_outputs"].regex == "[0-9]+"
    assert hf_generate_kwargs(s) == {"num_beams": 1}


# ------------------------------------------------------------------------------------------------ callbacks
def test_callbacks_are_added_popped_and_removed_like_transformers():
    from dsgrpo.callbacks import CallbackHandler, TrainerControl, TrainerState

    class Recorder:
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.seen.append((state.global_step, model, optimizer, sorted(kwargs)))
            control.should_save = True
            return control

    handler = CallbackHandler([Recorder])  # a class is instantiated, as transformers does
    handler.context.update(model="M", optimizer="O")
    control = handler.fire("on_step_end", None, TrainerState(global_step=3), TrainerControl())
    cb = handler.callbacks[0]
    assert control.should_save and cb.seen == [
        (3, "M", "O", ["eval_dataloader", "lr_scheduler", "processing_class", "train_dataloader"])
    ]
    assert handler.pop(Recorder) is cb and handler.callbacks == []
    handler.add(cb)
    assert handler.pop(cb) is cb and handler.pop(cb) is None
    with pytest.raises(TypeError, match="implements none of"):
        handler.add(object())


# ------------------------------------------------------------------------------------------------ the Hub
class RecordingHub:
    """Stands in for huggingface_hub.HfApi: records what the pusher asks of it."""

    def __init__(self, fail_whoami=False):
        self.calls, self.fail_whoami = [], fail_whoami

    def whoami(self):
        if self.fail_whoami:
            raise ConnectionError("no route to host")
        return {"name": "me"}

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create", repo_id, private))

    def upload_folder(
        self, repo_id, folder_path, path_in_repo=None, commit_message=None, revision=None, ignore_patterns=None
    ):
        self.calls.append(("upload", folder_path, path_in_repo, commit_message))


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("end", [("upload", "OUT", None, "End of training")]),
        (
            "every_save",
            [("upload", "OUT", None, "Training in progress, checkpoint-2"), ("upload", "OUT", None, "End of training")],
        ),
        (
            "checkpoint",
            [
                ("upload", "OUT", None, "Training in progress, checkpoint-2"),
                ("upload", "OUT/checkpoint-2", "last-checkpoint", "Training in progress, checkpoint-2"),
                ("upload", "OUT", None, "End of training"),
            ],
        ),
        (
            "all_checkpoints",
            [
                ("upload", "OUT", None, "Training in progress, checkpoint-2"),
                ("upload", "OUT/checkpoint-2", "checkpoint-2", "Training in progress, checkpoint-2"),
                ("upload", "OUT", None, "End of training"),
            ],
        ),
    ],
)
def test_hub_strategies_push_what_transformers_pushes(strategy, expected):
    from dsgrpo.hub import HubPusher

    api = RecordingHub()
    pusher = HubPusher(
        GRPOConfig(push_to_hub=True, hub_strategy=strategy, hub_model_id="run", output_dir="OUT", hub_always_push=True),
        api=api,
    )
    pusher.check()
    written = []
    pusher.on_save("OUT/checkpoint-2", "OUT", lambda: written.append("model"))
    pusher.on_end("OUT")
    pusher.finish()
    assert api.calls[0] == ("create", "me/run", None)
    assert api.calls[1:] == expected
    assert written == ([] if strategy == "end" else ["model"])  # the model is gathered only when it is pushed


def test_an_unreachable_hub_fails_at_start_naming_the_fix():
    from dsgrpo.hub import HubError, HubPusher

    with pytest.raises(HubError, match="did not accept the token.*no route to host.*push_to_hub=False"):
        HubPusher(GRPOConfig(push_to_hub=True), api=RecordingHub(fail_whoami=True)).check()


def test_no_token_fails_at_start(monkeypatch, tmp_path):
    from dsgrpo.hub import HubError, HubPusher

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no cached login
    with pytest.raises(HubError, match="no Hub token"):
        HubPusher(GRPOConfig(push_to_hub=True)).check()


# ------------------------------------------------------------------------------------------------ models
def test_prepare_model_disables_dropout_and_computes_logits_in_fp32():
    from dsgrpo.engines.builder import prepare_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)
            self.head = torch.nn.Linear(4, 3).to(torch.bfloat16)

        def get_output_embeddings(self):
            return self.head

    m = Tiny()
    prepare_model(m, GRPOConfig(disable_dropout=True, cast_lm_head_to_fp32=True))
    assert m.drop.p == 0.0
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    out = m.head(x)
    assert out.dtype == torch.float32 and m.head.weight.dtype == torch.bfloat16  # weights untouched
    expected = torch.nn.functional.linear(x.float(), m.head.weight.float(), m.head.bias.float())
    assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------------------ streaming
class CountingTokenizer:
    """Whitespace 'tokenizer' that counts what it is asked to tokenise (streaming must not tokenise up front)."""

    chat_template = None

    def __init__(self):
        self.texts = 0

    def __call__(self, texts, add_special_tokens=True):
        self.texts += len(texts)
        return {"input_ids": [[len(w) for w in t.split()] for t in texts]}


def test_an_iterable_dataset_is_read_a_round_at_a_time():
    import datasets

    from dsgrpo.data import make_prompt_source

    rows = [{"prompt": f"p{i} " + "x " * i, "idx": i} for i in range(5)]
    stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
    tok = CountingTokenizer()
    src = make_prompt_source(stream, tok, max_prompt_length=None, context_length=None, max_completion_length=4)
    assert src.streaming and src.columns == ["idx"] and tok.texts == 0  # nothing tokenised yet
    positions = src.round_prompts(1, 3, seed=0, shuffle=True)  # round 1 of 3 prompts: positions 3, 4, 5
    assert positions == [3, 4, 5]
    prompts, columns = src.rows_for(positions, [2, 1, 1])
    assert columns["idx"] == [3, 3, 4, 0]  # position 5 wraps to the stream's start: the next epoch
    assert src.prompt_ids[4] == [2] + [1] * 4 and tok.texts == 1  # tokenised on first use
    with pytest.raises(TypeError, match="IterableDataset: it has no length"):
        len(src)
    # a resumed run starts at its round: the stream is read up to it, the same rows come out
    again = make_prompt_source(
        stream, CountingTokenizer(), max_prompt_length=None, context_length=None, max_completion_length=4
    )
    assert again.round_prompts(1, 3, seed=0, shuffle=True) == positions
    assert again.rows_for(positions, [1, 1, 1])[1]["idx"] == [3, 4, 0]


def test_streaming_needs_max_steps_and_no_epoch_strategies():
    from dsgrpo.preflight import streaming_limits

    with pytest.raises(ValueError, match="set max_steps"):
        streaming_limits(GRPOConfig())
    with pytest.raises(ValueError, match="save_strategy='epoch'"):
        streaming_limits(GRPOConfig(max_steps=3, save_strategy="epoch"))
    streaming_limits(GRPOConfig(max_steps=3))


# ------------------------------------------------------------------------------------------------ rewards
def test_reward_functions_that_ask_for_it_get_the_trainer_state():
    from dsgrpo.callbacks import TrainerState
    from dsgrpo.rewards import RewardStack

    seen = {}

    def curriculum(prompts, completions, trainer_state, **kwargs):
        seen["curriculum"] = trainer_state.global_step
        return [float(trainer_state.global_step)] * len(completions)

    def plain(prompts, completions, completion_ids):  # names neither trainer_state nor **kwargs: not given it
        return [1.0] * len(completions)

    def loose(prompts, completions, **kwargs):
        seen["loose"] = "trainer_state" in kwargs
        return [0.5] * len(completions)

    stack = RewardStack([curriculum, plain, loose])
    out = stack(["p"], ["c"], [[1]], {}, trainer_state=TrainerState(global_step=7))
    assert out.tolist() == [[7.0, 1.0, 0.5]] and seen == {"curriculum": 7, "loose": True}


def test_trls_helpers_exist_on_the_trainer():
    from unittest.mock import Mock

    from dsgrpo.trainer import GRPOTrainer

    ent = torch.tensor([[0.1, 0.9, 0.5, 0.3]])
    mask = torch.ones(1, 4)
    # TRL: tokens at or above the 0.5 quantile of the active entropies (0.4 here); an instance method, which TRL's
    # tests call on a stand-in trainer (in a world of one the quantile is over this process's tokens)
    assert GRPOTrainer.get_high_entropy_mask(Mock(spec=GRPOTrainer), ent, mask, 0.5).tolist() == [
        [False, True, True, False]
    ]
    assert GRPOTrainer.get_high_entropy_mask(Mock(), ent, torch.zeros(1, 4), 0.5).tolist() == [[False] * 4]
    adv, logp = torch.tensor([[-1.0]]), torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    assert GRPOTrainer.get_off_policy_mask(adv, logp, logp + 1.0, mask, 0.5).tolist() == [[0.0]]
    # TRL's gate σ(τ(w - 1))·4/τ: 2 at w = 1, τ = 1; 4/(1 + e^-1) at w = 2 (the loss is -gate·A)
    assert torch.allclose(GRPOTrainer.get_sapo_token_loss(torch.ones(1, 1), 1.0), torch.tensor([[2.0]]))
    assert torch.allclose(
        GRPOTrainer.get_sapo_token_loss(torch.full((1, 1), 2.0), 1.0), torch.tensor([[4 / (1 + math.exp(-1.0))]])
    )
    phi = GRPOTrainer.get_gamma_weights(torch.ones(1, 1), torch.zeros(1, 4), mask, None)
    assert torch.allclose(phi, torch.ones(1, 1))  # φ(1) = 1


def test_the_learning_alarm():
    from dsgrpo.update import learning_alarm

    assert (
        learning_alarm({"sampling/sampling_logp_difference/mean": 1e-5, "sampling/importance_sampling_ratio/mean": 1.0})
        is None
    )
    line = learning_alarm(
        {"sampling/sampling_logp_difference/mean": 7.3, "sampling/importance_sampling_ratio/mean": 1e-9}
    )
    assert "7.30 nats" in line and "barely learning" in line
    assert "mean weight is 0.05" in learning_alarm({"sampling/importance_sampling_ratio/mean": 0.05})


def test_all_none_rewards_warn_and_processing_classes_are_checked(caplog):
    from dsgrpo.rewards import RewardStack

    stack = RewardStack(
        [lambda prompts, completions, **kw: [None, 1.0], lambda prompts, completions, **kw: [None, None]]
    )
    with caplog.at_level("WARNING"):  # TRL's words, through a logger (TRL's tests read them with caplog)
        stack(["p0", "p1"], ["c0", "c1"], [[1], [2]], {"idx": [7, 8]})
    assert (
        "All reward functions returned None for the following kwargs: {'prompt': 'p0', 'completion': 'c0', "
        "'idx': 7} (1 of 2 completions get no reward)" in caplog.text
    )
    assert stack.processing_classes == [None, None]
    with pytest.raises(
        ValueError, match=r"reward processing classes \(1\) must match the number of reward functions \(2\)"
    ):
        RewardStack([lambda p, c, **k: [0.0], lambda p, c, **k: [0.0]], reward_processing_classes="tok")  # as TRL
    with pytest.raises(
        ValueError, match=r"reward processing classes \(1\) must match the number of reward functions \(2\)"
    ):
        RewardStack([lambda p, c, **k: [0.0], lambda p, c, **k: [0.0]], reward_processing_classes=["tok"])


def test_router_aux_coefficient_follows_trl():
    from types import SimpleNamespace

    from dsgrpo.update import router_aux_coef

    moe = SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.001)
    dense = SimpleNamespace()
    assert router_aux_coef(GRPOConfig(), moe) == 0.001  # the config's own
    assert router_aux_coef(GRPOConfig(router_aux_loss_coef=0.0), moe) == 0.0  # switched off
    assert router_aux_coef(GRPOConfig(), dense) == 0.0
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        router_aux_coef(GRPOConfig(router_aux_loss_coef=0.01), dense)
