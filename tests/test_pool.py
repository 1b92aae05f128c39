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
    return kp.Cache(page_tokens=PT, page_bytes=PB, device_bytes=64 * PB, host_bytes=16 * PB)


def cached(c: kp.Cache, tokens) -> kp.Inserted:
    pages = c.alloc_pages(-(-len(tokens) // PT))
    return c.insert(u32(tokens), pages)


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
    ):
        assert cache.match(buf).hit_len == 10
    # A strided view is a buffer too.
    assert cache.match(u32(range(20))[::2]).hit_len == 1


def test_mid_page_hit_shares_the_page_and_refuses_extension_in_place(cache):
    cached(cache, range(6))  # pages [0..4), [4..6)
    m = cache.match(u32([0, 1, 2, 3, 4, 9]))
    assert (m.hit_len, m.resident_len) == (5, 5)
    shared = ids(m.pages)
    assert len(shared) == 2
    cache.lock(m.node)
    before = snapshot(cache)
    # Writing past the hit into the shared page instead of a copy is refused.
    with pytest.raises(kp.SharedPageExtended, match="copy the page"):
        cache.insert(u32([0, 1, 2, 3, 4, 9]), u32(shared))
    assert snapshot(cache) == before
    cache.check_integrity()
    # With a copy of the tail page it goes in, and only the shared full page is kept as is.
    copy = cache.alloc_pages(1)
    ins = cache.insert(u32([0, 1, 2, 3, 4, 9]), u32(shared[:1]).tobytes() + copy)
    assert ids(ins.duplicates) == []
    cache.unlock(m.node)
    assert cache.match(u32([0, 1, 2, 3, 4, 9])).hit_len == 6
    assert cache.match(u32([0, 1, 2, 3, 4, 5])).hit_len == 6
    cache.check_integrity()


def test_duplicates_come_back_to_free(cache):
    cached(cache, range(8))
    ins = cached(cache, range(8))
    assert len(ids(ins.duplicates)) == 2
    cache.free_pages(ins.duplicates)
    assert cache.stats().pages_used == 2
    cache.check_integrity()


def test_snapshot_at_exact_length(cache):
    c = kp.Cache(page_tokens=PT, page_bytes=PB, state_bytes=2 * PB, device_bytes=64 * PB)
    tokens = list(range(7))
    slot = c.alloc_slot()
    c.insert(u32(tokens), c.alloc_pages(2), state=slot)
    m = c.match(u32(tokens + [99]))
    assert (m.hit_len, m.state_len, m.state_slot) == (7, 7, slot)
    # The snapshot is the tree's now.
    with pytest.raises(kp.OwnedByCache):
        c.free_slot(slot)
    c.check_integrity()


def test_park_then_wake_lands_copies(cache):
    cached(cache, range(12))
    taken = cache.make_room(cache.stats().pages_free + 3)
    assert len(taken) == 1
    match taken[0]:
        case kp.Evicted.Parked(key, plan, dropped):
            assert ids(key.tokens) == list(range(12)) and key.start == 0 and dropped == []
            assert plan.num_pages == 3 and len(ids(plan.dst_pages)) == 3
        case other:
            pytest.fail(f"expected a park, got {other}")
    m = cache.match(u32(range(12)))
    assert (m.hit_len, m.resident_len) == (12, 0)
    cache.lock(m.node)
    woken = cache.wake(m.node)
    assert woken.plan.num_pages == 3 and [ids(k.tokens) for k in woken.keys] == [list(range(12))]
    assert cache.match(u32(range(12))).resident_len == 12
    cache.unlock(m.node)
    s = cache.stats()
    assert (s.num_parked, s.num_woken, s.host_pages_used) == (1, 1, 0)
    cache.check_integrity()


def test_locked_entries_are_not_evicted(cache):
    cached(cache, range(8))
    m = cache.match(u32(range(8)))
    cache.lock(m.node)
    assert cache.make_room(10**6, park=False) == []
    cache.unlock(m.node)
    assert len(cache.make_room(10**6, park=False)) == 1
    assert cache.stats().pages_used == 0


def check_unchanged(c: kp.Cache, before: tuple) -> None:
    assert snapshot(c) == before
    c.check_integrity()


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda c, p: c.free_pages(u32([p[0], p[0]])), kp.RepeatedId, "more than once"),
        (lambda c, p: c.free_pages(u32([50])), kp.NotAllocated, "page 50 is not allocated"),
        (lambda c, p: c.unlock(c.match(u32(range(8))).node), kp.NotLocked, "not locked"),
        (lambda c, p: c.lock(0xDEAD), kp.UnknownNode, "names no live node"),
        (lambda c, p: c.wake(12345), kp.UnknownNode, "names no live node"),
        (lambda c, p: c.match(np.arange(4, dtype=np.int64)), kp.NotU32, "format 'l'"),
        (lambda c, p: c.match([1, 2, 3]), kp.NotU32, "not a buffer"),
        (lambda c, p: c.match(np.zeros(3, np.float32)), kp.NotU32, "format 'f'"),
        (lambda c, p: c.match(b"\x01\x00\x00"), kp.NotU32, "whole number"),
        (
            lambda c, p: c.insert(u32(range(9)), u32(p[:2])),
            kp.LengthMismatch,
            "need 3 pages, got 2",
        ),
        (lambda c, p: c.insert(u32(range(4)), u32([60])), kp.NotAllocated, "page 60"),
        (
            lambda c, p: c.free_pages(c.match(u32(range(8))).pages),
            kp.OwnedByCache,
            "owned by the prefix",
        ),
        (
            lambda c, p: c.insert(u32([5] * 4), c.match(u32(range(8))).pages[:4]),
            kp.OwnedByCache,
            "page",
        ),
        (lambda c, p: c.alloc_pages(10**6), kp.PoolFull, "needed 1000000"),
        (lambda c, p: c.free_slot(0), kp.NotAllocated, "state slot 0"),
    ],
)
def test_bad_input_raises_and_changes_nothing(cache, call, error, words):
    cached(cache, range(8))
    mine = ids(cache.alloc_pages(3))
    before = snapshot(cache)
    with pytest.raises(error, match=words):
        call(cache, mine)
    check_unchanged(cache, before)


def test_error_classes_have_builtin_bases():
    assert issubclass(kp.PoolFull, RuntimeError)
    assert issubclass(kp.UnknownNode, KeyError)
    assert issubclass(kp.NotU32, TypeError)
    for e in (kp.NotAllocated, kp.RepeatedId, kp.BudgetTooSmall, kp.LengthMismatch):
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


def test_negative_sizes_are_type_errors_not_panics():
    with pytest.raises(OverflowError):
        kp.Cache(page_tokens=-1, page_bytes=64, device_bytes=6400)
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=6400)
    with pytest.raises(OverflowError):
        c.alloc_pages(-1)


def test_long_walks_release_the_gil():
    # A thread keeps counting while another walks long keys; if the GIL were held across the
    # walk the counter could not advance during it.
    c = kp.Cache(page_tokens=16, page_bytes=64, device_bytes=1 << 24)
    key = u32(np.arange(200_000) % 50_000)
    c.insert(key, c.alloc_pages(-(-len(key) // 16)))
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        for _ in range(20):
            c.check_integrity()
            c.match(key)
    finally:
        stop.set()
        t.join()
    assert ticks[0] > 0
