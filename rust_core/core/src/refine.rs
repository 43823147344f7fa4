//! Refinement: small changes to the search's chosen plan, each kept when
//! the simulator says it is faster.
//!
//! The search is exact over its space only where its walk finishes
//! (`selection.optimal`); on the larger paper-scale cases it stops at its
//! budget, and above 16 GPUs its space is machine-aligned. Both leave
//! plans the simulator would rank higher just out of reach: on 4x8,
//! GNMT-32's chosen plan simulates 2.3% slower than the full space's,
//! though a few GPU swaps make it faster than both (docs/cost-model.md,
//! "Refinement"). So the chosen plan is improved by local moves on
//! concrete GPUs, the same way a person would tune it by hand, costed by
//! the same simulation and warm-up choice as every candidate:
//!
//! - move the boundary between two neighbouring stages by one layer;
//! - swap two GPUs on different machines between two stages, or a stage's
//!   GPU with an idle one on another machine (which machines a stage spans
//!   decides its AllReduce and its transfers);
//! - hand a GPU from one stage to another, give a stage an idle GPU, or
//!   leave one of its GPUs idle.
//!
//! A move is kept when the plan then simulates faster by more than a
//! relative 1e-9 (so rounding cannot cycle); the scan goes on with the
//! next move, over the new plan's moves, until a whole round of moves finds
//! nothing faster or the work budget is spent. Moves are tried in a fixed
//! order, in batches of fixed size, keeping the first faster move of a
//! batch in that order: the result does not depend on the thread count.
//! Refinement never returns a slower plan, and its plans stay valid: every
//! one is checked and costed by `evaluate`, with the search's own slices
//! on mixed GPUs.

use rayon::prelude::*;

use crate::cost::{Cluster, StageCoster, StageDevices, WarmupPolicy};
use crate::error::Result;
use crate::evaluate::evaluate;
use crate::plan::{Plan, Stage};
use crate::profile::{LayerCosts, Profile};
use crate::warmup::plan_with_chosen_warmups;

/// Who holds a GPU: a stage (by index) or nobody.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Stage(usize),
    Idle,
}

/// One local change to a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// The boundary between stage `stage` and the next moves by one layer:
    /// later (`stage` takes the next stage's first layer) or earlier.
    Shift { stage: usize, later: bool },
    /// GPU `a` of stage `stage` and GPU `b` of `other` change places.
    Swap {
        stage: usize,
        a: u32,
        other: Holder,
        b: u32,
    },
    /// GPU `device` goes from one holder to another.
    Hand { device: u32, from: Holder, to: Holder },
}

/// What refinement did to a plan.
#[derive(Debug, Clone)]
pub(crate) struct Refined {
    /// The fastest plan found: the one given when no move helped.
    pub(crate) plan: Plan,
    /// Simulated iteration of the plan given.
    pub(crate) from_ms: f64,
    /// Moves kept.
    pub(crate) moves: u32,
    /// Plans costed.
    pub(crate) tried: u64,
}

/// Moves tried at once; the first faster one of a batch, in order, is kept.
const BATCH: usize = 8;

/// What costing one plan costs in simulated tasks, beyond its simulations:
/// building, checking and estimating it (as in the search's walk).
pub(crate) const PLAN_OVERHEAD_TASKS: u64 = 10_000;

