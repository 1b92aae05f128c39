use crate::cache::{Cache, CacheConfig};
use crate::error::KernError;
use crate::ids::{NodeId, SlotId};
use crate::plan::Evicted;

const PT: u32 = 4;

fn cache(device_pages: u64, host_pages: u64, stateful: bool) -> Cache {
    let mut c = Cache::new(CacheConfig {
        page_tokens: PT,
        page_bytes: 64,
        state_bytes: if stateful { 64 } else { 0 },
        device_bytes: device_pages * 64,
        host_bytes: host_pages * 64,
        min_slots: 0,
    })
    .unwrap();
    c.record_paths(true);
    c
}

/// Insert `tokens` as a scheduler does: match (locked), allocate the rest, insert, unlock.
fn put(c: &mut Cache, tokens: &[u32]) -> u32 {
    let m = c.match_prefix(tokens);
    let shared = (m.resident_len / PT) as usize;
    let need = tokens.len().div_ceil(PT as usize) - shared;
    let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
    pages.extend(c.alloc_pages(need).unwrap().into_iter().map(|p| p.0));
    let ins = c.insert(tokens, &pages, None).unwrap();
    if let Some(n) = m.node {
        c.unlock(n).unwrap();
    }
    c.check_integrity().unwrap();
    ins.held
}

fn hit(c: &Cache, tokens: &[u32]) -> (u32, u32) {
    let m = c.peek(tokens);
    (m.hit_len, m.resident_len)
}

fn evict_all_order(c: &mut Cache) -> Vec<Vec<u32>> {
    let room = c.make_room(c.device_geometry().num_pages(), 0, false);
    room.evicted
        .into_iter()
        .map(|e| match e {
            Evicted::Dropped { key, .. } => key.tokens.unwrap(),
            other => panic!("{other:?}"),
        })
        .collect()
}

#[test]
fn divergence_mid_page_branches_at_the_page_boundary() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    assert_eq!(put(&mut c, &[1, 2, 3, 4, 5, 6, 0, 0]), 4);
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 6, 7, 8, 9]), (9, 9)); // ends inside [9, 10]
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 6, 0, 0, 1]), (8, 8));
    // A key that leaves a page mid-way reads none of it: [5, 9] is in neither second page.
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 9, 9]), (4, 4));
    // A key that ends inside a page reads it.
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5]), (5, 5));
    // Shared first page, two second pages, a tail page: 4 pages held.
    assert_eq!(c.stats().tree.resident_pages, 4);
    assert_eq!(c.stats().device.pages_used, 4);
}

#[test]
fn a_leaf_ending_mid_page_is_hit_whole_and_extended_in_a_copy() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 6, 7]), (6, 6));
    assert_eq!(put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8, 9]), 6);
    // The partial page stays the old leaf's; the next turn branches in its own copy.
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (9, 9));
    assert_eq!(hit(&c, &[1, 2, 3, 4, 5, 6, 0]), (6, 6));
    assert_eq!(c.stats().tree.resident_pages, 4);
}

#[test]
fn snapshot_inside_a_full_page_gets_its_own_partial_leaf() {
    let mut c = cache(64, 0, true);
    put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let slot = c.alloc_slot().unwrap();
    let page = c.alloc_pages(1).unwrap()[0].0;
    // The key ends inside the second page: it reads it, and copies it before writing.
    let m = c.match_prefix(&[1, 2, 3, 4, 5, 6]);
    assert_eq!((m.hit_len, m.pages.len()), (6, 2));
    let pages = [m.pages[0].0, page];
    let ins = c.insert(&[1, 2, 3, 4, 5, 6], &pages, Some(slot)).unwrap();
    c.unlock(m.node.unwrap()).unwrap();
    assert_eq!(ins.held, 6);
    let m = c.peek(&[1, 2, 3, 4, 5, 6, 9]);
    assert_eq!((m.hit_len, m.state.unwrap().len), (6, 6));
    assert_eq!(m.state.unwrap().slot, Some(slot));
    // The tree took the slot.
    assert!(matches!(
        c.free_slot(slot),
        Err(KernError::OwnedByCache { .. })
    ));
    c.check_integrity().unwrap();
}

