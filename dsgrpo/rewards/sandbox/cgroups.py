"""The cgroups of one sandbox run: what the kernel counts for it, where /proc cannot see.

Resident memory read from /proc misses what a run can hold without mapping it (memfd, System V and POSIX shared
memory, tmpfs pages) and a time limit on the wall clock is shared with every neighbour on the machine. So each run
gets a cgroup of its own, with a child for the program's processes and one for the checker (the process that runs
the tests and decodes the program's answers):

    <base>/dsgrpo-<supervisor pid>-<n>/          CPU: counted for the whole run; weighted like every other run
        program/                                 memory.max = memory_bytes, pids.max = processes
        checker/                                 memory.max = checker_memory_bytes

Both cgroup versions: v1 (a hierarchy per controller: memory, cpu, cpuacct, pids) and v2 (one unified tree).
`<base>` is the supervisor's own cgroup, or DSGRPO_SANDBOX_CGROUP: a cgroup delegated to the user the trainer runs
as, given as a path inside the hierarchies ('/jobs/me'), or relative to the trainer's own cgroup in each ('me').
Standard library only.
"""

from __future__ import annotations

import errno
import os
import signal
import time

V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
V2_CONTROLLERS = ("memory", "cpu", "pids")
PARTS = ("program", "checker")
DRAIN_S = 10.0  # how long killed processes may take to leave their cgroup (a SIGKILL is acted on at once, except
#                 by a process in an uninterruptible wait)


class CgroupUnavailable(OSError):
    """No cgroup can be made for the runs here (no controllers mounted, or none this user may write)."""


