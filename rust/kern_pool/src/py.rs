//! The Python face of the crate, `kern._pool`: one mutable class (`Cache`), frozen result
//! types, and one exception class per failure. Token ids and page ids cross as buffers
//! (numpy uint32 arrays, `array('I')`, bytes) and come back as `bytes` of little-endian u32,
//! never as one Python object per id. Long walks run with the GIL released. A panic never
//! crosses: each entry point catches it and raises `CacheCorrupt` instead.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::cache::{Cache as CoreCache, CacheConfig, CacheStats};
use crate::error::KernError;
use crate::ids::{NodeId, SlotId};
use crate::plan::{self, EntryKey as CoreKey};
use crate::pool::Pool;

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
            KernError::PoolFull { .. } => PoolFull::new_err(msg),
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

/// Read a buffer of u32 without a Python object per id: a uint32 buffer (numpy, `array('I')`)
/// or raw bytes holding little-endian u32.
fn read_u32(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(py);
    }
    if let Ok(buf) = PyBuffer::<u8>::get(obj) {
        let bytes = buf.to_vec(py)?;
        if bytes.len() % 4 != 0 {
            return Err(NotU32::new_err(format!(
                "{what}: {} bytes is not a whole number of uint32 ids",
                bytes.len()
            )));
        }
        return Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect());
    }
    let kind = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let format = py
        .import("builtins")
        .and_then(|b| b.getattr("memoryview"))
        .and_then(|mv| mv.call1((obj,)))
        .and_then(|view| view.getattr("format"))
        .and_then(|f| f.extract::<String>());
    let detail = match format {
        Ok(f) => format!(
            "a buffer of format '{f}', not uint32 (convert with numpy.asarray(x, numpy.uint32))"
        ),
        Err(_) => "not a buffer (convert with numpy.asarray(x, numpy.uint32))".to_string(),
    };
    Err(NotU32::new_err(format!(
        "{what} must be a buffer of uint32 (a numpy uint32 array, array('I') or bytes); got {kind}: {detail}"
    )))
}

/// `None` or the value, as Python prints it.
fn show<T: std::fmt::Display>(x: Option<T>) -> String {
    x.map_or_else(|| "None".to_string(), |v| v.to_string())
}

fn u32_bytes<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyBytes> {
    PyBytes::new_with(py, ids.len() * 4, |buf| {
        for (dst, id) in buf.chunks_exact_mut(4).zip(ids) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        Ok(())
    })
    .expect("filling a fresh bytes object cannot fail")
}

/// The longest cached prefix of a key (see `Cache.match`).
#[pyclass(frozen, module = "kern._pool")]
pub struct Match {
    #[pyo3(get)]
    hit_len: u32,
    #[pyo3(get)]
    resident_len: u32,
    #[pyo3(get)]
    node: Option<u64>,
    pages: Vec<u32>,
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
        u32_bytes(py, &self.pages)
    }

    fn __repr__(&self) -> String {
        format!(
            "Match(hit_len={}, resident_len={}, node={}, pages={}, state_len={}, state_slot={})",
            self.hit_len,
            self.resident_len,
            show(self.node),
            self.pages.len(),
            show(self.state_len),
            show(self.state_slot)
        )
    }
}

/// What `Cache.insert` left to the caller.
#[pyclass(frozen, module = "kern._pool")]
pub struct Inserted {
    duplicates: Vec<u32>,
    #[pyo3(get)]
    state_duplicate: Option<u32>,
    #[pyo3(get)]
    node: Option<u64>,
}

#[pymethods]
impl Inserted {
    /// Pages the tree already held: the caller frees them.
    #[getter]
    fn duplicates<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.duplicates)
    }

    fn __repr__(&self) -> String {
        format!(
            "Inserted(duplicates={}, state_duplicate={}, node={})",
            self.duplicates.len(),
            show(self.state_duplicate),
            show(self.node)
        )
    }
}

/// A tree entry: its whole token path and where its own tokens start.
#[pyclass(frozen, module = "kern._pool", from_py_object)]
#[derive(Clone)]
pub struct EntryKey {
    tokens: Vec<u32>,
    #[pyo3(get)]
    start: u32,
}

