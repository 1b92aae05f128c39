//! A fixed-size bitset: the pool's books (which positions are allocated, which chunks are free,
//! empty or partly used) and the tree's (which pages and slots it owns). Lowest and highest set
//! bits are found a word at a time, so a book of 1,024 chunks is searched in 16 reads.

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bits {
    words: Vec<u64>,
    len: u32,
}

impl Bits {
    pub fn new(len: u32) -> Self {
        Bits {
            words: vec![0; (len as usize).div_ceil(64)],
            len,
        }
    }

    /// Every bit in `0..len` set.
    pub fn full(len: u32) -> Self {
        let mut b = Bits::new(len);
        for w in &mut b.words {
            *w = u64::MAX;
        }
        if !len.is_multiple_of(64) {
            if let Some(last) = b.words.last_mut() {
                *last = (1u64 << (len % 64)) - 1;
            }
        }
        b
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    /// Out-of-range bits read as clear.
    #[inline]
    pub fn get(&self, i: u32) -> bool {
        i < self.len && self.words[(i / 64) as usize] & (1u64 << (i % 64)) != 0
    }

    /// Set bit `i` (`i < len`); returns whether it was set before.
    #[inline]
    pub fn set(&mut self, i: u32) -> bool {
        let w = &mut self.words[(i / 64) as usize];
        let m = 1u64 << (i % 64);
        let was = *w & m != 0;
        *w |= m;
        was
    }

    /// Clear bit `i` (`i < len`); returns whether it was set before.
    #[inline]
    pub fn clear(&mut self, i: u32) -> bool {
        let w = &mut self.words[(i / 64) as usize];
        let m = 1u64 << (i % 64);
        let was = *w & m != 0;
        *w &= !m;
        was
    }

    /// Word `w` (bits `64w..64w+64`); words past the end read as clear.
    #[inline]
    pub fn word(&self, w: u32) -> u64 {
        self.words.get(w as usize).copied().unwrap_or(0)
    }

    /// Set the bits of `mask` in word `w` (`w` a word of this set).
    #[inline]
    pub fn or_word(&mut self, w: u32, mask: u64) {
        self.words[w as usize] |= mask;
    }

    /// Clear word `w` (`w` a word of this set).
    #[inline]
    pub fn zero_word(&mut self, w: u32) {
        self.words[w as usize] = 0;
    }

    pub fn first(&self) -> Option<u32> {
        self.words
            .iter()
            .position(|&w| w != 0)
            .map(|i| i as u32 * 64 + self.words[i].trailing_zeros())
    }

    /// The lowest set bit at or above `i`.
    pub fn first_from(&self, i: u32) -> Option<u32> {
        let w = (i / 64) as usize;
        let head = self.words.get(w)? & (u64::MAX << (i % 64));
        if head != 0 {
            return Some(w as u32 * 64 + head.trailing_zeros());
        }
        self.words[w + 1..]
            .iter()
            .position(|&x| x != 0)
            .map(|k| (w + 1 + k) as u32 * 64 + self.words[w + 1 + k].trailing_zeros())
    }

    /// The highest set bit at or below `i`.
    pub fn last_to(&self, i: u32) -> Option<u32> {
        let w = ((i / 64) as usize).min(self.words.len().checked_sub(1)?);
        let keep = if (i / 64) as usize > w {
            u64::MAX
        } else {
            u64::MAX >> (63 - i % 64)
        };
        let head = self.words[w] & keep;
        if head != 0 {
            return Some(w as u32 * 64 + 63 - head.leading_zeros());
        }
        self.words[..w]
            .iter()
            .rposition(|&x| x != 0)
            .map(|k| k as u32 * 64 + 63 - self.words[k].leading_zeros())
    }

    pub fn last(&self) -> Option<u32> {
        self.words
            .iter()
            .rposition(|&w| w != 0)
            .map(|i| i as u32 * 64 + 63 - self.words[i].leading_zeros())
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    fn mask(lo: u32, hi: u32, w: u32) -> u64 {
        let (wlo, whi) = (lo / 64, (hi - 1) / 64);
        let mut m = u64::MAX;
        if w == wlo {
            m &= u64::MAX << (lo % 64);
        }
        if w == whi && !hi.is_multiple_of(64) {
            m &= (1u64 << (hi % 64)) - 1;
        }
        m
    }

    /// Set up to `n` clear bits in `lo..hi`, lowest first (`up`) or highest first, a word at a
    /// time, appending their indices to `out`.
    pub fn take_clear(&mut self, lo: u32, hi: u32, up: bool, n: usize, out: &mut Vec<u32>) {
        if lo >= hi || n == 0 {
            return;
        }
        let (wlo, whi) = (lo / 64, (hi - 1) / 64);
        let mut left = n;
        let mut w = if up { wlo } else { whi };
        loop {
            let word = &mut self.words[w as usize];
            let mut free = !*word & Self::mask(lo, hi, w);
            if free == u64::MAX && left >= 64 {
                // A whole free word: take it in one go.
                *word = u64::MAX;
                let base = w * 64;
                if up {
                    out.extend(base..base + 64);
                } else {
                    out.extend((base..base + 64).rev());
                }
                left -= 64;
                free = 0;
            }
            let mut took = 0u64;
            while free != 0 && left > 0 {
                let b = if up {
                    free.trailing_zeros()
                } else {
                    63 - free.leading_zeros()
                };
                free &= !(1u64 << b);
                took |= 1u64 << b;
                out.push(w * 64 + b);
                left -= 1;
            }
            *word |= took;
            if left == 0 || (up && w == whi) || (!up && w == wlo) {
                return;
            }
            w = if up { w + 1 } else { w - 1 };
        }
    }

    /// Set (`on`) or clear the bits of `ids` (each `< len`), a word at a time for ids that come
    /// in runs.
    pub fn put_all(&mut self, ids: &[u32], on: bool) {
        let (mut w, mut mask) = (u32::MAX, 0u64);
        for &id in ids {
            let wi = id / 64;
            if wi != w {
                if mask != 0 {
                    self.put_word(w, mask, on);
                }
                (w, mask) = (wi, 0);
            }
            mask |= 1u64 << (id % 64);
        }
        if mask != 0 {
            self.put_word(w, mask, on);
        }
    }

    #[inline]
    fn put_word(&mut self, w: u32, mask: u64, on: bool) {
        let word = &mut self.words[w as usize];
        if on {
            *word |= mask;
        } else {
            *word &= !mask;
        }
    }

    /// Clear the bits of `ids`, all or nothing: `Err(i)` (nothing changed) names the first id
    /// that is out of range, clear already, or named twice. Consecutive ids in one word are
    /// checked and cleared together.
    pub fn clear_all(&mut self, ids: &[u32]) -> std::result::Result<(), usize> {
        let (mut w, mut mask, mut group) = (u32::MAX, 0u64, 0usize);
        let mut failed = false;
        for (i, &id) in ids.iter().enumerate() {
            if id >= self.len {
                failed = true;
                break;
            }
            let (wi, b) = (id / 64, 1u64 << (id % 64));
            if wi != w {
                if mask != 0 {
                    let word = &mut self.words[w as usize];
                    if *word & mask != mask {
                        failed = true;
                        break;
                    }
                    *word &= !mask;
                }
                (w, mask, group) = (wi, 0, i);
            }
            if mask & b != 0 {
                failed = true;
                break;
            }
            mask |= b;
        }
        if !failed && mask != 0 {
            let word = &mut self.words[w as usize];
            if *word & mask == mask {
                *word &= !mask;
                return Ok(());
            }
            failed = true;
        }
        if !failed {
            return Ok(());
        }
        // Put back what earlier words cleared, then find the first bad id one at a time.
        for &id in &ids[..group] {
            self.set(id);
        }
        for (i, &id) in ids.iter().enumerate() {
            if id >= self.len || !self.clear(id) {
                for &p in &ids[..i] {
                    self.set(p);
                }
                return Err(i);
            }
        }
        // Unreachable: the fast pass failed, so the slow one does too.
        Err(ids.len())
    }
}

/// Division by a fixed divisor without a divide instruction (a page's chunk, per freed page):
/// a 64x64-bit multiply, exact for every u32 numerator (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019). A hardware divide was a third of a free's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divisor {
    d: u32,
    m: u64,
}

impl Divisor {
    pub fn new(d: u32) -> Self {
        let d = d.max(1);
        Divisor {
            d,
            m: (u64::MAX / u64::from(d)).wrapping_add(1),
        }
    }

