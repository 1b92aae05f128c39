//! What must move. The crate never touches memory: each call that moves data returns one of
//! these, and the runner lands it as one batched index copy per list before the memory it frees
//! is reused (the freed device pages are already free in the pool's books).

use crate::ids::{HostPageId, HostSlotId, PageId, SlotId};

/// Device → host copies for an entry being parked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParkPlan {
    pub pages: Vec<(PageId, HostPageId)>,
    pub states: Vec<(SlotId, HostSlotId)>,
}

/// Host → device copies for parked entries being woken, and which entries they were.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WakePlan {
    pub pages: Vec<(HostPageId, PageId)>,
    pub states: Vec<(HostSlotId, SlotId)>,
    pub woken: Vec<EntryKey>,
}

/// Names a tree entry: where its own tokens start (page-aligned) and end in the path from the
/// root. The path's tokens themselves are recorded only when the cache was asked to
/// (`Cache::record_paths`, for tests): copying a 5,000-token path for every entry evicted was
/// most of an eviction's cost, and no scheduler reads it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryKey {
    pub start: u32,
    pub end: u32,
    pub tokens: Option<Vec<u32>>,
}

/// What one step of the make-room loop took. Callers count evictions from these values alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// The entry went to host memory; `dropped` are the parked entries removed to make room.
    Parked {
        key: EntryKey,
        plan: ParkPlan,
        dropped: Vec<EntryKey>,
    },
    /// The entry was removed; `parked` says whether it was in host memory.
    Dropped { key: EntryKey, parked: bool },
}

/// What `make_room` did: each step of the loop, the device room those steps gave back, and
/// whether the room asked for is there now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Room {
    pub evicted: Vec<Evicted>,
    pub pages_freed: u64,
    pub slots_freed: u64,
    pub fits: bool,
}
