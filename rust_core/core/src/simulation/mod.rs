//! Costing plans: the setup every costing shares (`costing`), the estimate
//! of any plan (`evaluate`), the event simulator that runs its action lists
//! (`simulate`), warm-up depths chosen by simulating them (`warmup`, with
//! early backward's fast replay, `early_backward`), and measured runs read
//! back (`metrics`, `calibrate`).

pub mod calibrate;
pub(crate) mod costing;
pub mod early_backward;
pub mod evaluate;
pub mod metrics;
pub mod simulate;
pub mod warmup;
