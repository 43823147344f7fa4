use dapple_core::baselines::{baseline_plan, Baseline};
use dapple_core::cost::WarmupPolicy;
use dapple_core::profile::Profile;
use dapple_core::topology::Topology;
use pyo3::prelude::*;

use crate::to_py_err;

/// A baseline strategy's plan ("data-parallel", "gpipe", "straight",
/// "pipedream-planner") at its fastest micro-batch size that fits.
#[pyfunction]
#[pyo3(signature = (kind, profile_text, topology_text, global_batch_size, *, min_micro_batch_size=None, warmup_policy="auto"))]
fn plan_baseline(
    py: Python<'_>,
    kind: &str,
    profile_text: &str,
    topology_text: &str,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    warmup_policy: &str,
) -> PyResult<String> {
    let kind = Baseline::parse(kind).map_err(|e| to_py_err(e.under("kind")))?;
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    let topology = Topology::from_json(topology_text).map_err(to_py_err)?;
    let policy =
        WarmupPolicy::parse(warmup_policy).map_err(|e| to_py_err(e.under("warmup_policy")))?;
    let plan = py
        .detach(|| {
            baseline_plan(
                kind,
                &profile,
                &topology,
                global_batch_size,
                min_micro_batch_size,
                policy,
            )
        })
        .map_err(to_py_err)?;
    Ok(plan.to_json())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_baseline, m)?)?;
    Ok(())
}
