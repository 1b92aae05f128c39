//! What must move. The crate never touches memory: each call that moves data returns one of
//! these, and the runner lands it as one batched index copy per list before the memory it frees
//! is reused (the freed device pages are already free in the pool's books).

use crate::ids::{HostPageId, HostSlotId, PageId, SlotId};

/// One side of a copy: the device arena or the host tier, each with its own id types.
pub trait Side {
    type Page: Copy + std::fmt::Debug + Eq + Into<u32>;
    type Slot: Copy + std::fmt::Debug + Eq + Into<u32>;
}

/// The device arena: `PageId`s and `SlotId`s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Device;

/// The host tier: `HostPageId`s and `HostSlotId`s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTier;

impl Side for Device {
    type Page = PageId;
    type Slot = SlotId;
}

impl Side for HostTier {
    type Page = HostPageId;
    type Slot = HostSlotId;
}

/// Copies the runner lands, one batched index copy per list: each `(src, dst)` pair of
/// `pages` and of `states`. A park plan copies device → host (`CopyPlan<Device, HostTier>`),
/// a wake plan host → device (`CopyPlan<HostTier, Device>`); Python sees both as `CopyPlan`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPlan<Src: Side, Dst: Side> {
    pub pages: Vec<(Src::Page, Dst::Page)>,
    pub states: Vec<(Src::Slot, Dst::Slot)>,
}

impl<Src: Side, Dst: Side> Default for CopyPlan<Src, Dst> {
    fn default() -> Self {
        CopyPlan {
            pages: Vec::new(),
            states: Vec::new(),
        }
    }
}

/// What `wake` brought back: the host → device copies to land before the pages are read, and
/// the entries woken.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Woken {
    pub plan: CopyPlan<HostTier, Device>,
    pub keys: Vec<EntryKey>,
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
        plan: CopyPlan<Device, HostTier>,
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
