//! The Python face of the crate, `kern._pool`: one mutable class (`Cache`), frozen result
//! types, and one exception class per failure. Token ids and page ids cross as buffers
//! (numpy uint32 arrays, `array('I')`, bytes) and come back as `bytes` of little-endian u32,
//! never as one Python object per id. Long walks run with the GIL released. A panic never
//! crosses: each entry point catches it and raises `CacheCorrupt` instead. Integer arguments
//! are read here, so a negative or oversized one is an `InvalidArgument` naming it, not
//! pyo3's `OverflowError`.
//!
//! What only tests read sits behind `Cache._peek` (a match that changes nothing) and
//! `Cache._record_paths` (keys that carry their token paths); the scheduler needs neither.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt};

use crate::cache::{Cache as CoreCache, CacheConfig, CacheStats};
use crate::error::KernError;
use crate::ids::{NodeId, PageId, SlotId};
use crate::plan::{self, EntryKey as CoreKey};
use crate::pool::Pool;
use crate::prefix::Match as CoreMatch;

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
    "Unlock of a node that is not locked."
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
fn guarded<T>(f: impl FnOnce() -> Result<T, KernError>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(PyErr::from),
        Err(p) => Err(panic_message(p)),
    }
}

/// Like `guarded`, with the GIL released: for calls that walk long keys or plan many pages.
fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, KernError> + Send,
) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(r) => r.map_err(PyErr::from),
        Err(p) => Err(panic_message(p)),
    }
}

/// Ids read from a Python buffer: borrowed in place when the buffer already is what the
/// crate reads (contiguous, aligned, this machine's byte order), else copied.
struct U32s {
    buf: Option<PyUntypedBuffer>,
    len: usize,
    owned: Vec<u32>,
}

impl U32s {
    fn owned(owned: Vec<u32>) -> Self {
        U32s {
            buf: None,
            len: owned.len(),
            owned,
        }
    }

    fn as_slice(&self) -> &[u32] {
        match &self.buf {
            // SAFETY: `read_u32` borrows only a C-contiguous buffer of `len` u32s whose start
            // is 4-aligned; the exporter keeps it alive and unmoved while `buf` holds the view.
            // It is read only with the GIL held, so no Python code runs meanwhile (the stance of
            // pyo3's `PyBuffer::as_slice`); walks that release the GIL read a copy.
            Some(b) => unsafe { std::slice::from_raw_parts(b.buf_ptr() as *const u32, self.len) },
            None => &self.owned,
        }
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// Read a buffer of u32 without a Python object per id: a buffer of 4-byte unsigned ints
/// (numpy uint32 in either byte order, `array('I')`), or `bytes`/`bytearray` holding
/// little-endian u32. Anything else, a uint8 array included, is `NotU32`.
fn read_u32(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<U32s> {
    let native_little = cfg!(target_endian = "little");
    let borrow =
        |buf: PyUntypedBuffer, little: bool, len: usize| -> Result<U32s, PyUntypedBuffer> {
            if len == 0 || buf.buf_ptr().is_null() {
                // An empty buffer may have no memory at all: never make a slice of it.
                return Ok(U32s::owned(Vec::new()));
            }
            if little == native_little
                && buf.is_c_contiguous()
                && (buf.buf_ptr() as usize).is_multiple_of(4)
            {
                Ok(U32s {
                    buf: Some(buf),
                    len,
                    owned: Vec::new(),
                })
            } else {
                Err(buf)
            }
        };
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>() {
        let buf = PyUntypedBuffer::get(obj)?;
        let n = buf.len_bytes();
        if n % 4 != 0 {
            return Err(NotU32::new_err(format!(
                "{what}: {n} bytes is not a whole number of uint32 ids"
            )));
        }
        let buf = match borrow(buf, true, n / 4) {
            Ok(ids) => return Ok(ids),
            Err(buf) => buf,
        };
        // SAFETY: bytes and bytearray are contiguous: `len_bytes` readable bytes at `buf_ptr`.
        let raw = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, n) };
        return Ok(U32s::owned(decode(raw, true)));
    }
    let kind = || {
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let Ok(buf) = PyUntypedBuffer::get(obj) else {
        return Err(NotU32::new_err(format!(
            "{what} must be a buffer of uint32 (a numpy uint32 array, array('I') or bytes); got \
             {}: not a buffer (convert with numpy.asarray(x, numpy.uint32))",
            kind()
        )));
    };
    let (order, code) = match buf.format().to_bytes() {
        [c] => (b'@', *c),
        [o, c] => (*o, *c),
        _ => (b'?', b'?'),
    };
    let little = match order {
        b'@' | b'=' => Some(native_little),
        b'<' => Some(true),
        b'>' | b'!' => Some(false),
        _ => None,
    };
    let (Some(little), true, 4) = (little, matches!(code, b'I' | b'L'), buf.item_size()) else {
        return Err(NotU32::new_err(format!(
            "{what} must be a buffer of uint32 (a numpy uint32 array, array('I') or bytes); got \
             {}: a buffer of format '{}', not uint32 (convert with \
             numpy.asarray(x, numpy.uint32))",
            kind(),
            buf.format().to_string_lossy()
        )));
    };
    let n = buf.item_count();
    let buf = match borrow(buf, little, n) {
        Ok(ids) => return Ok(ids),
        Err(buf) => buf,
    };
    if buf.is_c_contiguous() {
        // SAFETY: the exporter keeps `len_bytes` readable bytes at `buf_ptr` while `buf` lives.
        let raw =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        return Ok(U32s::owned(decode(raw, little)));
    }
    // A strided view: let Python make it contiguous, then read that.
    let copy = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))?
        .call_method0("tobytes")?;
    let raw: Vec<u8> = copy.extract()?;
    Ok(U32s::owned(decode(&raw, little)))
}

