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
//! - The books are bitsets: one bit per position (allocated or not) and, per class, one bit per
//!   chunk for "partly used" and "empty", plus counters. Allocating `n` objects and freeing
//!   them are O(n) bit operations with no sorting and no ordered sets; `available` and `fits`
//!   are O(1). A free checks every id by clearing its bit and puts the cleared bits back if a
//!   later id fails, so a repeated or unknown id changes nothing and costs no extra pass.
//! - A class fills its partly used chunks first (pages from the low end, slots from the high
//!   end), then its own empty chunks, then claims one. Keeping empty chunks empty is what lets
//!   the other class take them, and it makes `fits(pages, slots)` exact: the formula there
//!   assumes this order, and with it an allocation of slots then pages (or pages then slots)
//!   succeeds exactly when `fits` said so.
//! - Tried and dropped: objects spanning several chunks. They need contiguous runs, and the
//!   fragmentation that brings is worse than a chunk at least as large as the largest object.
//!   Also dropped: a `BTreeSet` of free positions (what this file had): every free inserted
//!   each id into a tree, ~76 us for a 4,700-page request with scattered ids.

use std::collections::HashMap;

use crate::bits::{Bits, Divisor};
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
    Pages = 0,
    Slots = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Free,
    Owned(Kind),
}

/// One object class: which chunks it owns and which of their positions are taken.
#[derive(Clone, Debug)]
struct Class {
    kind: Kind,
    object_bytes: u64,
    per_chunk: u32,
    chunk_of: Divisor,
    /// One bit per position of the whole arena: allocated or not.
    allocated: Bits,
    used_in_chunk: Vec<u32>,
    /// Owned chunks with some but not all positions allocated.
    partial: Bits,
    /// Owned chunks with nothing allocated: the ones another class may take.
    empty: Bits,
    num_empty: u32,
    owned: u32,
    used: u64,
    /// The class never shrinks below this many chunks (a stateful target keeps two slots).
    floor_chunks: u32,
}

