"""Grammar compiles that cannot stall the server: :class:`CompilePool` runs each in a process
of its own, within a time budget, and kills the one that overruns.

Design notes
------------
* A JSON schema can take minutes to compile, and the request that sends it need not be
  large: with xgrammar 0.2.8 on the tiny 512-token vocabulary, arrays nested 480 deep took
  19 s, objects nested 450 deep and the string pattern ``[a-z]{1,20000}`` over 25 s (one
  core each). In the server's process such a compile competes with the engine for the GIL
  and the cores, and a thread cannot be stopped: it would run to its end.
* So one compiler process (``python -m kern.engine.grammar_compile``, started when the server
  starts, in the background, or else by the first compile, and fed over a socket) imports
  xgrammar once and forks a child per compile. The child compiles and sends back only that it
  did, and its CPU seconds: the server then compiles the same source itself
  (kern.engine.structured), which the child has shown fits the budget. The compiled grammar
  does not come back: its JSON (``CompiledGrammar.serialize_json``) can cost far more than the
  compile (xgrammar 0.2.8, the tiny vocabulary, Claude Code's 21 tools as one tag: compiled in
  0.14 s, 447 MB of JSON written in 26 s, read back in 8.5 s). A child that overruns is killed
  with SIGKILL, its core and memory back at once; one that crashes (xgrammar's C++ on a
  pathological input) ends itself, not the server.
* The time budget is CPU seconds (read from ``/proc`` every :data:`POLL` s; the wall clock
  where there is no ``/proc``): a loaded machine slows a compile down but does not turn a
  good schema into a 400. A compile that waits for the CPU has a wall-clock bound as well,
  :data:`WALL_FACTOR` times the budget. Each child also has ``RLIMIT_CPU`` a second past the
  budget, so even one orphaned by a killed compiler process dies by the kernel's hand.
* The compiler runs at nice :data:`NICE`, with one compile thread per child and at most
  :data:`CONCURRENT` children at once (the rest wait in order): on a contended core the
  engine's threads win, so a compile does not slow the streams down.
* The server's side never waits in a thread per compile: :meth:`CompilePool.submit` returns
  a ``concurrent.futures.Future`` that one reader thread completes (an asyncio caller wraps
  it); one writer thread feeds the compiler, so a submit never blocks on its start.
* If the compiler process dies, the compiles it held fail (:class:`CompilerUnavailable`)
  and the next submit starts a new one.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from kern.kern_toml import DEFAULT_GRAMMAR_MAX_BYTES, DEFAULT_GRAMMAR_TIMEOUT

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TIMEOUT",
    "CompileFailed",
    "CompilePool",
    "CompileTimeout",
    "CompilerUnavailable",
    "GrammarBudget",
    "build_grammar",
]

# The budgets' defaults: CPU seconds one compile may take, and the bytes of a schema (its
# JSON) or tool list a request may ask to compile.
DEFAULT_TIMEOUT = DEFAULT_GRAMMAR_TIMEOUT
DEFAULT_MAX_BYTES = DEFAULT_GRAMMAR_MAX_BYTES
# The compiler process's niceness: its children lose a contended core to the engine.
NICE = 10
# Children compiling at once; the rest wait in the compiler process, in order.
CONCURRENT = 2
# Seconds between the compiler's looks at its children's CPU time.
POLL = 0.05
# A compile that has not used its CPU budget is still ended at this many times it in wall time.
WALL_FACTOR = 10
# xgrammar's JSON string characters, loose and strict (kern.engine.structured's design notes).
_LOOSE_CHARS = r"[^\"\\\r\n]"
_STRICT_CHARS = r"[^\0-\x1f\"\\]"
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ", re.MULTILINE)


@dataclass(frozen=True)
class GrammarBudget:
    """What one compile may take: ``timeout`` CPU seconds, a source of ``max_bytes``."""

    timeout: float = DEFAULT_TIMEOUT
    max_bytes: int = DEFAULT_MAX_BYTES


class CompileFailed(ValueError):
    """The source does not compile (xgrammar's reason), or the compile crashed."""


class CompileTimeout(ValueError):
    """The compile used its whole time budget and was killed."""


class CompilerUnavailable(RuntimeError):
    """The compiler process could not start, or died with the compile."""


def build_grammar(xgr: Any, kind: str, source: str) -> Any:
    """The xgrammar ``Grammar`` of ``source``: a JSON schema (``kind`` "json_schema", compiled
    without free whitespace) or a structural tag ("structural_tag"), its JSON strings made
    strict (kern.engine.structured's design notes)."""
    if kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    else:
        grammar = xgr.Grammar.from_structural_tag(source)
    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _STRICT_CHARS))


def reason(error: BaseException) -> str:
    """xgrammar's message without the time and source file it starts with."""
    return _XGR_PREFIX.sub("", str(error)).strip()


