use dapple_core::interleave::{simulate_interleaved as simulate_plan_interleaved, ChunkedOrder};
use dapple_core::schedule::ScheduleKind;
use dapple_core::simulate::{
    simulate as simulate_plan, Simulation, SimulationOptions, StageTimeline,
};
use pyo3::prelude::*;
use serde::Serialize;

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

/// What `simulate_interleaved` gives Python: the chunks, the iteration and
/// each rank's timeline, without the tasks.
#[derive(Serialize)]
struct InterleavedRun<'a> {
    order: &'static str,
    chunks: u32,
    chunk_layers: &'a [(usize, usize)],
    chunk_ranks: &'a [u32],
    iteration_ms: f64,
    ranks: &'a [StageTimeline],
}

/// The plan's ranks running `order` with `chunks` chunks each
/// (`interleave.rs`), as a dict.
#[pyfunction]
#[pyo3(signature = (plan, profile, chunks, *, order="interleaved-1f1b"))]
fn simulate_interleaved<'py>(
    py: Python<'py>,
    plan: &PyPlan,
    profile: &PyProfile,
    chunks: u32,
    order: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let kind = ChunkedOrder::parse(order).map_err(|e| to_py_err(e.under("order")))?;
    let run = py
        .detach(|| simulate_plan_interleaved(&plan.inner, &profile.inner, kind, chunks))
        .map_err(|e| plan.err(e))?;
    let view = InterleavedRun {
        order: kind.name(),
        chunks,
        chunk_layers: &run.chunk_layers,
        chunk_ranks: &run.chunk_ranks,
        iteration_ms: run.simulation.iteration_ms,
        ranks: &run.simulation.ranks,
    };
    crate::convert::to_python(py, &view)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySimulation>()?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulate_interleaved, m)?)?;
    Ok(())
}
