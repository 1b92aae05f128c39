//! Property tests: drive the cache the way a scheduler does and land every plan into a model of
//! device pages, state slots and host slots that records which tokens each one holds. After
//! every step the cache checks its own invariants, every hit reads back exactly its tokens,
//! and the eviction counters equal what the returned values said. At the end, evicting
//! everything must bring every counter back to where it started. Without a host tier, a model
//! of every cached page's last use also checks that each evicted entry is, page by page, the
//! coldest unlocked page with nothing under it: exact LRU. (The Python model,
//! `tests/test_pool_model.py`, checks the order with a host tier too.)

use std::collections::{HashMap, HashSet};

use kern_pool::{Cache, CacheConfig, EntryKey, Evicted, KernError, PageId};
use proptest::prelude::*;

/// What a page or slot holds: the tokens written into it (pages) or the prefix a state
/// summarises (slots).
#[derive(Default)]
struct Memory {
    dev_pages: HashMap<u32, Vec<u32>>,
    host_pages: HashMap<u32, Vec<u32>>,
    dev_slots: HashMap<u32, Vec<u32>>,
    host_slots: HashMap<u32, Vec<u32>>,
}

#[derive(Default)]
struct Counts {
    parked: u64,
    dropped_resident: u64,
    dropped_parked: u64,
}

fn land(mem: &mut Memory, counts: &mut Counts, taken: Vec<Evicted>) {
    for e in taken {
        match e {
            Evicted::Parked { plan, dropped, .. } => {
                for (d, h) in plan.pages {
                    let v = mem.dev_pages.remove(&d.0).expect("parked page had content");
                    mem.host_pages.insert(h.0, v);
                }
                for (d, h) in plan.states {
                    let v = mem
                        .dev_slots
                        .remove(&d.0)
                        .expect("parked state had content");
                    mem.host_slots.insert(h.0, v);
                }
                counts.parked += 1;
                counts.dropped_parked += dropped.len() as u64;
            }
            Evicted::Dropped { parked: true, .. } => counts.dropped_parked += 1,
            Evicted::Dropped { parked: false, .. } => counts.dropped_resident += 1,
        }
    }
}

/// A cached page: the tokens before it and its own.
type PageKey = (Vec<u32>, Vec<u32>);

/// Every cached page with the tick of its last use and the locks that cover it, updated from
/// what the cache returned and the rules of `docs/pool.md` alone.
struct Recency {
    pt: usize,
    pages: HashMap<PageKey, (u64, u32)>,
    clock: u64,
    /// The paths that end at a state snapshot.
    snaps: HashSet<Vec<u32>>,
}

impl Recency {
    fn keys_of(&self, tokens: &[u32]) -> Vec<PageKey> {
        (0..tokens.len().div_ceil(self.pt))
            .map(|g| {
                let hi = ((g + 1) * self.pt).min(tokens.len());
                (
                    tokens[..g * self.pt].to_vec(),
                    tokens[g * self.pt..hi].to_vec(),
                )
            })
            .collect()
    }

    /// The pages a match of `q` reads, and its hit: the longest path, unless a page shorter
    /// than a page at a page boundary it passed ends at a snapshot deeper than any on it.
    fn lookup(&self, q: &[u32]) -> (usize, Vec<PageKey>) {
        let (hit, read) = self.lookup_longest(q);
        let pt = self.pt;
        let path = |k: &PageKey| [&k.0[..], &k.1[..]].concat();
        let deepest = read
            .iter()
            .filter(|k| Self::end(k) <= hit && self.snaps.contains(&path(k)))
            .map(Self::end)
            .max()
            .unwrap_or(0);
        let mut best: Option<(usize, PageKey)> = None;
        for g in 0..=read.len() {
            let h = g * pt;
            if h > hit || (g > 0 && read[g - 1].1.len() < pt) {
                break;
            }
            let rest = &q[h..];
            for p in self.pages.keys().filter(|p| p.0 == q[..h]) {
                let end = h + p.1.len();
                if p.1.len() < pt
                    && p.1.len() <= rest.len()
                    && rest[..p.1.len()] == p.1[..]
                    && self.snaps.contains(&path(p))
                    && end > best.as_ref().map_or(deepest, |b| b.0)
                {
                    best = Some((end, p.clone()));
                }
            }
        }
        match best {
            Some((end, p)) => {
                let mut read = read[..p.0.len() / pt].to_vec();
                read.push(p);
                (end, read)
            }
            None => (hit, read),
        }
    }

