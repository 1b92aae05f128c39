"""Hypothesis state machine: the Rust cache against a brute-force model of what it holds.

The model keeps one entry per cached page, keyed by (the tokens before it, its tokens), with
its tier, its device page, the tick of its last use and how many locks cover it; parked pages
also belong to the parked entry they went out with. It learns every eviction, park and wake
only from the values ``make_room``, ``wake`` and ``insert`` return, and checks each of them:

- exact LRU: every evicted entry's pages are, deepest first, the coldest unlocked pages with no
  resident page under them (ties deeper first), one after another; every parked entry dropped
  to make host room is the coldest unlocked parked entry with nothing under it;
- bytes: park and wake plans are landed into a model of what each device and host page and
  slot holds, and every hit's pages and state slot must hold exactly the hit's tokens;
- counts: the counters equal what the values said, and ``parked - woken - dropped_parked`` is
  the number of parked entries.

Requests live across steps, holding a lock, pages and a state slot while other requests start,
finish or abort and ``make_room`` runs. After every refused call the stats and every match are
what they were. Geometries with and without state slots and a host tier.
"""

import os
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kern.pool as kp

PAGE_BYTES = 64

# CI must see at least 200 examples of at least 50 steps. Hypothesis draws how many steps an
# example runs (up to stateful_step_count), so ask for more of both and count what ran.
EXAMPLES = int(os.environ.get("KERN_MODEL_EXAMPLES", "400"))
STEPS = 60
MIN_LONG_EXAMPLES, LONG = 200, 50
steps_run: list[int] = []

Key = tuple[tuple[int, ...], tuple[int, ...]]  # (tokens before the page, the page's tokens)


def u32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


def ids(b: bytes | None) -> list[int]:
    assert b is not None
    return np.frombuffer(b, dtype=np.uint32).tolist()


def stats(c: kp.Cache) -> tuple:
    s = c.stats()
    return tuple(getattr(s, k) for k in dir(s) if not k.startswith("_"))


@dataclass
class Page:
    tier: str  # "R" resident, "P" parked
    dev: int | None  # device page id while resident
    host: int | None  # host page id while parked
    tick: int
    locks: int = 0
    group: int | None = None  # the parked entry it belongs to


@dataclass
class Group:
    """A parked entry: its pages, root first."""

    keys: list[Key]


@dataclass
class Snap:
    tier: str
    slot: int


@dataclass
class Lookup:
    hit: int
    resident: int
    read: list[Key]  # the pages the hit reads, root first
    locked: list[Key]  # what a match locks and refreshes (a parked entry read in part: all)
    state: tuple[int, Snap] | None


@dataclass
class Request:
    tokens: tuple[int, ...]
    node: int | None
    pages: list[int]  # the block table: the tree's pages for the hit, then the request's own
    own: list[int]
    slot: int | None
    snapshot: bool


