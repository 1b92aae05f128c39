//! The floor under any exact prefix cache on `kern.bench.prefix`'s trace: the memory work a
//! request cannot avoid, timed as the benchmark times kern, so that kern's per-request cost
//! and its growth from 2,000 to 20,000 requests can be read against what the machine allows.
//!
//! ```sh
//! python -m kern.bench.prefix --export /tmp/floor      # writes the traces and kern's hits
//! cargo run --release --example floor -- /tmp/floor    # in rust/kern_pool
//! ```
//!
//! Per request, with no tree, no books and no Python: at its start compare the prompt's hit
//! (kern's hit length, read from the export) with the stored tokens, its system prompt's from
//! one shared copy and the rest from the conversation's own copy, and copy the hit's page ids
//! into a fresh list, ids for the rest after them; at its end compare the whole key and the
//! request's page ids with what is stored and store what is new. Nothing is ever evicted, so
//! the stored copies are never fewer than a cache's: the floor's memory is touched in the same
//! order as a tree's, at the same distance between a conversation's turns.
//!
//! Layout of `trace_N.bin` (little-endian): `KERNTRC1`, u64 sessions S and ops O, u64
//! offsets[S + 1] into the tokens, u64 system-prompt index[S], u64 system-prompt length[S],
//! u64 ops[O][4] (0 start / 1 finish, session, prompt length, prompt + answer length), u32
//! tokens. `hits_N_pP.bin`: u64 hit length per request, in start order.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

struct Trace {
    offsets: Vec<u64>,
    template: Vec<u64>,
    template_len: Vec<u64>,
    ops: Vec<[u64; 4]>,
    tokens: Vec<u32>,
}

fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn read_trace(path: &std::path::Path) -> Result<Trace, String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if b.len() < 24 || &b[..8] != b"KERNTRC1" {
        return Err(format!("{}: not a kern trace", path.display()));
    }
    let head = u64s(&b[8..24]);
    let (s, o) = (head[0] as usize, head[1] as usize);
    let mut at = 24;
    let truncated = || format!("{}: truncated", path.display());
    let mut take = |count: usize, size: usize| -> Result<&[u8], String> {
        let end = count
            .checked_mul(size)
            .and_then(|n| n.checked_add(at))
            .ok_or_else(truncated)?;
        let out = b.get(at..end).ok_or_else(truncated)?;
        at = end;
        Ok(out)
    };
    let offsets = u64s(take(s.saturating_add(1), 8)?);
    let template = u64s(take(s, 8)?);
    let template_len = u64s(take(s, 8)?);
    let ops: Vec<[u64; 4]> = u64s(take(o, 32)?)
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect();
    let n = *offsets.last().unwrap_or(&0) as usize;
    let tokens = take(n, 4)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    // What the replay indexes by must hold, or it would panic mid-run: say so instead.
    let bad = |what: &str| Err(format!("{}: {what}", path.display()));
    if offsets.windows(2).any(|w| w[0] > w[1]) {
        return bad("offsets decrease");
    }
    for (k, &tl) in template_len.iter().enumerate() {
        if tl > offsets[k + 1] - offsets[k] {
            return bad("a system prompt longer than its conversation");
        }
    }
    // A conversation's turns only grow: its stored copy is extended, never cut.
    let mut grown = vec![0u64; s];
    for &[kind, session, prompt, full] in &ops {
        let fits = (session as usize) < s
            && prompt <= full
            && full <= offsets[session as usize + 1] - offsets[session as usize]
            && prompt >= template_len[session as usize]
            && full >= grown[session as usize];
        if kind > 1 || !fits {
            return bad("an op out of range");
        }
        grown[session as usize] = full;
    }
    Ok(Trace {
        offsets,
        template,
        template_len,
        ops,
        tokens,
    })
}

