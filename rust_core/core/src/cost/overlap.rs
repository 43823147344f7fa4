//! What communication a runtime hides behind a stage's computation
//! (`schedule.overlap` of a plan): the gradient reduction behind the
//! backward, and ZeRO-1's all-gather of the updated weights behind the
//! next forward. Tensor-parallel collectives and the pipeline's transfers
//! are never hidden: no runtime dapple exports to overlaps them by default.
//!
//! Both overlaps work bucket by bucket, as the runtimes issue them: a
//! bucket's reduction starts once the backward has passed all its layers
//! (torch DDP, Megatron-LM's `--overlap-grad-reduce`), and a bucket's
//! gather must end before the forward reaches its first layer
//! (`--overlap-param-gather`, FSDP's prefetch). What is left exposed is
//! what the stage waits for beyond its own passes.

use serde::{Deserialize, Serialize};

use crate::cost::shape::StageShape;

/// PyTorch DDP's default gradient bucket (25 MiB): gradients are reduced,
/// and weights gathered, a bucket at a time.
pub const DP_BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

crate::named_enum! {
    /// Which stages reduce their gradients behind their backward (the
    /// default, DAPPLE's, first).
    pub enum GradReduceOverlap("a gradient reduction overlap") {
        /// A plan of one plain stage (data parallelism, section VI-C of
        /// DAPPLE's paper; torch DDP's buckets); a pipelined, split or
        /// sharded stage reduces after its last backward, as Megatron-LM
        /// without `--overlap-grad-reduce` and DeepSpeed's pipeline engine do.
        DataParallel = "data-parallel",
        /// Every stage, behind its last micro-batch's backward: Megatron-LM's
        /// `--overlap-grad-reduce` (the distributed optimizer's
        /// reduce-scatter as well), FSDP and torchtitan.
        EveryStage = "every-stage",
        /// None: every stage reduces after its last backward.
        None = "none",
    }
}

// named_enum! declares the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for GradReduceOverlap {
    fn default() -> Self {
        GradReduceOverlap::DataParallel
    }
}

/// The communication a plan's runtime overlaps with computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overlap {
    #[serde(default)]
    pub grad_reduce: GradReduceOverlap,
    /// A ZeRO-1 stage gathers its updated weights behind the next
    /// iteration's first forward (Megatron-LM's `--overlap-param-gather`);
    /// false: right after the optimizer's step.
    #[serde(default)]
    pub param_gather: bool,
}

impl Overlap {
    /// Whether a stage of `shape` reduces its gradients behind its backward.
    /// `only_stage`: the stage is the whole model.
    pub fn hides_grad_reduce(&self, only_stage: bool, shape: &StageShape) -> bool {
        match self.grad_reduce {
            GradReduceOverlap::None => false,
            GradReduceOverlap::DataParallel => only_stage && shape.reduces_as_plain(),
            GradReduceOverlap::EveryStage => true,
        }
    }

    /// Whether a stage of `shape` gathers its weights behind the next forward.
    pub fn hides_param_gather(&self, shape: &StageShape) -> bool {
        self.param_gather && shape.shards_optimizer()
    }

    pub fn is_default(&self) -> bool {
        *self == Overlap::default()
    }
}

/// The reduction left exposed after a backward whose layers pass in
/// `layers` order (the backward's: last layer first), each as
/// `(bwd_ms, gradient_bytes)`: gradients are reduced a bucket of at least
/// `DP_BUCKET_BYTES` at a time (the last may be smaller), `reduce_ms(bytes)`
/// each, one after another on the network, each as soon as the backward
/// has passed its layers.
pub fn exposed_behind_backward(
    layers: impl Iterator<Item = (f64, f64)>,
    reduce_ms: impl Fn(f64) -> f64,
) -> f64 {
    let mut clock = 0.0; // the backward's progress
    let mut network_free_at: f64 = 0.0;
    let mut bucket = 0.0;
    let mut flush = |bucket: f64, clock: f64| {
        if bucket > 0.0 {
            network_free_at = network_free_at.max(clock) + reduce_ms(bucket);
        }
    };
    for (bwd_ms, bytes) in layers {
        clock += bwd_ms;
        bucket += bytes;
        if bucket >= DP_BUCKET_BYTES {
            flush(bucket, clock);
            bucket = 0.0;
        }
    }
    flush(bucket, clock);
    (network_free_at - clock).max(0.0)
}

