"""What a newcomer sees of a run: `dsgrpo train` from the command line in one process (stdout a pipe, as in a
Slurm log), the trackers report_to names (tensorboard, trackio: offline, read back), and `dsgrpo report` over
two real runs (a GRPOTrainer run with beta > 0, an eval set and log_completions; an AsyncGRPOTrainer run), its
HTML checked for structure and rendered in a real headless browser (Debian's chromium).

The two runs start beside the unit tests (tests/background.py) and go side by side; the browser check installs
chromium from Debian when it is missing and this is root, as tests/slurm/local_cluster.sh does for Slurm."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from launch import REPO

pytestmark = pytest.mark.slow


def start_cli(tmp_path, name, **over):
    """`dsgrpo train` of one config in a process of its own (one thread of compute: the two runs go side by side
    on the 2 cores); the function returned waits for it: (its output folder, its CompletedProcess)."""
    import background
    from dsgrpo.testing import tiny_model

    values = dict(
        model=tiny_model("qwen2"),
        train_dataset="task:copy_digits",
        reward_funcs=["dsgrpo.tasks:copy_digits_reward"],
        output_dir=str(tmp_path / name),
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        vllm_kv_cache_bytes=32 * 2**20,
        seed=0,
    )
    values.update(over)
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    env = {"TRACKIO_DIR": str(tmp_path / "trackio")}
    env.update({key: None for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
    wait = background.command(
        [sys.executable, "-m", "dsgrpo.cli", "train", str(cfg)],
        str(tmp_path),
        name=name,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )

    def finish():
        proc = wait()
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return tmp_path / name, proc

    return finish


def start_runs(folder):
    """Both runs started (tests/background.py starts them beside the unit tests); the function returned waits."""
    import pathlib

    tmp = pathlib.Path(folder)
    grpo = start_cli(
        tmp,
        "grpo",
        beta=0.04,
        eval_dataset="task:copy_digits:32",
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=8,
        log_completions=True,
        num_completions_to_print=0,
        report_to=["tensorboard", "trackio"],
        project="dsgrpo-test",
        run_name="grpo-run",
    )
    asynchronous = start_cli(tmp, "async", trainer="async")
    return lambda: (tmp, grpo(), asynchronous())


@pytest.fixture(scope="module")
def runs():
    import background

    return background.result("report_runs")


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


# ----------------------------------------------------------------------------------------- console and trackers
def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(runs):
    _, (_, proc), _ = runs
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in lines] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout
    assert re.match(
        r"step 1/4 \(25%\) \| reward [\d.]+ \| loss \S+ \| kl \S+ \| entropy \S+ \| \S+ tok/s \| "
        r"(\d+m)?\d+s elapsed \| ETA (\d+m)?\d+s$",
        lines[0],
    ), lines[0]
    assert "ETA" not in lines[-1]  # nothing left at the last step
    assert sum(l.startswith("eval at step ") for l in proc.stdout.splitlines()) == 2  # steps 2 and 4
    assert re.search(r"^done: step 4/4 in (\d+m)?\d+s$", proc.stdout, re.M)
    assert "\r" not in proc.stdout + proc.stderr  # no carriage-return bars


def test_tensorboard_holds_the_metrics_under_their_jsonl_names(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, (run_dir, _), _ = runs
    logdirs = [d for d in (run_dir / "runs").iterdir() if d.is_dir()]
    assert len(logdirs) == 1
    acc = EventAccumulator(str(logdirs[0]))
    acc.Reload()
    rows = metrics(run_dir)
    train = [r for r in rows if "reward" in r]
    assert set(acc.Tags()["scalars"]) >= {k for r in train for k, v in r.items() if k != "step" and v is not None}
    logged = {e.step: e.value for e in acc.Scalars("reward")}
    assert logged == pytest.approx({r["step"]: r["reward"] for r in train}, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval_reward")] == [2, 4]
    assert [e.step for e in acc.Scalars("kl")] == [1, 2, 3, 4]
    assert "completions/text_summary" in acc.Tags()["tensors"]  # the completions table, as markdown text


def test_trackio_holds_the_same_metrics_offline(runs):
    tmp, (run_dir, _), _ = runs
    read = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('dsgrpo-test', 'grpo-run')))",
        ],
        env=dict(os.environ, TRACKIO_DIR=str(tmp / "trackio")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0, read.stderr[-2000:]
    logs = json.loads(read.stdout.strip().splitlines()[-1])
    train = [r for r in metrics(run_dir) if "reward" in r]
    by_step = {row["step"]: row for row in logs if "reward" in row}
    assert sorted(by_step) == [1, 2, 3, 4]
    for r in train:
        assert by_step[r["step"]]["reward"] == pytest.approx(r["reward"], rel=1e-6)
        assert by_step[r["step"]]["kl"] == pytest.approx(r["kl"], rel=1e-6)
    assert [row["step"] for row in logs if "eval_reward" in row] == [2, 4]


# ----------------------------------------------------------------------------------------------------- report
class PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.headings, self.tables, self.scripts, self._in = [], [], 0, 0, None
        self.text = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        if tag == "table":
            self.tables += 1
        if tag == "script":
            self.scripts += 1
            assert "src" not in attrs  # nothing fetched
        if tag == "link":
            raise AssertionError(f"the report links an external resource: {attrs}")
        self._in = tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "h2":
            self.headings.append(data)
        self.text.append(data)


@pytest.fixture(scope="module")
def report(runs):
    tmp, (grpo, _), (asynchronous, _) = runs
    out = tmp / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "dsgrpo.cli", "report", str(grpo), str(asynchronous), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"report written to {out / 'report.html'}"
    return out


EXPECTED = [
    "Reward",
    "Each reward function",
    "KL to the reference",
    "Entropy",
    "Completion lengths",
    "Loss, grad norm, learning rate",
    "Clipped ratios",
    "Tokens per second",
    "Time per phase",
    "Async rollouts",
    "Evaluation",
    "Sampled completions",
]


def test_report_has_every_figure_embedded_and_as_png(report):
    page = PageParser()
    page.feed((report / "report.html").read_text())
    assert page.headings == EXPECTED
    assert len(page.images) == len(EXPECTED) - 1  # every figure but the completions table
    for img in page.images:
        assert img["src"].startswith("data:image/png;base64,")
        png = base64.b64decode(img["src"].split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert pngs == sorted(
        [
            "reward.png",
            "reward_functions.png",
            "kl.png",
            "entropy.png",
            "lengths.png",
            "optimizer.png",
            "clipping.png",
            "throughput.png",
            "time.png",
            "async.png",
            "eval.png",
        ]
    )
    text = " ".join(page.text)
    assert "grpo" in text and "async" in text  # both runs in the summary (overlaid in every figure)
    assert "Not logged" not in page.headings


def test_report_table_shows_sampled_completions_with_rewards(report, runs):
    _, (grpo, _), _ = runs
    rows = [json.loads(l) for l in open(grpo / "completions.jsonl")]
    last = [r for r in rows if r["step"] == 4]
    best = max(last, key=lambda r: r["reward"])
    page = (report / "report.html").read_text()
    assert "Repeat this number:" in page
    section = page[page.index("id='completions'") :]
    assert f"step 4: {min(12, len(last))} of {len(last)} completions" in section
    assert f"{best['reward']:.4g}" in section


def test_report_of_one_run_says_what_it_did_not_log(runs, tmp_path):
    from dsgrpo.report import write_report

    _, _, (asynchronous, _) = runs
    path = write_report([str(asynchronous)], str(tmp_path / "one"))
    page = open(path).read()
    assert "No run logged the metrics of: KL to the reference, Evaluation." in page
    assert "log_completions: true" in page
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report([str(tmp_path)])


def chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found or os.getuid() != 0 or not shutil.which("apt-get"):
        return found
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "chromium"],
        capture_output=True,
        timeout=600,
        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
    )
    return shutil.which("chromium")


def render(browser, page):
    """The DOM after load, and the page's console messages (chromium logs each as a CONSOLE line)."""
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [l for l in proc.stderr.splitlines() if ":CONSOLE" in l]


def test_report_renders_in_a_headless_browser(report, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium (and not root to install it from Debian)")
    dom, console = render(browser, report / "report.html")
    assert console == [], console
    plots = int(re.search(r'data-plots="(\d+)"', dom).group(1))
    assert plots == len(EXPECTED) - 1
    assert f'data-plots-decoded="{plots}"' in dom
    # the check can fail: a page with a broken image and a script error is caught
    broken = tmp_path / "broken.html"
    broken.write_text(
        (report / "report.html")
        .read_text()
        .replace("base64,iVBOR", "base64,AAAA", 1)
        .replace("</body>", "<script>undefinedFunction()</script></body>")
    )
    dom, console = render(browser, broken)
    assert f'data-plots-decoded="{plots - 1}"' in dom and "this plot failed to load" in dom
    assert any("undefinedFunction" in line for line in console)
