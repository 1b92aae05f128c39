//! Insert: a request's tokens and pages (and optionally the state snapshot taken at exactly its
//! length) go to the tree, which keeps what it lacks and frees the rest.
//!
//! The walk is the match's walk, so the tree holds afterwards exactly what a later match reads:
//! it descends through the nodes the key matches whole and splits the one it matches in part
//! at the last page boundary read; what follows goes in one new leaf. Every check runs on that
//! read-only walk before anything changes. The repeat check marks the caller's own pages in a
//! scratch bitset; pages the tree already holds at their place are compared with the tree's,
//! not marked.

use super::node::Node;
use super::walk::Walk;
use super::{books_agree, Prefix, Tier, ROOT};
use crate::bits::Bits;
use crate::error::{KernError, Result};
use crate::host::Host;
use crate::ids::SlotId;
use crate::pool::{Kind, Pool};
use crate::prefix::Inserted;

impl Prefix {
    /// Give `tokens`, their `pages` (one per `page_tokens` tokens, the last perhaps partial) and
    /// optionally the state `snapshot` taken at exactly `tokens.len()` to the tree. The tree
    /// takes the pages it lacks, also where it holds the tokens only in host memory (those
    /// entries become resident and count as woken, unless one holds a state snapshot the
    /// caller does not give again), and frees the caller's duplicates of pages it holds on the
    /// device; the snapshot is taken or freed. So every page and the slot passed are the
    /// tree's or free afterwards. Splits nodes; refreshes the key's path. Errors change
    /// nothing.
    pub fn insert(
        &mut self,
        pool: &mut Pool,
        host: Option<&mut Host>,
        tokens: &[u32],
        pages: &[u32],
        snapshot: Option<SlotId>,
    ) -> Result<Inserted> {
        self.insert_and_free(pool, host, tokens, pages, snapshot, &[])
    }

    /// `insert`, then free `free`: more of the caller's own pages (a request's pages past the
    /// key). They are checked with the key's pages before anything changes: allocated, not the
    /// tree's, and named once across `pages` and `free`, or an error naming the page.
    pub fn insert_and_free(
        &mut self,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        tokens: &[u32],
        pages: &[u32],
        snapshot: Option<SlotId>,
        free: &[u32],
    ) -> Result<Inserted> {
        let pt = self.page_tokens as usize;
        let total = tokens.len();
        if total > u32::MAX as usize {
            return Err(KernError::TooLong { tokens: total });
        }
        if pages.len() != total.div_ceil(pt) {
            return Err(KernError::LengthMismatch {
                tokens: total,
                pages: pages.len(),
                page_tokens: self.page_tokens,
            });
        }
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
        let w = self.walk_longest(tokens);
        self.check_pages(pool, &w, total, pages, free)?;

        let mut dups: Vec<u32> = Vec::new();
        let mut woken = 0u32;
        let mut snapshot = snapshot.map(|s| s.0);
        let (mut node, mut pos) = (ROOT, 0usize);
        for (k, &c) in w.path.iter().enumerate() {
            let clen = self.nodes[c as usize].tokens.len();
            let last = k + 1 == w.path.len();
            let cover = if last { w.cover } else { clen };
            if cover < clen && cover.is_multiple_of(pt) {
                // Matched in part: the head becomes its own node; the rest branches below it.
                let top = self.split(c, cover);
                self.take(
                    top,
                    pages,
                    None,
                    false,
                    host.as_deref_mut(),
                    &mut dups,
                    &mut woken,
                );
                node = top;
                pos += cover;
                break;
            }
            if cover < clen {
                // The key ends inside `c`, mid-page: the tree holds every token of it.
                let s = cover / pt * pt;
                let last = pages[pages.len() - 1];
                let parked = self.nodes[c as usize].tier == Tier::Parked;
                let tree_last = !parked && self.nodes[c as usize].pages.get(s / pt) == Some(&last);
                if (snapshot.is_some() || parked) && !tree_last {
                    // A snapshot needs a node that ends where the key does: a leaf of the key's
                    // last partial page, in the caller's copy, after the last page boundary.
                    // Inside a parked entry the same shape leaves the key resident: the head's
                    // whole pages and that leaf are the caller's pages, the rest stays parked.
                    if s > 0 {
                        let top = self.split(c, s);
                        self.take(
                            top,
                            pages,
                            None,
                            false,
                            host.as_deref_mut(),
                            &mut dups,
                            &mut woken,
                        );
                        node = top;
                    }
                    pos += s;
                    break;
                }
                let at = cover.div_ceil(pt) * pt;
                let head = if at < clen { self.split(c, at) } else { c };
                self.take(
                    head,
                    pages,
                    None,
                    false,
                    host.as_deref_mut(),
                    &mut dups,
                    &mut woken,
                );
                node = head;
                pos = total;
                break;
            }
            if last && pos + clen < total && !clen.is_multiple_of(pt) {
                // The key runs on past a node that ends mid-page: that page stays the node's,
                // and the key branches after the node's last whole page, in the caller's copy.
                let s = clen / pt * pt;
                if s > 0 {
                    let top = self.split(c, s);
                    self.take(
                        top,
                        pages,
                        None,
                        false,
                        host.as_deref_mut(),
                        &mut dups,
                        &mut woken,
                    );
                    node = top;
                    pos += s;
                }
                break;
            }
            let here = if pos + clen == total {
                snapshot.take()
            } else {
                None
            };
            snapshot = snapshot.or(self.take(
                c,
                pages,
                here,
                true,
                host.as_deref_mut(),
                &mut dups,
                &mut woken,
            ));
            node = c;
            pos += clen;
        }
        if pos < total {
            node = self.new_leaf(node, &tokens[pos..], &pages[pos / pt..], snapshot.take());
        } else if let Some(s) = snapshot.take() {
            let n = &self.nodes[node as usize];
            let ends_here = n.end() as usize == total;
            if node != ROOT && ends_here && n.tier == Tier::Resident && n.snapshot.is_none() {
                self.nodes[node as usize].snapshot = Some(s);
                self.owned_slots.set(s);
                self.stats.resident_states += 1;
            } else {
                pool.free(Kind::Slots, &[s]).map_err(|e| {
                    KernError::Corrupt(format!("freeing a checked state slot: {e}"))
                })?;
            }
        }
        pool.free(Kind::Pages, &dups)
            .map_err(|e| KernError::Corrupt(format!("freeing checked duplicates: {e}")))?;
        pool.free(Kind::Pages, free)
            .map_err(|e| KernError::Corrupt(format!("freeing checked pages: {e}")))?;
        if node != ROOT {
            self.touch_up(node);
        }
        Ok(Inserted {
            held: w.hit as u32,
            woken,
            node: (node != ROOT).then(|| self.handle(node)),
        })
    }

