//! The time of one operator on a GPU type, from its shape and the type's
//! measured kernel figures (`gpus::KernelFigures`): a matrix product by its
//! tiles and waves, a memory-bound operator by its bytes, and the attention
//! core as FlashAttention runs it or as separate kernels do (the products,
//! and a softmax over the whole score matrix in memory).
//!
//! A matrix product of m x n outputs over k is cut into tiles, one tile an
//! SM at a time, so it runs in ceil(tiles / SMs) waves; a last wave that is
//! partly empty, or tiles that hang over the matrix's edge, cost as much as
//! full ones (G11: "partial last wave costs a full wave"). The library picks
//! the tile (`GEMM_TILES`: CUTLASS's default 128 x 256 threadblock for
//! Ampere tensor-core products, NVIDIA/cutlass@044405c
//! include/cutlass/gemm/device/default_gemm_configuration.h, either way
//! round, and the smaller 128 x 128, 128 x 64 and 64 x 64 its kernels also
//! come in) that finishes first: a small tile fills more of the SMs, but
//! loads more operands for its products, so below `FED_TILE_INTENSITY` it
//! cannot keep an SM's tensor cores busy (a roofline a tile). Full waves of
//! fed tiles run at a share of the type's measured best (`gemm_tflops`,
//! the best of a search over shapes): `SUSTAINED_SHARE`, what the published
//! runs' own products reached on a lent H200. Each product also costs a
//! fixed 5 us (G8-floor: on H100 "t ~ 5 us + FLOP / (~800 TFLOP/s) fits
//! 256^3..4096^3 within ~10%"; assumed on every type), and no less than
//! reading its inputs and writing its output at the memory bandwidth.
//! `benchmarks/gemm_model.py` checks the rule against H100's measured
//! products by shape (G8, G9); no product on A100 was measured by shape.

use crate::cluster::gpus::GpuType;
use crate::error::{Error, Result};

/// Threadblock tiles of a matrix product (rows, columns) the library may
/// pick, the largest first.
pub const GEMM_TILES: [(u64, u64); 6] = [
    (128, 256),
    (256, 128),
    (128, 128),
    (128, 64),
    (64, 128),
    (64, 64),
];
/// The arithmetic intensity of a tile, rows x columns / (rows + columns)
/// (its products over the operand values it loads, a k-step at a time), at
/// and above which it keeps an SM's tensor cores fed; a tile of less runs
/// at its intensity over this. Fitted to XLA's H100 products by shape (G8:
/// 256^3 to 4096^3, G9: few tokens and short reductions, median CUPTI
/// kernel times; `benchmarks/gemm_model.py`): of 30 to 70 in steps of 5,
/// 50 has the least mean |log(model / measured)| over the 13, 0.108
/// against 0.348 with the 128 x 256 tile alone (`fed_tile_intensity` in
/// benchmarks/results/gemm_model.json); the lent H200's sweep then sets
/// `SUSTAINED_SHARE`. 128 x 128 tiles (64) and
/// larger are fed; 128 x 64 (42.7) runs at 0.85, 64 x 64 (32) at 0.64.
pub const FED_TILE_INTENSITY: f64 = 50.0;
/// Share of the type's best throughput (`gemm_tflops`: the maximum
/// achievable matmul FLOPS, the best shape of a brute-force search) that
/// full waves of a transformer's products reach. Measured on a lent H200
/// (`benchmarks/gpu_kernels.py --device cuda`, 2026-11-28, torch 2.11's
/// `torch.matmul` in bf16, `benchmarks/results/gpu_kernels-h200.json`): the
/// median, over the 151 products of 0.1 TFLOP and more (the forward and
/// both backward products of GPT-3 175B, the 530B and Llama-3-405B at
/// t = 8, Llama-2-70B at t = 4, a 3.6B GPT at t = 1, micro-batches 1 to 4,
/// and squares), of the measured throughput over the best times the wave
/// efficiency (`Gemm::wave_efficiency`, with `GEMM_TILES` and
/// `FED_TILE_INTENSITY`): 0.887 (quartiles 0.851 and 0.910; 0.898 with
/// the 128 x 256 tile alone; the 8192^3 square alone reached the best,
/// 793.1 of 794.5 TFLOP/s). Assumed on every type: no other type's
/// products were measured by shape.
/// `tests/test_operator_profiles.py` re-derives it from that file.
pub const SUSTAINED_SHARE: f64 = 0.887;
/// Fixed cost of one product's kernel (G8-floor), ms.
pub const GEMM_FLOOR_MS: f64 = 0.005;
/// Bytes of one bf16 value.
const BF16: f64 = 2.0;

