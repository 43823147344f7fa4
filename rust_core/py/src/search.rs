use dapple_core::cost::WarmupPolicy;
use dapple_core::profile::Profile;
use dapple_core::search::{search, SearchOptions, SearchSpace};
use dapple_core::topology::Topology;
use pyo3::prelude::*;

use crate::to_py_err;

/// Search the best plan. Returns (plan JSON, stats) where stats is
/// (micro-batch sizes tried, states, stages costed). The GIL is released
/// while searching.
#[pyfunction]
#[pyo3(signature = (profile_text, topology_text, global_batch_size, *, warmup_policy="auto", min_micro_batch_size=None, micro_batch_sizes=None, search_space="auto", profile_path=None))]
#[allow(clippy::too_many_arguments)]
fn plan_search(
    py: Python<'_>,
    profile_text: &str,
    topology_text: &str,
    global_batch_size: u32,
    warmup_policy: &str,
    min_micro_batch_size: Option<u32>,
    micro_batch_sizes: Option<Vec<u32>>,
    search_space: &str,
    profile_path: Option<String>,
) -> PyResult<(String, (Vec<u32>, usize, u64))> {
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    let topology = Topology::from_json(topology_text).map_err(to_py_err)?;
    let mut opts = SearchOptions::new(global_batch_size);
    opts.warmup_policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    opts.min_micro_batch_size = min_micro_batch_size;
    opts.micro_batch_sizes = micro_batch_sizes;
    opts.search_space =
        SearchSpace::parse(search_space).map_err(|e| to_py_err(e.under("search_space")))?;
    opts.profile_path = profile_path;
    let result = py
        .detach(|| search(&profile, &topology, &opts))
        .map_err(to_py_err)?;
    let s = result.stats;
    Ok((
        result.plan.to_json(),
        (s.micro_batch_sizes, s.states, s.stages_costed),
    ))
}

/// Names of the warm-up policies, the default ("auto") first.
#[pyfunction]
fn warmup_policies() -> Vec<&'static str> {
    WarmupPolicy::ALL.iter().map(|p| p.name()).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_search, m)?)?;
    m.add_function(wrap_pyfunction!(warmup_policies, m)?)?;
    Ok(())
}
