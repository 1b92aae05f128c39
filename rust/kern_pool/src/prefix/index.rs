//! The children index: a node's children of a page or more, filed under (parent, first page)
//! in one hash map, so a step down is one lookup however many siblings there are. Children
//! sharing a key are chained through `Node::next`. Children shorter than a page are not
//! indexed; `find_short` scans for them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::node::SCAN_KIDS;
use super::{Prefix, Tier, NONE};

/// The index's keys are already hashes: pass them through.
#[derive(Default)]
pub(super) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

pub(super) type Index = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

/// The index key of a child of `parent` whose first page is `page`.
pub(super) fn page_key(parent: u32, page: &[u32]) -> u64 {
    let mut h = u64::from(parent)
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for &t in page {
        h = (h.rotate_left(26) ^ u64::from(t)).wrapping_mul(0xA076_1D64_78BD_642F);
    }
    h ^= h >> 32;
    h = h.wrapping_mul(0xE703_7ED1_A0B4_28DB);
    h ^ (h >> 29)
}

impl Prefix {
    pub(super) fn index_insert(&mut self, i: u32) {
        let n = &self.nodes[i as usize];
        let key = page_key(n.parent, &n.tokens[..self.page_tokens as usize]);
        let next = self.index.insert(key, i).unwrap_or(NONE);
        let n = &mut self.nodes[i as usize];
        n.key = key;
        n.next = next;
    }

    /// Put `new` in `old`'s place in its index chain (`new` takes `old`'s key).
    pub(super) fn index_replace(&mut self, old: u32, new: u32) {
        let (key, next) = {
            let n = &self.nodes[old as usize];
            (n.key, n.next)
        };
        self.nodes[new as usize].key = key;
        self.nodes[new as usize].next = next;
        let Some(head) = self.index.get_mut(&key) else {
            return;
        };
        if *head == old {
            *head = new;
            return;
        }
        let mut j = *head;
        while j != NONE {
            let nj = self.nodes[j as usize].next;
            if nj == old {
                self.nodes[j as usize].next = new;
                return;
            }
            j = nj;
        }
    }

    pub(super) fn index_remove(&mut self, i: u32) {
        let (key, next) = {
            let n = &self.nodes[i as usize];
            (n.key, n.next)
        };
        let Some(head) = self.index.get_mut(&key) else {
            return;
        };
        if *head == i {
            if next == NONE {
                self.index.remove(&key);
            } else {
                *head = next;
            }
            return;
        }
        let mut j = *head;
        while j != NONE {
            let nj = self.nodes[j as usize].next;
            if nj == i {
                self.nodes[j as usize].next = next;
                return;
            }
            j = nj;
        }
    }

    /// The child of `parent` of a page or more whose first page is `page`.
    #[inline]
    pub(super) fn find_full(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let kids = &self.nodes[parent as usize].kids;
        if kids.len() <= SCAN_KIDS {
            // A conversation's path is mostly single children: comparing beats hashing.
            return kids.iter().copied().find(|&c| {
                let t = &self.nodes[c as usize].tokens;
                t.len() >= page.len() && t[0] == page[0] && t[..page.len()] == *page
            });
        }
        let mut c = *self.index.get(&page_key(parent, page))?;
        while c != NONE {
            let n = &self.nodes[c as usize];
            if n.parent == parent && n.tokens.len() >= page.len() && n.tokens[..page.len()] == *page
            {
                return Some(c);
            }
            c = n.next;
        }
        None
    }

    /// Where a key's last `rest` tokens (after `parent`) end: a child whose tokens are exactly
    /// `rest`; else, when `rest` is shorter than a page, a child whose first page starts with
    /// it (the key ends inside that page: resident before parked, then the one used last);
    /// else the longest child shorter than a page that `rest` starts with. Returns the child
    /// and how many tokens of it the key reads.
    pub(super) fn find_short(&self, parent: u32, rest: &[u32]) -> Option<(u32, usize)> {
        let n = &self.nodes[parent as usize];
        let pt = self.page_tokens as usize;
        let short = !rest.is_empty() && rest.len() < pt;
        if n.num_partial == 0 && !short {
            return None;
        }
        let mut prefix: Option<(u32, usize)> = None;
        let mut inside: Option<(u32, (bool, u64))> = None;
        for &c in n.kids.iter() {
            let cn = &self.nodes[c as usize];
            let t = &cn.tokens;
            if t.len() < pt && t.len() <= rest.len() && rest[..t.len()] == t[..] {
                if t.len() == rest.len() {
                    return Some((c, t.len()));
                }
                if prefix.is_none_or(|(_, l)| t.len() > l) {
                    prefix = Some((c, t.len()));
                }
            } else if short && t.len() > rest.len() && t[..rest.len()] == *rest {
                let rank = (cn.tier == Tier::Resident, cn.stamp);
                if inside.is_none_or(|(_, r)| rank > r) {
                    inside = Some((c, rank));
                }
            }
        }
        inside.map(|(c, _)| (c, rest.len())).or(prefix)
    }
}
