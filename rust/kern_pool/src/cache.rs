//! The one object the scheduler talks to: the device pool, the host tier and the prefix tree,
//! behind the verbs a scheduler needs (match, unlock, insert, make room, wake, alloc/free,
//! stats, check integrity). One call per operation keeps the number of crossings low: match
//! locks what it returns, insert frees the caller's duplicates, make room takes how much room
//! is wanted and says what it did.

use crate::error::{KernError, Result};
use crate::host::Host;
use crate::ids::{NodeId, PageId, SlotId};
use crate::plan::{Room, Woken};
use crate::pool::{Kind, Pool};
use crate::prefix::Prefix;

pub use crate::pool::PoolStats;
pub use crate::prefix::{Inserted, Match, PrefixStats, StateHit};

/// Sizes a cache is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    pub page_tokens: u32,
    pub page_bytes: u64,
    /// Zero for a model without recurrent state.
    pub state_bytes: u64,
    pub device_bytes: u64,
    /// Zero for no host tier.
    pub host_bytes: u64,
    /// State slots reserved at start (a stateful target starts with two and grows).
    pub min_slots: u32,
}

/// Counters of the device pool, the host tier and the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheStats {
    pub device: PoolStats,
    pub host: Option<PoolStats>,
    pub tree: PrefixStats,
}

/// How one arena (the device budget or the host tier) is cut: `num_chunks` chunks of
/// `chunk_bytes`; page `p` at byte `p * page_bytes`, slot `s` at byte `s * slot_stride`. The
/// runner allocates exactly `num_chunks * chunk_bytes` bytes and views them both ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub chunk_bytes: u64,
    pub num_chunks: u32,
    pub page_bytes: u64,
    pub pages_per_chunk: u32,
    pub slot_stride: u64,
    pub slots_per_chunk: u32,
}

impl Geometry {
    /// Page ids run over `[0, num_pages)`.
    pub fn num_pages(&self) -> u64 {
        u64::from(self.num_chunks) * u64::from(self.pages_per_chunk)
    }

    /// Slot ids run over `[0, num_slots)` (0 without slots).
    pub fn num_slots(&self) -> u64 {
        u64::from(self.num_chunks) * u64::from(self.slots_per_chunk)
    }

    /// The arena's size.
    pub fn arena_bytes(&self) -> u64 {
        u64::from(self.num_chunks) * self.chunk_bytes
    }
}

