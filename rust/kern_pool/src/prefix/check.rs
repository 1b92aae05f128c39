//! `check_integrity`: recount the whole tree and compare with every counter, index, set and
//! the pools' books. O(tree); for tests and debugging, never on the request path.

use std::cmp::Reverse;
use std::collections::HashSet;

use super::index::page_key;
use super::lru::Lru;
use super::{Prefix, Tier, NONE, ROOT};
use crate::bits::Bits;
use crate::error::{KernError, Result};
use crate::host::Host;
use crate::pool::{Kind, Pool};
use crate::prefix::PrefixStats;

impl Prefix {
    pub fn check_integrity(&self, pool: &Pool, host: Option<&Host>) -> Result<()> {
        let bad = |why: String| Err(KernError::Corrupt(why));
        let pt = self.page_tokens;
        let mut seen_pages = Bits::new(self.owned_pages.len());
        let mut seen_host = HashSet::new();
        let mut count = PrefixStats::default();
        let mut child_locks = vec![0u64; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && i as u32 != ROOT {
                child_locks[n.parent as usize] += u64::from(n.lock);
            }
        }
        let mut indexed = 0usize;
        for (i, n) in self.nodes.iter().enumerate() {
            let i = i as u32;
            if !n.live {
                if n.lru.is_some() || !n.kids.is_empty() {
                    return bad(format!("dead node {i} still linked"));
                }
                continue;
            }
            let resident_kids = n
                .kids
                .iter()
                .filter(|&&c| self.nodes[c as usize].tier == Tier::Resident)
                .count();
            if resident_kids as u32 != n.num_resident_children {
                return bad(format!("node {i}: num_resident_children wrong"));
            }
            let mut partials = 0;
            for (pos, &c) in n.kids.iter().enumerate() {
                let cn = &self.nodes[c as usize];
                if !cn.live || cn.parent != i || cn.pos as usize != pos {
                    return bad(format!("node {i}: child {c} misfiled"));
                }
                if cn.start != n.end() {
                    return bad(format!(
                        "node {c}: starts at {} but parent ends at {}",
                        cn.start,
                        n.end()
                    ));
                }
                if cn.stamp > n.stamp && i != ROOT {
                    return bad(format!(
                        "node {c} is more recently used than its parent {i}"
                    ));
                }
                if (cn.tokens.len() as u32) < pt {
                    partials += 1;
                } else {
                    indexed += 1;
                    let key = page_key(i, &cn.tokens[..pt as usize]);
                    if cn.key != key || self.find_full(i, &cn.tokens[..pt as usize]) != Some(c) {
                        return bad(format!("node {c}: not found in the index"));
                    }
                }
            }
            if partials != n.num_partial {
                return bad(format!(
                    "node {i}: num_partial {} != {partials}",
                    n.num_partial
                ));
            }
            let own_plus_children = u64::from(n.own_lock) + child_locks[i as usize];
            if i != ROOT && u64::from(n.lock) != own_plus_children {
                return bad(format!(
                    "node {i}: lock {} != own {} + children's {}",
                    n.lock, n.own_lock, child_locks[i as usize]
                ));
            }
            if i == ROOT {
                if !n.tokens.is_empty() || n.snapshot.is_some() || n.lru.is_some() || n.own_lock > 0
                {
                    return bad("root holds tokens, a snapshot, a lock or an LRU entry".into());
                }
                continue;
            }
            count.num_nodes += 1;
            if n.tokens.is_empty() || n.start % pt != 0 {
                return bad(format!("node {i}: empty or misaligned"));
            }
            if n.pages.len() as u32 != self.pages_for(n.tokens.len() as u32) {
                return bad(format!(
                    "node {i}: {} tokens but {} pages",
                    n.tokens.len(),
                    n.pages.len()
                ));
            }
            if !(n.tokens.len() as u32).is_multiple_of(pt) && !n.kids.is_empty() {
                return bad(format!("node {i}: ends mid-page but has children"));
            }
            let want = Self::lru_set(n);
            let have = n.lru.map(|s| {
                let key = (n.stamp, Reverse(n.end()), i);
                let present = match s {
                    Lru::Resident => self.resident_lru.contains(&key),
                    Lru::Parked => self.parked_lru.contains(&key),
                };
                (s, present)
            });
            match (want, have) {
                (None, None) => {}
                (Some(w), Some((h, true))) if w == h => {}
                _ => {
                    return bad(format!(
                        "node {i}: LRU membership {have:?}, expected {want:?}"
                    ))
                }
            }
            match n.tier {
                Tier::Resident => {
                    for &p in &n.pages {
                        if !pool.is_allocated(Kind::Pages, p)
                            || !self.owned_pages.get(p)
                            || seen_pages.set(p)
                        {
                            return bad(format!(
                                "node {i}: page {p} unallocated, unowned or shared"
                            ));
                        }
                    }
                    if let Some(s) = n.snapshot {
                        if !pool.is_allocated(Kind::Slots, s) || !self.owned_slots.get(s) {
                            return bad(format!("node {i}: state slot {s} not held"));
                        }
                        count.resident_states += 1;
                    }
                    count.resident_pages += n.pages.len() as u64;
                }
                Tier::Parked => {
                    let Some(host) = host else {
                        return bad(format!("node {i} parked without a host tier"));
                    };
                    for &p in &n.pages {
                        if !host.is_allocated(Kind::Pages, p) || !seen_host.insert(p) {
                            return bad(format!("node {i}: host page {p} not held or shared"));
                        }
                    }
                    if let Some(s) = n.snapshot {
                        if !host.is_allocated(Kind::Slots, s) {
                            return bad(format!("node {i}: host state slot {s} not held"));
                        }
                        count.parked_states += 1;
                    }
                    count.parked_pages += n.pages.len() as u64;
                }
            }
        }
        let mut chained = 0usize;
        for (&key, &head) in &self.index {
            let mut c = head;
            while c != NONE {
                let n = &self.nodes[c as usize];
                if !n.live || n.key != key {
                    return bad(format!("index chain {key:#x} names node {c} wrongly"));
                }
                chained += 1;
                if chained > self.nodes.len() {
                    return bad("index chain loops".into());
                }
                c = n.next;
            }
        }
        if chained != indexed {
            return bad(format!(
                "index holds {chained} nodes, the tree files {indexed}"
            ));
        }
        let lru_entries = self
            .nodes
            .iter()
            .filter(|n| n.live && n.lru.is_some())
            .count();
        if lru_entries != self.resident_lru.len() + self.parked_lru.len() {
            return bad("LRU sets hold stale entries".into());
        }
        if self.owned_pages.count() != count.resident_pages
            || self.owned_slots.count() != count.resident_states
        {
            return bad("owned page or slot bits disagree with the nodes".into());
        }
        if self.scratch.count() != 0 {
            return bad("the insert scratch bits were left set".into());
        }
        let s = self.stats;
        let kept = (
            s.num_nodes,
            s.resident_pages,
            s.parked_pages,
            s.resident_states,
            s.parked_states,
        );
        let recount = (
            count.num_nodes,
            count.resident_pages,
            count.parked_pages,
            count.resident_states,
            count.parked_states,
        );
        if kept != recount {
            return bad(format!(
                "counters (nodes, resident pages, parked pages, resident states, parked \
                 states) {kept:?} != recount {recount:?}"
            ));
        }
        let parked_nodes = self
            .nodes
            .iter()
            .filter(|n| n.live && n.tier == Tier::Parked)
            .count() as u64;
        if s.num_parked < s.num_woken + s.num_dropped_parked
            || s.num_parked - s.num_woken - s.num_dropped_parked != parked_nodes
        {
            return bad(format!(
                "parked {} - woken {} - dropped parked {} != {parked_nodes} parked entries",
                s.num_parked, s.num_woken, s.num_dropped_parked
            ));
        }
        if let Some(host) = host {
            let hs = host.stats();
            if hs.pages_used != count.parked_pages || hs.slots_used != count.parked_states {
                return bad(format!(
                    "host holds {} pages / {} states, the tree {} / {}",
                    hs.pages_used, hs.slots_used, count.parked_pages, count.parked_states
                ));
            }
        }
        Ok(())
    }
}
