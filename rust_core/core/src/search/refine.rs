//! Refinement: small changes to the search's chosen plan, each kept when
//! the simulator says it is faster.
//!
//! The search is exact over its space only where its walk finishes
//! (`selection.optimal`); on the larger paper-scale cases it stops at its
//! budget, and above 16 GPUs its space is machine-aligned. Both leave
//! plans the simulator would rank higher just out of reach: on 4x8,
//! GNMT-32's chosen plan (935.3 ms) simulated 2.3% slower than the full
//! space's (914.5); moves from it alone reach 897.0 ms, and with the
//! second start below 892.4 (docs/cost-model.md, "Refinement"). So the chosen plan is improved by local moves on
//! concrete GPUs, the same way a person would tune it by hand, costed by
//! the same simulation and warm-up choice as every candidate:
//!
//! - move the boundary between two neighbouring stages by one layer;
//! - swap one GPU, or all of a stage's GPUs on a machine, between two
//!   stages on different machines, or with idle GPUs on another machine
//!   (which machines a stage spans decides its AllReduce and transfers);
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
//! on mixed GPUs. The search refines from two starts
//! (`refine_from_two_starts`): the chosen plan, and the refined plan's
//! layout placed anew by the paper's policies.

use rayon::prelude::*;

use crate::cost::{Cluster, StageCoster, StageDevices};
use crate::error::Result;
use crate::plan::{Plan, PlanInputs, Stage};
use crate::simulation::costing::ProfileCosts;

use super::candidate::{best_placement_of, cost_candidate_below};
use super::space::hints_admit;
use crate::plan::hints::Hints;

/// Who holds a GPU: a stage (by index) or nobody.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Stage(usize),
    Idle,
}

/// One local change to a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Move {
    /// The boundary between stage `stage` and the next moves by one layer:
    /// later (`stage` takes the next stage's first layer) or earlier.
    Shift { stage: usize, later: bool },
    /// GPUs `give` of stage `stage` (on one machine) and as many GPUs
    /// `take` of `other` (on another) change places.
    Swap {
        stage: usize,
        give: Vec<u32>,
        other: Holder,
        take: Vec<u32>,
    },
    /// GPU `device` goes from one holder to another.
    Hand {
        device: u32,
        from: Holder,
        to: Holder,
    },
}

/// What refinement did to a plan.
#[derive(Debug, Clone)]
pub(crate) struct Refined {
    /// The fastest plan found: the one given when no move helped.
    pub(crate) plan: Plan,
    /// Simulated iteration of the plan given.
    pub(crate) from_ms: f64,
    pub(crate) moves_kept: u32,
    pub(crate) plans_costed: u64,
}

/// Moves tried at once; the first faster one of a batch, in order, is kept.
const BATCH: usize = 8;

/// Simulated tasks refinement may spend from each of its two starts:
/// well under a second each on the paper's cases.
const REFINE_TASK_BUDGET: u64 = 20_000_000;

/// Largest cluster whose chosen plan is refined. One GPU's move is a
/// visible share of a stage up to there; moves grow with the square of
/// the machines, and on 1,024 GPUs of whole-machine stages a single
/// GPU's move only splits a stage over one more machine.
pub(crate) const REFINE_MAX_DEVICES: u32 = 64;

/// Refine the search's chosen plan from two starts: the plan itself, and
/// the refined layout placed anew, as the paper's policies place it at its
/// smallest formula value, and refined in turn. Moves change a few GPUs at
/// a time, and a placement of the same layout can lie past every path of
/// faster single moves. The second start is skipped where it is a plan
/// already refined, up to which alike machines hold what (on 16x1,
/// always). `plans_costed` counts both starts; the placement anew counts
/// as one move where it is kept.
pub(crate) fn refine_from_two_starts(
    chosen: &Plan,
    costs: &ProfileCosts,
    inputs: &PlanInputs,
    cluster: &Cluster,
    (min_slice, hints): (u32, &Hints),
) -> Result<Refined> {
    let refine_from =
        |plan: &Plan| refine(plan, costs, cluster, (min_slice, hints), REFINE_TASK_BUDGET);
    let first = refine_from(chosen)?;
    let Some(placed) = best_placement_of(&first.plan, costs, inputs, cluster, min_slice)?
        .filter(|p| !same_up_to_machines(p, &first.plan, cluster))
    else {
        return Ok(first);
    };
    let again = refine_from(&placed)?;
    let plans_costed = first.plans_costed + 1 + again.plans_costed;
    if simulated_ms(&again.plan) < simulated_ms(&first.plan) * (1.0 - 1e-9) {
        Ok(Refined {
            from_ms: first.from_ms,
            moves_kept: first.moves_kept + 1 + again.moves_kept,
            plans_costed,
            ..again
        })
    } else {
        Ok(Refined {
            plans_costed,
            ..first
        })
    }
}

