//! kern_pool: the bookkeeping of kern's KV cache. A device pool of chunks backing KV pages and
//! recurrent-state slots, a prefix radix tree over token ids, and a host tier that parked
//! entries move to. No tensors and no I/O: every call that moves data returns a plan
//! (`plan.rs`) and the runner moves the bytes.

pub mod bits;
pub mod cache;
pub mod error;
pub mod host;
pub mod ids;
pub mod plan;
pub mod pool;
pub mod prefix;

#[cfg(feature = "python")]
mod py;

pub use cache::{Cache, CacheConfig, CacheStats};
pub use error::{KernError, Result};
pub use ids::{HostPageId, HostSlotId, NodeId, PageId, SlotId};
pub use plan::{EntryKey, Evicted, ParkPlan, Room, WakePlan};
pub use pool::{Kind, Pool, PoolStats};
pub use prefix::{Inserted, Match, Prefix, PrefixStats, StateHit, Tier};