class CompilePool:
    """The server's handle on the compiler process (see the design notes). ``tokenizer_info``
    is ``TokenizerInfo.serialize_json()`` of the vocabulary the grammars are for."""

    def __init__(self, tokenizer_info: str, budget: GrammarBudget) -> None:
        self._info = tokenizer_info
        self.budget = budget
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._jobs: dict[int, Future[float]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._outbox: queue.SimpleQueue[Any] | None = None

    def submit(self, kind: str, source: str) -> Future[float]:
        """A future of the CPU seconds ``source`` took to compile in a child (it compiles
        within the budget); it fails with :class:`CompileFailed`, :class:`CompileTimeout` or
        :class:`CompilerUnavailable`."""
        future: Future[float] = Future()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                try:
                    self._start()
                except OSError as e:
                    future.set_exception(CompilerUnavailable(f"cannot start: {e}"))
                    return future
            job = next(self._ids)
            self._jobs[job] = future
            assert self._outbox is not None
            self._outbox.put((job, kind, source))
        return future

    def start(self) -> None:
        """Start the compiler process now if it does not run (``submit`` starts it too): it
        imports xgrammar and reads the vocabulary before the first compile waits on it.
        Raises OSError when it cannot start."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def close(self) -> None:
        """End the compiler process (its children end with it)."""
        with self._lock:
            proc, self._proc = self._proc, None
            if self._outbox is not None:
                self._outbox.put(None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        # kern from where this process imported it, whatever sys.path the server was given.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kern.engine.grammar_compile", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )
        theirs.close()
        conn = Connection(ours.detach())
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        outbox.put((self._info, self.budget.timeout))
        self._proc, self._outbox = proc, outbox
        threading.Thread(target=self._write, args=(conn, outbox), daemon=True).start()
        threading.Thread(target=self._read, args=(conn, proc), daemon=True).start()

    def _write(self, conn: Connection, outbox: queue.SimpleQueue[Any]) -> None:
        while (message := outbox.get()) is not None:
            try:
                conn.send(message)
            except OSError:
                return  # the compiler died: the reader fails its jobs

    def _read(self, conn: Connection, proc: subprocess.Popen[bytes]) -> None:
        while True:
            try:
                job, status, payload = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._jobs.pop(job, None)
            if future is None:
                continue
            if status == "ok":
                future.set_result(payload)
            elif status == "timeout":
                future.set_exception(CompileTimeout(payload))
            else:
                future.set_exception(CompileFailed(payload))
        conn.close()
        # The compiler is gone: what it held fails, and the next submit starts a new one.
        with self._lock:
            if self._proc is proc:
                self._proc = None
                if self._outbox is not None:
                    self._outbox.put(None)
            lost, self._jobs = self._jobs, {}
        proc.wait()
        for future in lost.values():
            future.set_exception(
                CompilerUnavailable(f"the grammar compiler exited ({proc.returncode})")
            )


# --- the compiler process ----------------------------------------------------------------


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used (user and system), or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _compile_child(xgr: Any, compiler: Any, out: Connection, timeout: float, job: Any) -> None:
    """In the forked child: compile ``job`` and send the answer; never returns."""
    code = 0
    try:
        import resource

        limit = math.ceil(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
        _, kind, source = job
        try:
            compiler.compile_grammar(build_grammar(xgr, kind, source))
            # Only that it compiled, and in how long: the grammar itself can be hundreds of MB
            # as JSON (the design notes); the server compiles the source again.
            answer = ("ok", time.process_time())
        except Exception as e:  # xgrammar raises plain RuntimeErrors for bad sources
            answer = ("error", reason(e))
        out.send(answer)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _ended(pid: int) -> str:
    """Why a child that sent nothing ended (reaped here)."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the compile crashed ({signal.Signals(os.WTERMSIG(status)).name})"
    return f"the compile ended with exit code {os.WEXITSTATUS(status)}"


def serve(conn: Connection) -> None:
    """The compiler process's loop (see the design notes): jobs ``(id, kind, source)`` in,
    ``(id, status, payload)`` out, status "ok" (the compile's CPU seconds), "error" or
    "timeout"."""
    os.nice(NICE)
    info, timeout = conn.recv()
    import xgrammar

    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.deserialize_json(info), max_threads=1, cache_enabled=False
    )
    waiting: deque[Any] = deque()
    # read end of a child's pipe -> (job id, pid, start time)
    running: dict[Connection, tuple[int, int, float]] = {}
    while True:
        for ready in wait([conn, *running], POLL if running else None):
            if ready is conn:
                try:
                    waiting.append(conn.recv())
                except EOFError:
                    for _, pid, _ in running.values():
                        os.kill(pid, signal.SIGKILL)
                    return
                continue
            assert isinstance(ready, Connection)
            job, pid, _ = running.pop(ready)
            try:
                status, payload = ready.recv()
                os.waitpid(pid, 0)
            except EOFError:
                status, payload = "error", _ended(pid)
            ready.close()
            conn.send((job, status, payload))
        now = time.monotonic()
        for pipe, (job, pid, started) in list(running.items()):
            used = _cpu_seconds(pid)
            spent = now - started if used is None else used
            if spent > timeout or now - started > WALL_FACTOR * timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pipe.close()
                del running[pipe]
                conn.send((job, "timeout", f"{spent:.1f} s of CPU in {now - started:.1f} s"))
        while waiting and len(running) < CONCURRENT:
            job = waiting.popleft()
            read, write = _pipe()
            pid = os.fork()
            if pid == 0:
                read.close()
                conn.close()  # an orphaned child must not hold the server's socket open
                _compile_child(xgrammar, compiler, write, timeout, job)
            write.close()
            running[read] = (job[0], pid, time.monotonic())


def _pipe() -> tuple[Connection, Connection]:
    from multiprocessing import Pipe

    return Pipe(duplex=False)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
