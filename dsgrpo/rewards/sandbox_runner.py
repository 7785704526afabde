"""The far side of dsgrpo/rewards/sandbox.py: one process per scored completion, started by the judge as
`python -I -S sandbox_runner.py`. Standard library only (it must run under any interpreter the sandbox can use).

Processes of one run, and who trusts whom:

    judge (the trainer: holds the expected outputs of stdin/stdout cases)
      └─ supervisor S (this file's main; runs the test snippets, never the completion's code)
           └─ holder Z (one per program run: owns a PID namespace, kills and reaps it)
                └─ program P (PID 1 of that namespace: the completion's code, in its own mounts and uid)

P runs the completion's code and then answers S's questions: "call add(1, 2)", "len of that object". Every
answer crosses a pipe as plain data (None, bool, int, float, str, bytes, list, tuple, set, dict; anything else
stays in P as an opaque handle), and S runs each test snippet with those values, so every comparison, every
`assert` and the count of passed tests happen in S, which P can neither see (another PID namespace) nor reach
(no shared memory, file or signal). Whatever P does to itself (patched builtins, an object equal to everything,
a forged line on stdout, os._exit) changes only what it answers, and an answer is only ever compared, in S,
with values P has never seen. Anything P sends that is not a well-formed answer ends the run with score 0.

Frames on every pipe: a 4-byte big-endian length, then that many bytes of UTF-8 JSON.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys
import time

# ---------------------------------------------------------------------------------------------- Linux calls
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 38, 47, 4
SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
UID_BASE = 0x7F000000  # as root, each run's program gets uid UID_BASE + the supervisor's pid: unique while it runs
STDIO_FDS = (0, 1, 2)

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built here (a namespace or mount refused): the judge refuses to score."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target} ({fstype or 'bind'})")


def _syscall(name: str, *args) -> int:
    number = SYSCALLS.get(os.uname().machine, {}).get(name)
    if number is None:
        raise SetupError(f"no {name} syscall number known for {os.uname().machine}")
    return _libc.syscall(number, *args)


def _prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), what)


# ---------------------------------------------------------------------------------------------- framing
class ProtocolError(BaseException):
    """The program broke the protocol, a limit, or the deadline. A BaseException, so that no test's
    `except Exception` can swallow it; the run scores 0 whatever happens after."""


def frame(obj) -> bytes:
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes:
    """Blocking read of exactly n bytes from a trusted peer; b'' at a clean end of stream."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            if got:
                raise EOFError("stream ended inside a frame")
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int):
    """One frame from the judge (trusted), read byte-exactly: nothing after it is pulled into this process."""
    head = read_exact(fd, 4)
    if not head:
        raise EOFError("no frame")
    return json.loads(read_exact(fd, struct.unpack(">I", head)[0]))


# ---------------------------------------------------------------------------------------------- plain data
# The one encoding of values on the wire. JSON's own types carry None, bool, int, str and finite floats; the rest
# is tagged with a one-key object. Encoding is by exact type: a subclass (an int whose __eq__ says yes to
# everything) is not plain data.
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "float", "complex", "handle")


