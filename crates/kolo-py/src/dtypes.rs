//! Element types as every Python front end passes them: one vocabulary,
//! numpy's names (`"float32"`, `"bfloat16"`, `"uint8"`...), which are
//! kolo-horovod's `DataType` names; torch's and numpy's dtypes map onto
//! them in Python, TensorFlow's kernels pass TF's numbering instead.

use kolo_comm::DType;
use kolo_horovod::DataType;
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

/// The element type named `name`; upstream's text for any other name.
pub(crate) fn element_type(name: &str) -> PyResult<DataType> {
    name.parse().map_err(|_| PyValueError::new_err(format!("Tensor type {name} is not supported.")))
}

/// The element type named `name`, as kolo-comm's collectives take it.
pub(crate) fn comm_type(name: &str) -> PyResult<DType> {
    element_type(name)?.comm().ok_or_else(|| {
        PyValueError::new_err(format!(
            "{name} cannot be reduced by kolo's collectives: use float32, float64, float16, bfloat16, int32, int64, \
             int8 or uint8"
        ))
    })
}
