use dapple_core::cost::overlap::{GradReduceOverlap, Overlap};
use dapple_core::cost::WarmupPolicy;
use dapple_core::schedule::ScheduleKind;
use dapple_core::search::{
    search as search_plan, Hints, RangeHint, SearchOptions, SearchSpace, StageShapes,
};
use pyo3::prelude::*;

use crate::plan::PyPlan;
use crate::profile::PyProfile;
use crate::topology::PyTopology;
use crate::{to_py_err, with_inputs};

/// Micro-batch sizes tried, states created, stages costed.
type Stats = (Vec<u32>, usize, u64, Vec<u32>);

/// A range hint as Python gives it: (layer_start, layer_end, split degree,
/// replicas or None).
type PyRangeHint = (usize, usize, u32, Option<u32>);

/// Search the best plan. Returns (plan, stats). The profile's source is
/// recorded as the plan's `inputs.profile_path`. The GIL is released while
/// searching. The hints (`plan/hints.rs`): a stage count, a micro-batch count,
/// layers stages must start at, and layer ranges that form one stage each.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (profile, topology, global_batch_size, *, warmup_policy="auto", min_micro_batch_size=None, micro_batch_sizes=None, search_space="auto", stage_shapes="auto", max_shard_level=1, max_context_parallel=None, max_search_bytes=None, max_search_steps=None, refine=true, schedule=None, chunks=None, stages=None, micro_batches=None, cuts=Vec::new(), ranges=Vec::new(), overlap_grad_reduce="data-parallel", overlap_param_gather=false))]
fn search(
    py: Python<'_>,
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    warmup_policy: &str,
    min_micro_batch_size: Option<u32>,
    micro_batch_sizes: Option<Vec<u32>>,
    search_space: &str,
    stage_shapes: &str,
    max_shard_level: u8,
    max_context_parallel: Option<u32>,
    max_search_bytes: Option<u64>,
    max_search_steps: Option<u64>,
    refine: bool,
    schedule: Option<&str>,
    chunks: Option<u32>,
    stages: Option<u32>,
    micro_batches: Option<u32>,
    cuts: Vec<usize>,
    ranges: Vec<PyRangeHint>,
    overlap_grad_reduce: &str,
    overlap_param_gather: bool,
) -> PyResult<(PyPlan, Stats)> {
    let mut opts = SearchOptions::new(global_batch_size);
    opts.warmup_policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    opts.min_micro_batch_size = min_micro_batch_size;
    opts.micro_batch_sizes = micro_batch_sizes;
    opts.search_space =
        SearchSpace::parse(search_space).map_err(|e| to_py_err(e.under("search_space")))?;
    opts.stage_shapes =
        StageShapes::parse(stage_shapes).map_err(|e| to_py_err(e.under("stage_shapes")))?;
    if max_shard_level > 3 {
        return Err(to_py_err(dapple_core::Error::field(
            "max_shard_level",
            format!("value {max_shard_level} is no sharding level: 0 to 3"),
        )));
    }
    opts.max_shard_level = max_shard_level;
    if let Some(c) = max_context_parallel {
        if c == 0 {
            return Err(to_py_err(dapple_core::Error::field(
                "max_context_parallel",
                "value 0 must be >= 1 (1: no context parallelism)",
            )));
        }
        opts.max_context_parallel = c;
    }
    opts.profile_path = profile.source().map(str::to_string);
    if let Some(bytes) = max_search_bytes {
        opts.max_search_bytes = bytes;
    }
    if let Some(stages) = max_search_steps {
        opts.max_search_steps = stages;
    }
    opts.refine = refine;
    opts.schedule = match schedule {
        None | Some("auto") => None,
        Some(name) => Some(synchronous_kind(name).map_err(to_py_err)?),
    };
    if chunks.is_some() && !opts.schedule.is_some_and(ScheduleKind::is_chunked) {
        return Err(to_py_err(dapple_core::Error::incompatible(
            "chunks: a count of chunks a rank goes with a chunked schedule".to_string(),
        )));
    }
    opts.chunks = chunks;
    opts.overlap = overlap_of(overlap_grad_reduce, overlap_param_gather)?;
    opts.hints = Hints {
        stages,
        micro_batches,
        cuts,
        ranges: ranges
            .into_iter()
            .map(
                |(layer_start, layer_end, tensor_parallel, replicas)| RangeHint {
                    layer_start,
                    layer_end,
                    tensor_parallel,
                    replicas,
                },
            )
            .collect(),
    };
    let result = py
        .detach(|| search_plan(&profile.inner, &topology.inner, &opts))
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))?;
    let s = result.stats;
    Ok((
        crate::Wraps::wrap(result.plan, None),
        (
            s.micro_batch_sizes,
            s.states,
            s.stages_costed,
            s.abandoned_micro_batch_sizes,
        ),
    ))
}

/// What a runtime hides behind computation (`cost/overlap.rs`), from its
/// gradient reduction's name and whether it gathers weights behind the
/// forward.
pub(crate) fn overlap_of(grad_reduce: &str, param_gather: bool) -> PyResult<Overlap> {
    Ok(Overlap {
        grad_reduce: GradReduceOverlap::parse(grad_reduce)
            .map_err(|e| to_py_err(e.under("overlap_grad_reduce")))?,
        param_gather,
    })
}

/// A synchronous schedule kind by name; an asynchronous one is planned by
/// `asynchronous_plan`, not by the search.
fn synchronous_kind(name: &str) -> dapple_core::Result<ScheduleKind> {
    let kind = ScheduleKind::parse(name).map_err(|e| e.under("schedule"))?;
    if kind.is_asynchronous() {
        return Err(dapple_core::Error::field(
            "schedule",
            format!("value {name:?} is asynchronous: the search plans the synchronous kinds"),
        ));
    }
    Ok(kind)
}

/// Raise the infeasible error when no plan of any layout can fit, found
/// without searching; None otherwise.
#[pyfunction]
#[pyo3(signature = (profile, topology, global_batch_size, *, min_micro_batch_size=None))]
fn check_memory_floor(
    profile: &PyProfile,
    topology: &PyTopology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
) -> PyResult<()> {
    let mut opts = SearchOptions::new(global_batch_size);
    opts.min_micro_batch_size = min_micro_batch_size;
    dapple_core::search::check_memory_floor(&profile.inner, &topology.inner, &opts)
        .map_err(|e| to_py_err(with_inputs(e, profile, topology)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(search, m)?)?;
    m.add_function(wrap_pyfunction!(check_memory_floor, m)?)?;
    Ok(())
}