/// One replay: (us per request in all, us per request at starts).
fn replay(t: &Trace, hits: &[u64], pt: usize) -> (f64, f64) {
    let sessions = t.offsets.len() - 1;
    let mut shared: BTreeMap<u64, (Vec<u32>, Vec<u32>)> = BTreeMap::new();
    let mut own_tokens: Vec<Vec<u32>> = vec![Vec::new(); sessions];
    let mut own_pages: Vec<Vec<u32>> = vec![Vec::new(); sessions];
    let mut held: Vec<Vec<u32>> = vec![Vec::new(); sessions];
    let (mut next_id, mut r) = (0u32, 0usize);
    let (mut all, mut starts) = (0u128, 0u128);
    for &[kind, s, prompt, full] in &t.ops {
        let s = s as usize;
        let src = &t.tokens[t.offsets[s] as usize..t.offsets[s + 1] as usize];
        let tl = t.template_len[s] as usize / pt * pt;
        let (tt, tp) = shared.entry(t.template[s]).or_insert_with(|| {
            let k = (tl / pt) as u32;
            next_id += k;
            (src[..tl].to_vec(), (next_id - k..next_id).collect())
        });
        if kind == 0 {
            let h = hits[r] as usize;
            r += 1;
            let key = src[..prompt as usize].to_vec(); // a fresh key, as the scheduler makes
            let t0 = Instant::now();
            let a = h.min(tl);
            let mut same = key[..a] == tt[..a];
            // A hit may run a token or two into another conversation's turn (random tails
            // can share a first token): the floor compares only the conversation's own copy.
            let own = h.saturating_sub(tl).min(own_tokens[s].len());
            same &= key[tl.min(h)..tl.min(h) + own] == own_tokens[s][..own];
            let np = (prompt as usize).div_ceil(pt);
            let mut out = Vec::with_capacity(np);
            out.extend_from_slice(&tp[..a / pt]);
            let own = (h / pt - a / pt).min(own_pages[s].len());
            out.extend_from_slice(&own_pages[s][..own]);
            out.resize(np, next_id);
            let dt = t0.elapsed().as_nanos();
            black_box(same);
            held[s] = out;
            all += dt;
            starts += dt;
        } else {
            let w = full as usize / pt * pt;
            let key = src[..w].to_vec();
            let t0 = Instant::now();
            let mut out = std::mem::take(&mut held[s]);
            out.resize((full as usize).div_ceil(pt), next_id);
            let have = own_tokens[s].len();
            let mut same = key[..tl] == tt[..];
            same &= key[tl..tl + have] == own_tokens[s][..];
            own_tokens[s].extend_from_slice(&key[tl + have..]);
            let hp = own_pages[s].len();
            same &= out[tl / pt..tl / pt + hp] == own_pages[s][..];
            own_pages[s].extend_from_slice(&out[tl / pt + hp..w / pt]);
            black_box(same);
            drop(out);
            all += t0.elapsed().as_nanos();
        }
    }
    let n = r as f64;
    (all as f64 / 1e3 / n, starts as f64 / 1e3 / n)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> Result<(), String> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: floor DIR [RUNS] (DIR from python -m kern.bench.prefix --export DIR)")?;
    let runs: usize = match std::env::args().nth(2) {
        Some(x) => match x.parse() {
            Ok(r) if r > 0 => r,
            _ => return Err(format!("RUNS: not a positive count: {x}")),
        },
        None => 5,
    };
    // (requests, page) -> hits file
    let mut found: BTreeMap<(usize, usize), std::path::PathBuf> = BTreeMap::new();
    for e in std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))? {
        let p = e.map_err(|e| e.to_string())?.path();
        let name = p.file_name().and_then(|x| x.to_str()).unwrap_or("");
        if let Some(rest) = name
            .strip_prefix("hits_")
            .and_then(|x| x.strip_suffix(".bin"))
        {
            if let Some((n, pt)) = rest.split_once("_p") {
                match (n.parse::<usize>(), pt.parse::<usize>()) {
                    (Ok(n), Ok(pt)) if n > 0 && pt > 0 => {
                        found.insert((n, pt), p);
                    }
                    _ => return Err(format!("{}: not hits_N_pP.bin", p.display())),
                }
            }
        }
    }
    if found.is_empty() {
        return Err(format!("{dir}: no hits_N_pP.bin files"));
    }
    let largest = found.keys().map(|k| k.0).max().unwrap_or(1);
    let mut per: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    println!("| requests | page | floor us/request | of which at starts |");
    println!("|---|---|---|---|");
    let mut traces: BTreeMap<usize, Trace> = BTreeMap::new();
    for (&(n, pt), hits_path) in &found {
        let t = match traces.entry(n) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let path = std::path::Path::new(&dir).join(format!("trace_{n}.bin"));
                e.insert(read_trace(&path)?)
            }
        };
        let t = &*t;
        let hits = u64s(&std::fs::read(hits_path).map_err(|e| e.to_string())?);
        let starts = t.ops.iter().filter(|o| o[0] == 0).count();
        if hits.len() != starts {
            return Err(format!(
                "{}: {} hits for {starts} requests",
                hits_path.display(),
                hits.len()
            ));
        }
        let prompts = t.ops.iter().filter(|o| o[0] == 0).map(|o| o[2]);
        if hits.iter().zip(prompts).any(|(&h, p)| h > p) {
            return Err(format!(
                "{}: a hit longer than its prompt",
                hits_path.display()
            ));
        }
        // As kern.bench.prefix: smaller traces replayed more often (up to 10x).
        let k = runs * (largest / n).clamp(1, 10);
        let rs: Vec<(f64, f64)> = (0..k).map(|_| replay(t, &hits, pt)).collect();
        let all = median(rs.iter().map(|x| x.0).collect());
        let st = median(rs.iter().map(|x| x.1).collect());
        per.insert((n, pt), all);
        println!("| {n} | {pt} | {all:.2} | {st:.2} |");
    }
    let smallest = found.keys().map(|k| k.0).min().unwrap_or(1);
    if smallest != largest {
        for pt in found
            .keys()
            .map(|k| k.1)
            .collect::<std::collections::BTreeSet<_>>()
        {
            if let (Some(a), Some(b)) = (per.get(&(smallest, pt)), per.get(&(largest, pt))) {
                println!(
                    "page {pt}: the floor's per-request cost at {largest} / at {smallest} \
                     requests: {:.2}x",
                    b / a
                );
            }
        }
    }
    Ok(())
}
