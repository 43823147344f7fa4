//! Core values as plain Python data (dicts, lists, numbers, strings) and
//! back, for `to_dict` and `from_dict`: through the serde form, no JSON text.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::Serialize;
use serde_json::Value;

use crate::to_py_err;

pub(crate) fn to_python<'py, T: Serialize>(
    py: Python<'py>,
    value: &T,
) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(value).expect("plain data always serializes");
    value_to_python(py, &value)
}

fn value_to_python<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n
                .as_f64()
                .expect("a JSON number is an integer or a float")
                .into_pyobject(py)?
                .into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_python(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(fields) => {
            let dict = PyDict::new(py);
            for (key, item) in fields {
                dict.set_item(key, value_to_python(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// Deepest nesting `from_python` reads, as serde_json's parser allows for text.
const MAX_DEPTH: usize = 128;

/// Plain Python data (dicts with string keys, lists, tuples, strings,
/// integers, floats, booleans, None) as a serde value.
pub(crate) fn from_python(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    nested_from_python(obj, 0)
}

fn nested_from_python(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(to_py_err(dapple_core::Error::invalid(format!(
            "data nested deeper than {MAX_DEPTH} levels"
        ))));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(match obj.extract::<u64>() {
            Ok(u) => Value::from(u),
            Err(_) => match obj.extract::<i64>() {
                Ok(i) => Value::from(i),
                // Too large for 64 bits: the core's readers refuse it by field.
                Err(_) => Value::from(obj.extract::<f64>().unwrap_or(f64::INFINITY)),
            },
        });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(serde_json::Number::from_f64(f.value()).map_or(Value::Null, Value::Number));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_str()?.to_string()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::new();
        for (k, v) in d.iter() {
            let key = k
                .cast::<PyString>()
                .map_err(|_| PyTypeError::new_err(format!("dict key {k} is not a string")))?;
            map.insert(
                key.to_str()?.to_string(),
                nested_from_python(&v, depth + 1)?,
            );
        }
        return Ok(Value::Object(map));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj
            .try_iter()?
            .map(|item| nested_from_python(&item?, depth + 1))
            .collect::<PyResult<Vec<_>>>()
            .map(Value::Array);
    }
    Err(PyTypeError::new_err(format!(
        "{} is not plain data (dict, list, str, int, float, bool or None)",
        obj.get_type().name()?
    )))
}
