//! The core's run layout (`plan/layout.rs`: what each process of a run does) as
//! frozen classes the runtime asks; it derives nothing of its own.

use dapple_core::plan::layout::{Peer, ReplicaLayout, RunLayout, StageLayout};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::schedule::PyAction;

/// Samples `[start, end)` of each micro-batch exchanged with `rank`.
#[pyclass(frozen, get_all, module = "dapple.planner._core", name = "Peer")]
#[derive(Clone)]
pub struct PyPeer {
    rank: u32,
    start: u32,
    end: u32,
}

impl From<&Peer> for PyPeer {
    fn from(p: &Peer) -> Self {
        PyPeer {
            rank: p.rank,
            start: p.start,
            end: p.end,
        }
    }
}

/// One rank of a stage: shard `shard` at context rank `context` of replica
/// `replica`, its samples `[start, end)` of every micro-batch, the ranks it
/// receives its input from and sends its output to, and those it sends its
/// input's gradient to and receives its output's gradient from, in order.
#[pyclass(
    frozen,
    get_all,
    module = "dapple.planner._core",
    name = "ReplicaLayout"
)]
#[derive(Clone)]
pub struct PyReplicaLayout {
    rank: u32,
    replica: u32,
    shard: u32,
    context: u32,
    start: u32,
    end: u32,
    receives_from: Vec<PyPeer>,
    sends_to: Vec<PyPeer>,
    gradients_to: Vec<PyPeer>,
    gradients_from: Vec<PyPeer>,
}

impl From<&ReplicaLayout> for PyReplicaLayout {
    fn from(r: &ReplicaLayout) -> Self {
        let peers =
            |list: &[dapple_core::plan::layout::Peer]| list.iter().map(PyPeer::from).collect();
        PyReplicaLayout {
            rank: r.rank,
            replica: r.replica,
            shard: r.shard,
            context: r.context,
            start: r.start,
            end: r.end,
            receives_from: peers(&r.receives_from),
            sends_to: peers(&r.sends_to),
            gradients_to: peers(&r.gradients_to),
            gradients_from: peers(&r.gradients_from),
        }
    }
}

/// One stage: its layers, its ranks (`replicas`, one entry per rank in the
/// order of its devices), its action list (forwards and backwards, then
/// "AR" and "OPT"), its shape (split degree, ZeRO-1, re-computation, expert
/// degree, an offloaded optimizer, context degree) and the ranks of its
/// split groups (by replica and context rank), replica groups (by shard),
/// context groups (by replica and shard), expert groups and the groups
/// holding the same experts.
#[pyclass(frozen, get_all, module = "dapple.planner._core", name = "StageLayout")]
#[derive(Clone)]
pub struct PyStageLayout {
    layer_start: usize,
    layer_end: usize,
    replicas: Vec<PyReplicaLayout>,
    actions: Vec<PyAction>,
    tensor_parallel: u32,
    shard_level: u8,
    reshard_after_forward: bool,
    recompute: bool,
    recompute_per_layer: bool,
    split_groups: Vec<Vec<u32>>,
    replica_groups: Vec<Vec<u32>>,
    context_parallel: u32,
    context_groups: Vec<Vec<u32>>,
    expert_parallel: u32,
    expert_groups: Vec<Vec<u32>>,
    expert_replica_groups: Vec<Vec<u32>>,
    offload_optimizer: bool,
}

impl From<&StageLayout> for PyStageLayout {
    fn from(s: &StageLayout) -> Self {
        PyStageLayout {
            layer_start: s.layer_start,
            layer_end: s.layer_end,
            replicas: s.replicas.iter().map(PyReplicaLayout::from).collect(),
            actions: s.actions.iter().copied().map(PyAction).collect(),
            tensor_parallel: s.tensor_parallel,
            shard_level: s.shard_level,
            reshard_after_forward: s.reshard_after_forward,
            recompute: s.recompute,
            recompute_per_layer: s.recompute_per_layer,
            split_groups: s.split_groups.clone(),
            replica_groups: s.replica_groups.clone(),
            context_parallel: s.context_parallel,
            context_groups: s.context_groups.clone(),
            expert_parallel: s.expert_parallel,
            expert_groups: s.expert_groups.clone(),
            expert_replica_groups: s.expert_replica_groups.clone(),
            offload_optimizer: s.offload_optimizer,
        }
    }
}

/// What each process of a run does (`layout::RunLayout`), from `Plan.layout`.
/// Picklable, so launched workers get it as it is.
#[pyclass(frozen, module = "dapple.planner._core", name = "RunLayout")]
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
        PyTuple::new(py, self.0.stages.iter().map(PyStageLayout::from))
    }
    #[getter]
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    #[getter]
    fn global_batch_size(&self) -> u32 {
        self.0.global_batch_size()
    }
    /// (stage, replica index) of each stage `rank` runs: one, or a chunked
    /// plan's chunks of its rank.
    fn positions(&self, rank: u32) -> Vec<(usize, usize)> {
        self.0.positions(rank)
    }
    /// (stage, replica index) of `rank` (its first stage); ValueError when
    /// the run has no such rank.
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
