//! Clusters: topologies (machines, GPUs, links), the GPU catalog with its
//! measured figures, and where a stage's GPUs sit (placement policies).

pub mod gpus;
pub mod placement;
pub mod topology;
