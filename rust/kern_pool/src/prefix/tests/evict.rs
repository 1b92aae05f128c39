//! Making room, parking and waking: which entries go, what a refused call leaves, and the
//! parked counters.

use super::{cache, put};
use crate::cache::{Cache, CacheConfig};
use crate::error::KernError;
use crate::plan::Evicted;

#[test]
fn parking_drops_the_coldest_parked_to_make_room() {
    let mut c = cache(64, 2, false);
    put(&mut c, &[1, 1, 1, 1, 1, 1, 1, 1]);
    put(&mut c, &[2, 2, 2, 2, 2, 2, 2, 2]);
    let first = c.make_room(c.stats().device.pages_free + 2, 0, true);
    assert!(matches!(&first.evicted[..], [Evicted::Parked { dropped, .. }] if dropped.is_empty()));
    let second = c.make_room(c.stats().device.pages_free + 2, 0, true);
    match &second.evicted[..] {
        [Evicted::Parked { key, dropped, .. }] => {
            assert_eq!(key.tokens.as_deref(), Some(&[2; 8][..]));
            assert_eq!(dropped.len(), 1);
            assert_eq!(dropped[0].tokens.as_deref(), Some(&[1; 8][..]));
        }
        other => panic!("{other:?}"),
    }
    c.check_integrity().unwrap();
    let s = c.stats().tree;
    assert_eq!(
        (s.num_parked, s.num_dropped_parked, s.parked_pages),
        (2, 1, 2)
    );
}

#[test]
fn parked_entries_are_not_dropped_when_locked_ones_hold_the_room() {
    let mut c = cache(64, 2, false);
    put(&mut c, &[1, 1, 1, 1, 1, 1, 1, 1]);
    c.make_room(c.stats().device.pages_free + 2, 0, true); // parks [1; 8]
    let parked = c.match_prefix(&[1; 8]).node.unwrap(); // locks it, parked
    put(&mut c, &[2, 2, 2, 2, 2, 2, 2, 2]);
    let room = c.make_room(c.stats().device.pages_free + 2, 0, true);
    // The host is full of a locked entry: [2; 8] is dropped, [1; 8] stays parked.
    assert!(matches!(
        &room.evicted[..],
        [Evicted::Dropped { parked: false, .. }]
    ));
    assert_eq!(c.stats().tree.parked_pages, 2);
    c.unlock(parked).unwrap();
    c.check_integrity().unwrap();
}

/// Bug: an insert that split a parked node made a second parked entry with no event, so
/// parked - woken - dropped_parked went negative after a wake.
#[test]
fn parked_counters_balance_when_an_insert_stops_inside_a_parked_entry() {
    let mut c = Cache::new(CacheConfig {
        page_tokens: 2,
        page_bytes: 64,
        state_bytes: 0,
        device_bytes: 1024,
        host_bytes: 512,
        min_slots: 0,
    })
    .unwrap();
    let ins = |c: &mut Cache, t: &[u32]| {
        let p: Vec<u32> = c
            .alloc_pages(t.len().div_ceil(2))
            .unwrap()
            .into_iter()
            .map(|p| p.0)
            .collect();
        c.insert(t, &p, None).unwrap()
    };
    ins(&mut c, &[1, 2, 3, 4]);
    // Room that could never fit evicts nothing; room for every page parks the entry.
    assert!(c.make_room(1 << 40, 0, true).evicted.is_empty());
    c.make_room(c.device_geometry().num_pages(), 0, true);
    assert_eq!(c.stats().tree.num_parked, 1);
    let held = ins(&mut c, &[1, 2, 9]);
    assert_eq!((held.held, held.woken), (2, 0));
    c.check_integrity().unwrap();
    let m = c.match_prefix(&[1, 2, 3, 4]);
    assert_eq!((m.hit_len, m.resident_len), (4, 2));
    let woken = c.wake(m.node.unwrap()).unwrap();
    assert_eq!(woken.keys.len(), 1);
    let s = c.stats().tree;
    assert_eq!(
        (
            s.num_parked,
            s.num_woken,
            s.num_dropped_parked,
            s.parked_pages
        ),
        (1, 1, 0, 0)
    );
    c.unlock(m.node.unwrap()).unwrap();
    c.check_integrity().unwrap();
}

