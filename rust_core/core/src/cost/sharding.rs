//! Sharding a stage's state over its replicas: ZeRO's three levels (Rajbhandari
//! et al., arXiv 1910.02054, Fig. 1) as DeepSpeed, Megatron-LM and FSDP run
//! them. What each level keeps on a GPU, and what it moves when, lives here
//! (a stage's shape names its level: `StageShape::sharding`); `cost/shape.rs`
//! sums the bytes (`MemorySums`) and `cost/shaped.rs` prices the moves on
//! the links the replica group spans.
//!
//! Over an iteration of M micro-batches on r replicas, with W the weights'
//! bytes, G the gradients' and O the master weights' and optimizer state's:
//!
//! | level | a GPU keeps | moved per micro-batch | moved per iteration |
//! |---|---|---|---|
//! | 1 (ZeRO-1) | W + G + O/r | - | reduce-scatter G, all-gather W |
//! | 2 (ZeRO-2) | W + G/r + O/r | reduce-scatter G | all-gather W |
//! | 3, re-sharded (FSDP's default) | (W + G + O)/r | all-gather W twice, reduce-scatter G | - |
//! | 3, kept after the forward | W + G/r + O/r | all-gather W, reduce-scatter G | - |
//!
//! At one micro-batch, level 3 re-sharded moves 3 W-sized collectives' worth
//! (the ZeRO paper's 1.5 times data parallelism's 2), the others 2. Level 3
//! keeping its weights holds them whole while micro-batches are in flight,
//! as ZeRO-2 does, and moves more: it never beats level 2 in this model,
//! which is why the search leaves it out; a plan may still ask for it. Level
//! 2 and 3 reduce each micro-batch's gradients as its
//! backward makes them (DeepSpeed's ZeRO-2, FSDP2's default): a GPU holds
//! one layer's whole gradients before reducing them, and a re-sharded level
//! 3 gathers one layer's weights while the one before runs
//! (`gathered_bytes`). Whether a collective hides behind the passes is the
//! plan's `schedule.overlap` (`cost/overlap.rs`), for every level alike: the
//! gathers under `param_gather`, the reduce-scatters under `grad_reduce`.

use serde::Deserialize;

/// A stage's sharding level, as its shape says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardLevel {
    None,
    /// ZeRO-1: master weights and optimizer state.
    Optimizer,
    /// ZeRO-2: the gradients too.
    Gradients,
    /// ZeRO-3, FSDP: the weights too, freed after each forward where
    /// `reshard_after_forward`.
    Weights {
        reshard_after_forward: bool,
    },
}

/// How many gradient reduce-scatters and weight all-gathers (each of a
/// GPU's whole gradients or weights) a level runs, per micro-batch and per
/// iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardTraffic {
    pub gathers_before_forward: u32,
    pub gathers_before_backward: u32,
    pub scatters_after_backward: u32,
    pub iteration_scatters: u32,
    pub iteration_gathers: u32,
}

impl ShardTraffic {
    /// All of one iteration's collectives at `micro_batches`, in units of
    /// one gradient- or weight-sized collective.
    pub fn collectives(&self, micro_batches: u32) -> u32 {
        micro_batches
            * (self.gathers_before_forward
                + self.gathers_before_backward
                + self.scatters_after_backward)
            + self.iteration_scatters
            + self.iteration_gathers
    }
}

impl ShardLevel {
    /// The level a plan's `shard_level` and `reshard_after_forward` name
    /// (a level above 3 reads as 3: `from_fields` refuses it).
    pub fn new(level: u8, reshard_after_forward: bool) -> ShardLevel {
        match level {
            0 => ShardLevel::None,
            1 => ShardLevel::Optimizer,
            2 => ShardLevel::Gradients,
            _ => ShardLevel::Weights {
                reshard_after_forward,
            },
        }
    }

    /// The levels a plan may name, with the one rule between the two
    /// fields: re-sharding is a level-3 choice. Err names what is wrong.
    pub fn from_fields(level: u8, reshard_after_forward: bool) -> Result<ShardLevel, String> {
        match (level, reshard_after_forward) {
            (4.., _) => Err(format!(
                "sharding level {level} is none of 0 (none), 1 (optimizer state), 2 (and gradients) or 3 (and weights)"
            )),
            (0..=2, true) => Err(format!(
                "re-sharding after the forward needs sharding level 3 (the weights), not {level}"
            )),
            _ => Ok(ShardLevel::new(level, reshard_after_forward)),
        }
    }

    pub fn shards_optimizer(&self) -> bool {
        !matches!(self, ShardLevel::None)
    }

    pub fn shards_gradients(&self) -> bool {
        matches!(self, ShardLevel::Gradients | ShardLevel::Weights { .. })
    }

