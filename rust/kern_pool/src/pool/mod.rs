//! A byte budget split into chunks, each chunk backing one object class (KV pages or
//! recurrent-state slots) or free.
//!
//! Design notes:
//! - Addresses are implied by ids: page `p` sits at byte `p * page_bytes` (a chunk is a whole
//!   number of pages), slot `s` at `s * slot_stride`, where the stride divides the chunk and is
//!   at least `slot_bytes` (see `Layout`). So a class changing chunks moves no bytes and needs no
//!   plan: the runner views one arena as a page array and as a slot array, both linear in the
//!   id, and the pool guarantees the views never overlap in use.
//! - The chunk size scales with the budget (about `TARGET_CHUNKS` chunks at any budget): a fixed
//!   small chunk gives 100k+ chunks on a large GPU and a start-up that maps for a minute.
//! - The books are bitsets: one bit per position (allocated or not) and, per class, one bit per
//!   chunk for "partly used" and "empty", plus counters. Allocating `n` objects and freeing
//!   them are O(n) bit operations with no sorting and no ordered sets; `available` and `fits`
//!   are O(1). A free checks every id by clearing its bit and puts the cleared bits back if a
//!   later id fails, so a repeated or unknown id changes nothing and costs no extra pass.
//! - A class fills its partly used chunks first (pages from the low end, slots from the high
//!   end), then its own empty chunks, then claims one. Keeping empty chunks empty is what lets
//!   the other class take them, and it makes `fits(pages, slots)` exact: the formula there
//!   assumes this order, and with it an allocation of slots then pages (or pages then slots)
//!   succeeds exactly when `fits` said so.
//! - Tried and dropped: objects spanning several chunks. They need contiguous runs, and the
//!   fragmentation that brings is worse than a chunk at least as large as the largest object.
//!   Also dropped: a `BTreeSet` of free positions (what the pool had): every free inserted
//!   each id into a tree, ~76 us for a 4,700-page request with scattered ids.

mod alloc;
mod check;
mod class;
mod layout;
mod room;

use crate::bits::Bits;
use crate::error::{KernError, Result};
use class::Class;
use layout::Layout;
pub use room::Shadow;

/// About this many chunks at any budget (fewer when one object is larger than budget / this).
/// 1024 because a 1 GiB budget of 7B-class pages (16 tokens, 2 MiB) holds only 512 objects:
/// keeping 140 GiB within 2x of that count needs a target near 1024. The price is coarser
/// growth steps at large budgets (140 MiB chunks at 140 GiB).
pub const TARGET_CHUNKS: u64 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Pages = 0,
    Slots = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Free,
    Owned(Kind),
}

/// Counters of one pool, as numbers a scheduler or a metrics endpoint reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub chunk_bytes: u64,
    pub num_chunks: u32,
    pub free_chunks: u32,
    pub page_capacity: u64,
    pub pages_used: u64,
    /// Pages allocatable now without evicting anything (free chunks included).
    pub pages_free: u64,
    pub slot_capacity: u64,
    pub slots_used: u64,
    pub slots_free: u64,
}

#[derive(Clone, Debug)]
pub struct Pool {
    chunk_bytes: u64,
    num_chunks: u32,
    owner: Vec<Owner>,
    free_chunks: Bits,
    num_free_chunks: u32,
    pages: Class,
    slots: Option<Class>,
}