/// A matrix product: `batch` products of (m x k) by (k x n).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
}

impl Gemm {
    pub fn new(m: u64, n: u64, k: u64) -> Gemm {
        Gemm { m, n, k, batch: 1 }
    }

    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.n) as f64 * self.k as f64 * self.batch as f64
    }

    /// Its inputs read and its output written once, bf16.
    fn bytes(&self) -> f64 {
        let (m, n, k) = (self.m as f64, self.n as f64, self.k as f64);
        BF16 * self.batch as f64 * (m * k + k * n + m * n)
    }

    /// Share of the SMs' time that does useful work at full speed, with
    /// the tile that does the most: outputs over the tiles' area times the
    /// waves' slots, times the tile's fed share.
    pub fn wave_efficiency(&self, sm_count: u32) -> f64 {
        self.wave_efficiency_fed_at(sm_count, FED_TILE_INTENSITY)
    }

    /// [`Gemm::wave_efficiency`] with tiles fed at `fed_intensity`
    /// (`benchmarks/gemm_model.py` weighs the values it was chosen among).
    pub fn wave_efficiency_fed_at(&self, sm_count: u32, fed_intensity: f64) -> f64 {
        let useful = (self.m * self.n * self.batch) as f64;
        GEMM_TILES
            .iter()
            .map(|&(rows, columns)| {
                let tiles = self.m.div_ceil(rows) * self.n.div_ceil(columns) * self.batch;
                let waves = tiles.div_ceil(u64::from(sm_count));
                let slots = (waves * u64::from(sm_count) * rows * columns) as f64;
                useful / slots * fed_share((rows, columns), fed_intensity)
            })
            .fold(0.0, f64::max)
    }

    /// Its time on `gpu`, ms.
    pub fn ms(&self, gpu: &GpuType) -> f64 {
        self.ms_fed_at(gpu, FED_TILE_INTENSITY)
    }

    /// [`Gemm::ms`] with tiles fed at `fed_intensity`.
    pub fn ms_fed_at(&self, gpu: &GpuType, fed_intensity: f64) -> f64 {
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return 0.0;
        }
        let figures = &gpu.kernels;
        let flops_per_ms = SUSTAINED_SHARE
            * figures.gemm_tflops
            * 1e9
            * self.wave_efficiency_fed_at(figures.sm_count, fed_intensity);
        let compute_ms = self.flops() / flops_per_ms;
        GEMM_FLOOR_MS + compute_ms.max(memory_bound_ms(gpu, self.bytes()))
    }
}

/// What of an SM's full speed a tile of `rows` x `columns` keeps where
/// tiles of `fed_intensity` and more are fed (`FED_TILE_INTENSITY`).
pub fn fed_share((rows, columns): (u64, u64), fed_intensity: f64) -> f64 {
    let intensity = (rows * columns) as f64 / (rows + columns) as f64;
    (intensity / fed_intensity).min(1.0)
}

/// Time of a memory-bound operator that moves `bytes` (read and written
/// together) on `gpu`, ms: no launch cost (each moves megabytes here).
pub fn memory_bound_ms(gpu: &GpuType, bytes: f64) -> f64 {
    bytes / (gpu.kernels.hbm_gb_per_s * 1e6)
}

crate::named_enum! {
    /// How the attention core (softmax(QK^T) V) runs.
    pub enum AttentionKernel("an attention kernel") {
        /// FlashAttention, causal: the scores never leave the SM, and the
        /// masked half is skipped.
        Flash = "flash",
        /// Separate kernels, as Megatron-LM ran before FlashAttention: QK^T,
        /// a fused scale-mask-softmax that writes the s x s probabilities,
        /// and their product with V; the whole product is computed, masked
        /// or not.
        Unfused = "unfused",
    }
}

impl AttentionKernel {
    /// Whether the kernel runs on `gpu`: FlashAttention where the type has
    /// measured figures of it (none on V100: FlashAttention-2 needs Ampere
    /// or later); the unfused kernels everywhere.
    pub fn check_runs_on(&self, gpu: &GpuType) -> Result<()> {
        if *self == AttentionKernel::Flash && gpu.kernels.flash_attention_tflops.is_empty() {
            return Err(Error::field(
                "attention",
                format!(
                    "value \"flash\": no FlashAttention kernel runs on {} (FlashAttention-2 needs Ampere or later); \
                     use the unfused attention",
                    gpu.name
                ),
            ));
        }
        Ok(())
    }
}

