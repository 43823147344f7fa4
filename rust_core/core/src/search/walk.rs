//! The walk: after the candidates are ranked, every other layout whose
//! formula (2) value is below the fastest simulated time could still
//! simulate faster. The walk enumerates them all (`Dp::walk_layouts`), per
//! micro-batch size, costing each complete layout as a candidate and
//! lowering its bound as it finds faster plans, within a budget of stages
//! and simulated tasks; where it finishes, the plan is the space's
//! simulated optimum (`selection.optimal`).

use std::cell::Cell;

use crate::error::{Error, Result};
use crate::plan::{Plan, PlanInputs};
use crate::schedule::within_passes;
use crate::simulation::costing::ProfileCosts;

use super::candidate::{
    build_plan, cost_candidate_below, simulated_and_bound_ms, PLAN_OVERHEAD_TASKS,
};
use super::dp::{Dp, Found, LayoutWalk, Objective, Step};
use super::passes::PassResults;
use super::space::Space;

/// Stages the layout walk may cost, and tasks it may simulate to cost
/// complete layouts, before it stops; past either the plan is the fastest found and
/// `selection.optimal` is false. About a second on the paper's cases.
const WALK_NODE_BUDGET: u64 = 500_000;
const WALK_SIMULATED_TASK_BUDGET: u64 = 20_000_000;

/// What the walk found: a plan faster than the ranking's best, if any, and
/// whether it finished (so that no layout of the space simulates faster).
pub(crate) struct Walked {
    pub(crate) fastest: Option<Plan>,
    pub(crate) optimal: bool,
}

/// The micro-batch sizes to walk, with their smallest bound, most
/// promising first. Sizes share one bound and one budget in this order, so
/// the outcome does not depend on thread timing. A size searched alone
/// without a plan has none that fits. Sizes cut by a shared bound, and
/// sizes whose run passed the work limit, come last, with no bound of
/// their own (negative infinity).
pub(crate) fn walk_order(
    space: &Space,
    passes: &PassResults,
    sizes_alone: bool,
) -> Vec<(f64, u32)> {
    let mut order: Vec<(f64, u32)> = passes
        .bests
        .iter()
        .filter(|r| {
            r.pass == space.covering_pass()
                && (r.found.is_some() || r.abandoned_floor_ms.is_some() || !sizes_alone)
        })
        .map(|r| {
            let bound = match (&r.found, r.abandoned_floor_ms) {
                (Some(f), None) => f.value,
                _ => f64::NEG_INFINITY,
            };
            (bound, r.micro_batch_size)
        })
        .collect();
    order.sort_by(|a, b| {
        let unknown = |x: f64| x == f64::NEG_INFINITY;
        unknown(a.0)
            .cmp(&unknown(b.0))
            .then(a.0.total_cmp(&b.0))
            .then(b.1.cmp(&a.1))
    });
    order
}

/// Walk the sizes of `order` below `fastest_ms`, the fastest simulated
/// time of the ranking. A candidate at the space's bound
/// (`lower_bound_ms`) is optimal: nothing to walk.
pub(crate) fn walk(
    space: &Space,
    inputs: &PlanInputs,
    costs: &ProfileCosts,
    order: Vec<(f64, u32)>,
    fastest_ms: f64,
    lower_bound_ms: f64,
) -> Result<Walked> {
    let mut optimal = true;
    let mut visitor = Visitor {
        space,
        inputs,
        costs,
        fastest: None,
        fastest_ms,
        failure: None,
    };
    if fastest_ms <= lower_bound_ms * (1.0 + 1e-12) {
        return Ok(Walked {
            fastest: None,
            optimal,
        });
    }
    let mut bound = fastest_ms;
    let mut nodes_left = WALK_NODE_BUDGET;
    let work_left = Cell::new(WALK_SIMULATED_TASK_BUDGET);
    for (size_bound, b) in order {
        if size_bound >= bound {
            continue; // no layout of this size can be faster
        }
        let mut visit = |steps: &[Step], value: f64| -> f64 {
            let found = Found {
                value,
                stages: steps.to_vec(),
            };
            visitor.visit(b, found, &work_left)
        };
        let complete;
        (bound, nodes_left, complete) =
            walk_size(space, b, (bound, nodes_left), &work_left, &mut visit);
        if !complete {
            optimal = false;
            break;
        }
    }
    match visitor.failure {
        Some(e) => Err(e),
        None => Ok(Walked {
            fastest: visitor.fastest,
            optimal,
        }),
    }
}

/// Walk the layouts of micro-batch size `b` below `bound`, within
/// `nodes_left` stages (`Dp::walk_layouts`), each complete one given to
/// `visit`, which returns the new bound: the walk's bound and nodes left
/// after it, and whether it finished.
fn walk_size<F: FnMut(&[Step], f64) -> f64>(
    space: &Space,
    b: u32,
    (bound, nodes_left): (f64, u64),
    work_left: &Cell<u64>,
    visit: &mut F,
) -> (f64, u64, bool) {
    let mut walk = LayoutWalk {
        bound,
        nodes_left,
        work_left,
        complete: true,
        visit,
    };
    let ctx = space.covering();
    let m = space.micro_batches(b);
    let mut dp = Dp::new(ctx, b, m, Objective::Latency, vec![ctx.policy], None);
    dp.walk_layouts(&mut walk);
    (walk.bound, walk.nodes_left, walk.complete)
}

