//! Insert and release: what the tree takes and frees, snapshots, and the checks that refuse a
//! call while changing nothing.

use super::{cache, evict_all_order, hit, put, PT};
use crate::cache::Cache;
use crate::error::KernError;
use crate::ids::{NodeId, SlotId};

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
