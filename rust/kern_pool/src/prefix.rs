//! The prefix radix tree over token ids, at page granularity, with two tiers.
//!
//! Design notes:
//! - Every node starts on a page boundary and holds whole pages, except that a leaf may end in
//!   a partial page. Hits may end anywhere: a hit that ends mid-page shares that page, and the
//!   caller copies it before writing past the hit (insert refuses a shared page extended in
//!   place). A partial leaf and a full page with the same first tokens may both hang under one
//!   node; that keeps a state snapshot at its exact token count without splitting a page.
//! - LRU by a logical clock: an operation stamps every node on its path, so a parent is never
//!   colder than its child. Two ordered sets hold exactly the candidates (resident with no
//!   resident child and unlocked; parked with no child and unlocked), kept current on every
//!   change, so `evict` takes the first element instead of scanning or re-heaping the leaves.
//! - Tiers may mix along a path (a resident node under a parked one, after an insert through a
//!   parked entry). Insert never changes a tier: where the tree already holds tokens (resident
//!   or parked) the caller's pages are duplicates to free.
//! - Tried and dropped: merging a node with its only child after a removal. It saves nodes but
//!   moves pages between nodes that a lock or an outstanding handle may name.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};

use crate::error::{KernError, Result};
use crate::host::Host;
use crate::ids::{HostPageId, HostSlotId, NodeId, PageId, SlotId};
use crate::plan::{EntryKey, Evicted, ParkPlan, WakePlan};
use crate::pool::{Kind, Pool};

const ROOT: u32 = 0;

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

#[derive(Clone, Debug)]
struct Node {
    generation: u32,
    live: bool,
    parent: u32,
    /// Path length where this node's tokens begin; always a multiple of page_tokens.
    start: u32,
    tokens: Vec<u32>,
    /// Device page ids when resident, host page ids when parked.
    pages: Vec<u32>,
    /// A state snapshot taken at exactly `start + tokens.len()`, in the node's tier.
    snapshot: Option<u32>,
    tier: Tier,
    /// Children by first token; a bucket holds more than one only where children share a
    /// first token and differ later in their first page.
    children: HashMap<u32, Vec<u32>>,
    num_children: u32,
    num_resident_children: u32,
    lock: u32,
    stamp: u64,
    lru: Option<(Lru, LruKey)>,
}