/// The attention core of `heads` heads (all samples' of one GPU) of `seq`
/// tokens each, `head_dim` wide, with `dropout` of its probabilities or
/// not: forward and backward ms. FlashAttention drops inside its kernel
/// (its measured throughput is without dropout); unfused, the dropout is a
/// kernel of its own, reading the probabilities and writing them dropped
/// and a one-byte mask, and its backward as many bytes.
pub fn attention_ms(
    gpu: &GpuType,
    kernel: AttentionKernel,
    (heads, seq, head_dim): (u64, u64, u64),
    dropout: bool,
) -> Result<(f64, f64)> {
    match kernel {
        AttentionKernel::Flash => {
            let tflops = flash_tflops(gpu, seq)?;
            // QK^T and AV, 2 s^2 d each, halved by the causal mask; the
            // backward is 2.5 times the forward (five products, QK^T again
            // among them), as FlashAttention counts its FLOPs.
            let fwd_flops = 2.0 * (seq * seq) as f64 * head_dim as f64 * heads as f64;
            let fwd_ms = fwd_flops / (tflops * 1e9);
            Ok((fwd_ms, 2.5 * fwd_ms))
        }
        AttentionKernel::Unfused => {
            let scores = Gemm {
                m: seq,
                n: seq,
                k: head_dim,
                batch: heads,
            };
            let by_values = Gemm {
                m: seq,
                n: head_dim,
                k: seq,
                batch: heads,
            };
            let probabilities = BF16 * (seq * seq * heads) as f64;
            let dropped = if dropout {
                memory_bound_ms(gpu, (2.0 * BF16 + 1.0) * (seq * seq * heads) as f64)
            } else {
                0.0
            };
            // Softmax: reads the scores, writes the probabilities; its
            // backward reads them and their gradient and writes the scores'.
            let fwd = scores.ms(gpu)
                + memory_bound_ms(gpu, 2.0 * probabilities)
                + dropped
                + by_values.ms(gpu);
            let bwd = scores.ms(gpu)
                + 3.0 * by_values.ms(gpu)
                + memory_bound_ms(gpu, 3.0 * probabilities)
                + dropped;
            Ok((fwd, bwd))
        }
    }
}

