//! Making room (park or drop the coldest entries) and waking parked entries.
//!
//! A park that needs host room first plans, in thought, which parked entries it would drop (in
//! the order the real loop drops them, against a shadow of the host pool's books); only if
//! they free enough does it drop them. When locked entries hold the host room, the entry is
//! dropped instead and no parked entry is dropped for nothing.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::lru::LruKey;
use super::prefetch::{prefetch_node, prefetch_span, PREFETCH_BYTES};
use super::{books_agree, Prefix, Tier, ROOT};
use crate::error::{KernError, Result};
use crate::host::Host;
use crate::ids::{HostPageId, HostSlotId, NodeId, PageId, SlotId};
use crate::plan::{CopyPlan, Device, EntryKey, Evicted, HostTier, Room, Woken};
use crate::pool::{Kind, Pool};

impl Prefix {
    fn drop_parked(&mut self, i: u32, host: &mut Host) -> EntryKey {
        let key = self.key(i);
        let n = &self.nodes[i as usize];
        let states: Vec<u32> = n.snapshot.into_iter().collect();
        books_agree(host.free(&n.pages, &states));
        self.stats.parked_pages -= n.pages.len() as u64;
        self.stats.parked_states -= states.len() as u64;
        self.remove_node(i);
        self.stats.num_dropped_parked += 1;
        key
    }

    /// Give a resident node's device pages and snapshot back to the pool (the node keeps the
    /// stale ids until the caller replaces or removes it). Returns (pages, slots) freed.
    fn release_device(&mut self, i: u32, pool: &mut Pool) -> (u64, u64) {
        let n = &self.nodes[i as usize];
        self.owned_pages.put_all(&n.pages, false);
        books_agree(pool.free(Kind::Pages, &n.pages));
        let pages = n.pages.len() as u64;
        self.stats.resident_pages -= pages;
        let mut slots = 0;
        if let Some(s) = n.snapshot {
            self.owned_slots.clear(s);
            books_agree(pool.free(Kind::Slots, &[s]));
            self.stats.resident_states -= 1;
            slots = 1;
        }
        (pages, slots)
    }

    /// Drop `x` and everything under it, deepest first, one value each. Under a drop candidate
    /// there are only parked entries (a resident one would be colder, or deeper on a tie, and
    /// unlocked, so taken first), but a resident one would be dropped and reported too.
    fn drop_subtree(
        &mut self,
        x: u32,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        room: &mut Room,
    ) {
        let mut order = vec![x];
        let mut k = 0;
        while k < order.len() {
            order.extend_from_slice(&self.nodes[order[k] as usize].kids);
            k += 1;
        }
        for &j in order.iter().rev() {
            match (self.nodes[j as usize].tier, host.as_deref_mut()) {
                (Tier::Parked, Some(h)) => {
                    let key = self.drop_parked(j, h);
                    room.evicted.push(Evicted::Dropped { key, parked: true });
                }
                _ => {
                    let key = self.key(j);
                    let (p, s) = self.release_device(j, pool);
                    room.pages_freed += p;
                    room.slots_freed += s;
                    self.remove_node(j);
                    self.stats.num_dropped_resident += 1;
                    room.evicted.push(Evicted::Dropped { key, parked: false });
                }
            }
        }
    }

    fn park(
        &mut self,
        i: u32,
        pool: &mut Pool,
        host_pages: Vec<HostPageId>,
        host_states: Vec<HostSlotId>,
        room: &mut Room,
    ) -> CopyPlan<Device, HostTier> {
        let n = &self.nodes[i as usize];
        let plan = CopyPlan {
            pages: n
                .pages
                .iter()
                .zip(&host_pages)
                .map(|(&p, &h)| (PageId(p), h))
                .collect(),
            states: n
                .snapshot
                .zip(host_states.first())
                .map(|(s, &h)| (SlotId(s), h))
                .into_iter()
                .collect(),
        };
        let (p, s) = self.release_device(i, pool);
        room.pages_freed += p;
        room.slots_freed += s;
        self.stats.parked_pages += p;
        self.stats.parked_states += s;
        let parent = self.nodes[i as usize].parent;
        self.update(i, |n| {
            n.pages = host_pages.iter().map(|h| h.0).collect();
            n.snapshot = host_states.first().map(|h| h.0);
            n.tier = Tier::Parked;
        });
        self.update(parent, |p| p.num_resident_children -= 1);
        self.stats.num_parked += 1;
        plan
    }

