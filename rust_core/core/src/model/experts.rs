//! Expert parallelism: a mixture-of-experts layer's routed experts spread
//! over e GPUs of a stage, each holding E / e of them, and the tokens
//! exchanged between those GPUs (all-to-all) to reach their experts and
//! come back.
//!
//! The expert groups are folded onto the stage's data parallelism, as
//! Whale's M6-MoE (`replicate` and `split` on the same GPUs) and
//! Megatron-LM (`--expert-model-parallel-size`) fold them: a stage of r
//! replicas (of t shards each) forms r / e expert groups of e consecutive
//! replicas, and each expert's columns stay split t ways (Megatron's
//! expert tensor parallelism at t); or, at an expert tensor degree et
//! below t (Megatron-LM's `--expert-tensor-parallel-size`), groups of e
//! GPUs every et-th of e et consecutive ones, each expert's columns split
//! et ways. What every shard keeps whole (the attention, the router, the
//! shared experts) stays replicated r ways; the routed experts' weights,
//! gradients and optimizer state are divided by e (by e et / t against a
//! shard's), and their gradients are reduced over the GPUs that hold the
//! same experts. Routing is balanced unless the profile states the
//! router's imbalance (docs/cost-model.md, "Expert parallelism"):
//! balanced, each GPU computes as many tokens' experts as without expert
//! parallelism; imbalanced, the busiest GPU computes and receives that
//! many times the mean's, and the layer waits for it.
//!
//! This module holds the profile's description of a layer's experts and
//! what one GPU holds of them; `cost/all_to_all.rs` prices the exchange
//! on the stage's links.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A layer's routed experts, as a profile records them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertPattern {
    /// Routed experts E: the expert degree must divide them.
    pub count: u32,
    /// Experts each token is routed to (k).
    pub per_token: u32,
    /// Share of the layer's parameter bytes in its routed experts: what
    /// expert parallelism divides (the router, shared experts and the
    /// rest of the layer stay whole).
    pub param_fraction: f64,
    /// Bytes per sample of one all-to-all: the k copies of each token's
    /// hidden state the dispatch sends to their experts. The combine
    /// brings back as many, and the backward moves both again.
    pub all_to_all_bytes_per_sample: f64,
    /// Bytes per sample of the split layer's collective (one of its
    /// `allreduce_calls_per_pass`, each pass) that gathers the hidden
    /// state into the mixture and scatters its output back over the t
    /// shards, as Megatron-LM's allgather dispatcher does without expert
    /// parallelism. Spread experts under sequence parallelism exchange
    /// each shard's own tokens instead (Megatron-LM's all-to-all
    /// dispatcher), so the cost takes this call out there; 0 where shared
    /// experts need the gather anyway (or a profile does not say).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub split_gather_bytes_per_sample: f64,
    /// Share of the layer's compute in its routed experts (of its FLOPs,
    /// as `dapple profile transformer` counts them): what the router's
    /// imbalance lengthens. 0 where a profile does not say.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub compute_fraction: f64,
    /// The busiest GPU's routed tokens over the mean where the experts are
    /// spread (>= 1; 1: routing balanced, as force-balanced benchmarks
    /// run it; a capacity factor C bounds it at C): its experts' compute
    /// and the copies it receives, which every GPU of the layer waits for.
    #[serde(default = "balanced", skip_serializing_if = "is_balanced")]
    pub imbalance: f64,
    /// How the exchange moves a token's copies (absent: one copy an
    /// expert, NCCL's all-to-all).
    #[serde(default, skip_serializing_if = "TokenDispatcher::is_all_to_all")]
    pub dispatcher: TokenDispatcher,
    /// Group-limited routing (absent: a token may reach every expert).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_groups: Option<RoutingGroups>,
}

