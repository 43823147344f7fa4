use dapple_core::baselines::{
    baseline_plans as every_baseline_plan, fastest_baseline_plan, layout_plan as plan_of_layout,
    Baseline, StageLayout,
};
use dapple_core::cost::shape::{Offload, Recompute, StageShape};
use dapple_core::cost::WarmupPolicy;
use dapple_core::plan::Plan;
use dapple_core::schedule::ScheduleKind;
use pyo3::prelude::*;

use crate::plan::PyPlan;
use crate::profile::PyProfile;
use crate::search::overlap_of;
use crate::topology::PyTopology;
use crate::{to_py_err, with_inputs};

/// Every plan of a baseline strategy (one of `BASELINES`) that fits, each
/// at its fastest warm-up depths, fastest first: the baseline's plan is the
/// first.
#[pyfunction]
#[pyo3(signature = (kind, profile, topology, global_batch_size, *, min_micro_batch_size=None, warmup_policy="auto", overlap_grad_reduce="data-parallel", overlap_param_gather=false))]
#[allow(clippy::too_many_arguments)]
fn baseline_plans(
    py: Python<'_>,
    kind: &str,
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    warmup_policy: &str,
    overlap_grad_reduce: &str,
    overlap_param_gather: bool,
) -> PyResult<Vec<PyPlan>> {
    let overlap = overlap_of(overlap_grad_reduce, overlap_param_gather)?;
    let kind = Baseline::parse(kind).map_err(|e| to_py_err(e.under("kind")))?;
    let policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    let plans = py
        .detach(|| {
            every_baseline_plan(
                kind,
                &profile.inner,
                &topology.inner,
                global_batch_size,
                min_micro_batch_size,
                (policy, overlap),
            )
        })
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    Ok(plans
        .into_iter()
        .map(|plan| made_from(plan, profile))
        .collect())
}

/// The plan of a baseline strategy: `baseline_plans`' first, found
/// without simulating every micro-batch size (in order of formula (2)'s
/// bound, which no simulation beats).
#[pyfunction]
#[pyo3(signature = (kind, profile, topology, global_batch_size, *, min_micro_batch_size=None, warmup_policy="auto", overlap_grad_reduce="data-parallel", overlap_param_gather=false))]
#[allow(clippy::too_many_arguments)]
fn baseline_plan(
    py: Python<'_>,
    kind: &str,
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    warmup_policy: &str,
    overlap_grad_reduce: &str,
    overlap_param_gather: bool,
) -> PyResult<PyPlan> {
    let overlap = overlap_of(overlap_grad_reduce, overlap_param_gather)?;
    let kind = Baseline::parse(kind).map_err(|e| to_py_err(e.under("kind")))?;
    let policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    let plan = py
        .detach(|| {
            fastest_baseline_plan(
                kind,
                &profile.inner,
                &topology.inner,
                global_batch_size,
                min_micro_batch_size,
                (policy, overlap),
            )
        })
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    Ok(made_from(plan, profile))
}

/// Any layout, `stages` as (layer_start, layer_end, devices) each, as the
/// plan it runs fastest as: the micro-batch size (and, under warm-up policy
/// auto, the warm-up depths) whose simulated iteration is shortest and fits.
#[pyfunction]
#[pyo3(signature = (profile, topology, global_batch_size, stages, *, schedule="early-backward-1f1b", warmup_policy="auto", min_micro_batch_size=None, made_by="layout"))]
#[allow(clippy::too_many_arguments)]
fn layout_plan(
    py: Python<'_>,
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    stages: Vec<StageLayout>,
    schedule: &str,
    warmup_policy: &str,
    min_micro_batch_size: Option<u32>,
    made_by: &str,
) -> PyResult<PyPlan> {
    let kind = ScheduleKind::parse(schedule).map_err(|e| to_py_err(e.under("schedule")))?;
    let policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    let plan = py
        .detach(|| {
            plan_of_layout(
                &profile.inner,
                &topology.inner,
                global_batch_size,
                &stages,
                kind,
                policy,
                min_micro_batch_size,
                made_by,
            )
        })
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    Ok(made_from(plan, profile))
}