/// u32s from raw bytes in the given order: one copy when that is the machine's order.
fn decode(raw: &[u8], little: bool) -> Vec<u32> {
    let n = raw.len() / 4;
    let mut out: Vec<u32> = Vec::with_capacity(n);
    // SAFETY: `out` has room for n u32s (4n bytes), `raw` holds at least 4n, and any bit
    // pattern is a valid u32.
    unsafe {
        std::ptr::copy_nonoverlapping(raw.as_ptr(), out.as_mut_ptr() as *mut u8, n * 4);
        out.set_len(n);
    }
    if little != cfg!(target_endian = "little") {
        for x in &mut out {
            *x = x.swap_bytes();
        }
    }
    out
}

/// An integer argument (an int or anything with `__index__`, as numpy integers) in the range
/// of `T`, or `InvalidArgument` naming it.
fn int_arg<T: TryFrom<u64>>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    let bad = |why: String| InvalidArgument::new_err(format!("{name}: {why}"));
    let index = if obj.is_instance_of::<PyInt>() {
        obj.clone()
    } else {
        obj.call_method0("__index__").map_err(|_| {
            let kind = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            bad(format!("must be an int, got {kind}"))
        })?
    };
    let shown = || index.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    let v: u64 = index
        .extract()
        .map_err(|_| bad(format!("{} is out of range", shown())))?;
    T::try_from(v).map_err(|_| bad(format!("{} is out of range", shown())))
}

/// A bool argument (an int is refused: `park=0` is more likely a slip than a choice).
fn bool_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    if obj.is_instance_of::<PyBool>() {
        return obj.extract();
    }
    let kind = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    Err(InvalidArgument::new_err(format!(
        "{name}: must be a bool, got {kind}"
    )))
}

/// `None` or the value, as Python prints it.
fn show<T: std::fmt::Display>(x: Option<T>) -> String {
    x.map_or_else(|| "None".to_string(), |v| v.to_string())
}

fn u32_bytes<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyBytes> {
    if cfg!(target_endian = "little") {
        // SAFETY: a u32 slice is 4 * len initialised bytes, in little-endian order here.
        let raw = unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u8, ids.len() * 4) };
        return PyBytes::new(py, raw);
    }
    let mut raw = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        raw.extend_from_slice(&id.to_le_bytes());
    }
    PyBytes::new(py, &raw)
}

/// Walks of keys this long or longer run with the GIL released. Releasing and taking it back
/// cost about 0.5 us here, half a 4,096-token match; a 32,768-token walk takes several us.
const DETACH_TOKENS: usize = 32_768;

/// Room for this many pages or more is made with the GIL released: freeing them takes tens of
/// us. A request's room (tens to a few thousand pages) takes about as long as the GIL's round
/// trip, so it keeps the GIL.
const DETACH_PAGES: u64 = 16_384;