crate::named_enum! {
    /// How a layer's token exchange carries each token to its k experts.
    #[derive(Default)]
    pub enum TokenDispatcher("a token dispatcher") {
        /// One copy an expert, each sent to the GPU that holds it: NCCL's
        /// all-to-all, as Megatron-LM's `alltoall` dispatcher
        /// (`MoEAlltoAllTokenDispatcher`) and torch's `all_to_all_single`
        /// send them.
        #[default]
        AllToAll = "all-to-all",
        /// Deduplicated: one copy to each GPU that holds some of the
        /// token's experts, and across the network one to each machine that
        /// does, forwarded inside it over its intra-machine link (DeepEP's
        /// normal kernels, deepseek-ai/DeepEP; Megatron-LM's `flex`
        /// dispatcher with the DeepEP backend).
        DeepEp = "deepep",
    }
}

impl TokenDispatcher {
    fn is_all_to_all(&self) -> bool {
        *self == TokenDispatcher::AllToAll
    }
}

/// Group-limited routing (DeepSeek-V3's `n_group` and `topk_group`,
/// Megatron-LM's `--moe-router-num-groups` and `--moe-router-group-topk`):
/// the routed experts fall in `groups` equal groups of consecutive
/// experts, and each token's experts come from `per_token` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingGroups {
    pub groups: u32,
    pub per_token: u32,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn balanced() -> f64 {
    1.0
}

fn is_balanced(x: &f64) -> bool {
    *x == 1.0
}

/// All-to-alls of a mixture-of-experts layer in each pass: the dispatch
/// and the combine in the forward, their gradients in the backward.
pub const ALL_TO_ALLS_PER_PASS: f64 = 2.0;

/// The expert group of the GPU at `position` in a stage's device order,
/// as positions: shard k of e consecutive expert replicas of `et` GPUs
/// each, et the expert tensor degree (the same GPUs as Megatron-LM's
/// expert-parallel group, its expert ranks ordered etp-ep-edp). At et = t
/// an expert replica is a replica of the stage's split layers.
pub fn expert_group(position: usize, et: usize, e: usize) -> impl Iterator<Item = usize> {
    let (t, e) = (et.max(1), e.max(1));
    let (replica, shard) = (position / t, position % t);
    let first = replica / e * e;
    (first..first + e).map(move |q| q * t + shard)
}

/// The positions in a stage's device order of `gpus` that hold the same
/// experts (the same expert shard) as the GPU at `position`: one in every
/// e et consecutive GPUs, where its routed experts' gradients are reduced
/// (the stride `cost/shaped.rs` prices). Where the experts are not spread
/// (e = 1, et = t) these are the GPU's replica group.
pub fn expert_replicas(
    position: usize,
    et: usize,
    e: usize,
    gpus: usize,
) -> impl Iterator<Item = usize> {
    let stride = et.max(1) * e.max(1);
    (position % stride..gpus).step_by(stride)
}

impl ExpertPattern {
    /// Whether the layer's tokens go once to each machine and GPU their
    /// experts sit on (`TokenDispatcher::DeepEp`), not a copy an expert.
    pub fn deduplicates_tokens(&self) -> bool {
        self.dispatcher == TokenDispatcher::DeepEp
    }

    /// The probability that a token's k experts include some of experts
    /// `first..first + len` (consecutive ones, as an expert-parallel GPU or
    /// a machine holds them), routing balanced as the force-balanced runs
    /// route (the profile's `imbalance` aside): the k experts drawn evenly
    /// from those the token may reach, every expert or, under group-limited
    /// routing, those of `per_token` groups drawn evenly. Exact: a sum over
    /// how many of the block's experts the chosen groups hold.
    pub fn reaches(&self, first: u32, len: u32) -> f64 {
        let k = u64::from(self.per_token);
        let RoutingGroups { groups, per_token } = self.routing_groups.unwrap_or(RoutingGroups {
            groups: 1,
            per_token: 1,
        });
        let size = self.count / groups.max(1);
        let reachable = u64::from(per_token) * u64::from(size);
        let block = first..first.saturating_add(len).min(self.count);
        let overlaps: Vec<usize> = (0..groups)
            .map(|g| {
                let (start, end) = (g * size, (g + 1) * size);
                end.min(block.end).saturating_sub(start.max(block.start)) as usize
            })
            .filter(|&o| o > 0)
            .collect();
        let held = block.len();
        let (chosen, apart) = (per_token as usize, groups as usize - overlaps.len());
        // ways[j][x]: the ways to choose j of the overlapping groups that
        // hold x of the block's experts together.
        let mut ways = vec![vec![0.0f64; held + 1]; chosen + 1];
        ways[0][0] = 1.0;
        for &o in &overlaps {
            for j in (0..chosen).rev() {
                for x in (0..=held - o).rev() {
                    let w = ways[j][x];
                    if w > 0.0 {
                        ways[j + 1][x + o] += w;
                    }
                }
            }
        }
        let mut missed = 0.0;
        for (j, row) in ways.iter().enumerate() {
            if chosen - j > apart {
                continue;
            }
            let rest = binomial(apart as u64, (chosen - j) as u64);
            for (x, &w) in row.iter().enumerate().filter(|(_, &w)| w > 0.0) {
                missed += w * rest * none_drawn(reachable, x as u64, k);
            }
        }
        1.0 - missed / binomial(u64::from(groups), u64::from(per_token))
    }

