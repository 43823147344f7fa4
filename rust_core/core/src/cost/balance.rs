//! Whale's intra-stage load balancing (Whale section 3.3.1, Algorithm 1):
//! how many samples of each micro-batch every replica of a stage takes when
//! its GPUs differ in speed and memory. A pure function on plain numbers.
//!
//! 1. Each device's share starts in proportion to its speed (whole samples,
//!    at least `min_slice` each), which balances compute.
//! 2. Memory-constraint balancing: while some device is over its memory,
//!    the most over-full one (`peak`) gives samples to the device with room
//!    for at least one more sample and the lowest compute load
//!    (`valley`: samples over speed), until no device is over (done) or no
//!    device has room (infeasible).
//!
//! Whale's text leaves two points open; the reading here:
//! - **Whole samples.** The shares are rounded so that the slowest replica
//!   finishes as early as whole samples allow (`proportional_slices`); they
//!   sum to the micro-batch and no device is more than one sample off its
//!   share.
//! - **The amount moved (b).** Whale moves "the maximum number that the
//!   valley device will not go OOM after getting the load". Here it is that
//!   maximum, capped by what the peak must shed to fit and by what it can
//!   give without going below `min_slice`: moving more than the peak needs
//!   would unbalance compute for no memory gain.

use crate::error::{Error, Result};

/// One replica's device as the balancing sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceDevice {
    /// Relative compute speed (samples per unit time, any common unit).
    pub speed: f64,
    pub memory_bytes: f64,
    /// Memory taken whatever the slice: weights, gradients, optimizer state.
    pub fixed_bytes: f64,
    /// Memory each sample of the slice adds (activations in flight).
    pub bytes_per_sample: f64,
}

impl BalanceDevice {
    fn memory_at(&self, slice: u32) -> f64 {
        self.fixed_bytes + f64::from(slice) * self.bytes_per_sample
    }

    /// Most samples that fit in memory.
    fn most_samples(&self) -> u32 {
        if self.fixed_bytes > self.memory_bytes {
            return 0;
        }
        if self.bytes_per_sample <= 0.0 {
            return u32::MAX;
        }
        ((self.memory_bytes - self.fixed_bytes) / self.bytes_per_sample)
            .floor()
            .min(f64::from(u32::MAX)) as u32
    }
}

/// Samples per device in proportion to speed, whole, summing to `samples`,
/// each at least `min_slice` (step 1). The shares are those of the samples
/// in proportion to speed, devices whose share is below `min_slice` held at
/// it (the others share what is left); each share is rounded down, and the
/// samples that leaves over go one at a time to the device that would
/// finish its slice first. That makes the slowest replica as fast as whole
/// samples allow (rounding each share to the nearest can leave a fast
/// device idle: 4.8 and 3.2 samples round to 5 and 3, but 4.4 and 3.6 both
/// to 4). Ties go to the earlier device.
pub fn proportional_slices(speeds: &[f64], samples: u32, min_slice: u32) -> Result<Vec<u32>> {
    let n = speeds.len();
    if n == 0 || u64::from(min_slice) * n as u64 > u64::from(samples) {
        return Err(Error::incompatible(format!(
            "{samples} samples cannot give {n} devices at least {min_slice} each"
        )));
    }
    // Which devices sit at the minimum: a device held there gives the
    // others less to share, which can hold another (at most n rounds).
    let mut held = vec![false; n];
    let (free_samples, free_speed) = loop {
        let count = held.iter().filter(|&&h| h).count() as u32;
        let free_samples = f64::from(samples - min_slice * count);
        let free_speed: f64 = (0..n).filter(|&i| !held[i]).map(|i| speeds[i]).sum();
        let newly: Vec<usize> = (0..n)
            .filter(|&i| !held[i] && free_samples * speeds[i] / free_speed < f64::from(min_slice))
            .collect();
        if newly.is_empty() {
            break (free_samples, free_speed);
        }
        for i in newly {
            held[i] = true;
        }
    };
    let mut slices: Vec<u32> = (0..n)
        .map(|i| {
            if held[i] {
                min_slice
            } else {
                (free_samples * speeds[i] / free_speed).floor() as u32
            }
        })
        .collect();
    // Rounding down leaves fewer samples than devices over.
    let left = samples - slices.iter().sum::<u32>();
    for _ in 0..left {
        let finish = |i: usize| f64::from(slices[i] + 1) / speeds[i];
        let first = (0..n)
            .min_by(|&a, &b| finish(a).total_cmp(&finish(b)).then(a.cmp(&b)))
            .expect("devices");
        slices[first] += 1;
    }
    Ok(slices)
}