    /// The parked entries the loop would drop, in its order, until `pages` pages and `states`
    /// states fit in the host; `None` if dropping every one it could would not make them fit.
    fn plan_parked_drops(&self, host: &Host, pages: usize, states: usize) -> Option<Vec<u32>> {
        let mut shadow = host.shadow();
        let mut set = self.parked_lru.iter().peekable();
        // Parents that become candidates once their children are dropped in thought.
        let mut promoted: BinaryHeap<Reverse<LruKey>> = BinaryHeap::new();
        let mut gone: HashMap<u32, usize> = HashMap::new();
        let mut victims = Vec::new();
        loop {
            let next = match (set.peek(), promoted.peek()) {
                (Some(&&a), Some(&Reverse(b))) if b < a => promoted.pop().map(|Reverse(k)| k),
                (Some(_), _) => set.next().copied(),
                (None, _) => promoted.pop().map(|Reverse(k)| k),
            };
            let (_, _, y) = next?;
            victims.push(y);
            let n = &self.nodes[y as usize];
            for &p in &n.pages {
                shadow.free(Kind::Pages, p);
            }
            if let Some(s) = n.snapshot {
                shadow.free(Kind::Slots, s);
            }
            if shadow.fits(pages as u64, states as u64) {
                return Some(victims);
            }
            let parent = n.parent;
            let p = &self.nodes[parent as usize];
            if parent != ROOT && p.tier == Tier::Parked && p.lock == 0 {
                let g = gone.entry(parent).or_insert(0);
                *g += 1;
                if *g == p.kids.len() {
                    promoted.push(Reverse((p.stamp, Reverse(p.end()), parent)));
                }
            }
        }
    }

    /// One step of the make-room loop: take the coldest unlocked resident entry; park it if
    /// `park` and the host has or can make room (dropping the coldest parked entries, only if
    /// that is enough), else drop it. Appends what was taken; false when nothing is evictable.
    fn evict_one(
        &mut self,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        park: bool,
        room: &mut Room,
    ) -> bool {
        let mut coldest = self.resident_lru.iter();
        let Some(&(_, _, x)) = coldest.next() else {
            return false;
        };
        // The coldest entries are cold in memory too: ask for this one's page list whole, and
        // for the next one's node, before the books read them.
        let xn = &self.nodes[x as usize];
        prefetch_span(&xn.pages, PREFETCH_BYTES);
        prefetch_node(&self.nodes[xn.parent as usize]);
        if let Some(&(_, _, y)) = coldest.next() {
            prefetch_node(&self.nodes[y as usize]);
        }
        if let Some(host) = host.as_deref_mut().filter(|_| park) {
            let n = &self.nodes[x as usize];
            let (np, ns) = (n.pages.len(), usize::from(n.snapshot.is_some()));
            let victims = if host.fits(np, ns) {
                Some(Vec::new())
            } else if host.could_ever_fit(np, ns) {
                self.plan_parked_drops(host, np, ns)
            } else {
                None
            };
            if let Some(victims) = victims {
                let dropped: Vec<EntryKey> = victims
                    .into_iter()
                    .map(|y| self.drop_parked(y, host))
                    .collect();
                if let Some((hp, hs)) = host.try_alloc(np, ns) {
                    let key = self.key(x);
                    let plan = self.park(x, pool, hp, hs, room);
                    room.evicted.push(Evicted::Parked { key, plan, dropped });
                    return true;
                }
                // Unreachable if the shadow's books agree with the host's: report the drops.
                debug_assert!(false, "planned host room did not fit");
                room.evicted.extend(
                    dropped
                        .into_iter()
                        .map(|key| Evicted::Dropped { key, parked: true }),
                );
            }
        }
        self.drop_subtree(x, pool, host, room);
        true
    }

