"""kern.pool from Python: buffers in and out, every error class, and state after each error."""

import array
import threading
from pathlib import Path

import numpy as np
import pytest

import kern.pool as kp

PT, PB = 4, 64


def u32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


def ids(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype=np.uint32).tolist()


def snapshot(c: kp.Cache) -> tuple:
    s = c.stats()
    return tuple(getattr(s, k) for k in dir(s) if not k.startswith("_"))


@pytest.fixture
def cache() -> kp.Cache:
    c = kp.Cache(page_tokens=PT, page_bytes=PB, device_bytes=64 * PB, host_bytes=16 * PB)
    c._record_paths(True)
    return c


def alloc(c: kp.Cache, n) -> bytes:
    """``n`` pages of the caller's own, through the public verb, where they are free: nothing
    cached is evicted for them."""
    pages, room = c.take_pages(n)
    assert pages is not None and room.evicted == []
    return pages


def cached(c: kp.Cache, tokens) -> kp.Inserted:
    pages = alloc(c, -(-len(tokens) // PT))
    return c.insert(u32(tokens), pages)


def everything(c: kp.Cache) -> int:
    """Room for every page: make_room with this evicts all it can."""
    return c.device.num_pages


def test_stub_names_everything_exported():
    import kern._pool as ext

    stub = (Path(ext.__file__).parent / "_pool.pyi").read_text()
    for name in dir(ext):
        if not name.startswith("_"):
            assert f"class {name}" in stub, name


def test_buffers_of_every_kind_are_read(cache):
    tokens = list(range(10))
    cached(cache, tokens)
    for buf in (
        u32(tokens),
        array.array("I", tokens),
        u32(tokens).tobytes(),
        bytearray(u32(tokens)),
        np.asarray(tokens, dtype=">u4"),  # big-endian: converted, not misread
        np.asarray(tokens, dtype="<u4"),
        np.asarray(tokens, dtype=">u4")[::-1][::-1].copy(),
    ):
        assert cache._peek(buf).hit_len == 10, buf
    # A strided view is a buffer too.
    assert cache._peek(u32(range(20))[::2]).hit_len == 0
    assert cache._peek(u32([0, 0, 1, 0, 2, 0, 3, 0])[::2]).hit_len == 4
    assert cache._peek(np.asarray(range(40), dtype=">u4")[::2]).hit_len == 0
    # Empty buffers of every kind (some have no memory behind them at all).
    for empty in (u32([]), b"", bytearray(), array.array("I"), u32(range(4))[4:]):
        assert cache._peek(empty).hit_len == 0
    assert cache.insert(u32([]), b"").woken == 0
    assert cache._peek(u32([])).hit_len == 0


def test_a_hit_ending_mid_page_shares_the_page_and_refuses_extension_in_place(cache):
    cached(cache, range(6))  # pages [0..4), [4..6)
    m = cache.match(u32([0, 1, 2, 3, 4, 5, 9]))
    assert (m.hit_len, m.resident_len) == (6, 6)
    shared = ids(m.pages)
    assert len(shared) == 2
    before = snapshot(cache)
    # Writing past the hit into the shared page instead of a copy is refused.
    with pytest.raises(kp.SharedPageExtended, match="copy the page"):
        cache.insert(u32([0, 1, 2, 3, 4, 5, 9]), u32(shared))
    assert snapshot(cache) == before
    cache.check_integrity()
    # With a copy of the tail page it goes in; the shared full page is kept as is.
    copy = alloc(cache, 1)
    held = cache._peek(u32([0, 1, 2, 3, 4, 5, 9])).hit_len  # what the tree held before
    ins = cache.insert(u32([0, 1, 2, 3, 4, 5, 9]), u32(shared[:1]).tobytes() + copy)
    assert (held, ins.woken) == (6, 0)
    cache.unlock(m.node)
    assert cache._peek(u32([0, 1, 2, 3, 4, 5, 9])).hit_len == 7
    assert cache._peek(u32([0, 1, 2, 3, 4, 5, 5])).hit_len == 6
    # A key that ends inside a page reads it; one that leaves a page mid-way does not.
    assert cache._peek(u32([0, 1, 2, 3, 4])).hit_len == 5
    assert cache._peek(u32([0, 1, 2, 3, 4, 7, 7])).hit_len == 4
    cache.check_integrity()


def test_the_same_short_prompt_again_hits(cache):
    cached(cache, range(10))  # a prompt and its answer
    m = cache.match(u32(range(7)))  # the same 7-token prompt: it ends inside the second page
    assert (m.hit_len, m.resident_len, len(ids(m.pages))) == (7, 7, 2)
    cache.unlock(m.node)
    cache.check_integrity()


def test_insert_frees_its_duplicates(cache):
    cached(cache, range(8))
    held = cache._peek(u32(range(8))).hit_len
    ins = cached(cache, range(8))
    assert (held, ins.woken) == (8, 0)
    s = cache.stats()
    assert s.pages_used == s.resident_pages == 2
    cache.check_integrity()


def test_snapshot_at_exact_length():
    c = kp.Cache(page_tokens=PT, page_bytes=PB, state_bytes=2 * PB, device_bytes=64 * PB)
    tokens = list(range(7))
    slot = c.alloc_slot()
    c.insert(u32(tokens), alloc(c, 2), state=slot)
    m = c.match(u32(tokens + [99]))
    assert (m.hit_len, m.state_len, m.state_slot) == (7, 7, slot)
    c.unlock(m.node)
    # The snapshot is the tree's now.
    with pytest.raises(kp.OwnedByCache):
        c.free_slot(slot)
    # A second snapshot at the same length is freed by the insert, not left to the caller.
    other = c.alloc_slot()
    c.insert(u32(tokens), alloc(c, 2), state=other)
    with pytest.raises(kp.NotAllocated):
        c.free_slot(other)
    c.check_integrity()


def test_park_then_wake_lands_copies(cache):
    cached(cache, range(12))
    used = cache.stats().pages_used
    room = cache.make_room(cache.pages_free + 3)
    assert room.fits and cache.stats().pages_used == used - 3
    assert len(room.evicted) == 1
    match room.evicted[0]:
        case kp.Evicted.Parked(key, plan, dropped):
            assert ids(key.tokens) == list(range(12)) and (key.start, key.end) == (0, 12)
            assert dropped == []
            assert plan.num_pages == 3 and len(ids(plan.dst_pages)) == 3
        case other:
            pytest.fail(f"expected a park, got {other}")
    m = cache.match(u32(range(12)))
    assert (m.hit_len, m.resident_len) == (12, 0)
    woken = cache.wake(m.node)
    assert woken.plan.num_pages == 3 and [ids(k.tokens) for k in woken.keys] == [list(range(12))]
    assert cache._peek(u32(range(12))).resident_len == 12
    cache.unlock(m.node)
    # One park and one wake, as the values above said: the entry is back on the device whole.
    s = cache.stats()
    assert (s.resident_pages, s.parked_pages, s.host_pages_used) == (3, 0, 0)
    cache.check_integrity()


def test_keys_carry_paths_only_when_asked():
    c = kp.Cache(page_tokens=PT, page_bytes=PB, device_bytes=64 * PB)
    cached(c, range(8))
    (e,) = c.make_room(everything(c)).evicted
    assert (e.key.start, e.key.end, e.key.tokens) == (0, 8, None)


def test_locked_entries_are_not_evicted(cache):
    cached(cache, range(8))
    m = cache.match(u32(range(8)))
    assert cache.make_room(everything(cache), park=False).evicted == []
    cache.unlock(m.node)
    assert len(cache.make_room(everything(cache), park=False).evicted) == 1
    assert cache.stats().pages_used == 0


def test_room_that_could_never_fit_evicts_nothing(cache):
    cached(cache, range(8))
    room = cache.make_room(10**6)
    assert (room.evicted, room.fits) == ([], False)
    assert cache.stats().resident_pages == 2
    # Slots asked of a cache without them: never, so nothing is evicted for them.
    assert cache.make_room(0, slots=1).evicted == []


def check_unchanged(c: kp.Cache, before: tuple) -> None:
    assert snapshot(c) == before
    c.check_integrity()


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda c, p: c.free_pages(u32([p[0], p[0]])), kp.RepeatedId, "more than once"),
        (lambda c, p: c.free_pages(u32([50])), kp.NotAllocated, "page 50 is not allocated"),
        (lambda c, p: c.unlock(c._peek(u32(range(8))).node), kp.NotLocked, "not locked"),
        (lambda c, p: c.unlock(0xDEAD), kp.NotLocked, "names no live node"),
        (lambda c, p: c.wake(12345), kp.UnknownNode, "names no live node"),
        (lambda c, p: c.match(np.arange(4, dtype=np.int64)), kp.NotU32, "format 'l'"),
        (lambda c, p: c.match([1, 2, 3]), kp.NotU32, "not a buffer"),
        (lambda c, p: c.match(np.zeros(3, np.float32)), kp.NotU32, "format 'f'"),
        (lambda c, p: c.match(np.zeros(8, np.uint8)), kp.NotU32, "format 'B'"),
        (lambda c, p: c.match(b"\x01\x00\x00"), kp.NotU32, "whole number"),
        (
            lambda c, p: c.insert(u32(range(9)), u32(p[:2])),
            kp.LengthMismatch,
            "need 3 pages, got 2",
        ),
        (lambda c, p: c.insert(u32(range(4)), u32([60])), kp.NotAllocated, "page 60"),
        (lambda c, p: c.insert(u32([9] * 8), u32([p[1], p[1]])), kp.RepeatedId, "page"),
        (
            lambda c, p: c.free_pages(c._peek(u32(range(8))).pages),
            kp.OwnedByCache,
            "owned by the prefix",
        ),
        (
            lambda c, p: c.insert(u32([5] * 4), c._peek(u32(range(8))).pages[:4]),
            kp.OwnedByCache,
            "page",
        ),
        (lambda c, p: c.alloc_slot(), kp.PoolFull, "needed 1"),
        (lambda c, p: c.free_slot(0), kp.NotAllocated, "state slot 0"),
        (lambda c, p: c.make_room(0, -1), kp.InvalidArgument, "slots: -1 is out of range"),
        (lambda c, p: c.take_pages(2**64), kp.InvalidArgument, "out of range"),
        (lambda c, p: c.take_pages(1.0), kp.InvalidArgument, "must be an int, got float"),
        (lambda c, p: c.unlock(-1), kp.InvalidArgument, "node: -1"),
        (lambda c, p: c.wake(2**64), kp.InvalidArgument, "node"),
        (lambda c, p: c.free_slot(2**32), kp.InvalidArgument, "slot: 4294967296"),
        (lambda c, p: c.insert(u32([1]), u32(p[:1]), -3), kp.InvalidArgument, "state: -3"),
        (lambda c, p: c.make_room(-1), kp.InvalidArgument, "pages: -1"),
        (lambda c, p: c.make_room(1, slots="2"), kp.InvalidArgument, "slots: must be an int"),
        (lambda c, p: c.make_room(1, park=1), kp.InvalidArgument, "park: must be a bool"),
        (lambda c, p: c.take_pages(-1), kp.InvalidArgument, "n: -1"),
        (lambda c, p: c._record_paths(0), kp.InvalidArgument, "on: must be a bool"),
        (
            lambda c, p: c.release(u32([9] * 4), u32(p[:1]), free=u32(p[:2])),
            kp.RepeatedId,
            "named more than once",
        ),
        (
            lambda c, p: c.release(u32([9] * 4), u32(p[:1]), free=c._peek(u32(range(8))).pages),
            kp.OwnedByCache,
            "page",
        ),
        (lambda c, p: c.release(u32([9] * 4), u32(p[:1]), free=u32([60])), kp.NotAllocated, "60"),
        (
            lambda c, p: c.release(u32([9] * 4), u32(p[:1]), node=c._peek(u32(range(8))).node),
            kp.NotLocked,
            "not locked",
        ),
        (lambda c, p: c.release(u32([9] * 4), u32(p[:1]), node=-1), kp.InvalidArgument, "node"),
        (lambda c, p: c.release(u32([9] * 4), u32(p[:1]), free=[1]), kp.NotU32, "free"),
    ],
)
def test_bad_input_raises_and_changes_nothing(cache, call, error, words):
    cached(cache, range(8))
    mine = ids(alloc(cache, 3))
    before = snapshot(cache)
    peeks = [cache._peek(u32(q)).hit_len for q in (range(8), range(5), [9] * 8)]
    with pytest.raises(error, match=words):
        call(cache, mine)
    check_unchanged(cache, before)
    assert [cache._peek(u32(q)).hit_len for q in (range(8), range(5), [9] * 8)] == peeks


