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
//! - Pages fill from the low end, slots from the high end, and each takes its lowest (pages) or
//!   highest (slots) free position, so emptied chunks gather at the boundary where the other
//!   class can take them.
//! - Tried and dropped: objects spanning several chunks. They need contiguous runs, and the
//!   fragmentation that brings is worse than a chunk at least as large as the largest object.

use std::collections::BTreeSet;

use crate::error::{KernError, Result};

/// About this many chunks at any budget (fewer when one object is larger than budget / this).
/// 1024 because a 1 GiB budget of 7B-class pages (16 tokens, 2 MiB) holds only 512 objects:
/// keeping 140 GiB within 2x of that count needs a target near 1024. The price is coarser
/// growth steps at large budgets (140 MiB chunks at 140 GiB).
pub const TARGET_CHUNKS: u64 = 1024;

/// A slot's stride is a multiple of this, so any slot can be viewed as float32/float64 data.
pub const SLOT_ALIGN: u64 = 16;

/// How a chunk is cut: into pages (exactly) and into slots at a stride that divides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub chunk_bytes: u64,
    pub pages_per_chunk: u32,
    /// Bytes from slot `s` to slot `s + 1` (0 without slots).
    pub slot_stride: u64,
    pub slots_per_chunk: u32,
}

impl Layout {
    /// The chunk size near `base` (rounded up to whole pages) and, with slots, the slot count
    /// whose stride divides it. Among the chunk sizes up to twice the first (so the chunk count
    /// stays near its target) it keeps the one whose slots fill it best: a stride that must
    /// divide the chunk can leave part of it unused (5 slots of 3,000 bytes in a 16,384-byte
    /// chunk take 4 x 4,096).
    fn new(base: u64, page_bytes: u64, slot_bytes: u64) -> Layout {
        if slot_bytes == 0 {
            let chunk_bytes = base.div_ceil(page_bytes) * page_bytes;
            return Layout {
                chunk_bytes,
                pages_per_chunk: (chunk_bytes / page_bytes) as u32,
                slot_stride: 0,
                slots_per_chunk: 0,
            };
        }
        let unit = lcm(page_bytes, SLOT_ALIGN);
        let first = base.div_ceil(unit).max(1);
        let mut best: Option<(u64, Layout)> = None;
        for m in first..=2 * first {
            let chunk_bytes = m * unit;
            let most = chunk_bytes / slot_bytes;
            let Some(d) = (1..=most).rev().find(|&d| {
                chunk_bytes.is_multiple_of(d) && (chunk_bytes / d).is_multiple_of(SLOT_ALIGN)
            }) else {
                continue;
            };
            let layout = Layout {
                chunk_bytes,
                pages_per_chunk: (chunk_bytes / page_bytes) as u32,
                slot_stride: chunk_bytes / d,
                slots_per_chunk: d as u32,
            };
            // Fill in parts per million: slot bytes used over chunk bytes.
            let fill = u128::from(d * slot_bytes) * 1_000_000 / u128::from(chunk_bytes);
            let fill = fill as u64;
            if best.is_none_or(|(f, _)| fill > f) {
                best = Some((fill, layout));
            }
            if d * slot_bytes == chunk_bytes {
                break;
            }
        }
        // m * unit >= slot_bytes for the largest m tried, and d = 1 always divides, so `best`
        // is set whenever the loop reached a chunk that holds one slot.
        best.map_or(
            Layout {
                chunk_bytes: first * unit,
                pages_per_chunk: (first * unit / page_bytes) as u32,
                slot_stride: first * unit,
                slots_per_chunk: 1,
            },
            |(_, l)| l,
        )
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Pages,
    Slots,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Free,
    Owned(Kind),
}

/// One object class: which positions exist (its chunks) and which are taken.
#[derive(Clone, Debug)]
struct Class {
    kind: Kind,
    object_bytes: u64,
    per_chunk: u32,
    /// Free positions inside chunks this class owns.
    free: BTreeSet<u32>,
    /// One bit per position of the whole arena: allocated or not.
    allocated: Vec<u64>,
    used_in_chunk: Vec<u32>,
    /// Owned chunks with nothing allocated: the ones another class may take.
    empty: BTreeSet<u32>,
    owned: u32,
    used: u64,
    /// The class never shrinks below this many chunks (a stateful target keeps two slots).
    floor_chunks: u32,
}

impl Class {
    fn new(kind: Kind, object_bytes: u64, per_chunk: u32, num_chunks: u32) -> Self {
        let positions = u64::from(per_chunk) * u64::from(num_chunks);
        Class {
            kind,
            object_bytes,
            per_chunk,
            free: BTreeSet::new(),
            allocated: vec![0; positions.div_ceil(64) as usize],
            used_in_chunk: vec![0; num_chunks as usize],
            empty: BTreeSet::new(),
            owned: 0,
            used: 0,
            floor_chunks: 0,
        }
    }

