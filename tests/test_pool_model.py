"""Hypothesis state machine: the Rust cache against a brute-force model of the tree.

The model keeps one entry per cached page, keyed by (the page-aligned prefix before it, the
page's tokens), with its tier. It learns every eviction only from what ``make_room`` returns
(and every wake from what ``wake`` returns), and after every step the model and the cache agree
on each entry's hit and tier, on random probes, on page counts and on the eviction counters.
"""

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kern.pool import Cache, Evicted, PoolFull

PAGE_BYTES = 64

# CI must see at least 200 examples of at least 50 steps. Hypothesis draws how many steps an
# example runs (up to stateful_step_count), so ask for more of both and count what ran.
EXAMPLES = int(os.environ.get("KERN_MODEL_EXAMPLES", "300"))
STEPS = 60
MIN_LONG_EXAMPLES, LONG = 200, 50
steps_run: list[int] = []


def u32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


def ids(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype=np.uint32).tolist()


class Model:
    """Brute force: every cached page as its own entry."""

    def __init__(self, pt: int):
        self.pt = pt
        self.tier: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
        self.parked = self.dropped_resident = self.dropped_parked = 0

    def pages_of(self, tokens: tuple[int, ...], start: int = 0):
        pt = self.pt
        for g in range(start // pt, -(-len(tokens) // pt)):
            yield tokens[: g * pt], tokens[g * pt : (g + 1) * pt]

    def covering(self, prefix, page):
        """Entries at `prefix` whose tokens start with `page`."""
        return [k for k in self.tier if k[0] == prefix and k[1][: len(page)] == page]

    def insert(self, tokens: tuple[int, ...]):
        # Stop where the tokens leave the cached tree: past that point nothing covers them.
        for prefix, page in self.pages_of(tokens):
            if not self.covering(prefix, page):
                self.tier[(prefix, page)] = "resident"

    def lookup(self, query: tuple[int, ...]) -> tuple[int, int]:
        """(hit_len, resident_len) as the tree defines them."""
        pt, hit, resident, all_resident = self.pt, 0, 0, True
        g = 0
        while True:
            prefix, want = query[: g * pt], query[g * pt : (g + 1) * pt]
            if not want:
                break
            best, best_tiers = 0, []
            for (p, page), tier in self.tier.items():
                if p != prefix:
                    continue
                n = 0
                while n < min(len(page), len(want)) and page[n] == want[n]:
                    n += 1
                if n > best:
                    best, best_tiers = n, [tier]
                elif n == best and n > 0:
                    best_tiers.append(tier)
            if best == 0:
                break
            hit = g * pt + best
            all_resident = all_resident and "resident" in best_tiers
            if all_resident:
                resident = hit
            full = best == pt and len(want) == pt
            if not full:
                break
            g += 1
        return hit, resident

    def entries(self, key, tier):
        tokens = tuple(ids(key.tokens))
        assert key.start % self.pt == 0
        keys = list(self.pages_of(tokens, key.start))
        for k in keys:
            assert self.tier.get(k) == tier, f"{k} is {self.tier.get(k)}, evict said {tier}"
        return keys

    def evicted(self, taken):
        for e in taken:
            match e:
                case Evicted.Parked(key, _plan, dropped):
                    for d in dropped:
                        for k in self.entries(d, "parked"):
                            del self.tier[k]
                        self.dropped_parked += 1
                    for k in self.entries(key, "resident"):
                        self.tier[k] = "parked"
                    self.parked += 1
                case Evicted.Dropped(key, parked):
                    for k in self.entries(key, "parked" if parked else "resident"):
                        del self.tier[k]
                    if parked:
                        self.dropped_parked += 1
                    else:
                        self.dropped_resident += 1

    def woken(self, keys):
        for key in keys:
            for k in self.entries(key, "parked"):
                self.tier[k] = "resident"


BASES = [(), (7, 7, 7, 1, 2), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), (7, 7, 8)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        pt=st.sampled_from([1, 2, 4]),
        device_pages=st.integers(6, 40),
        host_pages=st.sampled_from([0, 3, 8, 20]),
    )
    def setup(self, pt, device_pages, host_pages):
        self.cache = Cache(
            page_tokens=pt,
            page_bytes=PAGE_BYTES,
            device_bytes=device_pages * PAGE_BYTES,
            host_bytes=host_pages * PAGE_BYTES,
        )
        self.model = Model(pt)
        self.pt = pt
        self.steps = 0
        self.start = self.cache.stats()

    @rule(base=st.sampled_from(BASES), extra=st.lists(st.integers(0, 2), max_size=12))
    def request(self, base, extra):
        tokens = tuple(base) + tuple(extra)
        if not tokens:
            return
        cache, pt = self.cache, self.pt
        m = cache.match(u32(tokens))
        if m.node is not None:
            cache.lock(m.node)
        if m.resident_len < m.hit_len:
            try:
                woken = cache.wake(m.node)
            except PoolFull:
                self.model.evicted(cache.make_room(-(-m.hit_len // pt) + 1))
                try:
                    woken = cache.wake(m.node)
                except PoolFull:
                    woken = None
            if woken is not None:
                self.model.woken(woken.keys)
            m = cache.match(u32(tokens))
        shared = m.resident_len // pt
        total = -(-len(tokens) // pt)
        self.model.evicted(cache.make_room(total - shared))
        try:
            fresh = cache.alloc_pages(total - shared)
        except PoolFull:
            if m.node is not None:
                cache.unlock(m.node)
            return
        pages = m.pages[: shared * 4] + fresh
        ins = cache.insert(u32(tokens), pages)
        cache.free_pages(ins.duplicates)
        self.model.insert(tokens)
        if m.node is not None:
            cache.unlock(m.node)

    @rule(pages=st.integers(0, 50), park=st.booleans())
    def make_room(self, pages, park):
        self.model.evicted(self.cache.make_room(pages, park=park))

    @rule(query=st.lists(st.sampled_from([0, 1, 2, 7, 8]), min_size=1, max_size=14))
    def probe(self, query):
        m = self.cache.match(u32(query))
        assert (m.hit_len, m.resident_len) == self.model.lookup(tuple(query))

    @invariant()
    def agree(self):
        cache, model = self.cache, self.model
        self.steps += 1
        cache.check_integrity()
        for prefix, page in list(model.tier):
            query = prefix + page
            m = cache.match(u32(query))
            assert (m.hit_len, m.resident_len) == model.lookup(query), query
            assert m.hit_len == len(query)
        s = cache.stats()
        tiers = list(model.tier.values())
        assert s.resident_pages == tiers.count("resident")
        assert s.parked_pages == tiers.count("parked")
        assert s.pages_used == s.resident_pages  # no request holds pages between steps
        assert s.host_pages_used == s.parked_pages
        assert (s.num_parked, s.num_dropped_resident, s.num_dropped_parked) == (
            model.parked,
            model.dropped_resident,
            model.dropped_parked,
        )

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        steps_run.append(self.steps - 1)  # the first invariant check runs before any step
        # Nothing leaks: with every resident entry dropped the device is back at its start.
        self.model.evicted(self.cache.make_room(2**62, park=False))
        s = self.cache.stats()
        assert s.pages_used == 0 and s.pages_free == self.start.pages_free
        self.cache.check_integrity()


CacheMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None
)
TestCacheModel = CacheMachine.TestCase


def test_model_ran_enough_long_examples():
    """Runs after the machine (pytest keeps file order): it saw enough long examples."""
    long = sum(n >= LONG for n in steps_run)
    print(f"model examples: {len(steps_run)}, of which {long} ran >= {LONG} steps")
    assert long >= MIN_LONG_EXAMPLES, (len(steps_run), long)
