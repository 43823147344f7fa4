use dapple_core::plan::layout::RunLayout;
use dapple_core::plan::{blocks_per_stage, Plan, Stage};
use dapple_core::schedule::ScheduleKind;
use dapple_core::search::interleave::chunked;
use dapple_core::simulation::evaluate::evaluate;
use dapple_core::simulation::warmup::{fastest_valid_warmups, plan_with_chosen_warmups};
use pyo3::prelude::*;

use crate::layout::PyRunLayout;
use crate::profile::PyProfile;
use crate::schedule::{PyAction, PyPass};
use crate::topology::PyTopology;
use crate::{to_py_err, with_source};

/// How one stage runs besides replicating its layers (`cost/shape.rs`), with
/// what follows from its GPUs: asked by pictures and tables, never
/// re-derived in Python.
#[pyclass(frozen, get_all, module = "dapple.planner._core", name = "StageShape")]
#[derive(Clone)]
pub struct PyStageShape {
    /// Whale's split degree t (1: no layer splits).
    tensor_parallel: u32,
    /// Sequence parallelism in the split layers.
    sequence_parallel: bool,
    /// Data replicas of the split layers: the stage's GPUs / (t c).
    replicas: u32,
    /// The GPUs holding the same weights, over which gradients are reduced
    /// and state sharded: the data replicas' context ranks, GPUs / t.
    weight_replicas: u32,
    /// Context parallelism: each sample's sequence cut over this many
    /// consecutive split groups (1: none).
    context_parallel: u32,
    /// The sharding level over the replicas: 0 none, 1 optimizer state
    /// (ZeRO-1), 2 and gradients (ZeRO-2), 3 and weights (ZeRO-3, FSDP).
    shard_level: u8,
    /// Level 3: the weights freed after each forward and gathered again
    /// for the backward (FSDP's `reshard_after_forward`).
    reshard_after_forward: bool,
    /// "none", "full", "per-layer" or "selective".
    recompute: &'static str,
    /// Expert parallelism: the routed experts over groups of this many
    /// consecutive replicas (1: none).
    expert_parallel: u32,
    /// The GPUs each routed expert's columns are split over (Megatron-LM's
    /// expert tensor degree; t unless the stage says otherwise).
    expert_tensor_parallel: u32,
    /// Where the master weights and optimizer state live: "none" (the
    /// GPUs) or "optimizer" (host memory, stepped by its CPU).
    offload: &'static str,
    /// t = 1, no sharding, no re-computation, no expert or context
    /// parallelism, no offloading: a stage as DAPPLE plans it.
    is_plain: bool,
    /// Each replica's devices: t consecutive devices of the stage.
    split_groups: Vec<Vec<u32>>,
    /// Each expert group's devices: shard k of e consecutive expert
    /// replicas (of the expert tensor degree's consecutive devices each).
    expert_groups: Vec<Vec<u32>>,
}

impl From<&Stage> for PyStageShape {
    fn from(s: &Stage) -> Self {
        let shape = &s.shape;
        PyStageShape {
            tensor_parallel: shape.tensor_parallel,
            sequence_parallel: shape.sequence_parallel,
            replicas: s.replicas(),
            weight_replicas: shape.weight_replicas(s.devices.len() as u32),
            context_parallel: shape.context_parallel,
            shard_level: shape.shard_level,
            reshard_after_forward: shape.reshard_after_forward,
            recompute: shape.recompute.name(),
            expert_parallel: shape.expert_parallel,
            expert_tensor_parallel: shape.expert_tensor_degree(),
            offload: shape.offload.name(),
            is_plain: shape.is_plain(),
            split_groups: s.split_groups().map(<[u32]>::to_vec).collect(),
            expert_groups: s.expert_groups(),
        }
    }
}

#[pymethods]
impl PyStageShape {
    fn __repr__(&self) -> String {
        format!(
            "StageShape(tensor_parallel={}, sequence_parallel={}, replicas={}, context_parallel={}, shard_level={}, \
             reshard_after_forward={}, recompute={:?}, expert_parallel={}, expert_tensor_parallel={}, offload={:?})",
            self.tensor_parallel,
            python_bool(self.sequence_parallel),
            self.replicas,
            self.context_parallel,
            self.shard_level,
            python_bool(self.reshard_after_forward),
            self.recompute,
            self.expert_parallel,
            self.expert_tensor_parallel,
            self.offload
        )
    }
}

fn python_bool(value: bool) -> &'static str {
    if value {
        "True"
    } else {
        "False"
    }
}

crate::file_object_class!(
    /// A plan (`dapple.plan`), checked for its format. Whether it fits a
    /// profile is checked where it is costed (`evaluate`, `simulate`).
    PyPlan(Plan, "Plan")
);

impl PyPlan {
    /// The plan's schedule, or `kind`'s, over `mini_batches` when asynchronous.
    fn schedule(
        &self,
        kind: Option<&str>,
        mini_batches: Option<u32>,
    ) -> PyResult<dapple_core::schedule::Schedule> {
        let kind = kind
            .map(ScheduleKind::parse)
            .transpose()
            .map_err(|e| to_py_err(e.under("schedule")))?;
        match mini_batches {
            Some(n) => dapple_core::plan::plan_schedule_over(&self.inner, kind, n),
            None => dapple_core::plan::plan_schedule(&self.inner, kind),
        }
        .map_err(|e| self.err(e))
    }

