//! What each process of a run does, from a plan: the runtime
//! (`planner/runtime/`) executes this and decides nothing of its own.
//!
//! One process (rank) per device the plan uses; rank r runs on the r-th
//! used device id in ascending order and holds one replica of one stage, or
//! at split degree t one shard of a replica of t ranks (t consecutive
//! devices of the stage's list); at context degree c a replica is c such
//! groups (t c consecutive devices), context rank k holding chunks k and
//! 2c-1-k of each sample's sequence cut in 2c (`model/context.rs`).
//! A micro-batch entering a stage of R replicas is split by the stage's own
//! `slices` (uneven, for mixed GPUs) or else evenly by `cost::slice_ranges`:
//! the split the cost model prices; replica j takes the j-th range. Between two stages every sender sends each receiver
//! exactly the samples their ranges share, and gradients go back the same
//! way. Each stage runs the action list of the plan's schedule
//! (`plan::plan_schedule`, which the simulator runs too).

use serde::{Deserialize, Serialize};

use crate::cost::{ranges_of, slice_ranges};
use crate::error::{Error, Result};
use crate::plan::check_layout;
use crate::plan::{plan_schedule_over, Plan};
use crate::schedule::{rank_lists, Action};

/// Samples `[start, end)` of a micro-batch that one rank sends to, or
/// receives from, another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub rank: u32,
    pub start: u32,
    pub end: u32,
}

