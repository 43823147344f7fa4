//! Whale's annotations as constraints on the search (whale.txt, 3.1):
//! `num_task_graph` (the stage count), `num_micro_batch`, `replicate(n)`
//! and `split(n)` on a range of layers, and a stage boundary the user
//! wants. The search stays exact under them: the DP and the walk build
//! only stages and plans the hints admit (`Context::starts`, the split
//! degrees, the stage count), so the walk's proof covers the constrained
//! space; every other candidate (baselines, uniform layouts, refinement's
//! moves) is kept only where the hints admit it (`admits_layout`).
//!
//! A hinted range is one stage: a stage starts at its first layer and
//! another at the layer after its last, and no stage boundary falls
//! inside it. `docs/hints.md` says what each hint means and how `dapple
//! plan` spells it.

use serde::{Deserialize, Serialize};

use crate::cost::shape::StageShape;
use crate::error::{Error, ErrorKind, Result};

/// The hints of one search; the default constrains nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hints {
    /// Exactly this many pipeline stages (Whale's `num_task_graph`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<u32>,
    /// Exactly this many micro-batches per iteration (`num_micro_batch`):
    /// the micro-batch size is the global batch over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<u32>,
    /// Layers a stage must start at (a boundary in front of each), between
    /// 1 and the layer count - 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<usize>,
    /// Layer ranges that each form one stage of the given shape.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<RangeHint>,
}

/// Layers `layer_start..layer_end` (end excluded, as a plan's stages) form
/// one stage: Whale's `replicate(n)` (unsplit, `replicas` copies where
/// given) or `split(n)` (split `tensor_parallel` ways, any replicas).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RangeHint {
    pub layer_start: usize,
    pub layer_end: usize,
    /// The stage's split degree (1 for `replicate`).
    pub tensor_parallel: u32,
    /// The stage's replicas, where the hint fixes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
}

/// No hints, for contexts built without options.
pub(crate) static NO_HINTS: Hints = Hints {
    stages: None,
    micro_batches: None,
    cuts: Vec::new(),
    ranges: Vec::new(),
};

impl Hints {
    pub fn is_empty(&self) -> bool {
        *self == NO_HINTS
    }

    /// Whether the hints fix where stages' layers begin (a cut, a range): a
    /// chunked kind, which cuts each rank's layers again into chunks, would
    /// not keep them.
    pub fn fix_boundaries(&self) -> bool {
        !self.cuts.is_empty() || !self.ranges.is_empty()
    }

    /// Whether the hints shape the layout (its stage count, a boundary).
    pub fn shape_layout(&self) -> bool {
        self.stages.is_some() || self.fix_boundaries()
    }

