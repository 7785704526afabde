"""dsgrpo/compat/ (a module per library): every private or version-specific symbol of DeepSpeed, vLLM,
torch.distributed, transformers and peft that dsgrpo touches still exists with what dsgrpo relies on (an upgrade
fails here, not as a hang), and no other module reaches behind those packages' public APIs. Imports the packages;
launches nothing."""

import os
import re

import pytest
import torch

from dsgrpo import compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("pin", compat.PINS, ids=lambda p: p.path)
def test_every_pinned_symbol_is_still_there(pin):
    assert pin.versions and pin.why  # each pin says what it was written for and why
    assert compat.check_pin(pin) is None, compat.check_pin(pin)


def test_a_kept_gradient_accumulator_remembers_the_shape_its_leaf_had():
    """What compat.pin_grad_accumulators relies on (torch 2.13): the AccumulateGrad node a leaf's graphs lead to is
    cached while something holds it, and it checks incoming gradients against the shape the leaf had when the node
    was made. A ZeRO-3 parameter is shape [0] between uses: a node made then (by a user's clone) breaks the next
    backward; one made while the parameter was whole serves every later graph. When torch stops doing either, this
    fails and the pinning can go."""
    full = torch.randn(4, 3)
    p = torch.nn.Parameter(full.clone())
    p.data = torch.empty(0)  # partitioned
    kept = p.clone()  # the user's copy holds an accumulator made at shape [0]
    p.data = full.clone()  # gathered for a forward
    with pytest.raises(RuntimeError, match="invalid gradient.*compatible with \\[0\\]"):
        (p * 2).sum().backward()
    q = torch.nn.Parameter(full.clone())
    pinned = q.view_as(q).grad_fn.next_functions[0][0]  # made while whole, and kept
    q.data = torch.empty(0)
    kept = q.clone()
    assert kept.grad_fn.next_functions[0][0] is pinned  # the user's copy reuses it
    q.data = full.clone()
    (q * 2).sum().backward()
    assert torch.equal(q.grad, torch.full((4, 3), 2.0))


def test_a_moved_symbol_is_reported():
    gone = compat.Pin("deepspeed.runtime.compiler:no_such_function", "deepspeed 0.19.8", "test")
    assert "is gone" in compat.check_pin(gone)
    renamed_arg = compat.Pin(
        "vllm.distributed.parallel_state:init_distributed_environment",
        "vllm 0.32.0",
        "test",
        params=("no_such_argument",),
    )
    assert "no_such_argument" in compat.check_pin(renamed_arg)
    changed = compat.Pin(
        "deepspeed.runtime.compiler:is_compiling", "deepspeed 0.19.8", "test", source_has=("text that is not there",)
    )
    assert "no longer contains" in compat.check_pin(changed)


def test_version_check_names_what_differs():
    tested = {k: v + ".0" if v.count(".") == 1 else v for k, v in compat.TESTED.items()}
    assert compat.untested_versions(tested) == {}
    assert compat.untested_versions({**tested, "torch": "2.13.0+cpu"}) == {}  # a local build tag is the same release
    assert compat.untested_versions({**tested, "vllm": "0.33.1", "deepspeed": "0.19.80"}) == {
        "vllm": "0.33.1",
        "deepspeed": "0.19.80",
    }
    assert compat.untested_versions() == {}, (
        "this environment is not the tested one: update compat.TESTED "
        "only after tests/test_compat.py and the dist tests pass"
    )


def test_untested_versions_warn_once_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(compat, "_warned", False)
    monkeypatch.setattr(compat, "installed_versions", lambda: {"vllm": "0.40.0", "torch": "2.13.0+cpu"})
    compat.warn_if_untested()
    compat.warn_if_untested()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "vllm 0.40.0 (tested 0.32.0)" in lines[0] and "torch" not in lines[0]


# The spellings of the internals pinned above. Outside dsgrpo/compat/ none may appear in dsgrpo's code (comments and
# docstrings aside): a new touch of an internal belongs in dsgrpo/compat/ with a pin.
PRIVATE_SPELLINGS = [
    r"_get_default_store",
    r"\bds_id\b",
    r"\bds_shape\b",
    r"\bds_numel\b",
    r"\bds_tensor\b",
    r"collective_rpc",
    r"unset_hf_deepspeed_config",
    r"HfDeepSpeedConfig\(",
    r"deepspeed\.comm\.torch",
    r"parallel_state",
    r"\._name_or_path",
    r"\.llm_engine\b",
    r"\.is_compiling\s*=",
    r"get_delta_weight",
    r"peft\.tuners",
    r"model_loader\.reload",
    r"__struct_fields__",
]