/// Improve `plan` (costed, simulated and fitting in memory) by local moves
/// the hints admit until none helps or `work_tasks` simulated tasks are
/// spent.
pub(crate) fn refine(
    plan: &Plan,
    costs: &ProfileCosts,
    cluster: &Cluster,
    (min_slice, hints): (u32, &Hints),
    work_tasks: u64,
) -> Result<Refined> {
    let from_ms = simulated_ms(plan);
    let coster = StageCoster::new(
        &costs.layers,
        cluster,
        plan.micro_batch_size,
        plan.micro_batches,
    )
    .overlapping(plan.schedule.overlap);
    let mut current = plan.clone();
    let mut best_ms = from_ms;
    let mut moves = candidate_moves(&current, cluster);
    let mut work_left = work_tasks;
    let (mut moves_kept, mut plans_costed) = (0u32, 0u64);
    let mut next = 0usize;
    let mut since_kept = 0usize;
    while since_kept < moves.len() && work_left > 0 {
        let count = BATCH.min(moves.len() - since_kept);
        // Built here (the coster's caches stay on this thread), costed in parallel.
        let batch: Vec<Option<Plan>> = (0..count)
            .map(|i| {
                apply(
                    &current,
                    &moves[(next + i) % moves.len()],
                    &coster,
                    cluster,
                    min_slice,
                )
                .filter(|p| hints_admit(hints, p))
            })
            .collect();
        let costed: Vec<(Option<Plan>, u64)> = batch
            .par_iter()
            .map(|candidate| match candidate {
                Some(candidate) => cost(candidate, costs, best_ms * (1.0 - 1e-9)),
                None => Ok((None, 0)),
            })
            .collect::<Result<_>>()?;
        plans_costed += costed.iter().filter(|(_, tasks)| *tasks > 0).count() as u64;
        work_left = work_left.saturating_sub(costed.iter().map(|(_, tasks)| tasks).sum());
        let faster = costed.into_iter().enumerate().find_map(|(i, (p, _))| {
            p.filter(|p| simulated_ms(p) < best_ms * (1.0 - 1e-9))
                .map(|p| (i, p))
        });
        match faster {
            Some((i, p)) => {
                best_ms = simulated_ms(&p);
                current = p;
                moves_kept += 1;
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
        moves_kept,
        plans_costed,
    })
}

/// Whether two plans have the same stages' layers and differ only in which
/// of alike machines (same group and size) hold what: they cost the same.
fn same_up_to_machines(a: &Plan, b: &Plan, cluster: &Cluster) -> bool {
    let layers = |p: &Plan| -> Vec<(usize, usize)> {
        p.stages
            .iter()
            .map(|s| (s.layer_start, s.layer_end))
            .collect()
    };
    // Each machine as (group, GPUs, GPUs of each holder on it), sorted.
    let kinds = cluster.group_and_gpus();
    let pattern = |p: &Plan| -> Vec<((usize, u32), Vec<usize>)> {
        let on = gpus_by_holder(p, cluster);
        let mut machines: Vec<((usize, u32), Vec<usize>)> = kinds
            .iter()
            .enumerate()
            .map(|(m, &kind)| {
                (
                    kind,
                    on.iter().map(|per_machine| per_machine[m].len()).collect(),
                )
            })
            .collect();
        machines.sort_unstable();
        machines
    };
    layers(a) == layers(b)
        && a.micro_batch_size == b.micro_batch_size
        && a.stages
            .iter()
            .map(|s| &s.slices)
            .eq(b.stages.iter().map(|s| &s.slices))
        && pattern(a) == pattern(b)
}

/// The GPUs each holder has on each machine, ascending: `[holder][machine]`,
/// the stages first, the idle pool last (index `plan.stages.len()`).
fn gpus_by_holder(plan: &Plan, cluster: &Cluster) -> Vec<Vec<Vec<u32>>> {
    let stages = plan.stages.len();
    let mut owner = vec![stages; cluster.num_devices() as usize];
    for (k, s) in plan.stages.iter().enumerate() {
        for &d in &s.devices {
            owner[d as usize] = k;
        }
    }
    let mut on = vec![vec![Vec::new(); cluster.group_and_gpus().len()]; stages + 1];
    for (d, &k) in owner.iter().enumerate() {
        if let Some(m) = cluster.machine_of(d as u32) {
            on[k][m].push(d as u32);
        }
    }
    on
}

fn simulated_ms(plan: &Plan) -> f64 {
    plan.estimate
        .as_ref()
        .and_then(|e| e.iteration_ms)
        .expect("refinement costs simulated plans")
}

/// A neighbour costed as the search costs a candidate, where it could be
/// faster than `below_ms` (`cost_candidate_below`); None without cost when
/// it is no valid plan: a move can give a stage more GPUs than its
/// micro-batch has slices of the minimum size.
fn cost(plan: &Plan, costs: &ProfileCosts, below_ms: f64) -> Result<(Option<Plan>, u64)> {
    if costs.check(plan).is_err() {
        return Ok((None, 0));
    }
    cost_candidate_below(plan, costs, below_ms)
}

/// Every move of `plan`, in the order they are tried. GPUs on one machine
/// are alike, so a holder (a stage or the idle pool) offers its GPUs on a
/// machine in a fixed order: a stage its last first, the idle pool its
/// first. Two holders swap one GPU, or as many as the smaller of their
/// shares of the two machines: a stage's AllReduce leaves NVLink as soon
/// as one GPU is on another machine, so moving a stage off a machine, or
/// onto one, takes all of its GPUs there at once. A swap that only
/// exchanges what two alike machines hold (on 16x1, any swap) changes
/// nothing and is left out.
fn candidate_moves(plan: &Plan, cluster: &Cluster) -> Vec<Move> {
    let kinds = cluster.group_and_gpus();
    let machines = kinds.len();
    let stages = plan.stages.len();
    // GPUs of each holder on each machine, in the order it offers them.
    let mut on = gpus_by_holder(plan, cluster);
    for per_machine in &mut on[..stages] {
        for gpus in per_machine.iter_mut() {
            gpus.reverse();
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
    let held: Vec<Vec<usize>> = (0..machines)
        .map(|m| (0..=stages).map(|h| on[h][m].len()).collect())
        .collect();
    // Machine `ma` with `count` GPUs of holder `a` given to `b` holds what
    // `mb` holds, and the two are alike: the swap only renames machines.
    let renames = |ma: usize, a: usize, mb: usize, b: usize, count: usize| {
        let mut after = held[ma].clone();
        after[a] -= count;
        after[b] += count;
        kinds[ma] == kinds[mb] && after == held[mb]
    };
    let machines_of =
        |h: usize| -> Vec<usize> { (0..machines).filter(|&m| !on[h][m].is_empty()).collect() };
    let mut out = Vec::new();
    for stage in 0..stages.saturating_sub(1) {
        for later in [false, true] {
            out.push(Move::Shift { stage, later });
        }
    }
    for stage in 0..stages {
        for other in stage + 1..=stages {
            for &ma in &machines_of(stage) {
                for &mb in &machines_of(other) {
                    if ma == mb {
                        continue;
                    }
                    let most = on[stage][ma].len().min(on[other][mb].len());
                    let counts = if most > 1 { vec![1, most] } else { vec![1] };
                    for count in counts {
                        if !renames(ma, stage, mb, other, count) {
                            out.push(Move::Swap {
                                stage,
                                give: on[stage][ma][..count].to_vec(),
                                other: holder(other),
                                take: on[other][mb][..count].to_vec(),
                            });
                        }
                    }
                }
            }
        }
    }
    for (from, from_on) in on.iter().enumerate() {
        for to in 0..=stages {
            if from == to {
                continue;
            }
            // A stage keeps at least one GPU.
            if from < stages && plan.stages[from].devices.len() < 2 {
                continue;
            }
            for m in machines_of(from) {
                out.push(Move::Hand {
                    device: from_on[m][0],
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
    mv: &Move,
    coster: &StageCoster,
    cluster: &Cluster,
    min_slice: u32,
) -> Option<Plan> {
    let mut stages: Vec<Stage> = plan.stages.clone();
    let mut touched: Vec<usize> = Vec::new();
    match *mv {
        Move::Shift { stage, later } => {
            let (a, b) = (&stages[stage], &stages[stage + 1]);
            let boundary = if later {
                a.layer_end + 1
            } else {
                a.layer_end - 1
            };
            if boundary <= a.layer_start || boundary >= b.layer_end {
                return None;
            }
            stages[stage].layer_end = boundary;
            stages[stage + 1].layer_start = boundary;
            touched.extend([stage, stage + 1]);
        }
        Move::Swap {
            stage,
            ref give,
            other,
            ref take,
        } => {
            replace(&mut stages[stage].devices, give, take);
            touched.push(stage);
            if let Holder::Stage(o) = other {
                replace(&mut stages[o].devices, take, give);
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
        // Slices are listed machine by machine, in device order; a plan's
        // stage need not be (Whale's pipeline orders GPUs by memory).
        s.devices.sort_unstable();
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

/// Put `new` in the place of `old` in a sorted GPU list, keeping it sorted.
fn replace(devices: &mut Vec<u32>, old: &[u32], new: &[u32]) {
    devices.retain(|d| !old.contains(d));
    devices.extend_from_slice(new);
    devices.sort_unstable();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::{with_one_slow_machine, Topology};
    use crate::cost::WarmupPolicy;
    use crate::model::profile::{LayerCosts, Profile};
    use crate::plan::hints::NO_HINTS;
    use crate::plan::{PlanInputs, ScheduleChoice};
    use crate::schedule::ScheduleKind;
    use crate::simulation::evaluate::evaluate;
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// A profile of layers (fwd ms, bwd ms, parameter bytes, activation
    /// bytes) measured at batch size 1.
    fn profile(layers: &[(f64, f64, u64, u64)]) -> Profile {
        crate::model::profile::profile_of_layers("refine-test", layers, 1)
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
        costed_with_min_slice(profile, topology, gbs, b, stages, policy, 1)
    }

    fn costed_with_min_slice(
        profile: &Profile,
        topology: &Topology,
        gbs: u32,
        b: u32,
        stages: &[(usize, usize, Vec<u32>)],
        policy: WarmupPolicy,
        min_slice: u32,
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
                ..Default::default()
            })
            .collect();
        let inputs = PlanInputs::new(profile, topology, gbs, min_slice, "test", None);
        let schedule = ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, policy);
        let plan = Plan::new(inputs, b, m, schedule, stages);
        cost(&plan, &ProfileCosts::new(profile), f64::INFINITY)
            .unwrap()
            .0
    }

    fn refined(plan: &Plan, profile: &Profile) -> Refined {
        let costs = ProfileCosts::new(profile);
        let cluster = Cluster::for_model(&plan.inputs.topology, &costs.layers).unwrap();
        let min_slice = plan.inputs.options.min_micro_batch_size;
        refine(plan, &costs, &cluster, (min_slice, &NO_HINTS), u64::MAX).unwrap()
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
            assert!(r.moves_kept >= 1);
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
        assert!(
            simulated_ms(&r.plan) < 0.5 * r.from_ms,
            "{} vs {}",
            simulated_ms(&r.plan),
            r.from_ms
        );
        // Changed stages are no policy's placement.
        assert!(r.plan.stages.iter().all(|s| s.placement.is_none()));
    }

    /// A random plan of `layers` layers on `topology`: random boundaries,
    /// GPUs dealt at random, some left idle.
    fn random_plan(rng: &mut StdRng, profile: &Profile, topology: &Topology) -> Option<Plan> {
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
            let k = if i < count {
                i
            } else {
                rng.gen_range(0..count)
            };
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
        let specs = [
            "1x4-nvlink",
            "2x2-nvlink-10gbps",
            "2x3-pcie-25gbps",
            "3x1-10gbps",
        ];
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
            if r.moves_kept > 0 {
                improved += 1;
                assert!(ms < r.from_ms, "case {case}");
            }
            // The refined plan is valid and re-costs to its own estimate.
            let again = evaluate(&r.plan, &profile).unwrap();
            assert_eq!(Some(&again), r.plan.estimate.as_ref(), "case {case}");
            assert!(again.fits_memory);
            // The same on one thread as on four.
            let on = |threads: usize| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(|| refined(&plan, &profile))
            };
            let (alone, four) = (on(1), on(4));
            assert_eq!(alone.plan, four.plan, "case {case}");
            assert_eq!(alone.moves_kept, four.moves_kept, "case {case}");
        }
        // Random plans are mostly improvable: the moves do reach them.
        assert!(
            cases >= 40 && improved * 2 >= cases,
            "{improved} of {cases} improved"
        );
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
        assert_eq!(
            swaps("4x1-10gbps", &[(0, 1, vec![0, 1]), (1, 2, vec![2])]),
            0
        );
        // Both stages on both machines, a third machine idle: two swaps put
        // each stage on one machine (stage 0 on either), and each stage's
        // GPU on either machine may trade with an idle one: 2 + 2 x 2.
        assert_eq!(
            swaps(
                "3x2-nvlink-10gbps",
                &[(0, 1, vec![0, 2]), (1, 2, vec![1, 3])]
            ),
            6
        );
    }

    #[test]
    fn stages_moved_onto_unlike_gpus_get_the_searchs_slices() {
        // One fast machine and one at half speed, two GPUs each; light
        // weights, heavy compute: the idle slow GPUs are worth adding to
        // the stages, which then run unlike GPUs with uneven slices.
        let profile = profile(&[(20.0, 40.0, 1000, 1000); 2]);
        let topology = with_one_slow_machine("2x2-nvlink-50gbps", 0.5);
        topology.validate().unwrap();
        let plan = costed(
            &profile,
            &topology,
            32,
            8,
            &[(0, 1, vec![0]), (1, 2, vec![1])],
            WarmupPolicy::Auto,
        )
        .unwrap();
        let r = refined(&plan, &profile);
        assert!(simulated_ms(&r.plan) < r.from_ms);
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::for_model(&topology, &layers).unwrap();
        let coster = StageCoster::new(&layers, &cluster, 8, 4);
        let mut uneven = 0;
        for s in &r.plan.stages {
            let alloc = cluster.alloc_of(&s.devices).unwrap();
            let devices = StageDevices::new(&cluster, alloc);
            let expected = coster.searched_slices(s.layer_start, s.layer_end, &devices, 1);
            assert_eq!(s.slices, expected, "{:?}", r.plan.stages);
            uneven += usize::from(
                s.slices
                    .as_ref()
                    .is_some_and(|v| v.iter().min() != v.iter().max()),
            );
        }
        assert!(uneven > 0, "{:?}", r.plan.stages);
        let again = evaluate(&r.plan, &profile).unwrap();
        assert_eq!(Some(&again), r.plan.estimate.as_ref());
    }

    #[test]
    fn no_move_gives_a_stage_slices_below_the_minimum() {
        // Micro-batches of 4 with slices of at least 2: a stage may have
        // two GPUs, not three or four, however much faster they would be.
        let profile = profile(&[(10.0, 20.0, 1000, 1000); 2]);
        let topology = Topology::from_spec("1x4-nvlink").unwrap();
        let plan = costed_with_min_slice(
            &profile,
            &topology,
            16,
            4,
            &[(0, 1, vec![0]), (1, 2, vec![1])],
            WarmupPolicy::Auto,
            2,
        )
        .unwrap();
        let r = refined(&plan, &profile);
        let sizes: Vec<usize> = r.plan.stages.iter().map(|s| s.devices.len()).collect();
        assert_eq!(sizes, vec![2, 2]);
        assert!(simulated_ms(&r.plan) < r.from_ms);
    }

    #[test]
    fn plans_alike_up_to_machines_are_recognised() {
        let profile = profile(&[(1.0, 2.0, 1000, 1000); 2]);
        let alike = Topology::from_spec("2x2-nvlink-10gbps").unwrap();
        let mixed = with_one_slow_machine("2x2-nvlink-10gbps", 0.5);
        let same = |topology: &Topology, a: [Vec<u32>; 2], b: [Vec<u32>; 2]| {
            let plan = |d: [Vec<u32>; 2]| {
                let [d0, d1] = d;
                costed(
                    &profile,
                    topology,
                    8,
                    2,
                    &[(0, 1, d0), (1, 2, d1)],
                    WarmupPolicy::A,
                )
                .unwrap()
            };
            let layers = LayerCosts::new(&profile);
            let cluster = Cluster::for_model(topology, &layers).unwrap();
            same_up_to_machines(&plan(a), &plan(b), &cluster)
        };
        // The two stages trade alike machines: the same plan.
        assert!(same(
            &alike,
            [vec![0, 1], vec![2, 3]],
            [vec![2, 3], vec![0, 1]]
        ));
        // Each stage on one machine, or both on both: not the same.
        assert!(!same(
            &alike,
            [vec![0, 1], vec![2, 3]],
            [vec![0, 2], vec![1, 3]]
        ));
        // Unlike machines are not renamed.
        assert!(!same(
            &mixed,
            [vec![0, 1], vec![2, 3]],
            [vec![2, 3], vec![0, 1]]
        ));
        assert!(same(
            &mixed,
            [vec![0, 1], vec![2, 3]],
            [vec![1, 0], vec![3, 2]]
        ));
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
        let costs = ProfileCosts::new(&profile);
        let cluster = Cluster::for_model(&topology, &costs.layers).unwrap();
        // One batch of moves at most, then no work is left.
        let r = refine(&plan, &costs, &cluster, (1, &NO_HINTS), 1).unwrap();
        assert!(r.plans_costed <= BATCH as u64, "{}", r.plans_costed);
        let full = refine(&plan, &costs, &cluster, (1, &NO_HINTS), u64::MAX).unwrap();
        assert!(full.plans_costed > r.plans_costed);
    }
}
