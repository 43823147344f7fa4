//! What each process of a run does, from a plan: the runtime
//! (`planner/runtime/`) executes this and decides nothing of its own.
//!
//! One process (rank) per device the plan uses; rank r runs on the r-th
//! used device id in ascending order and holds one replica of one stage.
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
use crate::schedule::Action;

/// Samples `[start, end)` of a micro-batch that one rank sends to, or
/// receives from, another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub rank: u32,
    pub start: u32,
    pub end: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLayout {
    pub rank: u32,
    /// Samples `[start, end)` of every micro-batch this replica computes.
    pub start: u32,
    pub end: u32,
    /// Ranks of the previous stage this replica's input comes from, in order.
    pub receives_from: Vec<Peer>,
    /// Ranks of the next stage its output goes to, in order.
    pub sends_to: Vec<Peer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageLayout {
    pub layer_start: usize,
    pub layer_end: usize,
    /// By replica index.
    pub replicas: Vec<ReplicaLayout>,
    /// The stage's actions: forwards and backwards (written `F3`, `B2`),
    /// then the AllReduce and the optimizer step (`AR`, `OPT`).
    pub actions: Vec<Action>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLayout {
    /// Used device ids, ascending: rank r runs on `devices[r]`.
    pub devices: Vec<u32>,
    pub micro_batch_size: u32,
    pub micro_batches: u32,
    pub stages: Vec<StageLayout>,
}

/// The runtime runs every stage plain: a split, sharded or re-computed
/// stage is refused by name rather than run as a plain one.
fn check_plain_stages(plan: &Plan) -> Result<()> {
    for (i, s) in plan.stages.iter().enumerate() {
        if s.shape().is_plain() {
            continue;
        }
        let (field, value) = if s.tensor_parallel > 1 {
            ("tensor_parallel", s.tensor_parallel.to_string())
        } else if s.shard_optimizer {
            ("shard_optimizer", "true".to_string())
        } else {
            ("recompute", s.recompute.name().to_string())
        };
        let mut e = Error::incompatible(format!(
            "value {value}: dapple run runs plain stages only so far (no split, ZeRO-1 or per-stage \
             re-computation; `--recompute` re-computes every stage); cost such a plan with dapple estimate"
        ));
        e.field = Some(format!("stages[{i}].{field}"));
        return Err(e);
    }
    Ok(())
}

impl RunLayout {
    /// The layout of a plan, after checking that its stages can run
    /// (`plan::check_layout`; the layer count is checked against the model).
    pub fn of(plan: &Plan) -> Result<RunLayout> {
        check_layout(plan, None)?;
        check_plain_stages(plan)?;
        let mut devices: Vec<u32> = plan.stages.iter().flat_map(|s| s.devices.clone()).collect();
        devices.sort_unstable();
        let rank_of = |device: u32| devices.binary_search(&device).expect("a used device") as u32;
        let mbs = plan.micro_batch_size;
        let ranges: Vec<Vec<(u32, u32)>> = plan
            .stages
            .iter()
            .map(|s| match &s.slices {
                Some(sizes) => ranges_of(sizes),
                None => slice_ranges(mbs, s.devices.len() as u32),
            })
            .collect();
        // The samples `(start, end)` shares with each replica of stage `other`.
        let peers = |other: usize, (start, end): (u32, u32)| -> Vec<Peer> {
            plan.stages[other]
                .devices
                .iter()
                .zip(&ranges[other])
                .filter_map(|(&d, &(a, b))| {
                    let (lo, hi) = (a.max(start), b.min(end));
                    (lo < hi).then(|| Peer {
                        rank: rank_of(d),
                        start: lo,
                        end: hi,
                    })
                })
                .collect()
        };
        // One mini-batch: an asynchronous run's lists come from `plan_schedule_over`.
        let schedule = plan_schedule_over(plan, None, 1)?;
        let last = plan.stages.len() - 1;
        let stages = plan
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| StageLayout {
                layer_start: s.layer_start,
                layer_end: s.layer_end,
                replicas: s
                    .devices
                    .iter()
                    .zip(&ranges[i])
                    .map(|(&d, &range)| ReplicaLayout {
                        rank: rank_of(d),
                        start: range.0,
                        end: range.1,
                        receives_from: if i > 0 { peers(i - 1, range) } else { vec![] },
                        sends_to: if i < last {
                            peers(i + 1, range)
                        } else {
                            vec![]
                        },
                    })
                    .collect(),
                actions: schedule.stages[i].actions.clone(),
            })
            .collect();
        Ok(RunLayout {
            devices,
            micro_batch_size: mbs,
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

    /// `(stage, replica index)` of `rank`, None when the run has no such rank.
    pub fn position(&self, rank: u32) -> Option<(usize, usize)> {
        self.stages.iter().enumerate().find_map(|(s, stage)| {
            let j = stage.replicas.iter().position(|r| r.rank == rank)?;
            Some((s, j))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::WarmupPolicy;
    use crate::format::FileObject;
    use crate::plan::{PlanInputs, PlanOptions, ScheduleChoice, Stage};
    use crate::schedule::ScheduleKind;
    use crate::topology::Topology;

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
                },
            },
            mbs,
            m,
            ScheduleChoice {
                kind: ScheduleKind::EarlyBackward1F1B,
                warmup_policy: WarmupPolicy::A,
            },
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
    fn a_shaped_stage_is_refused_by_name_not_run_plain() {
        use crate::shape::Recompute;
        let shaped = |stage: &mut Stage| stage.recompute = Recompute::Full;
        let mut p = plan(4, 2, &[(0, 2, &[0, 1]), (2, 5, &[2, 3])]);
        assert!(RunLayout::of(&p).is_ok());
        shaped(&mut p.stages[1]);
        let e = RunLayout::of(&p).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[1].recompute"));
        assert_eq!(e.kind, crate::ErrorKind::Incompatible);
        p.stages[1].recompute = Recompute::None;
        p.stages[0].tensor_parallel = 2;
        let e = RunLayout::of(&p).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("stages[0].tensor_parallel"));
        assert!(
            e.message
                .starts_with("value 2: dapple run runs plain stages only"),
            "{e}"
        );
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