/// One rank of a stage: shard `shard` at context rank `context` of replica
/// `replica` (shard 0 and context rank 0 of its own replica when the stage
/// neither splits nor cuts its sequence).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLayout {
    pub rank: u32,
    /// The replica this rank computes a shard of, and which shard.
    pub replica: u32,
    pub shard: u32,
    /// Which of the replica's c context ranks: it holds chunks `context`
    /// and 2c-1-`context` of every sample's tokens cut in 2c equal chunks.
    pub context: u32,
    /// Samples `[start, end)` of every micro-batch this replica computes.
    pub start: u32,
    pub end: u32,
    /// Ranks of the previous stage this rank's input comes from, in order.
    pub receives_from: Vec<Peer>,
    /// Ranks of the next stage its output goes to, in order.
    pub sends_to: Vec<Peer>,
    /// Ranks of the previous stage it sends its input's gradient to: every
    /// shard there needs its output's gradient once, while several shards
    /// here may have received the same input.
    pub gradients_to: Vec<Peer>,
    /// Ranks of the next stage its output's gradient comes from.
    pub gradients_from: Vec<Peer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageLayout {
    pub layer_start: usize,
    pub layer_end: usize,
    /// One entry per rank, in the order of the stage's devices: replica j's
    /// shards are entries `j * t .. (j + 1) * t`.
    pub replicas: Vec<ReplicaLayout>,
    /// The stage's actions: forwards and backwards, whole or split (written
    /// `F3`, `B2`, `I2`, `W2`), then the AllReduce and the optimizer step
    /// (`AR`, `OPT`).
    pub actions: Vec<Action>,
    /// Split degree t: the GPUs each replica's layers are sharded over.
    pub tensor_parallel: u32,
    /// The sharding level over each replica group (`cost/sharding.rs`).
    pub shard_level: u8,
    /// Level 3: the weights freed after each forward.
    pub reshard_after_forward: bool,
    /// The backward re-runs the stage's forward (only its input is kept).
    pub recompute: bool,
    /// It does so a layer at a time: each layer's input kept, each layer's
    /// forward re-run just before its backward (`Recompute::PerLayer`).
    pub recompute_per_layer: bool,
    /// Ranks of each replica's shards (t consecutive devices of the stage,
    /// as `plan::check` checks them), by replica and context rank.
    pub split_groups: Vec<Vec<u32>>,
    /// Ranks holding the same shard in every replica and context rank, by
    /// shard: the gradient AllReduce and the sharding run over these.
    pub replica_groups: Vec<Vec<u32>>,
    /// Context degree c: the GPUs each replica's sequence is cut over.
    pub context_parallel: u32,
    /// Ranks cutting one replica's sequence: the same shard at each context
    /// rank, by replica then shard (each rank alone when c = 1). The keys
    /// and values of attention are gathered over these.
    pub context_groups: Vec<Vec<u32>>,
    /// Expert degree e: each expert group spreads the routed experts of
    /// the stage's layers over e ranks (1: every rank holds them all).
    pub expert_parallel: u32,
    /// Ranks of each expert group (`Stage::expert_groups`), which exchange
    /// their tokens: member k holds the k-th e-th of each layer's experts.
    pub expert_groups: Vec<Vec<u32>>,
    /// Ranks holding the same experts (`Stage::expert_replica_groups`):
    /// the routed experts' gradients are reduced over these, the rest over
    /// the replica groups.
    pub expert_replica_groups: Vec<Vec<u32>>,
    /// The optimizer's master weights, state and step on the host
    /// (`Offload::Optimizer`).
    pub offload_optimizer: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLayout {
    /// Used device ids, ascending: rank r runs on `devices[r]`.
    pub devices: Vec<u32>,
    pub micro_batch_size: u32,
    pub micro_batches: u32,
    pub stages: Vec<StageLayout>,
}

/// One rank of a stage while the layout is built: its rank, replica,
/// shard, context rank and samples.
#[derive(Clone, Copy)]
struct Slot {
    rank: u32,
    replica: u32,
    shard: u32,
    context: u32,
    range: (u32, u32),
}

/// The ranks of each stage, with their replica, shard and samples: a
/// micro-batch is split over the G / (t c) replicas (by the stage's own slices,
/// else evenly), and every shard of a replica takes the replica's samples.
fn slots_of(plan: &Plan, rank_of: impl Fn(u32) -> u32) -> Vec<Vec<Slot>> {
    plan.stages
        .iter()
        .map(|s| {
            let t = s.shape.tensor_parallel.max(1);
            // A data replica's t c devices take its samples, each context
            // rank its chunks of their tokens.
            let c = s.shape.context_parallel.max(1);
            let width = (t * c) as usize;
            let ranges = match &s.slices {
                Some(sizes) => ranges_of(sizes),
                None => slice_ranges(plan.micro_batch_size, s.replicas()),
            };
            s.devices
                .iter()
                .enumerate()
                .map(|(i, &d)| Slot {
                    rank: rank_of(d),
                    replica: (i / width) as u32,
                    shard: i as u32 % t,
                    context: (i as u32 / t) % c,
                    range: ranges[i / width],
                })
                .collect()
        })
        .collect()
}

/// The samples `me` shares with each rank of `other` at its context rank
/// that `links` to (by that rank's shard), in the other stage's order:
/// neighbouring stages cut their sequences alike (`check_context_degrees`),
/// so context rank k's tokens go to context rank k.
fn peers(other: &[Slot], me: Slot, links: impl Fn(u32) -> bool) -> Vec<Peer> {
    let (start, end) = me.range;
    other
        .iter()
        .filter(|o| o.context == me.context && links(o.shard))
        .filter_map(|o| {
            let (lo, hi) = (o.range.0.max(start), o.range.1.min(end));
            (lo < hi).then_some(Peer {
                rank: o.rank,
                start: lo,
                end: hi,
            })
        })
        .collect()
}

/// Rank `me` of stage `i`: between a sender stage of split degree `ts` and
/// a receiver of `tr`, receiver shard b takes its input from sender shard
/// b mod ts, and sender shard a its output's gradient from receiver shard
/// a mod tr (all shards of a replica hold the same input and output).
fn replica_layout(slots: &[Vec<Slot>], t: &[u32], i: usize, me: Slot) -> ReplicaLayout {
    let (none, last) = (Vec::new(), slots.len() - 1);
    let prev = if i > 0 { &slots[i - 1] } else { &none };
    let next = if i < last { &slots[i + 1] } else { &none };
    let t_prev = if i > 0 { t[i - 1] } else { 1 };
    let t_next = if i < last { t[i + 1] } else { 1 };
    ReplicaLayout {
        rank: me.rank,
        replica: me.replica,
        shard: me.shard,
        context: me.context,
        start: me.range.0,
        end: me.range.1,
        receives_from: peers(prev, me, |a| a == me.shard % t_prev),
        sends_to: peers(next, me, |b| b % t[i] == me.shard),
        gradients_to: peers(prev, me, |a| a % t[i] == me.shard),
        gradients_from: peers(next, me, |b| b == me.shard % t_next),
    }
}

/// A stage's ranks in groups, in the stage's order.
struct Groups {
    /// t consecutive ranks, by replica and context rank.
    split: Vec<Vec<u32>>,
    /// Those of one shard, by shard.
    replica: Vec<Vec<u32>>,
    /// Those of one replica and shard, by replica then shard.
    context: Vec<Vec<u32>>,
}

/// Stage `i`'s groups from its slots, which run replica by replica, each
/// replica's context ranks in turn, each context rank's t shards in turn:
/// one pass over the slots apiece.
fn groups_of(stage: &[Slot], t: usize, width: usize) -> Groups {
    let ranks = |slots: &mut dyn Iterator<Item = &Slot>| slots.map(|s| s.rank).collect();
    Groups {
        split: stage.chunks(t).map(|g| ranks(&mut g.iter())).collect(),
        replica: (0..t)
            .map(|k| ranks(&mut stage.iter().skip(k).step_by(t)))
            .collect(),
        context: stage
            .chunks(width)
            .flat_map(|replica| (0..t).map(move |k| replica.iter().skip(k).step_by(t)))
            .map(|mut shard| ranks(&mut shard))
            .collect(),
    }
}

/// Neighbouring stages cut their sequences alike: the runtime passes each
/// context rank's chunks of tokens to the same context rank of the next
/// stage, and re-cutting a sequence between stages is not laid out.
fn check_context_degrees(plan: &Plan) -> Result<()> {
    let degree = |i: usize| plan.stages[i].shape.context_parallel.max(1);
    for i in 1..plan.stages.len() {
        if degree(i) != degree(i - 1) {
            let mut e = Error::incompatible(format!(
                "value {}: stage {} cuts its sequence {} ways; dapple's runtime passes each context rank's \
                 tokens to the same context rank of the next stage, so neighbouring stages need one context degree",
                degree(i),
                i - 1,
                degree(i - 1)
            ));
            e.field = Some(format!("stages[{i}].context_parallel"));
            return Err(e);
        }
    }
    Ok(())
}

/// Each stage's actions for one mini-batch (an asynchronous run's lists
/// come from `plan_schedule_over`): its schedule's list, or a chunked
/// plan's stage's actions in its rank's order (`schedule::rank_lists`).
fn stage_actions(plan: &Plan) -> Result<Vec<Vec<Action>>> {
    if !plan.schedule.kind.is_chunked() {
        let schedule = plan_schedule_over(plan, None, 1)?;
        return Ok(schedule.stages.into_iter().map(|s| s.actions).collect());
    }
    let mut actions = vec![Vec::new(); plan.stages.len()];
    for list in rank_lists(&plan.chunked_order()?) {
        for (stage, action) in list {
            actions[stage].push(action);
        }
    }
    Ok(actions)
}

impl RunLayout {
    /// The layout of a plan, after checking that its stages can run
    /// (`plan::check_layout`; the layer count, and which layers of a split
    /// stage the model can split, are the runtime's to check against the
    /// model).
    pub fn of(plan: &Plan) -> Result<RunLayout> {
        check_layout(plan, None)?;
        check_context_degrees(plan)?;
        let mut devices: Vec<u32> = plan.stages.iter().flat_map(|s| s.devices.clone()).collect();
        devices.sort_unstable();
        devices.dedup(); // a rank's chunks share its devices
        let rank_of = |device: u32| devices.binary_search(&device).expect("a used device") as u32;
        let slots = slots_of(plan, rank_of);
        let t: Vec<u32> = plan
            .stages
            .iter()
            .map(|s| s.shape.tensor_parallel.max(1))
            .collect();
        let actions = stage_actions(plan)?;
        let ranks_of = |groups: Vec<Vec<u32>>| -> Vec<Vec<u32>> {
            groups
                .into_iter()
                .map(|g| g.into_iter().map(rank_of).collect())
                .collect()
        };
        let stages = plan
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let shape = &s.shape;
                let groups = groups_of(&slots[i], t[i] as usize, shape.replica_gpus() as usize);
                StageLayout {
                    layer_start: s.layer_start,
                    layer_end: s.layer_end,
                    replicas: slots[i]
                        .iter()
                        .map(|&me| replica_layout(&slots, &t, i, me))
                        .collect(),
                    actions: actions[i].clone(),
                    tensor_parallel: t[i],
                    shard_level: shape.shard_level,
                    reshard_after_forward: shape.reshard_after_forward,
                    recompute: !shape.recompute.is_none() || plan.recomputes_every_stage(),
                    recompute_per_layer: shape.recompute == crate::cost::shape::Recompute::PerLayer,
                    split_groups: groups.split,
                    replica_groups: groups.replica,
                    context_parallel: shape.context_parallel.max(1),
                    context_groups: groups.context,
                    expert_parallel: shape.expert_parallel.max(1),
                    expert_groups: ranks_of(s.expert_groups()),
                    expert_replica_groups: ranks_of(s.expert_replica_groups()),
                    offload_optimizer: !shape.offload.is_none(),
                }
            })
            .collect();
        Ok(RunLayout {
            devices,
            micro_batch_size: plan.micro_batch_size,
            micro_batches: plan.micro_batches,
            stages,
        })
    }

    /// Processes the run uses: one per used device.
    pub fn world_size(&self) -> usize {
        self.devices.len()
    }

    /// Samples of one mini-batch: M micro-batches of `micro_batch_size`.
    pub fn global_batch_size(&self) -> u32 {
        self.micro_batch_size * self.micro_batches
    }

    /// `(stage, replica index)` of `rank` (its first stage where its
    /// plan's ranks hold several), None when the run has no such rank.
    pub fn position(&self, rank: u32) -> Option<(usize, usize)> {
        self.positions(rank).first().copied()
    }

    /// `(stage, replica index)` of each stage `rank` runs, in stage order:
    /// one, or a chunked plan's chunks of its rank.
    pub fn positions(&self, rank: u32) -> Vec<(usize, usize)> {
        self.stages
            .iter()
            .enumerate()
            .filter_map(|(s, stage)| {
                let j = stage.replicas.iter().position(|r| r.rank == rank)?;
                Some((s, j))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::cost::WarmupPolicy;
    use crate::formats::format::FileObject;
    use crate::plan::{PlanInputs, PlanOptions, ScheduleChoice, Stage};
    use crate::schedule::ScheduleKind;

    fn plan(mbs: u32, m: u32, stages: &[(usize, usize, &[u32])]) -> Plan {
        let count = stages.len() as u32;
        Plan::new(
            PlanInputs {
                model: "tiny".into(),
                profile_sha256: String::new(),
                profile_path: None,
                topology: Topology::from_spec("1x8-pcie").unwrap(),
                global_batch_size: mbs * m,
                options: PlanOptions {
                    min_micro_batch_size: 1,
                    search_space: None,
                    hints: Default::default(),
                },
            },
            mbs,
            m,
            ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A),
            stages
                .iter()
                .enumerate()
                .map(|(i, &(a, b, d))| Stage {
                    layer_start: a,
                    layer_end: b,
                    devices: d.to_vec(),
                    warmup_micro_batches: (count - i as u32).min(m),
                    placement: None,
                    slices: None,
                    ..Default::default()
                })
                .collect(),
        )
    }

    #[test]
    fn a_split_stage_lays_out_its_groups_and_each_shard_its_peers() {
        use crate::cost::shape::Recompute;
        // Stage 0 on device 0 feeds stage 1: two replicas of two shards.
        let mut p = plan(4, 2, &[(0, 2, &[0]), (2, 5, &[1, 2, 3, 4])]);
        p.stages[1].shape.tensor_parallel = 2;
        p.stages[1].shape.shard_level = 1;
        p.stages[0].shape.recompute = Recompute::Full;
        let lay = RunLayout::of(&p).unwrap();
        let (first, second) = (&lay.stages[0], &lay.stages[1]);
        assert_eq!(
            (first.tensor_parallel, first.recompute, first.shard_level),
            (1, true, 0)
        );
        assert_eq!(
            (second.tensor_parallel, second.recompute, second.shard_level),
            (2, false, 1)
        );
        assert_eq!(second.split_groups, vec![vec![1, 2], vec![3, 4]]);
        assert_eq!(second.replica_groups, vec![vec![1, 3], vec![2, 4]]);
        assert_eq!(first.split_groups, vec![vec![0]]);
        let at = |r: &ReplicaLayout| (r.replica, r.shard, r.start, r.end);
        let places: Vec<_> = second.replicas.iter().map(at).collect();
        assert_eq!(
            places,
            [(0, 0, 0, 2), (0, 1, 0, 2), (1, 0, 2, 4), (1, 1, 2, 4)]
        );
        let peer = |rank, start, end| Peer { rank, start, end };
        // Every shard gets the input; one shard of each replica sends the gradient back.
        let sender = &first.replicas[0];
        assert_eq!(
            sender.sends_to,
            vec![peer(1, 0, 2), peer(2, 0, 2), peer(3, 2, 4), peer(4, 2, 4)]
        );
        assert_eq!(sender.gradients_from, vec![peer(1, 0, 2), peer(3, 2, 4)]);
        assert_eq!(second.replicas[1].receives_from, vec![peer(0, 0, 2)]);
        assert!(second.replicas[1].gradients_to.is_empty());
        assert_eq!(second.replicas[2].gradients_to, vec![peer(0, 2, 4)]);
    }

    #[test]
    fn expert_groups_are_consecutive_replicas_and_their_experts_reduce_across_them() {
        // One stage of 4 replicas, experts over e = 2: groups {0, 1} and
        // {2, 3} exchange tokens; ranks 0 and 2 hold the same experts.
        let mut p = plan(4, 1, &[(0, 5, &[0, 1, 2, 3])]);
        p.stages[0].shape.expert_parallel = 2;
        p.stages[0].shape.offload = crate::cost::shape::Offload::Optimizer;
        let stage = &RunLayout::of(&p).unwrap().stages[0];
        assert_eq!(stage.expert_parallel, 2);
        assert_eq!(stage.expert_groups, vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(stage.expert_replica_groups, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(stage.replica_groups, vec![vec![0, 1, 2, 3]]);
        assert!(stage.offload_optimizer);
        // Not spread: each rank alone exchanges nothing, and its experts
        // reduce over its replica group.
        p.stages[0].shape.expert_parallel = 1;
        let stage = &RunLayout::of(&p).unwrap().stages[0];
        assert_eq!(
            stage.expert_groups,
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        assert_eq!(stage.expert_replica_groups, stage.replica_groups);
    }

    #[test]
    fn context_ranks_pair_across_stages_and_reduce_with_the_replicas() {
        // Stage 0 cuts its sequence over ranks 0 and 1; stage 1 splits over
        // t = 2 and cuts over c = 2: context rank 0 is ranks 2, 3, context
        // rank 1 ranks 4, 5.
        let mut p = plan(2, 2, &[(0, 2, &[0, 1]), (2, 5, &[2, 3, 4, 5])]);
        p.stages[0].shape.context_parallel = 2;
        (
            p.stages[1].shape.tensor_parallel,
            p.stages[1].shape.context_parallel,
        ) = (2, 2);
        let lay = RunLayout::of(&p).unwrap();
        let (first, second) = (&lay.stages[0], &lay.stages[1]);
        assert_eq!((first.context_parallel, second.context_parallel), (2, 2));
        assert_eq!(first.context_groups, vec![vec![0, 1]]);
        assert_eq!(second.context_groups, vec![vec![2, 4], vec![3, 5]]);
        assert_eq!(second.split_groups, vec![vec![2, 3], vec![4, 5]]);
        // Gradients are summed over the context ranks too.
        assert_eq!(first.replica_groups, vec![vec![0, 1]]);
        assert_eq!(second.replica_groups, vec![vec![2, 4], vec![3, 5]]);
        let at = |r: &ReplicaLayout| (r.replica, r.shard, r.context, r.start, r.end);
        let places: Vec<_> = second.replicas.iter().map(at).collect();
        assert_eq!(
            places,
            [
                (0, 0, 0, 0, 2),
                (0, 1, 0, 0, 2),
                (0, 0, 1, 0, 2),
                (0, 1, 1, 0, 2)
            ]
        );
        let peer = |rank, start, end| Peer { rank, start, end };
        // Each context rank's tokens go to both shards of the same context rank.
        assert_eq!(
            first.replicas[0].sends_to,
            vec![peer(2, 0, 2), peer(3, 0, 2)]
        );
        assert_eq!(
            first.replicas[1].sends_to,
            vec![peer(4, 0, 2), peer(5, 0, 2)]
        );
        assert_eq!(first.replicas[1].gradients_from, vec![peer(4, 0, 2)]);
        assert_eq!(second.replicas[3].receives_from, vec![peer(1, 0, 2)]);
        assert_eq!(second.replicas[2].gradients_to, vec![peer(1, 0, 2)]);
        // Neighbours that cut their sequences differently are refused.
        p.stages[0].shape.context_parallel = 1;
        let e = RunLayout::of(&p).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[1].context_parallel"));
        assert_eq!(e.kind, crate::error::ErrorKind::Incompatible);
        assert!(
            e.message.contains("stage 0 cuts its sequence 1 ways"),
            "{}",
            e.message
        );
    }

    #[test]
    fn every_shard_of_a_split_sender_gets_its_outputs_gradient() {
        let mut p = plan(2, 2, &[(0, 2, &[0, 1]), (2, 5, &[2])]);
        p.stages[0].shape.tensor_parallel = 2;
        let lay = RunLayout::of(&p).unwrap();
        let peer = |rank, start, end| Peer { rank, start, end };
        let (shard0, shard1) = (&lay.stages[0].replicas[0], &lay.stages[0].replicas[1]);
        assert_eq!(
            (shard0.sends_to.clone(), shard1.sends_to.clone()),
            (vec![peer(2, 0, 2)], vec![])
        );
        assert_eq!(shard1.gradients_from, vec![peer(2, 0, 2)]);
        let receiver = &lay.stages[1].replicas[0];
        assert_eq!(receiver.receives_from, vec![peer(0, 0, 2)]);
        assert_eq!(receiver.gradients_to, vec![peer(0, 0, 2), peer(1, 0, 2)]);
        assert_eq!(lay.stages[1].replica_groups, vec![vec![2]]);
    }

    #[test]
    fn an_asynchronous_plan_re_computes_but_neither_splits_nor_shards() {
        let mut p = plan(4, 2, &[(0, 2, &[0, 1]), (2, 5, &[2, 3])]);
        p.schedule.kind = ScheduleKind::XPipe;
        p.stages[0].warmup_micro_batches = 2;
        p.stages[1].warmup_micro_batches = 1;
        assert!(RunLayout::of(&p).is_ok(), "{:?}", RunLayout::of(&p));
        p.stages[0].shape.recompute = crate::cost::shape::Recompute::Full;
        let lay = RunLayout::of(&p).unwrap();
        assert!(lay.stages[0].recompute && !lay.stages[1].recompute);
        p.stages[1].shape.shard_level = 1;
        let e = RunLayout::of(&p).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[1].shard_level"));
    }

    #[test]
    fn two_to_three_replicas_send_the_samples_they_share() {
        // Micro-batch 5: stage 0 slices 0-3 and 3-5, stage 1 slices 0-2, 2-4, 4-5.
        let lay = RunLayout::of(&plan(5, 2, &[(0, 2, &[6, 1]), (2, 5, &[2, 3, 4])])).unwrap();
        assert_eq!(lay.devices, vec![1, 2, 3, 4, 6]);
        let first = &lay.stages[0].replicas;
        assert_eq!((first[0].rank, first[0].start, first[0].end), (4, 0, 3));
        let peer = |rank, start, end| Peer { rank, start, end };
        assert_eq!(first[0].sends_to, vec![peer(1, 0, 2), peer(2, 2, 3)]);
        assert_eq!(first[1].sends_to, vec![peer(2, 3, 4), peer(3, 4, 5)]);
        let second = &lay.stages[1].replicas;
        assert_eq!(second[1].receives_from, vec![peer(4, 2, 3), peer(0, 3, 4)]);
        assert!(first[0].receives_from.is_empty() && second[2].sends_to.is_empty());
        let actions: Vec<String> = lay.stages[1]
            .actions
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(actions, ["F0", "B0", "F1", "B1", "AR", "OPT"]);
        assert_eq!(
            (lay.position(4), lay.position(0), lay.position(5)),
            (Some((0, 0)), Some((0, 1)), None)
        );
        assert_eq!((lay.world_size(), lay.global_batch_size()), (5, 10));
    }

    #[test]
    fn a_stages_own_slices_split_its_micro_batches() {
        let mut p = plan(6, 2, &[(0, 2, &[0, 1]), (2, 5, &[2])]);
        p.stages[0].slices = Some(vec![4, 2]);
        let lay = RunLayout::of(&p).unwrap();
        let first = &lay.stages[0].replicas;
        assert_eq!(
            [
                (first[0].start, first[0].end),
                (first[1].start, first[1].end)
            ],
            [(0, 4), (4, 6)]
        );
        let peer = |rank, start, end| Peer { rank, start, end };
        assert_eq!(
            lay.stages[1].replicas[0].receives_from,
            vec![peer(0, 0, 4), peer(1, 4, 6)]
        );
        p.stages[0].slices = Some(vec![4, 1]);
        let e = RunLayout::of(&p).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[0].slices"));
        assert!(e.message.contains("adds up to 5"), "{}", e.message);
    }

    #[test]
    fn a_plan_that_cannot_run_is_refused() {
        let overlapping = plan(4, 2, &[(0, 2, &[0]), (1, 3, &[1])]);
        let e = RunLayout::of(&overlapping).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[1].layer_start"));
        let reused = plan(4, 2, &[(0, 2, &[0]), (2, 3, &[0])]);
        assert!(RunLayout::of(&reused)
            .unwrap_err()
            .to_string()
            .contains("used by two stages"));
        let text = plan(4, 2, &[(0, 2, &[0]), (2, 3, &[1])]).to_json();
        assert!(RunLayout::of(&Plan::from_json(&text).unwrap()).is_ok());
    }
}