/// Bug: make_room(pages, slots) tested each class alone against the same free chunks.
#[test]
fn make_room_makes_room_for_pages_and_slots_together() {
    let mut c = Cache::new(CacheConfig {
        page_tokens: 1,
        page_bytes: 64,
        state_bytes: 64,
        device_bytes: 256,
        host_bytes: 0,
        min_slots: 0,
    })
    .unwrap();
    let p = c.alloc_pages(1).unwrap()[0].0;
    c.insert(&[7], &[p], None).unwrap();
    let _mine = c.alloc_pages(1).unwrap();
    let room = c.make_room(2, 1, true);
    assert!(room.fits);
    assert_eq!((room.evicted.len(), room.pages_freed), (1, 1));
    c.alloc_slot().unwrap();
    c.alloc_pages(2).unwrap();
    c.check_integrity().unwrap();
}

/// Bug: a refused wake gave pages back but not the chunk they had claimed.
#[test]
fn a_refused_wake_changes_nothing() {
    let mut c = Cache::new(CacheConfig {
        page_tokens: 1,
        page_bytes: 64,
        state_bytes: 64,
        device_bytes: 4 * 64,
        host_bytes: 4 * 64,
        min_slots: 0,
    })
    .unwrap();
    let p = c.alloc_pages(1).unwrap()[0].0;
    let s = c.alloc_slot().unwrap();
    c.insert(&[5], &[p], Some(s)).unwrap();
    c.make_room(4, 0, true); // parks [5] and its state
    assert_eq!(c.stats().tree.parked_states, 1);
    let m = c.match_prefix(&[5]);
    let _held = c.alloc_pages(3).unwrap(); // one chunk left: a page or a slot, not both
    let (before, chunks) = (c.stats(), c.stats().device.free_chunks);
    assert!(matches!(
        c.wake(m.node.unwrap()),
        Err(KernError::RoomFull {
            pages: 1,
            slots: 1,
            ..
        })
    ));
    assert_eq!(c.stats(), before);
    assert_eq!(c.stats().device.free_chunks, chunks);
    c.check_integrity().unwrap();
}

#[test]
fn a_wake_counts_as_a_use() {
    let mut c = cache(64, 8, false);
    put(&mut c, &[1, 1, 1, 1]);
    c.make_room(c.stats().device.pages_free + 1, 0, true); // parks it
    let m = c.match_prefix(&[1, 1, 1, 1]); // a use; the wake comes later
    put(&mut c, &[3, 3, 3, 3]);
    c.wake(m.node.unwrap()).unwrap(); // the entry is back, and used now
    c.unlock(m.node.unwrap()).unwrap();
    let room = c.make_room(c.stats().device.pages_free + 1, 0, false);
    match &room.evicted[..] {
        [Evicted::Dropped { key, parked: false }] => {
            assert_eq!(key.tokens.as_deref(), Some(&[3, 3, 3, 3][..]))
        }
        other => panic!("{other:?}"),
    }
    c.check_integrity().unwrap();
}

#[test]
fn take_pages_makes_room_then_allocates() {
    let mut c = cache(8, 0, false);
    put(&mut c, &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]); // 3 pages cached
    let mut out = Vec::new();
    // Fits at once: nothing evicted.
    let room = c.take_pages_into(5, &mut out).unwrap();
    assert!(room.fits && room.evicted.is_empty());
    assert_eq!(out.len(), 5);
    c.free_pages(&out).unwrap();
    // Needs the cached entry's pages: evicts it, then allocates.
    let room = c.take_pages_into(8, &mut out).unwrap();
    assert!(room.fits);
    assert_eq!((room.evicted.len(), room.pages_freed), (1, 3));
    assert_eq!(out.len(), 8);
    c.check_integrity().unwrap();
    // Cannot fit: nothing allocated, the list left empty.
    let room = c.take_pages_into(1, &mut out).unwrap();
    assert!(!room.fits && out.is_empty());
    c.check_integrity().unwrap();
}
