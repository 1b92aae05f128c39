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

    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    pub fn first(&self) -> Option<u32> {
        self.words
            .iter()
            .position(|&w| w != 0)
            .map(|i| i as u32 * 64 + self.words[i].trailing_zeros())
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

    /// Visit the clear bits in `lo..hi`, ascending (`up`) or descending, until `visit` returns
    /// false.
    fn scan(&self, lo: u32, hi: u32, up: bool, mut visit: impl FnMut(u32) -> bool) {
        if lo >= hi {
            return;
        }
        let (wlo, whi) = (lo / 64, (hi - 1) / 64);
        let mask = |w: u32| {
            let mut m = u64::MAX;
            if w == wlo {
                m &= u64::MAX << (lo % 64);
            }
            if w == whi && !hi.is_multiple_of(64) {
                m &= (1u64 << (hi % 64)) - 1;
            }
            m
        };
        let mut step = |w: u32| -> bool {
            let mut bits = !self.words[w as usize] & mask(w);
            while bits != 0 {
                let b = if up {
                    bits.trailing_zeros()
                } else {
                    63 - bits.leading_zeros()
                };
                bits &= !(1u64 << b);
                if !visit(w * 64 + b) {
                    return false;
                }
            }
            true
        };
        if up {
            for w in wlo..=whi {
                if !step(w) {
                    return;
                }
            }
        } else {
            for w in (wlo..=whi).rev() {
                if !step(w) {
                    return;
                }
            }
        }
    }

    /// The clear bits in `lo..hi`, ascending (`up`) or descending, up to `n` of them.
    pub fn clear_in(&self, lo: u32, hi: u32, up: bool, n: usize, out: &mut Vec<u32>) {
        if n == 0 {
            return;
        }
        let mut left = n;
        self.scan(lo, hi, up, |b| {
            out.push(b);
            left -= 1;
            left > 0
        });
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
        b.clear_in(0, 8, true, 10, &mut out);
        assert_eq!(out, vec![0, 1, 2, 4, 5, 6, 7]);
        out.clear();
        b.clear_in(120, 140, false, 3, &mut out);
        assert_eq!(out, vec![139, 138, 137]);
        out.clear();
        b.clear_in(128, 132, true, 10, &mut out);
        assert_eq!(out, vec![128, 129, 131]);
        assert!(b.clear(3) && !b.clear(3));
        assert!(!b.get(500));
        assert_eq!(Bits::full(70).count(), 70);
        assert_eq!(Bits::full(64).last(), Some(63));
    }
}
