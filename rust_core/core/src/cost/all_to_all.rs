//! The token exchange of expert parallelism (`model/experts.rs`), priced on a
//! stage's links: every expert group of the stage runs its exchange at
//! once. Peers on a GPU's own machine are reached over its intra-machine
//! link; the others over the network, which all the machine's GPUs of the
//! stage share. The two parts run side by side and the slower one decides.
//!
//! What crosses each link depends on the layer's dispatcher
//! (`TokenDispatcher`):
//! - **all-to-all** (NCCL's, one copy an expert): each GPU sends 1/e of its
//!   k copies a token to each of its e - 1 peers (and keeps 1/e);
//! - **DeepEP** (deduplicated): a token crosses the network once to each
//!   other machine of its group that holds some of its experts, and is
//!   forwarded inside that machine over its intra-machine link to each GPU
//!   there that does (deepseek-ai/DeepEP's normal kernels: RDMA to the GPU
//!   of the same local rank, then NVLink). How many machines and GPUs a
//!   token reaches is its routing's expectation (`ExpertPattern::reaches`:
//!   balanced, or group-limited as DeepSeek-V3 routes).
//!
//! Each part is priced at the share of its link that the AllReduce
//! reaches there (`LinkShare`): the measured all-to-all is close to it
//! (hardware-measurements.json C7, 8 H100 in one machine: all-to-all
//! 268.5 GB/s bus bandwidth at 64 MiB against the AllReduce's 309.2, 0.87
//! of it; C11a, DeepEP's kernels across machines: 43-58 GB/s a GPU over
//! 50 GB/s links), which this model does not correct for.

use rustc_hash::FxHashMap;
use std::cell::Cell;

use super::{Cluster, Collective, LinkShare};
use crate::model::experts::{expert_group, ExpertPattern, RoutingGroups, TokenDispatcher};

/// One link's price: a call's latency and its time a byte, at the share of
/// the line rate NCCL reaches on it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Link {
    latency_ms: f64,
    ms_per_byte: f64,
    share: LinkShare,
}

impl Link {
    fn ms(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        self.share.ms(
            Collective::AllReduce,
            (self.latency_ms, self.ms_per_byte),
            bytes,
        )
    }
}

/// Where a stage's expert groups sit on its machines, as a deduplicating
/// dispatcher sees them. Positions count a group's GPUs in order (the
/// GPU at position i holds experts i E/e to (i + 1) E/e), and a machine
/// holds a run of consecutive positions (a stage's devices ascend).
#[derive(Debug, Clone, PartialEq, Default)]
struct GroupLayout {
    e: u32,
    /// Each distinct run of a group's positions on one machine: (its first
    /// position, the group's GPUs on that machine).
    beside: Vec<(u32, u32)>,
    /// For each machine, the runs (first position, GPUs) its GPUs' groups
    /// hold on other machines, with how many of its GPUs send to each.
    away: Vec<Vec<((u32, u32), u32)>>,
}

impl GroupLayout {
    /// The layout, its `beside` runs collected by `AllToAll::new`'s walk
    /// of the groups, with `away` grouped per machine: (sending machine, a
    /// run of its groups' positions on another machine, how many of its
    /// GPUs send to it).
    fn with_away(mut self, mut away: Vec<(usize, (u32, u32), u32)>) -> GroupLayout {
        away.sort_unstable();
        self.away = away
            .chunk_by(|a, b| a.0 == b.0)
            .map(|machine| {
                machine
                    .chunk_by(|a, b| a.1 == b.1)
                    .map(|same| (same[0].1, same.iter().map(|a| a.2).sum()))
                    .collect()
            })
            .collect();
        self
    }

    /// Per token, the sends over the busiest GPU's intra-machine link and
    /// out of the busiest machine.
    fn sends_per_token(&self, pattern: &ExpertPattern) -> (f64, f64) {
        let per_gpu = pattern.count / self.e.max(1);
        // Routing treats every routing group alike: a block's chance of
        // being reached depends only on its place within a group (with no
        // groups, on its length alone), so blocks alike in that are priced
        // once.
        let place = |first: u32| match pattern.routing_groups {
            Some(g) => first % (pattern.count / g.groups.max(1)).max(1),
            None => 0,
        };
        let mut known: Vec<((u32, u32), f64)> = Vec::new();
        let mut reaches = |(first, gpus): (u32, u32)| {
            let block = (place(first * per_gpu), gpus * per_gpu);
            match known.iter().find(|(b, _)| *b == block) {
                Some(&(_, p)) => p,
                None => {
                    let p = pattern.reaches(block.0, block.1);
                    known.push((block, p));
                    p
                }
            }
        };
        // The GPU's machine receives the token once from every other
        // machine of the group that it reaches, and each of its n GPUs in
        // the group forwards those, and sends its own tokens, to the n - 1
        // others that hold its experts: over e senders a token, e / n of
        // them through this GPU's machine, each reaching one of its
        // neighbours with the probability that one GPU's experts are hit.
        let mut beside = 0.0f64;
        for &(first, n) in &self.beside {
            let forwarded = (f64::from(n) - 1.0) * f64::from(self.e) / f64::from(n);
            for position in first..first + n {
                beside = beside.max(forwarded * reaches((position, 1)));
            }
        }
        let away = self
            .away
            .iter()
            .map(|runs| {
                runs.iter()
                    .map(|&(run, senders)| f64::from(senders) * reaches(run))
                    .sum()
            })
            .fold(0.0, f64::max);
        (beside, away)
    }
}

