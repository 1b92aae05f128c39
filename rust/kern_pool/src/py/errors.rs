//! The exceptions of `kern._pool`, the one mapping from `KernError` onto them, and the guards
//! that turn a panic into `CacheCorrupt`: a panic must never cross into Python, where pyo3
//! raises it as `PanicException`, a `BaseException` that `except Exception` misses.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::KernError;

create_exception!(
    kern._pool,
    PoolFull,
    PyRuntimeError,
    "Not enough room in the pool; nothing was allocated. Make room (evict) and retry."
);
create_exception!(
    kern._pool,
    BudgetTooSmall,
    PyValueError,
    "A budget cannot hold even one object."
);
create_exception!(
    kern._pool,
    NotAllocated,
    PyValueError,
    "An id that is not allocated (freed twice, or never handed out)."
);
create_exception!(
    kern._pool,
    RepeatedId,
    PyValueError,
    "The same id named twice in one call."
);
create_exception!(
    kern._pool,
    OwnedByCache,
    PyValueError,
    "A page or slot the prefix cache owns, passed as the caller's own."
);
create_exception!(
    kern._pool,
    UnknownNode,
    PyKeyError,
    "A node handle that names no live node."
);
create_exception!(
    kern._pool,
    NotLocked,
    PyValueError,
    "Unlock or release of a handle that holds no lock (one naming no live node included)."
);
create_exception!(
    kern._pool,
    LengthMismatch,
    PyValueError,
    "A page list whose length does not match the tokens."
);
create_exception!(
    kern._pool,
    SharedPageExtended,
    PyValueError,
    "A page shared with the cache was extended in place instead of copied."
);
create_exception!(
    kern._pool,
    NotU32,
    PyTypeError,
    "Ids that are not a buffer of uint32."
);
create_exception!(
    kern._pool,
    NoHostTier,
    PyRuntimeError,
    "The call needs a host tier and the cache has none."
);
create_exception!(
    kern._pool,
    InvalidArgument,
    PyValueError,
    "An argument out of range (a negative count, an id past 2^32) or of the wrong type."
);
create_exception!(
    kern._pool,
    CacheCorrupt,
    PyRuntimeError,
    "An internal invariant failed: a bug in kern_pool."
);

impl From<KernError> for PyErr {
    fn from(e: KernError) -> PyErr {
        let msg = e.to_string();
        match e {
            KernError::BudgetTooSmall { .. } | KernError::ZeroSize { .. } => {
                BudgetTooSmall::new_err(msg)
            }
            KernError::PoolFull { .. } | KernError::RoomFull { .. } => PoolFull::new_err(msg),
            KernError::TooLong { .. } => LengthMismatch::new_err(msg),
            KernError::NotAllocated { .. } => NotAllocated::new_err(msg),
            KernError::Repeated { .. } => RepeatedId::new_err(msg),
            KernError::OwnedByCache { .. } => OwnedByCache::new_err(msg),
            KernError::UnknownNode { .. } => UnknownNode::new_err(msg),
            KernError::NotLocked { .. } => NotLocked::new_err(msg),
            KernError::LengthMismatch { .. } => LengthMismatch::new_err(msg),
            KernError::SharedPageExtended { .. } => SharedPageExtended::new_err(msg),
            KernError::NoHostTier => NoHostTier::new_err(msg),
            KernError::Corrupt(_) => CacheCorrupt::new_err(msg),
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    CacheCorrupt::new_err(format!(
        "internal error in kern_pool (the cache may be inconsistent): {what}"
    ))
}

/// Run `f`, turning a panic into `CacheCorrupt`.
pub(super) fn guarded<T>(f: impl FnOnce() -> Result<T, KernError>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(PyErr::from),
        Err(p) => Err(panic_message(p)),
    }
}

/// Like `guarded`, with the GIL released: for calls that walk long keys or plan many pages.
pub(super) fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, KernError> + Send,
) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(r) => r.map_err(PyErr::from),
        Err(p) => Err(panic_message(p)),
    }
}

/// Add every exception class to the module.
pub(super) fn add_exceptions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for (name, ty) in [
        ("PoolFull", py.get_type::<PoolFull>()),
        ("BudgetTooSmall", py.get_type::<BudgetTooSmall>()),
        ("NotAllocated", py.get_type::<NotAllocated>()),
        ("RepeatedId", py.get_type::<RepeatedId>()),
        ("OwnedByCache", py.get_type::<OwnedByCache>()),
        ("UnknownNode", py.get_type::<UnknownNode>()),
        ("NotLocked", py.get_type::<NotLocked>()),
        ("LengthMismatch", py.get_type::<LengthMismatch>()),
        ("SharedPageExtended", py.get_type::<SharedPageExtended>()),
        ("NotU32", py.get_type::<NotU32>()),
        ("NoHostTier", py.get_type::<NoHostTier>()),
        ("InvalidArgument", py.get_type::<InvalidArgument>()),
        ("CacheCorrupt", py.get_type::<CacheCorrupt>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
