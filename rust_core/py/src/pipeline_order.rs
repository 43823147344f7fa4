//! Pipeline orders over ranks holding several stages (`schedule/pipeline_order.rs`),
//! in torch's action notation (`0F0`, `1I3`, `2W1`), as typed objects.

use dapple_core::schedule::pipeline_order::{PipelineOrder, StageAction};
use pyo3::prelude::*;

use crate::to_py_err;

/// One action of a rank: `computation` ("F", "B", "I" or "W") of `stage`
/// on `micro_batch`. Prints as torch's `_Action` (`1F3`); picklable.
#[pyclass(
    frozen,
    eq,
    hash,
    str,
    module = "dapple.planner._core",
    name = "StageAction"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyStageAction(StageAction);

impl std::fmt::Display for PyStageAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[pymethods]
impl PyStageAction {
    /// The action written `text`, as torch writes it (`1F3`).
    #[staticmethod]
    fn parse(text: &str) -> PyResult<Self> {
        text.parse().map(PyStageAction).map_err(to_py_err)
    }

    #[getter]
    fn stage(&self) -> u32 {
        self.0.stage
    }

    /// "F", "B", "I" or "W".
    #[getter]
    fn computation(&self) -> String {
        self.0.computation.symbol().to_string()
    }

    #[getter]
    fn micro_batch(&self) -> u32 {
        self.0.micro_batch
    }

    fn __repr__(&self) -> String {
        format!("StageAction({:?})", self.0.to_string())
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((slf.get_type().getattr("parse")?, (slf.get().0.to_string(),)))
    }
}

/// Every rank's actions, validated (no deadlock), from one of the
/// generators or from torch's schedule CSV.
#[pyclass(frozen, eq, module = "dapple.planner._core", name = "PipelineOrder")]
#[derive(PartialEq)]
pub struct PyPipelineOrder(pub(crate) PipelineOrder);

#[pymethods]
impl PyPipelineOrder {
    /// Interleaved 1F1B, as torch's `ScheduleInterleaved1F1B`.
    #[staticmethod]
    fn interleaved_1f1b(ranks: u32, micro_batches: u32, chunks: u32) -> PyResult<Self> {
        PipelineOrder::interleaved_1f1b(ranks, micro_batches, chunks)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// Interleaved zero bubble (ZB-H1 at one chunk), as torch's
    /// `ScheduleInterleavedZeroBubble`.
    #[staticmethod]
    fn interleaved_zero_bubble(ranks: u32, micro_batches: u32, chunks: u32) -> PyResult<Self> {
        PipelineOrder::interleaved_zero_bubble(ranks, micro_batches, chunks)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// ZB-V, as torch's `ScheduleZBVZeroBubble`.
    #[staticmethod]
    fn zbv(ranks: u32, micro_batches: u32) -> PyResult<Self> {
        PipelineOrder::zbv(ranks, micro_batches)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// ZB-H2 (Zero Bubble's, one stage a rank; torch has no class for it).
    #[staticmethod]
    fn zb_h2(ranks: u32, micro_batches: u32) -> PyResult<Self> {
        PipelineOrder::zb_h2(ranks, micro_batches)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// DualPipeV, as torch's `ScheduleDualPipeV`.
    #[staticmethod]
    fn dualpipev(ranks: u32, micro_batches: u32) -> PyResult<Self> {
        PipelineOrder::dualpipev(ranks, micro_batches)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// The order in torch's CSV (`compute_only`; empty cells skipped).
    #[staticmethod]
    fn from_csv(text: &str, micro_batches: u32) -> PyResult<Self> {
        PipelineOrder::from_csv(text, micro_batches)
            .map(PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// torch's schedule CSV: one row per rank.
    fn to_csv(&self) -> String {
        self.0.to_csv()
    }

    /// Each rank's cells as torch writes its actions (an overlapped
    /// forward and backward as one cell, `(0F3;3B1)OVERLAP_F_B`).
    fn rank_cells(&self) -> Vec<Vec<String>> {
        self.0.rank_cells()
    }

    #[getter]
    fn micro_batches(&self) -> u32 {
        self.0.micro_batches
    }

    /// `stage_ranks[s]`: the rank that runs stage s.
    #[getter]
    fn stage_ranks(&self) -> Vec<u32> {
        self.0.stage_ranks.clone()
    }

    /// Each rank's actions, in the order it runs them.
    #[getter]
    fn rank_actions(&self) -> Vec<Vec<PyStageAction>> {
        self.0
            .rank_actions
            .iter()
            .map(|row| row.iter().copied().map(PyStageAction).collect())
            .collect()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStageAction>()?;
    m.add_class::<PyPipelineOrder>()?;
    Ok(())
}
