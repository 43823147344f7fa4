use dapple_core::topology::Topology;
use pyo3::prelude::*;

use crate::profile::with_source;
use crate::to_py_err;

/// Topology JSON from a short spec (`2x8-nvlink`) or preset name (`A`).
#[pyfunction]
fn topology_from_spec(spec: &str) -> PyResult<String> {
    Ok(Topology::from_spec(spec).map_err(to_py_err)?.to_json())
}

/// Validate topology JSON; returns it in canonical form.
#[pyfunction]
#[pyo3(signature = (text, source=None))]
fn topology_canonical(text: &str, source: Option<&str>) -> PyResult<String> {
    let t = Topology::from_json(text).map_err(|e| to_py_err(with_source(e, source)))?;
    Ok(t.to_json())
}

/// One-line description of a topology.
#[pyfunction]
fn topology_describe(text: &str) -> PyResult<String> {
    Ok(Topology::from_json(text).map_err(to_py_err)?.describe())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(topology_from_spec, m)?)?;
    m.add_function(wrap_pyfunction!(topology_canonical, m)?)?;
    m.add_function(wrap_pyfunction!(topology_describe, m)?)?;
    Ok(())
}
