//! Models as the planner sees them: profiles (layers' times, memory and how
//! each splits, spreads experts or cuts its sequence) and the profiles made
//! without a GPU, from a transformer's configuration and a kernel model, or
//! imported from the DAPPLE artifact's text profiles.

pub mod artifact;
pub mod context;
pub mod experts;
pub mod kernels;
pub mod profile;
pub(crate) mod range_table;
pub mod split;
pub mod transformer;
