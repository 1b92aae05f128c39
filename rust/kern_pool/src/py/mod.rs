//! The Python face of the crate, `kern._pool`: one mutable class (`Cache`), frozen result
//! types (`values.rs`), and one exception class per failure (`errors.rs`). Ids cross as
//! buffers (`buffers.rs`). Long walks run with the GIL released. A panic never crosses: each
//! entry point catches it and raises `CacheCorrupt` instead. This face talks to `cache.rs` and
//! the plan, id and error types only.
//!
//! What only tests read sits behind `Cache._peek` (a match that changes nothing) and
//! `Cache._record_paths` (keys that carry their token paths); the scheduler needs neither.

mod buffers;
mod errors;
mod values;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use self::buffers::{bool_arg, int_arg, read_u32, u32_bytes, U32s};
use self::errors::{add_exceptions, detached, guarded};
use self::values::{CopyPlan, EntryKey, Evicted, Geometry, Inserted, Match, Room, Stats, Woken};
use crate::cache::{Cache as CoreCache, CacheConfig};
use crate::ids::{NodeId, PageId, SlotId};
use crate::plan;

/// Walks of keys this long or longer run with the GIL released. Releasing and taking it back
/// cost about 0.5 us here, half a 4,096-token match; a 32,768-token walk takes several us.
const DETACH_TOKENS: usize = 32_768;

/// Room for this many pages or more is made with the GIL released: freeing them takes tens of
/// us. A request's room (tens to a few thousand pages) takes about as long as the GIL's round
/// trip, so it keeps the GIL.
const DETACH_PAGES: u64 = 16_384;

/// kern's KV cache books: the device pool, the host tier and the prefix tree.
#[pyclass(module = "kern._pool")]
pub struct Cache {
    inner: CoreCache,
    /// What `make_room` and `take_pages` return when they evicted nothing (frozen values,
    /// shared): the room was there already, or could not be made without evicting.
    no_room_needed: Py<Room>,
    no_room: Py<Room>,
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
        let shared = |fits: bool| {
            Py::new(
                page_tokens.py(),
                Room::from(plan::Room {
                    fits,
                    ..plan::Room::default()
                }),
            )
        };
        Ok(Cache {
            inner,
            no_room_needed: shared(true)?,
            no_room: shared(false)?,
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
        self.inner.device_geometry().into()
    }
    /// The host arena's geometry; None without a host tier.
    #[getter]
    fn host(&self) -> Option<Geometry> {
        self.inner.host_geometry().map(Geometry::from)
    }
    /// Pages allocatable now without evicting anything.
    #[getter]
    fn pages_free(&self) -> u64 {
        self.inner.pages_free()
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
        Ok(r.into())
    }

    /// Evict until `pages` pages and `slots` slots fit. `park=False` drops instead of parking:
    /// the scheduler never asks for it, but it is the one way to empty a cache that has a host
    /// tier (a parked entry is otherwise dropped only to make host room for another).
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
        if self.inner.fits(pages, slots) {
            return Ok(self.no_room_needed.clone_ref(py));
        }
        let inner = &mut self.inner;
        let room = if pages >= DETACH_PAGES {
            detached(py, || Ok(inner.make_room(pages, slots, park)))?
        } else {
            guarded(|| Ok(inner.make_room(pages, slots, park)))?
        };
        self.room(py, room)
    }

    /// `make_room(n)` and, when the room fits, `n` pages allocated, in one call:
    /// `(pages, room)`, `pages` None when the room does not fit. A call that evicted nothing
    /// returns one of two shared `Room` objects (fits or not), the same each time.
    fn take_pages<'py>(
        &mut self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<(Option<Bound<'py, PyBytes>>, Py<Room>)> {
        let n: usize = int_arg(n, "n")?;
        let (inner, ids) = (&mut self.inner, &mut self.alloc_ids);
        let room = if n as u64 >= DETACH_PAGES {
            detached(py, || inner.take_pages_into(n, ids))?
        } else {
            guarded(|| inner.take_pages_into(n, ids))?
        };
        let pages = room.fits.then(|| u32_bytes(py, ids));
        ids.clear();
        Ok((pages, self.room(py, room)?))
    }

    /// The end of a request: `insert(tokens, pages, state)`, `unlock(node)` and
    /// `free_pages(free)` in one call, every check before any change. The optional arguments
    /// are keyword-only: `state` and `node` are both ints, and a swapped pair by position was
    /// refused only by luck of the id ranges.
    #[pyo3(
        signature = (tokens, pages, *, state = None, node = None, free = None),
        text_signature = "($self, tokens, pages, *, state=None, node=None, free=b'')"
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
        Ok(r.into())
    }

    fn wake(&mut self, py: Python<'_>, node: &Bound<'_, PyAny>) -> PyResult<Woken> {
        let node = NodeId::from_u64(int_arg(node, "node")?);
        let inner = &mut self.inner;
        Ok(detached(py, || inner.wake(node))?.into())
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

impl Cache {
    /// `room` as Python sees it: one of the shared values when nothing was evicted.
    fn room(&self, py: Python<'_>, room: plan::Room) -> PyResult<Py<Room>> {
        if !room.evicted.is_empty() {
            return Py::new(py, Room::from(room));
        }
        let shared = if room.fits {
            &self.no_room_needed
        } else {
            &self.no_room
        };
        Ok(shared.clone_ref(py))
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
    add_exceptions(m)
}
