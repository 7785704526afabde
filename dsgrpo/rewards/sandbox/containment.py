"""Containment: the namespaces, root, identity and limits of a process that runs code the trainer does not trust.

A run has two contained processes, each built the same way by a `Cell`:

    supervisor S (trusted: never runs a test, never decodes an answer)
      ├─ holder Z ── program P    PID 1 of its own PID namespace; the completion's code runs in its child
      └─ holder Z ── checker C    PID 1 of its own PID namespace; runs the tests, one child process per test

Each cell: its own PID namespace (the kernel kills every process in it when PID 1 dies) and IPC namespace (System V
objects die with it), the supervisor's network namespace (no interface up) and UTS namespace, a mount namespace
whose root holds only the interpreter's files read-only, a private /proc, and small /tmp and /dev/shm tmpfs; the
run's cgroup (memory, pids, CPU); a uid of its own (as root) or no capabilities (in a user namespace);
NO_NEW_PRIVS; rlimits; a seccomp filter (limits.py). Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import sys

from .limits import install_seccomp, set_rlimits
from .protocol import frame, read_exact, write_all

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 1, 38, 4
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
# As root each run's processes get uids of their own: the program UID_BASE + the supervisor's pid, the checker
# CHECKER_UID_OFFSET above that (pids stay below 2**22), so neither can signal the other or share an rlimit count.
UID_BASE, CHECKER_UID_OFFSET = 0x7F000000, 1 << 22
STDIO_FDS = (0, 1, 2)

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built here (a namespace, mount or cgroup refused): the judge refuses to score."""


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()
    check(
        _libc.mount(enc(source), target.encode(), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target} ({fstype or 'bind'})",
    )


def _syscall(name: str, *args) -> int:
    number = SYSCALLS.get(os.uname().machine, {}).get(name)
    if number is None:
        raise SetupError(f"no {name} syscall number known for {os.uname().machine}")
    return _libc.syscall(number, *args)


def prctl(option: int, arg: int, what: str) -> None:
    check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), what)


# ---------------------------------------------------------------------------------------------- namespaces
def enter_run_namespaces(isolated: bool) -> str:
    """In S, once: new network and UTS namespaces (nothing of the run has a network) and, when not root, a user
    namespace mapping only our own uid, in which the holders may create PID namespaces and the cells their
    mounts. Returns 'root', 'userns' or 'none'."""
    if not isolated:
        return "none"
    if os.geteuid() == 0:
        check(_libc.unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare(network, IPC, UTS namespaces)")
        return "root"
    uid, gid = os.geteuid(), os.getegid()
    check(
        _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
        "creating a user namespace (unshare CLONE_NEWUSER) as an unprivileged user was refused",
    )
    try:
        for path, text in (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"{uid} {uid} 1"),
            ("/proc/self/gid_map", f"{gid} {gid} 1"),
        ):
            with open(path, "w") as fh:
                fh.write(text)
    except OSError as exc:
        raise SetupError(f"writing the user namespace's id maps: {exc}") from None
    return "userns"


