//! `check_integrity`: recount the chunk owners and every class's bitsets and compare with the
//! counters. O(pool); for tests and debugging, never on the request path.

use super::{Kind, Owner, Pool};
use crate::error::{KernError, Result};

impl Pool {
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