def encode(value, handle_of=None, budget=None):
    """`budget`: a one-item list counting down the nodes still allowed (exports keep globals small)."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too large")
    t = type(value)
    if t is int and value.bit_length() > 12000:  # JSON's int parser stops at 4,300 digits
        raise ValueError("an int too large to send")
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
    if t is list:
        return [encode(v, handle_of, budget) for v in value]
    if t is tuple:
        return {"tuple": [encode(v, handle_of, budget) for v in value]}
    if t is set or t is frozenset:
        return {t.__name__: [encode(v, handle_of, budget) for v in value]}
    if t is dict:
        return {"dict": [[encode(k, handle_of, budget), encode(v, handle_of, budget)] for k, v in value.items()]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t is complex:
        return {"complex": [encode(value.real), encode(value.imag)]}
    if handle_of is None:
        raise TypeError(f"a {t.__name__} cannot cross the sandbox boundary (plain data only)")
    return {"handle": handle_of(value)}


def decode(value, resolve=None):
    """Plain data from the wire, rebuilt from fresh objects of exact builtin types; ValueError for anything else."""
    t = type(value)
    if value is None or t is bool or t is int or t is str or t is float:
        return value
    if t is list:
        return [decode(v, resolve) for v in value]
    if t is not dict or len(value) != 1:
        raise ValueError(f"not plain data: {t.__name__}")
    (tag, body), = value.items()
    if tag == "tuple" and type(body) is list:
        return tuple(decode(v, resolve) for v in body)
    if tag in ("set", "frozenset") and type(body) is list:
        return (set if tag == "set" else frozenset)(decode(v, resolve) for v in body)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k, resolve): decode(v, resolve) for k, v in body}
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(decode(body[0]), decode(body[1]))
    if tag == "handle" and type(body) is int and resolve is not None:
        return resolve(body)
    raise ValueError(f"not plain data: tag {tag!r}")


# ---------------------------------------------------------------------------------------------- the program (P)
EXPORTED_VALUE_NODES, MAX_EXPORTS = 10_000, 10_000


def exports(namespace: dict) -> dict:
    """What the program defined, as S will see it: plain values copied, modules by name, the rest as names."""
    import types

    out = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            out[name] = {"module": str(getattr(value, "__name__", ""))}
            continue
        try:
            out[name] = {"value": encode(value, budget=[EXPORTED_VALUE_NODES])}
        except Exception:  # not plain data, or too large to copy: S reaches it by name
            out[name] = {"object": True}
        if len(out) >= MAX_EXPORTS:
            break
    return out


def serve_program(code: str, requests: int, replies: int) -> None:
    """Runs inside P, after containment: the completion's code, then one answer per request until S hangs up."""
    handles: list = []
    namespace = {"__name__": "__main__", "__builtins__": builtins}

    def handle_of(obj) -> int:
        handles.append(obj)
        return len(handles) - 1

    def reply(obj) -> None:
        write_all(replies, frame(obj))

    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        ready = {"ready": exports(namespace)}
    except BaseException:  # the program failed: nothing it defined counts
        ready = {"ready": None}
    reply(ready)
    if ready["ready"] is None:
        os._exit(0)
    resolve = handles.__getitem__
    while True:
        try:
            request = read_frame(requests)
        except (EOFError, OSError):
            os._exit(0)
        try:
            ref = request["target"]
            target = None if ref is None else namespace[ref["name"]] if "name" in ref else resolve(ref["handle"])
            op = request["op"]
            if op == "ping":
                result = True
            elif op == "call":
                args = decode(request["args"], resolve)
                kwargs = decode(request["kwargs"], resolve)
                result = target(*args, **kwargs)
            elif op == "getattr":
                result = getattr(target, request["name"])
            elif op == "getitem":
                result = target[decode(request["key"], resolve)]
            elif op == "len":
                result = len(target)
            elif op == "bool":
                result = bool(target)
            elif op == "str":
                result = str(target)
            elif op == "iter":
                result = iter(target)
            elif op == "next":
                result = next(target)
            else:
                raise ValueError(f"unknown operation {op!r}")
            answer = {"ok": encode(result, handle_of)}
        except BaseException as exc:  # the program's own exception, reported by name
            try:
                answer = {"raise": [type(exc).__name__, str(exc)[:300]]}
            except BaseException:
                answer = {"raise": ["Exception", ""]}
        try:
            reply(answer)
        except (TypeError, ValueError, RecursionError):
            reply({"raise": ["ValueError", "an answer that cannot be encoded"]})


