//! Strategies to compare DAPPLE's plans against, built as ordinary plans so
//! the same estimate and simulator cost them.
//!
//! - data parallelism: one stage on every GPU (with or without AllReduce
//!   overlap is a simulation option);
//! - GPipe: one GPU per stage, layers in blocks of balanced time (the block
//!   partition torchgpipe's balance-by-time uses), all forwards then all
//!   backwards;
//! - straight: the same partition under early-backward scheduling;
//! - PipeDream's planner: its asynchronous objective (the slowest stage,
//!   replication allowed, section 3.1 of the PipeDream paper), then run
//!   synchronously as DAPPLE's section VI-F does.
//!
//! Each layout gets the micro-batch size that makes it fastest and fits.

use crate::cost::{smallest_slice, Cluster, WarmupPolicy};
use crate::error::{Error, Result};
use crate::plan::{evaluate, warmup_depth, Plan, PlanInputs, Schedule, Stage};
use crate::profile::{LayerCosts, Profile};
use crate::schedule::ScheduleKind;
use crate::topology::Topology;
use crate::warmup::plan_with_chosen_warmups;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    DataParallel,
    GPipe,
    Straight,
    PipeDream,
}

impl Baseline {
    pub const ALL: [Baseline; 4] = [
        Baseline::DataParallel,
        Baseline::GPipe,
        Baseline::Straight,
        Baseline::PipeDream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Baseline::DataParallel => "data-parallel",
            Baseline::GPipe => "gpipe",
            Baseline::Straight => "straight",
            Baseline::PipeDream => "pipedream-planner",
        }
    }

    pub fn parse(name: &str) -> Result<Baseline> {
        Baseline::ALL.into_iter().find(|b| b.name() == name).ok_or_else(|| {
            Error::invalid(format!(
                "value {name:?} is not a baseline; use data-parallel, gpipe, straight or pipedream-planner"
            ))
        })
    }
}