/// The longest cached prefix of a key (see `Cache.match`).
#[pyclass(frozen, module = "kern._pool")]
pub struct Match {
    #[pyo3(get)]
    hit_len: u32,
    #[pyo3(get)]
    resident_len: u32,
    #[pyo3(get)]
    node: Option<u64>,
    /// Built once, at the match: every read of `pages` returns this object.
    pages: Py<PyBytes>,
    #[pyo3(get)]
    state_len: Option<u32>,
    #[pyo3(get)]
    state_slot: Option<u32>,
}

#[pymethods]
impl Match {
    /// Device pages covering `resident_len`, as little-endian uint32 bytes.
    #[getter]
    fn pages<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.pages.bind(py).clone()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Match(hit_len={}, resident_len={}, node={}, pages={}, state_len={}, state_slot={})",
            self.hit_len,
            self.resident_len,
            show(self.node),
            self.pages.bind(py).as_bytes().len() / 4,
            show(self.state_len),
            show(self.state_slot)
        )
    }
}

impl Match {
    fn new(py: Python<'_>, m: &CoreMatch) -> Self {
        Match {
            hit_len: m.hit_len,
            resident_len: m.resident_len,
            node: m.node.map(NodeId::to_u64),
            pages: u32_bytes(py, PageId::raw(&m.pages)).unbind(),
            state_len: m.state.map(|s| s.len),
            state_slot: m.state.and_then(|s| s.slot).map(|s| s.0),
        }
    }
}

/// What `Cache.insert` did.
#[pyclass(frozen, module = "kern._pool", get_all)]
pub struct Inserted {
    /// Leading tokens of the key the tree held before (what a match would have hit).
    held: u32,
    /// Parked entries the caller's pages made resident (woken without a copy).
    woken: u32,
}

#[pymethods]
impl Inserted {
    fn __repr__(&self) -> String {
        format!("Inserted(held={}, woken={})", self.held, self.woken)
    }
}

/// A tree entry: where its own tokens start and end in its path; the path's tokens only when
/// the cache records them (a test-only switch).
#[pyclass(frozen, module = "kern._pool", from_py_object)]
#[derive(Clone)]
pub struct EntryKey {
    #[pyo3(get)]
    start: u32,
    #[pyo3(get)]
    end: u32,
    tokens: Option<Vec<u32>>,
}

#[pymethods]
impl EntryKey {
    /// The whole token path from the root to `end`, or None unless the cache records paths.
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.tokens.as_deref().map(|t| u32_bytes(py, t))
    }

    fn __repr__(&self) -> String {
        format!("EntryKey(start={}, end={})", self.start, self.end)
    }
}

impl From<CoreKey> for EntryKey {
    fn from(k: CoreKey) -> Self {
        EntryKey {
            start: k.start,
            end: k.end,
            tokens: k.tokens,
        }
    }
}

/// Copies the runner lands, one batched index copy per list: `src_pages[i]` → `dst_pages[i]`
/// and `src_states[i]` → `dst_states[i]`. A park plan copies device → host, a wake plan
/// host → device.
#[pyclass(frozen, module = "kern._pool", from_py_object)]
#[derive(Clone)]
pub struct CopyPlan {
    src_pages: Vec<u32>,
    dst_pages: Vec<u32>,
    src_states: Vec<u32>,
    dst_states: Vec<u32>,
}

#[pymethods]
impl CopyPlan {
    #[getter]
    fn src_pages<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.src_pages)
    }
    #[getter]
    fn dst_pages<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.dst_pages)
    }
    #[getter]
    fn src_states<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.src_states)
    }
    #[getter]
    fn dst_states<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.dst_states)
    }
    #[getter]
    fn num_pages(&self) -> usize {
        self.src_pages.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "CopyPlan(pages={}, states={})",
            self.src_pages.len(),
            self.src_states.len()
        )
    }
}

impl From<plan::ParkPlan> for CopyPlan {
    fn from(p: plan::ParkPlan) -> Self {
        CopyPlan {
            src_pages: p.pages.iter().map(|(d, _)| d.0).collect(),
            dst_pages: p.pages.iter().map(|(_, h)| h.0).collect(),
            src_states: p.states.iter().map(|(d, _)| d.0).collect(),
            dst_states: p.states.iter().map(|(_, h)| h.0).collect(),
        }
    }
}

/// What `Cache.wake` brought back: the host → device copies to land before the pages are read,
/// and the entries woken.
#[pyclass(frozen, module = "kern._pool")]
pub struct Woken {
    #[pyo3(get)]
    plan: CopyPlan,
    #[pyo3(get)]
    keys: Vec<EntryKey>,
}

