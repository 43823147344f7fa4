//! Python binding of dapple-core: the only crate that knows about pyo3.
//!
//! The core's validated objects cross the boundary as frozen classes
//! (`Profile`, `Topology`, `Plan`, `Simulation`) that wrap them, as
//! huggingface tokenizers does; JSON text appears only where a file is read
//! (`from_json`) or written (`to_json`). The tables of names users and files
//! spell (warm-up policies, baselines, presets, formats) come from the core.
//! Core errors become the exception classes of `dapple.planner.errors`, looked up
//! by their code in `to_py_err`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

mod artifact;
mod baselines;
mod calibrate;
mod convert;
mod kernels;
mod layout;
mod metrics;
mod pipeline_order;
mod plan;
mod profile;
mod regress;
mod schedule;
mod search;
mod simulation;
mod topology;
mod transformer;

/// Raise a core error as the matching `dapple.planner.errors` class.
pub(crate) fn to_py_err(err: dapple_core::Error) -> PyErr {
    Python::attach(|py| {
        let built = py
            .import("dapple.planner.errors")
            .and_then(|m| m.getattr("class_of_code"))
            .and_then(|class_of| class_of.call1((err.kind.code(),)))
            .and_then(|cls| {
                cls.call1((
                    err.to_string(),
                    err.kind.code(),
                    err.source.clone(),
                    err.field.clone(),
                ))
            });
        match built {
            Ok(instance) => PyErr::from_value(instance),
            Err(import_failed) => import_failed,
        }
    })
}

/// An error of a profile and topology used together, naming the file of
/// the one it is about (a spec topology has none; its name is in the
/// message).
pub(crate) fn with_inputs(
    e: dapple_core::Error,
    profile: &profile::PyProfile,
    topology: &topology::PyTopology,
) -> dapple_core::Error {
    let source = match e.input {
        Some(dapple_core::error::Input::Profile) => profile.source(),
        Some(dapple_core::error::Input::Topology) => topology.source.as_deref(),
        None => None,
    };
    with_source(e, source)
}

/// Set the limit on the micro-batch passes one simulation runs, for this
/// process (`schedule::set_max_passes`).
#[pyfunction]
fn set_max_passes(passes: u64) -> PyResult<()> {
    dapple_core::schedule::set_max_passes(passes).map_err(to_py_err)
}

/// The error, naming `source` (a file) unless it names one already.
pub(crate) fn with_source(e: dapple_core::Error, source: Option<&str>) -> dapple_core::Error {
    match source {
        Some(s) => e.in_source(s),
        None => e,
    }
}

/// A frozen class that wraps a core file object (`FileObject`), and the
/// file it was read from.
pub(crate) trait Wraps: Sized {
    type Core: dapple_core::FileObject;
    fn wrap(core: Self::Core, source: Option<String>) -> Self;
    fn core(&self) -> &Self::Core;
}