    /// The pages the longest cached path of `q` reads, and its hit.
    fn lookup_longest(&self, q: &[u32]) -> (usize, Vec<PageKey>) {
        let (pt, mut hit, mut read) = (self.pt, 0, Vec::new());
        loop {
            let rest = &q[hit..];
            let k = (q[..hit].to_vec(), rest[..rest.len().min(pt)].to_vec());
            if rest.len() >= pt && self.pages.contains_key(&k) {
                read.push(k);
                hit += pt;
                continue;
            }
            let here: Vec<&PageKey> = self.pages.keys().filter(|p| p.0 == q[..hit]).collect();
            let exact = here.iter().find(|p| p.1 == rest);
            let inside = here
                .iter()
                .filter(|p| rest.len() < pt && p.1.len() > rest.len() && p.1[..rest.len()] == *rest)
                .max_by_key(|p| self.pages[**p].0);
            let shorter = here
                .iter()
                .filter(|p| {
                    p.1.len() < pt && p.1.len() <= rest.len() && rest[..p.1.len()] == p.1[..]
                })
                .max_by_key(|p| p.1.len());
            if let (false, Some(p)) = (rest.is_empty(), exact.or(inside)) {
                read.push((*p).clone());
                hit = q.len();
            } else if let Some(p) = shorter {
                read.push((*p).clone());
                hit += p.1.len();
            }
            return (hit, read);
        }
    }

    fn touch(&mut self, keys: &[PageKey]) {
        self.clock += 1;
        for k in keys {
            self.pages.get_mut(k).expect("touched page cached").0 = self.clock;
        }
    }

    fn lock(&mut self, keys: &[PageKey], by: i32) {
        for k in keys {
            let e = self.pages.get_mut(k).expect("locked page cached");
            e.1 = e.1.checked_add_signed(by).expect("lock count");
        }
    }

    fn end(k: &PageKey) -> usize {
        k.0.len() + k.1.len()
    }

    /// The entry left the device: its pages, deepest first, must each be the coldest unlocked
    /// page with no page under it when it went.
    fn evicted(&mut self, key: &EntryKey) {
        let tokens = key.tokens.as_ref().expect("paths recorded");
        let keys = self.keys_of(tokens)[key.start as usize / self.pt..].to_vec();
        for k in keys.iter().rev() {
            let candidates = self.pages.iter().filter(|(p, e)| {
                e.1 == 0
                    && !(p.1.len() == self.pt
                        && self.pages.keys().any(|c| {
                            c.0.len() == Self::end(p)
                                && c.0[..] == [&p.0[..], &p.1[..]].concat()[..]
                        }))
            });
            let coldest = candidates
                .min_by_key(|(p, e)| (e.0, std::cmp::Reverse(Self::end(p))))
                .map(|(p, _)| p.clone());
            assert_eq!(coldest.as_ref(), Some(k), "evicted {k:?} out of LRU order");
            self.pages.remove(k);
            self.snaps.remove(&[&k.0[..], &k.1[..]].concat());
        }
    }

    /// An insert: the key's pages are cached and used now; a key ending inside a page the tree
    /// holds adds no page of its own unless a snapshot needs one.
    fn insert(&mut self, tokens: &[u32], snapshot: bool) {
        let (hit, read) = self.lookup_longest(tokens);
        if snapshot {
            self.snaps.insert(tokens.to_vec());
        }
        let mut keys = self.keys_of(tokens);
        let mut touched = keys.clone();
        let last = keys.last().cloned();
        if hit == tokens.len() && read.last() != last.as_ref() && !snapshot {
            keys.pop();
            touched = keys.clone();
            touched.extend(read.last().cloned());
        }
        for k in &keys {
            self.pages.entry(k.clone()).or_insert((0, 0));
        }
        self.touch(&touched);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Request {
        base: usize,
        extra: Vec<u32>,
        snapshot: bool,
        /// Pages by `take_pages_into` (one more than the key needs) and the end by `release`
        /// (which frees that page), instead of make_room + alloc and insert + unlock.
        fused: bool,
    },
    MakeRoom {
        pages: u64,
        park: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..4, prop::collection::vec(0u32..3, 0..24), any::<bool>(), any::<bool>())
            .prop_map(|(base, extra, snapshot, fused)| Op::Request { base, extra, snapshot, fused }),
        1 => (0u64..40, any::<bool>()).prop_map(|(pages, park)| Op::MakeRoom { pages, park }),
    ]
}

