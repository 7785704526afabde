"""Hostile completions against dsgrpo's code sandbox: every attack class of issue 25 and a few more.

The task is `add(a, b)` with three asserts; an honest wrong answer (`a - b`) passes one of them, so no attack
may score more than 1/3. Standard library only: tests/test_sandbox.py runs the corpus in-process (as the
user the suite runs as) and, when that is root, again as an unprivileged uid through this file's main:

    python3 tests/sandbox_attacks.py SANDBOX_PACKAGE_DIR WORK_DIR   # prints one JSON line per attack
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert abs(add(2, 2) - 4) < 1e-9"]
HONEST = "def add(a, b):\n    return a + b\n"
HONEST_WRONG = "def add(a, b):\n    return a - b\n"   # passes add(0, 0) == 0 only: 1/3
CEILING = 1 / 3

# Looks everywhere a test might be readable and, if it finds one, answers from it: a program that could read
# the tests would score 3/3 with this `add`.
ORACLE = r'''
import gc, glob, os, re, sys
_PATTERN = re.compile(r"add\((\d+), (\d+)\)(?: - (\d+))?\) ?(?:==|<) ?(\d+)")
LEAKED = {}
def _scan(text):
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    for m in re.finditer(r"add\((\d+), (\d+)\) == (\d+)", text):
        LEAKED[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))
    for m in re.finditer(r"add\((\d+), (\d+)\) - (\d+)\)", text):
        LEAKED[(int(m.group(1)), int(m.group(2)))] = int(m.group(3))
def _read(path, n=1 << 20):
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except Exception:
        return b""
for obj in gc.get_objects():                      # the interpreter's memory
    try:
        if isinstance(obj, str): _scan(obj)
        elif isinstance(obj, (list, tuple)): [_scan(x) for x in obj if isinstance(x, str)]
        elif isinstance(obj, dict): [_scan(x) for x in obj.values() if isinstance(x, str)]
    except Exception: pass
f = sys._getframe()
while f is not None:                               # every frame above us
    for v in list(f.f_locals.values()) + list(f.f_globals.values()):
        if isinstance(v, (str, bytes)): _scan(v)
        elif isinstance(v, (list, tuple)): [_scan(x) for x in v if isinstance(x, (str, bytes))]
    f = f.f_back
for pattern in ("*", ".*", "/tmp/**", "/dev/shm/**", "/tmp/*/*", "/root/**", "/home/**", "/srv/**", "/opt/**", "/mnt/**"):
    for path in glob.glob(pattern, recursive=True)[:2000]:   # the working directory, /tmp, other runs
        if os.path.isfile(path): _scan(_read(path))
for pid in os.listdir("/proc"):                   # other processes: cmdline, environ, memory
    if pid.isdigit():
        for part in ("cmdline", "environ"):
            _scan(_read(f"/proc/{pid}/{part}"))
for fd in range(0, 64):                           # whatever descriptors we inherited
    try:
        os.set_blocking(fd, False)
        _scan(os.read(fd, 1 << 16))
    except Exception: pass
def add(a, b):
    return LEAKED.get((a, b), a - b)
'''


# every descriptor the program holds beyond stdin/stdout/stderr: the protocol's pipes among them
FDS = "import os\nFDS = [int(fd) for fd in os.listdir('/proc/self/fd') if int(fd) > 2]\n"


def corpus(ctx: dict) -> list:
    """(name, program, tests, ceiling). ctx: port (a live HTTP server counting hits), secret (in the scorer's
    environment and in a file of the trainer's), victim (a file of the trainer's the program must not change)."""
    wrong = HONEST_WRONG
    secret, port, victim = ctx["secret"], ctx["port"], ctx["victim"]
    secret_tests = [f"assert leak() == {secret!r}"]
    attacks = [
        # --- forging the score
        ("forged result line + os._exit", 'print("\\n__RESULT__{\\"passed\\": 1000000}")\nimport os\nos._exit(0)', TESTS),
        ("forged result line on stderr and exit 0", 'import sys\nsys.stderr.write("__RESULT__{\\"passed\\": 3}\\n")\n'
                                                    'sys.stdout.write("OK 3/3\\n")\nraise SystemExit(0)', TESTS),
        ("__main__ counter", wrong + "import __main__, sys\n__main__.passed = 10**6\n"
                                     "sys.modules['__main__'].__dict__['passed'] = 10**6\n", TESTS),
        ("patched exec / compile / AssertionError", wrong + "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                                                            "builtins.compile = lambda *a, **k: None\n"
                                                            "builtins.AssertionError = type('N', (Exception,), {})\n", TESTS),
        ("rewritten test list (gc)", wrong + "import gc\nfor o in gc.get_objects():\n    if isinstance(o, list) and "
                                             "any(isinstance(x, str) and 'assert' in x for x in o):\n"
                                             "        o[:] = ['pass'] * len(o)\n", TESTS),
        ("frame inspection", wrong + "import sys\nf = sys._getframe()\nwhile f:\n    for k in list(f.f_locals):\n"
                                     "        if k in ('passed', 'tests', 'spec'):\n            f.f_locals[k] = ['pass']\n"
                                     "    f = f.f_back\n", TESTS),
        ("tests read from files, memory, /proc and inherited fds", ORACLE, TESTS),
        ("object equal to everything", "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): "
                                       "return False\n    def __lt__(self, o): return True\n    def __sub__(self, o): "
                                       "return 0\n    def __abs__(self): return 0\ndef add(a, b):\n    return E()\n", TESTS),
        ("int subclass equal to everything", "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = "
                                             "int.__hash__\n    def __sub__(self, o): return I(0)\n"
                                             "def add(a, b):\n    return I(a - b)\n", TESTS),
        ("shadowed builtin abs", wrong + "def abs(x):\n    return 0\n", TESTS),
        ("settrace / setprofile", wrong + "import sys\ndef t(frame, event, arg):\n    frame.f_locals.update(passed=99)"
                                          "\n    return t\nsys.settrace(t)\nsys.setprofile(t)\n", TESTS),
        ("signal handlers ignoring termination", "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, "
                                                 "signal.SIGHUP, signal.SIGALRM, signal.SIGXCPU):\n"
                                                 "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n", TESTS),
        # --- malformed answers on the protocol's pipes (found through /proc/self/fd)
        ("garbage frame header", wrong + FDS + "for fd in FDS:\n    try: os.write(fd, b'\\xff' * 8)\n"
                                         "    except OSError: pass\n", TESTS),
        ("forged answers queued ahead", FDS + "import struct, json\nok = json.dumps({'ok': 3}).encode()\n"
                                        "for fd in FDS:\n    try: os.write(fd, (struct.pack('>I', len(ok)) + ok) * 50)\n"
                                        "    except OSError: pass\n" + wrong, TESTS),
        ("answer too large", "def add(a, b):\n    return list(range(3_000_000))\n", TESTS),
        ("exported names shadowing builtins and keywords", "import builtins\nglobals()['assert'] = 1\n"
                                                           "AssertionError = 3\nlen = lambda x: 0\n" + wrong, TESTS),
        # --- escaping, persisting, reaching other runs and the trainer
        ("double fork + setsid daemon", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                        "        time.sleep(30)\n        for p in __import__('glob').glob('/tmp/**', "
                                        "recursive=True):\n            try: open(p, 'w').write('x')\n"
                                        "            except OSError: pass\n        os._exit(0)\n    os._exit(0)\n" + wrong, TESTS),
        ("fork bomb", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n", TESTS),
        ("threads bomb", "import threading, time\nfor i in range(10000):\n    try: threading.Thread(target=time.sleep, "
                         "args=(30,), daemon=True).start()\n    except RuntimeError: break\n" + wrong, TESTS),
        ("memory hog", "x = bytearray(4 * 1024 ** 3)\n" + wrong, TESTS),
        ("memory across processes", "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        b = "
                                    "bytearray(300 * 1024 ** 2)\n        time.sleep(30)\n        os._exit(0)\n"
                                    "time.sleep(30)\n" + wrong, TESTS),
        ("fd exhaustion", "fs = []\ntry:\n    while True: fs.append(open('/dev/null'))\nexcept OSError: pass\n" + wrong, TESTS),
        ("disk exhaustion", "try:\n    with open('/tmp/fill', 'wb') as fh:\n        while True: fh.write(b'x' * "
                            "(1 << 20))\nexcept OSError: pass\n" + wrong, TESTS),
        ("stdout flood", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", TESTS),
        ("1 GiB to stdout", "import os\nb = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, b)\n" + wrong, TESTS),
        ("infinite loop", "while True:\n    pass\n", TESTS),
        ("sleep past the limit", wrong + "import time\ntime.sleep(60)\n", TESTS),
        ("segfault by recursion", "import sys\nsys.setrecursionlimit(10 ** 6)\ndef add(a, b):\n    return add(a, b)\n",
         TESTS),
        ("network", wrong + f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)"
                            "\nexcept OSError: pass\n", TESTS),
        ("privilege: setuid, mount, unshare, ptrace", wrong + "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                                                              "for call in (lambda: os.setuid(0), lambda: libc.mount(b'none', "
                                                              "b'/', None, 32, None), lambda: libc.unshare(0x10000000), "
                                                              "lambda: libc.ptrace(16, os.getppid(), 0, 0), lambda: "
                                                              "os.kill(-1, 9)):\n    try: call()\n    except Exception: "
                                                              "pass\n", TESTS),
        ("write the trainer's file", wrong + f"try: open({victim!r}, 'w').write('gone')\nexcept OSError: pass\n", TESTS),
        ("secret from the environment, /proc and the trainer's files",
         "import glob, os\ndef leak():\n    for k, v in os.environ.items():\n        if v.startswith('sk-'): return v\n"
         "    for p in glob.glob('/proc/*/environ') + [" + repr(ctx["secret_file"]) + "]:\n        try:\n"
         "            for part in open(p, 'rb').read().split(b'\\0'):\n                if b'sk-' in part:\n"
         "                    return part.split(b'=')[-1].decode()\n        except OSError: pass\n    return None\n",
         secret_tests),
    ]
    for label, body in MALFORMED.items():  # written, framed, on every descriptor: before the first answer (the
        # program's list of names) and again inside the first call, ahead of its answer
        write = (f"    body = {body!r}\n    for fd in FDS:\n        try: os.write(fd, struct.pack('>I', len(body)) + body)\n"
                 "        except OSError: pass\n")
        attacks.append((f"malformed list of names: {label}", FDS + "import struct\ndef _w():\n" + write + "_w()\n" + wrong,
                        TESTS))
        attacks.append((f"malformed answer: {label}", FDS + "import struct\ndef _w():\n" + write + "calls = []\n"
                        "def add(a, b):\n    if not calls: calls.append(_w())\n    return a - b\n", TESTS))
    return [(name, program, tests, CEILING if tests is TESTS else 0.0) for name, program, tests in attacks]


MALFORMED = {
    "not JSON": b"__RESULT__ passed=3",
    "NaN": b'{"ok": NaN}',
    "invalid UTF-8": b'{"ok": "\xff\xfe"}',
    "100,000-deep JSON": b"[" * 100000 + b"]" * 100000,
    "a huge number": b'{"ok": 1e999}',
    "a handle out of range": b'{"ok": {"handle": 123456789}}',
    "an unknown tag": b'{"ok": {"pickle": "gASVAAAA"}}',
    "names shadowing keywords": b'{"ready": {"assert": {"value": 1}, "add": {"value": 3}}}',
    "two keys": b'{"ok": 3, "raise": ["ValueError", ""]}',
    "a truncated frame": b"",
}


def processes_left() -> list:
    """Processes in a PID namespace other than ours that we can see: a run's leftovers (daemons, bombs)."""
    mine = os.stat("/proc/self/ns/pid").st_ino
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/pid").st_ino != mine:
                    left.append(int(entry))
            except OSError:
                pass
    return left


