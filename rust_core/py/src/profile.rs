use dapple_core::model::profile::{LayerCosts, ParameterState, Precision, Profile};
use pyo3::prelude::*;

use crate::to_py_err;

/// A validated profile (`dapple.profile`). Built from JSON once; every
/// function of this module takes it as it is.
#[pyclass(frozen, module = "dapple.planner._core", name = "Profile")]
pub struct PyProfile {
    pub(crate) inner: Profile,
    /// The file it was read from, named in errors and recorded in plans.
    #[pyo3(get)]
    source: Option<String>,
    /// SHA-256 of the canonical form, computed once.
    #[pyo3(get)]
    sha256: String,
}

impl crate::Wraps for PyProfile {
    type Core = Profile;
    fn wrap(core: Profile, source: Option<String>) -> Self {
        PyProfile::new(core, source)
    }
    fn core(&self) -> &Profile {
        &self.inner
    }
}

impl PyProfile {
    pub(crate) fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    pub(crate) fn new(inner: Profile, source: Option<String>) -> PyProfile {
        let sha256 = inner.sha256();
        PyProfile {
            inner,
            source,
            sha256,
        }
    }
}

crate::file_object_methods!(PyProfile {
    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }

    #[getter]
    fn device(&self) -> Option<&str> {
        self.inner.device.as_deref()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.layers.len()
    }

    /// Profiled batch sizes, ascending.
    #[getter]
    fn batch_sizes(&self) -> Vec<u32> {
        self.inner.batch_sizes()
    }

    /// Bytes of weights, gradients and optimizer state of the whole model,
    /// as the cost model counts them (per replica).
    fn model_state_bytes(&self) -> f64 {
        LayerCosts::new(&self.inner).model_state_bytes(0, self.inner.layers.len())
    }

    /// This profile with stored-activation bytes scaled so that one GPU
    /// training the whole model at `batch_size` needs `peak_memory_bytes`.
    fn calibrated_stored_activations(
        &self,
        peak_memory_bytes: f64,
        batch_size: u32,
    ) -> PyResult<PyProfile> {
        let p = self
            .inner
            .calibrated_stored_activations(peak_memory_bytes, batch_size)
            .map_err(to_py_err)?;
        Ok(PyProfile::new(p, None))
    }

    /// This profile with `other`'s layer times as those of its GPU type;
    /// an error names the file it is about.
    fn with_times_of(&self, other: &PyProfile) -> PyResult<PyProfile> {
        self.inner
            .check_merge_base()
            .map_err(|e| to_py_err(crate::with_source(e, self.source.as_deref())))?;
        let p = self
            .inner
            .with_times_of(&other.inner)
            .map_err(|e| match &other.source {
                Some(path) => e.in_source(path.clone()),
                None => e,
            })
            .map_err(to_py_err)?;
        Ok(PyProfile::new(p, None))
    }

    /// GPU types whose layer times the profile holds, its own first.
    #[getter]
    fn devices(&self) -> Vec<Option<String>> {
        self.inner
            .timed_devices()
            .into_iter()
            .map(|d| d.map(str::to_string))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "Profile({:?}, {} layers, sha256 {}...)",
            self.inner.model,
            self.inner.layers.len(),
            &self.sha256[..12]
        )
    }
});

/// Bytes per parameter of each state training under torch's autocast holds
/// with `optimizer` (the profile's `parameter_state`); None for an unknown
/// optimizer.
#[pyfunction]
fn autocast_parameter_state<'py>(
    py: Python<'py>,
    optimizer: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    ParameterState::autocast(optimizer)
        .map(|state| crate::convert::to_python(py, &state))
        .transpose()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyProfile>()?;
    m.add_function(wrap_pyfunction!(autocast_parameter_state, m)?)?;
    m.add("PRECISIONS", crate::names(m.py(), Precision::names())?)?;
    Ok(())
}