/// Whale's Algorithm 1: the slices of `samples` over `devices` (step 1,
/// then step 2 while memory is over). Infeasible when no shift can bring
/// every device within its memory.
pub fn balanced_slices(
    devices: &[BalanceDevice],
    samples: u32,
    min_slice: u32,
) -> Result<Vec<u32>> {
    let speeds: Vec<f64> = devices.iter().map(|d| d.speed).collect();
    let mut slices = proportional_slices(&speeds, samples, min_slice)?;
    let utilisation =
        |i: usize, slices: &[u32]| devices[i].memory_at(slices[i]) / devices[i].memory_bytes;
    loop {
        let over: Vec<usize> = (0..devices.len())
            .filter(|&i| devices[i].memory_at(slices[i]) > devices[i].memory_bytes)
            .collect();
        let Some(&peak) = over.iter().max_by(|&&a, &&b| {
            utilisation(a, &slices)
                .total_cmp(&utilisation(b, &slices))
                .then(b.cmp(&a))
        }) else {
            return Ok(slices);
        };
        let room = |i: usize| devices[i].most_samples().saturating_sub(slices[i]);
        let load = |i: usize| f64::from(slices[i]) / devices[i].speed;
        let valley = (0..devices.len())
            .filter(|&i| i != peak && room(i) > 0)
            .min_by(|&a, &b| load(a).total_cmp(&load(b)).then(a.cmp(&b)));
        let shed = slices[peak] - devices[peak].most_samples().min(slices[peak]);
        let can_give = slices[peak] - min_slice;
        let Some(valley) = valley.filter(|_| can_give > 0) else {
            let d = &devices[peak];
            return Err(Error::infeasible(format!(
                "device {peak} needs {:.2} GiB for {} samples and has {:.2} GiB, and no device \
                 has room to take samples from it{}",
                d.memory_at(slices[peak]) / GIB,
                slices[peak],
                d.memory_bytes / GIB,
                if can_give == 0 {
                    format!(" (it is at the smallest slice, {min_slice})")
                } else {
                    String::new()
                }
            )));
        };
        let b = room(valley).min(shed).min(can_give);
        slices[peak] -= b;
        slices[valley] += b;
    }
}

