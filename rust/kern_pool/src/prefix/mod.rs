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
mod insert;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::bits::Bits;
use crate::error::{KernError, Result};
use crate::ids::{NodeId, PageId, SlotId};
use crate::plan::EntryKey;

const ROOT: u32 = 0;
/// No node (end of an index chain).
const NONE: u32 = u32::MAX;
/// Up to this many children, a lookup compares first pages instead of hashing one.
const SCAN_KIDS: usize = 4;
/// How much of a run a walk asks for ahead of comparing it (see `prefetch_span`).
const PREFETCH_BYTES: usize = 64 << 10;

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

/// Order of eviction candidates: coldest first, and on a tie the deeper entry first (a path
/// touched together goes leaf first). The index only makes the key unique.
type LruKey = (u64, Reverse<u32>, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Resident,
    Parked,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lru {
    Resident,
    Parked,
}

/// A node's children, in no order: up to `SCAN_KIDS` inside the node itself, so a step down a
/// path of few children reads the child's node and tokens and no list in between; more in a
/// list of their own.
#[derive(Clone, Debug)]
enum Kids {
    Few(u32, [u32; SCAN_KIDS]),
    Many(Vec<u32>),
}

impl Kids {
    fn new() -> Self {
        Kids::Few(0, [NONE; SCAN_KIDS])
    }

    fn one(c: u32) -> Self {
        let mut k = Kids::new();
        k.push(c);
        k
    }

    fn push(&mut self, c: u32) {
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
    fn swap_remove(&mut self, pos: usize) {
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
struct Node {
    tokens: Vec<u32>,
    /// Every child, in no order; `pos` is a child's place here.
    kids: Kids,
    parent: u32,
    /// Path length where this node's tokens begin; always a multiple of page_tokens.
    start: u32,
    stamp: u64,
    /// Device page ids when resident, host page ids when parked.
    pages: Vec<u32>,
    /// Locks on this node and on its descendants: what keeps it from eviction.
    lock: u32,
    /// Locks taken on this node's own handle: what `unlock` may release.
    own_lock: u32,
    num_resident_children: u32,
    /// Children shorter than a page (not in the index).
    num_partial: u32,
    pos: u32,
    generation: u32,
    /// Index key (a hash of parent and first page) and the next node with the same key.
    key: u64,
    next: u32,
    /// A state snapshot taken at exactly `start + tokens.len()`, in the node's tier.
    snapshot: Option<u32>,
    tier: Tier,
    /// The LRU set the node is in (its key there is `(stamp, Reverse(end), index)`).
    lru: Option<Lru>,
    live: bool,
}

impl Node {
    fn root() -> Self {
        Node::new(ROOT, 0, Vec::new(), Vec::new(), None, Tier::Resident)
    }

    fn new(
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

    fn end(&self) -> u32 {
        self.start + self.tokens.len() as u32
    }
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

/// The index's keys are already hashes: pass them through.
#[derive(Default)]
struct KeyHasher(u64);

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

type Index = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

/// The index key of a child of `parent` whose first page is `page`.
fn page_key(parent: u32, page: &[u32]) -> u64 {
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

/// Length of the common prefix: a memory compare when the runs agree, which they mostly do.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    if a == b {
        return n;
    }
    let mut i = 0;
    while i + 16 <= n && a[i..i + 16] == b[i..i + 16] {
        i += 16;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Ask the cache for the line at `x` ahead of its use (a hint: never faults, changes nothing).
#[inline(always)]
fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault; `x` is a live
    // reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((x as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Ask for every line of a node (three or four, by its alignment).
#[inline(always)]
fn prefetch_node(n: &Node) {
    let p = (n as *const Node).cast::<u8>();
    let size = std::mem::size_of::<Node>();
    let mut at = 0;
    while at < size {
        // SAFETY: `at` stays inside the node, so the pointer is in bounds of a live object.
        prefetch(unsafe { &*p.add(at) });
        at += 64;
    }
    // SAFETY: the node's last byte; a node not aligned to a line may end on one more.
    prefetch(unsafe { &*p.add(size - 1) });
}

/// Ask for the start of `xs` and the first line of each 4 KB page in its first `max` bytes: the
/// hardware streams a run once it is read, but stops at every page boundary, and a cold run's
/// pages then arrive one after another instead of together.
#[inline(always)]
fn prefetch_span(xs: &[u32], max: usize) {
    let n = xs.len().min(max / 4);
    if n == 0 {
        return;
    }
    prefetch(&xs[0]);
    let first_page = (xs.as_ptr() as usize & !4095) + 4096;
    let mut i = (first_page - xs.as_ptr() as usize) / 4;
    while i < n {
        prefetch(&xs[i]);
        i += 1024;
    }
}

/// What a lookup passes through: the nodes entered, every one matched whole except perhaps the
/// last, of which `cover` tokens are matched; and the hit length.
struct Walk {
    path: Vec<u32>,
    cover: usize,
    hit: usize,
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

    // ---- LRU bookkeeping: every change to tier, lock, children or stamp goes through here.

    fn lru_key(&self, i: u32) -> LruKey {
        let n = &self.nodes[i as usize];
        (n.stamp, Reverse(n.end()), i)
    }

    /// Take `i` out of its LRU set (its stamp and end are what they were when it went in: every
    /// change to them unlinks first).
    fn unlink(&mut self, i: u32) {
        if let Some(set) = self.nodes[i as usize].lru.take() {
            let key = self.lru_key(i);
            match set {
                Lru::Resident => self.resident_lru.remove(&key),
                Lru::Parked => self.parked_lru.remove(&key),
            };
        }
    }

    fn lru_set(n: &Node) -> Option<Lru> {
        match n.tier {
            Tier::Resident if n.lock == 0 && n.num_resident_children == 0 => Some(Lru::Resident),
            Tier::Parked if n.lock == 0 && n.kids.is_empty() => Some(Lru::Parked),
            _ => None,
        }
    }

    fn relink(&mut self, i: u32) {
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

    fn update(&mut self, i: u32, f: impl FnOnce(&mut Node)) {
        self.unlink(i);
        f(&mut self.nodes[i as usize]);
        self.relink(i);
    }

    /// Stamp every node from `i` up to the root with a new tick.
    fn touch_up(&mut self, mut i: u32) {
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

    // ---- The children index.

    fn index_insert(&mut self, i: u32) {
        let n = &self.nodes[i as usize];
        let key = page_key(n.parent, &n.tokens[..self.page_tokens as usize]);
        let next = self.index.insert(key, i).unwrap_or(NONE);
        let n = &mut self.nodes[i as usize];
        n.key = key;
        n.next = next;
    }

    /// Put `new` in `old`'s place in its index chain (`new` takes `old`'s key).
    fn index_replace(&mut self, old: u32, new: u32) {
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

    fn index_remove(&mut self, i: u32) {
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
    fn find_full(&self, parent: u32, page: &[u32]) -> Option<u32> {
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
    fn find_short(&self, parent: u32, rest: &[u32]) -> Option<(u32, usize)> {
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

    // ---- Structure.

    fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_nodes.pop() {
            Some(i) => {
                let generation = self.nodes[i as usize].generation.wrapping_add(1);
                self.nodes[i as usize] = Node { generation, ..node };
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn add_child(&mut self, parent: u32, child: u32) {
        let pos = self.nodes[parent as usize].kids.len() as u32;
        let (full, resident) = {
            let c = &mut self.nodes[child as usize];
            c.pos = pos;
            (
                c.tokens.len() >= self.page_tokens as usize,
                c.tier == Tier::Resident,
            )
        };
        if full {
            self.index_insert(child);
        }
        self.update(parent, |p| {
            p.kids.push(child);
            p.num_partial += u32::from(!full);
            p.num_resident_children += u32::from(resident);
        });
    }

    fn remove_child(&mut self, parent: u32, child: u32) {
        let (pos, full, resident) = {
            let c = &self.nodes[child as usize];
            (
                c.pos as usize,
                c.tokens.len() >= self.page_tokens as usize,
                c.tier == Tier::Resident,
            )
        };
        if full {
            self.index_remove(child);
        }
        self.unlink(parent);
        let p = &mut self.nodes[parent as usize];
        p.kids.swap_remove(pos);
        let moved = p.kids.get(pos).copied();
        p.num_partial -= u32::from(!full);
        p.num_resident_children -= u32::from(resident);
        if let Some(m) = moved {
            self.nodes[m as usize].pos = pos as u32;
        }
        self.relink(parent);
    }

    /// Split `c` at `at` tokens into its own parent (`at` page-aligned, inside `c`). The new
    /// node takes the first part and `c` keeps its handle, its children, its snapshot and its
    /// own locks, so a lock taken on `c` still covers both halves.
    fn split(&mut self, c: u32, at: usize) -> u32 {
        let pt = self.page_tokens as usize;
        debug_assert!(at > 0 && at < self.nodes[c as usize].tokens.len());
        debug_assert!(at.is_multiple_of(pt));
        self.unlink(c);
        let n = &mut self.nodes[c as usize];
        let tail_tokens = n.tokens.split_off(at);
        let tail_pages = n.pages.split_off(at / pt);
        let head_tokens = std::mem::replace(&mut n.tokens, tail_tokens);
        let head_pages = std::mem::replace(&mut n.pages, tail_pages);
        let mut top = Node::new(n.parent, n.start, head_tokens, head_pages, None, n.tier);
        top.kids = Kids::one(c);
        top.pos = n.pos;
        top.num_resident_children = u32::from(n.tier == Tier::Resident);
        top.lock = n.lock;
        top.stamp = n.stamp;
        let parent = n.parent;
        let pos = n.pos;
        n.start += at as u32;
        n.pos = 0;
        let top = self.alloc_node(top);
        // `c` had a page or more, so it was in the index; `top` has the same first page.
        self.index_replace(c, top);
        self.nodes[parent as usize].kids[pos as usize] = top;
        self.nodes[c as usize].parent = top;
        if self.nodes[c as usize].tokens.len() >= pt {
            self.index_insert(c);
        } else {
            self.nodes[top as usize].num_partial += 1;
        }
        self.stats.num_nodes += 1;
        self.relink(c);
        self.relink(top);
        top
    }

    /// Remove a node without children.
    fn remove_node(&mut self, i: u32) {
        debug_assert!(self.nodes[i as usize].kids.is_empty());
        let parent = self.nodes[i as usize].parent;
        self.unlink(i);
        self.remove_child(parent, i);
        let n = &mut self.nodes[i as usize];
        n.live = false;
        n.tokens = Vec::new();
        n.pages = Vec::new();
        n.kids = Kids::new();
        n.num_partial = 0;
        self.free_nodes.push(i);
        self.stats.num_nodes -= 1;
    }

    // ---- Locks.

    fn lock_index(&mut self, i: u32) {
        self.nodes[i as usize].own_lock += 1;
        let mut j = i;
        while j != ROOT {
            let n = &mut self.nodes[j as usize];
            if n.lru.is_some() {
                self.update(j, |n| n.lock += 1);
            } else {
                n.lock += 1;
            }
            j = self.nodes[j as usize].parent;
        }
    }

    /// Lock `node` and its ancestors so eviction leaves them alone. Locks nest.
    #[cfg(test)]
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        let i = self.resolve(node)?;
        self.lock_index(i);
        Ok(())
    }

    /// What `unlock(node)` would refuse, changing nothing; the node's index when it would not.
    /// Any handle without a lock is `NotLocked`, a dead one included: a locked node is never
    /// removed, so a dead handle holds no lock.
    pub fn check_unlock(&self, node: NodeId) -> Result<u32> {
        let handle = node.to_u64();
        let i = self.resolve(node).map_err(|_| KernError::NotLocked {
            handle,
            live: false,
        })?;
        if self.nodes[i as usize].own_lock == 0 {
            return Err(KernError::NotLocked { handle, live: true });
        }
        Ok(i)
    }

    /// Release one lock taken on `node`'s own handle. `NotLocked` (changing nothing) when none
    /// is held on it, even if a descendant's lock covers it.
    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        let i = self.check_unlock(node)?;
        self.nodes[i as usize].own_lock -= 1;
        let mut j = i;
        while j != ROOT {
            let n = &self.nodes[j as usize];
            if n.lock == 1 {
                self.update(j, |n| n.lock -= 1);
            } else {
                self.nodes[j as usize].lock -= 1;
            }
            j = self.nodes[j as usize].parent;
        }
        Ok(())
    }

    // ---- Walking.

    /// Where a lookup of `tokens` goes: the longest path, unless a state snapshot deeper than
    /// any on it sits on a shorter child off it (see `snapshot_detour`). Read-only.
    fn walk(&self, tokens: &[u32]) -> Walk {
        let w = self.walk_longest(tokens);
        if self.stats.resident_states + self.stats.parked_states == 0 {
            return w;
        }
        self.snapshot_detour(tokens, w)
    }

    /// A recurrent model resumes only at a snapshot. A prompt that ended mid-page leaves its
    /// snapshot on a child shorter than a page; the next turn through it is inserted as a
    /// sibling of whole pages (a node never ends mid-page above a child), which the longest
    /// path then takes, past the snapshot. Where such a short child of a node the walk passed
    /// whole is a prefix of the key and holds a snapshot deeper than any on the walk's path,
    /// the walk ends in that child instead.
    fn snapshot_detour(&self, tokens: &[u32], w: Walk) -> Walk {
        let pt = self.page_tokens as usize;
        let deepest = w
            .path
            .iter()
            .map(|&i| &self.nodes[i as usize])
            .filter(|n| n.snapshot.is_some() && n.end() as usize <= w.hit)
            .map(|n| n.end() as usize)
            .max()
            .unwrap_or(0);
        // (how many path nodes precede it, the child, its end)
        let mut best: Option<(usize, u32, usize)> = None;
        let (mut parent, mut at) = (ROOT, 0usize);
        for k in 0..=w.path.len() {
            let p = &self.nodes[parent as usize];
            if p.num_partial > 0 {
                let rest = &tokens[at..];
                for &c in p.kids.iter() {
                    let cn = &self.nodes[c as usize];
                    let t = &cn.tokens;
                    let end = at + t.len();
                    if cn.snapshot.is_some()
                        && t.len() < pt
                        && t.len() <= rest.len()
                        && end > best.map_or(deepest, |b| b.2)
                        && rest[..t.len()] == t[..]
                    {
                        best = Some((k, c, end));
                    }
                }
            }
            let Some(&next) = w.path.get(k) else { break };
            let end = self.nodes[next as usize].end() as usize;
            if end > w.hit || !end.is_multiple_of(pt) {
                break;
            }
            (parent, at) = (next, end);
        }
        match best {
            Some((k, c, end)) => {
                let mut path = w.path[..k].to_vec();
                path.push(c);
                Walk {
                    path,
                    cover: self.nodes[c as usize].tokens.len(),
                    hit: end,
                }
            }
            None => w,
        }
    }

    /// The longest cached path of `tokens`. Read-only.
    fn walk_longest(&self, tokens: &[u32]) -> Walk {
        let pt = self.page_tokens as usize;
        let mut w = Walk {
            path: Vec::new(),
            cover: 0,
            hit: 0,
        };
        let mut node = ROOT;
        loop {
            let rest = &tokens[w.hit..];
            if rest.len() >= pt {
                if let Some(c) = self.find_full(node, &rest[..pt]) {
                    let cn = &self.nodes[c as usize];
                    let t = &cn.tokens;
                    prefetch_span(t, PREFETCH_BYTES);
                    // `read` copies its pages next, if the walk ends here or deeper.
                    prefetch_span(&cn.pages, 256);
                    // The next step reads one of these children (asked for one step ago): ask
                    // for the head of its tokens and for its own children during the compare.
                    if let Kids::Few(k, ids) = &cn.kids {
                        for &g in &ids[..*k as usize] {
                            let gn = &self.nodes[g as usize];
                            // Its second line (stamp, pages, locks) is read if the walk goes on.
                            prefetch(&gn.pages);
                            prefetch_span(&gn.tokens, 256);
                            if let Kids::Few(k, ids) = &gn.kids {
                                for &h in &ids[..*k as usize] {
                                    prefetch(&self.nodes[h as usize]);
                                }
                            }
                        }
                    }
                    let l = lcp(t, rest);
                    w.path.push(c);
                    if l == t.len() {
                        w.hit += l;
                        w.cover = l;
                        if !l.is_multiple_of(pt) {
                            return w;
                        }
                        node = c;
                        continue;
                    }
                    // Matched in part: up to the last whole page it read, or to the key's end
                    // inside a page.
                    w.cover = if l == rest.len() { l } else { l / pt * pt };
                    w.hit += w.cover;
                    return w;
                }
            }
            if let Some((c, l)) = self.find_short(node, rest) {
                w.path.push(c);
                w.cover = l;
                w.hit += l;
            }
            return w;
        }
    }

    /// The `Match` of a walk's path (after any split), its pages in `pages` (cleared first).
    fn read(&self, path: &[u32], hit: u32, mut pages: Vec<PageId>) -> Match {
        pages.clear();
        pages.reserve(self.pages_for(hit) as usize);
        let mut m = Match {
            hit_len: hit,
            resident_len: 0,
            node: None,
            pages,
            state: None,
        };
        let mut resident = true;
        for &i in path {
            let n = &self.nodes[i as usize];
            let end = n.end().min(hit);
            if resident && n.tier == Tier::Resident {
                let k = self.pages_for(end - n.start) as usize;
                m.pages.extend(n.pages[..k].iter().map(|&p| PageId(p)));
                m.resident_len = end;
            } else {
                resident = false;
            }
            if n.end() <= hit {
                if let Some(s) = n.snapshot {
                    let slot = (n.tier == Tier::Resident).then_some(SlotId(s));
                    m.state = Some(StateHit { len: n.end(), slot });
                }
            }
        }
        m.node = path.last().map(|&i| self.handle(i));
        m
    }

    /// Longest cached prefix of `tokens`, locked. Splits the node the hit ends inside right
    /// after the last page the hit read, unless it is parked, then refreshes and locks the
    /// hit's path only: release the lock with `unlock(m.node)`.
    #[cfg(test)]
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Match {
        self.match_prefix_with(tokens, Vec::new())
    }

    /// `match_prefix` with the page list written into `pages` (cleared first): a caller that
    /// matches often reuses one buffer.
    pub fn match_prefix_with(&mut self, tokens: &[u32], pages: Vec<PageId>) -> Match {
        let w = self.walk(tokens);
        let mut path = w.path;
        if let Some(last) = path.last_mut() {
            let n = &self.nodes[*last as usize];
            let at = w.cover.div_ceil(self.page_tokens as usize) * self.page_tokens as usize;
            if at < n.tokens.len() && n.tier == Tier::Resident {
                *last = self.split(*last, at);
            }
        }
        if let Some(&last) = path.last() {
            self.lock_index(last);
            self.touch_up(last);
        }
        self.read(&path, w.hit as u32, pages)
    }

    /// What `match_prefix` would return, changing nothing (no split, no refresh, no lock):
    /// `node` is then the deepest node the hit reaches, perhaps past the hit.
    pub fn peek(&self, tokens: &[u32]) -> Match {
        let w = self.walk(tokens);
        self.read(&w.path, w.hit as u32, Vec::new())
    }
}