def run_stdio_program(code: str) -> None:
    """Runs inside P for a stdin/stdout case: the completion as a script."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except SystemExit as exc:
        code_ = exc.code
        _flush()
        os._exit(0 if code_ is None or code_ == 0 else 1)
    except BaseException:
        _flush()
        os._exit(1)
    _flush()
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


# ---------------------------------------------------------------------------------------------- containment
def enter_run_namespaces(isolated: bool) -> str:
    """In S, once per run: new network, IPC and UTS namespaces (S's test code has no network either) and, when
    not root, a user namespace mapping only our own uid, in which the holders may create PID namespaces and the
    programs their mounts. Returns 'root', 'userns' or 'none'."""
    if not isolated:
        return "none"
    if os.geteuid() == 0:
        _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare(network, IPC, UTS namespaces)")
        return "root"
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
           "creating a user namespace (unshare CLONE_NEWUSER) as an unprivileged user was refused")
    try:
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            with open(path, "w") as fh:
                fh.write(text)
    except OSError as exc:
        raise SetupError(f"writing the user namespace's id maps: {exc}") from None
    return "userns"


def build_root(base: str, binds: list) -> None:
    """In P, before the completion runs: a root of its own, made of a tmpfs, read-only binds of the
    interpreter's files, a private /proc, /tmp, /dev/shm and four device nodes. Nothing else of the host's
    filesystem (the trainer's files, other runs' directories, /etc, /home) exists in it."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")  # (P is PID 1 of its own PID namespace)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.mkdir(base + "/.old")
    _check(_syscall("pivot_root", base.encode(), (base + "/.old").encode()), "pivot_root")
    os.chdir("/")
    for source in binds:
        old = "/.old" + source
        if os.path.islink(old) and source.count("/") == 1:  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(old), source)
            continue
        if not os.path.exists(old):
            continue
        if os.path.isdir(old):
            os.makedirs(source, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(source), exist_ok=True)
            open(source, "w").close()
        _mount(old, source, None, MS_BIND | MS_REC)
        _remount_read_only(source)
    for d in ("/proc", "/tmp", "/dev"):
        os.makedirs(d, exist_ok=True)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for node in ("null", "zero", "urandom", "random"):
        open("/dev/" + node, "w").close()
        _mount("/.old/dev/" + node, "/dev/" + node, None, MS_BIND)
    os.mkdir("/dev/shm")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")


def mount_scratch(tmp_bytes: int) -> None:
    """The program's only writable places, each a size-capped tmpfs (its pages count against nothing else)."""
    for d in ("/tmp", "/dev/shm"):
        _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(tmp_bytes, 4096)},mode=1777")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _remount_read_only(path: str) -> None:
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    try:
        _mount(None, path, None, flags)
    except SetupError:
        # in a user namespace the source mount's locked flags (noexec, noatime, ...) must be kept
        st = os.statvfs(path)
        extra = 0
        for st_flag, ms_flag in ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 0x400), (os.ST_NODIRATIME, 0x800),
                                 (os.ST_RELATIME, 1 << 21)):
            if st.f_flag & st_flag:
                extra |= ms_flag
        _mount(None, path, None, flags | extra)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(mode: str, run_uid: int) -> None:
    """In P: as root, a uid of the run's own (no other process has it, so RLIMIT_NPROC counts this run alone);
    in a user namespace, no capabilities left. Either way no exec may gain privileges again."""
    if mode == "root":
        os.setgroups([])
        os.setresgid(run_uid, run_uid, run_uid)
        os.setresuid(run_uid, run_uid, run_uid)  # from root to another uid: every capability goes
    elif mode == "userns":
        _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
        _check(_syscall("capset", ctypes.byref(header), ctypes.byref(data)), "capset (dropping capabilities)")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")


def set_limits(limits: dict, mode: str) -> None:
    for res, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_bytes"]),
                       (resource.RLIMIT_FSIZE, limits["file_bytes"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NOFILE, 256)):
        resource.setrlimit(res, (value, value))
    if mode != "none":  # the run's own uid (root) or user namespace: the count is this run's processes alone
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))


def close_other_fds(keep) -> None:
    keep = sorted(set(keep))
    lo = 3
    for fd in keep + [1 << 16]:
        if fd >= lo:
            os.closerange(lo, fd)
            lo = fd + 1