impl Class {
    fn new(kind: Kind, object_bytes: u64, per_chunk: u32, num_chunks: u32) -> Self {
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

    fn free_positions(&self) -> u64 {
        u64::from(self.owned) * u64::from(self.per_chunk) - self.used
    }

    fn releasable(&self) -> u32 {
        self.num_empty
            .min(self.owned.saturating_sub(self.floor_chunks))
    }

    fn counts(&self) -> ClassCounts {
        ClassCounts {
            per: u64::from(self.per_chunk),
            free: self.free_positions(),
            empty: u64::from(self.num_empty),
            owned: u64::from(self.owned),
            floor: u64::from(self.floor_chunks),
        }
    }

    /// `k` positions of chunk `c` were just allocated (bits already set).
    fn took(&mut self, c: u32, k: u32) {
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
    fn gave_back(&mut self, c: u32, k: u32) {
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

    fn claim(&mut self, chunk: u32) {
        self.empty.set(chunk);
        self.num_empty += 1;
        self.owned += 1;
    }

    fn release(&mut self, chunk: u32) {
        self.empty.clear(chunk);
        self.num_empty -= 1;
        self.owned -= 1;
    }
}

/// The counters `fits` reads, for one class.
#[derive(Clone, Copy, Debug, Default)]
struct ClassCounts {
    per: u64,
    /// Free positions in owned chunks.
    free: u64,
    /// Owned chunks with nothing allocated.
    empty: u64,
    owned: u64,
    floor: u64,
}

/// Could `a` pages and `b` slots be allocated together? Each class first fills the free
/// positions of its partly used chunks, then its own empty chunks; what is left needs whole
/// chunks from the free ones or from the other class's spare empty chunks (those it does not
/// need itself, and for slots only above their floor). A class that needs chunks from outside
/// has no spare empty chunks, so the two demands never compete for the same spares.
fn fits(p: ClassCounts, s: Option<ClassCounts>, free_chunks: u64, a: u64, b: u64) -> bool {
    let s = match s {
        Some(s) => s,
        None if b > 0 => return false,
        None => ClassCounts::default(),
    };
    let chunks = |c: &ClassCounts, want: u64| -> (u64, u64) {
        // (chunks needed beyond its own empties, its spare empty chunks)
        if want == 0 {
            return (0, c.empty);
        }
        let in_partial = c.free - c.empty * c.per;
        let need = want.saturating_sub(in_partial).div_ceil(c.per);
        (need.saturating_sub(c.empty), c.empty.saturating_sub(need))
    };
    let (need_p, spare_p) = chunks(&p, a);
    let (need_s, spare_s) = chunks(&s, b);
    let spare_s = spare_s.min(s.owned.saturating_sub(s.floor));
    need_p.saturating_sub(spare_s) + need_s.saturating_sub(spare_p) <= free_chunks
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
    free_chunks: Bits,
    num_free_chunks: u32,
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
        let num_chunks = budget_bytes / chunk_bytes;
        if num_chunks == 0 {
            // Rounding up to whole pages (and slot strides) overshot a budget that holds the
            // largest object.
            return Err(KernError::BudgetTooSmall {
                what: "pool",
                budget_bytes,
                object_bytes: chunk_bytes,
            });
        }
        let num_chunks = num_chunks.min(u64::from(u32::MAX));
        let pages_per_chunk = u64::from(layout.pages_per_chunk);
        let slots_per_chunk = u64::from(layout.slots_per_chunk);
        if pages_per_chunk.max(slots_per_chunk) * num_chunks > u64::from(u32::MAX) {
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
            free_chunks: Bits::full(num_chunks),
            num_free_chunks: num_chunks,
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

    /// Page ids run over `0..num_pages`.
    pub fn num_pages(&self) -> u32 {
        self.pages.allocated.len()
    }

    /// Slot ids run over `0..num_slots` (0 without slots).
    pub fn num_slots(&self) -> u32 {
        self.slots.as_ref().map_or(0, |s| s.allocated.len())
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

    /// How many objects of `kind` can be allocated now without evicting anything (the other
    /// class allocating nothing meanwhile).
    pub fn available(&self, kind: Kind) -> u64 {
        let Some(class) = self.class(kind) else {
            return 0;
        };
        let other = self.class(Self::other(kind)).map_or(0, Class::releasable);
        class.free_positions()
            + (u64::from(self.num_free_chunks) + u64::from(other)) * u64::from(class.per_chunk)
    }

    /// Can `pages` pages and `slots` slots be allocated together now, in either order?
    pub fn fits(&self, pages: u64, slots: u64) -> bool {
        fits(
            self.pages.counts(),
            self.slots.as_ref().map(Class::counts),
            u64::from(self.num_free_chunks),
            pages,
            slots,
        )
    }

    /// Could `pages` pages and `slots` slots ever be allocated together, with the pool empty?
    /// The state slots' floor chunks are never the pages': slots hold at least that many.
    pub fn could_ever_fit(&self, pages: u64, slots: u64) -> bool {
        if slots > 0 && self.slots.is_none() {
            return false;
        }
        let chunks = |n: u64, per: u32| n.div_ceil(u64::from(per.max(1)));
        let floor = self.slots.as_ref().map_or(0, |s| u64::from(s.floor_chunks));
        let slot_chunks = chunks(slots, self.slots_per_chunk()).max(floor);
        chunks(pages, self.pages.per_chunk) + slot_chunks <= u64::from(self.num_chunks)
    }

    /// Take one more chunk for `kind`: a free one (lowest for pages, highest for slots), else an
    /// empty chunk of the other class above its floor. The caller has checked that one exists.
    fn claim_chunk(&mut self, kind: Kind) -> Option<u32> {
        let chunk = match kind {
            Kind::Pages => self.free_chunks.first(),
            Kind::Slots => self.free_chunks.last(),
        };
        let chunk = match chunk {
            Some(c) => {
                self.free_chunks.clear(c);
                self.num_free_chunks -= 1;
                c
            }
            None => {
                let other = self.class_mut(Self::other(kind))?;
                if other.releasable() == 0 {
                    return None;
                }
                let c = match kind {
                    Kind::Pages => other.empty.first(),
                    Kind::Slots => other.empty.last(),
                }?;
                other.release(c);
                c
            }
        };
        self.owner[chunk as usize] = Owner::Owned(kind);
        self.class_mut(kind)?.claim(chunk);
        Some(chunk)
    }

    fn what(kind: Kind) -> &'static str {
        match kind {
            Kind::Pages => "pages",
            Kind::Slots => "state slots",
        }
    }

    /// Allocate `n` objects of `kind`, all or nothing.
    pub fn alloc(&mut self, kind: Kind, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.alloc_into(kind, n, &mut out)?;
        Ok(out)
    }

    /// `alloc` into `out` (cleared first; left empty on an error): a caller that allocates
    /// often reuses one buffer.
    pub fn alloc_into(&mut self, kind: Kind, n: usize, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        if n == 0 {
            return Ok(());
        }
        let available = self.available(kind);
        if self.class(kind).is_none() || (n as u64) > available {
            return Err(KernError::PoolFull {
                what: Self::what(kind),
                needed: n as u64,
                available,
            });
        }
        let up = kind == Kind::Pages;
        out.reserve(n);
        // Partly used chunks go first, lowest (highest for slots) first; a chunk left partly
        // used ends the loop, so each search resumes past the chunk before.
        let mut next = if up { 0 } else { u32::MAX };
        while out.len() < n {
            let chunk = {
                let Some(class) = self.class(kind) else { break };
                let found = if up {
                    class
                        .partial
                        .first_from(next)
                        .or_else(|| class.empty.first())
                } else {
                    class.partial.last_to(next).or_else(|| class.empty.last())
                };
                match found {
                    Some(c) => Some(c),
                    None => self.claim_chunk(kind),
                }
            };
            let (Some(c), Some(class)) = (chunk, self.class_mut(kind)) else {
                break;
            };
            let from = out.len();
            let per = class.per_chunk;
            class
                .allocated
                .take_clear(c * per, (c + 1) * per, up, n - from, out);
            class.took(c, (out.len() - from) as u32);
            next = if up { c + 1 } else { c.wrapping_sub(1) };
        }
        if out.len() < n {
            // Unreachable if available() is right; undo rather than leave a half-done call.
            self.free(kind, out)?;
            out.clear();
            return Err(KernError::Corrupt(format!(
                "{}: available() overcounted",
                Self::what(kind)
            )));
        }
        Ok(())
    }

    /// Is `id` an allocated object of `kind`?
    #[inline]
    pub fn is_allocated(&self, kind: Kind, id: u32) -> bool {
        self.class(kind).is_some_and(|c| c.allocated.get(id))
    }

    /// Allocation bits `64w..64w+64` of `kind` (clear past the end).
    #[inline]
    pub fn allocated_word(&self, kind: Kind, w: u32) -> u64 {
        self.class(kind).map_or(0, |c| c.allocated.word(w))
    }

    /// Free objects of `kind`, all or nothing: a double free, a repeat or an unknown id
    /// changes nothing and is named in the error.
    pub fn free(&mut self, kind: Kind, ids: &[u32]) -> Result<()> {
        let what = match kind {
            Kind::Pages => "page",
            Kind::Slots => "state slot",
        };
        if ids.is_empty() {
            return Ok(());
        }
        let Some(class) = self.class_mut(kind) else {
            return Err(KernError::NotAllocated { what, id: ids[0] });
        };
        if let Err(i) = class.allocated.clear_all(ids) {
            let id = ids[i];
            return Err(if ids[..i].contains(&id) {
                KernError::Repeated { what, id }
            } else {
                KernError::NotAllocated { what, id }
            });
        }
        // Ids mostly come in runs within a chunk: count a run, then book it once.
        let (chunk_of, per) = (class.chunk_of, class.per_chunk);
        let (mut run, mut k) = (chunk_of.quotient(ids[0]), 0u32);
        let (mut lo, mut hi) = (run * per, run * per + per);
        for &id in ids {
            if id < lo || id >= hi {
                class.gave_back(run, k);
                run = chunk_of.quotient(id);
                (lo, hi, k) = (run * per, run * per + per, 0);
            }
            k += 1;
        }
        class.gave_back(run, k);
        Ok(())
    }

    /// A view of the pool in which some objects are freed, without freeing them: to ask
    /// whether room would fit before changing anything.
    pub fn shadow(&self) -> Shadow<'_> {
        Shadow {
            pool: self,
            freed: [HashMap::new(), HashMap::new()],
            counts: [
                self.pages.counts(),
                self.slots
                    .as_ref()
                    .map_or_else(ClassCounts::default, Class::counts),
            ],
        }
    }

    pub fn stats(&self) -> PoolStats {
        let per = |c: &Class| u64::from(c.per_chunk) * u64::from(c.owned);
        PoolStats {
            chunk_bytes: self.chunk_bytes,
            num_chunks: self.num_chunks,
            free_chunks: self.num_free_chunks,
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
            let is_free = *owner == Owner::Free;
            free_chunks += u32::from(is_free);
            if is_free != self.free_chunks.get(c) {
                return bad(format!(
                    "chunk {c}: owner {owner:?} but free bit {}",
                    !is_free
                ));
            }
            if let Owner::Owned(kind) = owner {
                if self.class(*kind).is_none() {
                    return bad(format!("chunk {c} owned by a class the pool lacks"));
                }
            }
        }
        if free_chunks != self.num_free_chunks || u64::from(free_chunks) != self.free_chunks.count()
        {
            return bad("free chunk count disagrees with the owners".into());
        }
        for class in [Some(&self.pages), self.slots.as_ref()]
            .into_iter()
            .flatten()
        {
            let k = class.kind;
            let (mut owned, mut used, mut empty) = (0u32, 0u64, 0u32);
            for c in 0..self.num_chunks {
                let first = c * class.per_chunk;
                let in_chunk = (first..first + class.per_chunk)
                    .filter(|&p| class.allocated.get(p))
                    .count() as u32;
                let mine = self.owner[c as usize] == Owner::Owned(k);
                if !mine {
                    if in_chunk != 0 || class.partial.get(c) || class.empty.get(c) {
                        return bad(format!(
                            "{k:?}: chunk {c} not owned but marked in its books"
                        ));
                    }
                    continue;
                }
                owned += 1;
                used += u64::from(in_chunk);
                empty += u32::from(in_chunk == 0);
                if class.used_in_chunk[c as usize] != in_chunk {
                    return bad(format!(
                        "{k:?}: chunk {c} count {} != {in_chunk}",
                        class.used_in_chunk[c as usize]
                    ));
                }
                let partial = in_chunk > 0 && in_chunk < class.per_chunk;
                if (in_chunk == 0) != class.empty.get(c) || partial != class.partial.get(c) {
                    return bad(format!("{k:?}: chunk {c} empty/partial bits wrong"));
                }
            }
            if owned != class.owned || used != class.used || empty != class.num_empty {
                return bad(format!(
                    "{k:?}: counters owned {} used {} empty {} != recount {owned} {used} {empty}",
                    class.owned, class.used, class.num_empty
                ));
            }
            if class.allocated.count() != used {
                return bad(format!("{k:?}: allocated bits outside owned chunks"));
            }
            if class.owned < class.floor_chunks {
                return bad(format!("{k:?}: shrank below its floor"));
            }
            if k == Kind::Slots
                && class.object_bytes * u64::from(class.per_chunk) != self.chunk_bytes
            {
                return bad("slot stride does not divide the chunk".into());
            }
        }
        Ok(())
    }
}

/// A pool with some objects freed in thought only (see `Pool::shadow`).
pub struct Shadow<'a> {
    pool: &'a Pool,
    /// Per class: chunk -> positions freed in it.
    freed: [HashMap<u32, u32>; 2],
    counts: [ClassCounts; 2],
}

impl Shadow<'_> {
    /// Free `id` of `kind` in thought (the caller knows it is allocated, and names it once).
    pub fn free(&mut self, kind: Kind, id: u32) {
        let k = kind as usize;
        let Some(class) = self.pool.class(kind) else {
            return;
        };
        let c = class.chunk_of.quotient(id);
        let n = self.freed[k].entry(c).or_insert(0);
        *n += 1;
        self.counts[k].free += 1;
        if *n == class.used_in_chunk[c as usize] {
            self.counts[k].empty += 1;
        }
    }

    pub fn fits(&self, pages: u64, slots: u64) -> bool {
        fits(
            self.counts[0],
            self.pool.slots.as_ref().map(|_| self.counts[1]),
            u64::from(self.pool.num_free_chunks),
            pages,
            slots,
        )
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
