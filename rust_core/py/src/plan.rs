use dapple_core::plan::{blocks_per_stage, evaluate, Plan};
use dapple_core::profile::Profile;
use dapple_core::schedule::ScheduleKind;
use dapple_core::simulate::{simulate, SimulationOptions};
use dapple_core::warmup::plan_with_chosen_warmups;
use pyo3::prelude::*;

use crate::profile::with_source;
use crate::to_py_err;

/// Validate plan JSON; returns it in canonical form.
#[pyfunction]
#[pyo3(signature = (text, source=None))]
fn plan_canonical(text: &str, source: Option<&str>) -> PyResult<String> {
    let p = Plan::from_json(text).map_err(|e| to_py_err(with_source(e, source)))?;
    Ok(p.to_json())
}

/// Cost a plan against a profile; returns the plan with a fresh estimate.
#[pyfunction]
#[pyo3(signature = (plan_text, profile_text, plan_source=None))]
fn plan_evaluate(
    py: Python<'_>,
    plan_text: &str,
    profile_text: &str,
    plan_source: Option<&str>,
) -> PyResult<String> {
    let mut plan =
        Plan::from_json(plan_text).map_err(|e| to_py_err(with_source(e, plan_source)))?;
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    let estimate = py
        .detach(|| evaluate(&plan, &profile))
        .map_err(|e| to_py_err(with_source(e, plan_source)))?;
    plan.estimate = Some(estimate);
    Ok(plan.to_json())
}

/// The plan under warm-up policy auto, with the depths that simulate
/// fastest within memory, costed; None when no depths fit.
#[pyfunction]
#[pyo3(signature = (plan_text, profile_text, plan_source=None))]
fn plan_choose_warmups(
    py: Python<'_>,
    plan_text: &str,
    profile_text: &str,
    plan_source: Option<&str>,
) -> PyResult<Option<String>> {
    let plan = Plan::from_json(plan_text).map_err(|e| to_py_err(with_source(e, plan_source)))?;
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    let (chosen, _) = py
        .detach(|| plan_with_chosen_warmups(&plan, &profile))
        .map_err(|e| to_py_err(with_source(e, plan_source)))?;
    Ok(chosen.map(|p| p.to_json()))
}

/// Count of the profile's "block" layers in each stage of the plan.
#[pyfunction]
fn plan_blocks_per_stage(plan_text: &str, profile_text: &str) -> PyResult<Vec<usize>> {
    let plan = Plan::from_json(plan_text).map_err(to_py_err)?;
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    Ok(blocks_per_stage(&profile, &plan))
}

/// Simulate one iteration of a plan; returns the simulation as JSON.
#[pyfunction]
#[pyo3(signature = (plan_text, profile_text, *, schedule=None, recompute=false, overlap_allreduce=true, plan_source=None))]
fn plan_simulate(
    py: Python<'_>,
    plan_text: &str,
    profile_text: &str,
    schedule: Option<&str>,
    recompute: bool,
    overlap_allreduce: bool,
    plan_source: Option<&str>,
) -> PyResult<String> {
    let plan = Plan::from_json(plan_text).map_err(|e| to_py_err(with_source(e, plan_source)))?;
    let profile = Profile::from_json(profile_text).map_err(to_py_err)?;
    let kind: Option<ScheduleKind> = schedule
        .map(str::parse)
        .transpose()
        .map_err(|e: dapple_core::Error| to_py_err(e.under("schedule")))?;
    let opts = SimulationOptions {
        schedule: kind,
        recompute,
        overlap_allreduce,
    };
    let sim = py
        .detach(|| simulate(&plan, &profile, opts))
        .map_err(|e| to_py_err(with_source(e, plan_source)))?;
    Ok(dapple_core::format::to_json(&sim))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_simulate, m)?)?;
    m.add_function(wrap_pyfunction!(plan_canonical, m)?)?;
    m.add_function(wrap_pyfunction!(plan_evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(plan_choose_warmups, m)?)?;
    m.add_function(wrap_pyfunction!(plan_blocks_per_stage, m)?)?;
    Ok(())
}
