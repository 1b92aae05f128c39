//! One object class's books (KV pages or state slots): the chunks it owns, which of their
//! positions are allocated, and which owned chunks are partly used or empty, as bitsets and
//! counters so that every question about room is O(1) and `fits` reads counters only.

use super::room::ClassCounts;
use super::Kind;
use crate::bits::{Bits, Divisor};

/// One object class: which chunks it owns and which of their positions are taken.
#[derive(Clone, Debug)]
pub(super) struct Class {
    pub(super) kind: Kind,
    pub(super) object_bytes: u64,
    pub(super) per_chunk: u32,
    pub(super) chunk_of: Divisor,
    /// One bit per position of the whole arena: allocated or not.
    pub(super) allocated: Bits,
    pub(super) used_in_chunk: Vec<u32>,
    /// Owned chunks with some but not all positions allocated.
    pub(super) partial: Bits,
    /// Owned chunks with nothing allocated: the ones another class may take.
    pub(super) empty: Bits,
    pub(super) num_empty: u32,
    pub(super) owned: u32,
    pub(super) used: u64,
    /// The class never shrinks below this many chunks (a stateful target keeps two slots).
    pub(super) floor_chunks: u32,
}

impl Class {
    pub(super) fn new(kind: Kind, object_bytes: u64, per_chunk: u32, num_chunks: u32) -> Self {
        Class {
            kind,
            object_bytes,
            per_chunk,
            chunk_of: Divisor::new(per_chunk),
            allocated: Bits::new(per_chunk * num_chunks),
            used_in_chunk: vec![0; num_chunks as usize],
            partial: Bits::new(num_chunks),
            empty: Bits::new(num_chunks),
            num_empty: 0,
            owned: 0,
            used: 0,
            floor_chunks: 0,
        }
    }

    pub(super) fn free_positions(&self) -> u64 {
        u64::from(self.owned) * u64::from(self.per_chunk) - self.used
    }

    pub(super) fn releasable(&self) -> u32 {
        self.num_empty
            .min(self.owned.saturating_sub(self.floor_chunks))
    }

    pub(super) fn counts(&self) -> ClassCounts {
        ClassCounts {
            per: u64::from(self.per_chunk),
            free: self.free_positions(),
            empty: u64::from(self.num_empty),
            owned: u64::from(self.owned),
            floor: u64::from(self.floor_chunks),
        }
    }

    /// `k` positions of chunk `c` were just allocated (bits already set).
    pub(super) fn took(&mut self, c: u32, k: u32) {
        let before = self.used_in_chunk[c as usize];
        let after = before + k;
        self.used_in_chunk[c as usize] = after;
        self.used += u64::from(k);
        if before == 0 {
            self.empty.clear(c);
            self.num_empty -= 1;
        }
        if after == self.per_chunk {
            self.partial.clear(c);
        } else {
            self.partial.set(c);
        }
    }

    /// `k` positions of chunk `c` were just freed (bits already cleared).
    pub(super) fn gave_back(&mut self, c: u32, k: u32) {
        let after = self.used_in_chunk[c as usize] - k;
        self.used_in_chunk[c as usize] = after;
        self.used -= u64::from(k);
        if after == 0 {
            self.partial.clear(c);
            self.empty.set(c);
            self.num_empty += 1;
        } else {
            self.partial.set(c);
        }
    }

    pub(super) fn claim(&mut self, chunk: u32) {
        self.empty.set(chunk);
        self.num_empty += 1;
        self.owned += 1;
    }

    pub(super) fn release(&mut self, chunk: u32) {
        self.empty.clear(chunk);
        self.num_empty -= 1;
        self.owned -= 1;
    }
}
