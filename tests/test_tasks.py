"""The demo's task (dsgrpo/tasks.py): its held-out set, its reward, and the state its warm-up leaves the model in —
what makes the demo a sharpening run (issue 54) rather than a search. The environment example's Door: its rules,
its warm-up's episodes replayed against it, and the warm-up's loss pieces."""

import json
import os

import pytest

from dsgrpo import tasks


def test_the_held_out_numbers_are_distinct_and_never_in_the_training_set():
    train = set(tasks.copy_digits_dataset()["answer"])
    held = list(tasks.copy_digits_heldout()["answer"])
    assert len(held) == 200 == len(set(held)) and not set(held) & train
    assert all(len(x) == 3 and x.isdigit() for x in held)
    assert held == list(tasks.copy_digits_heldout()["answer"])  # the same set every time
    with pytest.raises(ValueError, match="only 1 3-digit|ask for fewer"):
        tasks.copy_digits_heldout(10**3)


def test_the_warm_ups_wrong_answer_scores_nothing():
    assert tasks.off_by_one("384") == "495" and tasks.off_by_one("909") == "010"
    assert tasks.copy_digits_reward(["495", "384", "394", "no"], ["384"] * 4) == [0.0, 1.0, 2 / 3, 0.0]


@pytest.mark.slow
def test_the_warm_up_leaves_a_model_that_copies_sometimes_and_never_greedily(tmp_path, monkeypatch, capsys):
    """About one digit in five right when sampled, none greedily (its greedy answer is the off-by-one); the CLI keeps
    a model built by the same recipe and rebuilds one built by another."""
    out = str(tmp_path / "init")
    assert tasks.main(["warmup", "--out", out]) == 0
    start = tasks.evaluate_copy(out, n=100)
    assert start["greedy_pass@1"] <= 0.02 and start["greedy_reward"] <= 0.05, start
    assert 0.08 <= start["sampled_reward"] <= 0.35, start
    with open(os.path.join(out, "warmup.json")) as fh:
        assert json.load(fh) == tasks.WARMUP_RECIPE
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    assert tasks.main(["warmup", "--out", out]) == 0  # same recipe: kept
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp
    built = []
    monkeypatch.setattr(tasks, "copy_warmup", lambda base, out, **kw: built.append(kw))
    os.remove(os.path.join(out, "warmup.json"))  # an older demo's model (no recipe): rebuilt
    assert tasks.main(["warmup", "--out", out]) == 0
    assert built == [{}] and "another warm-up recipe" in capsys.readouterr().out  # {}: the recipe as it is


# ------------------------------------------------------------------------------------ the environment example
def play(locked, calls):
    door = tasks.Door()
    observation = door.reset(locked=locked, prompt=[])  # reset takes the whole row
    answers = [getattr(door, name)() for name in calls]
    return observation, answers, door.get_reward()


def test_the_door_keeps_its_state_across_calls_and_rewards_no_wasted_call():
    assert play(True, ["unlock", "walk_through"]) == (" The door is locked.", ["unlocked", "you are through"], 1.0)
    assert play(True, ["walk_through"]) == (" The door is locked.", ["the door is locked"], 0.0)
    assert play(True, ["walk_through", "unlock", "walk_through"])[2] == 0.0  # through, one call wasted
    assert play(False, ["walk_through"]) == (" The door is open.", ["you are through"], 1.0)
    assert play(False, ["unlock", "walk_through"])[2] == 0.0
    assert play(False, [])[2] == 0.0 and play(True, ["unlock"])[2] == 0.0  # never through
    rows = tasks.door_dataset()
    assert len(rows) == 512 and 0.4 < sum(rows["locked"]) / 512 < 0.6
    assert rows[0]["prompt"] == [{"role": "user", "content": tasks.DOOR_PROMPT}]


@pytest.mark.parametrize("locked", [True, False])
def test_the_warm_ups_episodes_score_what_they_teach(locked):
    """Replayed against a Door, the right episode scores 1 and the usual mistake 0: the warm-up's mixture starts the
    run near its share of right episodes, and only reading the prompt lifts it."""
    for right, reward in ((True, 1.0), (False, 0.0)):
        messages = tasks.door_transcript(locked, right)
        calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
        observation, answers, got = play(locked, calls)
        assert got == reward and messages[0]["content"] == tasks.DOOR_PROMPT + observation
        assert [m["content"] for m in messages if m["role"] == "tool"] == answers
        assert messages[-1] == {"role": "assistant", "content": "Done."}