    /// The hints, spelled as `dapple plan`'s options, for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.stages {
            parts.push(format!("--stages {s}"));
        }
        if let Some(m) = self.micro_batches {
            parts.push(format!("--micro-batches {m}"));
        }
        for c in &self.cuts {
            parts.push(format!("--pin-cut {c}"));
        }
        for r in &self.ranges {
            parts.push(r.describe());
        }
        parts.join(" ")
    }

    /// The search's error where it found no plan, with the hints named: no
    /// layout of the space keeps them (incompatible), or none that does
    /// fits (infeasible).
    pub fn named_in(&self, e: Error) -> Error {
        let message = match e.kind {
            _ if self.is_empty() => return e,
            ErrorKind::Incompatible => {
                format!("no plan keeps the hints {}: {}", self.describe(), e.message)
            }
            ErrorKind::Infeasible => {
                format!("{} (under the hints {})", e.message, self.describe())
            }
            _ => return e,
        };
        Error { message, ..e }
    }

    /// Checks the hints against a model of `layers` layers on `gpus` GPUs
    /// at `global_batch_size`: each bad one is named in the error.
    pub fn validate(&self, layers: usize, gpus: u32, global_batch_size: u32) -> Result<()> {
        if let Some(s) = self.stages {
            if s == 0 || s as usize > layers || s > gpus {
                return Err(Error::field(
                    "hints.stages",
                    format!("--stages {s}: must be between 1 and {} (the profile has {layers} layers, the topology {gpus} GPUs)", layers.min(gpus as usize)),
                ));
            }
        }
        if let Some(m) = self.micro_batches {
            if m == 0 || !global_batch_size.is_multiple_of(m) {
                return Err(Error::field(
                    "hints.micro_batches",
                    format!("--micro-batches {m}: must divide the global batch size {global_batch_size}"),
                ));
            }
        }
        for &c in &self.cuts {
            if c == 0 || c >= layers {
                return Err(Error::field(
                    "hints.cuts",
                    match layers {
                        0 | 1 => format!("--pin-cut {c}: a profile of one layer has no boundary to pin"),
                        _ => format!("--pin-cut {c}: a boundary must be in front of one of layers 1 to {} (the profile has {layers} layers)", layers - 1),
                    },
                ));
            }
        }
        for (k, r) in self.ranges.iter().enumerate() {
            let bad = |why: String| {
                Err(Error::field(
                    format!("hints.ranges[{k}]"),
                    format!("{}: {why}", r.describe()),
                ))
            };
            if r.layer_start >= r.layer_end || r.layer_end > layers {
                return bad(format!(
                    "layers must be a non-empty range within 0..{layers}"
                ));
            }
            if r.tensor_parallel == 0 || r.replicas == Some(0) {
                return bad("degrees must be at least 1".into());
            }
            if u64::from(r.tensor_parallel) * u64::from(r.replicas.unwrap_or(1)) > u64::from(gpus) {
                return bad(format!("needs more GPUs than the topology's {gpus}"));
            }
            if let Some(c) = self
                .cuts
                .iter()
                .find(|&&c| r.layer_start < c && c < r.layer_end)
            {
                return bad(format!("--pin-cut {c} falls inside it"));
            }
            if let Some(o) = self.ranges[..k]
                .iter()
                .find(|o| o.layer_start < r.layer_end && r.layer_start < o.layer_end)
            {
                return bad(format!("overlaps {}", o.describe()));
            }
        }
        Ok(())
    }

    /// The first layer a stage ending at layer `j` (excluded) may start at,
    /// or None where no stage may end there (inside a hinted range).
    pub(crate) fn lowest_start(&self, j: usize) -> Option<usize> {
        if self
            .ranges
            .iter()
            .any(|r| r.layer_start < j && j < r.layer_end)
        {
            return None;
        }
        let boundaries = self.cuts.iter().copied().chain(
            self.ranges
                .iter()
                .flat_map(|r| [r.layer_start, r.layer_end]),
        );
        Some(boundaries.filter(|&c| c < j).max().unwrap_or(0))
    }

    /// Whether a stage ending at layer `j` may run split `t` ways on `gpus`
    /// GPUs: a hinted range ending there fixes its degree and replicas.
    pub(crate) fn admits_degree(&self, j: usize, t: u32, gpus: u32) -> bool {
        self.ranges.iter().filter(|r| r.layer_end == j).all(|r| {
            r.tensor_parallel == t
                && r.replicas
                    .is_none_or(|n| u64::from(n) * u64::from(t) == u64::from(gpus))
        })
    }

    /// Whether a hinted range asks for a stage of `gpus` GPUs split `t` ways.
    pub(crate) fn fixes_gpus(&self, gpus: u32, t: u32) -> bool {
        self.ranges.iter().any(|r| {
            r.tensor_parallel == t
                && r.replicas
                    .is_some_and(|n| u64::from(n) * u64::from(t) == u64::from(gpus))
        })
    }

    /// Whether a suffix of `stages` stages whose first starts at layer `i`,
    /// with `free` GPUs left in front of it, can still become a plan of the
    /// hinted stage count: all of them once the suffix starts at layer 0,
    /// fewer before, and a layer and a GPU left in front for each stage
    /// still missing.
    pub(crate) fn admits_stage_count(&self, stages: u32, i: usize, free: u32) -> bool {
        self.stages.is_none_or(|n| {
            stages <= n
                && if i == 0 {
                    stages == n
                } else {
                    // At least one stage is still missing in front.
                    stages < n && (n - stages) as usize <= i && n - stages <= free
                }
        })
    }

    /// Whether a plan's stages, each (layer_start, layer_end, GPUs, shape)
    /// front to back, and its micro-batch count satisfy every hint.
    pub fn admits_layout(
        &self,
        stages: &[(usize, usize, u32, StageShape)],
        micro_batches: u32,
    ) -> bool {
        let count = stages.len() as u32;
        self.micro_batches.is_none_or(|m| m == micro_batches)
            && self.stages.is_none_or(|n| n == count)
            && stages.iter().all(|&(start, end, gpus, shape)| {
                self.lowest_start(end).is_some_and(|lowest| lowest <= start)
                    && self.admits_degree(end, shape.tensor_parallel, gpus)
            })
    }
}

