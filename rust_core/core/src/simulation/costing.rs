//! The setup that estimating (`simulation/evaluate.rs`) and simulating
//! (`simulation/simulate.rs`) a plan share: the plan checked against its profile, the
//! stage coster of its topology and micro-batching, and the cost of each
//! of its stages and of each transfer between them.

use crate::cost::{Alloc, Cluster, StageCost, StageCoster, StageDevices, WarmupPolicy};
use crate::error::Result;
use crate::model::profile::{LayerCosts, Profile};
use crate::plan::{check_layout_hashed, Plan};
use crate::schedule::{check_passes, steady_state_mini_batches};

/// Candidates simulated side by side when a search or a baseline costs
/// them in order of their bound: the batch is this wide whatever the
/// machine's cores, so that which candidates are simulated before the
/// fastest so far stops the walk, and so the plan, is the same on every
/// machine (a bound the warm-up choice later moves is not always below the
/// simulated time, so a batch's width could change the plan).
pub const SIMULATED_AT_ONCE: usize = 4;

/// A profile with what costing any plan of it derives from the profile
/// alone: its layer costs, and its hash, which a plan made from it records.
/// Both take O(layers); the search costs thousands of plans of one profile
/// (at 12,300 layers, deriving them per plan was 60% of a search's time).
pub struct ProfileCosts<'a> {
    pub profile: &'a Profile,
    pub layers: LayerCosts,
    sha256: String,
}

impl<'a> ProfileCosts<'a> {
    pub fn new(profile: &'a Profile) -> ProfileCosts<'a> {
        ProfileCosts {
            profile,
            layers: LayerCosts::new(profile),
            sha256: profile.sha256(),
        }
    }

    /// Check that `plan` can run the profile (`plan::check`).
    pub(crate) fn check(&self, plan: &Plan) -> Result<Vec<Alloc>> {
        check_layout_hashed(plan, Some((self.profile, &self.sha256)))
    }
}

/// Check `plan` against the profile, then run `f` with the stage coster of
/// the plan's topology and micro-batching, each stage's GPUs per machine
/// and the warm-up policy: the setup that estimating and simulating share.
pub(crate) fn with_coster<R>(
    plan: &Plan,
    costs: &ProfileCosts,
    f: impl FnOnce(&StageCoster, &[Alloc], WarmupPolicy) -> R,
) -> Result<R> {
    let allocs = costs.check(plan)?;
    check_passes(plan.stages.len(), plan.micro_batches).map_err(|e| e.under("micro_batches"))?;
    if plan.schedule.kind.is_asynchronous() {
        // Its steady state is simulated over many mini-batches.
        steady_state_mini_batches(plan.stages.len(), plan.micro_batches)
            .map_err(|e| e.under("micro_batches"))?;
    }
    let cluster = Cluster::for_model(&plan.inputs.topology, &costs.layers)?;
    let coster = StageCoster::new(
        &costs.layers,
        &cluster,
        plan.micro_batch_size,
        plan.micro_batches,
    )
    .overlapping(plan.schedule.overlap);
    Ok(f(&coster, &allocs, plan.schedule.warmup_policy))
}

/// Cost of every stage of a checked plan, and of every transfer between
/// consecutive stages (`transfers_ms[i]`: between stages i and i+1, each
/// way). `only_stage`: the plan is one stage (what its runtime hides is
/// `plan.schedule.overlap`, the coster's).
pub(crate) fn stage_costs(
    coster: &StageCoster,
    plan: &Plan,
    allocs: &[Alloc],
    only_stage: bool,
) -> (Vec<StageCost>, Vec<f64>) {
    let mut stages = Vec::with_capacity(plan.stages.len());
    let mut transfers_ms = Vec::with_capacity(plan.stages.len().saturating_sub(1));
    for (i, (s, alloc)) in plan.stages.iter().zip(allocs).enumerate() {
        if i > 0 {
            transfers_ms.push(coster.transfer(s.layer_start, &allocs[i - 1], alloc));
        }
        let shape = &s.shape;
        if !shape.is_plain() {
            let devices = StageDevices::new(coster.cluster, alloc.clone());
            stages.push(coster.stage_shaped(
                s.layer_start,
                s.layer_end,
                &devices,
                shape,
                s.warmup_micro_batches,
                only_stage,
            ));
            continue;
        }
        stages.push(match &s.slices {
            Some(slices) => coster.stage_sliced(
                s.layer_start,
                s.layer_end,
                &s.devices,
                slices,
                s.warmup_micro_batches,
                only_stage,
            ),
            None => coster.stage(
                s.layer_start,
                s.layer_end,
                alloc,
                s.warmup_micro_batches,
                only_stage,
            ),
        });
    }
    (stages, transfers_ms)
}
