//! Plans whose ranks hold several stages (chunks): the chunked kinds'
//! pipeline orders, the ranks of their stages, and a plan of one stage a
//! rank cut again into chunks (issue 28).
//!
//! A chunked plan's stages are its chunks in layer order, as torch numbers
//! them: stage s runs on the rank the order puts it on (s mod p looped, or
//! down and back up the ranks for a V), on that rank's devices and shape.
//! [`chunked_plan`] makes one from a plan of one stage a rank: its layers
//! cut again into p x v consecutive chunks, balanced by the layers'
//! forward and backward time on each rank (`weighted_block_partition`);
//! the ranks run the order in the simulator (`simulate_order`).

use crate::cost::block_partition::weighted_block_partition;
use crate::cost::StageCost;
use crate::error::{Error, Result};
use crate::model::profile::Profile;
use crate::plan::{Plan, ScheduleChoice, Stage};
use crate::schedule::ScheduleKind;
use crate::simulation::costing::{stage_costs, with_coster, ProfileCosts};
use crate::simulation::evaluate::evaluate_costed;

/// Most chunks a rank tried for the looped chunked kinds when none is
/// asked: Megatron's usual virtual stages; more cut small layers smaller
/// while each adds a transfer a micro-batch (docs/schedules.md).
pub const MAX_SEARCHED_CHUNKS: u32 = 8;

/// `plan` (one stage a rank, synchronous) with its ranks running chunked
/// `kind` ([`chunked_plan`]), `chunks` a rank, or the fastest count the
/// kind can take up to [`MAX_SEARCHED_CHUNKS`] (ZB-V: 2) that fits;
/// costed. Interleaved 1F1B with one chunk is plain 1F1B (policy B's
/// depths), interleaved zero bubble with one is ZB-H1, each on the cut
/// balanced by the ranks' speeds.
pub fn chunked(
    plan: &Plan,
    profile: &Profile,
    kind: ScheduleKind,
    chunks: Option<u32>,
) -> Result<Plan> {
    let costs = ProfileCosts::new(profile);
    if let Some(v) = chunks {
        let made = chunked_plan(plan, &costs, kind, v)?;
        let estimate = evaluate_costed(&made, &costs)?;
        return Ok(Plan {
            estimate: Some(estimate),
            ..made
        });
    }
    // What no count can run is refused as the smallest count would be.
    let counts = chunk_counts(plan, &costs, kind, None);
    chunked_plan(plan, &costs, kind, counts.first().copied().unwrap_or(1))?;
    fastest_chunking(plan, &costs, kind, None).ok_or_else(|| {
        Error::infeasible(match kind.fixed_chunks() {
            Some(v) => format!("{kind}'s {v} chunks a rank do not run the plan within memory"),
            None => format!(
                "no count of chunks up to {MAX_SEARCHED_CHUNKS} a rank runs the plan as {kind} within memory"
            ),
        })
    })
}

/// [`chunked`]'s costed plans, `chunks` a rank or each count the kind can
/// take, the fastest that fits; None where none does.
pub(crate) fn fastest_chunking(
    plan: &Plan,
    costs: &ProfileCosts,
    kind: ScheduleKind,
    chunks: Option<u32>,
) -> Option<Plan> {
    let iteration = |p: &Plan| p.iteration_ms().unwrap_or(f64::INFINITY);
    chunk_counts(plan, costs, kind, chunks)
        .into_iter()
        .filter_map(|v| costed_chunked_plan(plan, costs, kind, v))
        .min_by(|a, b| iteration(a).total_cmp(&iteration(b)))
}

/// The chunks a rank [`fastest_chunking`] tries: `chunks`, or every count
/// `kind` takes up to [`MAX_SEARCHED_CHUNKS`] and the layers allow.
fn chunk_counts(
    plan: &Plan,
    costs: &ProfileCosts,
    kind: ScheduleKind,
    chunks: Option<u32>,
) -> Vec<u32> {
    let ranks = plan.stages.len() as u32;
    match chunks.or(kind.fixed_chunks()) {
        Some(v) => vec![v],
        None => (1..=MAX_SEARCHED_CHUNKS.min(costs.layers.num_layers as u32 / ranks)).collect(),
    }
}

