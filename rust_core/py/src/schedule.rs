use dapple_core::schedule::{Action, Schedule, ScheduleKind, StageSchedule};
use pyo3::prelude::*;

use crate::to_py_err;

/// Action lists of a schedule, one per stage, as tokens ("F3", "B2", "AR",
/// "OPT"). Early backward takes K_i of stage i from `warmup[i]`; GPipe
/// needs none; an asynchronous kind runs `mini_batches`. A plan's own lists
/// come from `Plan.actions`.
#[pyfunction]
#[pyo3(signature = (kind, num_stages, micro_batches, warmup=None, mini_batches=1))]
fn schedule_actions(
    kind: &str,
    num_stages: usize,
    micro_batches: u32,
    warmup: Option<Vec<u32>>,
    mini_batches: u32,
) -> PyResult<Vec<Vec<String>>> {
    let kind = ScheduleKind::parse(kind).map_err(|e| to_py_err(e.under("kind")))?;
    let schedule = match (kind, warmup) {
        (ScheduleKind::GPipe, _) => Schedule::gpipe(num_stages, micro_batches),
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
        mini_batches: 1,
        stages,
    };
    schedule.validate().map_err(to_py_err)
}

pub(crate) fn tokens(schedule: &Schedule) -> Vec<Vec<String>> {
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