    fn is_allocated(&self, pos: u32) -> bool {
        self.allocated[(pos / 64) as usize] & (1u64 << (pos % 64)) != 0
    }

    fn set_allocated(&mut self, pos: u32, on: bool) {
        let word = &mut self.allocated[(pos / 64) as usize];
        if on {
            *word |= 1u64 << (pos % 64);
        } else {
            *word &= !(1u64 << (pos % 64));
        }
    }

    fn chunk_of(&self, pos: u32) -> u32 {
        pos / self.per_chunk
    }

    fn releasable(&self) -> u32 {
        (self.empty.len() as u32).min(self.owned.saturating_sub(self.floor_chunks))
    }

    fn take(&mut self, pos: u32) {
        let chunk = self.chunk_of(pos);
        self.free.remove(&pos);
        self.set_allocated(pos, true);
        if self.used_in_chunk[chunk as usize] == 0 {
            self.empty.remove(&chunk);
        }
        self.used_in_chunk[chunk as usize] += 1;
        self.used += 1;
    }

    fn give_back(&mut self, pos: u32) {
        let chunk = self.chunk_of(pos);
        self.set_allocated(pos, false);
        self.free.insert(pos);
        self.used_in_chunk[chunk as usize] -= 1;
        if self.used_in_chunk[chunk as usize] == 0 {
            self.empty.insert(chunk);
        }
        self.used -= 1;
    }

    fn claim(&mut self, chunk: u32) {
        let first = chunk * self.per_chunk;
        self.free.extend(first..first + self.per_chunk);
        self.empty.insert(chunk);
        self.owned += 1;
    }