/// `plan` (one stage a rank, synchronous) with its ranks running chunked
/// `kind`, `chunks` chunks each: the layers cut again (`balanced_chunks`),
/// chunk s on the rank the order puts it on with that rank's devices and
/// shape (tensor parallelism, replicas, ZeRO, re-computation), its depth
/// the forwards the order runs of it before its first backward. Not
/// costed; checked as any plan is when it is.
pub(crate) fn chunked_plan(
    plan: &Plan,
    costs: &ProfileCosts,
    kind: ScheduleKind,
    chunks: u32,
) -> Result<Plan> {
    if plan.schedule.kind.is_asynchronous() || plan.schedule.kind.is_chunked() {
        return Err(Error::field(
            "schedule.kind",
            format!(
                "value \"{}\": only a synchronous plan of one stage a rank is cut into chunks",
                plan.schedule.kind
            ),
        ));
    }
    if chunks == 0 {
        return Err(Error::field(
            "chunks",
            "value 0: a rank holds at least one chunk",
        ));
    }
    let ranks = plan.stages.len() as u32;
    let order = match kind.chunked_order(ranks, plan.micro_batches, chunks) {
        Err(e) if e.field.is_none() => return Err(e.under("micro_batches")),
        order => order?,
    };
    let rank_of: Vec<usize> = order.stage_ranks.iter().map(|&r| r as usize).collect();
    let parts = (ranks * chunks) as usize;
    let n = costs.layers.num_layers;
    if parts > n {
        return Err(Error::field(
            "chunks",
            format!(
                "value {chunks} on {ranks} rank{} needs {parts} layers; the model has {n}",
                if ranks == 1 { "" } else { "s" }
            ),
        ));
    }
    let chunk_layers = balanced_layers(plan, costs, &rank_of)?;
    let depths = order.forwards_before_first_backward();
    Ok(Plan {
        schema_version: crate::formats::format::PLAN.version,
        schedule: ScheduleChoice {
            kind: if chunks == 1 {
                kind.at_one_chunk()
            } else {
                kind
            },
            chunks,
            ..plan.schedule
        },
        stages: chunk_layers
            .iter()
            .enumerate()
            .map(|(s, &layers)| Stage {
                warmup_micro_batches: depths[s],
                ..plan.stages[rank_of[s]]
                    .clone()
                    .over_layers(layers, &costs.layers)
            })
            .collect(),
        estimate: None,
        selection: None,
        ..plan.clone()
    })
}

/// `plan` (one stage a rank) with its layers cut again by its ranks'
/// speeds, each rank keeping its devices and shape: what ZB-H1 and ZB-H2,
/// whose depths are the kind's, run where the search's cut was early
/// backward's. Neither costed nor given the kind's depths.
pub(crate) fn cut_by_rank_speeds(plan: &Plan, costs: &ProfileCosts) -> Result<Plan> {
    let ranks: Vec<usize> = (0..plan.stages.len()).collect();
    let layers = balanced_layers(plan, costs, &ranks)?;
    Ok(Plan {
        stages: plan
            .stages
            .iter()
            .zip(layers)
            .map(|(stage, layers)| stage.clone().over_layers(layers, &costs.layers))
            .collect(),
        estimate: None,
        selection: None,
        ..plan.clone()
    })
}

/// `plan` cut into chunks of `kind` ([`chunked_plan`]) and costed; None
/// where it cannot be (too few layers or micro-batches for the order) or
/// does not fit.
pub(crate) fn costed_chunked_plan(
    plan: &Plan,
    costs: &ProfileCosts,
    kind: ScheduleKind,
    chunks: u32,
) -> Option<Plan> {
    let chunked = chunked_plan(plan, costs, kind, chunks).ok()?;
    let estimate = evaluate_costed(&chunked, costs).ok()?;
    estimate.fits_memory.then_some(Plan {
        estimate: Some(estimate),
        ..chunked
    })
}

/// [`balanced_chunks`] of `plan` (one stage a rank), its ranks' speeds
/// taken from its stages as it is checked.
fn balanced_layers(
    plan: &Plan,
    costs: &ProfileCosts,
    rank_of: &[usize],
) -> Result<Vec<(usize, usize)>> {
    with_coster(plan, costs, |coster, allocs, _| {
        let (rank_costs, _) = stage_costs(coster, plan, allocs, false);
        balanced_chunks(plan, costs, &rank_costs, rank_of)
    })
}

