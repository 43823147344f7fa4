//! The token exchange of expert parallelism (`model/experts.rs`), priced on a
//! stage's links: every expert group of the stage runs its all-to-all at
//! once, each GPU sending 1/e of its bytes to each of its e - 1 peers (and
//! keeping 1/e). Peers on its own machine are reached over the GPU's
//! intra-machine link; the others over the network, which all the
//! machine's GPUs of the stage share. NCCL posts the sends to every peer
//! at once, so the two parts run side by side and the slower one decides.
//!
//! Each part is priced at the share of its link that the AllReduce
//! reaches there (`LinkShare`): the measured all-to-all is close to it
//! (hardware-measurements.json C7, 8 H100 in one machine: all-to-all
//! 268.5 GB/s bus bandwidth at 64 MiB against the AllReduce's 309.2, 0.87
//! of it; C11a, DeepEP's kernels across machines: 43-58 GB/s a GPU over
//! 50 GB/s links), which this model does not correct for.

use super::{Cluster, LinkShare};
use crate::model::experts::expert_group;

/// One link's part of an all-to-all: what share of a GPU's bytes cross it,
/// at the stage's busiest GPU (intra-machine) or machine (the network).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Part {
    /// Bytes over the link per byte each GPU sends.
    bytes_per_sent_byte: f64,
    latency_ms: f64,
    ms_per_byte: f64,
    share: LinkShare,
}

impl Part {
    fn ms(&self, bytes_per_gpu: f64) -> f64 {
        let bytes = bytes_per_gpu * self.bytes_per_sent_byte;
        if bytes <= 0.0 {
            return 0.0;
        }
        self.share.ms((self.latency_ms, self.ms_per_byte), bytes)
    }
}

/// The all-to-all of a stage's expert groups, as a function of the bytes
/// each GPU sends (its own tokens' copies, before 1/e of them stay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllToAll {
    intra: Part,
    inter: Part,
}

impl AllToAll {
    /// The all-to-all of the stage whose GPUs (in device order) sit on
    /// `machines`, split `t` ways into replicas of t consecutive GPUs,
    /// with expert groups of `e` consecutive replicas
    /// (`experts::expert_group`): shard k of a replica exchanges with
    /// shard k of the other e - 1 replicas of its group.
    pub fn new(cluster: &Cluster, machines: &[usize], t: usize, e: usize) -> AllToAll {
        let gpus = machines.len();
        let peer_share = 1.0 / e.max(1) as f64;
        let mut most_intra = 0usize;
        // Peers across machines, summed over each machine's GPUs.
        let mut leaving: Vec<(usize, usize)> = Vec::new();
        for p in 0..gpus {
            let (mut intra, mut inter) = (0, 0);
            for q in expert_group(p, t, e).filter(|&q| q != p) {
                match machines.get(q) {
                    Some(&m) if m == machines[p] => intra += 1,
                    Some(_) => inter += 1,
                    None => {}
                }
            }
            most_intra = most_intra.max(intra);
            match leaving.iter_mut().find(|(m, _)| *m == machines[p]) {
                Some((_, n)) => *n += inter,
                None => leaving.push((machines[p], inter)),
            }
        }
        let most_leaving = leaving.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let slowest = machines
            .iter()
            .map(|&m| &cluster.machines[m])
            .min_by(|a, b| a.intra_bytes_per_ms.total_cmp(&b.intra_bytes_per_ms));
        AllToAll {
            intra: Part {
                bytes_per_sent_byte: most_intra as f64 * peer_share,
                latency_ms: slowest.map_or(0.0, |m| m.intra_latency_ms),
                ms_per_byte: slowest.map_or(0.0, |m| 1.0 / m.intra_bytes_per_ms),
                share: slowest.map_or(LinkShare::Line, |m| m.intra_share),
            },
            inter: Part {
                bytes_per_sent_byte: most_leaving as f64 * peer_share,
                latency_ms: cluster.inter_latency_ms,
                ms_per_byte: 1.0 / cluster.inter_bytes_per_ms,
                share: cluster.inter_share,
            },
        }
    }

    /// Time of one all-to-all in which each GPU sends `bytes_per_gpu`.
    pub fn ms(&self, bytes_per_gpu: f64) -> f64 {
        self.intra
            .ms(bytes_per_gpu)
            .max(self.inter.ms(bytes_per_gpu))
    }

    /// What crosses the busiest GPU's intra-machine link and leaves the
    /// busiest machine, per byte each GPU sends.
    pub fn bytes_per_sent_byte(&self) -> (f64, f64) {
        (
            self.intra.bytes_per_sent_byte,
            self.inter.bytes_per_sent_byte,
        )
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

    #[test]
    fn inside_a_machine_a_gpu_sends_all_but_its_own_share_over_its_link() {
        let cluster = two_machines_of_8();
        for (e, intra) in [(2, 0.5), (4, 0.75), (8, 0.875)] {
            let exchange = AllToAll::new(&cluster, &SIXTEEN, 1, e);
            assert_eq!(exchange.bytes_per_sent_byte(), (intra, 0.0), "e = {e}");
        }
        // 1 MB a GPU at e = 8: 7/8 of it over NVLink, at the line rate
        // ("nvlink": the DAPPLE paper's measured link), after its latency.
        let m = &cluster.machines[0];
        let exchange = AllToAll::new(&cluster, &SIXTEEN, 1, 8);
        assert_eq!(m.intra_share, LinkShare::Line);
        let expected = m.intra_latency_ms + 0.875e6 / m.intra_bytes_per_ms;
        assert!((exchange.ms(1e6) - expected).abs() < 1e-12);
    }

    #[test]
    fn across_machines_the_machines_gpus_share_its_network() {
        let cluster = two_machines_of_8();
        // e = 16 over both machines: 7 of a GPU's 15 peers beside it, 8
        // across; each machine's 8 GPUs send 8/16 of their bytes out.
        let exchange = AllToAll::new(&cluster, &SIXTEEN, 1, 16);
        assert_eq!(exchange.bytes_per_sent_byte(), (7.0 / 16.0, 4.0));
        let expected = cluster.inter_latency_ms + 4.0 * 1e6 / cluster.inter_bytes_per_ms;
        assert!((exchange.ms(1e6) - expected).abs() < 1e-9);
        // Split 8 ways, one replica a machine: e = 2 pairs each shard with
        // its counterpart on the other machine, half of every GPU's bytes out.
        let split = AllToAll::new(&cluster, &SIXTEEN, 8, 2);
        assert_eq!(split.bytes_per_sent_byte(), (0.0, 4.0));
        // One GPU on each of 8 machines: every peer across, each machine
        // sending its one GPU's (e - 1)/e.
        let wide = Cluster::new(&Topology::from_spec("8x8-nvlink").unwrap());
        let one_each: Vec<usize> = (0..8).collect();
        for (e, out) in [(2, 0.5), (4, 0.75), (8, 0.875)] {
            let exchange = AllToAll::new(&wide, &one_each, 1, e);
            assert_eq!(exchange.bytes_per_sent_byte(), (0.0, out), "e = {e}");
        }
    }

    #[test]
    fn nothing_sent_takes_no_time() {
        let exchange = AllToAll::new(&two_machines_of_8(), &SIXTEEN, 1, 4);
        assert_eq!(exchange.ms(0.0), 0.0);
    }
}
