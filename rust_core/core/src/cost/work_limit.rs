//! The work limit of one simulation: how many micro-batch passes one
//! schedule may hold (`MAX_PASSES`, `--max-passes`). Schedules, pipeline
//! orders and the search all ask it; it asks nothing of them.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Most micro-batch passes (stages x micro-batches) one schedule may hold,
/// by default. Simulating a schedule costs time and memory in proportion to
/// them (about 1.1 KB a pass), and the search simulates each candidate many
/// times to choose its warm-up depths. At the limit `dapple simulate` takes
/// 0.8 s and 285 MB, and a search over sizes up to it (BERT-48, 2^21
/// samples on 2x8) 6.5 s and 190 MB (`benchmarks/README.md`). A plan above
/// it is refused (`ErrorKind::Limit`); the search and the baselines leave
/// out the micro-batch sizes that would pass it. `set_max_passes` raises it
/// for the process (`--max-passes`), up to [`MAX_PASSES_CEILING`].
pub const MAX_PASSES: u64 = 1 << 18;

/// The most `set_max_passes` accepts: 2^24 passes, about 18 GB to simulate.
pub const MAX_PASSES_CEILING: u64 = 1 << 24;

static PASSES_LIMIT: AtomicU64 = AtomicU64::new(MAX_PASSES);

/// The limit on the micro-batch passes of one schedule in this process.
pub fn max_passes() -> u64 {
    PASSES_LIMIT.load(Ordering::Relaxed)
}

/// Set the limit of [`max_passes`] for this process: a command-line
/// option's, for one command. 1..=[`MAX_PASSES_CEILING`].
pub fn set_max_passes(passes: u64) -> Result<()> {
    if !(1..=MAX_PASSES_CEILING).contains(&passes) {
        return Err(Error::field(
            "max_passes",
            format!("value {passes} must be in 1..={MAX_PASSES_CEILING}"),
        ));
    }
    PASSES_LIMIT.store(passes, Ordering::Relaxed);
    Ok(())
}

/// Whether `num_stages` x `micro_batches` is within [`max_passes`].
pub fn within_passes(num_stages: usize, micro_batches: u32) -> bool {
    num_stages as u64 * u64::from(micro_batches) <= max_passes()
}

/// [`within_passes`], or a limit error saying what to do.
pub fn check_passes(num_stages: usize, micro_batches: u32) -> Result<()> {
    if within_passes(num_stages, micro_batches) {
        return Ok(());
    }
    Err(Error::limit(format!(
        "{num_stages} stages x {micro_batches} micro-batches is over the limit of {} \
         micro-batch passes one simulation runs (its time and memory grow with them); \
         use fewer, larger micro-batches, or raise the limit (--max-passes)",
        max_passes()
    )))
}
