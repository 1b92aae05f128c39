//! The prefix radix tree over token ids, at page granularity, with two tiers.
//!
//! Design notes:
//! - Every node starts on a page boundary and holds whole pages, except that a leaf may end in
//!   a partial page. A node's children of a page or more are filed in one hash index under
//!   (parent, first page), so a step down is one lookup however many siblings share a first
//!   token (a scan of a first-token bucket cost 6.9 us at 1,000 siblings). Children shorter
//!   than a page (a prompt that ended mid-page, a state snapshot's exact length) sit in a short
//!   list on their parent.
//! - A match reads whole pages, a node that ends mid-page whole, or the page the key itself
//!   ends in: it descends through children it matches whole and stops in a child it matches
//!   in part, splitting that child right after the last page it read. So the match's path is
//!   exactly what it read, and only that path is refreshed and locked: exact LRU over what was
//!   matched. A hit that ends mid-page shares that page (the caller copies it). Where the key
//!   ends inside the first page of several children, it reads the resident one used last.
//!   Tried and dropped: a hit that runs mid-page into a child the key then leaves. The child
//!   whose first tokens matched was another conversation's entry (a template ending mid-page,
//!   conversations under it); refreshing and locking it made LRU wrong, to save a few tokens.
//! - A recurrent model resumes only at a state snapshot. When the tree holds snapshots, a
//!   match whose longest path has none as deep as a snapshot on a short child off that path
//!   (a turn that ended mid-page, then the next turn inserted through it as a sibling of whole
//!   pages) ends in that short child instead. Inserts walk the longest path.
//! - A parked node is never split by a match: a match that reads part of one refreshes and
//!   locks all of it, and a wake brings all of it back. (A split would create a parked entry
//!   without a park, and the counters `parked - woken - dropped_parked` stop counting the
//!   parked entries.) An insert that stops inside a parked node splits it and takes the
//!   caller's pages for the head, which becomes resident.
//! - LRU by a logical clock: an operation stamps every node on its path, so a parent is never
//!   colder than its child. Two ordered sets hold exactly the candidates (resident with no
//!   resident child and unlocked; parked with no child and unlocked), kept current on every
//!   change, so `evict` takes the first element instead of scanning or re-heaping the leaves.
//!   Ties go deeper first: a path touched together goes leaf first.
//! - Locks: each node counts the locks taken on its own handle and the locks on itself and
//!   its descendants. Only the first decides `NotLocked`; the second keeps a locked path out of
//!   eviction.
//! - Tiers may mix along a path (a resident node under a parked one that held a state the
//!   caller did not give again). An insert leaves every token of its key resident otherwise:
//!   where the tree holds tokens only in host memory it takes the caller's device pages for
//!   them (a wake with no copy) instead of freeing them.
//! - A node holds up to four children's ids in itself (a list of their own past that): a step
//!   down a path of few children reads the child and its tokens, not a list in between
//!   (measured: a third fewer samples in the child lookup, 8-11% fewer in the crate, over the
//!   page-16 replay of `kern.bench.prefix`), and a walk asks for those children while it
//!   compares the node's tokens, so the next step's node is mostly in cache (10-18% fewer
//!   samples in the crate again).
//! - Every counter is kept as it changes, so `stats` is O(1).
//! - Tried and dropped: merging a node with its only child after a removal. It saves nodes but
//!   moves pages between nodes that a lock or an outstanding handle may name.

mod check;
mod evict;
mod index;
mod insert;
mod lock;
mod lru;
mod node;
mod prefetch;
mod structure;
#[cfg(test)]
mod tests;
mod walk;

use std::collections::BTreeSet;

use crate::bits::Bits;
use crate::error::{KernError, Result};
use crate::ids::{NodeId, PageId, SlotId};
use crate::plan::EntryKey;
use index::Index;
use lru::LruKey;
use node::Node;

const ROOT: u32 = 0;
/// No node (end of an index chain).
const NONE: u32 = u32::MAX;

