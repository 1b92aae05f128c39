"""The soak's clients (``python -m kern.bench.soak``): what each of its workers sends and how
each answer is counted.

Design notes
------------
* A worker loops until the deadline, each time drawing one kind from :data:`MIX` (seeded):
  whole answers, streams read to the end, hang-ups (a stream closed after a random number of
  events, or a whole request given up after a random delay), bad bodies and long prompts.
  Completions and chat alternate, so both handlers and the chat template run.
* Prompts are text, so the soak runs against any model: one of 8 shared openings (prefix
  hits) and a seeded tail; a long prompt repeats one of 4 long "documents" (a few hundred to a
  thousand tokens on the tiny model), more than a small pool holds at once, so the tree
  parks and wakes.
* Each bad body is one a correct server refuses with a 4xx naming the problem; a 2xx answer to
  one is counted (``accepted_bad``) and shown, as a 5xx is. Bad ids are token ids out of
  range (above the vocabulary, negative, 2^63), a ``logit_bias`` key out of range, and ids of
  things that do not exist (``/v1/models/...``, ``/v1/responses/...``).
* A hang-up is not an error whatever the transport says; a stream that ends without its
  ``[DONE]`` when the client did not leave is one (``incomplete``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["MIX", "Tally", "Workload"]

# kind -> weight. Hang-ups and bad bodies are a sixth each: enough to exercise every path
# thousands of times in 30 minutes, while most of the load is still real work.
MIX = {
    "stream": 30,
    "whole": 20,
    "long": 12,
    "hangup_stream": 12,
    "hangup_whole": 6,
    "bad": 20,
}

_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven river stones hum about "
    "winter light and old maps of distant harbours"
).split()


@dataclass
class Tally:
    """What the clients saw, over the whole run."""

    sent: Counter[str] = field(default_factory=Counter)  # by kind
    status: Counter[int] = field(default_factory=Counter)  # HTTP status -> count
    served: int = 0  # 2xx answers read whole (streams to their [DONE])
    hangups: int = 0  # requests the client left on purpose
    timeouts: int = 0
    transport: int = 0  # connection errors on requests the client did not leave
    incomplete: int = 0  # streams cut without [DONE] though the client stayed
    malformed: int = 0  # 2xx answers the client could not read
    accepted_bad: int = 0  # bad bodies answered 2xx
    refused: int = 0  # well-formed requests answered 4xx (the workload does not fit the server)
    errors: list[str] = field(default_factory=list)  # the first few, for the report
    latencies: list[float] = field(default_factory=list)  # seconds, served requests
    start: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        if len(self.errors) < 10:
            at = time.strftime("%H:%M:%S", time.gmtime()) + f"{time.time() % 1:.3f}"[1:]
            self.errors.append(f"{at} UTC ({time.monotonic() - self.start:.1f} s in): {what}")

    def count_status(self, code: int, kind: str, detail: str = "") -> None:
        self.status[code] += 1
        if code >= 500:
            self.note(f"{kind}: HTTP {code} {detail[:200]}")
        elif code >= 400 and not kind.startswith("bad"):
            self.refused += 1
            self.note(f"{kind}: HTTP {code} {detail[:200]}")

    def by_class(self) -> dict[str, int]:
        out = {"2xx": 0, "4xx": 0, "5xx": 0, "other": 0}
        for code, n in self.status.items():
            out[f"{code // 100}xx" if code // 100 in (2, 4, 5) else "other"] += n
        return out


def _bad_bodies(model: str) -> list[tuple[str, str, bytes | dict[str, Any]]]:
    """(name, path, body): raw bytes are sent as they are, dicts as JSON."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    return [
        ("truncated json", c, b'{"model": "' + model.encode() + b'", "prompt": "ab'),
        ("not an object", c, b"[1, 2, 3]"),
        ("invalid utf-8", c, b'{"model": "m", "prompt": "\xff\xfe"}'),
        ("negative max_tokens", c, {"model": model, "prompt": "x", "max_tokens": -5}),
        ("string max_tokens", c, {"model": model, "prompt": "x", "max_tokens": "ten"}),
        ("string temperature", ch, {"model": model, "messages": msg, "temperature": "hot"}),
        ("n = 0", c, {"model": model, "prompt": "x", "n": 0}),
        ("id over vocab", c, {"model": model, "prompt": [1, 2, 10**9], "max_tokens": 2}),
        ("negative id", c, {"model": model, "prompt": [-1], "max_tokens": 2}),
        ("id 2^63", c, {"model": model, "prompt": [2**63], "max_tokens": 2}),
        ("bias key over vocab", c, {"model": model, "prompt": "x", "logit_bias": {"99999999": 5}}),
        ("unknown model", c, {"model": "no-such-model", "prompt": "x"}),
        ("no messages", ch, {"model": model}),
        ("empty prompt", c, {"model": model, "prompt": ""}),
        (
            "top_logprobs 1000",
            ch,
            {"model": model, "messages": msg, "logprobs": True, "top_logprobs": 1000},
        ),  # fmt: skip
        ("unknown field type", ch, {"model": model, "messages": [{"role": 5, "content": "x"}]}),
    ]


