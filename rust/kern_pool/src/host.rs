//! The host tier: a byte budget of host memory in page-sized and state-sized slots. It is the
//! same chunked mechanics as the device pool (so a host arena of pinned memory is one buffer
//! viewed two ways), under its own id types.

use crate::error::Result;
use crate::ids::{HostPageId, HostSlotId};
use crate::pool::{Kind, Pool, PoolStats, Shadow};

#[derive(Clone, Debug)]
pub struct Host {
    pool: Pool,
}

impl Host {
    pub fn new(budget_bytes: u64, page_bytes: u64, state_bytes: u64) -> Result<Self> {
        Ok(Host {
            pool: Pool::new(budget_bytes, page_bytes, state_bytes, 0)?,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Could `pages` pages and `states` states ever fit, with every parked entry dropped?
    pub fn could_ever_fit(&self, pages: usize, states: usize) -> bool {
        self.pool.could_ever_fit(pages as u64, states as u64)
    }

    /// Do `pages` pages and `states` states fit together now?
    pub fn fits(&self, pages: usize, states: usize) -> bool {
        self.pool.fits(pages as u64, states as u64)
    }

    pub fn shadow(&self) -> Shadow<'_> {
        self.pool.shadow()
    }

    /// Allocate both or neither, changing nothing when they do not fit together.
    pub fn try_alloc(
        &mut self,
        pages: usize,
        states: usize,
    ) -> Option<(Vec<HostPageId>, Vec<HostSlotId>)> {
        if !self.fits(pages, states) {
            return None;
        }
        let p = self.pool.alloc(Kind::Pages, pages).ok()?;
        let s = self.pool.alloc(Kind::Slots, states).ok()?;
        Some((
            p.into_iter().map(HostPageId).collect(),
            s.into_iter().map(HostSlotId).collect(),
        ))
    }

    pub fn free(&mut self, pages: &[u32], states: &[u32]) -> Result<()> {
        self.pool.free(Kind::Pages, pages)?;
        self.pool.free(Kind::Slots, states)
    }

    pub fn is_allocated(&self, kind: Kind, id: u32) -> bool {
        self.pool.is_allocated(kind, id)
    }

    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    pub fn check_integrity(&self) -> Result<()> {
        self.pool.check_integrity()
    }
}