def locate(mountinfo: str, own: str, base: str | None = None) -> dict:
    """Where runs' cgroups go, from /proc/self/mountinfo and /proc/self/cgroup: {'version': 1, 'dirs':
    {controller: directory}} or {'version': 2, 'dirs': {'': directory}}. `base` (a path inside the hierarchies)
    replaces this process's own cgroup. A pure function of its inputs."""
    v1_mounts, v2_mount = {}, None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], rfields[0], rfields[2].split(",")
        if fstype == "cgroup":
            for controller in V1_CONTROLLERS:
                if controller in options:
                    v1_mounts.setdefault(controller, (root, point))
        elif fstype == "cgroup2" and v2_mount is None:
            v2_mount = (root, point)
    own_v1, own_v2 = {}, None
    for line in own.splitlines():
        number, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if number == "0" and names == "":
            own_v2 = path
        for name in names.split(","):
            own_v1[name] = path

    def join(mount, path):
        if base:
            path = base if base.startswith("/") else path.rstrip("/") + "/" + base
        root, point = mount
        if root != "/" and (path == root or path.startswith(root + "/")):
            path = path[len(root) :] or "/"
        return os.path.normpath(point + "/" + path.lstrip("/"))

    if all(c in v1_mounts and c in own_v1 for c in V1_CONTROLLERS):
        return {"version": 1, "dirs": {c: join(v1_mounts[c], own_v1[c]) for c in V1_CONTROLLERS}}
    if v2_mount is not None and own_v2 is not None:
        return {"version": 2, "dirs": {"": join(v2_mount, own_v2)}}
    raise CgroupUnavailable(errno.ENOENT, "no cgroup hierarchy with the memory, cpu and pids controllers is mounted")


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class RunCgroups:
    """The cgroups of one run, made at construction; `remove()` takes them away once their processes are gone."""

    def __init__(self, where: dict, name: str, memory_bytes: int, checker_memory_bytes: int, processes: int):
        self.version, self.name = where["version"], name
        # one directory per distinct hierarchy (cpu and cpuacct are often mounted together)
        self.bases = {}
        for controller, directory in where["dirs"].items():
            self.bases.setdefault(directory, []).append(controller)
        self.made: list = []
        try:
            for base, controllers in self.bases.items():
                if self.version == 2:
                    self._enable_v2(base)
                run = os.path.join(base, name)
                os.mkdir(run)
                self.made.append(run)
                if self.version == 2:
                    _write(os.path.join(run, "cgroup.subtree_control"), " ".join(f"+{c}" for c in V2_CONTROLLERS))
                for part in PARTS:
                    os.mkdir(os.path.join(run, part))
                    self.made.append(os.path.join(run, part))
            self._limit("program", memory_bytes, processes)
            self._limit("checker", checker_memory_bytes, 16)
        except OSError as exc:
            self.remove()
            where_text = ", ".join(self.bases)
            raise CgroupUnavailable(
                exc.errno or errno.EIO, f"making the run's cgroup under {where_text}: {exc.strerror or exc}"
            ) from None

    @staticmethod
    def _enable_v2(base: str) -> None:
        wanted = set(V2_CONTROLLERS)
        if wanted <= set(_read(os.path.join(base, "cgroup.subtree_control")).split()):
            return
        missing = wanted - set(_read(os.path.join(base, "cgroup.controllers")).split())
        if missing:
            raise OSError(errno.ENOENT, f"controllers {sorted(missing)} not available in {base}")
        # fails (EBUSY) where the base itself holds processes: cgroup v2 puts processes only in leaves
        _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(wanted)))

    def _dir(self, controller: str, part: str = "") -> str:
        for base, controllers in self.bases.items():
            if self.version == 2 or controller in controllers:
                return os.path.join(base, self.name, part)
        raise KeyError(controller)

    def _limit(self, part: str, memory_bytes: int, processes: int) -> None:
        memory = self._dir("memory", part)
        if self.version == 1:
            _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
        else:
            _write(os.path.join(memory, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(memory, "memory.swap.max")):
                _write(os.path.join(memory, "memory.swap.max"), "0")
        _write(os.path.join(self._dir("pids", part), "pids.max"), str(processes))

    def join(self, part: str, pid: int = 0) -> None:
        """Move process `pid` (this one by default) into `part` of the run, in every hierarchy."""
        pid = pid or os.getpid()
        for base in self.bases:
            _write(os.path.join(base, self.name, part, "cgroup.procs"), str(pid))

    def cpu_seconds(self) -> float:
        """CPU time of every process of the run so far, both parts together."""
        try:
            if self.version == 1:
                return int(_read(os.path.join(self._dir("cpuacct"), "cpuacct.usage"))) / 1e9
            return _field(_read(os.path.join(self._dir("cpu"), "cpu.stat")), "usage_usec") / 1e6
        except (OSError, ValueError):
            return 0.0

    def oom_kills(self, part: str) -> int:
        """Processes of `part` the kernel killed at its memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            return _field(_read(os.path.join(self._dir("memory", part), name)), "oom_kill")
        except (OSError, ValueError):
            return 0

    def peak_bytes(self, part: str) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int(_read(os.path.join(self._dir("memory", part), name)).split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    def remove(self) -> None:
        """Remove the run's cgroups, children first, once every process in them is killed and gone (drain): the
        supervisor calls it after the cells stopped, so normally there is nothing left to kill; whatever the
        program did (a process that outlived its cell, a supervisor that gave up waiting), no cgroup stays."""
        drain([p for p in self.made if os.path.basename(p) not in PARTS])
        _rmdir_all(reversed(self.made))
        self.made = [p for p in self.made if os.path.isdir(p)]


def _processes(run: str) -> set:
    """Processes (their pids, as this process sees them) in a run's cgroup and its parts."""
    pids = set()
    for d in (run, *(os.path.join(run, part) for part in PARTS)):
        try:
            pids.update(int(line) for line in _read(os.path.join(d, "cgroup.procs")).split())
        except (OSError, ValueError):
            pass
    return pids


def _still_in(pid: int, runs: list) -> bool:
    """Whether `pid` (a pidfd of it is open, so the number cannot be reused meanwhile) is in one of `runs`."""
    names = {os.path.basename(run) for run in runs}
    try:
        lines = _read(f"/proc/{pid}/cgroup").splitlines()
    except OSError:
        return False
    return any(names & set(line.split(":", 2)[-1].split("/")) for line in lines)


def drain(runs: list, timeout: float = DRAIN_S) -> bool:
    """Kill every process in the run cgroups `runs` (directories, any hierarchy) and wait until none is left.
    cgroup v2's cgroup.kill where the kernel has it (it also catches a process forked meanwhile); else each pid
    read from cgroup.procs, through a pidfd and only while that process is still in the run (never a pid some
    other process took since), until the cgroups read empty. True once they are."""
    deadline = time.monotonic() + timeout
    for run in runs:
        if os.path.exists(os.path.join(run, "cgroup.kill")):
            try:
                _write(os.path.join(run, "cgroup.kill"), "1")
            except OSError:
                pass
    while True:
        pids = set().union(*(_processes(run) for run in runs)) if runs else set()
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone already
            try:
                if _still_in(pid, runs):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.005)


def _rmdir_all(paths) -> None:
    """rmdir each (children first); an exiting process can hold its cgroup for a moment, hence the short retry."""
    deadline = time.monotonic() + 2.0
    for path in paths:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    break
                time.sleep(0.005)


def remove_stale(where: dict, supervisor_pid: int) -> None:
    """Remove what a killed supervisor left behind: its cells die with it (PDEATHSIG), but not at once, and a
    cgroup holding a process cannot be removed, so every process in them is killed and awaited first."""
    prefix = f"dsgrpo-{supervisor_pid}-"
    runs = []
    for base in set(where["dirs"].values()):
        try:
            runs += [os.path.join(base, n) for n in os.listdir(base) if n.startswith(prefix)]
        except OSError:
            continue
    drain(runs)
    _rmdir_all([os.path.join(run, part) for run in runs for part in PARTS] + runs)


def where_runs_go(base: str | None = None) -> dict:
    try:
        return locate(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"), base)
    except OSError as exc:
        raise CgroupUnavailable(exc.errno or errno.ENOENT, str(exc)) from None