impl Pool {
    /// A pool over `budget_bytes` for pages of `page_bytes` and, when `slot_bytes > 0`, state
    /// slots of `slot_bytes`, reserving room for `min_slots` slots up front.
    pub fn new(
        budget_bytes: u64,
        page_bytes: u64,
        slot_bytes: u64,
        min_slots: u32,
    ) -> Result<Self> {
        if page_bytes == 0 {
            return Err(KernError::ZeroSize { what: "page_bytes" });
        }
        let largest = page_bytes.max(slot_bytes);
        if budget_bytes < largest {
            return Err(KernError::BudgetTooSmall {
                what: "pool",
                budget_bytes,
                object_bytes: largest,
            });
        }
        let base = budget_bytes.div_ceil(TARGET_CHUNKS).max(largest);
        let layout = Layout::new(base, page_bytes, slot_bytes);
        let chunk_bytes = layout.chunk_bytes;
        let num_chunks = budget_bytes / chunk_bytes;
        if num_chunks == 0 {
            // Rounding up to whole pages (and slot strides) overshot a budget that holds the
            // largest object.
            return Err(KernError::BudgetTooSmall {
                what: "pool",
                budget_bytes,
                object_bytes: chunk_bytes,
            });
        }
        let num_chunks = num_chunks.min(u64::from(u32::MAX));
        let pages_per_chunk = u64::from(layout.pages_per_chunk);
        let slots_per_chunk = u64::from(layout.slots_per_chunk);
        if pages_per_chunk.max(slots_per_chunk) * num_chunks > u64::from(u32::MAX) {
            return Err(KernError::BudgetTooSmall {
                what: "pool (more than 2^32 pages: use larger pages)",
                budget_bytes,
                object_bytes: page_bytes,
            });
        }
        let num_chunks = num_chunks as u32;
        let pages = Class::new(Kind::Pages, page_bytes, pages_per_chunk as u32, num_chunks);
        let slots = (slot_bytes > 0).then(|| {
            Class::new(
                Kind::Slots,
                layout.slot_stride,
                layout.slots_per_chunk,
                num_chunks,
            )
        });
        let mut pool = Pool {
            chunk_bytes,
            num_chunks,
            owner: vec![Owner::Free; num_chunks as usize],
            free_chunks: Bits::full(num_chunks),
            num_free_chunks: num_chunks,
            pages,
            slots,
        };
        if let Some(slots) = &pool.slots {
            let want = u64::from(min_slots).div_ceil(u64::from(slots.per_chunk));
            if want > u64::from(num_chunks) {
                return Err(KernError::BudgetTooSmall {
                    what: "pool (for the initial state slots)",
                    budget_bytes,
                    object_bytes: slot_bytes * u64::from(min_slots),
                });
            }
            for _ in 0..want {
                pool.claim_chunk(Kind::Slots);
            }
            if let Some(slots) = pool.slots.as_mut() {
                slots.floor_chunks = want as u32;
            }
        }
        Ok(pool)
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    pub fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    pub fn pages_per_chunk(&self) -> u32 {
        self.pages.per_chunk
    }

    pub fn slots_per_chunk(&self) -> u32 {
        self.slots.as_ref().map_or(0, |s| s.per_chunk)
    }

    /// Page ids run over `0..num_pages`.
    pub fn num_pages(&self) -> u32 {
        self.pages.allocated.len()
    }

    /// Slot ids run over `0..num_slots` (0 without slots).
    pub fn num_slots(&self) -> u32 {
        self.slots.as_ref().map_or(0, |s| s.allocated.len())
    }

    /// Bytes from slot `s` to slot `s + 1` (0 without slots): slot `s` sits at `s * stride`.
    pub fn slot_stride(&self) -> u64 {
        self.slots.as_ref().map_or(0, |s| s.object_bytes)
    }

    pub fn has_slots(&self) -> bool {
        self.slots.is_some()
    }

    fn class(&self, kind: Kind) -> Option<&Class> {
        match kind {
            Kind::Pages => Some(&self.pages),
            Kind::Slots => self.slots.as_ref(),
        }
    }

    fn class_mut(&mut self, kind: Kind) -> Option<&mut Class> {
        match kind {
            Kind::Pages => Some(&mut self.pages),
            Kind::Slots => self.slots.as_mut(),
        }
    }

    fn other(kind: Kind) -> Kind {
        match kind {
            Kind::Pages => Kind::Slots,
            Kind::Slots => Kind::Pages,
        }
    }

    pub fn stats(&self) -> PoolStats {
        let per = |c: &Class| u64::from(c.per_chunk) * u64::from(c.owned);
        PoolStats {
            chunk_bytes: self.chunk_bytes,
            num_chunks: self.num_chunks,
            free_chunks: self.num_free_chunks,
            page_capacity: per(&self.pages),
            pages_used: self.pages.used,
            pages_free: self.available(Kind::Pages),
            slot_capacity: self.slots.as_ref().map_or(0, per),
            slots_used: self.slots.as_ref().map_or(0, |s| s.used),
            slots_free: self.available(Kind::Slots),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_too_small_is_an_error() {
        assert!(matches!(
            Pool::new(100, 4096, 0, 0),
            Err(KernError::BudgetTooSmall { .. })
        ));
        assert!(matches!(
            Pool::new(1 << 20, 4096, 2 << 20, 2),
            Err(KernError::BudgetTooSmall { .. })
        ));
        assert!(matches!(
            Pool::new(1 << 20, 0, 0, 0),
            Err(KernError::ZeroSize { .. })
        ));
    }
}