#[test]
fn coldest_goes_first_and_a_path_goes_leaf_first() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 1, 1, 1, 2, 2, 2, 2]);
    put(&mut c, &[1, 1, 1, 1, 3, 3, 3, 3]);
    put(&mut c, &[5, 5, 5, 5]);
    let m = c.match_prefix(&[1, 1, 1, 1, 9]); // reads [1..] only
    c.unlock(m.node.unwrap()).unwrap();
    assert_eq!(
        evict_all_order(&mut c),
        vec![
            vec![1, 1, 1, 1, 2, 2, 2, 2],
            vec![1, 1, 1, 1, 3, 3, 3, 3],
            vec![5, 5, 5, 5],
            vec![1, 1, 1, 1]
        ]
    );
    assert_eq!(c.stats().device.pages_used, 0);
}

/// The defect the exact LRU fixes: a template that ends mid-page, conversations under it that
/// share the template's last tokens (a first token and a partial last page). A new
/// conversation's match reads the template only; it must neither refresh nor lock another
/// conversation's entry, so eviction follows last use exactly.
#[test]
fn siblings_sharing_a_partial_last_page_are_evicted_in_exact_lru_order() {
    let mut c = cache(64, 0, false);
    let tmpl = [9, 9, 9, 9, 9, 9, 9, 9, 7, 7]; // two pages and two tokens
    let conv = |k: u32| -> Vec<u32> {
        let mut t = tmpl.to_vec();
        t.extend([100 + k, 200 + k, 300 + k, 400 + k]);
        t
    };
    for k in 0..3 {
        put(&mut c, &conv(k));
    }
    // Conversation 0 is used again; then a new conversation matches: it reads the template's
    // two whole pages and nothing of any sibling (each sibling's first page differs from its).
    let m = c.match_prefix(&conv(0));
    c.unlock(m.node.unwrap()).unwrap();
    let m = c.match_prefix(&conv(9));
    assert_eq!(m.hit_len, 8);
    // Its lock covers the template only: every sibling stays evictable.
    let room = c.make_room(c.device_geometry().num_pages(), 0, false);
    let order: Vec<Vec<u32>> = room
        .evicted
        .iter()
        .map(|e| match e {
            Evicted::Dropped { key, .. } => key.tokens.clone().unwrap(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        order,
        vec![
            conv(1)[8..].to_vec(),
            conv(2)[8..].to_vec(),
            conv(0)[8..].to_vec()
        ]
        .into_iter()
        .map(|tail| [&tmpl[..8], &tail[..]].concat())
        .collect::<Vec<_>>()
    );
    c.unlock(m.node.unwrap()).unwrap();
    c.check_integrity().unwrap();
}

#[test]
fn match_splits_at_the_last_page_read_and_locks_only_that() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    let m = c.match_prefix(&[1, 1, 1, 1, 2, 2, 2, 2, 9]);
    assert_eq!((m.hit_len, m.pages.len()), (8, 2));
    assert_eq!(c.stats().tree.num_nodes, 2);
    // The unread tail page is evictable, the read head is not.
    let room = c.make_room(c.device_geometry().num_pages(), 0, false);
    assert_eq!(room.evicted.len(), 1);
    assert_eq!(hit(&c, &[1, 1, 1, 1, 2, 2, 2, 2, 3]), (8, 8));
    c.unlock(m.node.unwrap()).unwrap();
    c.check_integrity().unwrap();
}

#[test]
fn unlock_needs_a_lock_on_that_very_handle() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let leaf = c.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8]).node.unwrap();
    // A second key splits the locked leaf; its new head is covered by the leaf's lock...
    put(&mut c, &[1, 2, 3, 4, 9]);
    let head = c.match_prefix(&[1, 2, 3, 4]).node.unwrap();
    assert_ne!(head, leaf);
    c.unlock(head).unwrap();
    // ...but nobody locked the head itself: refused, and nothing changed.
    let before = c.stats();
    assert_eq!(
        c.unlock(head),
        Err(KernError::NotLocked {
            handle: head.to_u64(),
            live: true
        })
    );
    assert_eq!(c.stats(), before);
    c.check_integrity().unwrap();
    c.unlock(leaf).unwrap();
    assert!(matches!(c.unlock(leaf), Err(KernError::NotLocked { .. })));
    c.check_integrity().unwrap();
    // Everything is evictable again: no count wrapped.
    c.make_room(c.device_geometry().num_pages(), 0, false);
    assert_eq!(c.stats().tree.num_nodes, 0);
    let stale = NodeId {
        index: leaf.index,
        generation: leaf.generation + 1,
    };
    assert!(matches!(c.lock(stale), Err(KernError::UnknownNode { .. })));
}

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
fn insert_frees_duplicates_and_takes_parked_tokens_on_device() {
    let mut c = cache(64, 8, false);
    put(&mut c, &[1, 1, 1, 1, 2, 2]);
    let used = c.stats().device.pages_used;
    // The same tokens again in the caller's own pages: held, and the copies freed.
    let mine: Vec<u32> = c.alloc_pages(2).unwrap().into_iter().map(|p| p.0).collect();
    let ins = c.insert(&[1, 1, 1, 1, 2, 2], &mine, None).unwrap();
    assert_eq!((ins.held, ins.woken), (6, 0));
    assert_eq!(c.stats().device.pages_used, used);
    // Parked, then given again on the device: the tree takes the device copy (a wake).
    c.make_room(c.stats().device.pages_free + 2, 0, true);
    let mine: Vec<u32> = c.alloc_pages(2).unwrap().into_iter().map(|p| p.0).collect();
    let ins = c.insert(&[1, 1, 1, 1, 2, 2], &mine, None).unwrap();
    assert_eq!((ins.held, ins.woken), (6, 1));
    assert_eq!(hit(&c, &[1, 1, 1, 1, 2, 2]), (6, 6));
    let s = c.stats();
    assert_eq!((s.device.pages_used, s.tree.parked_pages), (2, 0));
    c.check_integrity().unwrap();
}