    /// What one GPU holds of the layer's parameters where `spread` GPUs
    /// share what it would hold of the routed experts alone (the expert
    /// degree e; for a shard of a layer split t ways, e et / t): its share
    /// of the routed experts, and everything else whole.
    pub fn param_factor(&self, spread: f64) -> f64 {
        1.0 - self.param_fraction + self.param_fraction / spread
    }

    /// Of the part of a layer's passes that grows with the experts a GPU
    /// holds (`Measurement::experts_held_fwd_ms`: all E against one), what
    /// a GPU no longer spends where `spread` GPUs share what it would hold:
    /// linear in the experts held, E / spread of them, so
    /// (E - E / spread) / (E - 1); negative where it holds more.
    pub fn held_dropped_share(&self, spread: f64) -> f64 {
        let all = f64::from(self.count);
        if all <= 1.0 {
            return 0.0;
        }
        (all - all / spread) / (all - 1.0)
    }

    pub fn validate(&self) -> Result<()> {
        if self.count == 0 {
            return Err(Error::field("count", "value 0 must be >= 1"));
        }
        if let Some(RoutingGroups { groups, per_token }) = self.routing_groups {
            if groups == 0 || !self.count.is_multiple_of(groups) {
                return Err(Error::field(
                    "routing_groups.groups",
                    format!(
                        "value {groups} must divide the {} experts into equal groups",
                        self.count
                    ),
                ));
            }
            let reachable = u64::from(per_token) * u64::from(self.count / groups);
            if per_token == 0 || per_token > groups || reachable < u64::from(self.per_token) {
                return Err(Error::field(
                    "routing_groups.per_token",
                    format!(
                        "value {per_token} must be between 1 and the {groups} groups, and its groups must hold the {} experts a token takes",
                        self.per_token
                    ),
                ));
            }
        }
        if self.per_token == 0 || self.per_token > self.count {
            return Err(Error::field(
                "per_token",
                format!(
                    "value {} must be between 1 and the {} experts",
                    self.per_token, self.count
                ),
            ));
        }
        if !(self.imbalance.is_finite() && self.imbalance >= 1.0) {
            return Err(Error::field(
                "imbalance",
                format!(
                    "value {} must be a finite number >= 1: the busiest GPU's routed tokens over the mean",
                    self.imbalance
                ),
            ));
        }
        for (field, share, of) in [
            ("param_fraction", self.param_fraction, "parameters"),
            ("compute_fraction", self.compute_fraction, "compute"),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return Err(Error::field(
                    field,
                    format!("value {share} must be a share of the layer's {of}, in [0, 1]"),
                ));
            }
        }
        for (field, bytes) in [
            (
                "all_to_all_bytes_per_sample",
                self.all_to_all_bytes_per_sample,
            ),
            (
                "split_gather_bytes_per_sample",
                self.split_gather_bytes_per_sample,
            ),
        ] {
            if !(bytes.is_finite() && bytes >= 0.0) {
                return Err(Error::field(
                    field,
                    format!("value {bytes} must be a finite number >= 0"),
                ));
            }
        }
        Ok(())
    }
}

