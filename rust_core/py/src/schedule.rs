//! Schedules as typed data: the core's `Action` (printed and parsed as the
//! core writes it, `F3`, `B2`, `AR`, `OPT`) and its weights per pass, as
//! frozen classes, so Python never splits action text.

use dapple_core::schedule::pipeline_order::PipelineOrder;
use dapple_core::schedule::{
    rank_lists, Action, ActionKind, PassWeights, Schedule, ScheduleKind, StageSchedule,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::to_py_err;

/// One action of a stage's list (`schedule.rs`'s `Action`): a forward or
/// backward of a micro-batch, the stage's gradient AllReduce, or its
/// optimizer step. Prints as the core writes it; picklable.
#[pyclass(
    frozen,
    eq,
    hash,
    str,
    from_py_object,
    module = "dapple.planner._core",
    name = "Action"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyAction(pub(crate) Action);

impl std::fmt::Display for PyAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[pymethods]
impl PyAction {
    /// `kind`: "F", "B", "I", "W", "AR" or "OPT"; `micro_batch` for the
    /// passes (F, B, I, W) only.
    #[new]
    #[pyo3(signature = (kind, micro_batch=None))]
    fn new(kind: &str, micro_batch: Option<u32>) -> PyResult<Self> {
        let kind = ActionKind::from_symbol(kind).ok_or_else(|| {
            PyValueError::new_err(format!("action kind {kind:?} is not F, B, I, W, AR or OPT"))
        })?;
        if kind.is_pass() != micro_batch.is_some() {
            return Err(PyValueError::new_err(format!(
                "a {} action {} a micro-batch",
                kind.symbol(),
                if kind.is_pass() { "needs" } else { "takes no" }
            )));
        }
        Ok(PyAction(Action::new(kind, micro_batch)))
    }

    /// The action written `text` (`F3`, `B2`, `I2`, `W2`, `AR`, `OPT`), as
    /// the core parses it.
    #[staticmethod]
    fn parse(text: &str) -> PyResult<Self> {
        text.parse().map(PyAction).map_err(to_py_err)
    }

    /// "F", "B", "I", "W", "AR" or "OPT".
    #[getter]
    fn kind(&self) -> &'static str {
        self.0.kind.symbol()
    }

    /// The micro-batch of a forward or backward (of the run, for an
    /// asynchronous list); None for "AR" and "OPT".
    #[getter]
    fn micro_batch(&self) -> Option<u32> {
        self.0.micro_batch
    }

    fn __repr__(&self) -> String {
        format!("Action({:?})", self.0.to_string())
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((slf.get_type().getattr("parse")?, (slf.get().0.to_string(),)))
    }
}

/// One action of a stage's list with the weights a forward or backward
/// computes with (`Schedule::pass_weights`): the mini-batch it belongs to,
/// the updates the stage has applied when it runs (`live_version`), the
/// version its weights come from (`base_version`) and the updates predicted
/// ahead of that (`predicted_updates`, 0: none); None for "AR" and "OPT".
/// Prints as the core's weights table (`F4@0+2`); picklable.
#[pyclass(
    frozen,
    eq,
    str,
    get_all,
    module = "dapple.planner._core",
    name = "Pass"
)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PyPass {
    action: PyAction,
    /// The stage the pass computes: its list's, or under a chunked plan
    /// the chunk of the rank's list it belongs to.
    stage: usize,
    mini_batch: Option<u32>,
    live_version: Option<u32>,
    base_version: Option<u32>,
    predicted_updates: Option<u32>,
}

impl PyPass {
    fn of(stage: usize, action: Action, weights: Option<PassWeights>) -> Self {
        PyPass {
            action: PyAction(action),
            stage,
            mini_batch: weights.map(|w| w.mini_batch),
            live_version: weights.map(|w| w.live_version),
            base_version: weights.map(|w| w.base_version),
            predicted_updates: weights.map(|w| w.predicted_updates),
        }
    }

    /// The core's weights of a forward or backward.
    fn weights(&self) -> Option<PassWeights> {
        Some(PassWeights {
            action: self.action.0,
            mini_batch: self.mini_batch?,
            live_version: self.live_version?,
            base_version: self.base_version?,
            predicted_updates: self.predicted_updates?,
        })
    }
}

impl std::fmt::Display for PyPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.weights() {
            Some(w) => w.fmt(f),
            None => self.action.fmt(f),
        }
    }
}

#[pymethods]
impl PyPass {
    /// `weights`: (mini-batch, live version, base version, updates predicted
    /// ahead) for a forward or backward, None for "AR" and "OPT"; `stage`:
    /// the stage it computes.
    #[new]
    #[pyo3(signature = (action, weights=None, stage=0))]
    fn new(
        action: PyAction,
        weights: Option<(u32, u32, u32, u32)>,
        stage: usize,
    ) -> PyResult<Self> {
        let action = action.0;
        if action.kind.is_pass() != weights.is_some() {
            return Err(PyValueError::new_err(format!(
                "{action}: weights go with forwards and backwards only"
            )));
        }
        let weights = weights.map(
            |(mini_batch, live_version, base_version, predicted_updates)| PassWeights {
                action,
                mini_batch,
                live_version,
                base_version,
                predicted_updates,
            },
        );
        Ok(PyPass::of(stage, action, weights))
    }

