//! Python binding of dapple-core: the only crate that knows about pyo3.
//!
//! Values cross the boundary as JSON text (the one parser per format lives
//! in the core) and plain numbers. Core errors become the exception classes
//! of `planner.errors`, mapped once in `to_py_err`.

use pyo3::prelude::*;

mod artifact;
mod baselines;
mod plan;
mod profile;
mod schedule;
mod search;
mod topology;

/// Raise a core error as the matching `planner.errors` class.
pub(crate) fn to_py_err(err: dapple_core::Error) -> PyErr {
    Python::attach(|py| {
        let class_name = match err.kind {
            dapple_core::ErrorKind::InvalidInput => "InvalidInputError",
            dapple_core::ErrorKind::Incompatible => "IncompatibleInputsError",
            dapple_core::ErrorKind::Infeasible => "InfeasibleError",
            dapple_core::ErrorKind::Io => "DappleIOError",
        };
        let built = py
            .import("planner.errors")
            .and_then(|m| m.getattr(class_name))
            .and_then(|cls| {
                cls.call1((
                    err.to_string(),
                    err.kind.code(),
                    err.source.clone(),
                    err.field.clone(),
                ))
            });
        match built {
            Ok(instance) => PyErr::from_value(instance),
            Err(import_failed) => import_failed,
        }
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", dapple_core::PLANNER_VERSION)?;
    profile::register(m)?;
    topology::register(m)?;
    artifact::register(m)?;
    baselines::register(m)?;
    plan::register(m)?;
    search::register(m)?;
    schedule::register(m)?;
    Ok(())
}
