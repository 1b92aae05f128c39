//! Locks: `unlock` releases only a lock taken on that very handle.

use super::{cache, put};
use crate::error::KernError;
use crate::ids::NodeId;

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