    fn __repr__(&self) -> String {
        format!("Pass({self})")
    }

    #[allow(clippy::type_complexity)]
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(
        Bound<'py, PyAny>,
        (PyAction, Option<(u32, u32, u32, u32)>, usize),
    )> {
        let p = slf.get();
        let weights = p.weights().map(|w| {
            (
                w.mini_batch,
                w.live_version,
                w.base_version,
                w.predicted_updates,
            )
        });
        Ok((slf.get_type().into_any(), (p.action, weights, p.stage)))
    }
}

/// Each rank's list of a chunked plan's order (`schedule::rank_lists`),
/// each pass of one synchronous step on the live weights.
pub(crate) fn chunked_passes(order: &PipelineOrder) -> Vec<Vec<PyPass>> {
    rank_lists(order)
        .into_iter()
        .map(|list| {
            list.into_iter()
                .map(|(stage, action)| {
                    let weights = action.kind.is_pass().then_some(PassWeights {
                        action,
                        mini_batch: 0,
                        live_version: 0,
                        base_version: 0,
                        predicted_updates: 0,
                    });
                    PyPass::of(stage, action, weights)
                })
                .collect()
        })
        .collect()
}

/// Each stage's actions, typed.
pub(crate) fn actions_of(schedule: &Schedule) -> Vec<Vec<PyAction>> {
    schedule
        .stages
        .iter()
        .map(|s| s.actions.iter().copied().map(PyAction).collect())
        .collect()
}

/// Each stage's actions with the weights of its passes.
pub(crate) fn passes_of(schedule: &Schedule) -> Vec<Vec<PyPass>> {
    schedule
        .stages
        .iter()
        .map(|stage| {
            let mut weights = schedule.pass_weights(stage.stage).into_iter();
            stage
                .actions
                .iter()
                .map(|&action| {
                    let w = action
                        .micro_batch
                        .map(|_| weights.next().expect("one weight per pass"));
                    PyPass::of(stage.stage, action, w)
                })
                .collect()
        })
        .collect()
}

/// Action lists of a schedule, one per stage. Early backward takes K_i of
/// stage i from `warmup[i]`; GPipe needs none; an asynchronous kind runs
/// `mini_batches`. A plan's own lists come from `Plan.actions`.
#[pyfunction]
#[pyo3(signature = (kind, num_stages, micro_batches, warmup=None, mini_batches=1))]
fn schedule_actions(
    kind: &str,
    num_stages: usize,
    micro_batches: u32,
    warmup: Option<Vec<u32>>,
    mini_batches: u32,
) -> PyResult<Vec<Vec<PyAction>>> {
    let kind = ScheduleKind::parse(kind).map_err(|e| to_py_err(e.under("kind")))?;
    let schedule = match (kind, warmup) {
        (ScheduleKind::GPipe, _) => Schedule::gpipe(num_stages, micro_batches),
        (ScheduleKind::ZeroBubbleH1, _) => Schedule::zero_bubble_h1(num_stages, micro_batches),
        (ScheduleKind::ZeroBubbleH2, _) => Schedule::zero_bubble_h2(num_stages, micro_batches),
        (asynchronous, _) if asynchronous.is_asynchronous() => {
            Schedule::asynchronous(asynchronous, num_stages, micro_batches, mini_batches)
        }
        (ScheduleKind::EarlyBackward1F1B, Some(depths)) if depths.len() == num_stages => {
            Schedule::early_backward(num_stages, micro_batches, &depths)
        }
        (_, given) => Err(dapple_core::Error::field(
            "warmup",
            format!(
                "early backward needs one warm-up depth per stage: {num_stages} stages, {} depths",
                given.map_or(0, |d| d.len())
            ),
        )),
    }
    .map_err(to_py_err)?;
    Ok(actions_of(&schedule))
}

/// Check hand-made action lists (one per stage): every forward and backward
/// once, backward after forward, AR then OPT last, and no deadlock between
/// stages.
#[pyfunction]
fn schedule_validate(lists: Vec<Vec<PyAction>>, micro_batches: u32) -> PyResult<()> {
    let stages = lists
        .into_iter()
        .enumerate()
        .map(|(stage, list)| StageSchedule {
            stage,
            actions: list.into_iter().map(|a| a.0).collect(),
        })
        .collect();
    let schedule = Schedule {
        kind: ScheduleKind::EarlyBackward1F1B,
        micro_batches,
        mini_batches: 1,
        stages,
    };
    schedule.validate().map_err(to_py_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAction>()?;
    m.add_class::<PyPass>()?;
    m.add_function(wrap_pyfunction!(schedule_actions, m)?)?;
    m.add_function(wrap_pyfunction!(schedule_validate, m)?)?;
    Ok(())
}