    /// Evict until `pages` pages and `slots` state slots can be allocated together (room for
    /// that many more), or nothing more can be evicted. Evicts nothing for room that would not
    /// fit even in an empty pool. The device pages freed are free in the pool at once: land
    /// every returned plan before allocating again.
    pub fn make_room(
        &mut self,
        pool: &mut Pool,
        mut host: Option<&mut Host>,
        pages: u64,
        slots: u64,
        park: bool,
    ) -> Room {
        let mut room = Room::default();
        if pool.could_ever_fit(pages, slots) {
            while !pool.fits(pages, slots) {
                if !self.evict_one(pool, host.as_deref_mut(), park, &mut room) {
                    break;
                }
            }
        }
        room.fits = pool.fits(pages, slots);
        room
    }

    /// Bring every parked node from the root to `node` back to the device, and refresh the
    /// path. All or nothing: `PoolFull` (changing nothing) when the device lacks room for the
    /// pages and states together; make room and call again.
    pub fn wake(
        &mut self,
        pool: &mut Pool,
        host: Option<&mut Host>,
        node: NodeId,
    ) -> Result<Woken> {
        let last = self.resolve(node)?;
        let mut chain = Vec::new();
        let mut i = last;
        while i != ROOT {
            if self.nodes[i as usize].tier == Tier::Parked {
                chain.push(i);
            }
            i = self.nodes[i as usize].parent;
        }
        chain.reverse();
        let mut woken = Woken::default();
        if chain.is_empty() {
            // Nothing to bring back, but a wake is still a use of the path.
            self.touch_up(last);
            return Ok(woken);
        }
        let host = host.ok_or(KernError::NoHostTier)?;
        let np: usize = chain
            .iter()
            .map(|&j| self.nodes[j as usize].pages.len())
            .sum();
        let ns = chain
            .iter()
            .filter(|&&j| self.nodes[j as usize].snapshot.is_some())
            .count();
        if !pool.fits(np as u64, ns as u64) {
            return Err(KernError::RoomFull {
                pages: np as u64,
                slots: ns as u64,
                pages_free: pool.available(Kind::Pages),
            });
        }
        let dev_pages = pool.alloc(Kind::Pages, np)?;
        let dev_slots = pool.alloc(Kind::Slots, ns)?;
        let (mut pi, mut si) = (0, 0);
        for j in chain {
            let n = &self.nodes[j as usize];
            let k = n.pages.len();
            let dev: Vec<u32> = dev_pages[pi..pi + k].to_vec();
            pi += k;
            woken.plan.pages.extend(
                n.pages
                    .iter()
                    .zip(&dev)
                    .map(|(&h, &d)| (HostPageId(h), PageId(d))),
            );
            let old_state: Vec<u32> = n.snapshot.into_iter().collect();
            let new_state = n.snapshot.map(|h| {
                let d = dev_slots[si];
                si += 1;
                woken.plan.states.push((HostSlotId(h), SlotId(d)));
                d
            });
            books_agree(host.free(&n.pages, &old_state));
            self.owned_pages.put_all(&dev, true);
            if let Some(s) = new_state {
                self.owned_slots.set(s);
            }
            let st = &mut self.stats;
            st.parked_pages -= k as u64;
            st.resident_pages += k as u64;
            st.parked_states -= old_state.len() as u64;
            st.resident_states += old_state.len() as u64;
            st.num_woken += 1;
            let parent = self.nodes[j as usize].parent;
            self.update(j, |n| {
                n.pages = dev;
                n.snapshot = new_state;
                n.tier = Tier::Resident;
            });
            self.update(parent, |p| p.num_resident_children += 1);
            woken.keys.push(self.key(j));
        }
        self.touch_up(last);
        Ok(woken)
    }
}
