//! Eviction order: coldest first, a path leaf first, and exact LRU over what a match read.

use super::{cache, evict_all_order, put};
use crate::plan::Evicted;

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