/// The wait a forward whose layers pass in `layers` order, each as
/// `(fwd_ms, weight_bytes)`, sees when its weights are gathered a bucket
/// of at least `DP_BUCKET_BYTES` at a time, `gather_ms(bytes)` each, one
/// after another from its start: a bucket's layers start once their
/// gather has ended.
pub fn exposed_before_forward(
    layers: impl Iterator<Item = (f64, f64)>,
    gather_ms: impl Fn(f64) -> f64,
) -> f64 {
    let (mut gathered_at, mut clock, mut computing) = (0.0, 0.0, 0.0);
    let (mut bucket, mut bucket_fwd_ms) = (0.0, 0.0);
    let mut run = |bucket: f64, fwd_ms: f64, clock: &mut f64| {
        gathered_at += gather_ms(bucket);
        *clock = f64::max(*clock, gathered_at) + fwd_ms;
    };
    for (fwd_ms, bytes) in layers {
        computing += fwd_ms;
        bucket += bytes;
        bucket_fwd_ms += fwd_ms;
        if bucket >= DP_BUCKET_BYTES {
            run(bucket, bucket_fwd_ms, &mut clock);
            (bucket, bucket_fwd_ms) = (0.0, 0.0);
        }
    }
    if bucket > 0.0 {
        run(bucket, bucket_fwd_ms, &mut clock);
    }
    (clock - computing).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::shape::Recompute;

    const MB: f64 = DP_BUCKET_BYTES;

    #[test]
    fn a_reduction_waits_for_its_bucket_and_the_one_before() {
        // Three layers of one bucket each, backward 2 ms each, reductions
        // 3 ms each: they start at 2, 5 and 8 (the network's), end at 11;
        // the backward ends at 6, so 5 ms are exposed.
        let layers = [(2.0, MB), (2.0, MB), (2.0, MB)];
        assert_eq!(exposed_behind_backward(layers.into_iter(), |_| 3.0), 5.0);
        // Reductions faster than the backward: only the last bucket's.
        assert_eq!(exposed_behind_backward(layers.into_iter(), |_| 1.0), 1.0);
        // Small layers share a bucket: two layers of half a bucket are one
        // reduction, after the second.
        let halves = [(2.0, MB / 2.0), (2.0, MB / 2.0)];
        assert_eq!(exposed_behind_backward(halves.into_iter(), |b| b / MB), 1.0);
    }

    #[test]
    fn a_forward_waits_for_each_bucket_it_reaches() {
        // Gathers of 3 ms end at 3, 6 and 9; forwards of 2 ms run 3-5, 6-8
        // and 9-11: 5 ms of waiting over 6 of work.
        let layers = [(2.0, MB), (2.0, MB), (2.0, MB)];
        assert_eq!(exposed_before_forward(layers.into_iter(), |_| 3.0), 5.0);
        // Gathers of 1 ms: only the first bucket's.
        assert_eq!(exposed_before_forward(layers.into_iter(), |_| 1.0), 1.0);
    }

    #[test]
    fn the_runtime_decides_which_stages_hide_their_reduction() {
        let plain = StageShape::PLAIN;
        let split = StageShape {
            tensor_parallel: 2,
            ..plain
        };
        let zero = StageShape {
            shard_level: 1,
            recompute: Recompute::Full,
            ..plain
        };
        let of = |grad_reduce| Overlap {
            grad_reduce,
            param_gather: false,
        };
        let dapple = of(GradReduceOverlap::DataParallel);
        assert!(dapple.hides_grad_reduce(true, &plain));
        assert!(!dapple.hides_grad_reduce(false, &plain));
        assert!(!dapple.hides_grad_reduce(true, &split));
        assert!(!dapple.hides_grad_reduce(true, &zero));
        let every = of(GradReduceOverlap::EveryStage);
        assert!([plain, split, zero]
            .iter()
            .all(|s| every.hides_grad_reduce(false, s)));
        assert!(!of(GradReduceOverlap::None).hides_grad_reduce(true, &plain));
        let gathering = Overlap {
            param_gather: true,
            ..every
        };
        assert!(gathering.hides_param_gather(&zero) && !gathering.hides_param_gather(&plain));
        assert!(Overlap::default() == dapple && dapple.is_default());
    }
}