def test_the_warm_up_trains_the_assistants_turns_only_on_the_templates_tokens():
    from transformers import AutoTokenizer

    from dsgrpo.rollout.tools import tool_schemas
    from dsgrpo.testing import tiny_model

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    door = tasks.Door()
    schemas = tool_schemas([door.unlock, door.walk_through])
    messages = tasks.door_transcript(True, True)
    ids, labels = tasks.assistant_only(tok, messages, schemas)
    assert len(ids) == len(labels)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tools=schemas, tokenize=False)
    trained = tok.decode([i for i, y in zip(ids, labels) if y != -100])
    assert trained.count("<tool_call>") == 2 and trained.count("<|im_end|>") == 3 and "Done." in trained
    assert "tool_response" not in trained and "locked" not in trained and "unlocked" not in trained
    # the prompt's system turn lists both tools and is never trained
    head = tok.apply_chat_template(messages[:1], tools=schemas, tokenize=False, add_generation_prompt=True)
    assert '"walk_through"' in head and all(y == -100 for y in labels[: len(tok(head)["input_ids"])])


def test_the_shared_prompt_runs_once_with_the_same_loss_and_gradients(monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsgrpo.rollout.tools import tool_schemas
    from dsgrpo.testing import tiny_model

    path = tiny_model("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    door = tasks.Door()
    schemas = tool_schemas([door.unlock, door.walk_through])
    ids, labels = zip(
        *(tasks.assistant_only(tok, tasks.door_transcript(k % 2 == 0, k % 3 == 0), schemas) for k in range(5))
    )

    def loss_and_grad():
        model.zero_grad()
        loss = tasks._causal_lm_loss(model, tok.pad_token_id, ids, labels)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(kw["input_ids"].shape) or forward(*a, **kw))
    shared, shared_grad = loss_and_grad()
    assert len(calls) == 2 and calls[0][0] == 1 and calls[0][1] >= tasks.SHARED_PREFIX_MIN  # the prompt ran once
    monkeypatch.setattr(tasks, "SHARED_PREFIX_MIN", 10**9)
    plain, plain_grad = loss_and_grad()
    assert len(calls) == 3
    assert abs(shared - plain) < 1e-5 and torch.allclose(shared_grad, plain_grad, atol=1e-6, rtol=1e-4)


def test_reasoning_gym_tasks_are_made_here_and_scored_by_their_own_scorers():
    """task:reasoning_gym:NAME[,NAME] (issue 66): reasoning-gym generates the rows locally, under its own system
    prompt; reasoning_gym_reward scores the <answer> with the task's own scorer (from the row's entry)."""
    from dsgrpo.cli import build_dataset
    from dsgrpo.rewards import BUILTIN_REWARDS

    rows = build_dataset("task:reasoning_gym:basic_arithmetic,leg_counting", "train")
    assert (
        len(rows) == 512 and rows[0]["prompt"][0]["role"] == "system" and "<answer>" in rows[0]["prompt"][0]["content"]
    )
    sources = [json.loads(e)["metadata"]["source_dataset"] for e in rows["reasoning_gym_entry"][:4]]
    assert sources == ["basic_arithmetic", "leg_counting"] * 2  # the names in turn
    reward = BUILTIN_REWARDS.get("reasoning_gym_reward")
    entries = rows["reasoning_gym_entry"][:4]
    right = [[{"role": "assistant", "content": f"Thinking.\n<answer>{a}</answer>"}] for a in rows["answer"][:4]]
    assert reward(right, entries) == [1.0] * 4
    wrong = ["<answer>seven</answer>", "<answer>-1</answer>", "no answer tags", ""]
    assert reward(wrong, entries) == [0.0] * 4
    with pytest.raises(ValueError, match="'no_such_task' with its defaults cannot be made"):
        build_dataset("task:reasoning_gym:no_such_task", "train")
    # answers reasoning-gym's own scorers raise on (found by feeding every task's scorer odd answers): a wrong answer
    factors = build_dataset("task:reasoning_gym:prime_factorization,coin_flip", "train")
    odd = [[{"role": "assistant", "content": "<answer>[[[[</answer>"}], "<answer>1e999999</answer>"]
    assert reward(odd, factors["reasoning_gym_entry"][:2]) == [0.0, 0.0]


def test_reasoning_gym_tasks_take_their_own_configuration():
    """`NAME(key=value, ...)` configures a task (its difficulty), values read as YAML scalars; a bad key or an
    unclosed bracket is refused by name before anything is made."""
    from dsgrpo.cli import build_dataset
    from dsgrpo.tasks import reasoning_gym_specs

    assert reasoning_gym_specs("chain_sum(min_terms=2, max_terms=2), leg_counting,x(a=true,b=0.5,c=[+, -])") == [
        ("chain_sum", {"min_terms": 2, "max_terms": 2}),
        ("leg_counting", {}),
        ("x", {"a": True, "b": 0.5, "c": ["+", "-"]}),
    ]
    rows = build_dataset("task:reasoning_gym:chain_sum(min_terms=2, max_terms=2, min_digits=1, max_digits=1)", "t")
    entries = [json.loads(e) for e in rows["reasoning_gym_entry"]]
    assert {e["metadata"]["num_terms"] for e in entries} == {2} and {e["metadata"]["num_digits"] for e in entries} == {
        1
    }
    assert all(-9 <= int(a) <= 18 for a in rows["answer"])
    for bad, says in (
        ("chain_sum(min_terms=2", "opens a bracket and does not close it"),
        ("chain_sum(2)", "'2' in 'chain_sum\\(2\\)' is not key=value"),
        ("chain_sum)", "closes a '\\)' it never opened"),
        ("chain_sum(min_terms=2)x", "has text after its '\\)'"),
        ("chain_sum(no_such_key=1)", "'chain_sum' with \\{'no_such_key': 1\\} cannot be made"),
    ):
        with pytest.raises(ValueError, match=says):
            build_dataset(f"task:reasoning_gym:{bad}", "train")


def test_reasoning_gym_system_prompt_option_and_the_examples_warm_up_rows():
    """`system_prompt=NAME|none` among the tasks picks reasoning-gym's system prompt (the example asks the question
    alone); an unknown option or prompt is refused by name. The example's warm-up answers in <answer> tags, right
    a fifth of the time and one too high otherwise, on the example's own task (its dataset and YAML agree)."""
    import random

    import yaml
    from transformers import AutoTokenizer

    from dsgrpo import tasks
    from dsgrpo.cli import build_dataset
    from dsgrpo.testing import tiny_tokenizer

    spec = "chain_sum(min_terms=2, max_terms=2, min_digits=1, max_digits=1), system_prompt=none"
    assert tasks.reasoning_gym_options(spec) == (
        "chain_sum(min_terms=2, max_terms=2, min_digits=1, max_digits=1)",
        {"system_prompt": "none"},
    )
    bare = build_dataset(f"task:reasoning_gym:{spec}", "train")
    assert [m["role"] for m in bare[0]["prompt"]] == ["user"]
    direct = build_dataset("task:reasoning_gym:chain_sum,system_prompt=direct", "train")
    assert direct[0]["prompt"][0]["content"].startswith("Answer the question directly.")
    for bad, says in (
        ("chain_sum,system_prompt=nope", "system_prompt='nope' is not one of reasoning-gym's"),
        ("chain_sum,min_terms=2", "'min_terms=2' is not a task nor an option of the dataset"),
    ):
        with pytest.raises(ValueError, match=says):
            build_dataset(f"task:reasoning_gym:{bad}", "train")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = yaml.safe_load(open(os.path.join(repo, "examples", "cpu_reasoning_gym.yaml")))
    assert example["train_dataset"] == f"task:reasoning_gym:{tasks.REASONING_GYM_TASK}"
    assert tasks.one_more("-4", "7") == "-3" and tasks.one_more("abc", "xyz") == "xyz"

    made = []
    original = tasks.supervised_warmup
    tasks.supervised_warmup = lambda model_path, out_dir, example, recipe: made.append((example, recipe))
    try:
        tasks.reasoning_gym_warmup("unused", "unused")
    finally:
        tasks.supervised_warmup = original
    (example_fn, recipe), tok = made[0], AutoTokenizer.from_pretrained(tiny_tokenizer())
    assert recipe == tasks.REASONING_GYM_WARMUP
    rng, right, n = random.Random(0), 0, 400
    for _ in range(n):
        ids, labels = example_fn(tok, rng)
        text = tok.decode(ids)
        question = text.split("problem: ")[1].split(" =")[0]
        answer = int(tok.decode([i for i, y in zip(ids, labels) if y != -100]).split("<answer>")[1].split("<")[0])
        assert "<|im_start|>system" not in text and answer - eval(question) in (0, 1)
        right += answer == eval(question)
    assert 0.12 < right / n < 0.28
