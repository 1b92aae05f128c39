//! Locks: each node counts the locks taken on its own handle (what `unlock` may release) and
//! the locks on itself and its descendants (what keeps a locked path out of eviction).

use super::{Prefix, ROOT};
use crate::error::{KernError, Result};
use crate::ids::NodeId;

impl Prefix {
    pub(super) fn lock_index(&mut self, i: u32) {
        self.nodes[i as usize].own_lock += 1;
        let mut j = i;
        while j != ROOT {
            let n = &mut self.nodes[j as usize];
            if n.lru.is_some() {
                self.update(j, |n| n.lock += 1);
            } else {
                n.lock += 1;
            }
            j = self.nodes[j as usize].parent;
        }
    }

    /// Lock `node` and its ancestors so eviction leaves them alone. Locks nest.
    #[cfg(test)]
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        let i = self.resolve(node)?;
        self.lock_index(i);
        Ok(())
    }

    /// What `unlock(node)` would refuse, changing nothing; the node's index when it would not.
    /// Any handle without a lock is `NotLocked`, a dead one included: a locked node is never
    /// removed, so a dead handle holds no lock.
    pub fn check_unlock(&self, node: NodeId) -> Result<u32> {
        let handle = node.to_u64();
        let i = self.resolve(node).map_err(|_| KernError::NotLocked {
            handle,
            live: false,
        })?;
        if self.nodes[i as usize].own_lock == 0 {
            return Err(KernError::NotLocked { handle, live: true });
        }
        Ok(i)
    }

    /// Release one lock taken on `node`'s own handle. `NotLocked` (changing nothing) when none
    /// is held on it, even if a descendant's lock covers it.
    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        let i = self.check_unlock(node)?;
        self.nodes[i as usize].own_lock -= 1;
        let mut j = i;
        while j != ROOT {
            let n = &self.nodes[j as usize];
            if n.lock == 1 {
                self.update(j, |n| n.lock -= 1);
            } else {
                self.nodes[j as usize].lock -= 1;
            }
            j = self.nodes[j as usize].parent;
        }
        Ok(())
    }
}
