//! How a chunk is cut (`Layout`): into pages exactly, and into state slots at a stride that
//! divides it. Ids imply addresses (page `p` at `p * page_bytes`, slot `s` at
//! `s * slot_stride`), which is why the stride must divide the chunk: a chunk then changes
//! class without moving a byte.

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
    pub(super) fn new(base: u64, page_bytes: u64, slot_bytes: u64) -> Layout {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Pool;

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
}
