use dapple_core::cost::WarmupPolicy;
use dapple_core::schedule::{Action, Schedule, ScheduleKind, StageSchedule};
use pyo3::prelude::*;

use crate::to_py_err;

/// Action lists of a schedule, one per stage, as tokens ("F3", "B2", "AR",
/// "OPT"). Early backward takes K_i per stage from `warmup`; a missing list,
/// or a `None` in it, means the K_i of `warmup_policy` ("A" or "B"; "auto"
/// has no rule, so every depth must be given).
#[pyfunction]
#[pyo3(signature = (kind, num_stages, micro_batches, warmup=None, warmup_policy="A"))]
fn schedule_actions(
    kind: &str,
    num_stages: usize,
    micro_batches: u32,
    warmup: Option<Vec<Option<u32>>>,
    warmup_policy: &str,
) -> PyResult<Vec<Vec<String>>> {
    let kind: ScheduleKind = kind.parse().map_err(to_py_err)?;
    let schedule = match kind {
        ScheduleKind::GPipe => Schedule::gpipe(num_stages, micro_batches),
        ScheduleKind::EarlyBackward1F1B => {
            let policy = WarmupPolicy::parse(warmup_policy)
                .map_err(|e| to_py_err(e.under("warmup_policy")))?;
            let given = warmup.unwrap_or_else(|| vec![None; num_stages]);
            if given.len() != num_stages {
                return Err(to_py_err(dapple_core::Error::invalid(format!(
                    "{} warm-up depths for {num_stages} stages",
                    given.len()
                ))));
            }
            let depths: Vec<u32> = given
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    k.or_else(|| policy.warmup((num_stages - i) as u32, micro_batches))
                        .ok_or_else(|| {
                            to_py_err(dapple_core::Error::field(
                                format!("stages[{i}].warmup_micro_batches"),
                                "missing: warm-up policy auto has no rule to fill it in",
                            ))
                        })
                })
                .collect::<PyResult<_>>()?;
            Schedule::early_backward(num_stages, micro_batches, &depths)
        }
    }
    .map_err(to_py_err)?;
    Ok(tokens(&schedule))
}

/// Check hand-written action lists (tokens, one list per stage): every
/// forward and backward once, backward after forward, AR then OPT last, and
/// no deadlock between stages.
#[pyfunction]
fn schedule_validate(lists: Vec<Vec<String>>, micro_batches: u32) -> PyResult<()> {
    let stages = lists
        .iter()
        .enumerate()
        .map(|(stage, list)| {
            let actions = list
                .iter()
                .map(|t| t.parse::<Action>())
                .collect::<dapple_core::Result<Vec<_>>>()?;
            Ok(StageSchedule { stage, actions })
        })
        .collect::<dapple_core::Result<Vec<_>>>()
        .map_err(to_py_err)?;
    let schedule = Schedule {
        kind: ScheduleKind::EarlyBackward1F1B,
        micro_batches,
        stages,
    };
    schedule.validate().map_err(to_py_err)
}

fn tokens(schedule: &Schedule) -> Vec<Vec<String>> {
    schedule
        .stages
        .iter()
        .map(|s| s.actions.iter().map(|a| a.to_string()).collect())
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(schedule_actions, m)?)?;
    m.add_function(wrap_pyfunction!(schedule_validate, m)?)?;
    Ok(())
}