/// Contiguous split of `weights` into `parts` blocks minimising the largest
/// block sum (block partition of a sequence), as (start, end) ranges.
pub fn block_partition(weights: &[f64], parts: usize) -> Vec<(usize, usize)> {
    let n = weights.len();
    let parts = parts.clamp(1, n.max(1));
    let mut prefix = vec![0.0; n + 1];
    for (i, w) in weights.iter().enumerate() {
        prefix[i + 1] = prefix[i] + w;
    }
    // best[k][j]: smallest largest-block over splits of the first j items into k blocks.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for j in k..=n {
            for i in (k - 1)..j {
                let v = best[k - 1][i].max(prefix[j] - prefix[i]);
                if v < best[k][j] {
                    best[k][j] = v;
                    cut[k][j] = i;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut j = n;
    for k in (1..=parts).rev() {
        let i = cut[k][j];
        ranges.push((i, j));
        j = i;
    }
    ranges.reverse();
    ranges
}

/// A stage layout before micro-batching: layer ranges and their devices.
type Layout = Vec<(usize, usize, Vec<u32>)>;

/// The layout of a baseline on this cluster.
fn layout(kind: Baseline, layers: &LayerCosts, cluster: &Cluster, min_slice: u32) -> Layout {
    let n = layers.num_layers;
    let g = cluster.num_devices();
    match kind {
        Baseline::DataParallel => vec![(0, n, (0..g).collect())],
        Baseline::GPipe | Baseline::Straight => {
            let t = layers.times_at(min_slice);
            let work: Vec<f64> = (0..n).map(|l| t.fwd(l, l + 1) + t.bwd(l, l + 1)).collect();
            block_partition(&work, g.min(n as u32) as usize)
                .into_iter()
                .enumerate()
                .map(|(i, (s, e))| (s, e, vec![i as u32]))
                .collect()
        }
        Baseline::PipeDream => pipedream_layout(layers, cluster, min_slice),
    }
}

/// PipeDream's planner (one level): A(j, m) = min over the last stage
/// (i..j on m' GPUs) of max(A(i, m - m'), 2 C_i / B, T(i..j, m')), with
/// T(i..j, m') = max(compute, 4 (m'-1) |w| / (m' B)) / m' as in the paper:
/// the slowest stage of an asynchronous pipeline, weights synchronised each
/// minibatch. Weight sync and transfers use the intra-machine link when the
/// GPUs involved fit in one machine, the network otherwise. Stages take
/// consecutive device ids, as PipeDream places them.
fn pipedream_layout(layers: &LayerCosts, cluster: &Cluster, batch: u32) -> Layout {
    let n = layers.num_layers;
    let g = cluster.num_devices() as usize;
    let per_machine = cluster.machines.iter().map(|m| m.gpus).max().unwrap_or(1) as usize;
    let intra = cluster
        .machines
        .iter()
        .map(|m| m.intra_bytes_per_ms)
        .fold(f64::INFINITY, f64::min);
    let inter = cluster.inter_bytes_per_ms;
    let bandwidth = |gpus: usize| if gpus <= per_machine { intra } else { inter };
    let t = layers.times_at(batch);
    let stage_time = |i: usize, j: usize, m: usize| {
        let compute = t.fwd(i, j) + t.bwd(i, j);
        let mf = m as f64;
        let sync = 4.0 * (mf - 1.0) * layers.param_bytes(i, j) / (mf * bandwidth(m));
        compute.max(sync) / mf
    };
    // a[j][m]: best slowest-stage time for layers 0..j on m GPUs; from[j][m] = (i, m').
    let mut a = vec![vec![f64::INFINITY; g + 1]; n + 1];
    let mut from = vec![vec![(0usize, 0usize); g + 1]; n + 1];
    for j in 1..=n {
        for m in 1..=g {
            a[j][m] = stage_time(0, j, m);
            from[j][m] = (0, m);
            for i in 1..j {
                // Both stages fit in one machine only while m GPUs do.
                let send = 2.0 * layers.cut_bytes_per_sample(i) * f64::from(batch) / bandwidth(m);
                for mp in 1..m {
                    let v = a[i][m - mp].max(send).max(stage_time(i, j, mp));
                    if v < a[j][m] {
                        a[j][m] = v;
                        from[j][m] = (i, mp);
                    }
                }
            }
        }
    }
    let mut stages = Vec::new();
    let (mut j, mut m) = (n, g);
    while j > 0 {
        let (i, mp) = from[j][m];
        stages.push((i, j, mp));
        j = i;
        m -= mp;
    }
    stages.reverse();
    let mut next = 0u32;
    stages
        .into_iter()
        .map(|(i, j, mp)| {
            let devices: Vec<u32> = (next..next + mp as u32).collect();
            next += mp as u32;
            (i, j, devices)
        })
        .collect()
}

/// The baseline's layout at every micro-batch size it can take (each
/// device's slice at least `min_slice`), with the K_i of `policy` (one
/// micro-batch under auto, whose depths are chosen later). Not costed.
pub fn baseline_layouts(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_slice: u32,
    policy: WarmupPolicy,
) -> Result<Vec<Plan>> {
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::new(topology);
    let stages = layout(kind, &layers, &cluster, min_slice);
    let schedule_kind = if kind == Baseline::GPipe {
        ScheduleKind::GPipe
    } else {
        ScheduleKind::EarlyBackward1F1B
    };
    let widest = stages
        .iter()
        .map(|(_, _, d)| d.len() as u32)
        .max()
        .unwrap_or(1);
    let inputs = PlanInputs::new(
        profile,
        topology,
        global_batch_size,
        min_slice,
        kind.name(),
        None,
    );
    let count = stages.len() as u32;
    Ok((1..=global_batch_size)
        .filter(|b| global_batch_size.is_multiple_of(*b) && smallest_slice(*b, widest) >= min_slice)
        .map(|b| {
            let m = global_batch_size / b;
            Plan::new(
                inputs.clone(),
                b,
                m,
                Schedule {
                    kind: schedule_kind.name().into(),
                    warmup_policy: policy.name().into(),
                },
                stages
                    .iter()
                    .enumerate()
                    .map(|(i, (s, e, d))| Stage {
                        layer_start: *s,
                        layer_end: *e,
                        devices: d.clone(),
                        warmup_micro_batches: warmup_depth(
                            schedule_kind,
                            policy,
                            count - i as u32,
                            m,
                        )
                        .unwrap_or(1),
                        placement: None,
                    })
                    .collect(),
            )
        })
        .collect())
}

/// The baseline's plan at the micro-batch size (and, under warm-up policy
/// auto, the warm-up depths) whose simulated iteration is shortest and fits.
pub fn baseline_plan(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    policy: WarmupPolicy,
) -> Result<Plan> {
    let min_slice = profile.min_slice(min_micro_batch_size);
    let layouts = baseline_layouts(
        kind,
        profile,
        topology,
        global_batch_size,
        min_slice,
        policy,
    )?;
    let searched = policy == WarmupPolicy::Auto && kind != Baseline::GPipe;
    let mut best: Option<Plan> = None;
    let mut smallest_need: Option<f64> = None;
    for plan in layouts {
        // Checked and costed like a hand-written plan (which re-hashes the
        // profile each time: well under a millisecond per micro-batch size).
        let estimate = evaluate(&plan, profile)?;
        let costed = if searched {
            plan_with_chosen_warmups(&plan, profile)?.0
        } else {
            Some(Plan {
                estimate: Some(estimate.clone()),
                ..plan
            })
        };
        let Some(plan) = costed.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory))
        else {
            let need = estimate.peak_memory_bytes;
            smallest_need = Some(smallest_need.map_or(need, |s: f64| s.min(need)));
            continue;
        };
        if best
            .as_ref()
            .is_none_or(|b| headline_ms(&plan) < headline_ms(b))
        {
            best = Some(plan);
        }
    }
    best.ok_or_else(|| match smallest_need {
        Some(need) => Error::infeasible(format!(
            "{} does not fit in GPU memory at any micro-batch size: it needs at least {:.2} GiB per GPU",
            kind.name(),
            need / (1u64 << 30) as f64
        )),
        None => Error::incompatible(format!(
            "{}: no micro-batch size of global batch {global_batch_size} gives every GPU at least {min_slice} samples",
            kind.name()
        )),
    })
}

