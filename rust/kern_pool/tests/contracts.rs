//! Regression tests for the cache contracts an independent model of `Cache` found broken
//! (issue 27), through the public verbs alone: room that could never fit evicts nothing even
//! when state slots hold floor chunks; a wake with nothing parked still refreshes its path; an
//! insert ending mid-page inside a parked entry takes the caller's pages; unlocking or
//! releasing a dead handle is `NotLocked`.

use kern_pool::{Cache, CacheConfig, Evicted, KernError, NodeId};

const PT: u32 = 4;

fn cache(device_pages: u64, host_pages: u64, state_bytes: u64, min_slots: u32) -> Cache {
    let mut c = Cache::new(CacheConfig {
        page_tokens: PT,
        page_bytes: 64,
        state_bytes,
        device_bytes: device_pages * 64,
        host_bytes: host_pages * 64,
        min_slots,
    })
    .unwrap();
    c.record_paths(true);
    c
}

/// `n` pages of the caller's own, free already: nothing cached is evicted for them.
fn own(c: &mut Cache, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let room = c.take_pages_into(n, &mut out).unwrap();
    assert!(room.fits && room.evicted.is_empty(), "{room:?}");
    out
}

/// Insert `tokens` into fresh pages of their own.
fn put(c: &mut Cache, tokens: &[u32]) {
    let pages = own(c, tokens.len().div_ceil(PT as usize));
    c.insert(tokens, &pages, None).unwrap();
    c.check_integrity().unwrap();
}

fn locked(c: &mut Cache, tokens: &[u32]) -> NodeId {
    c.match_prefix_with(tokens, Vec::new()).node.unwrap()
}

fn hit(c: &Cache, tokens: &[u32]) -> (u32, u32) {
    let m = c.peek(tokens);
    (m.hit_len, m.resident_len)
}

/// Bug: `could_ever_fit` counted the slots' floor chunks as pages'; room that only they could
/// give dropped the whole cache and still said `fits: false`.
#[test]
fn room_that_only_the_slot_floor_could_give_evicts_nothing() {
    // 8 chunks of one page or one slot; two of them are the slots' floor.
    let mut c = cache(8, 0, 64, 2);
    assert_eq!(c.device_geometry().num_chunks, 8);
    put(&mut c, &[1, 1, 1, 1, 2, 2, 2, 2]);
    put(&mut c, &[3, 3, 3, 3]);
    let before = c.stats();
    for (pages, slots) in [(7, 0), (6, 3), (0, 9)] {
        let room = c.make_room(pages, slots, false);
        assert!(
            !room.fits && room.evicted.is_empty(),
            "{pages} {slots}: {room:?}"
        );
        assert_eq!(c.stats(), before);
    }
    let mut out = Vec::new();
    let room = c.take_pages_into(7, &mut out).unwrap();
    assert!(!room.fits && room.evicted.is_empty() && out.is_empty());
    assert_eq!(c.stats(), before);
    c.check_integrity().unwrap();
    // The most that could ever fit is made by evicting: six pages, or six pages and two slots.
    let room = c.make_room(6, 2, false);
    assert!(room.fits && room.evicted.len() == 2, "{room:?}");
    c.check_integrity().unwrap();
}

/// Bug: a wake with nothing parked returned at once without refreshing the path.
#[test]
fn a_wake_with_nothing_parked_is_still_a_use() {
    let mut c = cache(64, 8, 0, 0);
    put(&mut c, &[1, 1, 1, 1]);
    let node = locked(&mut c, &[1, 1, 1, 1]);
    put(&mut c, &[2, 2, 2, 2]); // used after the match
    let woken = c.wake(node).unwrap(); // nothing parked: no copies, but a use
    assert!(woken.keys.is_empty() && woken.plan.pages.is_empty());
    c.unlock(node).unwrap();
    let room = c.make_room(c.stats().device.pages_free + 1, 0, false);
    match &room.evicted[..] {
        [Evicted::Dropped { key, parked: false }] => {
            assert_eq!(key.tokens.as_deref(), Some(&[2, 2, 2, 2][..]))
        }
        other => panic!("{other:?}"),
    }
    c.check_integrity().unwrap();
}