impl Node {
    fn root() -> Self {
        Node {
            generation: 0,
            live: true,
            parent: ROOT,
            start: 0,
            tokens: Vec::new(),
            pages: Vec::new(),
            snapshot: None,
            tier: Tier::Resident,
            children: HashMap::new(),
            num_children: 0,
            num_resident_children: 0,
            lock: 0,
            stamp: 0,
            lru: None,
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
    /// The deepest node the hit reaches, to lock and wake; `None` when nothing matched.
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

/// What `insert` left to the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// Pages whose tokens the tree already held: the caller frees them.
    pub duplicates: Vec<PageId>,
    /// The snapshot slot, if the tree did not take it: the caller frees it.
    pub state_duplicate: Option<SlotId>,
    /// The node the inserted tokens end in.
    pub node: Option<NodeId>,
}

/// Counters of what the tree did, as the metrics report them.
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

#[derive(Clone, Debug, Default)]
struct BitSet(Vec<u64>);

impl BitSet {
    fn get(&self, i: u32) -> bool {
        self.0
            .get((i / 64) as usize)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    fn set(&mut self, i: u32, on: bool) {
        let w = (i / 64) as usize;
        if w >= self.0.len() {
            if !on {
                return;
            }
            self.0.resize(w + 1, 0);
        }
        if on {
            self.0[w] |= 1 << (i % 64);
        } else {
            self.0[w] &= !(1 << (i % 64));
        }
    }
    fn count(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[derive(Clone, Debug)]
pub struct Prefix {
    page_tokens: u32,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    resident_lru: BTreeSet<LruKey>,
    parked_lru: BTreeSet<LruKey>,
    clock: u64,
    owned_pages: BitSet,
    owned_slots: BitSet,
    stats: PrefixStats,
}

impl Prefix {
    pub fn new(page_tokens: u32) -> Result<Self> {
        if page_tokens == 0 {
            return Err(KernError::ZeroSize {
                what: "page_tokens",
            });
        }
        Ok(Prefix {
            page_tokens,
            nodes: vec![Node::root()],
            free_nodes: Vec::new(),
            resident_lru: BTreeSet::new(),
            parked_lru: BTreeSet::new(),
            clock: 0,
            owned_pages: BitSet::default(),
            owned_slots: BitSet::default(),
            stats: PrefixStats::default(),
        })
    }

    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }

    /// Is this device page held by the tree?
    pub fn owns_page(&self, page: u32) -> bool {
        self.owned_pages.get(page)
    }

    pub fn owns_slot(&self, slot: u32) -> bool {
        self.owned_slots.get(slot)
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

    // ---- LRU bookkeeping: every change to tier, lock, children or stamp goes through here.

    fn unlink(&mut self, i: u32) {
        if let Some((set, key)) = self.nodes[i as usize].lru.take() {
            match set {
                Lru::Resident => self.resident_lru.remove(&key),
                Lru::Parked => self.parked_lru.remove(&key),
            };
        }
    }

    fn relink(&mut self, i: u32) {
        if i == ROOT {
            return;
        }
        let n = &self.nodes[i as usize];
        let set = match n.tier {
            Tier::Resident if n.lock == 0 && n.num_resident_children == 0 => Some(Lru::Resident),
            Tier::Parked if n.lock == 0 && n.num_children == 0 => Some(Lru::Parked),
            _ => None,
        };
        let key = (n.stamp, Reverse(n.end()), i);
        if let Some(set) = set {
            match set {
                Lru::Resident => self.resident_lru.insert(key),
                Lru::Parked => self.parked_lru.insert(key),
            };
            self.nodes[i as usize].lru = Some((set, key));
        }
    }

    fn update(&mut self, i: u32, f: impl FnOnce(&mut Node)) {
        self.unlink(i);
        f(&mut self.nodes[i as usize]);
        self.relink(i);
    }

    fn touch(&mut self, path: &[u32]) {
        self.clock += 1;
        let now = self.clock;
        for &i in path {
            self.update(i, |n| n.stamp = now);
        }
    }

    // ---- Walking.

    /// The child of `node` sharing the longest prefix with `rest`; on a tie, a resident one
    /// (no wake needed), then one matched whole (a partial leaf holding a snapshot at the hit).
    fn best_child(&self, node: u32, rest: &[u32]) -> Option<(u32, usize)> {
        let bucket = self.nodes[node as usize].children.get(rest.first()?)?;
        let mut best: Option<(u32, (usize, bool, bool))> = None;
        for &c in bucket {
            let n = &self.nodes[c as usize];
            let l = lcp(&n.tokens, rest);
            let rank = (l, n.tier == Tier::Resident, l == n.tokens.len());
            if best.is_none_or(|(_, b)| rank > b) {
                best = Some((c, rank));
            }
        }
        best.map(|(c, (l, _, _))| (c, l))
    }

    /// The nodes a lookup of `tokens` passes through (the last possibly only partly matched),
    /// and the hit length. Read-only.
    fn walk(&self, tokens: &[u32]) -> (Vec<u32>, u32) {
        let mut path = Vec::new();
        let (mut node, mut pos) = (ROOT, 0usize);
        while let Some((c, l)) = self.best_child(node, &tokens[pos..]) {
            path.push(c);
            pos += l;
            if l < self.nodes[c as usize].tokens.len() {
                break;
            }
            node = c;
        }
        (path, pos as u32)
    }

    /// Longest cached prefix of `tokens`. Mutates only the LRU order (every node on the hit's
    /// path becomes most recently used); never splits a node.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Match {
        let (path, hit) = self.walk(tokens);
        let mut m = Match {
            hit_len: hit,
            resident_len: 0,
            node: None,
            pages: Vec::new(),
            state: None,
        };
        let mut resident = true;
        for &i in &path {
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
        self.touch(&path);
        m
    }

    /// Lock `node` and its ancestors so eviction leaves them alone. Locks nest.
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        let mut i = self.resolve(node)?;
        while i != ROOT {
            self.update(i, |n| n.lock += 1);
            i = self.nodes[i as usize].parent;
        }
        Ok(())
    }

    /// Release one `lock` of `node`. Errors (changing nothing) if `node` is not locked.
    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        let first = self.resolve(node)?;
        if self.nodes[first as usize].lock == 0 {
            return Err(KernError::NotLocked {
                handle: node.to_u64(),
            });
        }
        let mut i = first;
        while i != ROOT {
            self.update(i, |n| n.lock -= 1);
            i = self.nodes[i as usize].parent;
        }
        Ok(())
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
        let (first, resident) = {
            let c = &self.nodes[child as usize];
            (c.tokens[0], c.tier == Tier::Resident)
        };
        self.update(parent, |p| {
            p.children.entry(first).or_default().push(child);
            p.num_children += 1;
            p.num_resident_children += u32::from(resident);
        });
    }

    fn remove_child(&mut self, parent: u32, child: u32) {
        let (first, resident) = {
            let c = &self.nodes[child as usize];
            (c.tokens[0], c.tier == Tier::Resident)
        };
        self.update(parent, |p| {
            if let Some(bucket) = p.children.get_mut(&first) {
                bucket.retain(|&c| c != child);
                if bucket.is_empty() {
                    p.children.remove(&first);
                }
            }
            p.num_children -= 1;
            p.num_resident_children -= u32::from(resident);
        });
    }

    /// Split `c` at `at` tokens into its own parent (`at` page-aligned, inside `c`). The new
    /// node takes the first part and `c` keeps its handle, its children and its snapshot, so a
    /// lock taken on `c` still covers both halves.
    fn split(&mut self, c: u32, at: usize) -> u32 {
        debug_assert!(at > 0 && at < self.nodes[c as usize].tokens.len());
        debug_assert!(at.is_multiple_of(self.page_tokens as usize));
        let k = at / self.page_tokens as usize;
        self.unlink(c);
        let n = &mut self.nodes[c as usize];
        let tail_tokens = n.tokens.split_off(at);
        let tail_pages = n.pages.split_off(k);
        let head_tokens = std::mem::replace(&mut n.tokens, tail_tokens);
        let head_pages = std::mem::replace(&mut n.pages, tail_pages);
        let (parent, start, tier, lock, stamp) = (n.parent, n.start, n.tier, n.lock, n.stamp);
        n.start += at as u32;
        let first = head_tokens[0];
        let mut children = HashMap::new();
        children.insert(n.tokens[0], vec![c]);
        let top = self.alloc_node(Node {
            generation: 0,
            live: true,
            parent,
            start,
            tokens: head_tokens,
            pages: head_pages,
            snapshot: None,
            tier,
            children,
            num_children: 1,
            num_resident_children: u32::from(tier == Tier::Resident),
            lock,
            stamp,
            lru: None,
        });
        self.nodes[c as usize].parent = top;
        self.relink(c);
        if let Some(bucket) = self.nodes[parent as usize].children.get_mut(&first) {
            for x in bucket.iter_mut() {
                if *x == c {
                    *x = top;
                }
            }
        }
        self.relink(top);
        top
    }

    fn new_leaf(
        &mut self,
        parent: u32,
        tokens: &[u32],
        pages: &[u32],
        snapshot: Option<u32>,
    ) -> u32 {
        let start = self.nodes[parent as usize].end();
        for &p in pages {
            self.owned_pages.set(p, true);
        }
        if let Some(s) = snapshot {
            self.owned_slots.set(s, true);
        }
        let leaf = self.alloc_node(Node {
            generation: 0,
            live: true,
            parent,
            start,
            tokens: tokens.to_vec(),
            pages: pages.to_vec(),
            snapshot,
            tier: Tier::Resident,
            children: HashMap::new(),
            num_children: 0,
            num_resident_children: 0,
            lock: 0,
            stamp: 0, // stamped with its path when the insert ends
            lru: None,
        });
        self.add_child(parent, leaf);
        self.relink(leaf);
        leaf
    }

    /// Our pages at global page indices `range` that `c` already holds: duplicates unless they
    /// are the very pages `c` holds (a shared hit).
    fn duplicates_in(
        &self,
        c: u32,
        pages: &[u32],
        range: std::ops::Range<usize>,
        out: &mut Vec<PageId>,
    ) {
        let n = &self.nodes[c as usize];
        let base = (n.start / self.page_tokens) as usize;
        for g in range {
            let same = n.tier == Tier::Resident && n.pages.get(g - base) == Some(&pages[g]);
            if !same {
                out.push(PageId(pages[g]));
            }
        }
    }

    /// Give a finished request's tokens and pages to the tree (and optionally the state
    /// snapshot taken at exactly `tokens.len()`). The tree takes what it does not hold and
    /// returns the rest to free. Splits nodes; validates everything before changing anything.
    pub fn insert(
        &mut self,
        pool: &Pool,
        tokens: &[u32],
        pages: &[u32],
        snapshot: Option<SlotId>,
    ) -> Result<Inserted> {
        let pt = self.page_tokens as usize;
        let total = tokens.len();
        if pages.len() != total.div_ceil(pt) {
            return Err(KernError::LengthMismatch {
                tokens: total,
                pages: pages.len(),
                page_tokens: self.page_tokens,
            });
        }
        pool.check_owned(Kind::Pages, pages, "page")?;
        if let Some(SlotId(s)) = snapshot {
            if !pool.is_allocated(Kind::Slots, s) {
                return Err(KernError::NotAllocated {
                    what: "state slot",
                    id: s,
                });
            }
            if self.owned_slots.get(s) {
                return Err(KernError::OwnedByCache {
                    what: "state slot",
                    id: s,
                });
            }
        }
        // Pages the tree owns may only be passed back where the tree holds them, and only if the
        // tree holds every token the caller has in them.
        let (path, hit) = self.walk(tokens);
        let mut tree_page: Vec<Option<u32>> = vec![None; pages.len()];
        for &i in &path {
            let n = &self.nodes[i as usize];
            if n.tier == Tier::Resident {
                let base = (n.start as usize) / pt;
                for (j, &p) in n.pages.iter().enumerate() {
                    if let Some(slot) = tree_page.get_mut(base + j) {
                        *slot = Some(p);
                    }
                }
            }
        }
        for (g, &p) in pages.iter().enumerate() {
            if self.owned_pages.get(p) {
                if tree_page[g] != Some(p) {
                    return Err(KernError::OwnedByCache {
                        what: "page",
                        id: p,
                    });
                }
                if (hit as usize) < total.min((g + 1) * pt) {
                    return Err(KernError::SharedPageExtended { page: p, index: g });
                }
            }
        }

        let mut out = Inserted {
            duplicates: Vec::new(),
            state_duplicate: None,
            node: None,
        };
        let mut snapshot = snapshot.map(|s| s.0);
        let (mut node, mut pos) = (ROOT, 0usize);
        loop {
            let rest = &tokens[pos..];
            if rest.is_empty() {
                if let Some(s) = snapshot.take() {
                    let n = &self.nodes[node as usize];
                    if node != ROOT && n.snapshot.is_none() && n.tier == Tier::Resident {
                        self.nodes[node as usize].snapshot = Some(s);
                        self.owned_slots.set(s, true);
                    } else {
                        out.state_duplicate = Some(SlotId(s));
                    }
                }
                break;
            }
            let g0 = pos / pt;
            let Some((c, m)) = self.best_child(node, rest) else {
                node = self.new_leaf(node, rest, &pages[g0..], snapshot.take());
                break;
            };
            let clen = self.nodes[c as usize].tokens.len();
            let extends_partial = !clen.is_multiple_of(pt) && rest.len() > clen;
            if m == clen && !extends_partial {
                // All of c is ours too: descend.
                self.duplicates_in(c, pages, g0..g0 + clen.div_ceil(pt), &mut out.duplicates);
                pos += clen;
                node = c;
                continue;
            }
            // Duplicates are counted on c before any split, while its page indices are whole.
            let s = (m / pt) * pt;
            let gs = g0 + s / pt;
            if m == rest.len() {
                // We end inside c, which holds every token we have.
                let tail_is_shared = self.owned_pages.get(pages[pages.len() - 1]);
                if snapshot.is_none() || (m % pt != 0 && tail_is_shared) {
                    self.duplicates_in(c, pages, g0..pages.len(), &mut out.duplicates);
                    // A snapshot whose tail page the tree already holds would need that page in
                    // two nodes: hand it back instead.
                    out.state_duplicate = snapshot.take().map(SlotId);
                    node = c;
                    break;
                }
                if m % pt == 0 {
                    self.duplicates_in(c, pages, g0..pages.len(), &mut out.duplicates);
                    node = self.split(c, m);
                    pos += m;
                    continue; // rest is now empty: the snapshot lands on the split-off node
                }
            }
            // Diverge mid-page (or end mid-page with a snapshot): branch at the page boundary.
            self.duplicates_in(c, pages, g0..gs, &mut out.duplicates);
            let parent = if s > 0 { self.split(c, s) } else { node };
            node = self.new_leaf(parent, &rest[s..], &pages[gs..], snapshot.take());
            break;
        }
        if node != ROOT {
            out.node = Some(self.handle(node));
        }
        let mut path = Vec::new();
        let mut i = node;
        while i != ROOT {
            path.push(i);
            i = self.nodes[i as usize].parent;
        }
        self.touch(&path);
        Ok(out)
    }

    // ---- Make room.

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
        EntryKey {
            tokens: self.path_tokens(i),
            start: self.nodes[i as usize].start,
        }
    }

    fn remove_node(&mut self, i: u32) {
        let parent = self.nodes[i as usize].parent;
        self.unlink(i);
        self.remove_child(parent, i);
        let n = &mut self.nodes[i as usize];
        n.live = false;
        n.children.clear();
        n.tokens = Vec::new();
        n.pages = Vec::new();
        self.free_nodes.push(i);
    }

    fn drop_parked(&mut self, i: u32, host: &mut Host) -> EntryKey {
        let key = self.key(i);
        let n = &self.nodes[i as usize];
        let states: Vec<u32> = n.snapshot.into_iter().collect();
        // The tree's books say these are allocated; a failure here is corruption, not input.
        let freed = host.free(&n.pages, &states);
        debug_assert!(freed.is_ok(), "{freed:?}");
        self.remove_node(i);
        self.stats.num_dropped_parked += 1;
        key
    }

    fn drop_resident(
        &mut self,
        i: u32,
        pool: &mut Pool,
        host: Option<&mut Host>,
        out: &mut Vec<Evicted>,
    ) {
        // Children of a drop candidate can only be parked (a resident one would be colder and
        // unlocked, so taken first); they go with it, each reported.
        if self.nodes[i as usize].num_children > 0 {
            let mut stack: Vec<u32> = self.nodes[i as usize]
                .children
                .values()
                .flatten()
                .copied()
                .collect();
            let mut order = Vec::new();
            while let Some(j) = stack.pop() {
                order.push(j);
                stack.extend(self.nodes[j as usize].children.values().flatten().copied());
            }
            if let Some(host) = host {
                for &j in order.iter().rev() {
                    let key = self.drop_parked(j, host);
                    out.push(Evicted::Dropped { key, parked: true });
                }
            }
        }
        let key = self.key(i);
        self.release_device(i, pool);
        self.remove_node(i);
        self.stats.num_dropped_resident += 1;
        out.push(Evicted::Dropped { key, parked: false });
    }

    /// Give a resident node's device pages and snapshot back to the pool (the node keeps the
    /// stale ids until the caller replaces or removes it).
    fn release_device(&mut self, i: u32, pool: &mut Pool) {
        let n = &self.nodes[i as usize];
        let (pages, snapshot) = (n.pages.clone(), n.snapshot);
        for &p in &pages {
            self.owned_pages.set(p, false);
        }
        // The tree's books say these are allocated; a failure here is corruption, not input.
        let freed = pool.free(Kind::Pages, &pages);
        debug_assert!(freed.is_ok(), "{freed:?}");
        if let Some(s) = snapshot {
            self.owned_slots.set(s, false);
            let freed = pool.free(Kind::Slots, &[s]);
            debug_assert!(freed.is_ok(), "{freed:?}");
        }
    }

    fn park(
        &mut self,
        i: u32,
        pool: &mut Pool,
        host_pages: Vec<HostPageId>,
        host_states: Vec<HostSlotId>,
    ) -> ParkPlan {
        let n = &self.nodes[i as usize];
        let plan = ParkPlan {
            pages: n
                .pages
                .iter()
                .zip(&host_pages)
                .map(|(&p, &h)| (PageId(p), h))
                .collect(),
            states: n
                .snapshot
                .zip(host_states.first())
                .map(|(s, &h)| (SlotId(s), h))
                .into_iter()
                .collect(),
        };
        self.release_device(i, pool);
        let parent = self.nodes[i as usize].parent;
        self.update(i, |n| {
            n.pages = host_pages.iter().map(|h| h.0).collect();
            n.snapshot = host_states.first().map(|h| h.0);
            n.tier = Tier::Parked;
        });
        self.update(parent, |p| p.num_resident_children -= 1);
        self.stats.num_parked += 1;
        plan
    }

    /// One step of the make-room loop: take the coldest unlocked resident entry; park it if
    /// `park` and the host can make room (dropping the coldest parked entries as needed), else
    /// drop it. Returns what was taken, or nothing when nothing is evictable.
    pub fn evict_one(
        &mut self,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        park: bool,
    ) -> Vec<Evicted> {
        let mut out = Vec::new();
        let Some(&(_, _, x)) = self.resident_lru.first() else {
            return out;
        };
        if park {
            if let Some(host) = host.as_deref_mut() {
                let n = &self.nodes[x as usize];
                let (np, ns) = (n.pages.len(), usize::from(n.snapshot.is_some()));
                if host.could_ever_fit(np, ns) {
                    let mut dropped = Vec::new();
                    loop {
                        if let Some((hp, hs)) = host.try_alloc(np, ns) {
                            let plan = self.park(x, pool, hp, hs);
                            let key = self.key(x);
                            out.push(Evicted::Parked { key, plan, dropped });
                            return out;
                        }
                        let Some(&(_, _, y)) = self.parked_lru.first() else {
                            break;
                        };
                        dropped.push(self.drop_parked(y, host));
                    }
                    // Locked parked entries hold the room: what was dropped trying is still
                    // reported, one value each.
                    out.extend(
                        dropped
                            .into_iter()
                            .map(|key| Evicted::Dropped { key, parked: true }),
                    );
                }
            }
        }
        self.drop_resident(x, pool, host, &mut out);
        out
    }

    /// Evict until `pages` pages and `slots` state slots are allocatable (or nothing more can
    /// be evicted). The device pages freed are free in the pool at once: land every returned
    /// plan before allocating again.
    pub fn make_room(
        &mut self,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        pages: u64,
        slots: u64,
        park: bool,
    ) -> Vec<Evicted> {
        let mut out = Vec::new();
        while pool.available(Kind::Pages) < pages
            || (slots > 0 && pool.available(Kind::Slots) < slots)
        {
            let step = self.evict_one(pool, host.as_deref_mut(), park);
            if step.is_empty() {
                break;
            }
            out.extend(step);
        }
        out
    }

    /// Bring every parked node from the root to `node` back to the device. All or nothing:
    /// `PoolFull` (changing nothing) when the device lacks room; make room and call again.
    pub fn wake(
        &mut self,
        pool: &mut Pool,
        host: Option<&mut Host>,
        node: NodeId,
    ) -> Result<WakePlan> {
        let mut i = self.resolve(node)?;
        let mut chain = Vec::new();
        while i != ROOT {
            if self.nodes[i as usize].tier == Tier::Parked {
                chain.push(i);
            }
            i = self.nodes[i as usize].parent;
        }
        chain.reverse();
        let mut plan = WakePlan::default();
        if chain.is_empty() {
            return Ok(plan);
        }
        let host = host.ok_or(KernError::NoHostTier)?;
        let np: usize = chain
            .iter()
            .map(|&j| self.nodes[j as usize].pages.len())
            .sum();
        let ns = chain
            .iter()
            .filter(|&&j| self.nodes[j as usize].snapshot.is_some())
            .count();
        let dev_pages = pool.alloc(Kind::Pages, np)?;
        let dev_slots = match pool.alloc(Kind::Slots, ns) {
            Ok(s) => s,
            Err(e) => {
                pool.free(Kind::Pages, &dev_pages)?;
                return Err(e);
            }
        };
        let (mut pi, mut si) = (0, 0);
        for j in chain {
            let n = &self.nodes[j as usize];
            let k = n.pages.len();
            let dev: Vec<u32> = dev_pages[pi..pi + k].to_vec();
            pi += k;
            plan.pages.extend(
                n.pages
                    .iter()
                    .zip(&dev)
                    .map(|(&h, &d)| (HostPageId(h), PageId(d))),
            );
            let old_pages = n.pages.clone();
            let old_state: Vec<u32> = n.snapshot.into_iter().collect();
            let new_state = n.snapshot.map(|h| {
                let d = dev_slots[si];
                si += 1;
                plan.states.push((HostSlotId(h), SlotId(d)));
                d
            });
            let freed = host.free(&old_pages, &old_state);
            debug_assert!(freed.is_ok(), "{freed:?}");
            for &p in &dev {
                self.owned_pages.set(p, true);
            }
            if let Some(s) = new_state {
                self.owned_slots.set(s, true);
            }
            let parent = self.nodes[j as usize].parent;
            self.update(j, |n| {
                n.pages = dev;
                n.snapshot = new_state;
                n.tier = Tier::Resident;
            });
            self.update(parent, |p| p.num_resident_children += 1);
            self.stats.num_woken += 1;
            plan.woken.push(self.key(j));
        }
        Ok(plan)
    }

    /// Recount the whole tree and compare with every counter, set and the pools' books.
    pub fn check_integrity(&self, pool: &Pool, host: Option<&Host>) -> Result<()> {
        let bad = |why: String| Err(KernError::Corrupt(why));
        let pt = self.page_tokens;
        let mut seen_pages = HashSet::new();
        let mut seen_host = HashSet::new();
        let (mut rp, mut pp, mut rs, mut ps, mut live) = (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut child_locks = vec![0u64; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live || i as u32 == ROOT {
                continue;
            }
            child_locks[n.parent as usize] += u64::from(n.lock);
        }
        for (i, n) in self.nodes.iter().enumerate() {
            let i = i as u32;
            if !n.live {
                continue;
            }
            let kids: Vec<u32> = n.children.values().flatten().copied().collect();
            if kids.len() as u32 != n.num_children {
                return bad(format!(
                    "node {i}: num_children {} != {}",
                    n.num_children,
                    kids.len()
                ));
            }
            let resident_kids = kids
                .iter()
                .filter(|&&c| self.nodes[c as usize].tier == Tier::Resident)
                .count();
            if resident_kids as u32 != n.num_resident_children {
                return bad(format!("node {i}: num_resident_children wrong"));
            }
            for (&first, bucket) in &n.children {
                for &c in bucket {
                    let cn = &self.nodes[c as usize];
                    if !cn.live || cn.parent != i || cn.tokens.first() != Some(&first) {
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
                }
            }
            if i != ROOT && u64::from(n.lock) < child_locks[i as usize] {
                return bad(format!(
                    "node {i}: lock {} below its children's {}",
                    n.lock, child_locks[i as usize]
                ));
            }
            if i == ROOT {
                if !n.tokens.is_empty() || n.snapshot.is_some() || n.lru.is_some() {
                    return bad("root holds tokens, a snapshot or an LRU entry".into());
                }
                continue;
            }
            live += 1;
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
            if !(n.tokens.len() as u32).is_multiple_of(pt) && n.num_children > 0 {
                return bad(format!("node {i}: ends mid-page but has children"));
            }
            let want = match n.tier {
                Tier::Resident if n.lock == 0 && n.num_resident_children == 0 => {
                    Some(Lru::Resident)
                }
                Tier::Parked if n.lock == 0 && n.num_children == 0 => Some(Lru::Parked),
                _ => None,
            };
            let have = n.lru.map(|(s, key)| {
                let present = match s {
                    Lru::Resident => self.resident_lru.contains(&key),
                    Lru::Parked => self.parked_lru.contains(&key),
                };
                (s, key == (n.stamp, Reverse(n.end()), i) && present)
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
                            || !seen_pages.insert(p)
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
                        rs += 1;
                    }
                    rp += n.pages.len() as u64;
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
                        ps += 1;
                    }
                    pp += n.pages.len() as u64;
                }
            }
        }
        let lru_entries = self
            .nodes
            .iter()
            .filter(|n| n.live && n.lru.is_some())
            .count();
        if lru_entries != self.resident_lru.len() + self.parked_lru.len() {
            return bad("LRU sets hold stale entries".into());
        }
        if self.owned_pages.count() != rp || self.owned_slots.count() != rs {
            return bad("owned page or slot bits disagree with the nodes".into());
        }
        if let Some(host) = host {
            let hs = host.stats();
            if hs.pages_used != pp || hs.slots_used != ps {
                return bad(format!(
                    "host holds {} pages / {} states, the tree {pp} / {ps}",
                    hs.pages_used, hs.slots_used
                ));
            }
        }
        if live != self.stats().num_nodes {
            return bad("node count disagrees with the live nodes".into());
        }
        Ok(())
    }

    /// The event counters, and the structure recounted (one pass over the nodes).
    pub fn stats(&self) -> PrefixStats {
        let mut s = self.stats;
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live || i as u32 == ROOT {
                continue;
            }
            s.num_nodes += 1;
            match n.tier {
                Tier::Resident => {
                    s.resident_pages += n.pages.len() as u64;
                    s.resident_states += u64::from(n.snapshot.is_some());
                }
                Tier::Parked => {
                    s.parked_pages += n.pages.len() as u64;
                    s.parked_states += u64::from(n.snapshot.is_some());
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PT: u32 = 4;

    fn setup(device_pages: u64, host_pages: u64) -> (Prefix, Pool, Option<Host>) {
        let pool = Pool::new(device_pages * 64, 64, 128, 2).unwrap();
        let host = (host_pages > 0).then(|| Host::new(host_pages * 64, 64, 128).unwrap());
        (Prefix::new(PT).unwrap(), pool, host)
    }

    fn put(t: &mut Prefix, pool: &mut Pool, tokens: &[u32]) -> Inserted {
        let m = t.match_prefix(tokens);
        let shared = (m.resident_len / PT) as usize;
        let need = tokens.len().div_ceil(PT as usize) - shared;
        let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
        pages.extend(pool.alloc(Kind::Pages, need).unwrap());
        let ins = t.insert(pool, tokens, &pages, None).unwrap();
        let dups: Vec<u32> = ins.duplicates.iter().map(|p| p.0).collect();
        pool.free(Kind::Pages, &dups).unwrap();
        ins
    }

    #[test]
    fn divergence_mid_page_branches_at_the_page_boundary() {
        let (mut t, mut pool, host) = setup(64, 0);
        put(&mut t, &mut pool, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        put(&mut t, &mut pool, &[1, 2, 3, 4, 5, 6, 0, 0]);
        t.check_integrity(&pool, host.as_ref()).unwrap();
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 5, 6, 7]).hit_len, 7);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 5, 6, 0, 0, 1]).hit_len, 8);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 5, 9]).hit_len, 5);
        // Shared first page, two second pages, a tail page: 4 pages held.
        assert_eq!(t.stats().resident_pages, 4);
        assert_eq!(pool.stats().pages_used, 4);
    }

    #[test]
    fn snapshot_inside_a_full_page_gets_its_own_partial_leaf() {
        let (mut t, mut pool, host) = setup(64, 0);
        put(&mut t, &mut pool, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let slot = pool.alloc(Kind::Slots, 1).unwrap()[0];
        let page = pool.alloc(Kind::Pages, 1).unwrap()[0];
        let m = t.match_prefix(&[1, 2, 3, 4, 5, 6]);
        let pages = [m.pages[0].0, page];
        let ins = t
            .insert(&pool, &[1, 2, 3, 4, 5, 6], &pages, Some(SlotId(slot)))
            .unwrap();
        assert_eq!(ins.state_duplicate, None);
        assert!(ins.duplicates.is_empty());
        let m = t.match_prefix(&[1, 2, 3, 4, 5, 6, 9]);
        assert_eq!(
            m.state,
            Some(StateHit {
                len: 6,
                slot: Some(SlotId(slot))
            })
        );
        t.check_integrity(&pool, host.as_ref()).unwrap();
    }

    #[test]
    fn coldest_goes_first_and_a_path_goes_leaf_first() {
        let (mut t, mut pool, mut host) = setup(64, 0);
        put(&mut t, &mut pool, &[1, 1, 1, 1, 2, 2, 2, 2]);
        put(&mut t, &mut pool, &[1, 1, 1, 1, 3, 3, 3, 3]);
        put(&mut t, &mut pool, &[5, 5, 5, 5]);
        t.match_prefix(&[1, 1, 1, 1, 2]); // [1..][2..] is now the warmest
        let order: Vec<Vec<u32>> = (0..4)
            .flat_map(|_| t.evict_one(&mut pool, host.as_mut(), false))
            .map(|e| match e {
                Evicted::Dropped { key, .. } => key.tokens,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            vec![
                vec![1, 1, 1, 1, 3, 3, 3, 3],
                vec![5, 5, 5, 5],
                vec![1, 1, 1, 1, 2, 2, 2, 2],
                vec![1, 1, 1, 1]
            ]
        );
        assert!(t.evict_one(&mut pool, host.as_mut(), false).is_empty());
        assert_eq!(pool.stats().pages_used, 0);
    }

    #[test]
    fn parking_drops_the_coldest_parked_to_make_room() {
        let (mut t, mut pool, mut host) = setup(64, 2);
        put(&mut t, &mut pool, &[1, 1, 1, 1, 1, 1, 1, 1]);
        put(&mut t, &mut pool, &[2, 2, 2, 2, 2, 2, 2, 2]);
        let first = t.evict_one(&mut pool, host.as_mut(), true);
        assert!(matches!(&first[..], [Evicted::Parked { dropped, .. }] if dropped.is_empty()));
        let second = t.evict_one(&mut pool, host.as_mut(), true);
        match &second[..] {
            [Evicted::Parked { key, dropped, .. }] => {
                assert_eq!(key.tokens, vec![2; 8]);
                assert_eq!(
                    dropped.iter().map(|k| k.tokens.clone()).collect::<Vec<_>>(),
                    vec![vec![1; 8]]
                );
            }
            other => panic!("{other:?}"),
        }
        t.check_integrity(&pool, host.as_ref()).unwrap();
        let s = t.stats();
        assert_eq!(
            (s.num_parked, s.num_dropped_parked, s.parked_pages),
            (2, 1, 2)
        );
    }

    #[test]
    fn locks_protect_and_bad_unlocks_change_nothing() {
        let (mut t, mut pool, mut host) = setup(64, 0);
        let ins = put(&mut t, &mut pool, &[1, 2, 3, 4, 5]);
        let node = ins.node.unwrap();
        t.lock(node).unwrap();
        assert!(t.evict_one(&mut pool, host.as_mut(), false).is_empty());
        t.unlock(node).unwrap();
        assert_eq!(
            t.unlock(node),
            Err(KernError::NotLocked {
                handle: node.to_u64()
            })
        );
        let stale = NodeId {
            index: node.index,
            generation: node.generation + 1,
        };
        assert!(matches!(t.lock(stale), Err(KernError::UnknownNode { .. })));
        t.check_integrity(&pool, host.as_ref()).unwrap();
        assert_eq!(t.evict_one(&mut pool, host.as_mut(), false).len(), 1);
        assert!(matches!(t.lock(node), Err(KernError::UnknownNode { .. })));
    }

    #[test]
    fn a_lock_survives_a_split_of_its_node() {
        let (mut t, mut pool, mut host) = setup(64, 0);
        let ins = put(&mut t, &mut pool, &[1, 2, 3, 4, 5, 6, 7, 8]);
        t.lock(ins.node.unwrap()).unwrap();
        put(&mut t, &mut pool, &[1, 2, 3, 4, 9]); // splits the locked node after its first page
        assert_eq!(t.evict_one(&mut pool, host.as_mut(), false).len(), 1); // only the new leaf
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8]).hit_len, 8);
        t.unlock(ins.node.unwrap()).unwrap();
        t.check_integrity(&pool, host.as_ref()).unwrap();
    }

    #[test]
    fn insert_errors_change_nothing() {
        let (mut t, mut pool, host) = setup(64, 0);
        put(&mut t, &mut pool, &[1, 2, 3, 4, 5, 6]);
        let before = (t.stats(), pool.stats());
        let mine = pool.alloc(Kind::Pages, 2).unwrap();
        let m = t.match_prefix(&[1, 2, 3, 4, 5, 6]);
        let tree: Vec<u32> = m.pages.iter().map(|p| p.0).collect();
        let cases: Vec<(&[u32], Vec<u32>)> = vec![
            (&[1, 2, 3, 4, 5], vec![mine[0]]),                // too few pages
            (&[1, 2, 3, 4, 5, 6, 7], vec![tree[0], tree[1]]), // shared tail page written into
            (&[9, 9, 9, 9, 9], vec![tree[0], mine[0]]),       // the tree's page elsewhere
            (&[1, 2, 3], vec![mine[0] + 1000]),               // not allocated
            (&[1, 2, 3, 4, 5], vec![mine[0], mine[0]]),       // repeated
        ];
        for (tokens, pages) in cases {
            assert!(
                t.insert(&pool, tokens, &pages, None).is_err(),
                "{tokens:?} {pages:?}"
            );
            t.check_integrity(&pool, host.as_ref()).unwrap();
        }
        pool.free(Kind::Pages, &mine).unwrap();
        let after = pool.stats();
        assert_eq!(
            (before.1.pages_used, before.1.pages_free),
            (after.pages_used, after.pages_free)
        );
        assert_eq!(before.0.num_nodes, t.stats().num_nodes);
    }
}
