//! kern_pool: the bookkeeping of kern's KV cache. A device pool of chunks backing KV pages and
//! recurrent-state slots, a prefix radix tree over token ids, and a host tier that parked
//! entries move to. No tensors and no I/O: every call that moves data returns a plan
//! (`plan.rs`) and the runner moves the bytes.
//!
//! The public surface is `Cache` (`cache.rs`) with the values its verbs take and return: the
//! plans, the ids, the error. The pool, the host tier and the tree stay inside the crate; the
//! Python face (`py/`, behind the `python` feature) talks to `cache.rs` alone.

pub(crate) mod bits;
pub mod cache;
pub mod error;
pub(crate) mod host;
pub mod ids;
pub mod plan;
pub(crate) mod pool;
pub(crate) mod prefix;

#[cfg(feature = "python")]
mod py;

pub use cache::{
    Cache, CacheConfig, CacheStats, Geometry, Inserted, Match, PoolStats, PrefixStats, StateHit,
};
pub use error::{KernError, Result};
pub use ids::{HostPageId, HostSlotId, NodeId, PageId, SlotId};
pub use plan::{CopyPlan, Device, EntryKey, Evicted, HostTier, Room, Side, Woken};
