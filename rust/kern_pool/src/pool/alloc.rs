//! Allocating and freeing objects, and claiming a chunk for a class when its own run out.
//! Both are all or nothing: an allocation that could not finish gives back what it took, and a
//! free that meets a bad id changes nothing. The fill order here is what `fits` assumes (see
//! `room.rs`).

use super::{Kind, Owner, Pool};
use crate::error::{KernError, Result};

impl Pool {
    /// Take one more chunk for `kind`: a free one (lowest for pages, highest for slots), else an
    /// empty chunk of the other class above its floor. The caller has checked that one exists.
    pub(super) fn claim_chunk(&mut self, kind: Kind) -> Option<u32> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