    /// Every page must be the tree's own page at its place on the walk (and the tree must hold
    /// every token the caller has in it), or the caller's: allocated, not the tree's, named
    /// once. Every page of `free` must be the caller's too, named once across both lists.
    fn check_pages(
        &mut self,
        pool: &Pool,
        w: &Walk,
        total: usize,
        pages: &[u32],
        free: &[u32],
    ) -> Result<()> {
        let pt = self.page_tokens as usize;
        let mut own = Own {
            pool,
            owned: &self.owned_pages,
            seen: &mut self.scratch,
            marked: &mut self.marked,
        };
        let mut result = Ok(());
        let mut g = 0; // pages checked
        for &i in &w.path {
            let n = &self.nodes[i as usize];
            let base = n.start as usize / pt;
            let hi = (base + n.pages.len()).min(pages.len());
            debug_assert_eq!(base, g);
            let tree: &[u32] = if n.tier == Tier::Resident {
                &n.pages
            } else {
                &[]
            };
            // A hit's pages come back whole: compare the run at once, page by page only if
            // it differs somewhere.
            let run = hi - base;
            let same = tree.len() >= run && pages[base..hi] == tree[..run];
            while g < hi {
                let p = pages[g];
                if same || tree.get(g - base) == Some(&p) {
                    if w.hit < total.min((g + 1) * pt) {
                        result = Err(KernError::SharedPageExtended { page: p, index: g });
                        break;
                    }
                    if same {
                        // The condition only grows with g: the last page decides the run.
                        let last = hi - 1;
                        if w.hit >= total.min((last + 1) * pt) {
                            g = hi;
                            break;
                        }
                    }
                } else {
                    result = own.check(p);
                    if result.is_err() {
                        break;
                    }
                }
                g += 1;
            }
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            result = own.check_run(&pages[g..]);
        }
        if result.is_ok() {
            result = own.check_run(free);
        }
        // Clear the marks: only the caller's own pages were marked, in the words listed.
        for &w in own.marked.iter() {
            own.seen.zero_word(w);
        }
        own.marked.clear();
        result
    }