#[test]
fn insert_errors_change_nothing() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 2, 3, 4, 5, 6]);
    let mine: Vec<u32> = c.alloc_pages(2).unwrap().into_iter().map(|p| p.0).collect();
    let before = c.stats();
    let tree: Vec<u32> = c
        .peek(&[1, 2, 3, 4, 5, 6])
        .pages
        .iter()
        .map(|p| p.0)
        .collect();
    let cases: Vec<(&[u32], Vec<u32>, KernError)> = vec![
        (
            &[1, 2, 3, 4, 5],
            vec![mine[0]],
            KernError::LengthMismatch {
                tokens: 5,
                pages: 1,
                page_tokens: PT,
            },
        ),
        (
            &[1, 2, 3, 4, 5, 6, 7],
            vec![tree[0], tree[1]],
            KernError::SharedPageExtended {
                page: tree[1],
                index: 1,
            },
        ),
        (
            &[9, 9, 9, 9, 9],
            vec![tree[0], mine[0]],
            KernError::OwnedByCache {
                what: "page",
                id: tree[0],
            },
        ),
        (
            &[1, 2, 3],
            vec![mine[0] + 1000],
            KernError::NotAllocated {
                what: "page",
                id: mine[0] + 1000,
            },
        ),
        (
            &[8, 8, 8, 8, 8],
            vec![mine[1], mine[1]],
            KernError::Repeated {
                what: "page",
                id: mine[1],
            },
        ),
    ];
    for (tokens, pages, err) in cases {
        assert_eq!(c.insert(tokens, &pages, None), Err(err), "{tokens:?}");
        assert_eq!(c.stats(), before);
        c.check_integrity().unwrap();
    }
    let slot_err = c.insert(&[1], &[mine[0]], Some(SlotId(0)));
    assert!(matches!(slot_err, Err(KernError::NotAllocated { .. })));
    c.free_pages(&mine).unwrap();
    c.check_integrity().unwrap();
}

