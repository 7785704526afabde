"""The supervisor (S): one process per scored completion, started by the judge (judge.py) as
`python -I -S -c "...supervisor.main()"`. Standard library only.

Who trusts whom:

    judge (the trainer: holds the expected outputs of stdin/stdout cases; reads S's verdict on a pipe of its own)
      └─ supervisor S (trusted: runs only this package's code; never a test, never an answer's decoding)
           ├─ program cell P (containment.py): the completion's code; answers questions (program.py)
           └─ checker cell C: the test snippets, one process per test, asking P (checker.py)

S builds the run (its cgroups, both cells), feeds stdin and reads stdout for stdin/stdout cases, and for test
snippets waits for C's verdicts while it counts P's output, the run's CPU time and both cells' memory (the
kernel's count, in cgroups.py). The tests reach S only after P is running, so P was never forked with them in its
memory. Any limit broken ends the run: it scores 0. Frames on every pipe: protocol.py.

On the result pipe to the judge: per stdin/stdout case, as soon as it ends, a JSON frame {"case": i, "ok", "fatal",
"ended", figures, "stdout_bytes": n} and then n raw bytes of its stdout (S keeps no case's output past its frame);
at the end one JSON frame without "case": {"asserts": ...} and S's own peak memory, or {"unavailable": why}.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

from . import checker, names, program
from .cgroups import CgroupUnavailable, RunCgroups, where_runs_go
from .containment import CHECKER_UID_OFFSET, UID_BASE, Cell, SetupError, enter_run_namespaces
from .protocol import ProtocolError, frame, read_frame, write_all

POLL_S = 0.02  # how often the run's CPU time and memory events are read
VERDICT_BYTES = 1 << 20  # the checker's messages not yet read, at most


class Supervisor:
    def __init__(self, job: dict, mode: str):
        self.job, self.mode, self.limits = job, mode, job["limits"]
        self.runs = 0
        self.row_output = 0  # stdout + stderr of the row's stdin/stdout cases so far
        self.devnull = os.open("/dev/null", os.O_RDWR)
        self.where = None
        if mode != "none":
            try:
                self.where = where_runs_go(job.get("cgroup_base"))
            except CgroupUnavailable as exc:
                raise SetupError(f"no cgroup for the runs' memory and CPU time: {exc.strerror or exc}") from None

    # -------- the pieces of a run
    def _cgroups(self):
        if self.where is None:
            return None
        self.runs += 1
        limits = self.limits
        try:
            return RunCgroups(
                self.where,
                f"dsgrpo-{os.getpid()}-{self.runs}",
                limits["memory_bytes"],
                limits["checker_memory_bytes"],
                limits["processes"],
            )
        except CgroupUnavailable as exc:
            raise SetupError(
                f"no cgroup for the runs' memory and CPU time ({exc.strerror}); as root it is made "
                "under the trainer's own cgroup, otherwise set DSGRPO_SANDBOX_CGROUP to a cgroup "
                "delegated to this user"
            ) from None

    def _rlimits(self, role: str) -> dict:
        limits = self.limits
        own_uid = self.mode == "root"  # RLIMIT_NPROC counts per uid: only where the uid is the cell's alone
        if role == "program":
            return {
                "cpu_s": limits["cpu_s"],
                "address_space": limits["memory_bytes"],
                "file_bytes": limits["file_bytes"],
                "processes": limits["processes"] if own_uid else 0,
            }
        return {
            "cpu_s": limits["cpu_s"],
            "address_space": max(limits["memory_bytes"], limits["checker_memory_bytes"]),
            "file_bytes": limits["file_bytes"],
            "processes": 16 if own_uid else 0,
        }

    def _cell(self, role, cgroups, stdio, fds, body, reaper) -> Cell:
        uid = UID_BASE + os.getpid() + (CHECKER_UID_OFFSET if role == "checker" else 0)
        return Cell(self.job, self.mode, role, uid, cgroups, self._rlimits(role), stdio, fds, body, reaper)

    # -------- a stdin/stdout case
    def stdio_case(self, stdin_data: bytes) -> tuple:
        """The program as a script, fed one case's input: (how it ended, its stdout), the stdout for the judge,
        which alone holds the expected output. A time-out fails the case; an output limit (the run's or the row's)
        or a setup failure fails the completion."""
        code = self.job["code"]
        cgroups = self._cgroups()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        watch = Watch(self.limits, self.mode, cgroups, self.limits["row_output_bytes"] - self.row_output)
        cell = None
        try:
            cell = self._cell(
                "program", cgroups, (in_r, out_w, err_w), {}, lambda fds: program.run_script(code), reaper=True
            )
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
            if cell is None:
                _close(in_w, out_r, err_r)
                if cgroups is not None:
                    cgroups.remove()
        output, pending = bytearray(), memoryview(stdin_data)
        # never a blocking write: a program that stops reading its stdin would hold this process in write() past
        # every limit (the deadline and the CPU count are checked between selects only)
        os.set_blocking(in_w, False)
        if not pending:
            os.close(in_w)
            in_w = -1
        readers = [out_r, err_r]
        try:
            while readers or in_w >= 0:  # until its stdout and stderr end (it and its children exited)
                r, w, _ = select.select(readers, [in_w] if in_w >= 0 else [], [], watch.wait())
                watch.check()
                if w:
                    try:
                        n = os.write(in_w, pending[:65536])
                    except BlockingIOError:
                        n = 0
                    except BrokenPipeError:  # it closed its stdin: the rest is not wanted
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        os.close(in_w)
                        in_w = -1
                for fd in r:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        readers.remove(fd)
                        continue
                    watch.output(len(data))
                    if fd == out_r:
                        output += data
            while not cell.exited():  # it may still be running after closing its output
                select.select([cell.z_exit], [], [], watch.wait())
                watch.check()
        except ProtocolError:
            pass
        finally:
            cell.stop()
            _close(in_w, out_r, err_r)
            watch.finish()
        self.row_output += watch.output_bytes
        ok = watch.broken is None and cell.exit_code == 0
        fatal = watch.broken not in (None, "the time limit")
        if not ok:
            output = bytearray()
        return {
            "ok": ok,
            "fatal": fatal,
            "ended": watch.broken or (None if ok else f"exit code {cell.exit_code}"),
            "stdout_bytes": len(output),
            **watch.figures(),
        }, output

    # -------- test snippets
    def snippets(self) -> dict:
        """The program serving answers, the checker asking and judging. Both cells are forked before the tests are
        read from the judge, so neither holds them; each test goes to the one process that runs it, when the
        checker asks for it. The verdicts, or none when a limit broke."""
        code, limits = self.job["code"], self.limits
        cgroups = self._cgroups()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        out_r, out_w = os.pipe()
        tests_r, tests_w = os.pipe()
        control_r, control_w = os.pipe()
        watch = Watch(limits, self.mode, cgroups)
        cells, ours = [], [out_r, tests_w, control_r]
        try:
            try:
                cells.append(
                    self._cell(
                        "program",
                        cgroups,
                        (self.devnull, out_w, out_w),
                        {"requests": req_r, "replies": rep_w},
                        lambda fds: program.serve(code, fds["requests"], fds["replies"]),
                        reaper=True,
                    )
                )
                contained = self.mode != "none"
                cells.append(
                    self._cell(
                        "checker",
                        cgroups,
                        (self.devnull,) * 3,
                        {"requests": req_w, "replies": rep_r, "tests": tests_r, "control": control_w},
                        lambda fds: checker.run(limits, contained, fds),
                        reaper=False,
                    )
                )
            finally:
                _close(req_r, req_w, rep_r, rep_w, out_w, tests_r, control_w)
            material = read_frame(0)  # only now: both cells were forked without the tests in memory
            tests, setup = material["tests"], material["setup"]
            plan = names.plan_names(tests, setup, material["entry_points"])
            verdicts = self._converse(watch, out_r, tests_w, control_r, plan, tests, setup)
        finally:
            for cell in cells:
                cell.stop()
            _close(*ours)
            watch.finish()
        n = len(tests)
        if watch.broken:
            return {"passed": [False] * n, "ended": f"the program broke {watch.broken}", **watch.figures()}
        if verdicts is None:
            return {"passed": [False] * n, "ended": "the checker ended without a verdict", **watch.figures()}
        passed, ended = verdicts
        return {"passed": [False] * n if ended else passed, "ended": ended, **watch.figures()}

    def _converse(self, watch, out_r, tests_w, control_r, plan, tests, setup):
        """Serve the checker: the names plan, then test i when it asks for it; collect its verdicts, count the
        program's output. (passed, ended), or None when the checker broke off."""
        pending = bytearray(frame(plan))
        received = bytearray()
        passed, asked = [False] * len(tests), -1
        readers = [out_r, control_r]
        os.set_blocking(tests_w, False)
        try:
            while control_r in readers:
                r, w, _ = select.select(readers, [tests_w] if pending else [], [], watch.wait())
                watch.check()
                if w:
                    try:
                        del pending[: os.write(tests_w, pending[:65536])]
                    except BlockingIOError:
                        pass
                for fd in r:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        readers.remove(fd)
                    elif fd == out_r:
                        watch.output(len(data))  # the program's prints: counted, not kept
                    else:
                        received += data
                while len(received) >= 4 and len(received) >= 4 + int.from_bytes(received[:4], "big"):
                    size = int.from_bytes(received[:4], "big")
                    message = _message(bytes(received[4 : 4 + size]))
                    del received[: 4 + size]
                    if message is None:
                        return None
                    if "next" in message:  # the checker's next test process is waiting for its test
                        if message["next"] != asked + 1 or message["next"] >= len(tests):
                            return None
                        asked += 1
                        pending += frame({"index": asked, "test": tests[asked], "setup": setup})
                    elif "verdict" in message:
                        if message["verdict"] != asked or type(message["passed"]) is not bool:
                            return None
                        passed[asked] = message["passed"]
                    else:
                        ended = message["done"]
                        if ended is None and asked != len(tests) - 1:
                            return None
                        return passed, ended
                if len(received) > VERDICT_BYTES:
                    return None
        except ProtocolError:
            return None
        return None


