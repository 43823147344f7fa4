use dapple_core::cluster::gpus::gpu_type;
use dapple_core::model::kernels::{memory_bound_ms, Gemm};
use pyo3::prelude::*;

use crate::to_py_err;

/// The cost model's time, ms, of `batch` matrix products of (m x k) by
/// (k x n) on GPU type `gpu` (tiles, waves and the per-product floor).
#[pyfunction]
#[pyo3(signature = (gpu, m, n, k, *, batch=1))]
fn gemm_ms(gpu: &str, m: u64, n: u64, k: u64, batch: u64) -> PyResult<f64> {
    let gpu = gpu_type(gpu).map_err(|e| to_py_err(e.under("gpu")))?;
    Ok(Gemm { m, n, k, batch }.ms(gpu))
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
