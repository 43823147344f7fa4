//! File formats: the versioned JSON envelope every file shares, and enums
//! spelled by name.

pub mod format;
pub mod names;