def _message(body: bytes):
    """One message of the checker's, or None when it is not one."""
    try:
        message = json.loads(body)
    except ValueError:
        return None
    if type(message) is not dict:
        return None
    if set(message) == {"next"} and type(message["next"]) is int:
        return message
    if set(message) == {"verdict", "passed"} and type(message["verdict"]) is int:
        return message
    if set(message) == {"done"} and (
        message["done"] is None or (type(message["done"]) is str and len(message["done"]) <= 1000)
    ):
        return message
    return None


class Watch:
    """A run's limits as S enforces them: CPU seconds of all the run's processes (its cgroup: a neighbour's load
    does not count against it), a wall-clock backstop for a run that waits, both cells' memory (the kernel's OOM
    count in each cgroup), and the program's output. Without containment (`none`), the wall clock alone."""

    def __init__(self, limits: dict, mode: str, cgroups, row_left=None):
        self.limits, self.cgroups = limits, cgroups
        # what this run may print: the run's own limit, or what is left of the row's when that is less
        self.output_left, self.output_limit = limits["output_bytes"], "the output limit"
        if row_left is not None and row_left < self.output_left:
            self.output_left, self.output_limit = row_left, "the row's output limit"
        self.start = time.monotonic()
        wall = limits["wall_timeout_s"] or 2 * limits["timeout_s"] + 1
        self.deadline = self.start + (wall if cgroups is not None else limits["timeout_s"])
        self.next_poll = self.start + POLL_S
        self.output_bytes = 0
        self.broken = None
        self.cpu_s = 0.0
        self.checker_peak = -1

    def fail(self, what: str):
        self.broken = self.broken or what
        raise ProtocolError(self.broken)

    def wait(self) -> float:
        """How long a select may wait before the next check."""
        return max(0.0, min(self.deadline, self.next_poll) - time.monotonic())

    def check(self) -> None:
        now = time.monotonic()
        if now >= self.deadline:
            self.fail("the time limit")
        if self.cgroups is None or now < self.next_poll:
            return
        self.next_poll = now + POLL_S
        self.cpu_s = self.cgroups.cpu_seconds()
        if self.cpu_s > self.limits["timeout_s"]:
            self.fail("the time limit")
        if self.cgroups.oom_kills("program"):
            self.fail("the memory limit")
        if self.cgroups.oom_kills("checker"):
            self.fail("the checker's memory limit")

    def output(self, n: int) -> None:
        self.output_bytes += n  # stdout and stderr together
        if self.output_bytes > self.output_left:
            self.fail(self.output_limit)

    def finish(self) -> None:
        """After the run's processes are gone: last figures, and the cgroups removed."""
        if self.cgroups is None:
            return
        self.cpu_s = self.cgroups.cpu_seconds()
        self.checker_peak = self.cgroups.peak_bytes("checker")
        if self.broken is None and self.cgroups.oom_kills("program"):
            self.broken = "the memory limit"
        self.cgroups.remove()

    def figures(self) -> dict:
        return {
            "cpu_s": round(self.cpu_s, 4),
            "checker_peak_bytes": self.checker_peak,
            "wall_s": round(time.monotonic() - self.start, 4),
        }


