//! Property tests: drive the cache the way a scheduler does and land every plan into a model of
//! device pages, state slots and host slots that records which tokens each one holds. After
//! every step the cache checks its own invariants, every hit reads back exactly its tokens,
//! and the eviction counters equal what the returned values said. At the end, evicting
//! everything must bring every counter back to where it started.

use std::collections::HashMap;

use kern_pool::{Cache, CacheConfig, Evicted, KernError};
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

#[derive(Clone, Debug)]
enum Op {
    Request {
        base: usize,
        extra: Vec<u32>,
        snapshot: bool,
    },
    MakeRoom {
        pages: u64,
        park: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..4, prop::collection::vec(0u32..3, 0..24), any::<bool>())
            .prop_map(|(base, extra, snapshot)| Op::Request { base, extra, snapshot }),
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

    for op in ops {
        match op {
            Op::MakeRoom { pages, park } => {
                let room = cache.make_room(pages, 0, park);
                land(&mut mem, &mut counts, room.evicted);
            }
            Op::Request {
                base,
                extra,
                snapshot,
            } => {
                let mut tokens = bases[base].clone();
                tokens.extend(extra);
                if tokens.is_empty() {
                    continue;
                }
                let snapshot = snapshot && stateful;
                // Match locks what it returns.
                let mut m = cache.match_prefix(&tokens);
                let mut hit = m.hit_len as usize;
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
                    if let Some(plan) = plan {
                        for (h, d) in plan.pages {
                            let v = mem.host_pages.remove(&h.0).expect("woken page had content");
                            mem.dev_pages.insert(d.0, v);
                        }
                        for (h, d) in plan.states {
                            let v = mem
                                .host_slots
                                .remove(&h.0)
                                .expect("woken state had content");
                            mem.dev_slots.insert(d.0, v);
                        }
                    }
                    // Read the woken pages: a second match, its own lock, and the first one
                    // released.
                    let again = cache.match_prefix(&tokens);
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
                let room = cache.make_room(need, u64::from(snapshot), true);
                land(&mut mem, &mut counts, room.evicted);
                let Ok(fresh) = cache.alloc_pages(total - shared) else {
                    if let Some(node) = m.node {
                        cache.unlock(node).unwrap();
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
                let ins = cache.insert(&tokens, &pages, state).unwrap();
                assert!(ins.held as usize >= hit);
                for p in &pages {
                    assert!(
                        cache.owns_page(*p) || cache.free_pages(&[*p]).is_err(),
                        "page {p} neither the tree's nor free"
                    );
                }
                if let Some(node) = m.node {
                    cache.unlock(node).unwrap();
                }
                // The request's own tokens now hit in full.
                let again = cache.peek(&tokens);
                assert_eq!(again.hit_len as usize, tokens.len());
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
    // and the host holds exactly their pages (check_integrity recounts that).
    let all = u64::from(cache.pool().num_pages());
    let room = cache.make_room(all, 0, false);
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