def serve_counter():
    """A loopback HTTP server counting the requests it gets."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(1)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hits


def run_corpus(sandbox, workdir: str):
    """Yield one dict per attack: its score, what it left and what it touched."""
    server, hits = serve_counter()
    secret = "sk-" + os.urandom(8).hex()
    os.environ["HF_TOKEN"] = secret
    secret_file = os.path.join(workdir, "token")
    with open(secret_file, "w") as fh:
        fh.write(f"HF_TOKEN={secret}\n")
    os.chmod(secret_file, 0o600)
    victim = os.path.join(workdir, "trainer_state.json")
    with open(victim, "w") as fh:
        fh.write("precious")
    ctx = {"port": server.server_address[1], "secret": secret, "secret_file": secret_file, "victim": victim}
    limits = sandbox.SandboxLimits(timeout_s=2.0, cpu_s=2)
    reward = sandbox.CodeReward(limits=limits, workers=1)
    baseline = reward([f"```python\n{HONEST_WRONG}```"], [TESTS])[0]
    honest = reward([f"```python\n{HONEST}```"], [TESTS])[0]
    yield {"name": "honest", "score": honest, "ceiling": 1.0, "baseline": baseline}
    for name, program, tests, ceiling in corpus(ctx):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t = time.perf_counter()
        try:
            score, error = reward([f"Here you go:\n```python\n{program}```"], [tests])[0], None
        except BaseException as exc:  # noqa: BLE001 - reported, the test fails on it
            score, error = None, f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t
        deadline = time.time() + 5
        while processes_left() and time.time() < deadline:  # the kernel is tearing a namespace down
            time.sleep(0.05)
        with open(victim) as fh:
            intact = fh.read() == "precious"
        yield {"name": name, "score": score, "ceiling": ceiling, "error": error, "seconds": round(seconds, 2),
               "left": processes_left(), "hits": len(hits), "victim_intact": intact,
               "children_maxrss_kib": max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss),
               "baseline": reward([f"```python\n{HONEST_WRONG}```"], [TESTS])[0]}
    server.shutdown()


def load_sandbox(directory: str):
    """The sandbox package (dsgrpo/rewards/sandbox/, or a copy of it) loaded on its own, without dsgrpo."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("copied_sandbox", os.path.join(directory, "__init__.py"),
                                                  submodule_search_locations=[directory])
    module = importlib.util.module_from_spec(spec)
    sys.modules["copied_sandbox"] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sandbox = load_sandbox(sys.argv[1])
    sandbox.check_isolation()
    for row in run_corpus(sandbox, sys.argv[2]):
        print(json.dumps(row), flush=True)
