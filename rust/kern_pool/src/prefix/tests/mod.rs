//! The tree's unit tests, through `Cache` as a scheduler drives it, one file per concept:
//! the walks and what a match reads (`walk`), eviction order (`lru`), locks (`lock`), insert
//! and release (`insert`), and making room, parking and waking (`evict`). The helpers here
//! build a small cache and put keys in it the way a scheduler does.

mod evict;
mod insert;
mod lock;
mod lru;
mod walk;

use crate::cache::{Cache, CacheConfig};
use crate::plan::Evicted;

const PT: u32 = 4;

fn cache(device_pages: u64, host_pages: u64, stateful: bool) -> Cache {
    let mut c = Cache::new(CacheConfig {
        page_tokens: PT,
        page_bytes: 64,
        state_bytes: if stateful { 64 } else { 0 },
        device_bytes: device_pages * 64,
        host_bytes: host_pages * 64,
        min_slots: 0,
    })
    .unwrap();
    c.record_paths(true);
    c
}

/// Insert `tokens` as a scheduler does: match (locked), allocate the rest, insert, unlock.
fn put(c: &mut Cache, tokens: &[u32]) -> u32 {
    let m = c.match_prefix(tokens);
    let shared = (m.resident_len / PT) as usize;
    let need = tokens.len().div_ceil(PT as usize) - shared;
    let mut pages: Vec<u32> = m.pages[..shared].iter().map(|p| p.0).collect();
    pages.extend(c.alloc_pages(need).unwrap().into_iter().map(|p| p.0));
    let ins = c.insert(tokens, &pages, None).unwrap();
    if let Some(n) = m.node {
        c.unlock(n).unwrap();
    }
    c.check_integrity().unwrap();
    ins.held
}

fn hit(c: &Cache, tokens: &[u32]) -> (u32, u32) {
    let m = c.peek(tokens);
    (m.hit_len, m.resident_len)
}

fn evict_all_order(c: &mut Cache) -> Vec<Vec<u32>> {
    let room = c.make_room(c.device_geometry().num_pages(), 0, false);
    room.evicted
        .into_iter()
        .map(|e| match e {
            Evicted::Dropped { key, .. } => key.tokens.unwrap(),
            other => panic!("{other:?}"),
        })
        .collect()
}
