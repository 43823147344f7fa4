use dapple_core::search::regress::RegressSuite;
use pyo3::prelude::*;

crate::file_object_class!(
    /// A plan-quality regression suite (`dapple.regress-suite`).
    PyRegressSuite(RegressSuite, "RegressSuite")
);

crate::file_object_methods!(PyRegressSuite {
    #[getter]
    fn num_cases(&self) -> usize {
        self.inner.cases.len()
    }
});

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRegressSuite>()?;
    Ok(())
}
