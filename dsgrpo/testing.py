"""Tiny local models for tests, demos and benchmarks (nothing can be downloaded at run time).

Each model is built deterministically from a seed, saved with `save_pretrained` into a cache folder, and then
loaded by the caller through the same code path a hub model takes (`AutoModelForCausalLM.from_pretrained`,
vLLM's `LLM(model=path)`).

    path = tiny_model("qwen2")          # → ~/.cache/dsgrpo/tiny/qwen2-<hash>/
    path = tiny_model("llama-tied")
    path = tiny_model("qwen2-reward")   # sequence classification, num_labels=1

The tokenizer is a byte-level BPE trained here on a small synthetic corpus (vocab ≤ 2k), with ChatML special
tokens, a ChatML chat template, `<|im_end|>` as eos and `<|endoftext|>` as pad.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Optional

from .compat import SHM_DIR

# ChatML with Qwen2.5's tool conventions: with `tools`, the system turn lists their schemas; a `tool` message is
# a <tool_response> block in a user turn (consecutive ones share it); an assistant's tool_calls are <tool_call>
# blocks. Without tools the rendering is plain ChatML, byte for byte what it was before tools existed.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message.tool_calls %}"
    "{% if call.function is defined %}{% set call = call.function %}{% endif %}"
    '{{ \'\n<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' + (call.arguments | tojson) '
    "+ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Architecture of each tiny model. head_dim = hidden / heads = 32: vLLM's CPU attention accepts it.
TINY_SPECS = {
    "qwen2": dict(
        arch="Qwen2ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2-tied": dict(
        arch="Qwen2ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        arch="LlamaForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "llama-tied": dict(
        arch="LlamaForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2-reward": dict(
        arch="Qwen2ForSequenceClassification",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        num_labels=1,
    ),
    # mixture-of-experts policies: 4 experts, 2 routed per token (transformers 5 keeps each layer's experts fused in
    # one tensor; checkpoints and vLLM name them one expert at a time)
    "qwen3-moe": dict(
        arch="Qwen3MoeForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen2-moe": dict(
        arch="Qwen2MoeForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    # tied embeddings vLLM computes from the embedding (no lm_head), and logits soft-capped after the head
    "gemma2": dict(
        arch="Gemma2ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        tie_word_embeddings=True,
    ),
    # attention that spans a whole packed row (transformers 5's OPT builds its own mask from position ids it
    # ignores): packed steps must fall back to padded micro-batches, or be refused when asked for
    "opt": dict(
        arch="OPTForCausalLM",
        hidden_size=128,
        ffn_dim=256,
        word_embed_proj_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=False,
    ),
}
MODEL_TYPES = {
    "Qwen2": "qwen2",
    "Llama": "llama",
    "Qwen3Moe": "qwen3_moe",
    "Qwen2Moe": "qwen2_moe",
    "Gemma2": "gemma2",
    "OPT": "opt",
}
VOCAB_SIZE = 1024
TOKENIZER_VERSION = 2  # bump when the corpus, trainer settings or chat template change, so caches are rebuilt


def cache_root() -> str:
    return os.environ.get("DSGRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsgrpo"))


def _spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def _synthetic_corpus(seed: int, lines: int = 4000) -> list:
    """Text that covers what the tests and the demo feed the model: English-ish words, digits, arithmetic,
    chat markup and simple answer tags."""
    rng = random.Random(seed)
    words = (
        "the a of to and in is it you that he was for on are with as his they be at one have this from "
        "or had by word but what some we can out other were all there when up use your how said an each "
        "she which do their time if will way about many then them write would like so these her long make "
        "thing see him two has look more day could go come did number sound no most people my over know "
        "water than call first who may down side been now find any new work part take get place made live "
        "where after back little only round man year came show every good me give our under name very "
        "through just form sentence great think say help low line differ turn cause much mean before move "
        "right boy old too same tell does set three want air well also play small end put home read hand "
        "port large spell add even land here must big high such follow act why ask men change went light "
        "kind off need house picture try us again animal point mother world near build self earth father "
        "answer question think step total sum plus minus times equals apples pays each cost how many much"
    ).split()
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.45:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*"])
            val = {"+": a + b, "-": a - b, "*": a * b}[op]
            out.append(f"What is {a} {op} {b}? {a} {op} {b} = {val}. The answer is {val}. #### {val}")
        else:
            out.append(
                f"<answer>{rng.randint(0, 99)}</answer> <think>{rng.choice(words)}</think> "
                f"{''.join(rng.choice('0123456789') for _ in range(rng.randint(1, 6)))}"
            )
    return out


def build_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on the synthetic corpus and wrap it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        padding_side="left",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_tokenizer(seed: int = 0, cache_dir: Optional[str] = None) -> str:
    """Path of the cached tiny tokenizer (built on first use)."""
    root = cache_dir or cache_root()
    path = os.path.join(root, "tiny", f"tokenizer-v{TOKENIZER_VERSION}-s{seed}")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        from . import dist

        if not dist.is_initialized() or dist.is_main():
            tmp = path + f".tmp{os.getpid()}"
            build_tokenizer(seed).save_pretrained(tmp)
            _atomic_publish(tmp, path, complete=lambda p: os.path.isfile(os.path.join(p, "tokenizer.json")))
        dist.barrier("tiny tokenizer built by rank 0")
    return path


def build_model(name: str, seed: int = 0, spec: Optional[dict] = None, vocab_size: int = VOCAB_SIZE):
    """A randomly initialised model of `TINY_SPECS[name]` (or of `spec`) with the tiny tokenizer's vocabulary."""
    import torch
    import transformers

    spec = dict(spec or TINY_SPECS[name])
    arch = spec.pop("arch")
    num_labels = spec.pop("num_labels", None)
    tokenizer = build_tokenizer(seed, vocab_size)
    family = max((k for k in MODEL_TYPES if arch.startswith(k)), key=len)
    config_cls = transformers.AutoConfig.for_model(MODEL_TYPES[family]).__class__
    spec.setdefault("max_position_embeddings", 2048)
    config = config_cls(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **spec,
    )
    if num_labels is not None:
        config.num_labels = num_labels
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    return model.float().eval(), tokenizer