def build_root(base: str, binds: list) -> None:
    """A root of its own, made of a tmpfs, read-only binds of the interpreter's files, a private /proc and four
    device nodes. Nothing else of the host's filesystem (the trainer's files, other runs' directories, /etc,
    /home) exists in it."""
    check(_libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.mkdir(base + "/.old")
    check(_syscall("pivot_root", base.encode(), (base + "/.old").encode()), "pivot_root")
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
    check(_libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")


def mount_scratch(tmp_bytes: int) -> None:
    """The only writable places, each a size-capped tmpfs (its pages count in the run's memory cgroup)."""
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
        for st_flag, ms_flag in (
            (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, 0x400),
            (os.ST_NODIRATIME, 0x800),
            (os.ST_RELATIME, 1 << 21),
        ):
            if st.f_flag & st_flag:
                extra |= ms_flag
        _mount(None, path, None, flags | extra)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(mode: str, uid: int) -> None:
    """As root, a uid of the cell's own (every capability goes with the change); in a user namespace, no
    capabilities left. Either way no exec may gain privileges again."""
    if mode == "root":
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif mode == "userns":
        _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
        check(_syscall("capset", ctypes.byref(header), ctypes.byref(data)), "capset (dropping capabilities)")
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")


def close_other_fds(keep) -> None:
    keep = sorted(set(keep))
    lo = 3
    for fd in keep + [1 << 16]:
        if fd >= lo:
            os.closerange(lo, fd)
            lo = fd + 1


# ---------------------------------------------------------------------------------------------- cells
class Cell:
    """One contained process of a run: holder Z forked from S, and C, forked from Z as PID 1 of a new PID (and IPC)
    namespace, which contains itself and then runs `body(fds)` (never returning). `reaper`: C forks the body and
    stays PID 1, reaping orphans (the body keeps ordinary signal semantics: the program); else C runs the body
    itself (the checker: as PID 1 it takes no signal from its own children). `fds`: child-side descriptors by
    name, kept open at their numbers; `stdio`: the body's stdin, stdout, stderr. `stop()` makes Z kill C (the
    kernel then kills every process of the namespace) and reaps Z once the namespace is empty."""

    def __init__(
        self,
        job: dict,
        mode: str,
        role: str,
        uid: int,
        cgroups,
        rlimits: dict,
        stdio: tuple,
        fds: dict,
        body,
        reaper: bool,
    ):
        report_r, report_w = os.pipe()
        life_r, life_w = os.pipe()
        self.z = os.fork()
        if self.z == 0:  # ------------------------------------------------------------------------- Z
            try:
                close_other_fds([report_w, life_r, *stdio, *fds.values()])
                _holder(job, mode, role, uid, cgroups, rlimits, stdio, fds, body, reaper, report_w, life_r)
            finally:
                os._exit(70)
        os.close(report_w)
        os.close(life_r)
        self.lifeline = life_w
        self.exit_code = None
        try:
            report = _read_report(report_r)
        finally:
            os.close(report_r)
        if "error" in report:
            self.stop()
            raise SetupError(str(report["error"]))
        self.pid = report["pid"]  # C's pid on the host
        self.z_exit = os.pidfd_open(self.z)

    def exited(self) -> bool:
        """Whether C has ended (its holder reaps it and exits): non-blocking."""
        if self.z > 0:
            self._reap(block=False)
        return self.z < 0

    def stop(self) -> None:
        """Kill C (its namespace dies with it) and reap Z, who returns only once the namespace is empty."""
        if self.lifeline >= 0:
            os.close(self.lifeline)  # Z sees the hang-up, kills C and waits for the namespace to empty
            self.lifeline = -1
        if self.z > 0:
            self._reap(block=True)

    def _reap(self, block: bool) -> None:
        done, status = os.waitpid(self.z, 0 if block else os.WNOHANG)
        if done:
            self.exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128
            self.z = -1
            if hasattr(self, "z_exit"):
                os.close(self.z_exit)


def _read_report(fd: int) -> dict:
    head = read_exact(fd, 4)
    if not head:
        return {"error": "the holder process died"}
    import json

    try:
        return json.loads(read_exact(fd, struct.unpack(">I", head)[0]))
    except (EOFError, ValueError):
        return {"error": "the holder process died"}


def _holder(job, mode, role, uid, cgroups, rlimits, stdio, fds, body, reaper, report, lifeline) -> None:
    """Z: join the run's cgroup; a new PID and IPC namespace for its one child C; report C's pid (or why the
    sandbox cannot be built); then wait until S hangs up (or dies) or C ends; kill C, wait until its namespace is
    empty, exit with C's status."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
    try:
        if cgroups is not None:
            try:
                cgroups.join(role)
            except OSError as exc:
                raise SetupError(f"joining the run's cgroup: {exc}") from None
        if mode != "none":
            check(_libc.unshare(CLONE_NEWPID | CLONE_NEWIPC), "unshare(PID and IPC namespaces)")
        setup_r, setup_w = os.pipe()
        c = os.fork()
    except (SetupError, OSError) as exc:
        write_all(report, frame({"error": str(exc)}))
        os._exit(71)
    if c == 0:  # ---------------------------------------------------------------------------------- C
        try:
            os.close(setup_r)
            os.close(report)
            _contained(job, mode, uid, rlimits, stdio, fds, body, reaper, lifeline, setup_w)
        finally:
            os._exit(70)
    os.close(setup_w)
    for fd in {*stdio, *fds.values()}:
        os.close(fd)
    c_exit = os.pidfd_open(c)
    setup = read_exact(setup_r, 4)  # C's containment is built before any of its body runs
    message = read_exact(setup_r, struct.unpack(">I", setup)[0]).decode(errors="replace") if setup else "C died"
    os.close(setup_r)
    if message != "ok":
        _kill_and_wait(c, mode)
        write_all(report, frame({"error": message}))
        os._exit(71)
    write_all(report, frame({"pid": c}))
    os.close(report)
    select.select([lifeline, c_exit], [], [])
    os._exit(_kill_and_wait(c, mode))


def _kill_and_wait(c: int, mode: str) -> int:
    try:
        if mode == "none":
            os.killpg(c, signal.SIGKILL)  # C leads its own process group
        else:
            os.kill(c, signal.SIGKILL)  # PID 1 of the namespace: the kernel kills every other process in it
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(c, 0)  # PID 1's exit completes once every process of its namespace is gone
    if os.WIFEXITED(status):
        return min(os.WEXITSTATUS(status), 63)
    return 64 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else 127


def _contained(job, mode, uid, rlimits, stdio, fds, body, reaper, lifeline, setup) -> None:
    """C: contain, then run the body."""
    try:
        if mode != "none":
            build_root(job["base"], job["binds"])
            mount_scratch(job["limits"]["tmp_bytes"])
            os.chdir("/tmp")
        else:
            os.setsid()  # without a PID namespace, a process group is what Z can kill
            os.chdir(job["workdir"])
        drop_privileges(mode, uid)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")  # after the uid change, which clears it
        r, _, _ = select.select([lifeline], [], [], 0)
        if r:  # the holder died before PDEATHSIG was armed
            os._exit(0)
        set_rlimits(**rlimits)
        if mode != "none":
            install_seccomp(new_processes=True)
    except (SetupError, OSError) as exc:
        text = f"{type(exc).__name__}: {exc}".encode()[:4000]
        write_all(setup, struct.pack(">I", len(text)) + text)
        os._exit(71)
    write_all(setup, struct.pack(">I", 2) + b"ok")
    os.close(setup)
    if reaper:
        child = os.fork()
        if child:  # PID 1 stays the namespace's reaper; the body's exit ends the namespace
            _reap_until(child)
    for target, fd in zip(STDIO_FDS, stdio):
        os.dup2(fd, target)
    close_other_fds(list(STDIO_FDS) + list(fds.values()))
    os.environ.clear()
    os.environ.update(
        {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": os.getcwd(),
            "TMPDIR": os.getcwd(),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["solution.py"]
    body(fds)
    os._exit(0)


def _reap_until(child: int) -> None:
    """PID 1's loop: reap whatever ends (orphans are re-parented here) until the body itself has ended; exit with
    its status (the kernel then kills what is left of the namespace)."""
    close_other_fds([])
    for fd in STDIO_FDS:
        os.close(fd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            os._exit(min(os.WEXITSTATUS(status), 63) if os.WIFEXITED(status) else 64 + os.WTERMSIG(status))