const GIB: f64 = (1u64 << 30) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    /// (speed, memory GiB, fixed GiB, GiB per sample)
    fn devices(table: &[(f64, f64, f64, f64)]) -> Vec<BalanceDevice> {
        table
            .iter()
            .map(|&(speed, memory, fixed, per_sample)| BalanceDevice {
                speed,
                memory_bytes: memory * GIB,
                fixed_bytes: fixed * GIB,
                bytes_per_sample: per_sample * GIB,
            })
            .collect()
    }

    #[test]
    fn shares_follow_speed_in_whole_samples() {
        // speed    share of 16          rounded down   the last sample
        // 1.0      16 / 1.675 = 9.55    9              to 10: finishes at 10
        // 0.675    6.45                 6              (7 would finish at 10.4)
        assert_eq!(
            proportional_slices(&[1.0, 0.675], 16, 1).unwrap(),
            vec![10, 6]
        );
        // equal speeds, what is left to the earlier devices
        assert_eq!(
            proportional_slices(&[1.0, 1.0, 1.0], 8, 1).unwrap(),
            vec![3, 3, 2]
        );
        // V100 x2 + P100 x2 at 0.675, 32 samples: 9, 9, 6, 6, then two to the V100s
        assert_eq!(
            proportional_slices(&[1.0, 1.0, 0.675, 0.675], 32, 1).unwrap(),
            vec![10, 10, 6, 6]
        );
        // 8 V100 + 8 P100, micro-batch 64: shares 4.78 and 3.22, rounded
        // down 4 and 3, the 8 left to the V100s (5 finishes before 4 / 0.675 = 5.9).
        let mixed = [[1.0; 8], [0.675; 8]].concat();
        assert_eq!(
            proportional_slices(&mixed, 64, 2).unwrap(),
            [[5; 8], [3; 8]].concat()
        );
        // GNMT's 2048 with at least 64 each: shares 152.8 and 103.2 (both
        // above 64), so 153 and 103, the P100s finishing at 152.6.
        assert_eq!(
            proportional_slices(&mixed, 2048, 64).unwrap(),
            [[153; 8], [103; 8]].concat()
        );
        // A device whose share is below the minimum is held at it, and the
        // others share the rest: 0.1 of 12 is 1.1 < 2.
        assert_eq!(
            proportional_slices(&[1.0, 0.1], 12, 2).unwrap(),
            vec![10, 2]
        );
        assert!(proportional_slices(&[1.0, 1.0], 1, 1).is_err());
    }

    #[test]
    fn what_fits_stays_proportional() {
        //      speed  mem  fixed  per sample -> slices
        // V100 1.0    32   4      1.0           10 (14 GiB)
        // P100 0.675  16   4      1.0           6  (10 GiB)
        let d = devices(&[(1.0, 32.0, 4.0, 1.0), (0.675, 16.0, 4.0, 1.0)]);
        assert_eq!(balanced_slices(&d, 16, 1).unwrap(), vec![10, 6]);
    }

    #[test]
    fn an_overloaded_p100_sheds_samples_to_a_v100() {
        //      speed  mem  fixed  per sample  proportional    after
        // V100 1.0    32   10     1.0         10 (20 GiB)     11 (21 GiB)
        // P100 0.675  16   11     1.0         6  (17 > 16)    5  (16 GiB)
        // The P100 fits 5 samples, so it sheds 1; the V100 has room for 12.
        let d = devices(&[(1.0, 32.0, 10.0, 1.0), (0.675, 16.0, 11.0, 1.0)]);
        assert_eq!(balanced_slices(&d, 16, 1).unwrap(), vec![11, 5]);
        // Two P100s over, two V100s with room: each P100 sheds to the V100
        // with the lowest load at that moment.
        //      proportional 10,10,6,6 (32 samples); a P100 fits 4 samples
        //      (8 + 4 x 2 = 16 GiB), a V100 12 (8 + 12 x 2 = 32 GiB)
        let d = devices(&[
            (1.0, 32.0, 8.0, 2.0),
            (1.0, 32.0, 8.0, 2.0),
            (0.675, 16.0, 8.0, 2.0),
            (0.675, 16.0, 8.0, 2.0),
        ]);
        // P100 2 sheds 2 to V100 0 (load 10, the lower index of a tie), then
        // P100 3 sheds 2 to V100 1, the only one with room left.
        assert_eq!(balanced_slices(&d, 32, 1).unwrap(), vec![12, 12, 4, 4]);
    }

    #[test]
    fn nothing_fits_is_infeasible_and_says_why() {
        // Both devices are over whatever the split: 16 samples need
        // 2 x 10 + 16 = 36 GiB of 32 in all.
        let d = devices(&[(1.0, 16.0, 10.0, 1.0), (1.0, 16.0, 10.0, 1.0)]);
        let e = balanced_slices(&d, 16, 1).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Infeasible);
        assert!(e.message.contains("no device has room"), "{}", e.message);
        // The model state alone does not fit: no slice is small enough.
        let d = devices(&[(1.0, 16.0, 20.0, 0.1), (1.0, 32.0, 1.0, 0.1)]);
        let e = balanced_slices(&d, 4, 1).unwrap_err();
        assert!(e.message.contains("smallest slice"), "{}", e.message);
    }
}