/// A frozen class that wraps the core's file object `$core` and the file it
/// was read from: `pub struct $class { inner, source }`, with `Wraps`.
macro_rules! file_object_class {
    ($(#[$doc:meta])* $class:ident($core:ty, $name:literal)) => {
        $(#[$doc])*
        #[pyclass(frozen, module = "dapple.planner._core", name = $name)]
        pub struct $class {
            pub(crate) inner: $core,
            /// The file it was read from, named in errors.
            #[pyo3(get)]
            pub(crate) source: Option<String>,
        }

        impl $crate::Wraps for $class {
            type Core = $core;
            fn wrap(inner: $core, source: Option<String>) -> Self {
                $class { inner, source }
            }
            fn core(&self) -> &$core {
                &self.inner
            }
        }
    };
}
pub(crate) use file_object_class;

/// The `#[pymethods]` of a class that wraps a file object: `from_json` and
/// `from_dict` (read and checked by the core, `source` naming the file in
/// errors), `to_json` and `to_dict`, then the class's own methods.
macro_rules! file_object_methods {
    ($class:ty { $($own:tt)* }) => {
        #[pymethods]
        impl $class {
            /// Parse and check JSON text; `source` names the file in errors.
            #[staticmethod]
            #[pyo3(signature = (text, source=None))]
            fn from_json(text: &str, source: Option<String>) -> PyResult<Self> {
                let core = <<Self as $crate::Wraps>::Core as dapple_core::FileObject>::from_json(text)
                    .map_err(|e| $crate::to_py_err($crate::with_source(e, source.as_deref())))?;
                Ok(<Self as $crate::Wraps>::wrap(core, source))
            }

            /// Check plain data (dicts and lists); `format` and
            /// `schema_version` may be left out: this dapple's are filled in.
            #[staticmethod]
            #[pyo3(signature = (data, source=None))]
            fn from_dict(data: &Bound<'_, PyAny>, source: Option<String>) -> PyResult<Self> {
                let value = $crate::convert::from_python(data)?;
                let core = <<Self as $crate::Wraps>::Core as dapple_core::FileObject>::from_parts(value)
                    .map_err(|e| $crate::to_py_err($crate::with_source(e, source.as_deref())))?;
                Ok(<Self as $crate::Wraps>::wrap(core, source))
            }

            /// Canonical JSON, the form files hold.
            fn to_json(&self) -> String {
                dapple_core::FileObject::to_json($crate::Wraps::core(self))
            }

            /// Plain Python data (dicts and lists), a copy.
            fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                $crate::convert::to_python(py, $crate::Wraps::core(self))
            }

            $($own)*
        }
    };
}
pub(crate) use file_object_methods;

pub(crate) fn names<'py>(
    py: Python<'py>,
    names: Vec<&'static str>,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, names)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use dapple_core::baselines::Baseline;
    use dapple_core::cluster::placement::Policy;
    use dapple_core::cost::WarmupPolicy;
    use dapple_core::schedule::ScheduleKind;
    use dapple_core::search::{SearchSpace, StageShapes};

    let py = m.py();
    m.add("__version__", dapple_core::PLANNER_VERSION)?;
    m.add("WARMUP_POLICIES", names(py, WarmupPolicy::names())?)?;
    m.add("BASELINES", names(py, Baseline::names())?)?;
    m.add("SEARCH_SPACES", names(py, SearchSpace::names())?)?;
    m.add("STAGE_SHAPES", names(py, StageShapes::names())?)?;
    m.add(
        "GRAD_REDUCE_OVERLAPS",
        names(py, dapple_core::cost::overlap::GradReduceOverlap::names())?,
    )?;
    m.add(
        "ATTENTION_KERNELS",
        names(py, dapple_core::model::kernels::AttentionKernel::names())?,
    )?;
    m.add(
        "TOKEN_DISPATCHERS",
        names(py, dapple_core::model::experts::TokenDispatcher::names())?,
    )?;
    m.add(
        "GRADIENT_PRECISIONS",
        names(
            py,
            dapple_core::model::transformer::GradientPrecision::names(),
        )?,
    )?;
    m.add("SCHEDULE_KINDS", names(py, ScheduleKind::names())?)?;
    m.add(
        "CHUNKED_SCHEDULES",
        names(py, ScheduleKind::names_where(ScheduleKind::is_chunked))?,
    )?;
    m.add(
        "ASYNCHRONOUS_SCHEDULES",
        names(py, ScheduleKind::names_where(ScheduleKind::is_asynchronous))?,
    )?;
    let searched: Vec<&str> = dapple_core::search::kinds::SEARCHED_KINDS
        .iter()
        .map(|k| k.name())
        .collect();
    m.add("SEARCHED_SCHEDULES", names(py, searched)?)?;
    let predictors = PyDict::new(py);
    for kind in ScheduleKind::ALL {
        if let Some(p) = kind.predictor() {
            predictors.set_item(kind.name(), p.name())?;
        }
    }
    m.add("SCHEDULE_PREDICTORS", predictors)?;
    m.add(
        "ASYNCHRONOUS_ROWS_ON",
        dapple_core::baselines::ASYNCHRONOUS_ROWS_ON.name(),
    )?;
    m.add("PLACEMENT_POLICIES", names(py, Policy::names())?)?;
    let presets = PyDict::new(py);
    for (name, spec) in dapple_core::cluster::topology::PRESETS {
        presets.set_item(name, spec)?;
    }
    m.add("PRESETS", presets)?;
    m.add("MAX_PASSES", dapple_core::schedule::MAX_PASSES)?;
    m.add(
        "MAX_PASSES_CEILING",
        dapple_core::schedule::MAX_PASSES_CEILING,
    )?;
    m.add_function(wrap_pyfunction!(set_max_passes, m)?)?;
    m.add(
        "DEFAULT_MAX_SEARCH_BYTES",
        dapple_core::search::DEFAULT_MAX_SEARCH_BYTES,
    )?;
    m.add(
        "DEFAULT_MAX_SEARCH_STEPS",
        dapple_core::search::DEFAULT_MAX_SEARCH_STEPS,
    )?;
    m.add("ERROR_CODES", names(py, dapple_core::ErrorKind::names())?)?;
    let formats = PyDict::new(py);
    for f in dapple_core::formats::format::FORMATS {
        formats.set_item(f.name, (f.version, f.reads.to_vec()))?;
    }
    m.add("FORMATS", formats)?;
    profile::register(m)?;
    topology::register(m)?;
    artifact::register(m)?;
    baselines::register(m)?;
    calibrate::register(m)?;
    plan::register(m)?;
    simulation::register(m)?;
    metrics::register(m)?;
    regress::register(m)?;
    search::register(m)?;
    schedule::register(m)?;
    pipeline_order::register(m)?;
    transformer::register(m)?;
    kernels::register(m)?;
    layout::register(m)?;
    Ok(())
}