/// Improve `plan` (costed, simulated and fitting in memory) by local moves
/// until none helps or `work_tasks` simulated tasks are spent.
pub(crate) fn refine(
    plan: &Plan,
    profile: &Profile,
    layers: &LayerCosts,
    cluster: &Cluster,
    min_slice: u32,
    work_tasks: u64,
) -> Result<Refined> {
    let from_ms = simulated_ms(plan);
    let coster = StageCoster::new(layers, cluster, plan.micro_batch_size, plan.micro_batches);
    let mut current = plan.clone();
    let mut best_ms = from_ms;
    let mut moves = candidate_moves(&current, cluster);
    let mut work_left = work_tasks;
    let (mut kept, mut tried) = (0u32, 0u64);
    let mut next = 0usize;
    let mut since_kept = 0usize;
    while since_kept < moves.len() && work_left > 0 {
        let count = BATCH.min(moves.len() - since_kept);
        // Built here (the coster's caches stay on this thread), costed in parallel.
        let batch: Vec<Option<Plan>> = (0..count)
            .map(|i| apply(&current, moves[(next + i) % moves.len()], &coster, cluster, min_slice))
            .collect();
        let costed: Vec<(Option<Plan>, u64)> = batch
            .par_iter()
            .map(|candidate| match candidate {
                Some(candidate) => cost(candidate, profile),
                None => Ok((None, 0)),
            })
            .collect::<Result<_>>()?;
        tried += costed.iter().filter(|(_, tasks)| *tasks > 0).count() as u64;
        work_left = work_left.saturating_sub(costed.iter().map(|(_, tasks)| tasks).sum());
        let faster = costed.into_iter().enumerate().find_map(|(i, (p, _))| {
            p.filter(|p| simulated_ms(p) < best_ms * (1.0 - 1e-9))
                .map(|p| (i, p))
        });
        match faster {
            Some((i, p)) => {
                best_ms = simulated_ms(&p);
                current = p;
                kept += 1;
                moves = candidate_moves(&current, cluster);
                next = (next + i + 1) % moves.len().max(1);
                since_kept = 0;
            }
            None => {
                next = (next + count) % moves.len();
                since_kept += count;
            }
        }
    }
    Ok(Refined {
        plan: current,
        from_ms,
        moves: kept,
        tried,
    })
}

fn simulated_ms(plan: &Plan) -> f64 {
    plan.estimate
        .as_ref()
        .and_then(|e| e.iteration_ms)
        .expect("refinement costs simulated plans")
}

/// `plan` costed as the search costs a candidate: under warm-up policy
/// auto with its depths chosen anew, else at its fixed policy's depths;
/// None when it does not fit in memory or is no valid plan (a slice below
/// the minimum). Also the simulated tasks it took.
fn cost(plan: &Plan, profile: &Profile) -> Result<(Option<Plan>, u64)> {
    let per_simulation = 2 * u64::from(plan.micro_batches) * plan.stages.len() as u64;
    let (costed, simulations) = match plan.schedule.warmup_policy {
        WarmupPolicy::Auto => match plan_with_chosen_warmups(plan, profile) {
            Ok(found) => found,
            Err(_) => (None, 0),
        },
        _ => match evaluate(plan, profile) {
            Ok(estimate) => (
                Some(Plan {
                    estimate: Some(estimate),
                    ..plan.clone()
                }),
                1,
            ),
            Err(_) => (None, 0),
        },
    };
    let fits = costed.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory));
    Ok((fits, PLAN_OVERHEAD_TASKS + (1 + simulations) * per_simulation))
}