/// The layers cut into one consecutive chunk for each of `rank_of` (chunk
/// s on rank `rank_of[s]`), with the longest chunk time as short as can
/// be, each rank running layers at its speed ([`rank_speeds`]).
fn balanced_chunks(
    plan: &Plan,
    costs: &ProfileCosts,
    rank_costs: &[StageCost],
    rank_of: &[usize],
) -> Vec<(usize, usize)> {
    let pass_ms: Vec<f64> = rank_costs.iter().map(|c| c.fwd_ms + c.bwd_ms).collect();
    let speeds = rank_speeds(plan, costs, &pass_ms);
    let capacities: Vec<f64> = rank_of.iter().map(|&r| speeds[r]).collect();
    let t = costs.layers.times_at(plan.micro_batch_size);
    let work: Vec<f64> = (0..costs.layers.num_layers)
        .map(|l| t.fwd(l, l + 1) + t.bwd(l, l + 1))
        .collect();
    weighted_block_partition(&work, &capacities)
}

/// How many times faster than one GPU each rank of `plan` (one stage a
/// rank) runs layers, from `pass_ms[r]`, its stage's forward and backward
/// of a micro-batch: a layer's time is its forward and backward on one
/// GPU at the plan's micro-batch size, and a rank runs any layer as many
/// times faster as its stage runs its own (replicas, tensor parallelism
/// and faster GPUs count).
fn rank_speeds(plan: &Plan, costs: &ProfileCosts, pass_ms: &[f64]) -> Vec<f64> {
    let t = costs.layers.times_at(plan.micro_batch_size);
    plan.stages
        .iter()
        .zip(pass_ms)
        .map(|(s, ms)| (t.fwd(s.layer_start, s.layer_end) + t.bwd(s.layer_start, s.layer_end)) / ms)
        .collect()
}

