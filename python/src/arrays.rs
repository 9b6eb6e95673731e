//! What the bindings take as keys and values: NumPy arrays, CPU torch tensors (through NumPy's
//! view of their memory: no copy, and detached from autograd), and anything else
//! `numpy.asarray` reads (a list, say, copied). Keys are `uint64`, or `int64` — torch's index
//! type — without negative ones; values `float32`; both C-contiguous, any shape. Anything else
//! is a `FerryError` that names the argument and what it got.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::argument;

/// The array NumPy sees for `obj` (see the module documentation); `what` names the argument
/// in errors.
fn as_array<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(array) = obj.downcast::<PyUntypedArray>() {
        return Ok(array.clone());
    }
    let mut obj = obj.clone();
    // A torch tensor: its memory must be the CPU's, and autograd must not hold it (NumPy's view
    // of a tensor that requires grad is refused by torch).
    if obj.hasattr("detach")? && obj.hasattr("device")? {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(argument(format!("{what} is a tensor on '{device}': Ferry reads and writes CPU memory (move it with .cpu() first)")));
        }
        obj = obj.call_method0("detach")?;
    }
    let array = obj.py().import("numpy")?.call_method1("asarray", (obj,)).map_err(|e| argument(format!("{what}: not an array ({e})")))?;
    array.downcast_into::<PyUntypedArray>().map_err(|_| argument(format!("{what}: not an array")))
}

/// The name of `array`'s element type, for errors.
fn dtype(array: &Bound<'_, PyUntypedArray>) -> String {
    array.dtype().str().map(|s| s.to_string()).unwrap_or_else(|_| "an unknown type".into())
}

/// The elements of `array` as a slice, if it is C-contiguous.
fn contiguous<'a, T: numpy::Element>(array: &'a PyReadonlyArrayDyn<'_, T>, what: &str, kind: &str) -> PyResult<&'a [T]> {
    let c = array.is_c_contiguous();
    array.as_slice().ok().filter(|_| c).ok_or_else(|| argument(format!("{what} must be a C-contiguous {kind} array")))
}

/// Keys, borrowed from the caller's array for the length of a call.
pub(crate) enum Keys<'py> {
    /// `uint64`, as they are.
    Unsigned(PyReadonlyArrayDyn<'py, u64>),
    /// `int64`, read as `uint64` once checked to hold no negative key.
    Signed(PyReadonlyArrayDyn<'py, i64>),
}

impl<'py> FromPyObject<'py> for Keys<'py> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let array = as_array(obj, "keys")?;
        if let Ok(a) = array.downcast::<PyArrayDyn<u64>>() {
            return Ok(Keys::Unsigned(a.try_readonly().map_err(|e| argument(format!("keys: {e}")))?));
        }
        if let Ok(a) = array.downcast::<PyArrayDyn<i64>>() {
            return Ok(Keys::Signed(a.try_readonly().map_err(|e| argument(format!("keys: {e}")))?));
        }
        Err(argument(format!("keys must be uint64 or int64, not {}", dtype(&array))))
    }
}

impl Keys<'_> {
    /// The keys (an `int64` array is checked for negative keys, which have no `uint64` reading).
    pub(crate) fn slice(&self) -> PyResult<&[u64]> {
        match self {
            Keys::Unsigned(a) => contiguous(a, "keys", "uint64"),
            Keys::Signed(a) => {
                let signed = contiguous(a, "keys", "int64")?;
                if let Some(bad) = signed.iter().find(|&&k| k < 0) {
                    return Err(argument(format!("keys must not be negative ({bad})")));
                }
                Ok(bytemuck::cast_slice(signed))
            }
        }
    }
}

/// `float32` values, borrowed from the caller's array for the length of a call.
pub(crate) struct Values<'py>(PyReadonlyArrayDyn<'py, f32>);

impl<'py> FromPyObject<'py> for Values<'py> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let array = as_array(obj, "values")?;
        let typed = array.downcast::<PyArrayDyn<f32>>().map_err(|_| argument(format!("values must be float32, not {}", dtype(&array))))?;
        Ok(Values(typed.try_readonly().map_err(|e| argument(format!("values: {e}")))?))
    }
}

impl Values<'_> {
    /// The values, in C order (a Fortran-order array would be read in the wrong order).
    pub(crate) fn slice(&self) -> PyResult<&[f32]> {
        contiguous(&self.0, "values", "float32")
    }
}

/// A caller's `float32` array (or CPU tensor) that a pull writes into.
pub(crate) struct Out<'py>(PyReadwriteArrayDyn<'py, f32>);

impl<'py> FromPyObject<'py> for Out<'py> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let array = as_array(obj, "out")?;
        let typed = array.downcast::<PyArrayDyn<f32>>().map_err(|_| argument(format!("out must be float32, not {}", dtype(&array))))?;
        Ok(Out(typed.try_readwrite().map_err(|e| argument(format!("out: {e}")))?))
    }
}

impl Out<'_> {
    /// The array's memory, in C order.
    pub(crate) fn slice_mut(&mut self) -> PyResult<&mut [f32]> {
        let c = self.0.is_c_contiguous();
        self.0.as_slice_mut().ok().filter(|_| c).ok_or_else(|| argument("out must be a C-contiguous float32 array"))
    }
}