    /// A core error about this plan, naming its file.
    pub(crate) fn err(&self, e: dapple_core::Error) -> PyErr {
        to_py_err(with_source(e, self.source.as_deref()))
    }
}

crate::file_object_methods!(PyPlan {
    /// GPUs per stage, e.g. "8:8"; "16" is data parallelism.
    #[getter]
    fn shape(&self) -> String {
        self.inner.shape()
    }

    /// "data parallel", "straight" or "hybrid".
    #[getter]
    fn layout_kind(&self) -> &'static str {
        self.inner.layout_kind().name()
    }

    #[getter]
    fn num_stages(&self) -> usize {
        self.inner.stages.len()
    }

    #[getter]
    fn micro_batch_size(&self) -> u32 {
        self.inner.micro_batch_size
    }

    #[getter]
    fn micro_batches(&self) -> u32 {
        self.inner.micro_batches
    }

    #[getter]
    fn global_batch_size(&self) -> u32 {
        self.inner.inputs.global_batch_size
    }

    #[getter]
    fn model(&self) -> &str {
        &self.inner.inputs.model
    }

    #[getter]
    fn schedule_kind(&self) -> &'static str {
        self.inner.schedule.kind.name()
    }

    #[getter]
    fn warmup_policy(&self) -> &'static str {
        self.inner.schedule.warmup_policy.name()
    }

    /// Which stages reduce their gradients behind their backward
    /// (`schedule.overlap.grad_reduce`).
    #[getter]
    fn overlap_grad_reduce(&self) -> &'static str {
        self.inner.schedule.overlap.grad_reduce.name()
    }

    /// Whether ZeRO-1 stages gather their weights behind the next forward.
    #[getter]
    fn overlap_param_gather(&self) -> bool {
        self.inner.schedule.overlap.param_gather
    }

    /// Whether some stage reduces its gradients behind its backward.
    #[getter]
    fn hides_grad_reduce(&self) -> bool {
        self.inner.hides_grad_reduce()
    }

    /// Whether some ZeRO-1 stage gathers its weights behind the next forward.
    #[getter]
    fn hides_param_gather(&self) -> bool {
        self.inner.hides_param_gather()
    }

    /// Stages (chunks) each pipeline rank holds: 1 but under a chunked kind.
    #[getter]
    fn chunks(&self) -> u32 {
        self.inner.schedule.chunks
    }

    /// The pipeline rank of each stage (stage s's own, or where a chunked
    /// kind's order puts it).
    #[getter]
    fn stage_ranks(&self) -> Vec<u32> {
        self.inner.stage_ranks()
    }

    /// Simulated iteration time, the headline (formula (2) for version 1
    /// plans); None without an estimate.
    #[getter]
    fn iteration_ms(&self) -> Option<f64> {
        self.inner.iteration_ms()
    }

    /// The cluster the plan was made for.
    #[getter]
    fn topology(&self) -> PyTopology {
        crate::Wraps::wrap(self.inner.inputs.topology.clone(), None)
    }

    /// Each stage's shape: split degree, replicas, ZeRO-1, re-computation
    /// and split groups.
    fn stage_shapes(&self) -> Vec<PyStageShape> {
        self.inner.stages.iter().map(PyStageShape::from).collect()
    }

    /// The profile's "block" layers (the model's own layers) per stage.
    fn blocks_per_stage(&self, profile: &PyProfile) -> Vec<usize> {
        blocks_per_stage(&profile.inner, &self.inner)
    }

    /// Each stage's actions ("F3", "B2", "AR", "OPT" as `Action`s): the
    /// lists the simulator runs and the runtime executes. `schedule`: another
    /// kind than the plan's own (early backward then takes the K_i of the
    /// plan's fixed policy, or policy A's). `mini_batches`: how many an
    /// asynchronous kind runs (default: the simulator's steady-state run).
    #[pyo3(signature = (schedule=None, mini_batches=None))]
    fn actions(&self, schedule: Option<&str>, mini_batches: Option<u32>) -> PyResult<Vec<Vec<PyAction>>> {
        Ok(crate::schedule::actions_of(&self.schedule(schedule, mini_batches)?))
    }

    /// The order torch's pipelining would run this plan by, one pipeline
    /// rank per stage, in torch's action notation
    /// (`Plan::pipeline_order`); refused, naming what differs, where
    /// torch cannot run the plan as it is.
    fn pipeline_order(&self) -> PyResult<crate::pipeline_order::PyPipelineOrder> {
        self.inner
            .pipeline_order()
            .map(crate::pipeline_order::PyPipelineOrder)
            .map_err(to_py_err)
    }

    /// Each stage's list with the weights of every pass, `stage 0: F0@0
    /// F1@0+1 ... AR OPT` (`Schedule::weights_table`); arguments as `actions`.
    #[pyo3(signature = (schedule=None, mini_batches=None))]
    fn weights_table(&self, schedule: Option<&str>, mini_batches: Option<u32>) -> PyResult<String> {
        Ok(self.schedule(schedule, mini_batches)?.weights_table())
    }

    /// Each stage's actions in list order, each a `Pass` with the weights a
    /// forward or backward computes with (`Schedule::pass_weights`; a
    /// synchronous schedule's passes all use the live weights); arguments
    /// as `actions`. One schedule is built for both.
    /// A chunked plan (its own schedule, one mini-batch): each pipeline
    /// rank's list instead, each pass naming its stage.
    #[pyo3(signature = (schedule=None, mini_batches=None))]
    fn pass_weights(&self, schedule: Option<&str>, mini_batches: Option<u32>) -> PyResult<Vec<Vec<PyPass>>> {
        let own = self.inner.schedule.kind;
        if own.is_chunked() && schedule.is_none_or(|k| k == own.name()) && mini_batches.unwrap_or(1) == 1 {
            let order = self.inner.chunked_order().map_err(|e| self.err(e))?;
            return Ok(crate::schedule::chunked_passes(&order));
        }
        Ok(crate::schedule::passes_of(&self.schedule(schedule, mini_batches)?))
    }

    /// What each process of a run does (`plan/layout.rs`): used devices by
    /// rank, and per stage its layers, actions and replicas (rank, samples,
    /// who it receives from and sends to).
    fn layout(&self) -> PyResult<PyRunLayout> {
        RunLayout::of(&self.inner).map(PyRunLayout).map_err(|e| self.err(e))
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan({:?}, {}, {} x {})",
            self.inner.inputs.model,
            self.inner.shape(),
            self.inner.micro_batches,
            self.inner.micro_batch_size
        )
    }
});

