"""Regression tests for the accounting bugs of issue #10, each the issue's repro (adapted to
the API that replaced the one they were found with), plus exact LRU order."""

import numpy as np
import pytest

import kern.pool as kp


def u(x) -> np.ndarray:
    return np.asarray(x, dtype=np.uint32)


def ids(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype=np.uint32).tolist()


def state(c: kp.Cache) -> tuple:
    s = c.stats()
    return tuple(getattr(s, k) for k in dir(s) if not k.startswith("_"))


def alloc(c: kp.Cache, n: int) -> bytes:
    """`n` pages of the caller's own where they are free: nothing cached is evicted for them."""
    pages, room = c.take_pages(n)
    assert pages is not None and room.evicted == []
    return pages


def put(c: kp.Cache, tokens, slot=None) -> kp.Inserted:
    """Insert `tokens` into fresh pages of their own."""
    return c.insert(u(tokens), alloc(c, -(-len(tokens) // c.page_tokens)), slot)


def test_unlock_refuses_a_handle_nobody_locked():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64)
    put(c, range(8))
    leaf = c.match(u(range(8))).node  # locked
    put(c, [0, 1, 2, 3, 9])  # splits the leaf: its first page becomes an ancestor
    ancestor = c._peek(u(range(4))).node
    assert ancestor not in (None, leaf)
    before = state(c)
    # The ancestor's lock count includes the leaf's lock, but nobody locked the ancestor.
    with pytest.raises(kp.NotLocked):
        c.unlock(ancestor)
    assert state(c) == before
    c.check_integrity()
    c.unlock(leaf)
    with pytest.raises(kp.NotLocked):
        c.unlock(leaf)
    c.check_integrity()
    # Nothing stayed pinned: every entry can be evicted.
    c.make_room(c.device.num_pages, park=False)
    assert c.stats().num_nodes == 0 and c.stats().pages_used == 0


def test_parked_counters_balance_after_an_insert_into_a_parked_entry():
    c = kp.Cache(page_tokens=2, page_bytes=64, device_bytes=1024, host_bytes=512)
    put(c, [1, 2, 3, 4])
    room = c.make_room(c.device.num_pages)  # room for every page: parks [1, 2, 3, 4]
    # Counted from the returned values alone, as a caller counts them.
    parked = sum(isinstance(e, kp.Evicted.Parked) for e in room.evicted)
    dropped = sum(isinstance(e, kp.Evicted.Dropped) for e in room.evicted)
    assert (parked, dropped) == (1, 0)
    held = c._peek(u([1, 2, 9])).hit_len
    ins = put(c, [1, 2, 9])  # stops inside the parked entry
    assert held == 2
    c.check_integrity()
    m = c.match(u([1, 2, 3, 4]))
    assert (m.hit_len, m.resident_len) == (4, 2)
    woken = c.wake(m.node)
    c.unlock(m.node)
    assert len(woken.keys) == 1
    # One park, one wake (the insert's split head woke no entry), none dropped: no parked
    # entry left, and the books agree.
    s = c.stats()
    assert parked - (len(woken.keys) + ins.woken) == 0 == s.parked_pages == s.host_pages_used
    c.check_integrity()


def test_make_room_fits_pages_and_slots_together():
    c = kp.Cache(page_tokens=1, page_bytes=64, device_bytes=256, state_bytes=64, min_slots=0)
    put(c, [7])
    mine = alloc(c, 1)
    room = c.make_room(2, slots=1)
    assert room.fits and len(room.evicted) == 1  # [7] had to go
    c.alloc_slot()
    alloc(c, 2)
    c.free_pages(mine)
    c.check_integrity()


def test_a_refused_wake_leaves_everything_as_it_was():
    # Four chunks, each one page or one slot; the host as large.
    c = kp.Cache(
        page_tokens=1,
        page_bytes=64,
        state_bytes=64,
        device_bytes=256,
        host_bytes=256,
        min_slots=0,
    )
    slot = c.alloc_slot()
    put(c, [5], slot)
    c.make_room(4)  # parks [5] and its state
    assert c.stats().parked_states == 1
    m = c.match(u([5]))
    held = alloc(c, 3)  # one chunk left: room for a page or a slot, not both
    before, free_chunks = state(c), c.stats().free_chunks
    with pytest.raises(kp.PoolFull, match="1 pages and 1 state slots together"):
        c.wake(m.node)
    assert state(c) == before and c.stats().free_chunks == free_chunks
    c.check_integrity()
    # With room made, the same wake goes through.
    c.free_pages(held)
    c.wake(m.node)
    c.unlock(m.node)
    c.check_integrity()


def test_parked_entries_are_not_dropped_for_room_that_locked_ones_hold():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64, host_bytes=2 * 64)
    put(c, [1] * 8)
    c.make_room(c.pages_free + 2)  # parks [1] * 8: the host is full
    held = c.match(u([1] * 8)).node  # a request holds it, parked
    put(c, [2] * 8)
    room = c.make_room(c.pages_free + 2)
    # Dropping parked entries could not make host room: [2] * 8 is dropped, nothing else.
    assert [type(e) for e in room.evicted] == [kp.Evicted.Dropped]
    assert not room.evicted[0].parked
    assert c.stats().parked_pages == c.stats().host_pages_used == 2
    c.unlock(held)
    c.check_integrity()


def test_a_wake_is_a_use():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64, host_bytes=16 * 64)
    c._record_paths(True)
    put(c, [1] * 4)
    c.make_room(c.pages_free + 1)  # parked
    m = c.match(u([1] * 4))
    put(c, [3] * 4)  # used after that match...
    c.wake(m.node)  # ...but before this wake
    c.unlock(m.node)
    (e,) = c.make_room(c.pages_free + 1, park=False).evicted
    assert ids(e.key.tokens) == [3] * 4


