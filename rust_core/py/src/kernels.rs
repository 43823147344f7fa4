use dapple_core::cluster::gpus::gpu_type;
use dapple_core::model::kernels::{memory_bound_ms, Gemm, FED_TILE_INTENSITY};
use pyo3::prelude::*;

use crate::to_py_err;

/// The cost model's time, ms, of `batch` matrix products of (m x k) by
/// (k x n) on GPU type `gpu` (tiles, waves and the per-product floor), its
/// tiles fed at `fed_tile_intensity` (None: the model's `FED_TILE_INTENSITY`).
#[pyfunction]
#[pyo3(signature = (gpu, m, n, k, *, batch=1, fed_tile_intensity=None))]
fn gemm_ms(
    gpu: &str,
    m: u64,
    n: u64,
    k: u64,
    batch: u64,
    fed_tile_intensity: Option<f64>,
) -> PyResult<f64> {
    let gpu = gpu_type(gpu).map_err(|e| to_py_err(e.under("gpu")))?;
    let fed = fed_tile_intensity.unwrap_or(FED_TILE_INTENSITY);
    if !(fed.is_finite() && fed > 0.0) {
        return Err(to_py_err(dapple_core::Error::field(
            "fed_tile_intensity",
            format!("value {fed} must be a finite number > 0"),
        )));
    }
    Ok(Gemm { m, n, k, batch }.ms_fed_at(gpu, fed))
}

/// The cost model's time, ms, of a memory-bound operator that moves
/// `bytes` on GPU type `gpu`.
#[pyfunction]
fn memory_ms(gpu: &str, bytes: f64) -> PyResult<f64> {
    let gpu = gpu_type(gpu).map_err(|e| to_py_err(e.under("gpu")))?;
    Ok(memory_bound_ms(gpu, bytes))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gemm_ms, m)?)?;
    m.add_function(wrap_pyfunction!(memory_ms, m)?)?;
    Ok(())
}
