use dapple_core::simulation::metrics::RunMetrics;
use pyo3::prelude::*;

crate::file_object_class!(
    /// What `dapple run --metrics` writes (`dapple.run-metrics`).
    PyRunMetrics(RunMetrics, "RunMetrics")
);

crate::file_object_methods!(PyRunMetrics {
    #[getter]
    fn steps(&self) -> u32 {
        self.inner.steps
    }
});

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRunMetrics>()?;
    Ok(())
}