def test_big_endian_buffers_are_read_as_what_they_hold():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64)
    tokens = [1, 2, 3, 70000, 5]
    c.insert(np.asarray(tokens, dtype=">u4"), alloc(c, 2))
    assert c._peek(u(tokens)).hit_len == 5
    assert c._peek(np.asarray(tokens, dtype=">u4")).hit_len == 5


def test_siblings_sharing_a_first_token_and_a_partial_last_page_evict_in_exact_lru_order():
    """A template that ends mid-page and conversations under it: their first pages share the
    template's last tokens. A new conversation's match reads the template only; it must not
    refresh or lock another conversation's entry."""
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64)
    c._record_paths(True)
    template = [9] * 8 + [7, 7]  # two pages and two tokens

    def conv(k):
        return template + [100 + k, 200 + k, 300 + k, 400 + k]

    for k in range(4):
        put(c, conv(k))
    use = [2, 0, 3, 1]  # last use, oldest first
    for k in use:
        c.unlock(c.match(u(conv(k))).node)
    newcomer = c.match(u(conv(99)))
    assert newcomer.hit_len == 8  # the template's whole pages, nothing of a sibling
    order = [ids(e.key.tokens)[8:] for e in c.make_room(c.device.num_pages).evicted]
    assert order == [conv(k)[8:] for k in use]
    assert c.stats().num_nodes == 1  # the template, held by the newcomer
    c.unlock(newcomer.node)
    c.check_integrity()


# ---- issue 27: contracts an independent model of the cache found broken.


def test_room_only_the_slot_floor_could_give_evicts_nothing_and_is_one_shared_room():
    # A stateful cache keeps two slots' chunks; pages can never have them.
    c = kp.Cache(page_tokens=1, page_bytes=64, device_bytes=8 * 64, state_bytes=64)
    ever = c.pages_free
    assert ever == c.device.num_pages - 2
    put(c, [1, 2, 3])
    before = state(c)
    pages, room = c.take_pages(ever + 1)
    assert (pages, room.fits, room.evicted) == (None, False, [])
    assert state(c) == before  # nothing was dropped for room that could never be had
    # An eviction-free call returns the same Room each time, from either verb.
    assert c.take_pages(ever + 1)[1] is room
    assert c.make_room(ever + 1) is room
    assert c.make_room(ever - 1, slots=4) is room
    assert c.make_room(0) is c.take_pages(0)[1] is not room
    # The most that could ever be free is made by evicting.
    room = c.make_room(ever, park=False)
    assert room.fits and len(room.evicted) == 1
    c.check_integrity()


def test_a_wake_with_nothing_parked_is_still_a_use():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64, host_bytes=16 * 64)
    c._record_paths(True)
    put(c, [1] * 4)
    m = c.match(u([1] * 4))
    put(c, [3] * 4)  # used after that match...
    woken = c.wake(m.node)  # ...but before this wake, which has nothing to bring back
    assert woken.keys == [] and woken.plan.num_pages == 0
    c.unlock(m.node)
    (e,) = c.make_room(c.pages_free + 1, park=False).evicted
    assert ids(e.key.tokens) == [3] * 4


@pytest.mark.parametrize("n", [2, 6, 9])
def test_an_insert_ending_mid_page_inside_a_parked_entry_takes_the_callers_pages(n):
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64, host_bytes=8 * 64)
    entry = list(range(1, 11))  # pages [1-4] [5-8] [9 10]
    put(c, entry)
    c.make_room(c.device.num_pages)  # parks it whole
    assert (c.stats().parked_pages, c.stats().pages_used) == (3, 0)
    key = entry[:n]
    pages = alloc(c, -(-n // 4))
    assert c.insert(u(key), pages).woken == 0
    c.check_integrity()
    # The key is resident in the caller's own pages; the entry's rest stays parked.
    m = c._peek(u(key))
    assert (m.hit_len, m.resident_len, m.pages) == (n, n, pages)
    s = c.stats()
    assert (s.pages_used, s.parked_pages) == (len(pages) // 4, 3 - n // 4)
    m = c.match(u(entry))
    assert (m.hit_len, m.resident_len) == (10, n // 4 * 4)
    assert c.wake(m.node).plan.num_pages == 3 - n // 4
    c.unlock(m.node)
    assert c._peek(u(entry)).resident_len == 10
    c.check_integrity()


def test_a_dead_handle_is_not_locked_for_unlock_and_release():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64)
    put(c, [1] * 4)
    node = c.match(u([1] * 4)).node
    c.unlock(node)
    c.make_room(c.device.num_pages, park=False)  # removes the node
    mine = alloc(c, 1)
    before = state(c)
    with pytest.raises(kp.NotLocked, match="names no live node"):
        c.unlock(node)
    with pytest.raises(kp.NotLocked, match="names no live node"):
        c.release(u([7] * 4), mine, node=node)
    assert state(c) == before
    c.free_pages(mine)
    c.check_integrity()


def test_release_takes_state_node_and_free_by_keyword_only():
    c = kp.Cache(page_tokens=4, page_bytes=64, device_bytes=64 * 64, state_bytes=64)
    put(c, [1] * 4)
    node = c.match(u([1] * 4)).node
    slot = c.alloc_slot()
    mine = alloc(c, 1)
    before = state(c)
    # A swapped pair by position (node where the slot goes) can no longer be passed at all.
    with pytest.raises(TypeError):
        c.release(u([2] * 4), mine, node, slot)  # type: ignore[misc]
    assert state(c) == before
    c.release(u([2] * 4), mine, state=slot, node=node)
    assert c._peek(u([2] * 4)).state_slot == slot
    c.check_integrity()