#[pymethods]
impl EntryKey {
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        u32_bytes(py, &self.tokens)
    }

    #[getter]
    fn end(&self) -> usize {
        self.tokens.len()
    }

    fn __repr__(&self) -> String {
        format!("EntryKey(start={}, end={})", self.start, self.tokens.len())
    }
}

impl From<CoreKey> for EntryKey {
    fn from(k: CoreKey) -> Self {
        EntryKey {
            tokens: k.tokens,
            start: k.start,
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
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(signature = (*, page_tokens, page_bytes, device_bytes, state_bytes = 0, host_bytes = 0, min_slots = 2))]
    fn new(
        page_tokens: u32,
        page_bytes: u64,
        device_bytes: u64,
        state_bytes: u64,
        host_bytes: u64,
        min_slots: u32,
    ) -> PyResult<Self> {
        let cfg = CacheConfig {
            page_tokens,
            page_bytes,
            state_bytes,
            device_bytes,
            host_bytes,
            min_slots,
        };
        Ok(Cache {
            inner: guarded(|| CoreCache::new(cfg))?,
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
    /// Pages allocatable now without evicting anything (cheap; `stats()` recounts the tree).
    #[getter]
    fn pages_free(&self) -> u64 {
        self.inner.pool().available(crate::pool::Kind::Pages)
    }

    #[pyo3(name = "match")]
    fn match_(&mut self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Match> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let inner = &mut self.inner;
        let m = detached(py, || Ok(inner.match_prefix(&tokens)))?;
        Ok(Match {
            hit_len: m.hit_len,
            resident_len: m.resident_len,
            node: m.node.map(NodeId::to_u64),
            pages: m.pages.into_iter().map(|p| p.0).collect(),
            state_len: m.state.map(|s| s.len),
            state_slot: m.state.and_then(|s| s.slot).map(|s| s.0),
        })
    }

    fn lock(&mut self, node: u64) -> PyResult<()> {
        guarded(|| self.inner.lock(NodeId::from_u64(node)))
    }

    fn unlock(&mut self, node: u64) -> PyResult<()> {
        guarded(|| self.inner.unlock(NodeId::from_u64(node)))
    }

    #[pyo3(signature = (tokens, pages, state = None))]
    fn insert(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        state: Option<u32>,
    ) -> PyResult<Inserted> {
        let tokens = read_u32(py, tokens, "tokens")?;
        let pages = read_u32(py, pages, "pages")?;
        let inner = &mut self.inner;
        let r = detached(py, || inner.insert(&tokens, &pages, state.map(SlotId)))?;
        Ok(Inserted {
            duplicates: r.duplicates.into_iter().map(|p| p.0).collect(),
            state_duplicate: r.state_duplicate.map(|s| s.0),
            node: r.node.map(NodeId::to_u64),
        })
    }

    #[pyo3(signature = (pages, slots = 0, park = true))]
    fn make_room(
        &mut self,
        py: Python<'_>,
        pages: u64,
        slots: u64,
        park: bool,
    ) -> PyResult<Vec<Evicted>> {
        let inner = &mut self.inner;
        let taken = detached(py, || Ok(inner.make_room(pages, slots, park)))?;
        Ok(taken.into_iter().map(Evicted::from).collect())
    }

    fn wake(&mut self, py: Python<'_>, node: u64) -> PyResult<Woken> {
        let inner = &mut self.inner;
        Ok(detached(py, || inner.wake(NodeId::from_u64(node)))?.into())
    }

    fn alloc_pages<'py>(&mut self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyBytes>> {
        let pages = guarded(|| self.inner.alloc_pages(n))?;
        let ids: Vec<u32> = pages.into_iter().map(|p| p.0).collect();
        Ok(u32_bytes(py, &ids))
    }

    fn free_pages(&mut self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let pages = read_u32(py, pages, "pages")?;
        guarded(|| self.inner.free_pages(&pages))
    }

    fn alloc_slot(&mut self) -> PyResult<u32> {
        guarded(|| self.inner.alloc_slot()).map(|s| s.0)
    }

    fn free_slot(&mut self, slot: u32) -> PyResult<()> {
        guarded(|| self.inner.free_slot(SlotId(slot)))
    }

    fn stats(&self) -> PyResult<Stats> {
        guarded(|| Ok(self.inner.stats().into()))
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        detached(py, || inner.check_integrity())
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
        ("CacheCorrupt", py.get_type::<CacheCorrupt>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
