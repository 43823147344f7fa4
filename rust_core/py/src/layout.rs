//! The core's run layout (`layout.rs`: what each process of a run does) as
//! frozen classes the runtime asks; it derives nothing of its own.

use dapple_core::layout::{Peer, ReplicaLayout, RunLayout, StageLayout};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::schedule::PyAction;

/// Samples `[start, end)` of each micro-batch exchanged with `rank`.
#[pyclass(frozen, module = "planner._core", name = "Peer")]
#[derive(Clone)]
pub struct PyPeer(Peer);

#[pymethods]
impl PyPeer {
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank
    }
    #[getter]
    fn start(&self) -> u32 {
        self.0.start
    }
    #[getter]
    fn end(&self) -> u32 {
        self.0.end
    }
    fn __repr__(&self) -> String {
        format!(
            "Peer(rank={}, start={}, end={})",
            self.0.rank, self.0.start, self.0.end
        )
    }
}

fn peers<'py>(py: Python<'py>, peers: &[Peer]) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, peers.iter().map(|p| PyPeer(*p)))
}

/// One replica of a stage: its rank, its samples of every micro-batch, and
/// the ranks it receives its input from and sends its output to.
#[pyclass(frozen, module = "planner._core", name = "ReplicaLayout")]
#[derive(Clone)]
pub struct PyReplicaLayout(ReplicaLayout);

#[pymethods]
impl PyReplicaLayout {
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank
    }
    /// First sample of every micro-batch this replica computes.
    #[getter]
    fn start(&self) -> u32 {
        self.0.start
    }
    /// One past its last sample.
    #[getter]
    fn end(&self) -> u32 {
        self.0.end
    }
    #[getter]
    fn receives_from<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        peers(py, &self.0.receives_from)
    }
    #[getter]
    fn sends_to<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        peers(py, &self.0.sends_to)
    }
}

/// One stage: its layers, its replicas and its action list.
#[pyclass(frozen, module = "planner._core", name = "StageLayout")]
#[derive(Clone)]
pub struct PyStageLayout(StageLayout);

#[pymethods]
impl PyStageLayout {
    #[getter]
    fn layer_start(&self) -> usize {
        self.0.layer_start
    }
    #[getter]
    fn layer_end(&self) -> usize {
        self.0.layer_end
    }
    /// By replica index.
    #[getter]
    fn replicas<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.replicas.iter().cloned().map(PyReplicaLayout))
    }
    /// Forwards and backwards, then "AR" and "OPT".
    #[getter]
    fn actions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.actions.iter().copied().map(PyAction))
    }
}

/// What each process of a run does (`layout::RunLayout`), from `Plan.layout`.
/// Picklable, so launched workers get it as it is.
#[pyclass(frozen, module = "planner._core", name = "RunLayout")]
pub struct PyRunLayout(pub(crate) RunLayout);

#[pymethods]
impl PyRunLayout {
    /// Rebuild a layout from `to_json`'s text (pickling).
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        serde_json::from_str(text)
            .map(PyRunLayout)
            .map_err(|e| PyValueError::new_err(format!("not a run layout: {e}")))
    }
    fn to_json(&self) -> String {
        serde_json::to_string(&self.0).expect("a layout always serializes")
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((slf.get_type().getattr("from_json")?, (slf.get().to_json(),)))
    }
    /// Used device ids, ascending: rank r runs on `devices[r]`.
    #[getter]
    fn devices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.0.devices)
    }
    #[getter]
    fn micro_batch_size(&self) -> u32 {
        self.0.micro_batch_size
    }
    #[getter]
    fn micro_batches(&self) -> u32 {
        self.0.micro_batches
    }
    #[getter]
    fn stages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.stages.iter().cloned().map(PyStageLayout))
    }
    #[getter]
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    #[getter]
    fn global_batch_size(&self) -> u32 {
        self.0.global_batch_size()
    }
    /// (stage, replica index) of `rank`; ValueError when the run has no such rank.
    #[pyo3(name = "where")]
    fn where_(&self, rank: u32) -> PyResult<(usize, usize)> {
        self.0
            .position(rank)
            .ok_or_else(|| PyValueError::new_err(format!("rank {rank} is not in the plan")))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPeer>()?;
    m.add_class::<PyReplicaLayout>()?;
    m.add_class::<PyStageLayout>()?;
    m.add_class::<PyRunLayout>()?;
    Ok(())
}
