//! Ids in and out, and argument parsing. Token ids and page ids cross as buffers (numpy
//! uint32 arrays, `array('I')`, bytes) and come back as `bytes` of little-endian u32, never as
//! one Python object per id. Integer arguments are read here, so a negative or oversized one
//! is an `InvalidArgument` naming it, not pyo3's `OverflowError`.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt};

use super::errors::{InvalidArgument, NotU32};

/// Ids read from a Python buffer: borrowed in place when the buffer already is what the
/// crate reads (contiguous, aligned, this machine's byte order), else copied.
pub(super) struct U32s {
    buf: Option<PyUntypedBuffer>,
    len: usize,
    owned: Vec<u32>,
}

impl U32s {
    pub(super) fn owned(owned: Vec<u32>) -> Self {
        U32s {
            buf: None,
            len: owned.len(),
            owned,
        }
    }

    pub(super) fn as_slice(&self) -> &[u32] {
        match &self.buf {
            // SAFETY: `read_u32` borrows only a C-contiguous buffer of `len` u32s whose start
            // is 4-aligned; the exporter keeps it alive and unmoved while `buf` holds the view.
            // It is read only with the GIL held, so no Python code runs meanwhile (the stance of
            // pyo3's `PyBuffer::as_slice`); walks that release the GIL read a copy.
            Some(b) => unsafe { std::slice::from_raw_parts(b.buf_ptr() as *const u32, self.len) },
            None => &self.owned,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Read a buffer of u32 without a Python object per id: a buffer of 4-byte unsigned ints
/// (numpy uint32 in either byte order, `array('I')`), or `bytes`/`bytearray` holding
/// little-endian u32. Anything else, a uint8 array included, is `NotU32`.
pub(super) fn read_u32(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<U32s> {
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
pub(super) fn int_arg<T: TryFrom<u64>>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
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
pub(super) fn bool_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
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
pub(super) fn show<T: std::fmt::Display>(x: Option<T>) -> String {
    x.map_or_else(|| "None".to_string(), |v| v.to_string())
}

pub(super) fn u32_bytes<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyBytes> {
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
