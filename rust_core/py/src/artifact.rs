use dapple_core::model::artifact::{import_graph_txt, ImportOptions};
use pyo3::prelude::*;

use crate::profile::PyProfile;
use crate::{to_py_err, with_source};

/// A profile from a DAPPLE artifact (PipeDream graph.txt) file's text;
/// `source` names the file in errors.
#[pyfunction]
#[pyo3(signature = (text, *, model, batch_size, source=None, param_bytes_scale=1.0, block_pattern=None, origin=None, device=None, optimizer="adam"))]
#[allow(clippy::too_many_arguments)]
fn import_artifact_profile(
    text: &str,
    model: String,
    batch_size: u32,
    source: Option<&str>,
    param_bytes_scale: f64,
    block_pattern: Option<String>,
    origin: Option<String>,
    device: Option<String>,
    optimizer: &str,
) -> PyResult<PyProfile> {
    let opts = ImportOptions {
        model,
        batch_size,
        param_bytes_scale,
        block_pattern,
        source: origin,
        device,
        optimizer: optimizer.to_string(),
    };
    let p = import_graph_txt(text, &opts).map_err(|e| to_py_err(with_source(e, source)))?;
    Ok(PyProfile::new(p, None))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(import_artifact_profile, m)?)?;
    Ok(())
}