def tiny_model(name: str = "qwen2", seed: int = 0, cache_dir: Optional[str] = None) -> str:
    """Path of a cached tiny model (and its tokenizer) in Hugging Face format, built on first use."""
    if name not in TINY_SPECS:
        raise ValueError(f"Unknown tiny model {name!r}; known: {sorted(TINY_SPECS)}.")
    root = cache_dir or cache_root()
    spec = dict(TINY_SPECS[name], seed=seed, tokenizer=TOKENIZER_VERSION, vocab=VOCAB_SIZE)
    path = os.path.join(root, "tiny", f"{name}-{_spec_hash(spec)}")
    if not _complete(path):
        # in a process group only rank 0 builds and the others wait (a non-main rank's save_pretrained may skip
        # the weights); before one exists, each process builds its own copy and the first to publish wins
        from . import dist

        if not dist.is_initialized() or dist.is_main():
            model, tokenizer = build_model(name, seed)
            tmp = path + f".tmp{os.getpid()}"
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _atomic_publish(tmp, path)
        dist.barrier("tiny model built by rank 0")
        if not _complete(path):
            raise RuntimeError(f"tiny model {name!r} at {path} is incomplete (no config.json or weights); delete it.")
    return path


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors"))


def _atomic_publish(tmp: str, path: str, complete=None) -> None:
    """Rename a finished folder into place (replacing an incomplete one: `complete(path)` false, by default a
    model's config and weights); if another process published first, its copy wins and ours is dropped."""
    import shutil

    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isdir(path) and not (complete or _complete)(path):  # a build that died before it was written
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def save_custom_model(
    out_dir: str,
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    vocab_size: int = VOCAB_SIZE,
    arch: str = "Qwen2ForCausalLM",
    seed: int = 0,
    max_positions: int = 2048,
) -> str:
    """A random-init causal LM of any size on a locally trained tokenizer (benchmarks use this)."""
    spec = dict(
        arch=arch,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        tie_word_embeddings=False,
        max_position_embeddings=max_positions,
    )
    model, tokenizer = build_model("custom", seed, spec=spec, vocab_size=vocab_size)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_SIZE",
)