def _code_lines(path):
    """Source lines outside docstrings and comments."""
    text = open(path).read()
    text = re.sub(r'"""(?:.|\n)*?"""', lambda m: "\n" * m.group(0).count("\n"), text)
    for number, line in enumerate(text.splitlines(), 1):
        yield number, line.split("#", 1)[0]


def test_no_module_but_compat_touches_the_internals():
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "dsgrpo")):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or os.path.basename(root) == "compat":
                continue
            for number, line in _code_lines(path):
                for spelling in PRIVATE_SPELLINGS:
                    if re.search(spelling, line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "internals touched outside dsgrpo/compat/:\n" + "\n".join(offenders)


def test_only_dist_talks_to_torch_distributed():
    """Every collective goes through dsgrpo/dist.py (dsgrpo/compat/'s pinned replays aside)."""
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "dsgrpo")):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or name == "dist.py" or os.path.basename(root) == "compat":
                continue
            for number, line in _code_lines(path):
                # (torch.distributed.run is the launcher, started as a program: no collective)
                if re.search(r"torch\.distributed(?!\.run\b)|\btdist\b", line):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "torch.distributed used outside dist.py:\n" + "\n".join(offenders)


def test_cpu_tensor_parallel_shared_memory_is_named_per_job(monkeypatch, tmp_path):
    """Under external_launcher vLLM-CPU gave every TP engine of a machine the same segment names: a later job (or
    one after a SIGKILL, which leaves them behind) failed with errno 17. They carry MASTER_PORT now, and this rank's
    leftover of that name is removed."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    monkeypatch.setattr(compat.vllm, "SHM_DIR", str(tmp_path))  # (vLLM's section of the package reads it)
    compat.unique_cpu_shm_names()
    compat.unique_cpu_shm_names()  # idempotent: wrapped once
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what CPUWorker derives from "env://"
    monkeypatch.setenv("MASTER_PORT", "29517")
    stale = tmp_path / "dsgrpo29517-tp:0-[0-1]-cpushm_1"
    stale.write_bytes(b"left by a killed job")
    comm = SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank=1)
    assert _CPUSHMDistributed.make_group_name(comm) == "dsgrpo29517-tp:0-[0-1]-cpushm"
    assert not stale.exists()
    monkeypatch.setenv("VLLM_DIST_IDENT", "41234")  # vLLM's own executors: a real port, left alone
    assert _CPUSHMDistributed.make_group_name(comm) == "41234-tp:0-[0-1]-cpushm"


def test_an_engine_build_makes_no_full_collection_and_gc_comes_back():
    import gc
    import weakref

    class Cycle:
        pass

    def garbage():
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a  # only a collection frees it
        return weakref.ref(a)

    gc.disable()  # no automatic collection in between
    try:
        with compat.engine_build_without_full_collections(enabled=False):
            alive = garbage()
            gc.collect()
            assert alive() is None  # off (a GPU build): collections as usual
        with compat.engine_build_without_full_collections():
            alive = garbage()
            assert gc.collect() == 0 and alive() is not None
        gc.collect()
        assert alive() is None  # the real gc.collect is back
    finally:
        gc.enable()


def test_the_eager_token_rank_counts_as_vllms_compiled_function_does():
    """eager_token_ranks_on_cpu: the sampler's rank count, replaced on CPU, counts what vLLM's function counts (its
    uncompiled body) for ties, a batch of one and a batch of many, and is replaced once."""
    import torch
    import vllm.v1.sample.ops.logprobs as logprobs_ops
    import vllm.v1.sample.sampler as sampler

    compiled = sampler.batched_count_greater_than
    try:
        compat.eager_token_ranks_on_cpu()
        eager = sampler.batched_count_greater_than
        compat.eager_token_ranks_on_cpu()
        assert sampler.batched_count_greater_than is eager  # replaced once
        assert eager is not compiled and eager is not logprobs_ops.batched_count_greater_than
        body = logprobs_ops.batched_count_greater_than.__wrapped__  # vLLM's code, not compiled
        torch.manual_seed(0)
        for rows in (1, 7):
            x = torch.randn(rows, 50).log_softmax(-1)
            x[:, 3] = x[:, 4]  # a tie counts the other token too
            token = x.gather(-1, torch.randint(0, 50, (rows, 1)))
            assert torch.equal(eager(x, token), body(x, token))
            assert torch.equal(eager(x, token), (x >= token).sum(-1))
        assert eager(torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-1.0]])).tolist() == [2]
    finally:
        sampler.batched_count_greater_than = compiled


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_the_watchers_store_client_speaks_tcpstores_wire_protocol(libuv):
    """compat.StoreWire (the rank watcher's torch-free client) against a real TCPStore server of each backend: what
    one writes the other reads, and a missing key reads as None without waiting."""
    import datetime

    import torch.distributed as tdist

    server = tdist.TCPStore(
        "127.0.0.1",
        0,
        world_size=1,
        is_master=True,
        wait_for_workers=False,
        use_libuv=libuv,
        timeout=datetime.timedelta(seconds=10),
    )
    wire = compat.StoreWire("127.0.0.1", server.port, timeout_s=5)
    try:
        server.set("dsgrpo/alive/0", b'{"count": 1}')
        assert wire.get("dsgrpo/alive/0") == b'{"count": 1}'
        assert wire.get("dsgrpo/alive/1") is None
        wire.set("dsgrpo/alive/1", b"x" * 70000)
        assert server.get("dsgrpo/alive/1") == b"x" * 70000
    finally:
        wire.close()


def test_a_rank_under_deepspeeds_runner_follows_the_runner(tmp_path):
    """deepspeed_runner_above recognises DeepSpeed's node launcher by its module in a rank's parent's command line,
    and the node launcher's parent as the runner by the console script's name (`deepspeed`)."""
    import subprocess
    import sys
    import time

    runner_script = tmp_path / "deepspeed"  # what `deepspeed --num_gpus N` runs: bin/deepspeed
    runner_script.write_text(
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; "
        "time.sleep(30)', '-m', 'deepspeed.launcher.launch'])\n"
    )
    runner = subprocess.Popen([sys.executable, str(runner_script), "--num_gpus", "2"])
    node_launcher = None
    try:
        for _ in range(200):
            kids = open(f"/proc/{runner.pid}/task/{runner.pid}/children").read().split()
            # A child is listed from its fork, before its exec: until then its command line is the runner's.
            if kids and b"deepspeed.launcher.launch" in open(f"/proc/{kids[0]}/cmdline", "rb").read():
                node_launcher = int(kids[0])
                break
            time.sleep(0.05)
        assert node_launcher is not None
        assert compat.deepspeed_runner_above(node_launcher) == runner.pid
        assert compat.deepspeed_runner_above(runner.pid) is None  # not a node launcher
        assert compat.deepspeed_runner_above(os.getpid()) is None
    finally:
        if node_launcher is not None:
            os.kill(node_launcher, 9)
        runner.kill()
        runner.wait()


@pytest.mark.slow
def test_a_background_thread_generates_once_it_takes_the_main_threads_openmp_count(tmp_path):
    """Under the deepspeed launcher (no OMP_NUM_THREADS at start) a thread started after device.prepare_process
    counted the machine's cores, and vLLM-CPU's attention refused its calls (the agents' endpoint and the async
    worker generate in such threads). compat.engine_thread_threads gives it the main thread's count."""
    import json
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the main thread's share and the machine's count are the same")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "omp_thread_check.py")
    done = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(out["main"], list) and len(out["main"]) == 4
    assert "thread_num" in out["unset"], out  # the failure this guards against, still there without the call
    assert isinstance(out["set"], list) and len(out["set"]) == 4, out


def test_the_watcher_imports_no_torch():
    """The rank watcher (watcher.py) imports compat for the store's wire protocol and must start in a fraction of a
    second beside every rank: compat's modules import their libraries inside the functions that need them. (A
    top-level `import torch` in a compat module once made every watcher load torch and the stopped-rank tests
    miss their bound.)"""
    import subprocess
    import sys

    heavy = ("torch", "deepspeed", "vllm", "transformers", "peft", "bitsandbytes")
    code = (
        "import sys, dsgrpo.watcher, dsgrpo.compat, dsgrpo.process_exit; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