/// FlashAttention's forward-and-backward throughput at `seq` tokens: the
/// measured figures interpolated linearly in log2 of the length, the
/// nearest one beyond their range.
fn flash_tflops(gpu: &GpuType, seq: u64) -> Result<f64> {
    AttentionKernel::Flash.check_runs_on(gpu)?;
    let table = gpu.kernels.flash_attention_tflops;
    let (Some(first), Some(last)) = (table.first(), table.last()) else {
        unreachable!("checked: FlashAttention has measured figures on this type")
    };
    if seq <= first.0 {
        return Ok(first.1);
    }
    if seq >= last.0 {
        return Ok(last.1);
    }
    let x = (seq as f64).log2();
    let i = table.partition_point(|&(s, _)| s <= seq);
    let ((s0, t0), (s1, t1)) = (table[i - 1], table[i]);
    let (x0, x1) = ((s0 as f64).log2(), (s1 as f64).log2());
    Ok(t0 + (t1 - t0) * (x - x0) / (x1 - x0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::gpus::gpu_type;

    #[test]
    fn a_large_product_in_full_waves_runs_at_the_sustained_share_of_the_best() {
        // 4096^3 on H100: 32 x 16 = 512 tiles of 128 x 256 (or 16 x 32 of
        // 256 x 128) on 132 SMs: 4 waves, 528 slots, 512 used; 128 x 128
        // tiles fill 8 waves as well, and no smaller tile does better.
        let h100 = gpu_type("h100").unwrap();
        let g = Gemm::new(4096, 4096, 4096);
        assert_eq!(g.wave_efficiency(132), 512.0 / 528.0);
        let ms = g.ms(h100);
        let expected = 0.005 + 2.0 * 4096f64.powi(3) / (0.887 * 794.5e9 * 512.0 / 528.0);
        assert!((ms - expected).abs() < 1e-12, "{ms} {expected}");
        // 0.2061 ms: 667 TFLOP/s, against 780.2 measured by XLA (G8-4096)
        // and 722.9 on the H200 the share was measured on.
        assert!(
            (g.flops() / ms / 1e9 - 666.8).abs() < 0.1,
            "{}",
            g.flops() / ms / 1e9
        );
    }

    #[test]
    fn a_small_product_takes_the_tile_that_fills_the_sms() {
        // 1024 x 1024 on A100's 108 SMs: 32 tiles of 128 x 256 fill 30% of
        // one wave; 64 of 128 x 128 (fed: intensity 64) fill 59%; 128 of
        // 128 x 64 take two waves at 0.85 of full speed, 256 of 64 x 64
        // three at 0.64. The library takes 128 x 128.
        let a100 = gpu_type("a100").unwrap();
        let g = Gemm::new(1024, 1024, 1024);
        assert_eq!(g.wave_efficiency(108), 64.0 / 108.0);
        let expected = 0.005 + g.flops() / (0.887 * 271.2e9 * 64.0 / 108.0);
        assert!((g.ms(a100) - expected).abs() < 1e-12);
        // A tile hanging over the edge costs a whole one: 1025 rows take
        // 9 x 8 = 72 tiles of 128 x 128, still one wave of 108 slots.
        assert_eq!(
            Gemm::new(1025, 1024, 1024).wave_efficiency(108),
            1025.0 * 1024.0 / (108.0 * 128.0 * 128.0)
        );
        // A few tokens through a wide layer (G9-m256 on H100, 256 x 4096 x
        // 4096): 64 x 128 tiles fill the SMs at 0.85 of full speed, where
        // 128 x 256 ones leave three quarters of them idle.
        let h100 = gpu_type("h100").unwrap();
        let few = Gemm::new(256, 4096, 4096);
        assert_eq!(
            fed_share((64, 128), FED_TILE_INTENSITY),
            64.0 * 128.0 / 192.0 / 50.0
        );
        assert_eq!(
            few.wave_efficiency(132),
            256.0 * 4096.0 / (132.0 * 64.0 * 128.0) * fed_share((64, 128), FED_TILE_INTENSITY)
        );
        let tflops = few.flops() / few.ms(h100) / 1e9;
        assert!(
            (tflops / 418.4 - 1.0).abs() < 0.10,
            "{tflops} against G9's 418.4"
        );
    }

    #[test]
    fn a_thin_product_is_bound_by_memory() {
        // 65536 x 8 outputs over k = 8: a few FLOPs, a megabyte moved.
        let a100 = gpu_type("a100").unwrap();
        let g = Gemm::new(65536, 8, 8);
        let bytes = 2.0 * (65536.0 * 8.0 + 64.0 + 65536.0 * 8.0);
        assert_eq!(g.ms(a100), 0.005 + bytes / 1759e6);
    }

    #[test]
    fn flash_attention_interpolates_its_measured_lengths() {
        let a100 = gpu_type("a100").unwrap();
        // 2048 tokens: 140 TFLOP/s (A2); 3000 between 2k's 140 and 4k's 156.
        let (fwd, bwd) = attention_ms(a100, AttentionKernel::Flash, (1, 2048, 128), false).unwrap();
        assert!((fwd - 2.0 * 2048.0 * 2048.0 * 128.0 / 140e9).abs() < 1e-15);
        assert_eq!(bwd, 2.5 * fwd);
        let mid = flash_tflops(a100, 3000).unwrap();
        let expected = 140.0 + 16.0 * (3000f64.log2() - 11.0);
        assert!((mid - expected).abs() < 1e-9, "{mid}");
        assert_eq!(flash_tflops(a100, 100).unwrap(), 88.0);
        assert_eq!(flash_tflops(a100, 1 << 20).unwrap(), 171.0);
        let v100 = gpu_type("v100").unwrap();
        let e = attention_ms(v100, AttentionKernel::Flash, (1, 2048, 64), false).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("attention"));
        assert!(attention_ms(v100, AttentionKernel::Unfused, (1, 2048, 64), false).is_ok());
    }

    #[test]
    fn unfused_attention_moves_the_whole_score_matrix() {
        let a100 = gpu_type("a100").unwrap();
        let (fwd, _) =
            attention_ms(a100, AttentionKernel::Unfused, (12, 2048, 128), false).unwrap();
        let scores = Gemm {
            m: 2048,
            n: 2048,
            k: 128,
            batch: 12,
        }
        .ms(a100);
        let by_values = Gemm {
            m: 2048,
            n: 128,
            k: 2048,
            batch: 12,
        }
        .ms(a100);
        let softmax = 2.0 * 2.0 * 2048.0 * 2048.0 * 12.0 / 1759e6;
        assert!((fwd - (scores + softmax + by_values)).abs() < 1e-12);
        assert!(
            softmax > 0.3 * fwd,
            "the softmax is a large part: {softmax} of {fwd}"
        );
        // Dropping the probabilities reads them and writes them and a mask: 5 bytes a score.
        let (dropped, _) =
            attention_ms(a100, AttentionKernel::Unfused, (12, 2048, 128), true).unwrap();
        assert!((dropped - fwd - 5.0 * 2048.0 * 2048.0 * 12.0 / 1759e6).abs() < 1e-12);
    }
}