def test_take_pages_is_make_room_then_alloc(cache):
    cached(cache, range(8))
    pages, room = cache.take_pages(3)
    assert (room.fits, room.evicted, len(ids(pages))) == (True, [], 3)
    assert cache.take_pages(0)[1] is room  # evicting nothing: the same Room every time
    everyone_else = alloc(cache, cache.pages_free)
    pages, room = cache.take_pages(2)  # only the cached entry's 2 pages can be had
    assert room.fits
    match room.evicted:
        case [kp.Evicted.Parked(_, plan, [])]:
            assert plan.num_pages == 2
        case other:
            pytest.fail(f"expected one park, got {other}")
    assert len(set(ids(pages))) == 2
    pages, room = cache.take_pages(1)  # nothing left to evict: nothing allocated
    assert (pages, room.fits, room.evicted) == (None, False, [])
    cache.free_pages(everyone_else)
    cache.check_integrity()


def test_release_is_insert_unlock_and_free(cache):
    cached(cache, range(8))
    key = u32(range(12))
    m = cache.match(key)
    own = ids(alloc(cache, 3))  # the key's third page and two past the key
    pages = ids(m.pages) + own[:1]
    used = cache.stats().pages_used
    ins = cache.release(key, u32(pages), node=m.node, free=u32(own[1:]))
    assert (m.hit_len, ins.woken) == (8, 0)
    s = cache.stats()
    assert (s.pages_used, s.resident_pages) == (used - 2, 3)
    with pytest.raises(kp.NotLocked):  # the lock went with the release
        cache.unlock(m.node)
    assert len(cache.make_room(everything(cache), park=False).evicted) == 2
    cache.check_integrity()