/// Bug: an insert ending mid-page inside a parked entry took none of the caller's pages, so
/// the key's tokens stayed parked and needed a wake.
#[test]
fn an_insert_ending_mid_page_inside_a_parked_entry_takes_the_callers_pages() {
    let entry: Vec<u32> = (1..=10).collect(); // pages [1-4] [5-8] [9 10]
    for key in [&entry[..6], &entry[..2], &entry[..9]] {
        let mut c = cache(64, 8, 0, 0);
        put(&mut c, &entry);
        c.make_room(c.device_geometry().num_pages(), 0, true); // parks it whole
        let s = c.stats();
        assert_eq!(
            (s.tree.num_parked, s.tree.parked_pages, s.device.pages_used),
            (1, 3, 0)
        );
        let pages = own(&mut c, key.len().div_ceil(PT as usize));
        let ins = c.insert(key, &pages, None).unwrap();
        assert_eq!((ins.held as usize, ins.woken), (key.len(), 0));
        c.check_integrity().unwrap();
        // Every token of the key is resident in the caller's pages; the rest stays parked.
        let m = c.peek(key);
        assert_eq!(
            (m.hit_len, m.resident_len) as (u32, u32),
            (key.len() as u32, key.len() as u32)
        );
        assert_eq!(m.pages.iter().map(|p| p.0).collect::<Vec<_>>(), pages);
        let s = c.stats();
        let whole = (key.len() / PT as usize) as u64;
        assert_eq!(s.device.pages_used, pages.len() as u64, "{key:?}");
        assert_eq!(s.tree.parked_pages, 3 - whole, "{key:?}");
        // Parks minus wakes minus parked drops is still the one parked entry.
        let t = s.tree;
        assert_eq!(t.num_parked - t.num_woken - t.num_dropped_parked, 1);
        // The whole entry is still there: the parked rest is reached past the resident head.
        assert_eq!(hit(&c, &entry), (10, whole as u32 * PT));
        let node = locked(&mut c, &entry);
        let woken = c.wake(node).unwrap();
        assert_eq!(woken.plan.pages.len() as u64, 3 - whole);
        c.unlock(node).unwrap();
        assert_eq!(hit(&c, &entry), (10, 10));
        c.check_integrity().unwrap();
    }
}

/// Bug: `unlock` and `release` of a handle to a removed node raised `UnknownNode`, where the
/// docs say any handle without a lock is `NotLocked`.
#[test]
fn a_dead_handle_is_not_locked() {
    let mut c = cache(64, 0, 0, 0);
    put(&mut c, &[1, 1, 1, 1]);
    let node = locked(&mut c, &[1, 1, 1, 1]);
    c.unlock(node).unwrap();
    c.make_room(c.device_geometry().num_pages(), 0, false); // removes it
    assert_eq!(c.stats().tree.num_nodes, 0);
    let dead = KernError::NotLocked {
        handle: node.to_u64(),
        live: false,
    };
    assert_eq!(c.unlock(node), Err(dead.clone()));
    let before = c.stats();
    let pages = own(&mut c, 1);
    assert_eq!(
        c.release(&[7, 7], &pages, None, Some(node), &[]),
        Err(dead.clone())
    );
    assert!(dead.to_string().contains("names no live node"));
    // The refused release changed nothing: the caller's page is still its own.
    c.free_pages(&pages).unwrap();
    assert_eq!(c.stats(), before);
    // A live handle that holds no lock says so too, and names itself live.
    put(&mut c, &[2, 2, 2, 2]);
    let live = c.peek(&[2, 2, 2, 2]).node.unwrap();
    assert_eq!(
        c.unlock(live),
        Err(KernError::NotLocked {
            handle: live.to_u64(),
            live: true
        })
    );
    c.check_integrity().unwrap();
}
