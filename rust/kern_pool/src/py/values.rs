//! The value classes `Cache`'s verbs return: frozen, built once from the crate's values, with
//! ids handed out as `bytes`. `Evicted` is a complex enum so Python can `match` it.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::buffers::{show, u32_bytes};
use crate::cache::{
    CacheStats, Geometry as CoreGeometry, Inserted as CoreInserted, Match as CoreMatch,
};
use crate::ids::{NodeId, PageId};
use crate::plan::{self, CopyPlan as CorePlan, EntryKey as CoreKey, Side};

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
    pub(super) fn new(py: Python<'_>, m: &CoreMatch) -> Self {
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
    /// Parked entries the caller's pages made resident (woken without a copy).
    woken: u32,
}

#[pymethods]
impl Inserted {
    fn __repr__(&self) -> String {
        format!("Inserted(woken={})", self.woken)
    }
}

impl From<CoreInserted> for Inserted {
    fn from(r: CoreInserted) -> Self {
        Inserted { woken: r.woken }
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
/// host → device (the crate's `CopyPlan<Device, HostTier>` and `CopyPlan<HostTier, Device>`).
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

impl<Src: Side, Dst: Side> From<CorePlan<Src, Dst>> for CopyPlan {
    fn from(p: CorePlan<Src, Dst>) -> Self {
        CopyPlan {
            src_pages: p.pages.iter().map(|&(s, _)| s.into()).collect(),
            dst_pages: p.pages.iter().map(|&(_, d)| d.into()).collect(),
            src_states: p.states.iter().map(|&(s, _)| s.into()).collect(),
            dst_states: p.states.iter().map(|&(_, d)| d.into()).collect(),
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

impl From<plan::Woken> for Woken {
    fn from(w: plan::Woken) -> Self {
        Woken {
            plan: w.plan.into(),
            keys: w.keys.into_iter().map(EntryKey::from).collect(),
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
/// and whether the room asked for is there. What the steps freed is counted from them.
#[pyclass(frozen, module = "kern._pool")]
pub struct Room {
    evicted: Vec<plan::Evicted>,
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
            "Room(evicted={}, fits={})",
            self.evicted.len(),
            if self.fits { "True" } else { "False" }
        )
    }
}

impl From<plan::Room> for Room {
    fn from(r: plan::Room) -> Self {
        Room {
            evicted: r.evicted,
            fits: r.fits,
        }
    }
}

/// How one arena (the device budget or the host tier) is cut (see the crate's `Geometry`).
#[pyclass(frozen, module = "kern._pool")]
pub struct Geometry(CoreGeometry);

#[pymethods]
impl Geometry {
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.0.chunk_bytes
    }
    #[getter]
    fn num_chunks(&self) -> u32 {
        self.0.num_chunks
    }
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.0.page_bytes
    }
    #[getter]
    fn pages_per_chunk(&self) -> u32 {
        self.0.pages_per_chunk
    }
    #[getter]
    fn slot_stride(&self) -> u64 {
        self.0.slot_stride
    }
    #[getter]
    fn slots_per_chunk(&self) -> u32 {
        self.0.slots_per_chunk
    }
    /// Page ids run over `[0, num_pages)`.
    #[getter]
    fn num_pages(&self) -> u64 {
        self.0.num_pages()
    }
    /// Slot ids run over `[0, num_slots)` (0 without slots).
    #[getter]
    fn num_slots(&self) -> u64 {
        self.0.num_slots()
    }
    /// The arena's size: `num_chunks * chunk_bytes`.
    #[getter]
    fn arena_bytes(&self) -> u64 {
        self.0.arena_bytes()
    }
    fn __repr__(&self) -> String {
        let g = &self.0;
        format!(
            "Geometry(chunks={} x {} B, pages={} x {} B, slots={} x {} B)",
            g.num_chunks,
            g.chunk_bytes,
            g.num_pages(),
            g.page_bytes,
            g.num_slots(),
            g.slot_stride
        )
    }
}

impl From<CoreGeometry> for Geometry {
    fn from(g: CoreGeometry) -> Self {
        Geometry(g)
    }
}

/// Counters of the device pool, the host tier and the tree: what the scheduler's gauges and
/// `kern serve`'s start-up line read. Evictions are counted from the `Evicted` values alone.
#[pyclass(frozen, module = "kern._pool", get_all)]
pub struct Stats {
    chunk_bytes: u64,
    free_chunks: u32,
    pages_used: u64,
    pages_free: u64,
    slot_capacity: u64,
    slots_used: u64,
    slots_free: u64,
    host_pages_used: u64,
    host_pages_free: u64,
    host_slots_used: u64,
    num_nodes: u64,
    resident_pages: u64,
    parked_pages: u64,
    resident_states: u64,
    parked_states: u64,
}

impl From<CacheStats> for Stats {
    fn from(s: CacheStats) -> Self {
        let h = s.host.unwrap_or_default();
        Stats {
            chunk_bytes: s.device.chunk_bytes,
            free_chunks: s.device.free_chunks,
            pages_used: s.device.pages_used,
            pages_free: s.device.pages_free,
            slot_capacity: s.device.slot_capacity,
            slots_used: s.device.slots_used,
            slots_free: s.device.slots_free,
            host_pages_used: h.pages_used,
            host_pages_free: h.pages_free,
            host_slots_used: h.slots_used,
            num_nodes: s.tree.num_nodes,
            resident_pages: s.tree.resident_pages,
            parked_pages: s.tree.parked_pages,
            resident_states: s.tree.resident_states,
            parked_states: s.tree.parked_states,
        }
    }
}