class ServerProcess:
    """A `dsgrpo vllm-serve` subprocess for tests and benchmarks: started, awaited (/health), killed with SIGKILL
    and restarted. Its command and pid live in `state_file`, so another process (a training rank of a test) can
    restart the server the test started: ServerProcess.from_state(path).restart()."""

    def __init__(
        self,
        model: str,
        state_file: str,
        *,
        port: int,
        group_port: int,
        token: Optional[str] = None,
        extra=(),
        nproc: int = 1,
        dtype: str = "float32",
        log_path: Optional[str] = None,
    ):
        import sys

        serve = [
            "-m",
            "dsgrpo.cli",
            "vllm-serve",
            "--model",
            model,
            "--port",
            str(port),
            "--group-port",
            str(group_port),
            "--dtype",
            dtype,
            *extra,
        ]
        master_port = _free_port()
        launcher = [sys.executable] + (
            ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(master_port)]
            if nproc > 1
            else []
        )
        self.state = {
            "cmd": launcher + serve,
            "url": f"http://127.0.0.1:{port}",
            "pid": None,
            "token": token,
            "log": log_path or state_file + ".log",
            "master_port": master_port if nproc > 1 else None,
        }
        self.state_file = state_file

    @classmethod
    def from_state(cls, state_file: str) -> "ServerProcess":
        self = cls.__new__(cls)
        self.state_file = state_file
        with open(state_file) as fh:
            self.state = json.load(fh)
        return self

    @property
    def url(self) -> str:
        return self.state["url"]

    def start(self, timeout_s: float = 300) -> dict:
        """Start the server and wait until it answers /health (its reply)."""
        import subprocess
        import time
        import urllib.request

        env = dict(
            os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")
        )
        if self.state.get("token"):  # the server reads its token from the environment, never the command line
            env["DSGRPO_VLLM_TOKEN"] = self.state["token"]
        for key in list(env):  # started from a training rank: the server is a world of its own (torchrun's
            # TORCHELASTIC_USE_AGENT_STORE would make it a client of a rendezvous store no one runs)
            if key in LAUNCHER_ENV or key.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_")):
                del env[key]
        with open(self.state["log"], "a") as log:
            proc = subprocess.Popen(
                self.state["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.state["pid"] = proc.pid
        with open(self.state_file, "w") as fh:
            json.dump(self.state, fh)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"dsgrpo vllm-serve exited {proc.returncode}; see {self.state['log']}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    return json.loads(resp.read())
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"dsgrpo vllm-serve did not answer within {timeout_s} s; see {self.state['log']}")

    def kill(self) -> None:
        """SIGKILL the server and every process under it (torchrun starts its ranks in sessions of their own, so
        the process group alone misses them), and wait until they are gone."""
        import time

        import psutil

        pid = self.state.get("pid")
        if not pid:
            return
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        # shared memory its engine mapped (vLLM's message queue of a tensor-parallel group, /dev/shm/psm_*): a killed
        # process never unlinks it, and each one left 24 MiB of RAM in tmpfs
        segments = set()
        for proc in procs:
            try:
                segments.update(m.path for m in proc.memory_maps() if m.path.startswith(SHM_DIR + "/psm_"))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for _ in range(400):
            try:
                os.waitpid(pid, os.WNOHANG)  # reaps it when this process started it
            except ChildProcessError:
                pass
            if not any(_alive(p.pid) for p in procs):
                break
            time.sleep(0.05)
        self.state["pid"] = None
        if self.state.get("master_port"):  # a killed TP engine leaves its shared memory (compat.unique_cpu_shm_names)
            import glob

            segments.update(glob.glob(f"{SHM_DIR}/dsgrpo{self.state['master_port']}-*"))
        for leftover in segments:
            if os.path.exists(leftover):
                os.unlink(leftover)

    def restart(self, timeout_s: float = 300) -> dict:
        self.kill()
        return self.start(timeout_s)


def _alive(pid: int) -> bool:
    """Running (a zombie another process has not reaped yet holds no ports: it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    """`python -m dsgrpo.testing make --hidden 512 --layers 8 --heads 8 --vocab 1000 --out DIR`"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dsgrpo.testing")
    parser.add_argument("command", choices=["make"])
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    save_custom_model(
        a.out,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        vocab_size=a.vocab,
        max_positions=a.max_positions,
    )
    n = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(a.out).parameters())
    print(f"saved {a.out}: {n / 1e6:.1f}M parameters")
    return 0


# ------------------------------------------------------------------------------ a test environment
class Ledger:
    """A tool-calling environment for tests and benches (environment_factory): keeps the sum of what `add`
    returned across the rollout's turns; `explode` raises, `stall` outlives any tool timeout; owns a reward (1 when
    the sum is 5)."""

    def reset(self, **row):
        self.total, self.calls, self.prompt = 0, [], row["prompt"][-1]["content"]

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls.append((a, b))
        self.total += a + b
        return a + b

    def explode(self, x: int) -> int:
        """A tool that always fails.

        Args:
            x: Any number.
        """
        raise ValueError("the environment broke on purpose")

    def stall(self, x: int) -> int:
        """A tool that never answers in time.

        Args:
            x: Any number.
        """
        import time

        time.sleep(30)
        return x

    def get_reward(self) -> float:
        return float(self.total == 5)


if __name__ == "__main__":
    raise SystemExit(main())