class Workload:
    """The soak's workers against ``url`` (``key``: the bearer token, or None)."""

    def __init__(
        self, url: str, key: str | None, model: str, *, seed: int, max_tokens: int, timeout: float
    ) -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.tally = Tally()
        self.rng = random.Random(seed)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=30),
            # Idle connections dropped well before kern serve's 10 s keep-alive timeout: at
            # equal timeouts a POST can go out on a connection the server is closing.
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0
            ),
        )
        self.bad = _bad_bodies(model)
        self.openings = [self._text(40 + 20 * i) for i in range(8)]
        # ~450 to 1,100 tokens on the tiny model: with a tail and max_tokens, within its 2,048
        # pool tokens, and more than half of them, so two long prompts at once must park.
        self.documents = [self._text(150 + 70 * i) for i in range(4)]
        self._kinds = list(MIX)
        self._weights = [MIX[k] for k in self._kinds]
        # The first requests (over all workers) are every kind once: a short run tries them all.
        self._first = self.rng.sample(self._kinds, len(self._kinds))

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(words))

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, deadline: float) -> None:
        """One worker: requests back to back until ``deadline`` (time.monotonic)."""
        while time.monotonic() < deadline:
            if self._first:
                kind = self._first.pop()
            else:
                kind = self.rng.choices(self._kinds, self._weights)[0]
            self.tally.sent[kind] += 1
            try:
                await getattr(self, "_" + kind)()
            except httpx.TimeoutException as e:
                self.tally.timeouts += 1
                self.tally.note(f"{kind}: timeout ({type(e).__name__})")
            except httpx.TransportError as e:
                self.tally.transport += 1
                self.tally.note(f"{kind}: {type(e).__name__}: {e}{_causes(e)}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                # A 2xx whose body is not the answer's shape (bad JSON, a missing field).
                self.tally.malformed += 1
                self.tally.note(f"{kind}: unreadable answer: {type(e).__name__}: {e}")

    # --- bodies -----------------------------------------------------------------------------

    def _body(self, long: bool = False) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        head = rng.choice(self.documents) if long else rng.choice(self.openings)
        text = f"{head} {self._text(rng.randint(3, 30))}"
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": rng.randint(1, self.max_tokens),
            "temperature": rng.choice((0, 0, 0.8)),
            "seed": rng.randint(0, 2**31),
        }
        if rng.random() < 0.3:
            body["ignore_eos"] = True  # vLLM's: the whole max_tokens, so pages fill up
        if rng.random() < 0.5:
            return "/v1/completions", {**body, "prompt": text}
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}

    # --- kinds ------------------------------------------------------------------------------

    async def _whole(self, long: bool = False) -> None:
        path, body = self._body(long)
        t0 = time.monotonic()
        r = await self.client.post(path, json=body)
        self.tally.count_status(r.status_code, "whole", r.text)
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            if choice.get("finish_reason") not in ("stop", "length"):
                self.tally.incomplete += 1
                self.tally.note(f"whole: finish_reason {choice.get('finish_reason')!r}")
            else:
                self.tally.served += 1
                self.tally.latencies.append(time.monotonic() - t0)

    async def _long(self) -> None:
        if self.rng.random() < 0.5:
            await self._whole(long=True)
        else:
            await self._stream(long=True)

    async def _stream(self, long: bool = False, leave_after: int | None = None) -> None:
        path, body = self._body(long)
        body["stream"] = True
        if leave_after is not None:  # an answer long enough to leave in the middle of
            body["max_tokens"] = self.max_tokens
            body["ignore_eos"] = True
        t0 = time.monotonic()
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.tally.count_status(r.status_code, "stream", (await r.aread()).decode())
                return
            self.tally.count_status(200, "stream")
            events, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                events += 1
                if leave_after is not None and events >= leave_after:
                    # Leaving the block unread closes the connection: the hang-up.
                    self.tally.hangups += 1
                    return
                if '"error"' in line and json.loads(line[6:]).get("error"):
                    self.tally.note(f"stream: error event {line[:200]}")
        if done:
            self.tally.served += 1
            self.tally.latencies.append(time.monotonic() - t0)
        else:
            self.tally.incomplete += 1
            self.tally.note(f"stream: ended without [DONE] after {events} events")

    async def _hangup_stream(self) -> None:
        # Gone after the first event, or somewhere in the answer (a short answer's [DONE]
        # may come first: then it is served).
        await self._stream(long=self.rng.random() < 0.3, leave_after=self.rng.randint(1, 12))

    async def _hangup_whole(self) -> None:
        path, body = self._body(long=self.rng.random() < 0.3)
        body["max_tokens"] = self.max_tokens
        body["ignore_eos"] = True
        # Its own connection, closed on leaving: a hang-up is the client closing its socket.
        # A request cancelled inside a shared pool may leave that connection half-used for
        # the next request (httpx issue 1461), an error of the client, not the server's.
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.client.headers, timeout=self.client.timeout
        ) as own:
            try:
                r = await asyncio.wait_for(own.post(path, json=body), self.rng.uniform(0.01, 1.0))
            except TimeoutError:
                self.tally.hangups += 1
                return
        self.tally.count_status(r.status_code, "hangup_whole", r.text)
        if r.status_code == 200:
            self.tally.served += 1

    async def _bad(self) -> None:
        rng = self.rng
        pick = rng.randrange(len(self.bad) + 3)
        if pick >= len(self.bad):  # ids of things that do not exist, and a wrong media type
            if pick == len(self.bad):
                name, r = "unknown model id", await self.client.get("/v1/models/no-such-model")
            elif pick == len(self.bad) + 1:
                name, r = "unknown response id", await self.client.get("/v1/responses/resp_x")
            else:
                name = "text/plain body"
                r = await self.client.post(
                    "/v1/completions", content=b"{}", headers={"content-type": "text/plain"}
                )
        else:
            name, path, body = self.bad[pick]
            if isinstance(body, bytes):
                headers = {"content-type": "application/json"}
                r = await self.client.post(path, content=body, headers=headers)
            else:
                r = await self.client.post(path, json=body)
        self.tally.count_status(r.status_code, f"bad ({name})", r.text)
        if r.is_success:
            self.tally.accepted_bad += 1
            self.tally.note(f"bad body accepted ({name}): HTTP {r.status_code}")


def _causes(e: BaseException) -> str:
    """The exceptions under ``e`` (an empty httpx ReadError may be a reset or a local close)."""
    out = []
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
        out.append(f"{type(e).__name__}({e})")
    return f" [from {' <- '.join(out)}]" if out else ""