impl From<&Pool> for Geometry {
    fn from(p: &Pool) -> Self {
        Geometry {
            chunk_bytes: p.chunk_bytes(),
            num_chunks: p.num_chunks(),
            page_bytes: p.chunk_bytes() / u64::from(p.pages_per_chunk()),
            pages_per_chunk: p.pages_per_chunk(),
            slot_stride: p.slot_stride(),
            slots_per_chunk: p.slots_per_chunk(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Cache {
    pool: Pool,
    host: Option<Host>,
    prefix: Prefix,
}

impl Cache {
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        let min_slots = if cfg.state_bytes > 0 {
            cfg.min_slots
        } else {
            0
        };
        let pool = Pool::new(cfg.device_bytes, cfg.page_bytes, cfg.state_bytes, min_slots)?;
        let host = if cfg.host_bytes > 0 {
            Some(Host::new(cfg.host_bytes, cfg.page_bytes, cfg.state_bytes)?)
        } else {
            None
        };
        let prefix = Prefix::new(cfg.page_tokens, pool.num_pages(), pool.num_slots())?;
        Ok(Cache { pool, host, prefix })
    }

    pub fn page_tokens(&self) -> u32 {
        self.prefix.page_tokens()
    }

    /// The device arena's geometry.
    pub fn device_geometry(&self) -> Geometry {
        Geometry::from(&self.pool)
    }

    /// The host arena's geometry, if there is a host tier.
    pub fn host_geometry(&self) -> Option<Geometry> {
        self.host.as_ref().map(|h| Geometry::from(h.pool()))
    }

    /// Pages allocatable now without evicting anything.
    pub fn pages_free(&self) -> u64 {
        self.pool.available(Kind::Pages)
    }

    /// Can `pages` pages and `slots` slots be allocated together now, without evicting?
    pub fn fits(&self, pages: u64, slots: u64) -> bool {
        self.pool.fits(pages, slots)
    }

    /// Record each evicted or woken entry's whole token path in its key (for tests).
    pub fn record_paths(&mut self, on: bool) {
        self.prefix.record_paths(on);
    }

    /// Longest cached prefix, locked (release with `unlock(m.node)`); see `Prefix::match_prefix`.
    #[cfg(test)]
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Match {
        self.prefix.match_prefix(tokens)
    }

    /// `match_prefix` with the page list written into `pages` (cleared first), reusing the
    /// caller's buffer.
    pub fn match_prefix_with(&mut self, tokens: &[u32], pages: Vec<PageId>) -> Match {
        self.prefix.match_prefix_with(tokens, pages)
    }

    /// What `match_prefix` would return, changing nothing.
    pub fn peek(&self, tokens: &[u32]) -> Match {
        self.prefix.peek(tokens)
    }

    #[cfg(test)]
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        self.prefix.lock(node)
    }

    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        self.prefix.unlock(node)
    }

    pub fn insert(
        &mut self,
        tokens: &[u32],
        pages: &[u32],
        state: Option<SlotId>,
    ) -> Result<Inserted> {
        self.prefix
            .insert(&mut self.pool, self.host.as_mut(), tokens, pages, state)
    }

    /// The end of a request in one call: `insert(tokens, pages, state)`, release the lock its
    /// match took on `node`, and free `free` (the request's own pages past the key). Every
    /// check (the handle locked, each page of `pages` and `free` the tree's at its place or the
    /// caller's, named once) runs before anything changes.
    pub fn release(
        &mut self,
        tokens: &[u32],
        pages: &[u32],
        state: Option<SlotId>,
        node: Option<NodeId>,
        free: &[u32],
    ) -> Result<Inserted> {
        if let Some(node) = node {
            self.prefix.check_unlock(node)?;
        }
        let r = self.prefix.insert_and_free(
            &mut self.pool,
            self.host.as_mut(),
            tokens,
            pages,
            state,
            free,
        )?;
        if let Some(node) = node {
            // An insert removes no node and keeps every handle's own locks.
            self.prefix
                .unlock(node)
                .map_err(|e| KernError::Corrupt(format!("unlock after a checked insert: {e}")))?;
        }
        Ok(r)
    }

    /// `make_room(n, 0, true)`, then, when `n` pages fit, allocate them into `out` (cleared
    /// first; left empty when they do not fit, as `Room::fits` says): one call where a
    /// scheduler makes room only to allocate. The one way to allocate pages.
    pub fn take_pages_into(&mut self, n: usize, out: &mut Vec<u32>) -> Result<Room> {
        out.clear();
        let room = if self.pool.fits(n as u64, 0) {
            Room {
                fits: true,
                ..Room::default()
            }
        } else {
            self.make_room(n as u64, 0, true)
        };
        if room.fits {
            self.pool.alloc_into(Kind::Pages, n, out)?;
        }
        Ok(room)
    }

    /// Evict until `pages` pages and `slots` slots can be allocated together.
    pub fn make_room(&mut self, pages: u64, slots: u64, park: bool) -> Room {
        self.prefix
            .make_room(&mut self.pool, self.host.as_mut(), pages, slots, park)
    }

    pub fn wake(&mut self, node: NodeId) -> Result<Woken> {
        self.prefix.wake(&mut self.pool, self.host.as_mut(), node)
    }

    /// Is this device page held by the tree?
    #[cfg(test)]
    pub fn owns_page(&self, page: u32) -> bool {
        self.prefix.owns_page(page)
    }

    /// Allocate `n` pages without making room (a scheduler calls `take_pages_into`).
    #[cfg(test)]
    pub fn alloc_pages(&mut self, n: usize) -> Result<Vec<PageId>> {
        Ok(self
            .pool
            .alloc(Kind::Pages, n)?
            .into_iter()
            .map(PageId)
            .collect())
    }

    /// Free the caller's own pages. Pages the tree holds are refused, so a stale page list can
    /// never free what a cached prefix still names.
    pub fn free_pages(&mut self, pages: &[u32]) -> Result<()> {
        if let Some(&p) = pages.iter().find(|&&p| self.prefix.owns_page(p)) {
            return Err(KernError::OwnedByCache {
                what: "page",
                id: p,
            });
        }
        self.pool.free(Kind::Pages, pages)
    }

    pub fn alloc_slot(&mut self) -> Result<SlotId> {
        Ok(SlotId(self.pool.alloc(Kind::Slots, 1)?[0]))
    }

    pub fn free_slot(&mut self, slot: SlotId) -> Result<()> {
        if self.prefix.owns_slot(slot.0) {
            return Err(KernError::OwnedByCache {
                what: "state slot",
                id: slot.0,
            });
        }
        self.pool.free(Kind::Slots, &[slot.0])
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            device: self.pool.stats(),
            host: self.host.as_ref().map(Host::stats),
            tree: self.prefix.stats(),
        }
    }

    pub fn check_integrity(&self) -> Result<()> {
        self.pool.check_integrity()?;
        if let Some(host) = &self.host {
            host.check_integrity()?;
        }
        self.prefix.check_integrity(&self.pool, self.host.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "books disagree")]
    fn books_that_disagree_stop_the_call_in_every_build() {
        let mut c = Cache::new(CacheConfig {
            page_tokens: 2,
            page_bytes: 64,
            state_bytes: 0,
            device_bytes: 64 * 8,
            host_bytes: 0,
            min_slots: 2,
        })
        .unwrap();
        let page = c.alloc_pages(1).unwrap()[0].0;
        c.insert(&[1, 2], &[page], None).unwrap();
        let rest = c.pages_free() as usize;
        c.alloc_pages(rest).unwrap();
        // The pool forgets a page the tree holds; evicting the entry then frees it twice.
        c.pool.free(Kind::Pages, &[page]).unwrap();
        c.make_room(2, 0, false);
    }
}