/// Layouts of a space small enough for the kind phase to run every one as
/// every kind: at most this many complete layouts, found within
/// [`SMALL_SPACE_NODE_BUDGET`] stages, of at most
/// [`SMALL_SPACE_PASSES`] stage micro-batches in all, whose costing
/// simulates at most `WALK_SIMULATED_TASK_BUDGET` tasks. (XLNet-36 on two
/// GPUs at a global batch of 4,096 has few layouts, but of up to 4,096
/// micro-batches: costing each as every kind took 39 s.)
pub(crate) const SMALL_SPACE_LAYOUTS: usize = 512;
const SMALL_SPACE_NODE_BUDGET: u64 = 20_000;
const SMALL_SPACE_PASSES: u64 = 1 << 16;

/// Every layout of the sizes in `order` that fits, each costed as early
/// backward (its depths searched under the space's policy), where the
/// space is small: None where it has more than [`SMALL_SPACE_LAYOUTS`]
/// layouts or the walk does not finish within its budget. The kind phase
/// then runs all of them as every kind, so that its choice is exact on
/// small spaces; it ranks the layouts of larger ones (`kinds.rs`).
pub(crate) fn every_layout(
    space: &Space,
    inputs: &PlanInputs,
    costs: &ProfileCosts,
    order: &[(f64, u32)],
) -> Result<Option<Vec<Plan>>> {
    // Found first, costed after: a large space is given up uncosted.
    let mut found: Vec<(u32, Found)> = Vec::new();
    let mut nodes_left = SMALL_SPACE_NODE_BUDGET;
    let work_left = Cell::new(WALK_SIMULATED_TASK_BUDGET);
    for &(_, b) in order {
        let mut too_many = false;
        let mut visit = |steps: &[Step], value: f64| -> f64 {
            if found.len() == SMALL_SPACE_LAYOUTS {
                too_many = true;
                return f64::NEG_INFINITY; // the walk stops
            }
            let stages = steps.to_vec();
            found.push((b, Found { value, stages }));
            f64::INFINITY
        };
        let complete;
        (_, nodes_left, complete) = walk_size(
            space,
            b,
            (f64::INFINITY, nodes_left),
            &work_left,
            &mut visit,
        );
        if !complete || too_many {
            return Ok(None);
        }
    }
    let passes = |(b, layout): &(u32, Found)| {
        layout.stages.len() as u64 * u64::from(space.micro_batches(*b))
    };
    if found.iter().map(passes).sum::<u64>() > SMALL_SPACE_PASSES {
        return Ok(None);
    }
    let mut plans = Vec::new();
    for (b, layout) in found {
        let m = space.micro_batches(b);
        if !within_passes(layout.stages.len(), m) {
            continue; // not simulated: over the limit
        }
        let plan = build_plan(inputs, space.covering(), b, m, &layout);
        let (costed, tasks) = cost_candidate_below(&plan, costs, f64::INFINITY)?;
        if tasks > work_left.get() {
            return Ok(None);
        }
        work_left.set(work_left.get() - tasks);
        plans.extend(costed);
    }
    Ok(Some(plans))
}

/// What the walk does with each complete layout it reaches: cost it as a
/// candidate, keeping the fastest, and the first failure for the walk to
/// return.
struct Visitor<'s, 'a> {
    space: &'s Space<'a>,
    inputs: &'s PlanInputs,
    costs: &'s ProfileCosts<'s>,
    fastest: Option<Plan>,
    /// The fastest simulated time so far, the ranking's or the walk's.
    fastest_ms: f64,
    failure: Option<Error>,
}

impl Visitor<'_, '_> {
    /// Cost a complete layout of micro-batch size `b`, charging its
    /// simulated tasks to `work_left`; returns the walk's new bound: its
    /// simulated time where it is the fastest so far, else infinity.
    fn visit(&mut self, b: u32, found: Found, work_left: &Cell<u64>) -> f64 {
        let m = self.space.micro_batches(b);
        if !within_passes(found.stages.len(), m) {
            return f64::INFINITY; // not simulated: over the limit
        }
        let plan = build_plan(self.inputs, self.space.covering(), b, m, &found);
        let (plan, tasks) = match cost_candidate_below(&plan, self.costs, self.fastest_ms) {
            Ok(costed) => costed,
            Err(e) => {
                self.failure.get_or_insert(e);
                (None, PLAN_OVERHEAD_TASKS)
            }
        };
        work_left.set(work_left.get().saturating_sub(tasks));
        let ms = |p: &Plan| simulated_and_bound_ms(p).0;
        match plan {
            Some(p) if self.fastest.as_ref().is_none_or(|w| ms(&p) < ms(w)) => {
                let simulated = ms(&p);
                self.fastest = Some(p);
                self.fastest_ms = self.fastest_ms.min(simulated);
                simulated
            }
            _ => f64::INFINITY,
        }
    }
}