    #[inline]
    pub fn quotient(self, n: u32) -> u32 {
        if self.d == 1 {
            return n;
        }
        ((u128::from(self.m) * u128::from(n)) >> 64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_last_and_clear_runs() {
        let mut b = Bits::new(200);
        assert_eq!((b.first(), b.last()), (None, None));
        b.set(3);
        b.set(130);
        assert_eq!((b.first(), b.last(), b.count()), (Some(3), Some(130), 2));
        let mut out = Vec::new();
        b.take_clear(0, 8, true, 10, &mut out);
        assert_eq!(out, vec![0, 1, 2, 4, 5, 6, 7]);
        out.clear();
        b.take_clear(120, 140, false, 3, &mut out);
        assert_eq!(out, vec![139, 138, 137]);
        out.clear();
        b.take_clear(126, 132, true, 10, &mut out);
        assert_eq!(out, vec![126, 127, 128, 129, 131]);
        assert_eq!(b.count(), 2 + 7 + 3 + 5);
        assert!(b.clear(3) && !b.clear(3));
        assert!(!b.get(500));
        assert_eq!(Bits::full(70).count(), 70);
        assert_eq!(Bits::full(64).last(), Some(63));
    }

    #[test]
    fn first_from_and_last_to() {
        let mut b = Bits::new(300);
        for i in [0, 63, 64, 130, 299] {
            b.set(i);
        }
        let want_from = |i: u32| (i..300).find(|&j| b.get(j));
        let want_to = |i: u32| (0..=i.min(299)).rev().find(|&j| b.get(j));
        for i in 0..320 {
            assert_eq!(b.first_from(i), want_from(i), "from {i}");
            assert_eq!(b.last_to(i), want_to(i), "to {i}");
        }
        assert_eq!(Bits::new(0).last_to(5), None);
        assert_eq!(Bits::new(0).first_from(0), None);
    }

    #[test]
    fn clear_all_is_all_or_nothing() {
        let mut b = Bits::new(300);
        let mut ids = Vec::new();
        b.take_clear(0, 300, true, 200, &mut ids);
        let before = b.clone();
        for (bad, at) in [
            (vec![5, 6, 7, 7], 3),
            (vec![5, 6, 250], 2),
            (vec![1, 2, 100, 64, 64], 4),
            (vec![0, 1, 2, 300], 3),
        ] {
            assert_eq!(b.clear_all(&bad), Err(at), "{bad:?}");
            assert_eq!(b, before, "{bad:?}");
        }
        assert_eq!(b.clear_all(&[199, 3, 64, 65, 2]), Ok(()));
        assert_eq!(b.count(), 195);
    }

    #[test]
    fn divisor_is_exact() {
        for d in [1u32, 2, 3, 7, 16, 1000, 4097, 65_535, 1 << 20, u32::MAX] {
            let q = Divisor::new(d);
            for n in [
                0u32,
                1,
                d - 1,
                d,
                d.wrapping_add(1),
                12_345_678,
                u32::MAX - 1,
                u32::MAX,
            ] {
                assert_eq!(q.quotient(n), n / d, "{n} / {d}");
            }
        }
    }
}
