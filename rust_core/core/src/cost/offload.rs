//! Offloading the optimizer (ZeRO-Offload, Whale's 10T): a stage whose
//! shape says `Offload::Optimizer` keeps its master weights and optimizer
//! state in host memory and steps them on the host's CPU cores. Each
//! iteration, after its last backward, a GPU copies the gradients of the
//! weights it steps to the host, the CPU runs Adam over them, and the
//! updated weights come back (ZeRO-Offload, arXiv 2101.06840, Fig. 2;
//! DeepSpeed's `offload_optimizer`). The three run one after the other in
//! this model: DeepSpeed overlaps the gradients' copy with the backward
//! and may delay the update a step, which this leaves out.
//!
//! What a GPU holds and steps is `cost/shape.rs`' (`MemorySums`); this prices
//! the step. A stage's cost says what its host holds beside what it can
//! (`StageCost::fits_host`).

use super::{Cluster, StageDevices};
use crate::cluster::gpus::find_gpu;
use crate::model::profile::LayerCosts;

/// Adam's parameters per second on one CPU core: torch 2.9's fused CPU Adam
/// (`torch.optim.Adam(fused=True)`, fp32) on one thread of the machine
/// dapple is built on, a Zen 3 EPYC guest, median of 10 steps over 50 M
/// parameters (`benchmarks/cpu_adam.py`, `results/cpu_adam.json`: 1,166 M;
/// 700 M a thread on two). No public record gives an absolute CPU Adam
/// rate (hardware-measurements.json, P4c).
pub const CPU_ADAM_PARAMS_PER_S_PER_CORE: f64 = 1.166e9;

/// What Adam moves through memory per fp32 parameter and step: the weight,
/// both moments read and written, the gradient read (4 + 4 + 4 + 4 + 4 +
/// 4 + 4 bytes; the same benchmark's count: its one thread moved 32.6 GB/s,
/// so that a server's many cores are bound by its memory, not their count).
pub const CPU_ADAM_BYTES_PER_PARAM: f64 = 28.0;

/// One GPU's side of its host, as the cost model reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostCost {
    /// Copies to and from pinned host memory, bytes per ms each way.
    pub copy_bytes_per_ms: f64,
    /// Adam's parameters per ms on the GPU's share of the CPU cores and of
    /// the host's memory bandwidth, the lesser.
    pub adam_params_per_ms: f64,
    /// The GPU's share of the host memory.
    pub memory_bytes: f64,
}

impl HostCost {
    /// The host of a GPU of catalog type `gpu_type`; None for a type the
    /// catalog does not know (no stage there may offload).
    pub fn of_gpu(gpu_type: &str) -> Option<HostCost> {
        find_gpu(gpu_type).map(|g| {
            let h = &g.host;
            let by_cores = h.cpu_cores_per_gpu * CPU_ADAM_PARAMS_PER_S_PER_CORE;
            let by_memory = h.memory_gb_per_s_per_gpu * 1e9 / CPU_ADAM_BYTES_PER_PARAM;
            HostCost {
                copy_bytes_per_ms: h.copy_gb_per_s * 1e9 / 1e3,
                adam_params_per_ms: by_cores.min(by_memory) / 1e3,
                memory_bytes: h.memory_gib_per_gpu * f64::from(1u32 << 30),
            }
        })
    }

    /// The host of a stage on `alloc`'s machines: the slowest copy, the
    /// fewest cores and the least memory among them (its GPUs step in lock
    /// step); None if any machine has none.
    pub fn of_stage(cluster: &Cluster, alloc: &[(usize, u32)]) -> Option<HostCost> {
        let mut hosts = alloc.iter().map(|&(m, _)| cluster.machines[m].host);
        let first = hosts.next()??;
        hosts.try_fold(first, |least, h| {
            h.map(|h| HostCost {
                copy_bytes_per_ms: least.copy_bytes_per_ms.min(h.copy_bytes_per_ms),
                adam_params_per_ms: least.adam_params_per_ms.min(h.adam_params_per_ms),
                memory_bytes: least.memory_bytes.min(h.memory_bytes),
            })
        })
    }
}