/// What a token's reach depends on: the experts, experts a token and the
/// routing groups.
type Routing = (u32, u32, Option<RoutingGroups>);

/// Visits each expert group of a stage whose GPUs sit on `machines` (e
/// consecutive replicas of t GPUs, `experts::expert_group`) once, with its
/// runs of consecutive positions on one machine, (machine, first position,
/// GPUs), and its members.
fn for_each_group(
    machines: &[usize],
    (t, e): (usize, usize),
    mut visit: impl FnMut(&[(usize, u32, u32)], usize),
) {
    let gpus = machines.len();
    let mut runs: Vec<(usize, u32, u32)> = Vec::new();
    // From each group's first member: replica 0 of its e.
    for first in (0..gpus).filter(|p| (p / t) % e == 0) {
        runs.clear();
        let mut members = 0;
        for (position, q) in expert_group(first, t, e).filter(|&q| q < gpus).enumerate() {
            members += 1;
            match runs.last_mut() {
                Some((m, _, n)) if *m == machines[q] => *n += 1,
                _ => runs.push((machines[q], position as u32, 1)),
            }
        }
        visit(&runs, members);
    }
}

/// The exchange of a stage's expert groups, as a function of the bytes of
/// token copies each GPU sends (its own tokens' k copies, before 1/e of
/// them stay).
#[derive(Debug, Clone, PartialEq)]
pub struct AllToAll {
    intra: Link,
    inter: Link,
    /// One copy an expert: bytes over the busiest GPU's intra-machine link
    /// and out of the busiest machine, per byte each GPU sends.
    copies: (f64, f64),
    /// Where the groups sit, for a deduplicating dispatcher (None: laid
    /// out only where the profile has one).
    layout: Option<GroupLayout>,
    /// The last deduplicated pattern's sends a token (a stage's layers
    /// share one): its experts, experts a token, routing groups.
    deduplicated: Cell<Option<(Routing, (f64, f64))>>,
}

impl AllToAll {
    /// The exchange of the stage whose GPUs (in device order) sit on
    /// `machines`, split `t` ways into replicas of t consecutive GPUs,
    /// with expert groups of `e` consecutive replicas
    /// (`experts::expert_group`): shard k of a replica exchanges with
    /// shard k of the other e - 1 replicas of its group. `deduplicated`:
    /// lay the groups out for a deduplicating dispatcher too.
    pub fn new(
        cluster: &Cluster,
        machines: &[usize],
        (t, e): (usize, usize),
        deduplicated: bool,
    ) -> AllToAll {
        let (t, e) = (t.max(1), e.max(1));
        let peer_share = 1.0 / e as f64;
        let mut most_intra = 0usize;
        // Peers across machines, summed over each machine's GPUs.
        let mut leaving: FxHashMap<usize, usize> = FxHashMap::default();
        // For a deduplicating dispatcher, where the groups sit, from the
        // same walk.
        let mut layout = deduplicated.then(|| GroupLayout {
            e: e as u32,
            ..GroupLayout::default()
        });
        let mut away: Vec<(usize, (u32, u32), u32)> = Vec::new();
        for_each_group(machines, (t, e), |runs, members| {
            for &(m, start, n) in runs {
                let beside: u32 = runs.iter().filter(|r| r.0 == m).map(|r| r.2).sum();
                most_intra = most_intra.max(beside as usize - 1);
                let across = (members - beside as usize) * n as usize;
                *leaving.entry(m).or_default() += across;
                if let Some(layout) = layout.as_mut() {
                    if !layout.beside.contains(&(start, beside)) {
                        layout.beside.push((start, beside));
                    }
                    away.extend(runs.iter().filter(|r| r.0 != m).map(|r| (m, (r.1, r.2), n)));
                }
            }
        });
        let most_leaving = leaving.values().copied().max().unwrap_or(0);
        let slowest = machines
            .iter()
            .map(|&m| &cluster.machines[m])
            .min_by(|a, b| a.intra_bytes_per_ms.total_cmp(&b.intra_bytes_per_ms));
        AllToAll {
            intra: Link {
                latency_ms: slowest.map_or(0.0, |m| m.intra_latency_ms),
                ms_per_byte: slowest.map_or(0.0, |m| 1.0 / m.intra_bytes_per_ms),
                share: slowest.map_or(LinkShare::Line, |m| m.intra_share),
            },
            inter: Link {
                latency_ms: cluster.inter_latency_ms,
                ms_per_byte: 1.0 / cluster.inter_bytes_per_ms,
                share: cluster.inter_share,
            },
            copies: (
                most_intra as f64 * peer_share,
                most_leaving as f64 * peer_share,
            ),
            layout: layout.map(|l| l.with_away(away)),
            deduplicated: Cell::new(None),
        }
    }