#[pymethods]
impl Woken {
    fn __repr__(&self) -> String {
        format!(
            "Woken(pages={}, entries={})",
            self.plan.src_pages.len(),
            self.keys.len()
        )
    }
}

impl From<plan::WakePlan> for Woken {
    fn from(p: plan::WakePlan) -> Self {
        let plan = CopyPlan {
            src_pages: p.pages.iter().map(|(h, _)| h.0).collect(),
            dst_pages: p.pages.iter().map(|(_, d)| d.0).collect(),
            src_states: p.states.iter().map(|(h, _)| h.0).collect(),
            dst_states: p.states.iter().map(|(_, d)| d.0).collect(),
        };
        Woken {
            plan,
            keys: p.woken.into_iter().map(EntryKey::from).collect(),
        }
    }
}

/// What one step of the make-room loop took. Count evictions from these values alone.
#[pyclass(frozen, module = "kern._pool")]
pub enum Evicted {
    /// The entry went to host memory (land `plan` before reusing its pages); `dropped` are the
    /// parked entries removed to make room for it.
    Parked {
        key: EntryKey,
        plan: CopyPlan,
        dropped: Vec<EntryKey>,
    },
    /// The entry was removed; `parked` says whether it was in host memory.
    Dropped { key: EntryKey, parked: bool },
}

impl From<plan::Evicted> for Evicted {
    fn from(e: plan::Evicted) -> Self {
        match e {
            plan::Evicted::Parked { key, plan, dropped } => Evicted::Parked {
                key: key.into(),
                plan: plan.into(),
                dropped: dropped.into_iter().map(EntryKey::from).collect(),
            },
            plan::Evicted::Dropped { key, parked } => Evicted::Dropped {
                key: key.into(),
                parked,
            },
        }
    }
}

/// What `Cache.make_room` did: each step of the loop (land every park plan before allocating),
/// the device pages and slots those steps gave back, and whether the room asked for is there.
#[pyclass(frozen, module = "kern._pool")]
pub struct Room {
    evicted: Vec<plan::Evicted>,
    #[pyo3(get)]
    pages_freed: u64,
    #[pyo3(get)]
    slots_freed: u64,
    #[pyo3(get)]
    fits: bool,
}

#[pymethods]
impl Room {
    /// The steps, oldest first.
    #[getter]
    fn evicted(&self) -> Vec<Evicted> {
        self.evicted.iter().cloned().map(Evicted::from).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "Room(evicted={}, pages_freed={}, slots_freed={}, fits={})",
            self.evicted.len(),
            self.pages_freed,
            self.slots_freed,
            if self.fits { "True" } else { "False" }
        )
    }
}

impl From<plan::Room> for Room {
    fn from(r: plan::Room) -> Self {
        Room {
            evicted: r.evicted,
            pages_freed: r.pages_freed,
            slots_freed: r.slots_freed,
            fits: r.fits,
        }
    }
}

/// How one arena (the device budget or the host tier) is cut: `num_chunks` chunks of
/// `chunk_bytes`; page `p` at byte `p * page_bytes`, slot `s` at byte `s * slot_stride`. The
/// runner allocates exactly `num_chunks * chunk_bytes` bytes and views them both ways.
#[pyclass(frozen, module = "kern._pool", get_all)]
pub struct Geometry {
    chunk_bytes: u64,
    num_chunks: u32,
    page_bytes: u64,
    pages_per_chunk: u32,
    slot_stride: u64,
    slots_per_chunk: u32,
}

#[pymethods]
impl Geometry {
    /// Page ids run over `[0, num_pages)`.
    #[getter]
    fn num_pages(&self) -> u64 {
        u64::from(self.num_chunks) * u64::from(self.pages_per_chunk)
    }
    /// Slot ids run over `[0, num_slots)` (0 without slots).
    #[getter]
    fn num_slots(&self) -> u64 {
        u64::from(self.num_chunks) * u64::from(self.slots_per_chunk)
    }
    /// The arena's size: `num_chunks * chunk_bytes`.
    #[getter]
    fn arena_bytes(&self) -> u64 {
        u64::from(self.num_chunks) * self.chunk_bytes
    }
    fn __repr__(&self) -> String {
        format!(
            "Geometry(chunks={} x {} B, pages={} x {} B, slots={} x {} B)",
            self.num_chunks,
            self.chunk_bytes,
            self.num_pages(),
            self.page_bytes,
            self.num_slots(),
            self.slot_stride
        )
    }
}