/// The simulated iteration of a costed plan.
fn headline_ms(plan: &Plan) -> f64 {
    let e = plan.estimate.as_ref().expect("costed plan");
    e.iteration_ms.unwrap_or(e.latency_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::chain_profile;

    #[test]
    fn block_partition_minimises_the_largest_block() {
        assert_eq!(
            block_partition(&[1.0, 1.0, 1.0, 1.0], 2),
            vec![(0, 2), (2, 4)]
        );
        assert_eq!(
            block_partition(&[5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2),
            vec![(0, 1), (1, 6)]
        );
        assert_eq!(
            block_partition(&[1.0, 2.0, 3.0, 4.0, 5.0], 3),
            vec![(0, 3), (3, 4), (4, 5)]
        );
        assert_eq!(block_partition(&[1.0; 3], 5).len(), 3);
    }

    #[test]
    fn baselines_are_valid_plans_of_their_kind() {
        let p = chain_profile(&[(1.0, 2.0); 8], 1);
        let t = Topology::from_spec("2x2-nvlink-10gbps").unwrap();
        let dp = baseline_plan(Baseline::DataParallel, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(dp.shape(), "4");
        let gp = baseline_plan(Baseline::GPipe, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(gp.shape(), "1:1:1:1");
        assert_eq!(gp.schedule.kind, "gpipe");
        assert!(gp
            .stages
            .iter()
            .all(|s| s.warmup_micro_batches == gp.micro_batches));
        let st = baseline_plan(Baseline::Straight, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(
            st.stages
                .iter()
                .map(|s| s.layer_end - s.layer_start)
                .collect::<Vec<_>>(),
            vec![2, 2, 2, 2]
        );
        let pd = baseline_plan(Baseline::PipeDream, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(pd.stages.iter().map(|s| s.devices.len()).sum::<usize>(), 4);
    }

    #[test]
    fn pipedream_replicates_a_heavy_stage() {
        // One layer much heavier than the rest, tiny weights: PipeDream gives it
        // more GPUs so that no stage is slower than the others.
        let mut p = chain_profile(&[(6.0, 12.0), (1.0, 2.0), (1.0, 2.0)], 1);
        for l in &mut p.layers {
            l.param_bytes = 10;
        }
        let t = Topology::from_spec("1x4-nvlink").unwrap();
        let pd = baseline_plan(Baseline::PipeDream, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert!(pd.stages[0].devices.len() >= 2, "{}", pd.shape());
    }
}
