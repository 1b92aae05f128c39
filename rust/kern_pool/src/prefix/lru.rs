//! LRU bookkeeping: two ordered sets hold exactly the eviction candidates (resident with no
//! resident child and unlocked; parked with no child and unlocked). Every change to a node's
//! tier, lock, children or stamp goes through `update` (or `unlink`, then `relink`), which is
//! what keeps the sets current without a scan.

use std::cmp::Reverse;

use super::node::Node;
use super::{Prefix, Tier, ROOT};

/// Order of eviction candidates: coldest first, and on a tie the deeper entry first (a path
/// touched together goes leaf first). The index only makes the key unique.
pub(super) type LruKey = (u64, Reverse<u32>, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lru {
    Resident,
    Parked,
}

impl Prefix {
    fn lru_key(&self, i: u32) -> LruKey {
        let n = &self.nodes[i as usize];
        (n.stamp, Reverse(n.end()), i)
    }

    /// Take `i` out of its LRU set (its stamp and end are what they were when it went in: every
    /// change to them unlinks first).
    pub(super) fn unlink(&mut self, i: u32) {
        if let Some(set) = self.nodes[i as usize].lru.take() {
            let key = self.lru_key(i);
            match set {
                Lru::Resident => self.resident_lru.remove(&key),
                Lru::Parked => self.parked_lru.remove(&key),
            };
        }
    }

    pub(super) fn lru_set(n: &Node) -> Option<Lru> {
        match n.tier {
            Tier::Resident if n.lock == 0 && n.num_resident_children == 0 => Some(Lru::Resident),
            Tier::Parked if n.lock == 0 && n.kids.is_empty() => Some(Lru::Parked),
            _ => None,
        }
    }

    pub(super) fn relink(&mut self, i: u32) {
        if i == ROOT {
            return;
        }
        let Some(set) = Self::lru_set(&self.nodes[i as usize]) else {
            return;
        };
        let key = self.lru_key(i);
        match set {
            Lru::Resident => self.resident_lru.insert(key),
            Lru::Parked => self.parked_lru.insert(key),
        };
        self.nodes[i as usize].lru = Some(set);
    }

    pub(super) fn update(&mut self, i: u32, f: impl FnOnce(&mut Node)) {
        self.unlink(i);
        f(&mut self.nodes[i as usize]);
        self.relink(i);
    }

    /// Stamp every node from `i` up to the root with a new tick.
    pub(super) fn touch_up(&mut self, mut i: u32) {
        self.clock += 1;
        let now = self.clock;
        while i != ROOT {
            let n = &mut self.nodes[i as usize];
            if n.lru.is_some() {
                self.update(i, |n| n.stamp = now);
            } else {
                n.stamp = now;
            }
            i = self.nodes[i as usize].parent;
        }
    }
}