impl From<&Pool> for Geometry {
    fn from(p: &Pool) -> Self {
        Geometry {
            chunk_bytes: p.chunk_bytes(),
            num_chunks: p.num_chunks(),
            page_bytes: p.chunk_bytes() / u64::from(p.pages_per_chunk()),
            pages_per_chunk: p.pages_per_chunk(),
            slot_stride: p.slot_stride(),
            slots_per_chunk: p.slots_per_chunk(),
        }
    }
}

/// Counters of the device pool, the host tier and the tree.
#[pyclass(frozen, module = "kern._pool", get_all)]
pub struct Stats {
    chunk_bytes: u64,
    num_chunks: u32,
    free_chunks: u32,
    page_capacity: u64,
    pages_used: u64,
    pages_free: u64,
    slot_capacity: u64,
    slots_used: u64,
    slots_free: u64,
    host_pages_used: u64,
    host_pages_free: u64,
    host_slots_used: u64,
    host_slots_free: u64,
    num_nodes: u64,
    resident_pages: u64,
    parked_pages: u64,
    resident_states: u64,
    parked_states: u64,
    num_parked: u64,
    num_dropped_resident: u64,
    num_dropped_parked: u64,
    num_woken: u64,
}

impl From<CacheStats> for Stats {
    fn from(s: CacheStats) -> Self {
        let h = s.host.unwrap_or_default();
        Stats {
            chunk_bytes: s.device.chunk_bytes,
            num_chunks: s.device.num_chunks,
            free_chunks: s.device.free_chunks,
            page_capacity: s.device.page_capacity,
            pages_used: s.device.pages_used,
            pages_free: s.device.pages_free,
            slot_capacity: s.device.slot_capacity,
            slots_used: s.device.slots_used,
            slots_free: s.device.slots_free,
            host_pages_used: h.pages_used,
            host_pages_free: h.pages_free,
            host_slots_used: h.slots_used,
            host_slots_free: h.slots_free,
            num_nodes: s.tree.num_nodes,
            resident_pages: s.tree.resident_pages,
            parked_pages: s.tree.parked_pages,
            resident_states: s.tree.resident_states,
            parked_states: s.tree.parked_states,
            num_parked: s.tree.num_parked,
            num_dropped_resident: s.tree.num_dropped_resident,
            num_dropped_parked: s.tree.num_dropped_parked,
            num_woken: s.tree.num_woken,
        }
    }
}

