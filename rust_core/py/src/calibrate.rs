//! `calibrate`: a profile corrected by a run of one of its plans
//! (`dapple_core::simulation::calibrate`).

use dapple_core::simulation::calibrate::{calibrate, Measured};
use pyo3::prelude::*;

use crate::metrics::PyRunMetrics;
use crate::plan::PyPlan;
use crate::profile::PyProfile;
use crate::{to_py_err, with_source};

/// `profile` corrected by `metrics`, a run of `plan`: the calibrated
/// profile and one dict per stage (measured, predicted, factors). An error
/// about the metrics names their file; one about the plan and the profile,
/// the plan's.
#[pyfunction(name = "calibrate")]
fn calibrate_profile<'py>(
    py: Python<'py>,
    plan: &PyPlan,
    metrics: &PyRunMetrics,
    profile: &PyProfile,
) -> PyResult<(PyProfile, Bound<'py, PyAny>)> {
    let measured = Measured::of(&plan.inner, &metrics.inner)
        .map_err(|e| to_py_err(with_source(e, metrics.source.as_deref())))?;
    let cal = py
        .detach(|| calibrate(&profile.inner, &plan.inner, &measured))
        .map_err(|e| plan.err(e))?;
    let stages = crate::convert::to_python(py, &cal.stages)?;
    Ok((PyProfile::new(cal.profile, None), stages))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(calibrate_profile, m)?)?;
    m.add(
        "EXACT_MEMORY_SOURCE",
        dapple_core::simulation::calibrate::EXACT_MEMORY_SOURCE,
    )?;
    Ok(())
}
