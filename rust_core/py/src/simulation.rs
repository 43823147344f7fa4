use dapple_core::schedule::ScheduleKind;
use dapple_core::simulation::simulate::{simulate as simulate_plan, Simulation, SimulationOptions};
use pyo3::prelude::*;

use crate::plan::PyPlan;
use crate::profile::PyProfile;
use crate::to_py_err;

crate::file_object_class!(
    /// One simulated iteration (`dapple.simulation`): every task, and each
    /// stage's bubbles and memory over time.
    PySimulation(Simulation, "Simulation")
);

crate::file_object_methods!(PySimulation {
    #[getter]
    fn iteration_ms(&self) -> f64 {
        self.inner.iteration_ms
    }

    /// The largest peak of any stage's GPU.
    #[getter]
    fn peak_memory_bytes(&self) -> f64 {
        self.inner.peak_memory_bytes()
    }

    /// Every stage's peak within its GPUs' memory.
    #[getter]
    fn fits_memory(&self) -> bool {
        self.inner.fits_memory()
    }

    #[getter]
    fn schedule(&self) -> &'static str {
        self.inner.schedule.name()
    }

    #[getter]
    fn recompute(&self) -> bool {
        self.inner.recompute
    }

    /// Mini-batches simulated: 1, or an asynchronous schedule's run.
    #[getter]
    fn mini_batches(&self) -> u32 {
        self.inner.mini_batches
    }

    /// When the last task ends (absent in version 1 files).
    #[getter]
    fn span_ms(&self) -> Option<f64> {
        self.inner.span_ms
    }

    /// Each stage's timeline (bubbles, memory over time), as plain data:
    /// without the tasks, which can be millions.
    #[getter]
    fn stages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::convert::to_python(py, &self.inner.stages)
    }

    /// Under a chunked kind, the rank of each stage (`stages` are then
    /// one timeline a rank); empty: stage s is rank s.
    #[getter]
    fn stage_ranks(&self) -> Vec<u32> {
        self.inner.stage_ranks.clone()
    }

    /// Every task, as plain data.
    #[getter]
    fn tasks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::convert::to_python(py, &self.inner.tasks)
    }

    fn __repr__(&self) -> String {
        format!("Simulation({}, {:.3} ms)", self.inner.schedule, self.inner.iteration_ms)
    }
});

/// Simulate one iteration of a plan with the costs of its estimate.
#[pyfunction]
#[pyo3(signature = (plan, profile, *, schedule=None, recompute=false, overlap_allreduce=true))]
fn simulate(
    py: Python<'_>,
    plan: &PyPlan,
    profile: &PyProfile,
    schedule: Option<&str>,
    recompute: bool,
    overlap_allreduce: bool,
) -> PyResult<PySimulation> {
    let kind = schedule
        .map(ScheduleKind::parse)
        .transpose()
        .map_err(|e| to_py_err(e.under("schedule")))?;
    let opts = SimulationOptions {
        schedule: kind,
        recompute,
        overlap_allreduce,
    };
    let inner = py
        .detach(|| simulate_plan(&plan.inner, &profile.inner, opts))
        .map_err(|e| plan.err(e))?;
    Ok(crate::Wraps::wrap(inner, None))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySimulation>()?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    Ok(())
}
