//! Handles that cross the boundary. Each id has its own type so a host slot can never be passed
//! where a device page is expected.

/// A KV page position in the device arena: page `p` lives at byte `p * page_bytes`.
/// Transparent, so a list of them is read as raw u32 ids without a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct PageId(pub u32);

impl PageId {
    /// The raw ids of a list of pages, in place.
    pub fn raw(pages: &[PageId]) -> &[u32] {
        // SAFETY: PageId is repr(transparent) over u32: same size, alignment and validity.
        unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<u32>(), pages.len()) }
    }
}

/// A recurrent-state slot position in the device arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

/// A page-sized slot in the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPageId(pub u32);

/// A state-sized slot in the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostSlotId(pub u32);

/// A node of the prefix tree. The generation makes a handle to a removed node detectably stale
/// instead of silently naming whatever reused its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    pub index: u32,
    pub generation: u32,
}

impl NodeId {
    /// One integer for Python: generation in the high half, index in the low half.
    pub fn to_u64(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    pub fn from_u64(raw: u64) -> Self {
        NodeId {
            index: (raw & 0xffff_ffff) as u32,
            generation: (raw >> 32) as u32,
        }
    }
}

/// The raw id, as it crosses into Python or into a plan's id list.
macro_rules! raw_u32 {
    ($($id:ty),*) => {$(
        impl From<$id> for u32 {
            fn from(id: $id) -> u32 {
                id.0
            }
        }
    )*};
}

raw_u32!(PageId, SlotId, HostPageId, HostSlotId);