def test_numpy_integers_are_ints(cache):
    pages, _ = cache.take_pages(np.int64(2))
    assert len(ids(pages)) == 2
    cache.free_pages(pages)


def test_error_classes_have_builtin_bases():
    assert issubclass(kp.PoolFull, RuntimeError)
    assert issubclass(kp.UnknownNode, KeyError)
    assert issubclass(kp.NotU32, TypeError)
    for e in (
        kp.NotAllocated,
        kp.RepeatedId,
        kp.BudgetTooSmall,
        kp.LengthMismatch,
        kp.InvalidArgument,
    ):
        assert issubclass(e, ValueError)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(page_tokens=4, page_bytes=64, device_bytes=10), "cannot hold one object of 64"),
        (dict(page_tokens=0, page_bytes=64, device_bytes=6400), "page_tokens must be positive"),
        (dict(page_tokens=4, page_bytes=0, device_bytes=6400), "page_bytes must be positive"),
        (dict(page_tokens=4, page_bytes=64, device_bytes=6400, host_bytes=8), "host|cannot hold"),
        (dict(page_tokens=4, page_bytes=64, state_bytes=4096, device_bytes=6400), "initial state"),
    ],
)
def test_budget_errors(kwargs, words):
    with pytest.raises(kp.BudgetTooSmall, match=words):
        kp.Cache(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(page_tokens=-1, page_bytes=64, device_bytes=6400), "page_tokens: -1"),
        (dict(page_tokens=2**32, page_bytes=64, device_bytes=6400), "page_tokens: 4294967296"),
        (dict(page_tokens=4, page_bytes=-64, device_bytes=6400), "page_bytes: -64"),
        (dict(page_tokens=4, page_bytes=64, device_bytes=2**64), "device_bytes"),
        (dict(page_tokens=4, page_bytes=64, device_bytes=6400, min_slots=-2), "min_slots"),
        (dict(page_tokens=4, page_bytes=64, device_bytes="6400"), "must be an int, got str"),
    ],
)
def test_out_of_range_sizes_are_invalid_arguments_not_overflow_errors(kwargs, words):
    with pytest.raises(kp.InvalidArgument, match=words):
        kp.Cache(**kwargs)


def test_long_walks_release_the_gil():
    # A thread keeps counting while another walks long keys; if the GIL were held across the
    # walk the counter could not advance during it.
    c = kp.Cache(page_tokens=16, page_bytes=64, device_bytes=1 << 24)
    key = u32(np.arange(200_000) % 50_000)
    c.insert(key, alloc(c, -(-len(key) // 16)))
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        for _ in range(20):
            c.check_integrity()
            c.unlock(c.match(key).node)
    finally:
        stop.set()
        t.join()
    assert ticks[0] > 0
