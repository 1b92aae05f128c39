//! Room: what the pool could hand out now, changing nothing. `available` (one class),
//! `fits` (pages and slots together, in either order), `could_ever_fit` (an empty pool), and
//! `Shadow`, the same question asked of the pool with some objects freed in thought.
//!
//! Design note: `fits` is exact only because allocation fills a class's partly used chunks
//! first, then its own empty chunks, then claims one (`alloc.rs`); the formula assumes that
//! order, so a change to either is a change to both.

use std::collections::HashMap;

use super::class::Class;
use super::{Kind, Pool};

/// The counters `fits` reads, for one class.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ClassCounts {
    pub(super) per: u64,
    /// Free positions in owned chunks.
    pub(super) free: u64,
    /// Owned chunks with nothing allocated.
    pub(super) empty: u64,
    pub(super) owned: u64,
    pub(super) floor: u64,
}

/// Could `a` pages and `b` slots be allocated together? Each class first fills the free
/// positions of its partly used chunks, then its own empty chunks; what is left needs whole
/// chunks from the free ones or from the other class's spare empty chunks (those it does not
/// need itself, and for slots only above their floor). A class that needs chunks from outside
/// has no spare empty chunks, so the two demands never compete for the same spares.
fn fits(p: ClassCounts, s: Option<ClassCounts>, free_chunks: u64, a: u64, b: u64) -> bool {
    let s = match s {
        Some(s) => s,
        None if b > 0 => return false,
        None => ClassCounts::default(),
    };
    let chunks = |c: &ClassCounts, want: u64| -> (u64, u64) {
        // (chunks needed beyond its own empties, its spare empty chunks)
        if want == 0 {
            return (0, c.empty);
        }
        let in_partial = c.free - c.empty * c.per;
        let need = want.saturating_sub(in_partial).div_ceil(c.per);
        (need.saturating_sub(c.empty), c.empty.saturating_sub(need))
    };
    let (need_p, spare_p) = chunks(&p, a);
    let (need_s, spare_s) = chunks(&s, b);
    let spare_s = spare_s.min(s.owned.saturating_sub(s.floor));
    need_p.saturating_sub(spare_s) + need_s.saturating_sub(spare_p) <= free_chunks
}

impl Pool {
    /// How many objects of `kind` can be allocated now without evicting anything (the other
    /// class allocating nothing meanwhile).
    pub fn available(&self, kind: Kind) -> u64 {
        let Some(class) = self.class(kind) else {
            return 0;
        };
        let other = self.class(Self::other(kind)).map_or(0, Class::releasable);
        class.free_positions()
            + (u64::from(self.num_free_chunks) + u64::from(other)) * u64::from(class.per_chunk)
    }

    /// Can `pages` pages and `slots` slots be allocated together now, in either order?
    pub fn fits(&self, pages: u64, slots: u64) -> bool {
        fits(
            self.pages.counts(),
            self.slots.as_ref().map(Class::counts),
            u64::from(self.num_free_chunks),
            pages,
            slots,
        )
    }

    /// Could `pages` pages and `slots` slots ever be allocated together, with the pool empty?
    /// The state slots' floor chunks are never the pages': slots hold at least that many.
    pub fn could_ever_fit(&self, pages: u64, slots: u64) -> bool {
        if slots > 0 && self.slots.is_none() {
            return false;
        }
        let chunks = |n: u64, per: u32| n.div_ceil(u64::from(per.max(1)));
        let floor = self.slots.as_ref().map_or(0, |s| u64::from(s.floor_chunks));
        let slot_chunks = chunks(slots, self.slots_per_chunk()).max(floor);
        chunks(pages, self.pages.per_chunk) + slot_chunks <= u64::from(self.num_chunks)
    }

    /// A view of the pool in which some objects are freed, without freeing them: to ask
    /// whether room would fit before changing anything.
    pub fn shadow(&self) -> Shadow<'_> {
        Shadow {
            pool: self,
            freed: [HashMap::new(), HashMap::new()],
            counts: [
                self.pages.counts(),
                self.slots
                    .as_ref()
                    .map_or_else(ClassCounts::default, Class::counts),
            ],
        }
    }
}

/// A pool with some objects freed in thought only (see `Pool::shadow`).
pub struct Shadow<'a> {
    pool: &'a Pool,
    /// Per class: chunk -> positions freed in it.
    freed: [HashMap<u32, u32>; 2],
    counts: [ClassCounts; 2],
}

impl Shadow<'_> {
    /// Free `id` of `kind` in thought (the caller knows it is allocated, and names it once).
    pub fn free(&mut self, kind: Kind, id: u32) {
        let k = kind as usize;
        let Some(class) = self.pool.class(kind) else {
            return;
        };
        let c = class.chunk_of.quotient(id);
        let n = self.freed[k].entry(c).or_insert(0);
        *n += 1;
        self.counts[k].free += 1;
        if *n == class.used_in_chunk[c as usize] {
            self.counts[k].empty += 1;
        }
    }

    pub fn fits(&self, pages: u64, slots: u64) -> bool {
        fits(
            self.counts[0],
            self.pool.slots.as_ref().map(|_| self.counts[1]),
            u64::from(self.pool.num_free_chunks),
            pages,
            slots,
        )
    }
}
