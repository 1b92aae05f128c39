//! The node record and its child list: the tree's storage, laid out for the walk.
//!
//! `Node`'s fields sit in the order a step down reads them, and `Kids` keeps a few children's
//! ids in the node itself so that a step down a path of few children reads no list in between
//! (see the design notes in `mod.rs`). Nodes live in `Prefix::nodes` and are named by index.

use super::lru::Lru;
use super::{Tier, NONE, ROOT};

/// Up to this many children, a lookup compares first pages instead of hashing one.
pub(super) const SCAN_KIDS: usize = 4;

/// A node's children, in no order: up to `SCAN_KIDS` inside the node itself, so a step down a
/// path of few children reads the child's node and tokens and no list in between; more in a
/// list of their own.
#[derive(Clone, Debug)]
pub(super) enum Kids {
    Few(u32, [u32; SCAN_KIDS]),
    Many(Vec<u32>),
}

impl Kids {
    pub(super) fn new() -> Self {
        Kids::Few(0, [NONE; SCAN_KIDS])
    }

    pub(super) fn one(c: u32) -> Self {
        let mut k = Kids::new();
        k.push(c);
        k
    }

    pub(super) fn push(&mut self, c: u32) {
        match self {
            Kids::Few(n, ids) if (*n as usize) < SCAN_KIDS => {
                ids[*n as usize] = c;
                *n += 1;
            }
            Kids::Few(_, ids) => {
                let mut v = ids.to_vec();
                v.push(c);
                *self = Kids::Many(v);
            }
            Kids::Many(v) => v.push(c),
        }
    }

    /// Remove the child at `pos`, the last one taking its place.
    pub(super) fn swap_remove(&mut self, pos: usize) {
        match self {
            Kids::Few(n, ids) => {
                let last = *n as usize - 1;
                ids.swap(pos, last);
                ids[last] = NONE;
                *n -= 1;
            }
            Kids::Many(v) => {
                v.swap_remove(pos);
            }
        }
    }
}

impl std::ops::Deref for Kids {
    type Target = [u32];
    #[inline]
    fn deref(&self) -> &[u32] {
        match self {
            Kids::Few(n, ids) => &ids[..*n as usize],
            Kids::Many(v) => v,
        }
    }
}

impl std::ops::DerefMut for Kids {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u32] {
        match self {
            Kids::Few(n, ids) => &mut ids[..*n as usize],
            Kids::Many(v) => v,
        }
    }
}

/// Fields in the order a walk reads them: the first cache line holds what a step down needs.
#[derive(Clone, Debug)]
#[repr(C)]
pub(super) struct Node {
    pub(super) tokens: Vec<u32>,
    /// Every child, in no order; `pos` is a child's place here.
    pub(super) kids: Kids,
    pub(super) parent: u32,
    /// Path length where this node's tokens begin; always a multiple of page_tokens.
    pub(super) start: u32,
    pub(super) stamp: u64,
    /// Device page ids when resident, host page ids when parked.
    pub(super) pages: Vec<u32>,
    /// Locks on this node and on its descendants: what keeps it from eviction.
    pub(super) lock: u32,
    /// Locks taken on this node's own handle: what `unlock` may release.
    pub(super) own_lock: u32,
    pub(super) num_resident_children: u32,
    /// Children shorter than a page (not in the index).
    pub(super) num_partial: u32,
    pub(super) pos: u32,
    pub(super) generation: u32,
    /// Index key (a hash of parent and first page) and the next node with the same key.
    pub(super) key: u64,
    pub(super) next: u32,
    /// A state snapshot taken at exactly `start + tokens.len()`, in the node's tier.
    pub(super) snapshot: Option<u32>,
    pub(super) tier: Tier,
    /// The LRU set the node is in (its key there is `(stamp, Reverse(end), index)`).
    pub(super) lru: Option<Lru>,
    pub(super) live: bool,
}

impl Node {
    pub(super) fn root() -> Self {
        Node::new(ROOT, 0, Vec::new(), Vec::new(), None, Tier::Resident)
    }

    pub(super) fn new(
        parent: u32,
        start: u32,
        tokens: Vec<u32>,
        pages: Vec<u32>,
        snapshot: Option<u32>,
        tier: Tier,
    ) -> Self {
        Node {
            tokens,
            kids: Kids::new(),
            parent,
            start,
            stamp: 0,
            pages,
            lock: 0,
            own_lock: 0,
            num_resident_children: 0,
            num_partial: 0,
            pos: 0,
            generation: 0,
            key: 0,
            next: NONE,
            snapshot,
            tier,
            lru: None,
            live: true,
        }
    }

    pub(super) fn end(&self) -> u32 {
        self.start + self.tokens.len() as u32
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kids_move_from_the_node_to_a_list_and_keep_their_places() {
        use super::Kids;
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
}
