"""`dsgrpo report` on a run with multi-turn episodes (tools, environments): the tool-health figure and the episodes
section, from the files a run writes (metrics.jsonl, completions.jsonl). No training: the files are written here."""

import json
from html.parser import HTMLParser

from dsgrpo.report import write_report


def episode(reward, answer, calls):
    messages = []
    for name, args, result in calls:
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}],
            }
        )
        messages.append({"role": "tool", "name": name, "content": result})
    messages.append({"role": "assistant", "content": answer})
    return {
        "step": 2,
        "prompt": "Guess my number.",
        "completion": answer,
        "reward": reward,
        "advantage": reward - 0.5,
        "rank": 0,
        "group": "0/0",
        "rewards": {"reward_len": None, "GuessEnv": reward},
        "messages": messages,
    }


class Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.headings, self.rewards, self._in = [], [], None

    def handle_starttag(self, tag, attrs):
        self._in = tag
        if tag == "th" and dict(attrs).get("data-reward") is not None:
            self.rewards.append(float(dict(attrs)["data-reward"]))

    def handle_data(self, data):
        if self._in == "h2":
            self.headings.append(data)


def test_episodes_are_shown_side_by_side_best_first_with_their_turns_and_tool_health(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as fh:
        for step in (1, 2):
            fh.write(
                json.dumps(
                    {
                        "step": step,
                        "reward": 0.2 * step,
                        "loss": 0.1,
                        "tools/calls_per_episode": 1.5,
                        "tools/failure_frequency": 0.25,
                        "env/errors": 0.1,
                        "env/timeouts": 0.0,
                        "env/step_s": 0.01,
                        "episode/turns": 2.5,
                        "tools/parse_failures": 0.0,
                    }
                )
                + "\n"
            )
    rows = [
        episode(0.0, "I give up.", [("guess", {"number": 3}, "higher")]),
        episode(1.0, "It is 7.", [("guess", {"number": 5}, "higher"), ("guess", {"number": 7}, "correct")]),
    ]
    with open(run / "completions.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    page = open(write_report([str(run)], str(tmp_path / "out"))).read()
    cells = Cells()
    cells.feed(page)
    assert "Tool and environment health" in cells.headings and "Episodes" in cells.headings
    assert (tmp_path / "out" / "tools.png").stat().st_size > 5000
    section = page[page.index("id='episodes'") :]
    assert cells.rewards == [1.0, 0.0]  # best episode first, side by side
    assert section.index("It is 7.") < section.index("I give up.")
    assert "guess({&quot;number&quot;: 7})" in section and "correct" in section  # the call and the answer
    assert "GuessEnv 1" in section  # each source's own reward
    assert "step 2, 1 groups" in section