    /// Whether a GPU keeps only its shard of the weights while micro-batches
    /// are in flight (level 3 re-sharded after each forward).
    pub fn shards_weights_in_flight(&self) -> bool {
        matches!(
            self,
            ShardLevel::Weights {
                reshard_after_forward: true
            }
        )
    }

    /// What a GPU holds whole for a moment on top of its shards, from the
    /// most weights and gradients of one layer it holds: a layer's
    /// gradients before their reduce-scatter (levels 2 and 3), and, where
    /// the weights are sharded in flight, the running layer's gathered
    /// weights and the next one's, prefetched (FSDP2's default prefetch).
    pub fn gathered_bytes(&self, layer_weight_bytes: f64, layer_gradient_bytes: f64) -> f64 {
        let gradients = if self.shards_gradients() {
            layer_gradient_bytes
        } else {
            0.0
        };
        let weights = if self.shards_weights_in_flight() {
            2.0 * layer_weight_bytes
        } else {
            0.0
        };
        gradients + weights
    }

    pub fn traffic(&self) -> ShardTraffic {
        match self {
            ShardLevel::None => ShardTraffic::default(),
            ShardLevel::Optimizer => ShardTraffic {
                iteration_scatters: 1,
                iteration_gathers: 1,
                ..ShardTraffic::default()
            },
            ShardLevel::Gradients => ShardTraffic {
                scatters_after_backward: 1,
                iteration_gathers: 1,
                ..ShardTraffic::default()
            },
            ShardLevel::Weights {
                reshard_after_forward,
            } => ShardTraffic {
                gathers_before_forward: 1,
                gathers_before_backward: u32::from(*reshard_after_forward),
                scatters_after_backward: 1,
                ..ShardTraffic::default()
            },
        }
    }
}

/// A plan's `shard_level`, or before version 12 its `shard_optimizer`
/// flag (true: level 1).
pub(crate) fn level_or_flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u8, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum LevelOrFlag {
        Level(u8),
        Flag(bool),
    }
    match LevelOrFlag::deserialize(d)? {
        LevelOrFlag::Level(level) if level > 3 => Err(serde::de::Error::custom(format!(
            "sharding level {level} is none of 0 (none), 1 (optimizer state), 2 (and gradients) or 3 (and weights)"
        ))),
        LevelOrFlag::Level(level) => Ok(level),
        LevelOrFlag::Flag(sharded) => Ok(u8::from(sharded)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(level: u8, reshard_after_forward: bool) -> ShardLevel {
        ShardLevel::from_fields(level, reshard_after_forward).unwrap()
    }

    #[test]
    fn level_three_re_sharded_moves_three_weights_where_the_others_move_two() {
        // One micro-batch: ZeRO-1 and ZeRO-2 a reduce-scatter and an
        // all-gather (data parallelism's AllReduce), ZeRO-3 one more gather.
        assert_eq!(level(1, false).traffic().collectives(1), 2);
        assert_eq!(level(2, false).traffic().collectives(1), 2);
        assert_eq!(level(3, true).traffic().collectives(1), 3);
        assert_eq!(level(3, false).traffic().collectives(1), 2);
        // Eight micro-batches: ZeRO-1 still once; ZeRO-2 scatters each
        // micro-batch's gradients; ZeRO-3 gathers and scatters with each.
        assert_eq!(level(1, false).traffic().collectives(8), 2);
        assert_eq!(level(2, false).traffic().collectives(8), 9);
        assert_eq!(level(3, true).traffic().collectives(8), 24);
        assert_eq!(level(3, false).traffic().collectives(8), 16);
        assert_eq!(level(0, false).traffic().collectives(8), 0);
    }

    #[test]
    fn levels_name_what_they_shard_and_refuse_what_is_not_a_level() {
        assert!(!level(0, false).shards_optimizer());
        assert!(level(1, false).shards_optimizer() && !level(1, false).shards_gradients());
        assert!(level(2, false).shards_gradients() && !level(2, false).shards_weights_in_flight());
        assert!(level(3, true).shards_weights_in_flight());
        assert!(level(3, false).shards_gradients() && !level(3, false).shards_weights_in_flight());
        let e = ShardLevel::from_fields(4, false).unwrap_err();
        assert!(e.contains("sharding level 4"), "{e}");
        let e = ShardLevel::from_fields(2, true).unwrap_err();
        assert!(
            e.contains("needs sharding level 3") && e.contains("not 2"),
            "{e}"
        );
    }

    #[test]
    fn what_a_gpu_gathers_whole_on_top_of_its_shards() {
        // The largest layer: 10 bytes of weights, 5 of gradients.
        assert_eq!(level(1, false).gathered_bytes(10.0, 5.0), 0.0);
        assert_eq!(level(2, false).gathered_bytes(10.0, 5.0), 5.0);
        assert_eq!(level(3, false).gathered_bytes(10.0, 5.0), 5.0);
        assert_eq!(level(3, true).gathered_bytes(10.0, 5.0), 25.0);
    }
}