# ---------------------------------------------------------------------------------------------- holder and program
class Program:
    """One run of the completion: holder Z forked from S, program P forked from Z as PID 1 of a new PID
    namespace. `stop()` makes Z kill P (the kernel then kills every process of the namespace) and reaps Z once
    the namespace is empty. `serve`: P answers S's questions (test snippets); else P is a script fed stdin."""

    def __init__(self, job: dict, mode: str, stdin_data: bytes, serve: bool):
        self.limits, self.mode, self.serve = job["limits"], mode, serve
        self.output_bytes, self.received = 0, 0
        self.output, self.buffer = bytearray(), bytearray()
        self.broken = None
        self.exit_code = None
        names = ("out", "err", "inp", "report", "life") + (("req", "rep") if serve else ())
        pipes = {name: os.pipe() for name in names}
        child = {"out": pipes["out"][1], "err": pipes["err"][1], "inp": pipes["inp"][0]}
        if serve:
            child.update(req=pipes["req"][0], rep=pipes["rep"][1])
        theirs = set(child.values()) | {pipes["report"][1], pipes["life"][0]}  # Z's (and P's) ends
        self.z = os.fork()
        if self.z == 0:  # ---------------------------------------------------------------------- Z, the holder
            try:
                for fd in {fd for pair in pipes.values() for fd in pair} - theirs:
                    os.close(fd)
                _holder(job, mode, serve, child, pipes["report"][1], pipes["life"][0])
            finally:
                os._exit(70)
        for fd in theirs:
            os.close(fd)
        self.lifeline = pipes["life"][1]
        self.requests = pipes["req"][1] if serve else -1
        self.replies = pipes["rep"][0] if serve else -1
        self.out, self.err, self.stdin = pipes["out"][0], pipes["err"][0], pipes["inp"][1]
        try:
            report = read_frame(pipes["report"][0])
        except (EOFError, ValueError):
            report = {"error": "the holder process died"}
        os.close(pipes["report"][0])
        if "error" in report:
            self.stop()
            raise SetupError(str(report["error"]))
        self.pid, self.ns_inode = report["pid"], report["ns"]  # P's pid on the host, its PID namespace
        self.z_exit = os.pidfd_open(self.z)
        self.pending_stdin = memoryview(stdin_data or b"")
        for fd in (self.replies, self.out, self.err, self.stdin):
            if fd >= 0:
                os.set_blocking(fd, False)
        if not self.pending_stdin:
            self._close("stdin")
        self.next_memory_check = time.monotonic() + 0.02

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        setattr(self, name, -1)

    # -------- waiting on P: its answers, its output, its memory, the deadline
    def pump(self, deadline: float, want_frame: bool):
        """Drive the pipes until a whole frame has arrived (want_frame), or until P's output ends; raises
        ProtocolError when P breaks the protocol, a limit or the deadline."""
        while True:
            if want_frame:
                got = self._take_frame()
                if got is not None:
                    return got
            readers = [fd for fd in (self.replies, self.out, self.err) if fd >= 0]
            writers = [self.stdin] if self.stdin >= 0 else []
            if not readers and not writers:
                return None
            now = time.monotonic()
            if now >= deadline:
                self.fail("the time limit")
            if now >= self.next_memory_check:
                self._check_memory()
                self.next_memory_check = now + 0.02
            r, w, _ = select.select(readers, writers, [], min(deadline - now, 0.02))
            if w:
                self._feed_stdin()
            for fd in r:
                self._drain(fd)

    def wait_exit(self, deadline: float) -> bool:
        """After P's output ended: wait for it to exit by itself (its holder reports). False at the deadline."""
        while self.z > 0:
            now = time.monotonic()
            if now >= deadline:
                return False
            r, _, _ = select.select([self.z_exit], [], [], min(deadline - now, 0.02))
            if r:
                self._reap()
        return True

    def _feed_stdin(self) -> None:
        try:
            n = os.write(self.stdin, self.pending_stdin[:65536])
        except BlockingIOError:
            return
        except BrokenPipeError:  # P closed its stdin: the rest is not wanted
            n = len(self.pending_stdin)
        self.pending_stdin = self.pending_stdin[n:]
        if not self.pending_stdin:
            self._close("stdin")

    def _drain(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self._close("replies" if fd == self.replies else "out" if fd == self.out else "err")
            return
        if fd == self.replies:
            self.received += len(data)
            if self.received > self.limits["message_bytes"]:
                self.fail("the size limit of its answers")
            self.buffer += data
            return
        self.output_bytes += len(data)  # stdout and stderr together
        if self.output_bytes > self.limits["output_bytes"]:
            self.fail("the output limit")
        if not self.serve and fd == self.out:
            self.output += data

    def _take_frame(self):
        size = struct.unpack(">I", self.buffer[:4])[0] if len(self.buffer) >= 4 else None
        if size is not None and size > self.limits["message_bytes"]:
            self.fail("the size limit of its answers")
        if size is None or len(self.buffer) < 4 + size:
            if self.replies < 0:
                self.fail("exiting")
            return None
        body = bytes(self.buffer[4:4 + size])
        del self.buffer[:4 + size]
        try:
            message = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
        except (ValueError, RecursionError, MemoryError):
            self.fail("a malformed answer")
        if type(message) is not dict or len(message) != 1:
            self.fail("a malformed answer")
        return message

    def _check_memory(self) -> None:
        if self.mode != "none" and _namespace_rss(self.pid, self.ns_inode) > self.limits["memory_bytes"]:
            self.fail("the memory limit")

    def fail(self, what: str):
        self.broken = self.broken or what
        raise ProtocolError(self.broken)

    # -------- questions (serve mode)
    def ask(self, deadline: float, request: dict):
        if self.broken:
            raise ProtocolError(self.broken)
        view = memoryview(frame(request))
        while view:
            now = time.monotonic()
            if now >= deadline:
                self.fail("the time limit")
            readers = [fd for fd in (self.out, self.err) if fd >= 0]
            r, w, _ = select.select(readers, [self.requests], [], min(deadline - now, 0.02))
            if w:
                try:
                    view = view[os.write(self.requests, view[:65536]):]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    self.fail("exiting")
            for fd in r:
                self._drain(fd)
        return self.pump(deadline, want_frame=True)

    # -------- the end
    def stop(self) -> None:
        """Kill P (its namespace dies with it) and reap Z, who returns only once the namespace is empty."""
        self._close("lifeline")  # Z sees the hang-up, kills P and waits for the namespace to empty
        if self.z > 0:
            self._reap(block=True)
        for name in ("requests", "replies", "out", "err", "stdin"):
            self._close(name)

    def _reap(self, block: bool = False) -> None:
        done, status = os.waitpid(self.z, 0 if block else os.WNOHANG)
        if done:
            self.exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128
            self.z = -1
            if hasattr(self, "z_exit"):
                os.close(self.z_exit)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _pid_ns_inode(pid) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return -1


def _namespace_rss(pid: int, ns_inode: int) -> int:
    """Resident bytes of every process in P's PID namespace (P and all its descendants, daemons included)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if int(entry) != pid and os.stat(f"/proc/{entry}/ns/pid").st_ino != ns_inode:
                continue
            with open(f"/proc/{entry}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def _holder(job: dict, mode: str, serve: bool, child: dict, report: int, lifeline: int) -> None:
    """Z: a new PID namespace for its one child P; report P's pid (or why the sandbox cannot be built); then wait
    until S hangs up (or dies) or P ends; kill P, wait until its namespace is empty, exit with P's status."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
    try:
        if mode != "none":
            _check(_libc.unshare(CLONE_NEWPID), "unshare(PID namespace)")
        setup_r, setup_w = os.pipe()
        p = os.fork()
    except (SetupError, OSError) as exc:
        write_all(report, frame({"error": str(exc)}))
        os._exit(71)
    if p == 0:  # ---------------------------------------------------------------------------------- P
        try:
            os.close(setup_r)
            os.close(report)
            _program(job, mode, serve, child, lifeline, setup_w)
        finally:
            os._exit(70)
    os.close(setup_w)
    for fd in child.values():
        os.close(fd)
    p_exit = os.pidfd_open(p)
    setup = read_exact(setup_r, 4)  # P's containment is built before any of the completion runs
    message = read_exact(setup_r, struct.unpack(">I", setup)[0]).decode(errors="replace") if setup else "P died"
    os.close(setup_r)
    if message != "ok":
        _kill_and_wait(p, mode)
        write_all(report, frame({"error": message}))
        os._exit(71)
    write_all(report, frame({"pid": p, "ns": _pid_ns_inode(p)}))
    os.close(report)
    r, _, _ = select.select([lifeline, p_exit], [], [])
    os._exit(_kill_and_wait(p, mode))


def _kill_and_wait(p: int, mode: str) -> int:
    try:
        if mode == "none":
            os.killpg(p, signal.SIGKILL)  # P leads its own process group
        else:
            os.kill(p, signal.SIGKILL)  # PID 1 of the namespace: the kernel kills every other process in it
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(p, 0)  # PID 1's exit completes once every process of its namespace is gone
    if os.WIFEXITED(status):
        return min(os.WEXITSTATUS(status), 63)
    return 64 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else 127


def _program(job: dict, mode: str, serve: bool, child: dict, lifeline: int, setup: int) -> None:
    """P: contain, then run the completion's code."""
    limits = job["limits"]
    try:
        if mode != "none":
            build_root(job["base"], job["binds"])
            mount_scratch(limits["tmp_bytes"])
            os.chdir("/tmp")
        else:
            os.setsid()  # without a PID namespace, a process group is what Z can kill
            os.chdir(job["workdir"])
        drop_privileges(mode, UID_BASE + job["supervisor_pid"])
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")  # after the uid change, which clears it
        r, _, _ = select.select([lifeline], [], [], 0)
        if r:  # the holder died before PDEATHSIG was armed
            os._exit(0)
        set_limits(limits, mode)
    except (SetupError, OSError) as exc:
        text = f"{type(exc).__name__}: {exc}".encode()[:4000]
        write_all(setup, struct.pack(">I", len(text)) + text)
        os._exit(71)
    write_all(setup, struct.pack(">I", 2) + b"ok")
    os.close(setup)
    runner = os.fork()
    if runner:  # P stays PID 1 as the namespace's reaper: it takes no signal from inside, so the program (its
        _reap_until(runner)  # child) keeps ordinary signal semantics, and its exit ends the namespace
    os.dup2(child["inp"], 0)
    os.dup2(child["out"], 1)
    os.dup2(child["out"] if serve else child["err"], 2)
    close_other_fds(list(STDIO_FDS) + ([child["req"], child["rep"]] if serve else []))
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.getcwd(), "TMPDIR": os.getcwd(),
                       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["solution.py"]
    if serve:
        serve_program(job["code"], child["req"], child["rep"])
    else:
        run_stdio_program(job["code"])


def _reap_until(runner: int) -> None:
    """PID 1's loop: reap whatever ends (orphans are re-parented here) until the program itself has ended; exit
    with its status (the kernel then kills what is left of the namespace)."""
    close_other_fds([])
    for fd in STDIO_FDS:
        os.close(fd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == runner:
            os._exit(min(os.WEXITSTATUS(status), 63) if os.WIFEXITED(status) else 64 + os.WTERMSIG(status))


# ---------------------------------------------------------------------------------------------- the tests (S)
class RemoteError(Exception):
    """An exception of the program's whose type is not one of Python's builtin exceptions."""


class Remote:
    """A value that stayed inside the program: calls, attributes, items, len, bool, str, iteration go to the
    program; equality, hashing and ordering stay here (identity), so an object cannot claim to equal the answer."""

    __slots__ = ("_sbx_link", "_sbx_ref")

    def __init__(self, link, ref: dict):
        object.__setattr__(self, "_sbx_link", link)
        object.__setattr__(self, "_sbx_ref", ref)

    def __call__(self, *args, **kwargs):
        return self._sbx_link.ask("call", self._sbx_ref, args=list(args), kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("_sbx_"):
            raise AttributeError(name)
        return self._sbx_link.ask("getattr", self._sbx_ref, name=name)

    def __getitem__(self, key):
        return self._sbx_link.ask("getitem", self._sbx_ref, key=key)

    def __len__(self):
        n = self._sbx_link.ask("len", self._sbx_ref)
        if type(n) is not int or n < 0:
            raise TypeError("len() of the program's object is not a non-negative int")
        return n

    def __bool__(self):
        b = self._sbx_link.ask("bool", self._sbx_ref)
        if type(b) is not bool:
            raise TypeError("bool() of the program's object is not a bool")
        return b

    def __str__(self):
        s = self._sbx_link.ask("str", self._sbx_ref)
        if type(s) is not str:
            raise TypeError("str() of the program's object is not a str")
        return s

    def __repr__(self):
        return "<an object of the program under test>"

    def __iter__(self):
        it = self._sbx_link.ask("iter", self._sbx_ref)
        if type(it) is not Remote:
            return iter(it)
        return it

    def __next__(self):
        return self._sbx_link.ask("next", self._sbx_ref)

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


_UNMAPPED = {"SystemExit", "KeyboardInterrupt", "GeneratorExit"}


class Link:
    """S's side of the questions to P."""

    def __init__(self, program: Program, deadline: float):
        self.program, self.deadline = program, deadline

    def ref(self, handle: int) -> Remote:
        return Remote(self, {"handle": handle})

    def _wire(self, value):
        return encode(value, handle_of=self._handle_of)

    @staticmethod
    def _handle_of(obj):
        if type(obj) is Remote and "handle" in obj._sbx_ref:
            return obj._sbx_ref["handle"]
        raise TypeError(f"a {type(obj).__name__} cannot be passed to the program under test (plain data only)")

    def ask(self, op: str, ref: dict, **fields):
        request = {"op": op, "target": ref}
        for key, value in fields.items():
            if key == "kwargs":
                if not all(type(k) is str for k in value):
                    raise TypeError("keyword names must be strings")
                request[key] = self._wire(dict(value))
            elif key == "name":
                request[key] = str(value)
            else:
                request[key] = self._wire(value)
        message = self.program.ask(self.deadline, request)
        if "ok" in message:
            try:
                return decode(message["ok"], self.ref)
            except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
                self.program.fail("a malformed answer")
        if "raise" in message:
            raise self._exception(message["raise"])
        self.program.fail("a malformed answer")

    def _exception(self, body) -> BaseException:
        if not (type(body) is list and len(body) == 2 and all(type(x) is str for x in body)):
            self.program.fail("a malformed answer")
        name, text = body
        if name == "StopIteration":
            return StopIteration()
        cls = getattr(builtins, name, None)
        if name not in _UNMAPPED and isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(text)
            except Exception:
                pass
        return RemoteError(f"{name}: {text}")


def test_namespace(link: Link, exported) -> dict:
    """The globals the test snippets run in: Python's builtins, then the program's names as S sees them. A name
    of the program never shadows a builtin or a standard-library module (its `abs` or `math` could otherwise be
    handed the expected value and agree with it): such names mean Python's own."""
    import importlib

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    if type(exported) is not dict:
        link.program.fail("a malformed answer")
    for name, entry in exported.items():
        if not (type(name) is str and name.isidentifier() and not name.startswith("__")):
            link.program.fail("a malformed answer")
        if type(entry) is not dict or len(entry) != 1:
            link.program.fail("a malformed answer")
        (kind, body), = entry.items()
        if hasattr(builtins, name):
            continue
        if kind == "module" or name in stdlib:
            module = body if kind == "module" and type(body) is str else name
            if module.partition(".")[0] in stdlib:
                try:
                    namespace[name] = importlib.import_module(module)
                except Exception:
                    pass
            continue
        if kind == "value":
            try:
                namespace[name] = decode(body)
            except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
                link.program.fail("a malformed answer")
        elif kind == "object":
            namespace[name] = Remote(link, {"name": name})
        else:
            link.program.fail("a malformed answer")
    return namespace


def run_assert_tests(program: Program, deadline: float, tests: list) -> dict:
    """Each snippet in S, in one namespace shared by the tests (as if they followed the program); a test passes
    when it runs to its end. Any broken answer, limit or deadline: no test passes."""
    link = Link(program, deadline)
    passed = [False] * len(tests)
    try:
        ready = program.pump(deadline, want_frame=True)
        if "ready" not in ready:
            program.fail("a malformed answer")
        if ready["ready"] is None:
            return {"passed": passed, "ended": "the program raised or exited before the tests"}
        namespace = test_namespace(link, ready["ready"])
        for i, test in enumerate(tests):
            try:
                exec(compile(test, f"<test {i}>", "exec"), namespace)
                passed[i] = True
            except ProtocolError:
                raise
            except BaseException:
                passed[i] = False
            if program.broken:
                raise ProtocolError(program.broken)
        # the program must still be answering after the last test: one that dies on the way scores nothing
        program.ask(deadline, {"op": "ping", "target": None})
    except ProtocolError:
        return {"passed": [False] * len(tests), "ended": f"the program broke {program.broken or 'the protocol'}"}
    if program.broken:
        return {"passed": [False] * len(tests), "ended": f"the program broke {program.broken}"}
    return {"passed": passed, "ended": None}


def run_stdio_case(job: dict, mode: str, stdin_data: bytes) -> dict:
    """The program as a script, fed one case's input; its stdout goes back to the judge, which alone holds the
    expected output. A time-out fails the case; the output limit or a setup failure fails the completion."""
    program = Program(job, mode, stdin_data, serve=False)
    deadline = time.monotonic() + job["limits"]["timeout_s"]
    try:
        program.pump(deadline, want_frame=False)  # until its stdout and stderr end (it and its children exited)
        exited = program.wait_exit(deadline)
    except ProtocolError:
        exited = False
    finally:
        program.stop()
    ok = exited and program.exit_code == 0 and not program.broken
    fatal = program.broken not in (None, "the time limit")
    return {"stdout": bytes(program.output).hex() if ok else "", "ok": ok, "fatal": fatal,
            "ended": program.broken or (None if ok else f"exit code {program.exit_code}")}


def _peak_rss_kib() -> int:
    """This process's own resident peak (VmHWM: getrusage's maxrss would include the image exec replaced)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return -1


def main() -> int:
    job = read_frame(0)
    job["supervisor_pid"] = os.getpid()
    result: dict = {}
    try:
        mode = enter_run_namespaces(job["isolated"])
        if mode == "none":
            import tempfile
            job["workdir"] = tempfile.mkdtemp(prefix="dsgrpo-sandbox-")
        # stdin/stdout cases first: their programs fork before any test snippet is in this process
        result["io"] = [run_stdio_case(job, mode, bytes.fromhex(data)) for data in job["inputs"]]
        if job["n_tests"]:
            program = Program(job, mode, None, serve=True)
            deadline = time.monotonic() + job["limits"]["timeout_s"]
            tests = read_frame(0)["tests"]  # only now: the program was forked without them
            try:
                result["asserts"] = run_assert_tests(program, deadline, tests)
            finally:
                program.stop()
        if mode == "none":
            import shutil
            shutil.rmtree(job["workdir"], ignore_errors=True)
    except SetupError as exc:
        result = {"unavailable": str(exc)}
    result["supervisor_maxrss_kib"] = _peak_rss_kib()
    sys.stdout.buffer.write(frame(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
