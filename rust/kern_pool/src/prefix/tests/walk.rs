//! The walks: where a key's lookup goes, what a match reads, splits and locks, and the
//! snapshot detour off the longest path.

use super::{cache, hit, put, PT};
use crate::cache::Cache;
use crate::plan::Evicted;

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