/// The offloaded step of one GPU that steps `stepped_weight_bytes` of
/// weights (its ZeRO-1 shard's, or all it holds): their gradients to the
/// host, Adam over their parameters on its cores, the weights back.
/// Infinite where the stage's GPUs have no host figures.
pub fn offloaded_step_ms(
    layers: &LayerCosts,
    devices: &StageDevices,
    stepped_weight_bytes: f64,
) -> f64 {
    let Some(host) = devices.host else {
        return f64::INFINITY;
    };
    let copies_bytes = stepped_weight_bytes * (layers.gradient_per_weight_byte() + 1.0);
    let params = stepped_weight_bytes / layers.weight_bytes_per_param();
    copies_bytes / host.copy_bytes_per_ms + params / host.adam_params_per_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::cost::shape::{Offload, StageShape};
    use crate::cost::StageCoster;
    use crate::model::profile::{profile_of_layers, ParameterState};

    #[test]
    fn an_offloaded_stage_keeps_its_optimizer_on_the_host_and_steps_it_there() {
        // Two layers of 1 MB of bf16 weights under mixed precision: 2 bytes
        // of gradient, 4 of master weight and 8 of Adam's moments a weight's
        // 2, on 8 V100s of a DGX-1 (16 GB/s copies, 5 cores and 19.2 GB/s
        // of host memory a GPU).
        let mut profile = profile_of_layers("two", &[(1.0, 2.0, 1_000_000, 10); 2], 8);
        profile.parameter_state = Some(ParameterState {
            weight_bytes: 2.0,
            gradient_bytes: 2.0,
            master_weight_bytes: 4.0,
            optimizer_bytes: 8.0,
        });
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::new(&Topology::from_spec("1x8-nvlink").unwrap());
        let coster = StageCoster::new(&layers, &cluster, 8, 1);
        let devices = StageDevices::new(&cluster, vec![(0, 8)]);
        let of = |sharded: bool, offload: Offload| {
            let shape = StageShape {
                shard_level: u8::from(sharded),
                offload,
                ..StageShape::PLAIN
            };
            (
                coster.stage_shaped(0, 2, &devices, &shape, 1, false),
                coster.stage_memory(0, 2, &devices, &shape),
            )
        };
        let (on_gpu, on_gpu_memory) = of(false, Offload::None);
        let (off, off_memory) = of(false, Offload::Optimizer);
        let (zero_off, zero_off_memory) = of(true, Offload::Optimizer);
        // 2 MB of weights: 16 MB of state on the GPU; offloaded, the weights'
        // and gradients' 4 MB, the host the other 12 MB (1.5 MB, an eighth,
        // under ZeRO-1 over the 8 replicas).
        assert_eq!(on_gpu_memory.model_state_bytes, 16e6);
        assert_eq!(on_gpu_memory.host_bytes, 0.0);
        assert_eq!(
            (off_memory.model_state_bytes, off_memory.host_bytes),
            (4e6, 12e6)
        );
        assert_eq!(
            (
                zero_off_memory.model_state_bytes,
                zero_off_memory.host_bytes
            ),
            (4e6, 1.5e6)
        );
        assert_eq!(off_memory.optimizer_step_bytes, 0.0);
        // A host of 64 GiB a GPU holds the 12 MB.
        assert_eq!(
            (off.host_memory_bytes, off.host_memory_limit_bytes),
            (12e6, 64.0 * f64::from(1u32 << 30))
        );
        assert!(off.fits_host() && on_gpu.fits_host());
        // The step: the stepped weights' gradients out and weights back at
        // 16 GB/s, Adam over their parameters at the host memory's pace
        // (19.2 GB/s over 28 bytes a parameter, below 5 cores' 5.83 G/s).
        let step_ms =
            |weight_bytes: f64| 2.0 * weight_bytes / 16e6 + weight_bytes / 2.0 * 28.0 / 19.2e6;
        assert_eq!(on_gpu.offloaded_step_ms, 0.0);
        assert!((off.offloaded_step_ms - step_ms(2e6)).abs() < 1e-12);
        assert!((zero_off.offloaded_step_ms - step_ms(2e6 / 8.0)).abs() < 1e-12);
        // After the last backward, beside the exposed reduction; the passes
        // are the GPU-stepped stage's.
        assert_eq!(
            off.tail_ms(),
            off.exposed_allreduce_ms + off.offloaded_step_ms
        );
        assert_eq!((off.fwd_ms, off.bwd_ms), (on_gpu.fwd_ms, on_gpu.bwd_ms));
    }
}