    fn release(&mut self, chunk: u32) {
        let first = chunk * self.per_chunk;
        for pos in first..first + self.per_chunk {
            self.free.remove(&pos);
        }
        self.empty.remove(&chunk);
        self.owned -= 1;
    }
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
    free_chunks: BTreeSet<u32>,
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
        let mut num_chunks = budget_bytes / chunk_bytes;
        if num_chunks == 0 {
            // Rounding up to whole pages (and slot strides) overshot a budget that holds the
            // largest object.
            return Err(KernError::BudgetTooSmall {
                what: "pool",
                budget_bytes,
                object_bytes: chunk_bytes,
            });
        }
        num_chunks = num_chunks.min(u64::from(u32::MAX));
        let pages_per_chunk = u64::from(layout.pages_per_chunk);
        if pages_per_chunk * num_chunks > u64::from(u32::MAX) {
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
            free_chunks: (0..num_chunks).collect(),
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

    /// How many objects of `kind` can be allocated now without evicting anything.
    pub fn available(&self, kind: Kind) -> u64 {
        let Some(class) = self.class(kind) else {
            return 0;
        };
        let other = self.class(Self::other(kind)).map_or(0, Class::releasable);
        class.free.len() as u64
            + (self.free_chunks.len() as u64 + u64::from(other)) * u64::from(class.per_chunk)
    }

    /// Take one more chunk for `kind`: a free one (lowest for pages, highest for slots), else an
    /// empty chunk of the other class. The caller has checked that one exists.
    fn claim_chunk(&mut self, kind: Kind) -> bool {
        let chunk = match kind {
            Kind::Pages => self.free_chunks.pop_first(),
            Kind::Slots => self.free_chunks.pop_last(),
        };
        let chunk = match chunk {
            Some(c) => c,
            None => {
                let Some(other) = self.class_mut(Self::other(kind)) else {
                    return false;
                };
                if other.releasable() == 0 {
                    return false;
                }
                let c = match kind {
                    Kind::Pages => other.empty.first().copied(),
                    Kind::Slots => other.empty.last().copied(),
                };
                let Some(c) = c else { return false };
                other.release(c);
                c
            }
        };
        self.owner[chunk as usize] = Owner::Owned(kind);
        if let Some(class) = self.class_mut(kind) {
            class.claim(chunk);
        }
        true
    }

    /// Allocate `n` objects of `kind`, all or nothing.
    pub fn alloc(&mut self, kind: Kind, n: usize) -> Result<Vec<u32>> {
        let what = match kind {
            Kind::Pages => "pages",
            Kind::Slots => "state slots",
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        if self.class(kind).is_none() {
            return Err(KernError::PoolFull {
                what,
                needed: n as u64,
                available: 0,
            });
        }
        let available = self.available(kind);
        if (n as u64) > available {
            return Err(KernError::PoolFull {
                what,
                needed: n as u64,
                available,
            });
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some(class) = self.class_mut(kind) else {
                break;
            };
            let pos = match kind {
                Kind::Pages => class.free.first().copied(),
                Kind::Slots => class.free.last().copied(),
            };
            match pos {
                Some(pos) => {
                    class.take(pos);
                    out.push(pos);
                }
                None => {
                    let claimed = self.claim_chunk(kind);
                    debug_assert!(claimed, "available() promised a chunk");
                    if !claimed {
                        // Unreachable if available() is right; undo rather than leave a half-done call.
                        if let Some(class) = self.class_mut(kind) {
                            for &pos in &out {
                                class.give_back(pos);
                            }
                        }
                        return Err(KernError::Corrupt(format!(
                            "{what}: available() overcounted"
                        )));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Is `id` an allocated object of `kind`?
    pub fn is_allocated(&self, kind: Kind, id: u32) -> bool {
        let Some(class) = self.class(kind) else {
            return false;
        };
        let chunk = id / class.per_chunk;
        chunk < self.num_chunks
            && self.owner[chunk as usize] == Owner::Owned(kind)
            && class.is_allocated(id)
    }

    /// Check that every id is allocated and named once, without changing anything.
    pub fn check_owned(&self, kind: Kind, ids: &[u32], what: &'static str) -> Result<()> {
        for &id in ids {
            if !self.is_allocated(kind, id) {
                return Err(KernError::NotAllocated { what, id });
            }
        }
        // Sorting a copy beats hashing for the few hundred ids a request holds.
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(KernError::Repeated { what, id: w[0] });
        }
        Ok(())
    }

    /// Free objects of `kind`, all or nothing: a double free or an unknown id changes nothing.
    pub fn free(&mut self, kind: Kind, ids: &[u32]) -> Result<()> {
        let what = match kind {
            Kind::Pages => "page",
            Kind::Slots => "state slot",
        };
        self.check_owned(kind, ids, what)?;
        // check_owned passed, so a missing class means `ids` is empty.
        if let Some(class) = self.class_mut(kind) {
            for &id in ids {
                class.give_back(id);
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> PoolStats {
        let per = |c: &Class| u64::from(c.per_chunk) * u64::from(c.owned);
        PoolStats {
            chunk_bytes: self.chunk_bytes,
            num_chunks: self.num_chunks,
            free_chunks: self.free_chunks.len() as u32,
            page_capacity: per(&self.pages),
            pages_used: self.pages.used,
            pages_free: self.available(Kind::Pages),
            slot_capacity: self.slots.as_ref().map_or(0, per),
            slots_used: self.slots.as_ref().map_or(0, |s| s.used),
            slots_free: self.available(Kind::Slots),
        }
    }

    /// Recount everything from the chunk owners and the bitsets and compare with the counters.
    pub fn check_integrity(&self) -> Result<()> {
        let bad = |why: String| Err(KernError::Corrupt(why));
        let mut free_chunks = 0u32;
        for (c, owner) in self.owner.iter().enumerate() {
            let c = c as u32;
            match owner {
                Owner::Free => {
                    free_chunks += 1;
                    if !self.free_chunks.contains(&c) {
                        return bad(format!("free chunk {c} missing from the free set"));
                    }
                }
                Owner::Owned(kind) => {
                    if self.free_chunks.contains(&c) {
                        return bad(format!("chunk {c} is owned and in the free set"));
                    }
                    if self.class(*kind).is_none() {
                        return bad(format!("chunk {c} owned by a class the pool lacks"));
                    }
                }
            }
        }
        if free_chunks as usize != self.free_chunks.len() {
            return bad("free chunk set has extra entries".into());
        }
        for class in [Some(&self.pages), self.slots.as_ref()]
            .into_iter()
            .flatten()
        {
            let (mut owned, mut used, mut free) = (0u32, 0u64, 0usize);
            for c in 0..self.num_chunks {
                let first = c * class.per_chunk;
                let in_chunk = (first..first + class.per_chunk)
                    .filter(|&p| class.is_allocated(p))
                    .count();
                let mine = self.owner[c as usize] == Owner::Owned(class.kind);
                if !mine {
                    if in_chunk != 0 {
                        return bad(format!(
                            "{:?}: chunk {c} not owned but has allocated objects",
                            class.kind
                        ));
                    }
                    continue;
                }
                owned += 1;
                used += in_chunk as u64;
                if class.used_in_chunk[c as usize] as usize != in_chunk {
                    return bad(format!(
                        "{:?}: chunk {c} count {} != {in_chunk}",
                        class.kind, class.used_in_chunk[c as usize]
                    ));
                }
                if (in_chunk == 0) != class.empty.contains(&c) {
                    return bad(format!(
                        "{:?}: chunk {c} empty-set membership wrong",
                        class.kind
                    ));
                }
                for p in first..first + class.per_chunk {
                    if class.is_allocated(p) == class.free.contains(&p) {
                        return bad(format!(
                            "{:?}: position {p} both or neither free and allocated",
                            class.kind
                        ));
                    }
                }
                free += class.per_chunk as usize - in_chunk;
            }
            if owned != class.owned || used != class.used || free != class.free.len() {
                return bad(format!(
                    "{:?}: counters owned {} used {} free {} != recount {owned} {used} {free}",
                    class.kind,
                    class.owned,
                    class.used,
                    class.free.len()
                ));
            }
            if class.owned < class.floor_chunks {
                return bad(format!("{:?}: shrank below its floor", class.kind));
            }
            debug_assert!(class.object_bytes * u64::from(class.per_chunk) <= self.chunk_bytes);
            if class.kind == Kind::Slots
                && class.object_bytes * u64::from(class.per_chunk) != self.chunk_bytes
            {
                return bad("slot stride does not divide the chunk".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn chunk_count_scales_with_the_budget() {
        // A 16-token page of a 7B-class model (32 layers, 8 KV heads of 128, bf16): 2 MiB.
        let page = 16 * 32 * 2 * 8 * 128 * 2;
        let small = Pool::new(GIB, page, 0, 0).unwrap();
        let large = Pool::new(140 * GIB, page, 0, 0).unwrap();
        let (a, b) = (u64::from(small.num_chunks()), u64::from(large.num_chunks()));
        println!("chunks: 1 GiB -> {a}, 140 GiB -> {b}");
        assert!(a < 20_000 && b < 20_000);
        assert!(a.max(b) <= 2 * a.min(b), "{a} vs {b}");
        // A tiny page (the CPU default model) at the same budgets.
        let small = Pool::new(GIB, 4096, 8192, 2).unwrap();
        let large = Pool::new(140 * GIB, 4096, 8192, 2).unwrap();
        let (a, b) = (u64::from(small.num_chunks()), u64::from(large.num_chunks()));
        println!("chunks (4 KiB pages): 1 GiB -> {a}, 140 GiB -> {b}");
        assert!(a < 20_000 && b < 20_000 && a.max(b) <= 2 * a.min(b));
    }

    #[test]
    fn slots_sit_at_a_stride_that_divides_the_chunk() {
        // Odd sizes on purpose: the stride must still divide the chunk and stay aligned.
        for (budget, page, slot) in [
            (1u64 << 20, 4096u64, 8192u64),
            (1 << 20, 3000, 7000),
            (256 << 20, 12_288, 100_000),
            (3 << 30, 2 << 20, 150 << 20),
            (1 << 20, 48, 40),
        ] {
            let pool = Pool::new(budget, page, slot, 2).unwrap();
            let (stride, per) = (pool.slot_stride(), u64::from(pool.slots_per_chunk()));
            assert!(
                stride >= slot && stride % SLOT_ALIGN == 0,
                "{page} {slot}: {stride}"
            );
            assert_eq!(stride * per, pool.chunk_bytes(), "{page} {slot}");
            assert_eq!(pool.chunk_bytes() % page, 0);
            let fill = (per * slot) as f64 / pool.chunk_bytes() as f64;
            println!("page {page} slot {slot}: {per} slots of stride {stride}, fill {fill:.3}");
            assert!(fill > 0.5, "{page} {slot}: fill {fill}");
            pool.check_integrity().unwrap();
        }
    }

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

    #[test]
    fn alloc_free_round_trip_and_double_free() {
        let mut pool = Pool::new(64 * 4096, 4096, 0, 0).unwrap();
        let start = pool.stats();
        let pages = pool.alloc(Kind::Pages, 10).unwrap();
        assert_eq!(pool.stats().pages_used, 10);
        pool.free(Kind::Pages, &pages[..5]).unwrap();
        let err = pool.free(Kind::Pages, &[pages[5], pages[0]]).unwrap_err();
        assert_eq!(
            err,
            KernError::NotAllocated {
                what: "page",
                id: pages[0]
            }
        );
        // The failed call freed nothing, not even the valid id before the bad one.
        assert_eq!(pool.stats().pages_used, 5);
        assert!(matches!(
            pool.free(Kind::Pages, &[pages[6], pages[6]]),
            Err(KernError::Repeated { .. })
        ));
        pool.free(Kind::Pages, &pages[5..]).unwrap();
        pool.check_integrity().unwrap();
        assert_eq!(pool.stats().pages_free, start.pages_free);
        let all = pool.alloc(Kind::Pages, start.pages_free as usize).unwrap();
        assert!(matches!(
            pool.alloc(Kind::Pages, 1),
            Err(KernError::PoolFull { .. })
        ));
        pool.free(Kind::Pages, &all).unwrap();
        pool.check_integrity().unwrap();
    }

    #[test]
    fn slots_start_at_two_grow_and_give_room_back_to_pages() {
        // 16 chunks of 4 pages; a slot is one chunk.
        let mut pool = Pool::new(16 * 4 * 1024, 1024, 4096, 2).unwrap();
        assert_eq!(pool.num_chunks(), 16);
        assert_eq!(pool.stats().slot_capacity, 2);
        let slots = pool.alloc(Kind::Slots, 5).unwrap();
        assert_eq!(pool.stats().slot_capacity, 5);
        pool.check_integrity().unwrap();
        // Pages may take everything but the five live slots.
        let pages = pool.alloc(Kind::Pages, 11 * 4).unwrap();
        assert!(pool.alloc(Kind::Pages, 1).is_err());
        pool.free(Kind::Slots, &slots).unwrap();
        // Freed slot chunks go to pages, down to the two-slot floor.
        let more = pool.alloc(Kind::Pages, 3 * 4).unwrap();
        assert!(pool.alloc(Kind::Pages, 1).is_err());
        assert_eq!(pool.stats().slot_capacity, 2);
        pool.check_integrity().unwrap();
        pool.free(Kind::Pages, &pages).unwrap();
        pool.free(Kind::Pages, &more).unwrap();
        pool.check_integrity().unwrap();
    }
}
