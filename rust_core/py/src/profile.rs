use dapple_core::profile::{LayerCosts, Profile};
use pyo3::prelude::*;

use crate::to_py_err;

/// Validate profile JSON; returns it in canonical form. `source` names the
/// file in error messages.
#[pyfunction]
#[pyo3(signature = (text, source=None))]
fn profile_canonical(text: &str, source: Option<&str>) -> PyResult<String> {
    let p = Profile::from_json(text).map_err(|e| to_py_err(with_source(e, source)))?;
    Ok(p.to_json())
}

/// SHA-256 of the canonical form of a profile.
#[pyfunction]
fn profile_sha256(text: &str) -> PyResult<String> {
    Ok(Profile::from_json(text).map_err(to_py_err)?.sha256())
}

/// Bytes of weights, gradients and optimizer state of the whole model, as
/// the cost model counts them (per replica).
#[pyfunction]
fn profile_model_state_bytes(text: &str) -> PyResult<f64> {
    let p = Profile::from_json(text).map_err(to_py_err)?;
    Ok(LayerCosts::new(&p).model_state_bytes(0, p.layers.len()))
}

pub(crate) fn with_source(e: dapple_core::Error, source: Option<&str>) -> dapple_core::Error {
    match source {
        Some(s) => e.in_source(s),
        None => e,
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profile_canonical, m)?)?;
    m.add_function(wrap_pyfunction!(profile_sha256, m)?)?;
    m.add_function(wrap_pyfunction!(profile_model_state_bytes, m)?)?;
    Ok(())
}
