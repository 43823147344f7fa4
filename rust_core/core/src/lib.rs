//! dapple-core: the DAPPLE planner without Python.
//!
//! Data flows one way: a [`profile::Profile`] and a [`topology::Topology`]
//! go into [`search::search`], which returns a [`plan::Plan`]; any plan, from
//! here or written by hand, can be costed again with [`evaluate::evaluate`].

pub mod artifact;
pub mod asynchronous;
pub mod balance;
pub mod baselines;
pub mod block_partition;
pub mod calibrate;
pub mod context;
pub mod cost;
mod costing;
pub mod early_backward;
pub mod error;
pub mod evaluate;
pub mod experts;
pub mod format;
pub mod gpus;
pub mod hints;
pub mod interleave;
pub mod kernels;
pub mod layout;
pub mod megatron;
pub mod metrics;
pub mod names;
pub mod overlap;
pub mod pipedream;
pub mod pipeline_order;
pub mod placement;
pub mod plan;
pub mod profile;
mod range_table;
pub mod regress;
pub mod schedule;
pub mod search;
pub mod shape;
pub mod sharding;
pub mod simulate;
pub mod split;
pub mod topology;
pub mod transformer;
pub mod warmup;
pub mod work_limit;

pub use error::{Error, ErrorKind, Result};
pub use format::FileObject;

/// Version of the planner, recorded in every plan it writes.
pub const PLANNER_VERSION: &str = env!("CARGO_PKG_VERSION");