/// n choose r, as a float (exact up to 2^53).
fn binomial(n: u64, r: u64) -> f64 {
    if r > n {
        return 0.0;
    }
    let r = r.min(n - r);
    (0..r).fold(1.0, |c, i| c * (n - i) as f64 / (i + 1) as f64)
}

/// The probability that `k` experts drawn evenly from `reachable` include
/// none of `held` given ones.
fn none_drawn(reachable: u64, held: u64, k: u64) -> f64 {
    if reachable < held + k {
        return 0.0;
    }
    (0..k).fold(1.0, |p, i| {
        p * (reachable - held - i) as f64 / (reachable - i) as f64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mixtral_like() -> ExpertPattern {
        ExpertPattern {
            count: 8,
            per_token: 2,
            param_fraction: 0.75,
            all_to_all_bytes_per_sample: 1000.0,
            split_gather_bytes_per_sample: 0.0,
            compute_fraction: 0.9,
            imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            routing_groups: None,
        }
    }

    /// The probability by enumerating every way to route a token: each
    /// choice of groups, then each choice of k of their experts, evenly.
    fn reaches_by_enumeration(p: &ExpertPattern, block: std::ops::Range<u32>) -> f64 {
        fn subsets(n: u32, r: u32) -> Vec<Vec<u32>> {
            if r == 0 {
                return vec![vec![]];
            }
            (r - 1..n)
                .flat_map(|last| {
                    subsets(last, r - 1).into_iter().map(move |mut s| {
                        s.push(last);
                        s
                    })
                })
                .collect()
        }
        let g = p.routing_groups.unwrap_or(RoutingGroups {
            groups: 1,
            per_token: 1,
        });
        let size = p.count / g.groups;
        let (mut hit, mut all) = (0.0, 0.0);
        for chosen in subsets(g.groups, g.per_token) {
            let experts: Vec<u32> = chosen
                .iter()
                .flat_map(|c| c * size..(c + 1) * size)
                .collect();
            let picks = subsets(experts.len() as u32, p.per_token);
            for pick in &picks {
                let reached = pick.iter().any(|&i| block.contains(&experts[i as usize]));
                hit += f64::from(u8::from(reached)) / picks.len() as f64;
            }
            all += 1.0;
        }
        hit / all
    }

    #[test]
    fn a_token_reaches_a_block_of_experts_as_enumerating_its_routes_says() {
        // Two of 8 experts, no groups: it misses 2 given ones with
        // probability C(6, 2) / C(8, 2) = 15 / 28.
        let p = mixtral_like();
        assert!((p.reaches(0, 2) - 13.0 / 28.0).abs() < 1e-12);
        assert!((p.reaches(6, 2) - 13.0 / 28.0).abs() < 1e-12);
        assert_eq!(p.reaches(0, 8), 1.0);
        let grouped = |groups, per_token, count, k| ExpertPattern {
            count,
            per_token: k,
            routing_groups: Some(RoutingGroups { groups, per_token }),
            ..mixtral_like()
        };
        let cases = [
            (
                grouped(4, 2, 8, 2),
                vec![(0, 2), (0, 4), (1, 2), (3, 3), (0, 1)],
            ),
            (
                grouped(4, 2, 12, 3),
                vec![(0, 3), (0, 6), (2, 4), (5, 7), (11, 1)],
            ),
            (grouped(2, 1, 8, 2), vec![(0, 4), (2, 4), (0, 8)]),
            (grouped(6, 3, 12, 2), vec![(0, 2), (1, 3), (4, 6)]),
        ];
        for (pattern, blocks) in cases {
            pattern.validate().unwrap();
            for (first, len) in blocks {
                let exact = reaches_by_enumeration(&pattern, first..first + len);
                let got = pattern.reaches(first, len);
                assert!(
                    (got - exact).abs() < 1e-12,
                    "{pattern:?} {first}+{len}: {got} against {exact}"
                );
            }
        }
        // DeepSeek-V3: 8 of 256 experts from 4 of 8 groups. A machine of 32
        // (one group) is reached by half the tokens, less those whose 8
        // experts all fall in the other 3 chosen groups.
        let v3 = grouped(8, 4, 256, 8);
        let missed_in_chosen = (0..8)
            .map(|i| (96.0 - i as f64) / (128.0 - i as f64))
            .product::<f64>();
        assert!((v3.reaches(0, 32) - 0.5 * (1.0 - missed_in_chosen)).abs() < 1e-12);
    }

    #[test]
    fn a_gpu_holds_its_share_of_the_routed_experts_and_the_rest_whole() {
        let p = mixtral_like();
        assert_eq!(p.param_factor(1.0), 1.0);
        assert_eq!(p.param_factor(2.0), 0.25 + 0.375);
        assert_eq!(p.param_factor(8.0), 0.25 + 0.75 / 8.0);
        // A shard of a layer split 2 ways, its experts spread 4 ways
        // whole (et = 1): the 4 GPUs share twice a shard's experts.
        assert_eq!(p.param_factor(4.0 * 1.0 / 2.0), 0.25 + 0.375);
    }

    #[test]
    fn a_group_is_one_shard_of_consecutive_replicas() {
        // 16 GPUs split 2 ways: 8 replicas; e = 4 groups replicas 0-3 and 4-7.
        let group = |p: usize| expert_group(p, 2, 4).collect::<Vec<_>>();
        assert_eq!(group(0), vec![0, 2, 4, 6]);
        assert_eq!(group(5), vec![1, 3, 5, 7]);
        assert_eq!(group(8), vec![8, 10, 12, 14]);
        assert_eq!(expert_group(3, 1, 2).collect::<Vec<_>>(), vec![2, 3]);
        // Expert tensor degree 1 on the same stage: 4 consecutive GPUs.
        assert_eq!(expert_group(5, 1, 4).collect::<Vec<_>>(), vec![4, 5, 6, 7]);
    }

    #[test]
    fn bad_patterns_name_their_field() {
        let bad = [
            (
                ExpertPattern {
                    per_token: 9,
                    ..mixtral_like()
                },
                "per_token: value 9 must be between 1 and the 8 experts",
            ),
            (
                ExpertPattern {
                    count: 0,
                    ..mixtral_like()
                },
                "count: value 0",
            ),
            (
                ExpertPattern {
                    imbalance: 0.5,
                    ..mixtral_like()
                },
                "imbalance: value 0.5 must be a finite number >= 1",
            ),
            (
                ExpertPattern {
                    compute_fraction: 2.0,
                    ..mixtral_like()
                },
                "compute_fraction: value 2",
            ),
            (
                ExpertPattern {
                    param_fraction: 1.5,
                    ..mixtral_like()
                },
                "param_fraction: value 1.5",
            ),
            (
                ExpertPattern {
                    all_to_all_bytes_per_sample: f64::NAN,
                    ..mixtral_like()
                },
                "all_to_all_bytes_per_sample: value NaN",
            ),
            (
                ExpertPattern {
                    routing_groups: Some(RoutingGroups { groups: 3, per_token: 1 }),
                    ..mixtral_like()
                },
                "routing_groups.groups: value 3 must divide the 8 experts",
            ),
            (
                ExpertPattern {
                    routing_groups: Some(RoutingGroups { groups: 4, per_token: 5 }),
                    ..mixtral_like()
                },
                "routing_groups.per_token: value 5 must be between 1 and the 4 groups",
            ),
            (
                ExpertPattern {
                    per_token: 3,
                    routing_groups: Some(RoutingGroups { groups: 8, per_token: 1 }),
                    ..mixtral_like()
                },
                "routing_groups.per_token: value 1 must be between 1 and the 8 groups, and its groups must hold the 3 experts",
            ),
        ];
        for (pattern, message) in bad {
            let e = pattern.validate().unwrap_err().to_string();
            assert!(e.contains(message), "{e}");
        }
        assert!(mixtral_like().validate().is_ok());
    }
}
