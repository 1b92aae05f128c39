//! Every way a call can fail. The crate never panics on bad input: each check runs before any
//! state changes, so after an error the cache is exactly as it was.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernError {
    /// The budget cannot hold even one object of the named kind.
    BudgetTooSmall {
        what: &'static str,
        budget_bytes: u64,
        object_bytes: u64,
    },
    /// A size argument that must be positive was zero.
    ZeroSize { what: &'static str },
    /// Not enough room; nothing was allocated.
    PoolFull {
        what: &'static str,
        needed: u64,
        available: u64,
    },
    /// Not enough room for pages and state slots together; nothing was allocated.
    RoomFull {
        pages: u64,
        slots: u64,
        pages_free: u64,
    },
    /// A key longer than 2^32 tokens.
    TooLong { tokens: usize },
    /// An id that is out of range or not allocated.
    NotAllocated { what: &'static str, id: u32 },
    /// The same id named twice in one call.
    Repeated { what: &'static str, id: u32 },
    /// A page or slot the cache owns was passed where the caller's own was expected.
    OwnedByCache { what: &'static str, id: u32 },
    /// A node handle that names no live node.
    UnknownNode { handle: u64 },
    /// Unlock of a handle that holds no lock: `live` false when it names no live node (a
    /// removed node is never locked, so its handle holds none either).
    NotLocked { handle: u64, live: bool },
    /// The page list does not match the token count.
    LengthMismatch {
        tokens: usize,
        pages: usize,
        page_tokens: u32,
    },
    /// A shared page would be extended in place; it must be copied first.
    SharedPageExtended { page: u32, index: usize },
    /// The cache has no host tier but the call needs one.
    NoHostTier,
    /// An internal invariant failed (check_integrity or a caught panic).
    Corrupt(String),
}

impl fmt::Display for KernError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use KernError::*;
        match self {
            BudgetTooSmall { what, budget_bytes, object_bytes } => write!(
                f,
                "{what} budget of {budget_bytes} bytes cannot hold one object of {object_bytes} bytes"
            ),
            ZeroSize { what } => write!(f, "{what} must be positive"),
            PoolFull { what, needed, available } => {
                write!(f, "{what}: needed {needed}, only {available} available")
            }
            RoomFull {
                pages,
                slots,
                pages_free,
            } => write!(
                f,
                "no room for {pages} pages and {slots} state slots together ({pages_free} pages \
                 free alone)"
            ),
            TooLong { tokens } => write!(f, "{tokens} tokens is more than a key may hold (2^32)"),
            NotAllocated { what, id } => write!(f, "{what} {id} is not allocated"),
            Repeated { what, id } => write!(f, "{what} {id} is named more than once"),
            OwnedByCache { what, id } => {
                write!(f, "{what} {id} is owned by the prefix cache, not by the caller")
            }
            UnknownNode { handle } => write!(f, "node handle {handle:#x} names no live node"),
            NotLocked { handle, live: true } => {
                write!(f, "node handle {handle:#x} is not locked")
            }
            NotLocked { handle, live: false } => {
                write!(f, "node handle {handle:#x} is not locked: it names no live node")
            }
            LengthMismatch { tokens, pages, page_tokens } => write!(
                f,
                "{tokens} tokens at {page_tokens} tokens per page need {} pages, got {pages}",
                tokens.div_ceil(*page_tokens as usize)
            ),
            SharedPageExtended { page, index } => write!(
                f,
                "page {page} (position {index}) is shared with the cache, which holds fewer \
                 tokens in it than given: copy the page before writing into it"
            ),
            NoHostTier => write!(f, "the cache has no host tier"),
            Corrupt(why) => write!(f, "cache integrity check failed: {why}"),
        }
    }
}

impl std::error::Error for KernError {}

pub type Result<T> = std::result::Result<T, KernError>;