/// A free of what the tree's books say is allocated (a node's pages or snapshot, on the device
/// or the host). It fails only when those books disagree with the pool's: corruption, not
/// input. It stops the call in every build, release too (the Python face's panic guard raises
/// `CacheCorrupt`), since carrying on would let the pool hand the same page out twice.
#[track_caller]
fn books_agree(freed: Result<()>) {
    if let Err(e) = freed {
        panic!("the tree's books disagree with the pool's: {e}");
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Resident,
    Parked,
}

/// What `match` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match {
    /// Longest cached prefix, resident or parked.
    pub hit_len: u32,
    /// The part of the hit whose pages are on the device, counted from the root.
    pub resident_len: u32,
    /// The deepest node the hit reaches (locked by `match_prefix`); `None` when nothing matched.
    pub node: Option<NodeId>,
    /// Device pages covering `resident_len` (the last one partial if it ends mid-page).
    pub pages: Vec<PageId>,
    /// The deepest state snapshot on the hit's path.
    pub state: Option<StateHit>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateHit {
    pub len: u32,
    /// The device slot, or `None` while the snapshot is parked (wake first).
    pub slot: Option<SlotId>,
}

/// What `insert` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// How many leading tokens of the key the tree held before (resident or parked): what a
    /// match would have hit.
    pub held: u32,
    /// Parked entries the caller's pages made resident (counted as woken).
    pub woken: u32,
    /// The node the key ends in; `None` for an empty key.
    pub node: Option<NodeId>,
}

/// Counters of what the tree holds and did, as the metrics report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub num_nodes: u64,
    pub resident_pages: u64,
    pub parked_pages: u64,
    pub resident_states: u64,
    pub parked_states: u64,
    pub num_parked: u64,
    pub num_dropped_resident: u64,
    pub num_dropped_parked: u64,
    pub num_woken: u64,
}

#[derive(Clone, Debug)]
pub struct Prefix {
    page_tokens: u32,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    index: Index,
    resident_lru: BTreeSet<LruKey>,
    parked_lru: BTreeSet<LruKey>,
    clock: u64,
    owned_pages: Bits,
    owned_slots: Bits,
    /// The caller's pages seen so far in one insert (the repeat check), and the words of it
    /// to clear again; both empty between calls.
    scratch: Bits,
    marked: Vec<u32>,
    stats: PrefixStats,
    record_paths: bool,
}

impl Prefix {
    /// A tree over a device pool of `num_pages` pages and `num_slots` state slots.
    pub fn new(page_tokens: u32, num_pages: u32, num_slots: u32) -> Result<Self> {
        if page_tokens == 0 {
            return Err(KernError::ZeroSize {
                what: "page_tokens",
            });
        }
        Ok(Prefix {
            page_tokens,
            nodes: vec![Node::root()],
            free_nodes: Vec::new(),
            index: Index::default(),
            resident_lru: BTreeSet::new(),
            parked_lru: BTreeSet::new(),
            clock: 0,
            owned_pages: Bits::new(num_pages),
            owned_slots: Bits::new(num_slots),
            scratch: Bits::new(num_pages),
            marked: Vec::new(),
            stats: PrefixStats::default(),
            record_paths: false,
        })
    }

    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }

    /// Record each evicted or woken entry's whole token path in its key (for tests).
    pub fn record_paths(&mut self, on: bool) {
        self.record_paths = on;
    }

    /// Is this device page held by the tree?
    pub fn owns_page(&self, page: u32) -> bool {
        self.owned_pages.get(page)
    }

    pub fn owns_slot(&self, slot: u32) -> bool {
        self.owned_slots.get(slot)
    }

    /// The counters, kept as things change.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    fn pages_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.page_tokens)
    }

    fn handle(&self, index: u32) -> NodeId {
        NodeId {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32> {
        let ok = id.index != ROOT
            && (id.index as usize) < self.nodes.len()
            && self.nodes[id.index as usize].live
            && self.nodes[id.index as usize].generation == id.generation;
        if ok {
            Ok(id.index)
        } else {
            Err(KernError::UnknownNode {
                handle: id.to_u64(),
            })
        }
    }

    fn path_tokens(&self, i: u32) -> Vec<u32> {
        let mut chain = Vec::new();
        let mut j = i;
        while j != ROOT {
            chain.push(j);
            j = self.nodes[j as usize].parent;
        }
        let mut out = Vec::with_capacity(self.nodes[i as usize].end() as usize);
        for &j in chain.iter().rev() {
            out.extend_from_slice(&self.nodes[j as usize].tokens);
        }
        out
    }

    fn key(&self, i: u32) -> EntryKey {
        let n = &self.nodes[i as usize];
        EntryKey {
            start: n.start,
            end: n.end(),
            tokens: self.record_paths.then(|| self.path_tokens(i)),
        }
    }
}
