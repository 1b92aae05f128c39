"""The gate's scenarios for one target: `kern test`, then one `kern serve` driven as a client
would, every answer judged against `kern run` (see README.md for what each one checks).

Design notes
------------
* One server per target, started once; the scenarios run in a fixed order because each
  leaves the cache as the next one needs it: conc1 on the cold server, then repeats and
  next turns, the warm round (prefix hits), twelve at once, the streamed round, a hang-up,
  then fillers that push everything to the host tier, and the idle check last.
* The twelve prompts are text (the server tokenizes them as `kern run --prompt` does; a
  prompt_tokens mismatch fails); next turns are sent as ids, since an answer's text need not
  tokenize back to its ids. Three of them are chat turns when the checkpoint has a template.
* Served-vs-served comparisons (warm vs cold, streamed vs whole) are byte identity with no
  excuse; only a comparison with `kern run` can be excused, by the probe (oracle.py).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from http_client import Answer, Client, Request, ServerProcess
from oracle import Oracle, Reference, judge

__all__ = ["SCENARIOS", "Result", "TargetGate", "run_kern_test"]

SCENARIOS = (
    "kern test",
    "conc1",
    "repeat + next turn",
    "warm",
    "twelve at once",
    "streamed",
    "mid-character",
    "hang-up",
    "park + wake",
    "slot growth",
    "rows",
    "idle",
)

STEPS = 32
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a kingdom by the sea, there lived",
    "def fibonacci(n):\n",
    "Explain in one sentence why the sky is blue.",
    "Translate to French: good morning, my friend.",
    "日本語で短い文章を書いてください。",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Emoji and accents: 😀 🎉 café naïve — then",
    "A long prompt spans several pages of the cache. " * 6 + "Summarize it:",
    "SELECT name FROM users WHERE",
    "The capital of France is",
    "Write a haiku about caches:",
)
CHAT = (0, 4, 8)  # chat turns, when the checkpoint has a chat template
# Targets with ranks > 1 run fewer prompts and scenarios (each rank is a process on CI's two
# cores); tests/test_ranks.py covers their faults.
RANK_PROMPTS = 4
RANK_SCENARIOS = ("conc1", "repeat + next turn", "twelve at once", "idle")
COMPLETION = tuple(i for i in range(len(TEXTS)) if i not in CHAT)


@dataclass
class Result:
    """One scenario of one target."""

    scenario: str
    status: str = "pass"  # pass | fail | n/a | skip
    compared: int = 0  # answers judged against `kern run` or another served answer
    excused: int = 0
    diverged: int = 0  # divergences reported, not gated (multi-rank targets)
    cached_tokens: int | None = None
    parked: int | None = None
    woken: int | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.status = "fail"
        self.failures.append(message)

    def add_cached(self, answer: Answer) -> None:
        if answer.cached_tokens is not None:
            self.cached_tokens = (self.cached_tokens or 0) + answer.cached_tokens


def run_kern_test(kern: list[str], config: Path, target: str, timeout: float) -> Result:
    res = Result("kern test")
    t0 = time.monotonic()
    cmd = [*kern, "test", "--config", str(config), "--target", target, "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        res.fail(f"no result after {timeout:.0f}s")
        return res
    res.wall_s = time.monotonic() - t0
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        tail = " ".join(out.stderr.strip().splitlines()[-3:])
        res.fail(f"exit {out.returncode}: {tail}")
        return res
    checks = report.get("checks", [])
    res.compared = len(checks)
    for c in checks:
        if not c["ok"]:
            res.fail(f"{c['name']}: {c['detail']}")
    if out.returncode != 0 and not res.failures:
        res.fail(f"exit {out.returncode}")
    res.notes.append(f"{len(checks)} checks")
    return res


class TargetGate:
    """Every server scenario of one target. ``run`` returns their results in order."""

    def __init__(self, oracle: Oracle, *, chat_template: bool, log: Callable[[str], None]) -> None:
        self.oracle = oracle
        self.target = oracle.target
        self.rows = self.target.widest_rows
        # kern run at the target's own ranks is the oracle, so identity gates at any rank
        # count; across rank counts it is reported (ranks.py).
        self.gated = True
        self.log = log
        self.prompts = [
            Request(text, STEPS, chat=chat_template and i in CHAT) for i, text in enumerate(TEXTS)
        ]
        if self.target.ranks > 1:
            self.prompts = self.prompts[:RANK_PROMPTS]
        self.refs: list[Reference] = []
        self.cold: list[Answer] = []
        self.streamed: list[Answer] = []
        self.excused_cold: set[int] = set()
        self.start: dict[str, float] = {}
        self.peak: dict[str, float] = {}

    def prepare(self) -> None:
        """`kern run`'s answers to the twelve prompts (before the server takes the machine),
        and those the scenarios will ask for when the server answers as `kern run` does:
        the prompts at rows 1 (a speculative target's rows scenario) and the next turns built
        from the answers (a divergence asks for its own when it happens)."""
        wanted = [(p.prompt, STEPS, self.rows, p.chat) for p in self.prompts]
        if self.rows > 1:
            wanted += [(p.prompt, STEPS, 1, p.chat) for p in self.prompts]
        self.oracle.prefetch(wanted)
        self.refs = [self.reference(p) for p in self.prompts]
        if self.target.ranks == 1:
            self.oracle.prefetch([(turn, STEPS, self.rows, False) for turn in self._turns()])

    def _turns(self) -> list[list[int]]:
        """The next turns (as ids) of repeat + next turn and of park + wake, built from
        `kern run`'s answers (the served ones, where they are identical)."""
        refs = self.refs
        pairs = [(COMPLETION[0], COMPLETION[1])]
        if self.target.host_bytes:
            pairs += [(i, COMPLETION[4]) for i in COMPLETION[2:4]]
        return [refs[i].prompt_ids + refs[i].ids + refs[j].prompt_ids for i, j in pairs]

    # --- helpers ----------------------------------------------------------------------------

    def reference(self, req: Request) -> Reference:
        return self.oracle.answer(req.prompt, STEPS, self.rows, chat=req.chat)

    def check(
        self, res: Result, label: str, got: Answer, ref: Reference, rows: int | None = None
    ) -> bool:
        """Judge ``got`` against `kern run` (at ``rows``, default the target's widest; a
        divergence is probed at those rows); True when identical (ids, text, finish)."""
        rows = self.rows if rows is None else rows
        res.compared += 1
        if got.prompt_tokens != len(ref.prompt_ids):
            res.fail(
                f"{label}: the server read {got.prompt_tokens} prompt tokens, kern run "
                f"{len(ref.prompt_ids)}"
            )
            return False
        v = judge(self.oracle, ref.prompt_ids, got.ids, got.text, ref, rows, gated=self.gated)
        if v.identical:
            if got.finish_reason != ref.finish_reason:
                res.fail(f"{label}: finish {got.finish_reason!r}, kern run {ref.finish_reason!r}")
                return False
            return True
        if v.excused:
            res.excused += 1
            res.notes.append(f"{label}: excused: {v.detail}")
        elif not v.gated:
            res.diverged += 1
            res.notes.append(
                f"{label}: diverged (not gated, ranks {self.target.ranks}): {v.detail}"
            )
        else:
            res.fail(f"{label}: {v.detail}")
        return False

    def same(self, res: Result, label: str, a: Answer, b: Answer) -> None:
        """Two served answers to one prompt: byte identity, no excuse."""
        res.compared += 1
        if (a.ids, a.text, a.finish_reason) != (b.ids, b.text, b.finish_reason):
            res.fail(f"{label}: {a.ids} {a.text!r} != {b.ids} {b.text!r}")

    # --- the scenarios ----------------------------------------------------------------------

    def run(self, server: ServerProcess, client: Client) -> list[Result]:
        """The server scenarios, in order, on a server just started (after :meth:`prepare`)."""
        self.server = server
        self.client = client
        self.start = client.idle_metrics()
        steps: list[tuple[str, Callable[[Result], None]]] = [
            ("conc1", self.conc1),
            ("repeat + next turn", self.repeat_and_next_turn),
            ("warm", self.warm),
            ("twelve at once", self.twelve_at_once),
            ("streamed", self.streamed_round),
            ("mid-character", self.mid_character),
            ("hang-up", self.hang_up),
            ("park + wake", self.park_and_wake),
            ("slot growth", self.slot_growth),
            ("rows", self.rows_round),
            ("idle", self.idle),
        ]
        results = []
        for name, fn in steps:
            res = Result(name)
            if self.target.ranks > 1 and name not in RANK_SCENARIOS:
                res.status = "n/a"
                res.notes.append(f"not run at ranks {self.target.ranks} (kept short)")
                results.append(res)
                continue
            t0 = time.monotonic()
            try:
                fn(res)
            except Exception as e:  # noqa: BLE001 - one scenario's error is its failure
                res.fail(f"{type(e).__name__}: {e}")
            res.wall_s = time.monotonic() - t0
            if not self.server.alive() and name != "idle":
                res.fail("the server exited:\n" + self.server.log_tail())
            self.log(f"  {name}: {res.status}" + (f" ({res.failures[0]})" if res.failures else ""))
            results.append(res)
        return results

    def conc1(self, res: Result) -> None:
        for i, req in enumerate(self.prompts):
            got = self.client.generate(req)
            self.cold.append(got)
            res.add_cached(got)
            if not self.check(res, f"prompt {i}", got, self.refs[i]):
                self.excused_cold.add(i)

    def repeat_and_next_turn(self, res: Result) -> None:
        i, j = COMPLETION[0], COMPLETION[1]
        req, ref = self.prompts[i], self.refs[i]
        first = self.client.generate(req)
        again = self.client.generate(req)
        self.check(res, "first", first, ref)
        self.check(res, "repeat", again, ref)
        self.same(res, "repeat vs first", again, first)
        res.add_cached(again)
        res.notes.append(f"repeat: {again.cached_tokens} of {again.prompt_tokens} cached")
        # A stateful target resumes from the state snapshot taken one token short of the
        # prompt's end, so it too hits all but the last prompt token.
        if again.cached_tokens != again.prompt_tokens - 1:
            res.fail(f"repeat: {again.cached_tokens} cached, not all but the last prompt token")
        # The next turn as ids: this prompt, the answer as served, then another prompt.
        turn = ref.prompt_ids + again.ids + self.refs[j].prompt_ids
        turn_ref = self.oracle.answer(turn, STEPS, self.rows)
        nxt = self.client.generate(Request(turn, STEPS))
        self.check(res, "next turn", nxt, turn_ref)
        res.add_cached(nxt)
        want = len(ref.prompt_ids) + len(again.ids) - 1
        res.notes.append(f"next turn: {nxt.cached_tokens} of {nxt.prompt_tokens} cached")
        if (nxt.cached_tokens or 0) < want:
            res.fail(f"next turn: {nxt.cached_tokens} cached, want at least {want}")
        # The same turn again (a client's retry): its prefix is still cached, at least as far.
        retry = self.client.generate(Request(turn, STEPS))
        self.check(res, "next turn again", retry, turn_ref)
        res.add_cached(retry)
        res.notes.append(f"next turn again: {retry.cached_tokens} cached")
        if (retry.cached_tokens or 0) < want:
            res.fail(f"next turn again: {retry.cached_tokens} cached, want at least {want}")

    @property
    def parks(self) -> bool:
        """Whether the target has a host tier (evicted entries park there, not dropped)."""
        return self.target.host_bytes > 0

    @property
    def stateful(self) -> bool:
        return self.start.get("kern_pool_slots_total", 0) > 0

    def warm(self, res: Result) -> None:
        for i, req in enumerate(self.prompts):
            got = self.client.generate(req)
            res.add_cached(got)
            ok = self.check(res, f"prompt {i}", got, self.refs[i])
            if ok and i not in self.excused_cold:
                self.same(res, f"prompt {i} warm vs cold", got, self.cold[i])
            # Everything the cold answer cached is resident or parked (a host tier parks
            # instead of dropping), so the repeat hits all but its last prompt token.
            if not got.cached_tokens:
                res.fail(f"prompt {i}: no prefix hit on a repeat")
            elif self.parks and got.cached_tokens != got.prompt_tokens - 1:
                res.fail(
                    f"prompt {i}: {got.cached_tokens} of {got.prompt_tokens} cached, not all "
                    "but the last prompt token, with a host tier to park in"
                )

    def twelve_at_once(self, res: Result) -> None:
        stop = threading.Event()
        peak: dict[str, float] = {}

        def sample() -> None:
            while not stop.is_set():
                m = self.client.metrics()
                for k in (
                    "kern_num_requests_running",
                    "kern_pool_slots_held",
                    "kern_pool_slots_total",
                ):
                    peak[k] = max(peak.get(k, 0.0), m.get(k, 0.0))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with ThreadPoolExecutor(len(self.prompts)) as pool:
                answers = list(pool.map(self.client.generate, self.prompts))
        finally:
            stop.set()
            sampler.join(10)
        self.peak = peak
        for i, got in enumerate(answers):
            res.add_cached(got)
            self.check(res, f"prompt {i}", got, self.refs[i])
        res.notes.append(f"at most {peak.get('kern_num_requests_running', 0):.0f} running at once")

    def streamed_round(self, res: Result) -> None:
        for i, req in enumerate(self.prompts):
            got = self.client.generate(dataclasses.replace(req, stream=True))
            self.streamed.append(got)
            res.add_cached(got)
            if got.cached_tokens is None:
                res.fail(f"prompt {i}: the stream's usage has no cached_tokens")
            ok = self.check(res, f"prompt {i}", got, self.refs[i])
            if ok and i not in self.excused_cold:
                self.same(res, f"prompt {i} streamed vs whole", got, self.cold[i])
        events = sum(a.num_events for a in self.streamed)
        tokens = sum(len(a.ids) for a in self.streamed)
        res.notes.append(f"{tokens} tokens came in {events} events")

    def mid_character(self, res: Result) -> None:
        """Answers that end inside a UTF-8 character: served text, whole and streamed, ends
        with the U+FFFD `kern run` prints."""
        cases = [i for i, r in enumerate(self.refs) if r.text.endswith("\ufffd")]
        verified = 0
        for i in cases:
            ref = self.refs[i]
            for how, got in (("whole", self.cold[i]), ("streamed", self.streamed[i])):
                if got.ids != ref.ids:
                    continue  # a divergence, judged (and excused or failed) where it was served
                res.compared += 1
                if got.text == ref.text:
                    verified += 1
                else:
                    res.fail(f"prompt {i} ({how}): served {got.text!r}, kern run {ref.text!r}")
        if verified:
            res.notes.append(
                f"{len(cases)} of {len(self.refs)} answers end mid-character, "
                f"{verified} served texts compared"
            )
        else:
            self._cut_mid_character(res)

    def _cut_mid_character(self, res: Result) -> None:
        """No answer ended inside a character: cut one where its text does."""
        for i in COMPLETION:
            ref = self.refs[i]
            for n in range(len(ref.ids) - 1, 0, -1):
                body = {"model": self.target.name, "tokens": ref.ids[:n]}
                if self.client.post("/detokenize", body)["prompt"].endswith("\ufffd"):
                    cut = self.oracle.answer(self.prompts[i].prompt, n, self.rows)
                    req = dataclasses.replace(self.prompts[i], max_tokens=n)
                    for stream in (False, True):
                        got = self.client.generate(dataclasses.replace(req, stream=stream))
                        self.check(res, f"prompt {i} cut at {n} (stream={stream})", got, cut)
                    res.notes.append(f"prompt {i} cut at {n} tokens ends mid-character")
                    return
        res.status = "n/a"
        res.notes.append("no answer of this target ends inside a character")

    def hang_up(self, res: Result) -> None:
        before = self.client.idle_metrics()
        req = Request(self.prompts[COMPLETION[0]].prompt, None, ignore_eos=True)
        seen = self.client.hang_up(req, after_events=3)
        if seen < 3:
            res.fail(f"the stream ended after {seen} events, before the hang-up")
        after = self.client.idle_metrics()
        aborted = after["kern_aborted_total"] - before["kern_aborted_total"]
        if aborted != 1:
            res.fail(f"kern_aborted_total rose by {aborted:.0f}, not 1")
        self._no_leak(res, before, after)
        i = COMPLETION[1]
        got = self.client.generate(self.prompts[i])
        self.check(res, "the next request", got, self.refs[i])

    def _no_leak(self, res: Result, before: dict[str, float], after: dict[str, float]) -> None:
        """Once idle nothing is held, and (stateless: the slots' chunks come from the pages
        on a stateful pool) every page is free or cached as it was ``before``."""
        for k in ("kern_pool_pages_held", "kern_pool_slots_held"):
            if after.get(k, 0) != 0:
                res.fail(f"{k} is {after[k]:.0f} once idle")
        if not self.stateful:
            pages = ("kern_pool_pages_free", "kern_pool_pages_cached")
            was, now = (sum(m[k] for k in pages) for m in (before, after))
            if was != now:
                res.fail(f"free + cached pages {was:.0f} -> {now:.0f}")

    def park_and_wake(self, res: Result) -> None:
        if self.target.host_bytes == 0:
            res.status = "n/a"
            res.notes.append("no host tier")
            return
        m0 = self.client.idle_metrics()
        pool_tokens = m0["kern_pool_pages_total"] * self.target.page_tokens
        filled = 0
        # Twice the pool in fillers pushes out everything older; bounded for huge pools.
        for k in range(400):
            if filled >= 2 * pool_tokens and (
                self.client.metrics()["kern_parked_total"] > m0["kern_parked_total"]
            ):
                break
            words = " ".join(f"w{(k * 31 + n) % 997}" for n in range(60))
            filled += self.client.generate(Request(f"Filler {k}: {words}", 1)).prompt_tokens
        m1 = self.client.idle_metrics()
        res.parked = int(m1["kern_parked_total"] - m0["kern_parked_total"])
        res.notes.append(f"{filled} filler prompt tokens on a pool of {pool_tokens:.0f}")
        if res.parked == 0:
            res.fail("nothing was parked")
        # Next turns of prompts no scenario extended yet: their prefixes (and, on a stateful
        # target, their request-end snapshots) are among the coldest, so parked by now.
        for i in COMPLETION[2:4]:
            ref = self.refs[i]
            turn = ref.prompt_ids + self.cold[i].ids + self.refs[COMPLETION[4]].prompt_ids
            got = self.client.generate(Request(turn, STEPS))
            res.add_cached(got)
            self.check(
                res, f"prompt {i} next turn", got, self.oracle.answer(turn, STEPS, self.rows)
            )
            want = len(ref.prompt_ids) + len(self.cold[i].ids) - 1
            if (got.cached_tokens or 0) < want:
                res.fail(f"prompt {i} next turn: {got.cached_tokens} cached, want {want}")
        m2 = self.client.idle_metrics()
        res.woken = int(m2["kern_woken_total"] - m1["kern_woken_total"])
        dropped = {
            k: int(m2[f"kern_dropped_{k}_total"] - m0[f"kern_dropped_{k}_total"])
            for k in ("resident", "parked")
        }
        res.notes.append(
            f"dropped meanwhile: {dropped['resident']} resident, {dropped['parked']} parked"
        )
        if res.woken == 0:
            res.fail("nothing was woken")

    def slot_growth(self, res: Result) -> None:
        if not self.stateful:
            res.status = "n/a"
            res.notes.append("no recurrent state or window pages")
            return
        start = self.start["kern_pool_slots_total"]
        held = self.peak.get("kern_pool_slots_held", 0)
        total = self.peak.get("kern_pool_slots_total", 0)
        res.notes.append(
            f"slots: {start:.0f} at start, {held:.0f} held at once and {total:.0f} in all "
            "during twelve at once"
        )
        # The slots the pool keeps: two for a recurrent state, three for window pages (a lone
        # request's two and its hit's snapshot), whole chunks of them.
        if start < 2:
            res.fail(f"the pool started with {start:.0f} slots, fewer than 2")
        if held <= 2 or total < held:
            res.fail("the slots did not grow past two while twelve requests ran")

    def rows_round(self, res: Result) -> None:
        """A speculative target (widest rows > 1): the server above verified drafts; its cold
        answers (at the widest rows) also equal `kern run` at rows 1; and a second server at
        ``--rows 1`` answers the twelve as `kern run` does at rows 1 and at the widest, and as
        the first server did."""
        if self.rows == 1:
            res.status = "n/a"
            res.notes.append("rows [1]: no speculative shape")
            return
        m = self.client.metrics()
        drafted = m.get("kern_spec_decode_num_draft_tokens_total", 0)
        accepted = m.get("kern_spec_decode_num_accepted_tokens_total", 0)
        res.notes.append(
            f"rows {self.rows}: {accepted:.0f} of {drafted:.0f} draft tokens accepted "
            f"({accepted / max(drafted, 1):.0%}) over every scenario above"
        )
        if drafted == 0:
            res.fail(f"the server at rows {self.rows} verified no draft")
        refs1 = [self.oracle.answer(req.prompt, STEPS, 1, chat=req.chat) for req in self.prompts]
        for i, (got, ref1) in enumerate(zip(self.cold, refs1, strict=True)):
            self.check(res, f"prompt {i} at rows {self.rows} vs kern run rows 1", got, ref1, 1)
        o = self.oracle
        log = o.work_dir / "serve-rows1.log"
        with ServerProcess(
            o.kern, o.config, self.target.name, log, start_limit=o.timeout, extra=("--rows", "1")
        ) as server:
            client = Client(server.port, self.target.name, timeout=o.timeout)
            key = "kern_spec_decode_num_draft_tokens_total"
            before = client.metrics().get(key, 0)
            for i, req in enumerate(self.prompts):
                got = client.generate(req)
                if self.check(res, f"prompt {i} at rows 1", got, refs1[i], 1):
                    label = f"prompt {i} at rows 1 vs kern run rows {self.rows}"
                    self.check(res, label, got, self.refs[i])
                    if i not in self.excused_cold:
                        self.same(res, f"prompt {i} rows 1 vs rows {self.rows}", got, self.cold[i])
            if client.metrics().get(key, 0) != before:
                res.fail("the server at --rows 1 verified drafts")
            if server.stop() != 0:
                res.fail("kern serve --rows 1 did not exit 0 on SIGTERM")

    def idle(self, res: Result) -> None:
        self._no_leak(res, self.start, self.client.idle_metrics())
        log = self.server.log_path.read_text(encoding="utf-8", errors="replace")
        if "Traceback" in log:
            res.fail("the server log has a traceback:\n" + self.server.log_tail())
        code = self.server.stop()
        if code != 0:
            res.fail(f"kern serve exited with {code} on SIGTERM, not 0")
