//! Cache-line prefetch hints for the walks and the eviction loop: a step down asks for the
//! next nodes and the start of their token runs while it compares the current one. Hints only:
//! they never fault and change nothing a caller can see.

use super::node::Node;

/// How much of a run a walk asks for ahead of comparing it (see `prefetch_span`).
pub(super) const PREFETCH_BYTES: usize = 64 << 10;

/// Ask the cache for the line at `x` ahead of its use (a hint: never faults, changes nothing).
#[inline(always)]
pub(super) fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault; `x` is a live
    // reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((x as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Ask for every line of a node (three or four, by its alignment).
#[inline(always)]
pub(super) fn prefetch_node(n: &Node) {
    let p = (n as *const Node).cast::<u8>();
    let size = std::mem::size_of::<Node>();
    let mut at = 0;
    while at < size {
        // SAFETY: `at` stays inside the node, so the pointer is in bounds of a live object.
        prefetch(unsafe { &*p.add(at) });
        at += 64;
    }
    // SAFETY: the node's last byte; a node not aligned to a line may end on one more.
    prefetch(unsafe { &*p.add(size - 1) });
}

/// Ask for the start of `xs` and the first line of each 4 KB page in its first `max` bytes: the
/// hardware streams a run once it is read, but stops at every page boundary, and a cold run's
/// pages then arrive one after another instead of together.
#[inline(always)]
pub(super) fn prefetch_span(xs: &[u32], max: usize) {
    let n = xs.len().min(max / 4);
    if n == 0 {
        return;
    }
    prefetch(&xs[0]);
    let first_page = (xs.as_ptr() as usize & !4095) + 4096;
    let mut i = (first_page - xs.as_ptr() as usize) / 4;
    while i < n {
        prefetch(&xs[i]);
        i += 1024;
    }
}