impl RangeHint {
    fn describe(&self) -> String {
        let layers = format!("{}..{}", self.layer_start, self.layer_end);
        match (self.tensor_parallel, self.replicas) {
            (1, None) => format!("--replicate {layers}"),
            (1, Some(n)) => format!("--replicate {layers}:{n}"),
            (t, None) => format!("--split {layers}:{t}"),
            (t, Some(n)) => format!("--split {layers}:{t} with {n} replicas"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(
        layer_start: usize,
        layer_end: usize,
        tensor_parallel: u32,
        replicas: Option<u32>,
    ) -> RangeHint {
        RangeHint {
            layer_start,
            layer_end,
            tensor_parallel,
            replicas,
        }
    }

    #[test]
    fn stage_starts_respect_cuts_and_ranges() {
        // 10 layers; a boundary in front of layer 3, layers 5..8 one stage.
        let hints = Hints {
            cuts: vec![3],
            ranges: vec![range(5, 8, 2, None)],
            ..Hints::default()
        };
        let starts: Vec<Option<usize>> = (1..=10).map(|j| hints.lowest_start(j)).collect();
        assert_eq!(
            starts,
            [
                Some(0),
                Some(0),
                Some(0),
                Some(3),
                Some(3),
                None,
                None,
                Some(5),
                Some(8),
                Some(8)
            ]
        );
        assert!(
            hints.admits_degree(8, 2, 6)
                && !hints.admits_degree(8, 1, 6)
                && hints.admits_degree(7, 1, 1)
        );
        let pinned = Hints {
            ranges: vec![range(0, 4, 1, Some(2))],
            ..Hints::default()
        };
        assert!(pinned.admits_degree(4, 1, 2) && !pinned.admits_degree(4, 1, 4));
    }

    #[test]
    fn the_stage_count_is_reached_exactly() {
        let hints = Hints {
            stages: Some(3),
            ..Hints::default()
        };
        // Stages so far, first layer of the first of them.
        // Stages so far, first layer of the first of them, GPUs left.
        assert!(hints.admits_stage_count(1, 5, 2) && hints.admits_stage_count(1, 2, 4));
        assert!(
            !hints.admits_stage_count(1, 1, 4),
            "two stages cannot fit in one layer"
        );
        assert!(!hints.admits_stage_count(1, 5, 1), "nor on one GPU");
        assert!(!hints.admits_stage_count(2, 0, 4) && hints.admits_stage_count(3, 0, 0));
        assert!(!hints.admits_stage_count(4, 7, 4) && !hints.admits_stage_count(3, 7, 4));
        assert!(Hints::default().admits_stage_count(9, 0, 0));
    }

    #[test]
    fn whole_layouts_are_checked_against_every_hint() {
        let split = |t: u32| StageShape {
            tensor_parallel: t,
            ..StageShape::PLAIN
        };
        let hints = Hints {
            stages: Some(2),
            cuts: vec![4],
            ranges: vec![range(4, 6, 2, None)],
            ..Hints::default()
        };
        assert!(hints.admits_layout(&[(0, 4, 2, split(1)), (4, 6, 4, split(2))], 8));
        assert!(
            !hints.admits_layout(&[(0, 4, 2, split(1)), (4, 6, 4, split(1))], 8),
            "the range's degree"
        );
        assert!(
            !hints.admits_layout(&[(0, 3, 2, split(1)), (3, 6, 4, split(2))], 8),
            "the cut"
        );
        assert!(
            !hints.admits_layout(
                &[
                    (0, 2, 1, split(1)),
                    (2, 4, 1, split(1)),
                    (4, 6, 4, split(2))
                ],
                8
            ),
            "the count"
        );
        let counted = Hints {
            micro_batches: Some(4),
            ..Hints::default()
        };
        assert!(
            counted.admits_layout(&[(0, 6, 2, split(1))], 4)
                && !counted.admits_layout(&[(0, 6, 2, split(1))], 8)
        );
    }

    #[test]
    fn bad_hints_name_themselves() {
        let message = |h: Hints| h.validate(8, 4, 32).unwrap_err().to_string();
        assert!(message(Hints {
            stages: Some(5),
            ..Hints::default()
        })
        .contains("--stages 5: must be between 1 and 4"));
        assert!(message(Hints {
            micro_batches: Some(5),
            ..Hints::default()
        })
        .contains("--micro-batches 5: must divide"));
        assert!(message(Hints {
            cuts: vec![8],
            ..Hints::default()
        })
        .contains("--pin-cut 8"));
        let inside = Hints {
            cuts: vec![3],
            ranges: vec![range(2, 5, 1, None)],
            ..Hints::default()
        };
        assert!(message(inside).contains("--replicate 2..5: --pin-cut 3 falls inside it"));
        let overlap = Hints {
            ranges: vec![range(0, 3, 1, None), range(2, 5, 2, None)],
            ..Hints::default()
        };
        assert!(message(overlap).contains("--split 2..5:2: overlaps --replicate 0..3"));
        assert!(message(Hints {
            ranges: vec![range(0, 2, 4, Some(2))],
            ..Hints::default()
        })
        .contains("more GPUs"));
        assert!(Hints {
            stages: Some(4),
            cuts: vec![7],
            ..Hints::default()
        }
        .validate(8, 4, 32)
        .is_ok());
    }
}
