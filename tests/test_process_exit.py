"""How dsgrpo's entry points end (dsgrpo/process_exit.py) and the exit hook that keeps vLLM's shutdown from collecting
garbage over the whole process (compat.skip_garbage_collection_at_exit): what a normal exit does that matters still
happens. Plain subprocesses, no model."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def test_leave_keeps_exit_code_threads_atexit_and_unflushed_files(tmp_path):
    proc = run(
        """
        import atexit, os, sys, threading, time
        out = sys.argv[1]
        log = open(os.path.join(out, "log.txt"), "w", buffering=1 << 20)   # never flushed nor closed by the script
        log.write("kept\\n")
        atexit.register(lambda: open(os.path.join(out, "atexit.txt"), "w").write("ran"))
        def late():
            time.sleep(0.3)
            open(os.path.join(out, "thread.txt"), "w").write("joined")
        threading.Thread(target=late).start()                            # non-daemon: a normal exit waits for it
        print("to stdout", end="")                                        # no newline: still buffered
        from dsgrpo.process_exit import leave
        leave(5)
        print("never")
    """,
        tmp_path,
    )
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "to stdout"
    assert (tmp_path / "log.txt").read_text() == "kept\n"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"


def test_leave_ends_a_live_thread_pools_idle_workers_as_a_normal_exit_does(tmp_path):
    """A ThreadPoolExecutor still referenced at exit (a library's, in a global or a cycle) has an idle non-daemon
    worker; only threading's exit hook tells it to end. leave() joined threads without it and hung."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max_workers=1)
        assert pool.submit(lambda: 41 + 1).result() == 42   # its worker now idles, waiting for more
        from dsgrpo.process_exit import leave
        leave(3)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 3, proc.stderr


def test_after_the_exit_hook_an_engine_finalizer_collects_nothing(tmp_path):
    proc = run(
        """
        import gc, os, sys, weakref
        class Engine:  # stands in for vLLM's in-process engine: a weakref finalizer that collects at exit
            pass
        engine = Engine()
        def shutdown(out=sys.argv[1]):
            cycle = []
            cycle.append(cycle)
            del cycle
            open(os.path.join(out, "collected.txt"), "w").write(str(gc.collect()))
        weakref.finalize(engine, shutdown)
        from dsgrpo import compat
        compat.skip_garbage_collection_at_exit()
        compat.skip_garbage_collection_at_exit()  # once per process, however many engines
        assert gc.collect() >= 0 and gc.collect.__module__ == "gc"  # untouched until the exit
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "collected.txt").read_text() == "0"  # the cycle was not looked for


def test_leave_passes_over_dead_weak_proxies(tmp_path):
    proc = run(
        """
        import weakref
        class Thing:
            pass
        thing = Thing()
        holder = [weakref.proxy(thing)]   # tracked by gc, its referent gone
        del thing
        from dsgrpo.process_exit import leave
        leave(0)
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr


def test_say_line_keeps_two_processes_lines_whole_on_one_pipe(tmp_path):
    """Ranks share the launcher's stderr: a marker line a test reads must arrive whole, never with another rank's
    text between its words and its newline (print writes them apart; that broke a CI run)."""
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            """
            import sys
            from dsgrpo.process_exit import say_line
            who = sys.argv[1]
            sys.stderr.write("pending ")   # unflushed text goes first, on the same line
            for i in range(3000):
                say_line(f"{who} line {i} " + "x" * 60)
            """
        )
    )
    proc = run(
        f"""
        import subprocess, sys
        kids = [subprocess.Popen([sys.executable, {str(child)!r}, who]) for who in ("A", "B")]
        sys.exit(max(k.wait() for k in kids))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 6000
    import re

    whole = re.compile(r"^(pending )?[AB] line \d+ x{60}$")
    assert [line for line in lines if not whole.match(line)] == []
    for who in "AB":
        numbers = [int(line.split()[-2]) for line in lines if line.removeprefix("pending ").startswith(who)]
        assert numbers == list(range(3000))
