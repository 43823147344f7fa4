//! dapple-core: the DAPPLE planner without Python.
//!
//! Data flows one way: a [`model::profile::Profile`] and a
//! [`cluster::topology::Topology`] go into [`search::search`], which returns a
//! [`plan::Plan`]; any plan, from here or written by hand, can be costed again
//! with [`simulation::evaluate::evaluate`]. The modules are grouped by concept,
//! each group building only on the groups before it in `CORE_LAYERS`
//! (`tests/test_structure.py`; docs/architecture.md lists them in that order).

pub mod baselines;
pub mod cluster;
pub mod cost;
pub mod error;
pub mod formats;
pub mod model;
pub mod plan;
pub mod schedule;
pub mod search;
pub mod simulation;

pub use error::{Error, ErrorKind, Result};
pub use formats::format::FileObject;

/// Version of the planner, recorded in every plan it writes.
pub const PLANNER_VERSION: &str = env!("CARGO_PKG_VERSION");