fn run(page_tokens: u32, device_pages: u64, host_pages: u64, stateful: bool, ops: Vec<Op>) {
    let page_bytes = 256;
    let cfg = CacheConfig {
        page_tokens,
        page_bytes,
        state_bytes: if stateful { 512 } else { 0 },
        device_bytes: device_pages * page_bytes,
        host_bytes: host_pages * page_bytes,
        min_slots: 2,
    };
    let mut cache = Cache::new(cfg).expect("valid config");
    let start = cache.stats();
    let bases: Vec<Vec<u32>> = (0..4u32)
        .map(|b| (0..(b * 7 % 19)).map(|i| 10 + (i * 31 + b) % 5).collect())
        .collect();
    let mut mem = Memory::default();
    let mut counts = Counts::default();
    let pt = page_tokens as usize;
    // The order check needs the entries' paths and no parked tier.
    let mut recency = (host_pages == 0).then(|| Recency {
        pt,
        pages: HashMap::new(),
        clock: 0,
        snaps: HashSet::new(),
    });
    cache.record_paths(recency.is_some());
    let check_order = |recency: &mut Option<Recency>, evicted: &[Evicted]| {
        if let Some(r) = recency.as_mut() {
            for e in evicted {
                match e {
                    Evicted::Dropped { key, parked: false } => r.evicted(key),
                    other => panic!("no host tier, yet {other:?}"),
                }
            }
        }
    };

    for op in ops {
        match op {
            Op::MakeRoom { pages, park } => {
                let room = cache.make_room(pages, 0, park);
                check_order(&mut recency, &room.evicted);
                land(&mut mem, &mut counts, room.evicted);
            }
            Op::Request {
                base,
                extra,
                snapshot,
                fused,
            } => {
                let mut tokens = bases[base].clone();
                tokens.extend(extra);
                if tokens.is_empty() {
                    continue;
                }
                let snapshot = snapshot && stateful;
                // Match locks what it returns.
                let mut m = cache.match_prefix_with(&tokens, Vec::new());
                let mut hit = m.hit_len as usize;
                let mut locked = Vec::new();
                if let Some(r) = recency.as_mut() {
                    let (want, read) = r.lookup(&tokens);
                    assert_eq!(want, hit, "hit of {tokens:?}");
                    r.lock(&read, 1);
                    r.touch(&read);
                    locked = read;
                }
                // Wake a parked hit, making room first if needed.
                if m.resident_len < m.hit_len {
                    let node = m.node.unwrap();
                    let plan = loop {
                        match cache.wake(node) {
                            Ok(plan) => break Some(plan),
                            Err(KernError::RoomFull { pages, slots, .. }) => {
                                let room = cache.make_room(pages, slots, true);
                                let stuck = room.evicted.is_empty();
                                land(&mut mem, &mut counts, room.evicted);
                                if stuck {
                                    break None;
                                }
                            }
                            Err(e) => panic!("wake: {e}"),
                        }
                    };
                    if let Some(woken) = plan {
                        for (h, d) in woken.plan.pages {
                            let v = mem.host_pages.remove(&h.0).expect("woken page had content");
                            mem.dev_pages.insert(d.0, v);
                        }
                        for (h, d) in woken.plan.states {
                            let v = mem
                                .host_slots
                                .remove(&h.0)
                                .expect("woken state had content");
                            mem.dev_slots.insert(d.0, v);
                        }
                    }
                    // Read the woken pages: a second match, its own lock, and the first one
                    // released.
                    let again = cache.match_prefix_with(&tokens, Vec::new());
                    cache.unlock(node).unwrap();
                    m = again;
                }
                // Whatever is resident must read back as exactly the hit's tokens.
                let resident = m.resident_len as usize;
                for (i, p) in m.pages.iter().enumerate() {
                    let want = &tokens[i * pt..((i + 1) * pt).min(resident)];
                    let have = &mem.dev_pages[&p.0];
                    assert_eq!(&have[..want.len()], want, "page {} at index {i}", p.0);
                }
                if let Some(st) = m.state {
                    if let Some(slot) = st.slot {
                        assert_eq!(mem.dev_slots[&slot.0], tokens[..st.len as usize]);
                    }
                }
                hit = hit.min(resident);
                // Our pages: the hit's full pages are shared; the page the hit ends in is copied.
                let shared = hit / pt;
                let total = tokens.len().div_ceil(pt);
                let need = (total - shared) as u64 + u64::from(snapshot);
                let fused = fused && !snapshot;
                let mut past = Vec::new(); // a page past the key (fused only), freed at the end
                let fresh = if fused {
                    let mut out = Vec::new();
                    let room = cache.take_pages_into(total - shared + 1, &mut out).unwrap();
                    assert_eq!(out.len(), if room.fits { total - shared + 1 } else { 0 });
                    check_order(&mut recency, &room.evicted);
                    land(&mut mem, &mut counts, room.evicted);
                    past = out.split_off(out.len().saturating_sub(1));
                    if room.fits {
                        Ok(out.into_iter().map(PageId).collect::<Vec<_>>())
                    } else {
                        Err(())
                    }
                } else {
                    let room = cache.make_room(need, u64::from(snapshot), true);
                    check_order(&mut recency, &room.evicted);
                    land(&mut mem, &mut counts, room.evicted);
                    // Pages without evicting more: when they are free, `take_pages_into` only
                    // allocates.
                    let n = total - shared;
                    let mut out = Vec::new();
                    if cache.pages_free() >= n as u64 {
                        let again = cache.take_pages_into(n, &mut out).unwrap();
                        assert!(again.fits && again.evicted.is_empty());
                        Ok(out.into_iter().map(PageId).collect())
                    } else {
                        Err(())
                    }
                };
                let Ok(fresh) = fresh else {
                    if let Some(node) = m.node {
                        cache.unlock(node).unwrap();
                    }
                    if let Some(r) = recency.as_mut() {
                        r.lock(&locked, -1);
                    }
                    cache.check_integrity().unwrap();
                    continue;
                };
                let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
                for (k, p) in fresh.iter().enumerate() {
                    let g = shared + k;
                    mem.dev_pages.insert(
                        p.0,
                        tokens[g * pt..((g + 1) * pt).min(tokens.len())].to_vec(),
                    );
                    pages.push(p.0);
                }
                let state = if snapshot {
                    match cache.alloc_slot() {
                        Ok(s) => {
                            mem.dev_slots.insert(s.0, tokens.clone());
                            Some(s)
                        }
                        Err(_) => None,
                    }
                } else {
                    None
                };
                // The tree takes what it lacks and frees the rest: every page and the slot are
                // the tree's or free afterwards.
                let ins = if fused {
                    // One call: insert, unlock the match's lock, free the page past the key.
                    cache
                        .release(&tokens, &pages, state, m.node, &past)
                        .unwrap()
                } else {
                    cache.insert(&tokens, &pages, state).unwrap()
                };
                assert!(ins.held as usize >= hit);
                if let Some(r) = recency.as_mut() {
                    r.insert(&tokens, state.is_some());
                    r.lock(&locked, -1);
                }
                // A free refuses a page the tree owns and one already free, and changes nothing.
                for p in pages.iter().chain(&past) {
                    assert!(
                        matches!(
                            cache.free_pages(&[*p]),
                            Err(KernError::OwnedByCache { .. } | KernError::NotAllocated { .. })
                        ),
                        "page {p} neither the tree's nor free"
                    );
                }
                if let (Some(node), false) = (m.node, fused) {
                    cache.unlock(node).unwrap();
                }
                // The request's own tokens now hit in full, unless (no snapshot at their end)
                // a deeper snapshot sits on a short sibling off their path.
                let again = cache.peek(&tokens);
                assert!(
                    again.hit_len as usize == tokens.len()
                        || (state.is_none() && again.state.is_some_and(|s| s.len == again.hit_len)),
                    "{tokens:?} hits {} after its insert",
                    again.hit_len
                );
            }
        }
        cache.check_integrity().unwrap();
        let s = cache.stats().tree;
        assert_eq!(
            (s.num_parked, s.num_dropped_resident, s.num_dropped_parked),
            (
                counts.parked,
                counts.dropped_resident,
                counts.dropped_parked
            ),
            "counters disagree with the returned values"
        );
    }
    if std::env::var_os("KERN_MODEL_STATS").is_some() {
        let s = cache.stats().tree;
        eprintln!(
            "parked {} woken {} dropped {}/{}",
            s.num_parked, s.num_woken, s.num_dropped_resident, s.num_dropped_parked
        );
    }
    // Evict everything resident: the device back at its start. What stays is parked entries,
    // and the host holds exactly their pages (check_integrity recounts that). Room for every
    // page that could ever be free (not the slots' floor: that room is never made).
    let all = start.device.pages_free;
    let room = cache.make_room(all, 0, false);
    check_order(&mut recency, &room.evicted);
    land(&mut mem, &mut counts, room.evicted);
    cache.check_integrity().unwrap();
    let end = cache.stats();
    assert_eq!(end.tree.resident_pages, 0);
    assert_eq!(end.device.pages_used, 0);
    assert_eq!(end.device.slots_used, 0);
    assert_eq!(end.device.pages_free, start.device.pages_free);
    assert_eq!(end.device.slots_free, start.device.slots_free);
    if let (Some(h0), Some(h1)) = (start.host, end.host) {
        assert_eq!(
            (h1.pages_used, h1.slots_used),
            (end.tree.parked_pages, end.tree.parked_states)
        );
        assert!(h1.pages_used > 0 || h1.pages_free == h0.pages_free);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn plans_land_and_nothing_leaks(
        page_tokens in prop_oneof![Just(1u32), Just(3), Just(4), Just(16)],
        device_pages in 8u64..64,
        host_pages in prop_oneof![Just(0u64), 4u64..48],
        stateful in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(page_tokens, device_pages, host_pages, stateful, ops);
    }
}