/// kern's KV cache books: the device pool, the host tier and the prefix tree.
#[pyclass(module = "kern._pool")]
pub struct Cache {
    inner: CoreCache,
    /// What `make_room` returns when the room is there already (a frozen value, shared).
    no_room_needed: Py<Room>,
    /// Buffers reused by every match and allocation (empty between calls): their ids go
    /// straight into the `bytes` returned, with no allocation per call.
    match_pages: Vec<PageId>,
    alloc_ids: Vec<u32>,
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(
        signature = (*, page_tokens, page_bytes, device_bytes, state_bytes = None, host_bytes = None, min_slots = None),
        text_signature = "(*, page_tokens, page_bytes, device_bytes, state_bytes=0, host_bytes=0, min_slots=2)"
    )]
    fn new(
        page_tokens: &Bound<'_, PyAny>,
        page_bytes: &Bound<'_, PyAny>,
        device_bytes: &Bound<'_, PyAny>,
        state_bytes: Option<&Bound<'_, PyAny>>,
        host_bytes: Option<&Bound<'_, PyAny>>,
        min_slots: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let opt = |x: Option<&Bound<'_, PyAny>>, name: &str, default: u64| -> PyResult<u64> {
            x.map_or(Ok(default), |v| int_arg(v, name))
        };
        let cfg = CacheConfig {
            page_tokens: int_arg(page_tokens, "page_tokens")?,
            page_bytes: int_arg(page_bytes, "page_bytes")?,
            state_bytes: opt(state_bytes, "state_bytes", 0)?,
            device_bytes: int_arg(device_bytes, "device_bytes")?,
            host_bytes: opt(host_bytes, "host_bytes", 0)?,
            min_slots: min_slots.map_or(Ok(2), |v| int_arg(v, "min_slots"))?,
        };
        let inner = guarded(|| CoreCache::new(cfg))?;
        let no_room_needed = Py::new(
            page_tokens.py(),
            Room::from(plan::Room {
                fits: true,
                ..plan::Room::default()
            }),
        )?;
        Ok(Cache {
            inner,
            no_room_needed,
            match_pages: Vec::new(),
            alloc_ids: Vec::new(),
        })
    }

    #[getter]
    fn page_tokens(&self) -> u32 {
        self.inner.page_tokens()
    }
    /// The device arena's geometry.
    #[getter]
    fn device(&self) -> Geometry {
        self.inner.pool().into()
    }
    /// The host arena's geometry; None without a host tier.
    #[getter]
    fn host(&self) -> Option<Geometry> {
        self.inner.host_pool().map(Geometry::from)
    }
    /// Pages allocatable now without evicting anything.
    #[getter]
    fn pages_free(&self) -> u64 {
        self.inner.pool().available(crate::pool::Kind::Pages)
    }

    /// The longest cached prefix of `tokens`, locked: call `unlock(m.node)` once when done.
    #[pyo3(name = "match")]
    fn match_(&mut self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Match> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let inner = &mut self.inner;
        let buf = std::mem::take(&mut self.match_pages);
        let mut m = if tokens.len() >= DETACH_TOKENS {
            let tokens = tokens.as_slice().to_vec();
            detached(py, || Ok(inner.match_prefix_with(&tokens, buf)))?
        } else {
            guarded(|| Ok(inner.match_prefix_with(tokens.as_slice(), buf)))?
        };
        let out = Match::new(py, &m);
        m.pages.clear();
        self.match_pages = m.pages;
        Ok(out)
    }

    fn unlock(&mut self, node: &Bound<'_, PyAny>) -> PyResult<()> {
        let node = NodeId::from_u64(int_arg(node, "node")?);
        guarded(|| self.inner.unlock(node))
    }

    #[pyo3(signature = (tokens, pages, state = None))]
    fn insert(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        state: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Inserted> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let pages = read_u32(py, pages, "pages")?;
        let state = state.map(|s| int_arg(s, "state")).transpose()?.map(SlotId);
        let inner = &mut self.inner;
        let r = if tokens.len() >= DETACH_TOKENS {
            let (tokens, pages) = (tokens.as_slice().to_vec(), pages.as_slice().to_vec());
            detached(py, || inner.insert(&tokens, &pages, state))?
        } else {
            guarded(|| inner.insert(tokens.as_slice(), pages.as_slice(), state))?
        };
        Ok(Inserted {
            held: r.held,
            woken: r.woken,
        })
    }

    #[pyo3(
        signature = (pages = None, slots = None, park = None),
        text_signature = "($self, pages=0, slots=0, park=True)"
    )]
    fn make_room(
        &mut self,
        py: Python<'_>,
        pages: Option<&Bound<'_, PyAny>>,
        slots: Option<&Bound<'_, PyAny>>,
        park: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Room>> {
        let pages: u64 = pages.map_or(Ok(0), |v| int_arg(v, "pages"))?;
        let slots: u64 = slots.map_or(Ok(0), |v| int_arg(v, "slots"))?;
        let park = park.map_or(Ok(true), |v| bool_arg(v, "park"))?;
        if self.inner.pool().fits(pages, slots) {
            return Ok(self.no_room_needed.clone_ref(py));
        }
        let inner = &mut self.inner;
        let room = if pages >= DETACH_PAGES {
            detached(py, || Ok(inner.make_room(pages, slots, park)))?
        } else {
            guarded(|| Ok(inner.make_room(pages, slots, park)))?
        };
        Py::new(py, Room::from(room))
    }

    /// `make_room(n, park=park)` and, when the room fits, `alloc_pages(n)`, in one call:
    /// `(pages, room)`, `pages` None when the room does not fit. A call that evicted nothing
    /// returns the same `Room` object every time.
    #[pyo3(
        signature = (n, park = None),
        text_signature = "($self, n, park=True)"
    )]
    fn take_pages<'py>(
        &mut self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
        park: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Option<Bound<'py, PyBytes>>, Py<Room>)> {
        let n: usize = int_arg(n, "n")?;
        let park = park.map_or(Ok(true), |v| bool_arg(v, "park"))?;
        let (inner, ids) = (&mut self.inner, &mut self.alloc_ids);
        let room = if n as u64 >= DETACH_PAGES {
            detached(py, || inner.take_pages_into(n, park, ids))?
        } else {
            guarded(|| inner.take_pages_into(n, park, ids))?
        };
        let pages = room.fits.then(|| u32_bytes(py, ids));
        ids.clear();
        let room = if room.fits && room.evicted.is_empty() {
            self.no_room_needed.clone_ref(py)
        } else {
            Py::new(py, Room::from(room))?
        };
        Ok((pages, room))
    }

    /// The end of a request: `insert(tokens, pages, state)`, `unlock(node)` and
    /// `free_pages(free)` in one call, every check before any change. Positional arguments
    /// cross faster than keywords (about 0.1 us less each, measured).
    #[pyo3(
        signature = (tokens, pages, state = None, node = None, free = None),
        text_signature = "($self, tokens, pages, state=None, node=None, free=b'')"
    )]
    fn release(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        state: Option<&Bound<'_, PyAny>>,
        node: Option<&Bound<'_, PyAny>>,
        free: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Inserted> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let pages = read_u32(py, pages, "pages")?;
        let free = match free {
            Some(f) => read_u32(py, f, "free")?,
            None => U32s::owned(Vec::new()),
        };
        let state = state.map(|s| int_arg(s, "state")).transpose()?.map(SlotId);
        let node = node
            .map(|n| int_arg(n, "node"))
            .transpose()?
            .map(NodeId::from_u64);
        let inner = &mut self.inner;
        let r = if tokens.len() >= DETACH_TOKENS {
            let (tokens, pages, free) = (
                tokens.as_slice().to_vec(),
                pages.as_slice().to_vec(),
                free.as_slice().to_vec(),
            );
            detached(py, || inner.release(&tokens, &pages, state, node, &free))?
        } else {
            guarded(|| {
                inner.release(
                    tokens.as_slice(),
                    pages.as_slice(),
                    state,
                    node,
                    free.as_slice(),
                )
            })?
        };
        Ok(Inserted {
            held: r.held,
            woken: r.woken,
        })
    }

    fn wake(&mut self, py: Python<'_>, node: &Bound<'_, PyAny>) -> PyResult<Woken> {
        let node = NodeId::from_u64(int_arg(node, "node")?);
        let inner = &mut self.inner;
        Ok(detached(py, || inner.wake(node))?.into())
    }

    fn alloc_pages<'py>(
        &mut self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let n: usize = int_arg(n, "n")?;
        let (inner, ids) = (&mut self.inner, &mut self.alloc_ids);
        guarded(|| inner.alloc_pages_into(n, ids))?;
        let out = u32_bytes(py, ids);
        ids.clear();
        Ok(out)
    }

    fn free_pages(&mut self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let pages = read_u32(py, pages, "pages")?;
        guarded(|| self.inner.free_pages(pages.as_slice()))
    }

    fn alloc_slot(&mut self) -> PyResult<u32> {
        guarded(|| self.inner.alloc_slot()).map(|s| s.0)
    }

    fn free_slot(&mut self, slot: &Bound<'_, PyAny>) -> PyResult<()> {
        let slot = SlotId(int_arg(slot, "slot")?);
        guarded(|| self.inner.free_slot(slot))
    }

    fn stats(&self) -> PyResult<Stats> {
        guarded(|| Ok(self.inner.stats().into()))
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        detached(py, || inner.check_integrity())
    }

    /// Test-only: what `match` would return, changing nothing (no split, no refresh, no lock).
    fn _peek(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Match> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let m = guarded(|| Ok(self.inner.peek(tokens.as_slice())))?;
        Ok(Match::new(py, &m))
    }

    /// Test-only: record each evicted or woken entry's whole token path in its key.
    fn _record_paths(&mut self, on: &Bound<'_, PyAny>) -> PyResult<()> {
        let on = bool_arg(on, "on")?;
        self.inner.record_paths(on);
        Ok(())
    }
}

#[pymodule]
fn _pool(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cache>()?;
    m.add_class::<Match>()?;
    m.add_class::<Inserted>()?;
    m.add_class::<EntryKey>()?;
    m.add_class::<CopyPlan>()?;
    m.add_class::<Woken>()?;
    m.add_class::<Evicted>()?;
    m.add_class::<Room>()?;
    m.add_class::<Stats>()?;
    m.add_class::<Geometry>()?;
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
