//! The host tier: a byte budget of host memory in page-sized and state-sized slots. It is the
//! same chunked mechanics as the device pool (so a host arena of pinned memory is one buffer
//! viewed two ways), under its own id types.

use crate::error::Result;
use crate::ids::{HostPageId, HostSlotId};
use crate::pool::{Kind, Pool, PoolStats};

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
        let chunks = |n: usize, per: u32| {
            if n == 0 {
                0
            } else {
                (n as u64).div_ceil(u64::from(per.max(1)))
            }
        };
        if states > 0 && !self.pool.has_slots() {
            return false;
        }
        chunks(pages, self.pool.pages_per_chunk()) + chunks(states, self.pool.slots_per_chunk())
            <= u64::from(self.pool.num_chunks())
    }

    /// Allocate both or neither.
    pub fn try_alloc(
        &mut self,
        pages: usize,
        states: usize,
    ) -> Option<(Vec<HostPageId>, Vec<HostSlotId>)> {
        let p = self.pool.alloc(Kind::Pages, pages).ok()?;
        let s = if states == 0 {
            Vec::new()
        } else {
            match self.pool.alloc(Kind::Slots, states) {
                Ok(s) => s,
                Err(_) => {
                    self.pool.free(Kind::Pages, &p).ok()?;
                    return None;
                }
            }
        };
        Some((
            p.into_iter().map(HostPageId).collect(),
            s.into_iter().map(HostSlotId).collect(),
        ))
    }

    pub fn free(&mut self, pages: &[u32], states: &[u32]) -> Result<()> {
        self.pool
            .check_owned(Kind::Slots, states, "host state slot")?;
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