/// Every move of `plan`, in the order they are tried. GPUs on one machine
/// are alike, so each (holder, machine) offers one GPU: a stage its last
/// there, the idle pool its first. A swap that only exchanges what two
/// alike machines hold (on 16x1, any swap) changes nothing and is left out.
fn candidate_moves(plan: &Plan, cluster: &Cluster) -> Vec<Move> {
    let kinds = cluster.group_and_gpus();
    let machines = kinds.len();
    let stages = plan.stages.len();
    // GPU offered by each holder on each machine.
    let mut offered: Vec<Vec<Option<u32>>> = vec![vec![None; machines]; stages + 1];
    let mut used = vec![false; cluster.num_devices() as usize];
    for (k, s) in plan.stages.iter().enumerate() {
        for &d in &s.devices {
            used[d as usize] = true;
            if let Some(m) = cluster.machine_of(d) {
                offered[k][m] = Some(offered[k][m].map_or(d, |o: u32| o.max(d)));
            }
        }
    }
    for (d, _) in used.iter().enumerate().filter(|(_, u)| !**u) {
        if let Some(m) = cluster.machine_of(d as u32) {
            offered[stages][m].get_or_insert(d as u32);
        }
    }
    let holder = |h: usize| {
        if h == stages {
            Holder::Idle
        } else {
            Holder::Stage(h)
        }
    };
    // How many GPUs each holder has on each machine.
    let mut held: Vec<Vec<u32>> = vec![vec![0; stages + 1]; machines];
    for d in 0..cluster.num_devices() {
        if let Some(m) = cluster.machine_of(d) {
            let h = plan
                .stages
                .iter()
                .position(|s| s.devices.contains(&d))
                .unwrap_or(stages);
            held[m][h] += 1;
        }
    }
    // Machine `ma` with one GPU of holder `a` given to `b` holds what `mb`
    // holds, and the two are alike: the swap only renames machines.
    let renames = |ma: usize, a: usize, mb: usize, b: usize| {
        let mut after = held[ma].clone();
        after[a] -= 1;
        after[b] += 1;
        kinds[ma] == kinds[mb] && after == held[mb]
    };
    let gpus_on = |h: usize| -> Vec<(usize, u32)> {
        offered[h]
            .iter()
            .enumerate()
            .filter_map(|(m, d)| d.map(|d| (m, d)))
            .collect()
    };
    let mut out = Vec::new();
    for stage in 0..stages.saturating_sub(1) {
        for later in [false, true] {
            out.push(Move::Shift { stage, later });
        }
    }
    for stage in 0..stages {
        for other in stage + 1..=stages {
            for &(ma, a) in &gpus_on(stage) {
                for &(mb, b) in &gpus_on(other) {
                    if ma != mb && !renames(ma, stage, mb, other) {
                        out.push(Move::Swap {
                            stage,
                            a,
                            other: holder(other),
                            b,
                        });
                    }
                }
            }
        }
    }
    for from in 0..=stages {
        for to in 0..=stages {
            if from == to || (from == stages && to == stages) {
                continue;
            }
            // A stage keeps at least one GPU.
            if from < stages && plan.stages[from].devices.len() < 2 {
                continue;
            }
            for (_, device) in gpus_on(from) {
                out.push(Move::Hand {
                    device,
                    from: holder(from),
                    to: holder(to),
                });
            }
        }
    }
    out
}

/// `plan` after `mv`, uncosted; None when the move leaves a stage empty.
/// Changed stages get the search's slices for their GPUs (uneven on mixed
/// GPUs) and no placement policy (no policy placed them).
fn apply(
    plan: &Plan,
    mv: Move,
    coster: &StageCoster,
    cluster: &Cluster,
    min_slice: u32,
) -> Option<Plan> {
    let mut stages: Vec<Stage> = plan.stages.clone();
    let mut touched: Vec<usize> = Vec::new();
    match mv {
        Move::Shift { stage, later } => {
            let (a, b) = (&stages[stage], &stages[stage + 1]);
            let boundary = if later { a.layer_end + 1 } else { a.layer_end - 1 };
            if boundary <= a.layer_start || boundary >= b.layer_end {
                return None;
            }
            stages[stage].layer_end = boundary;
            stages[stage + 1].layer_start = boundary;
            touched.extend([stage, stage + 1]);
        }
        Move::Swap { stage, a, other, b } => {
            replace(&mut stages[stage].devices, a, b);
            touched.push(stage);
            if let Holder::Stage(o) = other {
                replace(&mut stages[o].devices, b, a);
                touched.push(o);
            }
        }
        Move::Hand { device, from, to } => {
            if let Holder::Stage(f) = from {
                stages[f].devices.retain(|&d| d != device);
                if stages[f].devices.is_empty() {
                    return None;
                }
                touched.push(f);
            }
            if let Holder::Stage(t) = to {
                stages[t].devices.push(device);
                stages[t].devices.sort_unstable();
                touched.push(t);
            }
        }
    }
    for &k in &touched {
        let s = &mut stages[k];
        if cluster.is_mixed() {
            let alloc = cluster.alloc_of(&s.devices).ok()?;
            s.slices = coster.searched_slices(
                s.layer_start,
                s.layer_end,
                &StageDevices::new(cluster, alloc),
                min_slice,
            );
        }
        if !matches!(mv, Move::Shift { .. }) {
            s.placement = None;
        }
    }
    Some(Plan {
        stages,
        estimate: None,
        ..plan.clone()
    })
}