    /// The caller's pages for node `i`'s range, and the snapshot the caller took at its end if
    /// any. A resident node keeps its pages and the caller's different ones are duplicates. A
    /// parked node takes the caller's pages and becomes resident (host copies freed), unless it
    /// holds a snapshot the caller does not give again: then it stays parked and the caller's
    /// pages are duplicates. Returns the snapshot if the node did not take it.
    #[allow(clippy::too_many_arguments)]
    fn take(
        &mut self,
        i: u32,
        pages: &[u32],
        snapshot: Option<u32>,
        counts_as_woken: bool,
        host: Option<&mut Host>,
        dups: &mut Vec<u32>,
        woken: &mut u32,
    ) -> Option<u32> {
        let pt = self.page_tokens as usize;
        let n = &self.nodes[i as usize];
        let base = n.start as usize / pt;
        let mine = &pages[base..base + n.pages.len()];
        if n.tier == Tier::Resident {
            if *mine == n.pages[..] {
                // The caller passed the tree's own pages back (a hit): nothing to free.
                return snapshot;
            }
            dups.extend(
                mine.iter()
                    .zip(&n.pages)
                    .filter(|(a, b)| a != b)
                    .map(|(a, _)| *a),
            );
            return snapshot;
        }
        let keeps_state = n.snapshot.is_some() && snapshot.is_none();
        let Some(host) = host.filter(|_| !keeps_state) else {
            dups.extend_from_slice(mine);
            return snapshot;
        };
        let old_states: Vec<u32> = n.snapshot.into_iter().collect();
        books_agree(host.free(&n.pages, &old_states));
        self.owned_pages.put_all(mine, true);
        if let Some(s) = snapshot {
            self.owned_slots.set(s);
        }
        let k = mine.len() as u64;
        let st = &mut self.stats;
        st.parked_pages -= k;
        st.resident_pages += k;
        st.parked_states -= old_states.len() as u64;
        st.resident_states += u64::from(snapshot.is_some());
        if counts_as_woken {
            st.num_woken += 1;
            *woken += 1;
        }
        let parent = self.nodes[i as usize].parent;
        let mine = mine.to_vec();
        self.update(i, |n| {
            n.pages = mine;
            n.snapshot = snapshot;
            n.tier = Tier::Resident;
        });
        self.update(parent, |p| p.num_resident_children += 1);
        None
    }

    fn new_leaf(
        &mut self,
        parent: u32,
        tokens: &[u32],
        pages: &[u32],
        snapshot: Option<u32>,
    ) -> u32 {
        let start = self.nodes[parent as usize].end();
        self.owned_pages.put_all(pages, true);
        if let Some(s) = snapshot {
            self.owned_slots.set(s);
        }
        self.stats.num_nodes += 1;
        self.stats.resident_pages += pages.len() as u64;
        self.stats.resident_states += u64::from(snapshot.is_some());
        let leaf = self.alloc_node(Node::new(
            parent,
            start,
            tokens.to_vec(),
            pages.to_vec(),
            snapshot,
            Tier::Resident,
        ));
        self.add_child(parent, leaf);
        self.relink(leaf);
        leaf
    }
}

/// The check of a page the caller says is its own, over the books it reads and marks.
struct Own<'a> {
    pool: &'a Pool,
    owned: &'a Bits,
    seen: &'a mut Bits,
    marked: &'a mut Vec<u32>,
}

impl Own<'_> {
    /// Allocated, not the tree's, not named before in this call.
    #[inline]
    fn check(&mut self, p: u32) -> Result<()> {
        if !self.pool.is_allocated(Kind::Pages, p) {
            Err(KernError::NotAllocated {
                what: "page",
                id: p,
            })
        } else if self.owned.get(p) {
            Err(KernError::OwnedByCache {
                what: "page",
                id: p,
            })
        } else if self.seen.set(p) {
            Err(KernError::Repeated {
                what: "page",
                id: p,
            })
        } else {
            self.marked.push(p / 64);
            Ok(())
        }
    }

    /// `check` of each id in turn, a word of ids at a time: fresh allocations come in runs, so
    /// a run in one word is tested against the three books with three word reads. A word that
    /// fails any test is checked id by id, which names the first bad one.
    fn check_run(&mut self, ids: &[u32]) -> Result<()> {
        let mut i = 0;
        while i < ids.len() {
            let w = ids[i] / 64;
            let (mut mask, mut j, mut repeat) = (0u64, i, false);
            while j < ids.len() && ids[j] / 64 == w {
                let b = 1u64 << (ids[j] % 64);
                repeat |= mask & b != 0;
                mask |= b;
                j += 1;
            }
            let ok = !repeat
                && self.pool.allocated_word(Kind::Pages, w) & mask == mask
                && self.owned.word(w) & mask == 0
                && self.seen.word(w) & mask == 0;
            if ok {
                self.seen.or_word(w, mask);
                self.marked.push(w);
            } else {
                for &p in &ids[i..j] {
                    self.check(p)?;
                }
            }
            i = j;
        }
        Ok(())
    }
}