#[test]
fn a_key_ending_inside_a_page_reads_it_and_no_more() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    put(&mut c, &[5, 5, 5, 5, 6, 6]); // a leaf ending mid-page
                                      // The same short prompt again: it ends inside the first page.
    let m = c.match_prefix(&[1, 1]);
    assert_eq!((m.hit_len, m.pages.len()), (2, 1));
    // Only that page was read: it is locked and refreshed, the pages after it are not.
    let room = c.make_room(c.device_geometry().num_pages(), 0, false);
    let left: Vec<u32> = room
        .evicted
        .iter()
        .map(|e| match e {
            Evicted::Dropped { key, .. } => key.end,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(left, vec![12, 6]);
    assert_eq!(hit(&c, &[1, 1, 1, 1, 2]), (4, 4));
    c.unlock(m.node.unwrap()).unwrap();
    // Several children start with the key's last tokens: it reads the one used last.
    put(&mut c, &[7, 7, 1, 1]);
    put(&mut c, &[7, 7, 2, 2]);
    put(&mut c, &[7, 7, 3, 3]);
    let used = c.match_prefix(&[7, 7, 2, 2, 9]);
    c.unlock(used.node.unwrap()).unwrap();
    let m = c.match_prefix(&[7, 7]);
    assert_eq!(m.node, used.node);
    c.unlock(m.node.unwrap()).unwrap();
    // Inserting a key the tree holds inside a page frees the caller's copy of it.
    let mine = c.alloc_pages(1).unwrap()[0].0;
    let ins = c.insert(&[7, 7, 3], &[mine], None).unwrap();
    assert_eq!(ins.held, 3);
    assert!(c.free_pages(&[mine]).is_err());
    c.check_integrity().unwrap();
}

#[test]
fn a_page_child_is_one_lookup_among_many_siblings() {
    let mut c = cache(4096, 0, false);
    let tmpl = [9, 9, 9, 9, 9, 9];
    for k in 0..1000u32 {
        let mut t = tmpl.to_vec();
        t.extend([k, k, k, k, k, k]);
        put(&mut c, &t);
    }
    // Every conversation still finds its own first page under the template.
    let mut t = tmpl.to_vec();
    t.extend([500, 500, 500, 500, 500, 500]);
    assert_eq!(hit(&c, &t), (12, 12));
    let mut t = tmpl.to_vec();
    t.extend([7777, 1]);
    assert_eq!(hit(&c, &t), (4, 4));
}

/// Insert `tokens` with a fresh state snapshot at their end (the request-end snapshot).
fn put_snapshot(c: &mut Cache, tokens: &[u32]) {
    let m = c.match_prefix(tokens);
    let shared = (m.resident_len / PT) as usize;
    let need = tokens.len().div_ceil(PT as usize) - shared;
    let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
    pages.extend(c.alloc_pages(need).unwrap().into_iter().map(|p| p.0));
    let slot = c.alloc_slot().unwrap();
    c.insert(tokens, &pages, Some(slot)).unwrap();
    if let Some(n) = m.node {
        c.unlock(n).unwrap();
    }
    c.check_integrity().unwrap();
}

/// A stateful conversation: a turn ends mid-page with a snapshot, the next turn runs through
/// it (and is inserted as a sibling of whole pages). Sending the next turn again must resume
/// from the first turn's snapshot, not follow the longer sibling that holds none.
#[test]
fn a_snapshot_on_a_short_sibling_is_reached_past_a_longer_path() {
    let mut c = cache(64, 0, true);
    let turn1: Vec<u32> = (1..=7).collect(); // ends inside the second page
    put_snapshot(&mut c, &turn1);
    let turn2: Vec<u32> = (1..=13).collect();
    put(&mut c, &turn2); // no snapshot at its end
    let m = c.peek(&turn2);
    assert_eq!((m.hit_len, m.state.map(|s| s.len)), (7, Some(7)));
    // A match takes the same path, locked, and splits nothing.
    let nodes = c.stats().tree.num_nodes;
    let m = c.match_prefix(&turn2);
    assert_eq!((m.hit_len, m.state.map(|s| s.len)), (7, Some(7)));
    assert!(m.state.unwrap().slot.is_some());
    assert_eq!(c.stats().tree.num_nodes, nodes);
    c.unlock(m.node.unwrap()).unwrap();
    // A deeper snapshot on the longer path wins.
    put_snapshot(&mut c, &turn2[..12]);
    let m = c.peek(&turn2);
    assert_eq!((m.hit_len, m.state.map(|s| s.len)), (13, Some(12)));
    // Without states the longest path stays the answer.
    let mut plain = cache(64, 0, false);
    put(&mut plain, &turn1);
    put(&mut plain, &turn2);
    assert_eq!(hit(&plain, &turn2), (13, 13));
    c.check_integrity().unwrap();
}

/// The repeat check reads a word of fresh page ids at a time: a bad id inside a run (repeated,
/// not allocated, the tree's) is still named, it is the first bad one in the list's order, and
/// the marks of a refused call are cleared for the next one.
#[test]
fn page_checks_over_runs_name_the_first_bad_id() {
    let mut c = cache(512, 0, false);
    put(&mut c, &[7, 7, 7, 7]);
    let treepage = c.peek(&[7, 7, 7, 7]).pages[0].0;
    let mine: Vec<u32> = c
        .alloc_pages(150)
        .unwrap()
        .into_iter()
        .map(|p| p.0)
        .collect();
    let tokens: Vec<u32> = (0..150 * PT).collect();
    let before = c.stats();
    let with = |at: usize, id: u32| {
        let mut p = mine.clone();
        p[at] = id;
        p
    };
    let unallocated = c.device_geometry().num_pages() as u32 - 1;
    let cases = [
        (
            with(70, mine[65]),
            KernError::Repeated {
                what: "page",
                id: mine[65],
            },
        ),
        (
            with(3, mine[140]),
            KernError::Repeated {
                what: "page",
                id: mine[140],
            },
        ),
        (
            with(100, unallocated),
            KernError::NotAllocated {
                what: "page",
                id: unallocated,
            },
        ),
        (
            with(129, treepage),
            KernError::OwnedByCache {
                what: "page",
                id: treepage,
            },
        ),
        (
            {
                let mut p = with(20, u32::MAX);
                p[90] = p[91];
                p
            },
            KernError::NotAllocated {
                what: "page",
                id: u32::MAX,
            },
        ),
    ];
    for (pages, err) in cases {
        assert_eq!(c.insert(&tokens, &pages, None), Err(err));
        assert_eq!(c.stats(), before);
        c.check_integrity().unwrap();
    }
    assert_eq!(c.insert(&tokens, &mine, None).unwrap().held, 0);
    c.check_integrity().unwrap();
}

/// `release` does what `insert`, `unlock` and `free_pages` do one after the other.
#[test]
fn release_is_insert_unlock_and_free_in_one_call() {
    let one = |c: &mut Cache, key: &[u32], answer: usize, fused: bool| -> u32 {
        let m = c.match_prefix(key);
        let shared = (m.resident_len / PT) as usize;
        let need = key.len().div_ceil(PT as usize) + answer - shared;
        let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
        pages.extend(c.alloc_pages(need).unwrap().into_iter().map(|p| p.0));
        let whole = key.len().div_ceil(PT as usize);
        let (keep, extra) = pages.split_at(whole);
        let held = if fused {
            c.release(key, keep, None, m.node, extra).unwrap().held
        } else {
            let held = c.insert(key, keep, None).unwrap().held;
            if let Some(n) = m.node {
                c.unlock(n).unwrap();
            }
            c.free_pages(extra).unwrap();
            held
        };
        c.check_integrity().unwrap();
        held
    };
    let keys: [&[u32]; 4] = [
        &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
        &[1, 2, 3, 4, 0, 0],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    ];
    let (mut a, mut b) = (cache(64, 0, false), cache(64, 0, false));
    for (k, key) in keys.iter().enumerate() {
        assert_eq!(
            one(&mut a, key, k % 3, false),
            one(&mut b, key, k % 3, true)
        );
        assert_eq!(a.stats(), b.stats());
    }
    assert_eq!(evict_all_order(&mut a), evict_all_order(&mut b));
    assert_eq!(a.stats(), b.stats());
}

#[test]
fn release_errors_change_nothing() {
    let mut c = cache(64, 0, false);
    put(&mut c, &[1, 2, 3, 4, 5, 6]);
    let key = [1, 2, 3, 4, 5, 6, 7, 8];
    let m = c.match_prefix(&key[..6]);
    let node = m.node.unwrap();
    let tree: Vec<u32> = m.pages.iter().map(|p| p.0).collect();
    let mine: Vec<u32> = c.alloc_pages(3).unwrap().into_iter().map(|p| p.0).collect();
    // The hit's last page is partial: the request writes past it in its own copy.
    let pages = vec![tree[0], mine[0]];
    let before = c.stats();
    let stale = NodeId {
        index: node.index,
        generation: node.generation + 1,
    };
    let cases: Vec<(Option<NodeId>, Vec<u32>, KernError)> = vec![
        (
            Some(stale),
            vec![mine[1]],
            KernError::NotLocked {
                handle: stale.to_u64(),
                live: false,
            },
        ),
        (
            Some(node),
            vec![mine[0]],
            KernError::Repeated {
                what: "page",
                id: mine[0],
            },
        ),
        (
            Some(node),
            vec![tree[1]],
            KernError::OwnedByCache {
                what: "page",
                id: tree[1],
            },
        ),
        (
            Some(node),
            vec![mine[1], mine[1]],
            KernError::Repeated {
                what: "page",
                id: mine[1],
            },
        ),
        (
            Some(node),
            vec![mine[2] + 1000],
            KernError::NotAllocated {
                what: "page",
                id: mine[2] + 1000,
            },
        ),
    ];
    for (n, free, err) in cases {
        assert_eq!(
            c.release(&key, &pages, None, n, &free),
            Err(err),
            "{free:?}"
        );
        assert_eq!(c.stats(), before);
        c.check_integrity().unwrap();
    }
    let ins = c
        .release(&key, &pages, None, Some(node), &mine[1..])
        .unwrap();
    assert_eq!(ins.held, 6);
    c.check_integrity().unwrap();
    let s = c.stats();
    assert_eq!(s.device.pages_used, s.tree.resident_pages);
    // Its lock is gone: a second release of the same handle is refused, changing nothing.
    let again = c.release(&[], &[], None, Some(node), &[]);
    assert_eq!(
        again,
        Err(KernError::NotLocked {
            handle: node.to_u64(),
            live: true
        })
    );
    assert_eq!(c.stats(), s);
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

#[test]
fn kids_move_from_the_node_to_a_list_and_keep_their_places() {
    use super::node::Kids;
    let mut k = Kids::new();
    for c in 10..16 {
        k.push(c);
        assert_eq!(k.last(), Some(&c));
    }
    assert!(matches!(k, Kids::Many(_)));
    assert_eq!(&*k, &[10, 11, 12, 13, 14, 15]);
    k.swap_remove(1);
    assert_eq!(&*k, &[10, 15, 12, 13, 14]);
    let mut few = Kids::one(7);
    few.push(8);
    few.push(9);
    few.swap_remove(0);
    assert_eq!(&*few, &[9, 8]);
    few[1] = 3;
    few.swap_remove(1);
    assert_eq!(&*few, &[9]);
    few.swap_remove(0);
    assert!(few.is_empty());
}