/// Put `new` in `old`'s place in a sorted GPU list, keeping it sorted.
fn replace(devices: &mut Vec<u32>, old: u32, new: u32) {
    devices.retain(|&d| d != old);
    devices.push(new);
    devices.sort_unstable();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::PROFILE;
    use crate::plan::{PlanInputs, ScheduleChoice};
    use crate::profile::{Layer, Measurement};
    use crate::schedule::ScheduleKind;
    use crate::topology::Topology;
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// A profile of layers (fwd ms, bwd ms, parameter bytes, activation
    /// bytes) measured at batch size 1.
    fn profile(layers: &[(f64, f64, u64, u64)]) -> Profile {
        Profile {
            format: PROFILE.name.into(),
            schema_version: PROFILE.version,
            model: "refine-test".into(),
            source: None,
            device: None,
            optimizer: "adam".into(),
            other_devices: Vec::new(),
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, &(fwd_ms, bwd_ms, param_bytes, activation_bytes))| Layer {
                    name: format!("l{i}"),
                    kind: None,
                    param_bytes,
                    inputs: None,
                    measurements: vec![Measurement {
                        batch_size: 1,
                        fwd_ms,
                        bwd_ms,
                        activation_bytes,
                        stored_activation_bytes: None,
                    }],
                })
                .collect(),
        }
    }

    /// A plan of stages (layer_start, layer_end, devices) with micro-batches
    /// of `b` samples, costed under `policy` (auto: depths chosen); None
    /// when it does not fit.
    fn costed(
        profile: &Profile,
        topology: &Topology,
        gbs: u32,
        b: u32,
        stages: &[(usize, usize, Vec<u32>)],
        policy: WarmupPolicy,
    ) -> Option<Plan> {
        let m = gbs / b;
        let count = stages.len() as u32;
        let stages = stages
            .iter()
            .enumerate()
            .map(|(i, (start, end, devices))| Stage {
                layer_start: *start,
                layer_end: *end,
                devices: devices.clone(),
                warmup_micro_batches: policy.memory_depth(count - i as u32, m),
                placement: None,
                slices: None,
            })
            .collect();
        let inputs = PlanInputs::new(profile, topology, gbs, 1, "test", None);
        let schedule = ScheduleChoice {
            kind: ScheduleKind::EarlyBackward1F1B,
            warmup_policy: policy,
        };
        let plan = Plan::new(inputs, b, m, schedule, stages);
        cost(&plan, profile).unwrap().0
    }

    fn refined(plan: &Plan, profile: &Profile) -> Refined {
        let layers = LayerCosts::new(profile);
        let cluster = Cluster::for_model(&plan.inputs.topology, &layers).unwrap();
        refine(plan, profile, &layers, &cluster, 1, u64::MAX).unwrap()
    }

    #[test]
    fn a_stage_boundary_moves_to_balance_the_pipeline() {
        // Four equal layers on two GPUs split 1 | 3: the second stage is
        // the bottleneck until the boundary moves to 2 | 2.
        let profile = profile(&[(1.0, 2.0, 0, 1000); 4]);
        let topology = Topology::from_spec("1x2-nvlink").unwrap();
        for policy in [WarmupPolicy::A, WarmupPolicy::Auto] {
            let plan = costed(
                &profile,
                &topology,
                8,
                1,
                &[(0, 1, vec![0]), (1, 4, vec![1])],
                policy,
            )
            .unwrap();
            let r = refined(&plan, &profile);
            let layers: Vec<(usize, usize)> = r
                .plan
                .stages
                .iter()
                .map(|s| (s.layer_start, s.layer_end))
                .collect();
            assert_eq!(layers, vec![(0, 2), (2, 4)], "{policy:?}");
            assert!(r.moves >= 1);
            assert!(simulated_ms(&r.plan) < r.from_ms, "{policy:?}");
        }
    }

    #[test]
    fn stages_move_onto_one_machine_each_for_their_allreduce() {
        // Two layers with 400 MB of parameters each, on two machines of two
        // GPUs joined by 1 Gbps: each stage spread over both machines
        // reduces its gradients over the slow link. Swapping GPUs puts each
        // stage on one machine, where the AllReduce runs on NVLink.
        let profile = profile(&[(10.0, 20.0, 400_000_000, 1000); 2]);
        let topology = Topology::from_spec("2x2-nvlink-1gbps").unwrap();
        let plan = costed(
            &profile,
            &topology,
            8,
            2,
            &[(0, 1, vec![0, 2]), (1, 2, vec![1, 3])],
            WarmupPolicy::Auto,
        )
        .unwrap();
        let r = refined(&plan, &profile);
        let devices: Vec<&Vec<u32>> = r.plan.stages.iter().map(|s| &s.devices).collect();
        assert!(
            devices == vec![&vec![0, 1], &vec![2, 3]] || devices == vec![&vec![2, 3], &vec![0, 1]],
            "{devices:?}"
        );
        // Far faster: the slow AllReduce of 400 MB took about 3.2 s.
        assert!(simulated_ms(&r.plan) < 0.5 * r.from_ms, "{} vs {}", simulated_ms(&r.plan), r.from_ms);
        // Changed stages are no policy's placement.
        assert!(r.plan.stages.iter().all(|s| s.placement.is_none()));
    }

    /// A random plan of `layers` layers on `topology`: random boundaries,
    /// GPUs dealt at random, some left idle.
    fn random_plan(
        rng: &mut StdRng,
        profile: &Profile,
        topology: &Topology,
    ) -> Option<Plan> {
        let layers = profile.layers.len();
        let devices = topology.num_devices();
        let count = rng.gen_range(1..=layers.min(devices as usize));
        let mut cuts: Vec<usize> = (1..layers).collect();
        cuts.shuffle(rng);
        let mut cuts: Vec<usize> = cuts.into_iter().take(count - 1).collect();
        cuts.sort_unstable();
        let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain([layers]).collect();
        let mut gpus: Vec<u32> = (0..devices).collect();
        gpus.shuffle(rng);
        let used = rng.gen_range(count as u32..=devices) as usize;
        let mut owned: Vec<Vec<u32>> = vec![Vec::new(); count];
        for (i, &g) in gpus[..used].iter().enumerate() {
            // Each stage gets one first, the rest at random.
            let k = if i < count { i } else { rng.gen_range(0..count) };
            owned[k].push(g);
        }
        let stages: Vec<(usize, usize, Vec<u32>)> = (0..count)
            .map(|k| {
                owned[k].sort_unstable();
                (bounds[k], bounds[k + 1], owned[k].clone())
            })
            .collect();
        let gbs = 8;
        let b = [1, 2, 4][rng.gen_range(0..3)];
        let policy = [WarmupPolicy::A, WarmupPolicy::B, WarmupPolicy::Auto][rng.gen_range(0..3)];
        costed(profile, topology, gbs, b, &stages, policy)
    }

    #[test]
    fn refinement_never_slows_a_plan_and_its_plans_cost_as_they_say() {
        let mut rng = StdRng::seed_from_u64(20261124);
        let specs = ["1x4-nvlink", "2x2-nvlink-10gbps", "2x3-pcie-25gbps", "3x1-10gbps"];
        let mut improved = 0;
        let mut cases = 0;
        for case in 0..80 {
            let layers: Vec<(f64, f64, u64, u64)> = (0..rng.gen_range(1..=6))
                .map(|_| {
                    (
                        rng.gen_range(0.1..10.0),
                        rng.gen_range(0.1..20.0),
                        rng.gen_range(0..400_000_000),
                        rng.gen_range(0..100_000_000),
                    )
                })
                .collect();
            let profile = profile(&layers);
            let topology = Topology::from_spec(specs[case % specs.len()]).unwrap();
            let Some(plan) = random_plan(&mut rng, &profile, &topology) else {
                continue;
            };
            cases += 1;
            let r = refined(&plan, &profile);
            let ms = simulated_ms(&r.plan);
            assert!(ms <= r.from_ms, "case {case}: {ms} > {}", r.from_ms);
            assert_eq!(r.from_ms, simulated_ms(&plan));
            if r.moves > 0 {
                improved += 1;
                assert!(ms < r.from_ms, "case {case}");
            }
            // The refined plan is valid and re-costs to its own estimate.
            let again = evaluate(&r.plan, &profile).unwrap();
            assert_eq!(Some(&again), r.plan.estimate.as_ref(), "case {case}");
            assert!(again.fits_memory);
            // The same on one thread as on several.
            let alone = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap()
                .install(|| refined(&plan, &profile));
            assert_eq!(alone.plan, r.plan, "case {case}");
            assert_eq!(alone.moves, r.moves, "case {case}");
        }
        // Random plans are mostly improvable: the moves do reach them.
        assert!(cases >= 40 && improved * 2 >= cases, "{improved} of {cases} improved");
    }

    #[test]
    fn swaps_that_only_rename_machines_are_left_out() {
        let profile = profile(&[(1.0, 2.0, 1000, 1000); 2]);
        let swaps = |spec: &str, stages: &[(usize, usize, Vec<u32>)]| {
            let topology = Topology::from_spec(spec).unwrap();
            let plan = costed(&profile, &topology, 8, 2, stages, WarmupPolicy::A).unwrap();
            let layers = LayerCosts::new(&profile);
            let cluster = Cluster::for_model(&topology, &layers).unwrap();
            candidate_moves(&plan, &cluster)
                .into_iter()
                .filter(|m| matches!(m, Move::Swap { .. }))
                .count()
        };
        // One GPU per machine: every swap trades whole machines.
        assert_eq!(swaps("4x1-10gbps", &[(0, 1, vec![0, 1]), (1, 2, vec![2])]), 0);
        // Both stages on both machines, a third machine idle: two swaps put
        // each stage on one machine (stage 0 on either), and each stage's
        // GPU on either machine may trade with an idle one: 2 + 2 x 2.
        assert_eq!(
            swaps("3x2-nvlink-10gbps", &[(0, 1, vec![0, 2]), (1, 2, vec![1, 3])]),
            6
        );
    }

    #[test]
    fn a_spent_budget_stops_refinement() {
        let profile = profile(&[(1.0, 2.0, 0, 1000); 4]);
        let topology = Topology::from_spec("1x2-nvlink").unwrap();
        let plan = costed(
            &profile,
            &topology,
            8,
            1,
            &[(0, 1, vec![0]), (1, 4, vec![1])],
            WarmupPolicy::A,
        )
        .unwrap();
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::for_model(&topology, &layers).unwrap();
        // One batch of moves at most, then no work is left.
        let r = refine(&plan, &profile, &layers, &cluster, 1, 1).unwrap();
        assert!(r.tried <= BATCH as u64, "{}", r.tried);
        let full = refine(&plan, &profile, &layers, &cluster, 1, u64::MAX).unwrap();
        assert!(full.tried > r.tried);
    }
}