/// Cost a plan against a profile; returns the plan with a fresh estimate.
#[pyfunction(name = "evaluate")]
fn evaluate_plan(py: Python<'_>, plan: &PyPlan, profile: &PyProfile) -> PyResult<PyPlan> {
    let estimate = py
        .detach(|| evaluate(&plan.inner, &profile.inner))
        .map_err(|e| plan.err(e))?;
    let mut costed = plan.inner.clone();
    costed.estimate = Some(estimate);
    Ok(crate::Wraps::wrap(costed, plan.source.clone()))
}

/// The plan under warm-up policy auto, with the depths that simulate
/// fastest within memory, costed; None when no depths fit.
#[pyfunction]
fn choose_warmups(py: Python<'_>, plan: &PyPlan, profile: &PyProfile) -> PyResult<Option<PyPlan>> {
    let (chosen, _) = py
        .detach(|| plan_with_chosen_warmups(&plan.inner, &profile.inner))
        .map_err(|e| plan.err(e))?;
    Ok(chosen.map(|p| crate::Wraps::wrap(p, plan.source.clone())))
}

/// Every valid warm-up vector of the plan's layout that fits in memory,
/// simulated (`warmup::fastest_valid_warmups`): the fastest depths, their
/// iteration and how many vectors there were; None where there are more
/// than `max_vectors` or none fits. A check of `choose_warmups`.
#[pyfunction(name = "fastest_valid_warmups")]
fn fastest_valid_warmups_py(
    py: Python<'_>,
    plan: &PyPlan,
    profile: &PyProfile,
    max_vectors: u64,
) -> PyResult<Option<(Vec<u32>, f64, u64)>> {
    let found = py
        .detach(|| fastest_valid_warmups(&plan.inner, &profile.inner, max_vectors))
        .map_err(|e| plan.err(e))?;
    Ok(found.map(|f| (f.depths, f.iteration_ms, f.vectors)))
}

/// The plan's ranks (one stage each) running chunked `schedule`, the
/// layers cut again into `chunks` chunks a rank, or the fastest count that
/// fits (`interleave::chunked`); costed. Not a file's plan: no source.
#[pyfunction]
#[pyo3(signature = (plan, profile, schedule, chunks=None))]
fn chunked_plan(
    py: Python<'_>,
    plan: &PyPlan,
    profile: &PyProfile,
    schedule: &str,
    chunks: Option<u32>,
) -> PyResult<PyPlan> {
    let kind = ScheduleKind::parse(schedule).map_err(|e| to_py_err(e.under("schedule")))?;
    if !kind.is_chunked() {
        return Err(to_py_err(dapple_core::Error::field(
            "schedule",
            format!("value {schedule:?} runs one stage a rank; name a chunked kind"),
        )));
    }
    let made = py
        .detach(|| chunked(&plan.inner, &profile.inner, kind, chunks))
        .map_err(|e| plan.err(e))?;
    Ok(crate::Wraps::wrap(made, None))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPlan>()?;
    m.add_function(wrap_pyfunction!(chunked_plan, m)?)?;
    m.add_class::<PyStageShape>()?;
    m.add_function(wrap_pyfunction!(evaluate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(choose_warmups, m)?)?;
    m.add_function(wrap_pyfunction!(fastest_valid_warmups_py, m)?)?;
    Ok(())
}