    /// Time of one exchange of `pattern`'s layer in which each GPU sends
    /// `copy_bytes` of token copies (k a token).
    pub fn ms(&self, pattern: &ExpertPattern, copy_bytes: f64) -> f64 {
        let (intra, inter) = self.bytes_over_links(pattern, copy_bytes);
        self.intra.ms(intra).max(self.inter.ms(inter))
    }

    /// What crosses the busiest GPU's intra-machine link and leaves the
    /// busiest machine where each GPU sends `copy_bytes` of copies.
    pub fn bytes_over_links(&self, pattern: &ExpertPattern, copy_bytes: f64) -> (f64, f64) {
        match pattern.dispatcher {
            TokenDispatcher::AllToAll => (copy_bytes * self.copies.0, copy_bytes * self.copies.1),
            TokenDispatcher::DeepEp => {
                let key = (pattern.count, pattern.per_token, pattern.routing_groups);
                let sends = match self.deduplicated.get() {
                    Some((cached, sends)) if cached == key => sends,
                    _ => {
                        let layout = self.layout.as_ref().expect(
                            "an exchange priced with DeepEP is built for a profile that has it",
                        );
                        let sends = layout.sends_per_token(pattern);
                        self.deduplicated.set(Some((key, sends)));
                        sends
                    }
                };
                let token_bytes = copy_bytes / f64::from(pattern.per_token.max(1));
                (token_bytes * sends.0, token_bytes * sends.1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;

    fn two_machines_of_8() -> Cluster {
        Cluster::new(&Topology::from_spec("2x8-nvlink").unwrap())
    }

    /// The machine of each of 16 GPUs, 8 on each of two machines.
    const SIXTEEN: [usize; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];

    /// 64 experts, 8 a token (DeepSeek-V3's 256 over 4), 1 MB of copies
    /// a sample.
    fn pattern(
        dispatcher: TokenDispatcher,
        routing_groups: Option<RoutingGroups>,
    ) -> ExpertPattern {
        ExpertPattern {
            count: 64,
            per_token: 8,
            param_fraction: 0.9,
            all_to_all_bytes_per_sample: 1e6,
            split_gather_bytes_per_sample: 0.0,
            compute_fraction: 0.5,
            imbalance: 1.0,
            dispatcher,
            routing_groups,
        }
    }

    fn copies() -> ExpertPattern {
        pattern(TokenDispatcher::AllToAll, None)
    }

    #[test]
    fn inside_a_machine_a_gpu_sends_all_but_its_own_share_over_its_link() {
        let cluster = two_machines_of_8();
        for (e, intra) in [(2, 0.5), (4, 0.75), (8, 0.875)] {
            let exchange = AllToAll::new(&cluster, &SIXTEEN, (1, e), true);
            assert_eq!(
                exchange.bytes_over_links(&copies(), 1.0),
                (intra, 0.0),
                "e = {e}"
            );
        }
        // 1 MB a GPU at e = 8: 7/8 of it over NVLink, at the line rate
        // ("nvlink": the DAPPLE paper's measured link), after its latency.
        let m = &cluster.machines[0];
        let exchange = AllToAll::new(&cluster, &SIXTEEN, (1, 8), true);
        assert_eq!(m.intra_share, LinkShare::Line);
        let expected = m.intra_latency_ms + 0.875e6 / m.intra_bytes_per_ms;
        assert!((exchange.ms(&copies(), 1e6) - expected).abs() < 1e-12);
    }

    #[test]
    fn across_machines_the_machines_gpus_share_its_network() {
        let cluster = two_machines_of_8();
        // e = 16 over both machines: 7 of a GPU's 15 peers beside it, 8
        // across; each machine's 8 GPUs send 8/16 of their bytes out.
        let exchange = AllToAll::new(&cluster, &SIXTEEN, (1, 16), true);
        assert_eq!(exchange.bytes_over_links(&copies(), 1.0), (7.0 / 16.0, 4.0));
        let expected = cluster.inter_latency_ms + 4.0 * 1e6 / cluster.inter_bytes_per_ms;
        assert!((exchange.ms(&copies(), 1e6) - expected).abs() < 1e-9);
        // Split 8 ways, one replica a machine: e = 2 pairs each shard with
        // its counterpart on the other machine, half of every GPU's bytes out.
        let split = AllToAll::new(&cluster, &SIXTEEN, (8, 2), true);
        assert_eq!(split.bytes_over_links(&copies(), 1.0), (0.0, 4.0));
        // One GPU on each of 8 machines: every peer across, each machine
        // sending its one GPU's (e - 1)/e.
        let wide = Cluster::new(&Topology::from_spec("8x8-nvlink").unwrap());
        let one_each: Vec<usize> = (0..8).collect();
        for (e, out) in [(2, 0.5), (4, 0.75), (8, 0.875)] {
            let exchange = AllToAll::new(&wide, &one_each, (1, e), false);
            assert_eq!(
                exchange.bytes_over_links(&copies(), 1.0),
                (0.0, out),
                "e = {e}"
            );
        }
    }

    #[test]
    fn deepep_sends_a_token_once_to_each_machine_and_gpu_it_reaches() {
        let cluster = two_machines_of_8();
        let deepep = pattern(TokenDispatcher::DeepEp, None);
        // 8 copies a token of 1 MB in all: 125 kB a token.
        let token = 1e6 / 8.0;
        // e = 16 over both machines, 4 experts a GPU, 32 a machine. A token
        // reaches the other machine unless its 8 experts all fall among
        // the 32 on its own: 1 - C(32, 8) / C(64, 8).
        let exchange = AllToAll::new(&cluster, &SIXTEEN, (1, 16), true);
        let other_machine = 1.0
            - (0..8)
                .map(|i| (32.0 - i as f64) / (64.0 - i as f64))
                .product::<f64>();
        let one_gpu = 1.0
            - (0..8)
                .map(|i| (60.0 - i as f64) / (64.0 - i as f64))
                .product::<f64>();
        let (beside, away) = exchange.bytes_over_links(&deepep, 1e6);
        // Out of a machine: each of its 8 GPUs' tokens once, where they
        // reach the other machine (8 x 0.996 against 4 copies' worth).
        assert!((away - 8.0 * other_machine * token).abs() < 1e-6, "{away}");
        // Beside: 7 neighbours, each reached with one GPU's probability,
        // from the 16 senders whose tokens pass through this machine's 8.
        assert!(
            (beside - 7.0 * 2.0 * one_gpu * token).abs() < 1e-6,
            "{beside}"
        );
        let expected = cluster.inter_latency_ms + away / cluster.inter_bytes_per_ms;
        assert!((exchange.ms(&deepep, 1e6) - expected).abs() < 1e-9);
        // Inside one machine (e = 8): nothing leaves it, and a token goes
        // once to each of the 7 others it reaches, not 7/8 of 8 copies.
        let inside = AllToAll::new(&cluster, &SIXTEEN, (1, 8), true);
        let eight_experts = 1.0
            - (0..8)
                .map(|i| (56.0 - i as f64) / (64.0 - i as f64))
                .product::<f64>();
        let (beside, away) = inside.bytes_over_links(&deepep, 1e6);
        assert_eq!(away, 0.0);
        assert!((beside - 7.0 * eight_experts * token).abs() < 1e-6);
        assert!(beside < 0.875 * 1e6);
        // Group-limited routing, a group a machine and one group a token:
        // half the tokens pick their own machine's group and stay; the
        // others all reach the other machine, once each.
        let limited = pattern(
            TokenDispatcher::DeepEp,
            Some(RoutingGroups {
                groups: 2,
                per_token: 1,
            }),
        );
        let (_, away) = exchange.bytes_over_links(&limited, 1e6);
        assert!((away - 8.0 * 0.5 * token).abs() < 1e-6, "{away}");
    }

    #[test]
    fn nothing_sent_takes_no_time() {
        let exchange = AllToAll::new(&two_machines_of_8(), &SIXTEEN, (1, 4), true);
        assert_eq!(exchange.ms(&copies(), 0.0), 0.0);
        assert_eq!(
            exchange.ms(&pattern(TokenDispatcher::DeepEp, None), 0.0),
            0.0
        );
    }
}
