"""Where a scheduler step's time goes, for ``kern.bench.decode``: a scheduler driven on the
calling thread (the thread that loaded the model, as in the server), its events crossing to a
real event loop through the server's ``StepGate``, and two passes over the same decode, a
step of each in turn:

* a timed pass: the wall time of every step, and, per named part of the step (the wrappers
  ``Probe.install`` puts on the scheduler's, memory's, runner's, model's and sampler's calls),
  its exclusive wall time (perf_counter around the call, minus the parts called inside it);
* an ops pass: every torch call made from Python timed by a ``TorchFunctionMode`` (perf_counter
  around the call; the ops it runs inside are not seen, so nothing is counted twice) and put
  in the part it ran in, as a linear (``LINEAR_OPS``, or a matmul of two matrices: the MKL
  fallback's ``x @ w``) or another op. A call's time includes its argument parsing, dispatch
  and OpenMP fork/join; attribute reads (``.shape``) are not timed, they count as host.

Host time is wall time minus torch-op time: per step, and per part (the timed pass's part
minus the ops pass's ops in it). The op timer is kept out of the timed pass because its own
Python costs microseconds per op, which would count as host time; torch.profiler was not used
because a top-level op's time under it includes the recording of every op inside it (a step
of the tiny model measured 6.2 ms of ops under it against 4.0 ms of wall time without it).
Per pass, figures are means over its faster half of steps (by wall time), the same steps for
every column, so a step another process preempted does not count and the columns add up.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

import kern.engine.runner as runner_module
from kern.engine.load import Engine
from kern.engine.request import Request
from kern.server.hangup import StepGate

# The calls kern's CPU backend runs linears with (oneDNN), and aten's.
LINEAR_OPS = frozenset({"_linear_pointwise", "linear", "addmm", "mm"})
MATMULS = frozenset({"matmul", "__matmul__"})
STEP = "scheduler"  # the step's own part: what no narrower part holds
# The parts, in print order, and what each one wraps (see Probe.install).
PARTS = (
    (STEP, "scheduler bookkeeping (Scheduler.step outside the parts below)"),
    ("cache calls", "Memory: admit, take_pages, release, stats, snapshots"),
    ("building the batch", "build_step and the backend's attention / rope plans"),
    ("runner", "Runner.forward outside the plan and the model"),
    ("model", "the model's Python between ops (layers, norms, attention)"),
    ("sampling", "Sampler.forward outside Runner.forward (sample, picks)"),
    ("metrics gauges", "Metrics.snapshot once per step"),
    ("stream events", "deliver: StepGate to the event loop"),
)
_MEMORY_CALLS = (
    "admit",
    "take_pages",
    "release",
    "stats",
    "share_prefill",
    "prompt_snapshot_at",
    "prompt_snapshot",
)


@dataclass
class Split:
    """One decode's per-step figures (seconds; means over the faster half of a pass's steps)."""

    steps: int
    wall: float
    part_wall: dict[str, float] = field(default_factory=dict)  # exclusive wall (timed pass)
    linears: float = 0.0  # torch-op time (ops pass)
    other: float = 0.0
    part_ops: dict[str, float] = field(default_factory=dict)
    calls: float = 0.0  # torch calls made from Python per step (ops pass)

    @property
    def host(self) -> float:
        return self.wall - self.linears - self.other


class Probe:
    """Times a scheduler's steps (see the module notes). ``install`` wraps the parts once;
    the wrappers do nothing while no pass runs."""

    def __init__(self) -> None:
        self.mode = "off"  # "timed", "ops" or "off"
        self._stack: list[float] = []  # timed: the time of the parts inside each open part
        self._parts: list[str] = []  # ops: the open parts
        self._cur: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self.mode == "ops":
                self._parts.append(part)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._parts.pop()
            if self.mode != "timed":
                return fn(*args, **kwargs)
            stack = self._stack
            stack.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                inner = stack.pop()
                self._cur[part] += dt - inner
                if stack:
                    stack[-1] += dt

        return timed

    @contextmanager
    def install(self, sched, runner) -> Iterator[None]:
        """Wrap the parts of ``sched``'s steps (instance attributes, and the runner module's
        ``build_step`` until the block ends)."""
        memory, ops, model = sched.memory, runner.ops, runner.model
        for name in _MEMORY_CALLS:
            setattr(memory, name, self.wrap("cache calls", getattr(memory, name)))
        for obj, names, part in (
            (ops, ("plan_attention", "plan_latent_attention", "plan_rope"), "building the batch"),
            (ops, ("plan_recurrent",), "building the batch"),
            (runner, ("forward",), "runner"),
            (model, ("forward", "logits"), "model"),
            (sched.sampler, ("forward",), "sampling"),
            (sched.metrics, ("snapshot",), "metrics gauges"),
        ):
            for name in names:
                if hasattr(obj, name):
                    setattr(obj, name, self.wrap(part, getattr(obj, name)))
        sched.deliver = self.wrap("stream events", sched.deliver)
        build_step = runner_module.build_step
        runner_module.build_step = self.wrap("building the batch", build_step)
        try:
            yield
        finally:
            runner_module.build_step = build_step

    def measure(self, step: Callable[[], None], n: int) -> Split:
        """Run ``2 n`` steps, timed and under the op timer in turn (so both passes see the
        same minutes of a shared machine's load), and return their split."""
        run = self.wrap(STEP, step)
        timer = _OpTimer(self._parts)
        walls: list[float] = []
        parts: list[dict[str, float]] = []
        op_walls: list[float] = []
        books: list[dict[tuple[str, bool], float]] = []
        calls: list[int] = []
        try:
            for _ in range(n):
                self.mode = "timed"
                self._cur = defaultdict(float)
                run()
                # The step's wall is the sum of its parts' exclusive times (the outermost
                # wrapper's own span), so the parts add up to it whatever the load.
                walls.append(sum(self._cur.values()))
                parts.append(self._cur)
                self.mode = "ops"
                timer.book = defaultdict(float)
                timer.calls = 0
                t = time.perf_counter()
                with timer:
                    run()
                op_walls.append(time.perf_counter() - t)
                books.append(timer.book)
                calls.append(timer.calls)
        finally:
            self.mode = "off"
        keep = _faster_half(walls)
        split = Split(len(keep), statistics.fmean(walls[i] for i in keep))
        for part, _ in PARTS:
            split.part_wall[part] = statistics.fmean(parts[i].get(part, 0.0) for i in keep)
        faster = _faster_half(op_walls)
        kept = [books[i] for i in faster]
        split.calls = statistics.fmean(calls[i] for i in faster)

        def mean(linear: bool, part: str | None = None) -> float:
            return statistics.fmean(
                sum(v for (p, lin), v in b.items() if lin == linear and part in (None, p))
                for b in kept
            )

        split.linears, split.other = mean(True), mean(False)
        for part, _ in PARTS:
            split.part_ops[part] = mean(True, part) + mean(False, part)
        return split


class _OpTimer(TorchFunctionMode):
    """Books each torch call's time by (innermost open part, whether it is a linear). The
    mode is off inside the call, so the ops it runs are not seen again."""

    def __init__(self, parts: list[str]) -> None:
        super().__init__()
        self.parts = parts
        self.book: dict[tuple[str, bool], float] = defaultdict(float)
        self.calls = 0
        # What the two clock reads add to every op's time (~0.1 us), taken off each.
        clock = time.perf_counter
        self.clock_cost = statistics.median(-clock() + clock() for _ in range(2001))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":
            return func(*args, **(kwargs or {}))  # an attribute read (.shape): host work
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t - self.clock_cost
        linear = name in LINEAR_OPS or (
            name in MATMULS and all(getattr(a, "ndim", 0) == 2 for a in args[:2])
        )
        self.book[self.parts[-1] if self.parts else STEP, linear] += dt
        self.calls += 1
        return out


def _faster_half(walls: list[float]) -> list[int]:
    order = sorted(range(len(walls)), key=walls.__getitem__)
    return sorted(order[: max(1, (len(walls) + 1) // 2)])


class Decode:
    """``batch`` greedy requests of ``prompt_len`` random ids on ``engine``'s scheduler, stepped
    on the calling thread until each has its first token; events cross to an event loop on
    its own thread through the server's ``StepGate``, as in ``kern serve``."""

    def __init__(self, engine: Engine, probe: Probe) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._loop_thread.start()
        self.gate = StepGate()
        self.delivered = 0  # tokens the loop has dispatched (read only on the loop's thread)
        self.sched = engine.scheduler(self._deliver, max_running=1024)
        self.probe = probe
        self._installed = probe.install(self.sched, engine.runner)
        self._installed.__enter__()

    def _deliver(self, events) -> None:
        self.gate.deliver(self.loop, self._dispatch, events)

    def _dispatch(self, events) -> None:
        self.delivered += sum(tok is not None for _, (tok, _, _) in events)

    @staticmethod
    def prompts(engine: Engine, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
        vocab = engine.checkpoint.config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()

    def start(self, batch: int, prompt_len: int, max_tokens: int, seed: int) -> list[Request]:
        """Submit the batch (prompts from ``prompts``) and step until each has a token."""
        ids = self.prompts(self.engine, batch, prompt_len, seed)
        reqs = [Request(p, max_tokens, ignore_eos=True) for p in ids]
        for r in reqs:
            self.sched.check(len(r.prompt_ids), max_tokens)
            self.sched.submit(r)
        while not all(r.num_output >= 1 for r in reqs):
            self.sched.step()
        return reqs

    def end(self, reqs: list[Request]) -> None:
        """Abort ``reqs`` and step until the scheduler has let them go."""
        for r in reqs:
            self.sched.abort(r)
        while not all(r.finish_reason is not None for r in reqs):
            self.sched.step()

    def close(self) -> None:
        self._installed.__exit__(None, None, None)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
        self.loop.close()

    def weight_bytes(self) -> int:
        """Bytes of the distinct linear weights one step reads (run one step to see them)."""
        ops = self.engine.runner.ops
        seen: dict[int, int] = {}
        linear = ops.linear

        def counting(x, w, bias=None):
            t = w.weight if hasattr(w, "weight") else w
            seen[id(t)] = t.numel() * t.element_size()
            return linear(x, w, bias)

        ops.linear = counting
        try:
            self.sched.step()
        finally:
            del ops.linear
        return sum(seen.values())