/// The plan for an asynchronous schedule (`search/asynchronous.rs`): the fastest
/// uniform pipeline in its steady state that fits.
#[pyfunction]
#[pyo3(signature = (schedule, profile, topology, global_batch_size, *, min_micro_batch_size=None))]
fn asynchronous_plan(
    py: Python<'_>,
    schedule: &str,
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
) -> PyResult<PyPlan> {
    let kind = ScheduleKind::parse(schedule).map_err(|e| to_py_err(e.under("schedule")))?;
    let plan = py
        .detach(|| {
            dapple_core::search::asynchronous::asynchronous_plan(
                kind,
                &profile.inner,
                &topology.inner,
                global_batch_size,
                min_micro_batch_size,
            )
        })
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    Ok(made_from(plan, profile))
}

/// `plan`, recording the file its profile was read from (as the search's
/// plans do), so that the commands that read the plan find it.
fn made_from(mut plan: Plan, profile: &PyProfile) -> PyPlan {
    plan.inputs.profile_path = profile.source().map(str::to_string);
    crate::Wraps::wrap(plan, None)
}

/// One Megatron-LM layout as a run used it, not costed: t shards
/// (`tensor_parallel`), `pipeline_parallel` stages of equal blocks, the
/// GPUs left over as replicas, `micro_batch_size` samples a replica, every
/// stage at sharding level `shard_level` (0 to 3; at 3 re-sharded after the
/// forward or not), sequence parallelism or not (t > 1) and
/// re-computing as `recompute` says (none, full, per-layer or selective),
/// the experts of the stages that have some spread over `expert_parallel`
/// expert replicas of `expert_tensor_parallel` GPUs each (None: t), the
/// optimizer where `offload` says ("none" or "optimizer"), each sample's
/// sequence cut over `context_parallel` split groups, 1F1B, on a runtime
/// that hides what the overlap arguments say.
#[pyfunction]
#[pyo3(signature = (profile, topology, global_batch_size, *, tensor_parallel, pipeline_parallel, micro_batch_size, shard_level=0, reshard_after_forward=false, sequence_parallel=false, recompute="none", overlap_grad_reduce="data-parallel", overlap_param_gather=false, expert_parallel=1, expert_tensor_parallel=None, offload="none", context_parallel=1))]
#[allow(clippy::too_many_arguments)]
fn megatron_plan(
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    tensor_parallel: u32,
    pipeline_parallel: u32,
    micro_batch_size: u32,
    shard_level: u8,
    reshard_after_forward: bool,
    sequence_parallel: bool,
    recompute: &str,
    overlap_grad_reduce: &str,
    overlap_param_gather: bool,
    expert_parallel: u32,
    expert_tensor_parallel: Option<u32>,
    offload: &str,
    context_parallel: u32,
) -> PyResult<PyPlan> {
    let overlap = overlap_of(overlap_grad_reduce, overlap_param_gather)?;
    let shape = StageShape {
        tensor_parallel,
        sequence_parallel,
        shard_level,
        reshard_after_forward,
        recompute: Recompute::parse(recompute).map_err(|e| to_py_err(e.under("recompute")))?,
        expert_parallel,
        expert_tensor_parallel,
        offload: Offload::parse(offload).map_err(|e| to_py_err(e.under("offload")))?,
        context_parallel,
    };
    let plan = dapple_core::baselines::megatron::megatron_plan(
        &profile.inner,
        &topology.inner,
        global_batch_size,
        (pipeline_parallel, micro_batch_size),
        &shape,
    )
    .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    Ok(made_from(plan.overlapping(overlap), profile))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(megatron_plan, m)?)?;
    m.add_function(wrap_pyfunction!(asynchronous_plan, m)?)?;
    m.add_function(wrap_pyfunction!(baseline_plans, m)?)?;
    m.add_function(wrap_pyfunction!(baseline_plan, m)?)?;
    m.add_function(wrap_pyfunction!(layout_plan, m)?)?;
    Ok(())
}