def _close(*fds) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _peak_rss_kib() -> int:
    """This process's own resident peak (VmHWM: getrusage's maxrss would include the image exec replaced)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return -1


def main() -> int:
    job = read_frame(0)
    result: dict = {}
    try:
        mode = enter_run_namespaces(job["isolated"])
        if mode == "none":
            import tempfile

            job["workdir"] = tempfile.mkdtemp(prefix="dsgrpo-sandbox-")
        names.helper_names()  # imported once here, not in every checker
        supervisor = Supervisor(job, mode)
        # stdin/stdout cases first: their programs fork before any test snippet is in this process. Each case's
        # stdout goes to the judge as soon as the case ends, and is not kept; after a limit that fails the row,
        # nothing more runs
        fatal = False
        for i, data in enumerate(job["inputs"]):
            run, stdout = supervisor.stdio_case(bytes.fromhex(data))
            write_all(job["result_fd"], frame({"case": i, **run}))
            write_all(job["result_fd"], stdout)
            del stdout
            if run["fatal"]:
                fatal = True
                break
        if job["n_tests"] and not fatal:
            result["asserts"] = supervisor.snippets()
        if mode == "none":
            import shutil

            shutil.rmtree(job["workdir"], ignore_errors=True)
    except SetupError as exc:
        result = {"unavailable": str(exc)}
    result["supervisor_maxrss_kib"] = _peak_rss_kib()
    write_all(job["result_fd"], frame(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