/// Least time `plan`'s ranks (a costed plan of one stage a rank) take for
/// every micro-batch's forward and backward, however the layers are cut
/// into chunks: all layers' work spread over the ranks at their speeds
/// ([`rank_speeds`]) as if it divided evenly. It leaves out the
/// AllReduce, the transfers and the bubble, and takes a rank's speed as
/// the same for any layers, so chunked plans of the layout are ranked by
/// it, not proven slower.
pub(crate) fn balanced_bound_ms(plan: &Plan, costs: &ProfileCosts) -> f64 {
    let Some(estimate) = &plan.estimate else {
        return 0.0;
    };
    let pass_ms: Vec<f64> = estimate
        .stages
        .iter()
        .map(|c| c.fwd_ms + c.bwd_ms)
        .collect();
    let speed: f64 = rank_speeds(plan, costs, &pass_ms).iter().sum();
    let t = costs.layers.times_at(plan.micro_batch_size);
    let n = costs.layers.num_layers;
    f64::from(plan.micro_batches) * (t.fwd(0, n) + t.bwd(0, n)) / speed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::cost::WarmupPolicy;
    use crate::formats::format::FileObject;
    use crate::model::profile::chain_profile;
    use crate::plan::PlanInputs;
    use crate::simulation::simulate::{sim_inputs, simulate_order};

    /// A straight pipeline of `ranks` one-GPU stages over 16 unequal layers.
    fn straight(ranks: u32, micro_batches: u32) -> (Profile, Plan) {
        let times: Vec<(f64, f64)> = (0..16)
            .map(|l| (1.0 + f64::from(l % 3), 2.0 + f64::from(l % 5)))
            .collect();
        let profile = chain_profile(&times, 1);
        let topology = Topology::from_spec(&format!("1x{ranks}-nvlink")).unwrap();
        let inputs = PlanInputs::new(&profile, &topology, micro_batches, 1, "test", None);
        let per = 16 / ranks as usize;
        let stages = (0..ranks as usize)
            .map(|r| Stage {
                layer_start: r * per,
                layer_end: (r + 1) * per,
                devices: vec![r as u32],
                warmup_micro_batches: ranks - r as u32,
                ..Default::default()
            })
            .collect();
        let schedule = ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A);
        (
            profile,
            Plan::new(inputs, 1, micro_batches, schedule, stages),
        )
    }

    fn refusal(plan: &Plan, profile: &Profile) -> String {
        crate::simulation::evaluate::evaluate(plan, profile)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_ranks_chunks_share_its_devices_and_nothing_else() {
        let (profile, plan) = straight(4, 8);
        let costs = ProfileCosts::new(&profile);
        for (kind, ranks) in [
            (ScheduleKind::ZeroBubbleV, vec![0, 1, 2, 3, 3, 2, 1, 0]),
            (ScheduleKind::Interleaved1F1B, vec![0, 1, 2, 3, 0, 1, 2, 3]),
        ] {
            let chunked = chunked_plan(&plan, &costs, kind, 2).unwrap();
            assert_eq!(chunked.stage_ranks(), ranks);
            assert_eq!(chunked.ranks(), 4);
            assert_eq!(chunked.shape(), "1:1:1:1 (v=2)");
            let devices: Vec<u32> = chunked.stages.iter().map(|s| s.devices[0]).collect();
            assert_eq!(devices, ranks);
            crate::simulation::evaluate::evaluate(&chunked, &profile).unwrap();
            // The file says it all: its version (5 added chunks), the kind and the chunks.
            let text = chunked.to_json();
            let version = format!(
                "\"schema_version\": {}",
                crate::formats::format::PLAN.version
            );
            assert!(text.contains("\"chunks\": 2") && text.contains(&version));
            assert_eq!(Plan::from_json(&text).unwrap(), chunked);
            // A chunk on another rank's GPU, or on one of its own rank's
            // and another's, is refused by name.
            let mut moved = chunked.clone();
            moved.stages[4].devices = vec![ranks[5]];
            let e = refusal(&moved, &profile);
            assert!(e.contains("stages[4].devices"), "{e}");
            // A depth other than the order's.
            let mut deeper = chunked.clone();
            deeper.stages[0].warmup_micro_batches += 1;
            let e = refusal(&deeper, &profile);
            assert!(
                e.contains("stages[0].warmup_micro_batches") && e.contains("order"),
                "{e}"
            );
            // Stages that do not make ranks of the chunks.
            let mut odd = chunked.clone();
            odd.schedule.chunks = 3;
            assert!(refusal(&odd, &profile).contains("schedule.chunks: value 3"));
        }
        // Chunks belong to the chunked kinds; devices to one rank only.
        let mut plain = plan.clone();
        plain.schedule.chunks = 2;
        assert!(refusal(&plain, &profile).contains("schedule.chunks: value 2"));
        let mut shared = plan.clone();
        shared.stages[1].devices = vec![0];
        assert!(refusal(&shared, &profile).contains("used by two stages"));
    }

    #[test]
    fn a_chunked_plans_estimate_is_its_order_run_on_its_ranks() {
        let (profile, plan) = straight(4, 8);
        let costs = ProfileCosts::new(&profile);
        for kind in ScheduleKind::ALL.into_iter().filter(|k| k.is_chunked()) {
            let chunks = kind.fixed_chunks().unwrap_or(3);
            let chunked = chunked_plan(&plan, &costs, kind, chunks).unwrap();
            let estimate = evaluate_costed(&chunked, &costs).unwrap();
            let (stages, transfers) = sim_inputs(&chunked, &costs).unwrap();
            let order = kind.chunked_order(4, 8, chunks).unwrap();
            let run = simulate_order(&stages, &transfers, &order).unwrap();
            assert_eq!(estimate.iteration_ms, Some(run.iteration_ms));
            let file =
                crate::simulation::simulate::simulate(&chunked, &profile, Default::default())
                    .unwrap();
            assert_eq!(file.iteration_ms, run.iteration_ms);
            assert_eq!(file.stages, run.ranks);
            assert_eq!(file.stage_ranks, order.stage_ranks);
            // Each chunk's memory is its rank's peak: its GPU holds them all.
            for (st, &r) in estimate.stages.iter().zip(&order.stage_ranks) {
                assert_eq!(st.memory_bytes, run.ranks[r as usize].peak_memory_bytes);
            }
            // The bound no order beats: the busiest rank's passes.
            assert!(estimate.latency_ms <= run.iteration_ms, "{kind}");
            // Another kind is not run on a chunked plan.
            let other = crate::simulation::simulate::SimulationOptions {
                schedule: Some(ScheduleKind::GPipe),
                ..Default::default()
            };
            assert!(crate::simulation::simulate::simulate(&chunked, &profile, other).is_err());
        }
    }

    #[test]
    fn the_fastest_chunking_is_no_slower_than_any_count_it_tries() {
        let (profile, plan) = straight(2, 8);
        let costs = ProfileCosts::new(&profile);
        let best = chunked(&plan, &profile, ScheduleKind::InterleavedZeroBubble, None).unwrap();
        let counts = chunk_counts(&plan, &costs, ScheduleKind::InterleavedZeroBubble, None);
        assert_eq!(counts, (1..=MAX_SEARCHED_CHUNKS).collect::<Vec<_>>());
        for v in counts {
            let one = chunked(
                &plan,
                &profile,
                ScheduleKind::InterleavedZeroBubble,
                Some(v),
            )
            .unwrap();
            assert!(best.iteration_ms() <= one.iteration_ms(), "{v}");
        }
        // Interleaved zero bubble at one chunk a rank is ZB-H1 on the re-cut
        // layers, and recorded as such: ZB-H1's depths, and the iteration of
        // the interleaved order at one chunk, to the bit.
        let one = chunked(
            &plan,
            &profile,
            ScheduleKind::InterleavedZeroBubble,
            Some(1),
        )
        .unwrap();
        assert_eq!(one.schedule.kind, ScheduleKind::ZeroBubbleH1);
        let depths: Vec<u32> = one.stages.iter().map(|s| s.warmup_micro_batches).collect();
        assert_eq!(depths, [2, 1]);
        let (stages, transfers) = sim_inputs(&one, &costs).unwrap();
        let order = ScheduleKind::InterleavedZeroBubble
            .chunked_order(2, 8, 1)
            .unwrap();
        let run = simulate_order(&stages, &transfers, &order).unwrap();
        assert_eq!(one.iteration_ms(), Some(run.iteration_ms));
    }

    #[test]
    fn zb_h1_runs_a_layout_on_its_own_cut_and_cut_again_the_faster_of_the_two() {
        let (profile, mut plan) = straight(4, 8);
        // Cut unevenly, 2, 2, 2 and 10 layers: cut again by the ranks'
        // speeds, the layers run faster.
        for (stage, (start, end)) in plan
            .stages
            .iter_mut()
            .zip([(0, 2), (2, 4), (4, 6), (6, 16)])
        {
            (stage.layer_start, stage.layer_end) = (start, end);
        }
        let costs = ProfileCosts::new(&profile);
        let kind = ScheduleKind::ZeroBubbleH1;
        let mut opts = crate::search::SearchOptions::new(8);
        let fastest_kind = |opts: &crate::search::SearchOptions| {
            crate::search::kinds::fastest_kind(&plan, &[], &[kind], opts, &costs, false)
                .unwrap()
                .unwrap()
        };
        let found = fastest_kind(&opts);
        let mut own = plan.clone();
        own.schedule.kind = kind;
        for (i, s) in own.stages.iter_mut().enumerate() {
            s.warmup_micro_batches = 4 - i as u32;
        }
        let own = crate::simulation::evaluate::evaluate(&own, &profile).unwrap();
        let recut =
            costed_chunked_plan(&plan, &costs, ScheduleKind::InterleavedZeroBubble, 1).unwrap();
        assert_eq!(recut.schedule.kind, kind);
        let fastest = own.iteration_ms.unwrap().min(recut.iteration_ms().unwrap());
        assert_eq!(found.schedule.kind, kind);
        assert_eq!(found.iteration_ms(), Some(fastest));
        assert!(recut.iteration_ms() < own.iteration_ms);
        // Not where hints fix where stages begin: the plan's own cut.
        opts.hints.cuts = vec![6];
        assert_eq!(fastest_kind(&opts).iteration_ms(), own.iteration_ms);
    }

    #[test]
    fn a_search_for_a_chunked_kind_beats_its_chosen_layout_cut_into_chunks() {
        use crate::search::{search, SearchOptions};
        let (profile, _) = straight(4, 8);
        let topology = Topology::from_spec("1x4-nvlink").unwrap();
        let mut opts = SearchOptions::new(16);
        opts.schedule = Some(ScheduleKind::EarlyBackward1F1B);
        let early = search(&profile, &topology, &opts).unwrap().plan;
        for kind in ScheduleKind::ALL.into_iter().filter(|k| k.is_chunked()) {
            opts.schedule = Some(kind);
            let found = search(&profile, &topology, &opts).unwrap().plan;
            // (at one chunk a rank, the kind of one stage a rank it is)
            let one = found.schedule.chunks == 1 && found.schedule.kind == kind.at_one_chunk();
            assert!(found.schedule.kind == kind || one, "{kind}");
            crate::simulation::evaluate::evaluate(&found, &profile).unwrap();
            if early.stages.len() > 1 {
                let cut = chunked(&early, &profile, kind, None).unwrap();
                assert!(found.iteration_ms() <= cut.iteration_ms(), "{kind}");
            }
            // The proof of the early-backward walk is not the chunked plan's.
            let selection = found.selection.unwrap();
            assert!(selection.optimal.is_none() && selection.lower_bound_ms.is_none());
            // A count asked is the count planned.
            opts.chunks = Some(2);
            assert_eq!(
                search(&profile, &topology, &opts)
                    .unwrap()
                    .plan
                    .schedule
                    .chunks,
                2
            );
            opts.chunks = None;
        }
    }
}