class Model:
    def __init__(self, pt: int):
        self.pt = pt
        self.pages: dict[Key, Page] = {}
        self.groups: dict[int, Group] = {}
        self.next_group = 0
        self.snaps: dict[tuple[int, ...], Snap] = {}
        self.clock = 0
        self.locks: dict[int, list[list[Key]]] = {}  # handle -> the pages of each lock held
        self.parked = self.woken = self.dropped_resident = self.dropped_parked = 0
        self.dev: dict[int, tuple[int, ...]] = {}  # device page -> tokens written in it
        self.host: dict[int, tuple[int, ...]] = {}
        self.dev_slot: dict[int, tuple[int, ...]] = {}  # slot -> the prefix its state is of
        self.host_slot: dict[int, tuple[int, ...]] = {}

    # ---- pages and paths

    def keys_of(self, tokens) -> list[Key]:
        t, pt = tuple(tokens), self.pt
        return [(t[: g * pt], t[g * pt : (g + 1) * pt]) for g in range(-(-len(t) // pt))]

    @staticmethod
    def end(k: Key) -> int:
        return len(k[0]) + len(k[1])

    def under(self, k: Key) -> list[Key]:
        """The pages right under `k` (only a whole page has any)."""
        if len(k[1]) < self.pt:
            return []
        path = k[0] + k[1]
        return [c for c in self.pages if c[0] == path]

    def entry_keys(self, key: kp.EntryKey) -> list[Key]:
        tokens = ids(key.tokens)
        assert len(tokens) == key.end and key.start % self.pt == 0
        return self.keys_of(tokens)[key.start // self.pt :]

    # ---- lookups

    def lookup(self, query, detour: bool = True) -> Lookup:
        """What a match reads: the longest path (what an insert walks, ``detour`` False),
        unless a page shorter than a page, at a page boundary the path passed, is a prefix of
        the rest and ends at a state snapshot deeper than any on the path."""
        q, pt = tuple(query), self.pt
        read: list[Key] = []
        hit = 0
        while True:
            rest = q[hit:]
            k = (q[:hit], rest[:pt])
            if len(rest) >= pt and k in self.pages:
                read.append(k)
                hit += pt
                continue
            here = [p for p in self.pages if p[0] == q[:hit]]
            exact = [p for p in here if p[1] == rest]
            # The key ends inside a page: resident before parked, then the one used last.
            inside = [p for p in here if len(rest) < pt and len(p[1]) > len(rest)]
            inside = [p for p in inside if p[1][: len(rest)] == rest]
            shorter = [p for p in here if len(p[1]) < min(pt, len(rest) + 1)]
            shorter = [p for p in shorter if rest[: len(p[1])] == p[1]]
            if rest and exact:
                read.append(exact[0])
                hit += len(rest)
            elif rest and inside:
                best = max(inside, key=lambda p: (self.pages[p].tier == "R", self.pages[p].tick))
                read.append(best)
                hit += len(rest)
            elif shorter:
                best = max(shorter, key=lambda p: len(p[1]))
                read.append(best)
                hit += len(best[1])
            break
        if detour and self.snaps:
            read, hit = self.detour(q, read, hit)
        resident = 0
        for k in read:
            if self.pages[k].tier != "R":
                break
            resident = min(self.end(k), hit)
        locked = list(read)
        if read and self.pages[read[-1]].tier == "P":
            keys = self.groups[self.pages[read[-1]].group].keys
            locked += keys[keys.index(read[-1]) + 1 :]
        state = None
        for k in read:
            path = k[0] + k[1]
            if path in self.snaps and len(path) <= hit:
                state = (len(path), self.snaps[path])
        return Lookup(hit, resident, read, locked, state)

    def detour(self, q: tuple[int, ...], read: list[Key], hit: int) -> tuple[list[Key], int]:
        pt = self.pt
        ends = [self.end(k) for k in read if self.end(k) <= hit and k[0] + k[1] in self.snaps]
        best, best_end = None, max(ends, default=0)
        for g in range(len(read) + 1):
            h = g * pt
            if h > hit or (g > 0 and len(read[g - 1][1]) < pt):
                break
            rest = q[h:]
            for p in self.pages:
                n = len(p[1])
                if p[0] == q[:h] and n < pt and rest[:n] == p[1] and n <= len(rest):
                    if q[:h] + p[1] in self.snaps and h + n > best_end:
                        best, best_end = p, h + n
        if best is None:
            return read, hit
        return read[: len(best[0]) // pt] + [best], best_end

    def touch(self, keys: list[Key]) -> None:
        self.clock += 1
        for k in keys:
            self.pages[k].tick = self.clock

    def lock(self, node: int, keys: list[Key]) -> None:
        for k in keys:
            self.pages[k].locks += 1
        self.locks.setdefault(node, []).append(keys)

    def unlock(self, node: int) -> None:
        for k in self.locks[node].pop():
            self.pages[k].locks -= 1
        if not self.locks[node]:
            del self.locks[node]

    # ---- eviction order

    def resident_candidates(self) -> list[Key]:
        return [
            k
            for k, e in self.pages.items()
            if e.tier == "R"
            and e.locks == 0
            and not any(self.pages[c].tier == "R" for c in self.under(k))
        ]

    def coldest(self, keys: list[Key]) -> Key:
        return min(keys, key=lambda k: (self.pages[k].tick, -self.end(k)))

    def take_resident(self, keys: list[Key], tier: str) -> None:
        """`keys` (one entry, root first) leave the device, deepest first; each must be the
        coldest candidate at its turn."""
        for k in reversed(keys):
            e = self.pages.get(k)
            assert e is not None and e.tier == "R", f"{k} evicted but the model has {e}"
            want = self.coldest(self.resident_candidates())
            assert k == want, f"evicted {k} (tick {e.tick}) before {want}"
            if tier == "P":
                e.tier = "P"
            else:
                del self.pages[k]

    def parked_group_of(self, key: kp.EntryKey) -> int:
        keys = self.entry_keys(key)
        g = self.pages[keys[0]].group
        assert g is not None and self.groups[g].keys == keys, f"{keys} is not a parked entry"
        return g

    def drop_group(self, g: int, check_order: bool) -> None:
        keys = self.groups[g].keys
        if check_order:
            cands = [
                h
                for h, grp in self.groups.items()
                if not self.under(grp.keys[-1]) and all(self.pages[k].locks == 0 for k in grp.keys)
            ]
            assert g in cands, f"dropped parked {keys}, which is locked or has pages under it"
            last = {h: self.groups[h].keys[-1] for h in cands}
            want = min(cands, key=lambda h: (self.pages[last[h]].tick, -self.end(last[h])))
            assert g == want, f"dropped parked {keys} before {self.groups[want].keys}"
        for k in keys:
            host = self.pages.pop(k).host
            self.host.pop(host)
        path = keys[-1][0] + keys[-1][1]
        snap = self.snaps.get(path)
        if snap is not None and snap.tier == "P":
            del self.snaps[path]
            self.host_slot.pop(snap.slot)
        del self.groups[g]
        self.dropped_parked += 1

    # ---- what the cache returned

    def evicted(self, room: kp.Room) -> tuple[int, int]:
        """Apply what one make-room call took; returns the device (pages, slots) it freed."""
        pages_freed = slots_freed = 0
        subtree: list[int] = []  # parked entries dropped with the resident one that follows
        for e in room.evicted:
            match e:
                case kp.Evicted.Parked(key, plan, dropped):
                    for d in dropped:
                        self.drop_group(self.parked_group_of(d), check_order=True)
                    keys = self.entry_keys(key)
                    src, dst = ids(plan.src_pages), ids(plan.dst_pages)
                    assert src == [self.pages[k].dev for k in keys]
                    self.take_resident(keys, "P")
                    g = self.next_group
                    self.next_group += 1
                    self.groups[g] = Group(keys)
                    for k, s, d in zip(keys, src, dst, strict=True):
                        assert self.dev.pop(s) == k[1], f"device page {s} did not hold {k}"
                        self.host[d] = k[1]
                        p = self.pages[k]
                        p.dev, p.host, p.group = None, d, g
                    path = keys[-1][0] + keys[-1][1]
                    snap = self.snaps.get(path)
                    states = list(zip(ids(plan.src_states), ids(plan.dst_states), strict=True))
                    if snap is not None and snap.tier == "R":
                        assert len(states) == 1 and states[0][0] == snap.slot
                        assert self.dev_slot.pop(snap.slot) == path
                        self.host_slot[states[0][1]] = path
                        self.snaps[path] = Snap("P", states[0][1])
                        slots_freed += 1
                    else:
                        assert states == []
                    pages_freed += len(keys)
                    self.parked += 1
                case kp.Evicted.Dropped(key, True):
                    subtree.append(self.parked_group_of(key))
                case kp.Evicted.Dropped(key, False):
                    keys = self.entry_keys(key)
                    path = keys[-1][0] + keys[-1][1]
                    below = set()
                    if len(keys[-1][1]) == self.pt:  # only a whole page has pages under it
                        below = {
                            k
                            for k in self.pages
                            if len(k[0]) >= len(path) and k[0][: len(path)] == path
                        }
                    got = {k for g in subtree for k in self.groups[g].keys}
                    assert got == below, f"dropped {key} with {got}, under it are {below}"
                    for g in subtree:
                        self.drop_group(g, check_order=False)
                    subtree = []
                    for k in keys:
                        self.dev.pop(self.pages[k].dev)
                    self.take_resident(keys, "R-dropped")
                    snap = self.snaps.pop(path, None)
                    if snap is not None:
                        assert snap.tier == "R"
                        self.dev_slot.pop(snap.slot)
                        slots_freed += 1
                    pages_freed += len(keys)
                    self.dropped_resident += 1
        assert subtree == [], "parked entries dropped with no resident entry after them"
        return pages_freed, slots_freed

    def wake(self, node: int, woken: kp.Woken) -> None:
        locked = self.locks[node][-1]
        groups: list[int] = []
        for k in locked:
            g = self.pages[k].group
            if self.pages[k].tier == "P" and g not in groups:
                groups.append(g)
        want = [self.groups[g].keys for g in groups]
        assert [self.entry_keys(k) for k in woken.keys] == want
        plan = woken.plan
        src, dst = ids(plan.src_pages), ids(plan.dst_pages)
        assert src == [self.pages[k].host for keys in want for k in keys]
        states = list(zip(ids(plan.src_states), ids(plan.dst_states), strict=True))
        for keys, g in zip(want, groups, strict=True):
            for k in keys:
                p = self.pages[k]
                d = dst.pop(0)
                assert self.host.pop(p.host) == k[1]
                self.dev[d] = k[1]
                p.tier, p.dev, p.host, p.group = "R", d, None, None
            path = keys[-1][0] + keys[-1][1]
            snap = self.snaps.get(path)
            if snap is not None:
                s, d = states.pop(0)
                assert s == snap.slot
                self.dev_slot[d] = self.host_slot.pop(s)
                self.snaps[path] = Snap("R", d)
            del self.groups[g]
            self.woken += 1
        assert states == []
        self.touch(locked)

    def insert(self, tokens: tuple[int, ...], pages: list[int], slot: int | None) -> tuple:
        """Apply an insert; returns (held, woken, the caller's pages the tree freed)."""
        keys = self.keys_of(tokens)
        look = self.lookup(tokens, detour=False)
        held = look.hit
        gives = slot is not None
        woken = 0
        freed: list[int] = []
        # The key ends inside a page the tree holds (read, not the key's own page).
        inside = held == len(tokens) and look.read and look.read[-1] != keys[-1]
        touched = list(keys)
        if inside:
            read = self.pages[look.read[-1]]
            tree_last = read.tier == "R" and read.dev == pages[-1]
            if (gives or read.tier == "P") and not tree_last:
                # The caller's copy of that page becomes a leaf (with the state, if given);
                # inside a parked entry the whole pages before it are taken too, so the key
                # is resident and the entry's rest stays parked.
                inside = False
            else:
                keys = keys[:-1]  # the last page is a duplicate of the one read
                touched = keys + [look.read[-1]]
                if not tree_last:
                    freed.append(pages[-1])
        covered: dict[int, list[Key]] = {}
        for k in keys:
            p = self.pages.get(k)
            if p is not None and p.tier == "P":
                covered.setdefault(p.group, []).append(k)
        adopt: set[Key] = set()
        for g, ks in covered.items():
            grp = self.groups[g]
            assert ks == grp.keys[: len(ks)]
            if len(ks) == len(grp.keys):
                path = ks[-1][0] + ks[-1][1]
                keeps_state = path in self.snaps and not (gives and len(tokens) == len(path))
                if keeps_state:
                    continue
                adopt.update(ks)
                snap = self.snaps.get(path)
                if snap is not None:
                    self.host_slot.pop(snap.slot)
                    del self.snaps[path]  # the caller's slot takes its place below
                del self.groups[g]
                woken += 1
            else:
                adopt.update(ks)
                grp.keys = grp.keys[len(ks) :]
        for k, page in zip(keys, pages, strict=False):
            p = self.pages.get(k)
            if k in adopt:
                self.host.pop(p.host)
                p.tier, p.dev, p.host, p.group = "R", page, None, None
                assert self.dev[page] == k[1]
            elif p is None:
                self.pages[k] = Page("R", page, None, 0)
                assert self.dev[page] == k[1]
            elif p.tier == "P" or p.dev != page:
                freed.append(page)
        if gives:
            path = tuple(tokens)
            snap = self.snaps.get(path)
            if inside or (snap is not None and snap.tier == "R"):
                freed.append(-1 - slot)  # the slot, freed: held already, or nowhere to go
            else:
                assert snap is None
                self.snaps[path] = Snap("R", slot)
        self.touch(touched)
        self.woken += woken
        return held, woken, freed

    def check_hit(self, m: kp.Match, query) -> None:
        """Every resident page of a hit holds the hit's tokens; so does its state slot."""
        want = self.lookup(query)
        assert (m.hit_len, m.resident_len) == (want.hit, want.resident), query
        pages = ids(m.pages)
        assert pages == [self.pages[k].dev for k in want.read][: len(pages)]
        for p, k in zip(pages, want.read, strict=False):
            assert self.dev[p] == k[1]
        if want.state is None:
            assert m.state_len is None
        else:
            n, snap = want.state
            assert m.state_len == n
            assert m.state_slot == (snap.slot if snap.tier == "R" else None)
            if snap.tier == "R":
                assert self.dev_slot[snap.slot] == tuple(query[:n])


BASES = [(), (7, 7, 7, 1, 2), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), (7, 7, 8)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        pt=st.sampled_from([1, 2, 4]),
        device_pages=st.integers(8, 40),
        host_pages=st.sampled_from([0, 3, 8, 20]),
        stateful=st.booleans(),
    )
    def setup(self, pt, device_pages, host_pages, stateful):
        self.cache = kp.Cache(
            page_tokens=pt,
            page_bytes=PAGE_BYTES,
            state_bytes=PAGE_BYTES if stateful else 0,
            device_bytes=device_pages * PAGE_BYTES,
            host_bytes=host_pages * PAGE_BYTES,
        )
        self.cache._record_paths(True)
        self.model = Model(pt)
        self.pt = pt
        self.stateful = stateful
        self.whole_page_hits = False
        self.requests: list[Request] = []
        self.steps = 0
        self.start = self.cache.stats()

    # ---- helpers

    def room(self, pages: int, slots: int = 0, park: bool = True) -> kp.Room:
        before = self.cache.stats()
        room = self.cache.make_room(pages, slots, park)
        freed = self.model.evicted(room)
        # The device gave back exactly what the returned values name.
        after = self.cache.stats()
        assert (before.pages_used - after.pages_used, before.slots_used - after.slots_used) == freed
        return room

    def alloc(self, n: int) -> list[int] | None:
        """``n`` of the pages free now, through ``take_pages`` (nothing is evicted for them), or
        None when fewer are free."""
        if self.cache.pages_free < n:
            return None
        pages, room = self.cache.take_pages(n)
        assert pages is not None and room.evicted == []
        return ids(pages)

    def refused(self, call, error) -> None:
        """`call` must raise `error` (with `error` None: return a refusal it checks itself) and
        change nothing: stats and every match as before."""
        cache, model = self.cache, self.model
        probes = [k[0] + k[1] for k in model.pages] + [b for b in BASES if b]

        def look() -> list:
            ms = [cache._peek(u32(q)) for q in probes]
            return [(m.hit_len, m.resident_len, m.pages, m.state_len, m.state_slot) for m in ms]

        before, peeks = stats(cache), look()
        if error is None:
            call()
        else:
            try:
                call()
            except error:
                pass
            else:
                raise AssertionError(f"{call} did not raise {error}")
        assert stats(cache) == before
        assert look() == peeks
        cache.check_integrity()

    # ---- requests

    @precondition(lambda self: len(self.requests) < 3)
    @rule(
        base=st.sampled_from(BASES),
        extra=st.lists(st.integers(0, 2), max_size=12),
        snapshot=st.booleans(),
    )
    def start(self, base, extra, snapshot):
        self.begin(tuple(base) + tuple(extra), snapshot)

    @precondition(lambda self: 0 < len(self.requests) < 3)
    @rule(i=st.integers(0, 2), snapshot=st.booleans())
    def start_twin(self, i, snapshot):
        """A second request for an open one's tokens: whichever finishes second finds them
        cached (or parked meanwhile) and its own pages duplicates."""
        self.begin(self.requests[i % len(self.requests)].tokens, snapshot)

    def begin(self, tokens: tuple[int, ...], snapshot: bool) -> None:
        if not tokens:
            return
        cache, model, pt = self.cache, self.model, self.pt
        snapshot = snapshot and self.stateful
        want = model.lookup(tokens)
        m = cache.match(u32(tokens))
        model.check_hit(m, tokens)
        node = m.node
        if node is not None:
            model.lock(node, want.locked)
            model.touch(want.locked)
        hit = m.resident_len
        if m.resident_len < m.hit_len:
            parked = [k for k in want.locked if model.pages[k].tier == "P"]
            groups = {model.pages[k].group for k in parked}
            need_states = sum(
                1
                for g in groups
                if model.groups[g].keys[-1][0] + model.groups[g].keys[-1][1] in model.snaps
            )
            for attempt in range(2):
                try:
                    woken = cache.wake(node)
                except kp.PoolFull:
                    if attempt == 0:
                        self.room(len(parked), need_states)
                    continue
                model.wake(node, woken)
                hit = m.hit_len
                break
        m = cache._peek(u32(tokens))
        model.check_hit(m, tokens)
        hit = min(hit, m.resident_len)
        shared = ids(m.pages)[: hit // pt]
        need = -(-len(tokens) // pt) - len(shared)
        own, slot = [], None
        if snapshot:
            self.room(need, 1)
            own = self.alloc(need)
            if own is not None:
                try:
                    slot = cache.alloc_slot()
                except kp.PoolFull:
                    cache.free_pages(u32(own))
                    own = None
        else:
            # Room and pages in one call, as the scheduler takes them.
            before = cache.stats()
            pages, room = cache.take_pages(need)
            freed = model.evicted(room)
            after = cache.stats()
            taken = 0 if pages is None else need
            assert before.pages_used - after.pages_used + taken == freed[0]
            assert before.slots_used - after.slots_used == freed[1]
            assert (pages is not None) == room.fits
            own = None if pages is None else ids(pages)
            assert len(own or []) == (need if room.fits else 0)
        if own is None:
            if node is not None:
                cache.unlock(node)
                model.unlock(node)
            return
        for g, p in enumerate(own, start=len(shared)):
            model.dev[p] = tokens[g * pt : (g + 1) * pt]
        if slot is not None:
            model.dev_slot[slot] = tokens
        self.requests.append(Request(tokens, node, shared + own, own, slot, snapshot))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 2), fused=st.booleans())
    def finish(self, i, fused):
        """Insert, unlock: one after the other, or fused in one `release` that also frees a
        page the request holds past its key, if one can be had."""
        r = self.requests.pop(i % len(self.requests))
        cache, model = self.cache, self.model
        before = cache._peek(u32(r.tokens))
        if fused:
            extra = self.alloc(1) or []
            if extra and r.node is not None:
                # A page named twice is refused, changing nothing.
                self.refused(
                    lambda: cache.release(
                        u32(r.tokens), u32(r.pages), state=r.slot, node=r.node, free=u32(extra * 2)
                    ),
                    kp.RepeatedId,
                )
            ins = cache.release(
                u32(r.tokens), u32(r.pages), state=r.slot, node=r.node, free=u32(extra)
            )
        else:
            ins = cache.insert(u32(r.tokens), u32(r.pages), r.slot)
        held, woken, freed = model.insert(r.tokens, r.pages, r.slot)
        # What the tree held before is what a match would have hit, but for a snapshot detour.
        assert before.hit_len == held or before.state_len == before.hit_len
        assert ins.woken == woken
        for p in freed:
            if p >= 0:
                model.dev.pop(p)
            else:
                model.dev_slot.pop(-1 - p)
        if r.node is not None:
            if not fused:
                cache.unlock(r.node)
            model.unlock(r.node)
        # The request's whole key hits now (or, with no snapshot at its end, a deeper one on a
        # short sibling), and what it held is the tree's or free.
        again = cache._peek(u32(r.tokens))
        assert again.hit_len == len(r.tokens) or (
            r.slot is None and again.state_len == again.hit_len
        )

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 2))
    def abort(self, i):
        r = self.requests.pop(i % len(self.requests))
        cache, model = self.cache, self.model
        cache.free_pages(u32(r.own))
        for p in r.own:
            model.dev.pop(p)
        if r.slot is not None:
            cache.free_slot(r.slot)
            model.dev_slot.pop(r.slot)
        if r.node is not None:
            cache.unlock(r.node)
            model.unlock(r.node)

    # ---- the cache alone

    @rule(pages=st.integers(0, 50), slots=st.integers(0, 2), park=st.booleans())
    def make_room(self, pages, slots, park):
        if slots and not self.stateful:
            slots = 0
        self.room(pages, slots, park)

    @rule(query=st.lists(st.sampled_from([0, 1, 2, 7, 8]), min_size=1, max_size=14))
    def probe(self, query):
        self.model.check_hit(self.cache._peek(u32(query)), tuple(query))

    @rule(kind=st.integers(0, 6), pick=st.integers(0, 1000))
    def refuse(self, kind, pick):
        cache, model = self.cache, self.model
        tree_pages = [p.dev for p in model.pages.values() if p.tier == "R"]
        mine = [p for r in self.requests for p in r.own]
        held = {n for n in model.locks}
        if kind == 0 and tree_pages:
            p = tree_pages[pick % len(tree_pages)]
            self.refused(lambda: cache.free_pages(u32([p])), kp.OwnedByCache)
        elif kind == 1 and mine:
            p = mine[pick % len(mine)]
            self.refused(lambda: cache.free_pages(u32([p, p])), kp.RepeatedId)
        elif kind == 2 and model.pages:
            # A handle nobody holds a lock on (perhaps one that names no node any more).
            k = list(model.pages)[pick % len(model.pages)]
            node = cache._peek(u32(k[0] + k[1])).node
            if node is not None and node not in held:
                self.refused(lambda: cache.unlock(node), kp.NotLocked)
        elif kind == 3 and mine:
            p = mine[pick % len(mine)]
            tokens = u32([5] * (2 * self.pt))
            self.refused(lambda: cache.insert(tokens, u32([p, p])), kp.RepeatedId)
        elif kind == 4:

            def too_many() -> None:  # more pages than the pool has: none, and nothing evicted
                # One more than could ever be free: the slots' starting chunks are not pages'.
                for n in (cache.device.num_pages + 1, self.start.pages_free + 1):
                    pages, room = cache.take_pages(n)
                    assert (pages, room.fits, room.evicted) == (None, False, [])
                    assert cache.make_room(n) is room  # evicting nothing: one shared Room

            self.refused(too_many, None)
        elif kind == 5:
            self.refused(lambda: cache.wake(pick << 32), kp.UnknownNode)
        elif kind == 6 and tree_pages:
            p = tree_pages[pick % len(tree_pages)]
            self.refused(lambda: cache.insert(u32([9] * self.pt), u32([p])), kp.OwnedByCache)

    # ---- after every step

    @invariant()
    def agree(self):
        cache, model = self.cache, self.model
        self.steps += 1
        cache.check_integrity()
        for prefix, page in list(model.pages):
            query = prefix + page
            m = cache._peek(u32(query))
            model.check_hit(m, query)
            assert m.hit_len == len(query) or m.state_len == m.hit_len  # a snapshot detour
        s = cache.stats()
        tiers = [p.tier for p in model.pages.values()]
        snaps = [x.tier for x in model.snaps.values()]
        own = sum(len(r.own) for r in self.requests)
        slots = sum(r.slot is not None for r in self.requests)
        assert (s.resident_pages, s.parked_pages) == (tiers.count("R"), tiers.count("P"))
        assert (s.resident_states, s.parked_states) == (snaps.count("R"), snaps.count("P"))
        assert s.pages_used == s.resident_pages + own
        assert s.slots_used == s.resident_states + slots
        assert s.host_pages_used == s.parked_pages
        # Evictions counted from the returned values alone account for every parked entry.
        assert model.parked - model.woken - model.dropped_parked == len(model.groups)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        steps_run.append(self.steps - 1)  # the first invariant check runs before any step
        while self.requests:
            self.abort(0)
        # Nothing leaks: with every resident entry dropped the device is back at its start
        # (room for every page that could ever be free: the slots' floor never is).
        self.room(self.start.pages_free, 0, False)
        s = self.cache.stats()
        assert s.pages_used == 0 and s.pages_free == self.start.pages_free
        assert s.slots_used == 0
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
