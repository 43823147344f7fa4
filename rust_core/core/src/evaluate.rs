//! Checking a plan against its topology (and a profile) and costing it:
//! `evaluate` costs any plan, including one written by hand or by another
//! planner, with the same model the search uses, so plans can be compared
//! on equal terms.

use crate::cost::{
    alloc_size, pipeline_latency, smallest_slice, Alloc, Cluster, PipeStage, StageCost,
    StageCoster, WarmupPolicy,
};
use crate::error::{Error, Result};
use crate::plan::{
    plan_schedule, warmup_depth, Estimate, PipelinePosition, Plan, PositionKind, ScheduleChoice,
    TransferEstimate,
};
use crate::profile::{LayerCosts, Profile};
use crate::schedule::{check_passes, steady_state_mini_batches, ScheduleKind};

/// Check that `plan` can run `profile` on its topology and cost it.
pub fn evaluate(plan: &Plan, profile: &Profile) -> Result<Estimate> {
    with_coster(plan, profile, |coster, allocs, _| {
        estimate_stages(coster, plan, allocs)
    })
}

/// Check `plan` against `profile`, then run `f` with the stage coster of the
/// plan's topology and micro-batching, each stage's GPUs per machine and the
/// warm-up policy: the setup that estimating and simulating share.
pub(crate) fn with_coster<R>(
    plan: &Plan,
    profile: &Profile,
    f: impl FnOnce(&StageCoster, &[Alloc], WarmupPolicy) -> R,
) -> Result<R> {
    let (allocs, policy) = check(plan, profile)?;
    check_passes(plan.stages.len(), plan.micro_batches).map_err(|e| e.under("micro_batches"))?;
    if plan.schedule.kind.is_asynchronous() {
        // Its steady state is simulated over many mini-batches.
        steady_state_mini_batches(plan.stages.len(), plan.micro_batches)
            .map_err(|e| e.under("micro_batches"))?;
    }
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::for_model(&plan.inputs.topology, &layers)?;
    let coster = StageCoster::new(&layers, &cluster, plan.micro_batch_size, plan.micro_batches);
    Ok(f(&coster, &allocs, policy))
}

/// Cost of every stage of a checked plan, and of every transfer between
/// consecutive stages (`transfers_ms[i]`: between stages i and i+1, each
/// way). `overlap`: hide a single stage's AllReduce behind its backward.
pub(crate) fn stage_costs(
    coster: &StageCoster,
    plan: &Plan,
    allocs: &[Alloc],
    overlap: bool,
) -> (Vec<StageCost>, Vec<f64>) {
    let mut stages = Vec::with_capacity(plan.stages.len());
    let mut transfers_ms = Vec::with_capacity(plan.stages.len().saturating_sub(1));
    for (i, (s, alloc)) in plan.stages.iter().zip(allocs).enumerate() {
        if i > 0 {
            transfers_ms.push(coster.transfer(s.layer_start, &allocs[i - 1], alloc));
        }
        stages.push(match &s.slices {
            Some(slices) => coster.stage_sliced(
                s.layer_start,
                s.layer_end,
                &s.devices,
                slices,
                s.warmup_micro_batches,
                overlap,
            ),
            None => coster.stage(
                s.layer_start,
                s.layer_end,
                alloc,
                s.warmup_micro_batches,
                overlap,
            ),
        });
    }
    (stages, transfers_ms)
}

/// A stage's own slices: one per device, each at least `min_slice`,
/// summing to the micro-batch.
fn check_slices(slices: &[u32], devices: usize, micro_batch: u32, min_slice: u32) -> Result<()> {
    if slices.len() != devices {
        return Err(Error::invalid(format!(
            "{} slices for {devices} devices: give one per device, in the order of devices",
            slices.len()
        )));
    }
    if let Some((j, &small)) = slices.iter().enumerate().find(|(_, &s)| s < min_slice) {
        return Err(Error::invalid(format!(
            "slice {j} has {small} samples, below the minimum {min_slice} (the profile's smallest \
             measured batch size unless --min-micro-batch-size says otherwise)"
        )));
    }
    let total: u64 = slices.iter().map(|&s| u64::from(s)).sum();
    if total != u64::from(micro_batch) {
        return Err(Error::invalid(format!(
            "value {slices:?} adds up to {total} samples, not the micro-batch size {micro_batch}"
        )));
    }
    Ok(())
}

/// Check that `plan` can run `profile` on its topology; returns each
/// stage's GPUs per machine and the warm-up policy.
pub(crate) fn check(plan: &Plan, profile: &Profile) -> Result<(Vec<Alloc>, WarmupPolicy)> {
    let allocs = check_layout(plan, Some(profile))?;
    Ok((allocs, plan.schedule.warmup_policy))
}

/// Check that `plan`'s stages can run on its topology: batch sizes that
/// agree, stages that follow each other from layer 0, devices that exist
/// and are used once, slices of at least the minimum, and warm-up depths
/// its schedule can run. With `profile`, also that the plan was made from
/// it and covers its layers; without, the layer count is the runtime's to
/// check against the model. Returns each stage's GPUs per machine.
pub fn check_layout(plan: &Plan, profile: Option<&Profile>) -> Result<Vec<Alloc>> {
    let topology = &plan.inputs.topology;
    let n = profile.map(|p| p.layers.len());
    let num_devices = topology.num_devices();
    if plan.stages.is_empty() {
        return Err(Error::field("stages", "a plan needs at least one stage"));
    }
    if plan.micro_batch_size == 0 {
        return Err(Error::field("micro_batch_size", "value 0 must be >= 1"));
    }
    if plan.micro_batches == 0 {
        return Err(Error::field("micro_batches", "value 0 must be >= 1"));
    }
    let gbs = plan.inputs.global_batch_size;
    if plan.micro_batch_size.checked_mul(plan.micro_batches) != Some(gbs) {
        return Err(Error::field(
            "micro_batches",
            format!(
                "micro_batch_size {} x micro_batches {} is not the global batch size {gbs}",
                plan.micro_batch_size, plan.micro_batches
            ),
        ));
    }
    let ScheduleChoice {
        kind,
        warmup_policy: policy,
    } = plan.schedule;
    let expected_hash = &plan.inputs.profile_sha256;
    if let Some(profile) = profile {
        if !expected_hash.is_empty() && *expected_hash != profile.sha256() {
            let mut e = Error::incompatible(format!(
                "the plan was made from another profile (sha256 {}..., this one is {}...)",
                // Characters, not bytes: a hand-edited hash may not be ASCII.
                expected_hash.chars().take(12).collect::<String>(),
                &profile.sha256()[..12]
            ));
            e.field = Some("inputs.profile_sha256".into());
            return Err(e);
        }
    }
    let mut expected_start = 0;
    // The stage that uses each device so far.
    let mut used_by: Vec<Option<usize>> = vec![None; num_devices as usize];
    let cluster = Cluster::new(topology);
    let mut allocs: Vec<Alloc> = Vec::with_capacity(plan.stages.len());
    for (i, s) in plan.stages.iter().enumerate() {
        let at = |f: &str| format!("stages[{i}].{f}");
        if s.layer_start != expected_start {
            return Err(Error::field(
                at("layer_start"),
                format!(
                    "value {} leaves a gap or overlap: the previous stage ends at {expected_start}",
                    s.layer_start
                ),
            ));
        }
        if s.layer_end <= s.layer_start || n.is_some_and(|n| s.layer_end > n) {
            let range = match n {
                Some(n) => format!(
                    "in {}..={n} (the profile has {n} layers)",
                    s.layer_start + 1
                ),
                None => format!("above layer_start {}", s.layer_start),
            };
            return Err(Error::field(
                at("layer_end"),
                format!("value {} must be {range}", s.layer_end),
            ));
        }
        expected_start = s.layer_end;
        if s.devices.is_empty() {
            return Err(Error::field(
                at("devices"),
                "a stage needs at least one device",
            ));
        }
        let alloc = cluster
            .alloc_of(&s.devices)
            .map_err(|e| e.under(&at("devices")))?;
        for &d in &s.devices {
            if let Some(other) = used_by[d as usize].replace(i) {
                let why = if other == i {
                    format!("device {d} is listed twice")
                } else {
                    format!("device {d} is used by two stages (also stages[{other}])")
                };
                return Err(Error::field(at("devices"), why));
            }
        }
        let replicas = alloc_size(&alloc);
        let min_slice = plan.inputs.options.min_micro_batch_size;
        if let Some(slices) = &s.slices {
            check_slices(
                slices,
                s.devices.len(),
                plan.micro_batch_size,
                min_slice.max(1),
            )
            .map_err(|e| e.under(&at("slices")))?;
        } else if smallest_slice(plan.micro_batch_size, replicas) < min_slice.max(1) {
            return Err(Error::field(
                at("devices"),
                format!(
                    "{replicas} replicas split micro-batch {} into slices of {} samples, below the minimum {} \
                     (the profile's smallest measured batch size unless --min-micro-batch-size says otherwise)",
                    plan.micro_batch_size,
                    smallest_slice(plan.micro_batch_size, replicas),
                    min_slice.max(1)
                ),
            ));
        }
        let stages_from_here = (plan.stages.len() - i) as u32;
        let k = s.warmup_micro_batches;
        let m = plan.micro_batches;
        match warmup_depth(kind, policy, stages_from_here, m) {
            Some(expected) if k != expected => {
                let why = match kind {
                    ScheduleKind::GPipe => "GPipe runs all micro-batches forward first".to_string(),
                    ScheduleKind::EarlyBackward1F1B => {
                        format!("warm-up policy {} gives this stage", policy.name())
                    }
                    asynchronous => {
                        format!("{asynchronous} runs one micro-batch ahead per stage from here")
                    }
                };
                return Err(Error::field(
                    at("warmup_micro_batches"),
                    format!("value {k} differs from K_i = {expected} that {why}; fix one of them"),
                ));
            }
            Some(_) => {}
            None if !(1..=m).contains(&k) => {
                return Err(Error::field(
                    at("warmup_micro_batches"),
                    format!("value {k} must be in 1..={m} (the plan's micro-batches)"),
                ));
            }
            None => {
                // A stage that waits for more forwards than the stage before
                // it sends ahead of its own first backward deadlocks.
                if let Some(prev) = plan.stages[..i].last().map(|p| p.warmup_micro_batches) {
                    if k > prev {
                        return Err(Error::field(
                            at("warmup_micro_batches"),
                            format!(
                                "value {k} is deeper than stage {}'s {prev}: early backward deadlocks \
                                 unless K_i never grows along the pipeline",
                                i - 1
                            ),
                        ));
                    }
                }
            }
        }
        allocs.push(alloc);
    }
    match n {
        Some(n) if expected_start != n => Err(Error::field(
            format!("stages[{}].layer_end", plan.stages.len() - 1),
            format!("value {expected_start}: the stages must cover all {n} layers of the profile"),
        )),
        _ => Ok(allocs),
    }
}

/// Cost a plan whose stages have already been checked: formula (2) and
/// its terms, and the simulated iteration of the plan's own schedule.
pub(crate) fn estimate_stages(coster: &StageCoster, plan: &Plan, allocs: &[Alloc]) -> Estimate {
    let (costs, transfers_ms) = stage_costs(coster, plan, allocs, plan.stages.len() == 1);
    let mut pipe: Vec<PipeStage> = Vec::new();
    let mut stages = Vec::new();
    let mut transfers = Vec::new();
    for (i, (s, c)) in plan.stages.iter().zip(&costs).enumerate() {
        if i > 0 {
            let t = transfers_ms[i - 1];
            let bytes = coster.layers.cut_bytes_per_sample(s.layer_start)
                * f64::from(plan.micro_batch_size);
            transfers.push(TransferEstimate {
                bytes,
                fwd_ms: t,
                bwd_ms: t,
            });
            pipe.push(PipeStage::transfer(t));
        }
        pipe.push(c.as_pipe_stage());
        stages.push(*c);
    }
    let sim_stages = crate::simulate::sim_stages(coster.layers, plan, &costs);
    if plan.schedule.kind.is_asynchronous() {
        return asynchronous_estimate(coster, plan, stages, transfers, &sim_stages, &transfers_ms);
    }
    let lat = pipeline_latency(&pipe, plan.micro_batches);
    // A checked plan's own schedule always builds and runs.
    let simulation = plan_schedule(plan, None).and_then(|schedule| {
        crate::simulate::simulate_stages(&sim_stages, &transfers_ms, &schedule, false)
    });
    let iteration_ms = match &simulation {
        Ok(sim) => {
            for (st, timeline) in stages.iter_mut().zip(&sim.stages) {
                st.bubble_ms = Some(sim.iteration_ms - timeline.compute_ms);
            }
            Some(sim.iteration_ms)
        }
        Err(e) => unreachable!("a checked plan simulates: {e}"),
    };
    let headline = iteration_ms.unwrap_or(lat.latency_ms);
    let single = coster.single_device_ms();
    let (peak, fits) = peak_and_fit(&stages);
    Estimate {
        iteration_ms,
        latency_ms: lat.latency_ms,
        warmup_ms: lat.warmup_ms,
        steady_ms: lat.steady_ms,
        ending_ms: lat.ending_ms,
        pivot: position(lat.pivot),
        paper_pivot: position(lat.paper_pivot),
        paper_latency_ms: lat.paper_latency_ms,
        single_device_ms: single,
        speedup: single / headline,
        samples_per_second: f64::from(plan.inputs.global_batch_size) / headline * 1e3,
        peak_memory_bytes: peak,
        fits_memory: fits,
        stages,
        transfers,
    }
}

/// The estimate of a plan with an asynchronous schedule: its simulated
/// steady state (`iteration_ms`, time per mini-batch) and the bound it
/// cannot beat, the busiest stage or link per mini-batch (every forward,
/// re-computed forward and backward, and the AllReduce; or every transfer
/// one way), in `latency_ms` and `steady_ms`, with no warm-up or ending
/// (the pipeline never drains). Memory is the simulation's: inputs kept for
/// re-computation, weight copies, XPipe's own moments.
fn asynchronous_estimate(
    coster: &StageCoster,
    plan: &Plan,
    mut stages: Vec<StageCost>,
    transfers: Vec<TransferEstimate>,
    sim_stages: &[crate::simulate::SimStage],
    transfers_ms: &[f64],
) -> Estimate {
    let m = f64::from(plan.micro_batches);
    let simulation = plan_schedule(plan, None).and_then(|schedule| {
        crate::simulate::simulate_stages(sim_stages, transfers_ms, &schedule, true)
    });
    let sim = match simulation {
        Ok(sim) => sim,
        Err(e) => unreachable!("a checked plan simulates: {e}"),
    };
    // Pipe positions as formula (2) numbers them: stage i at 2i, the link
    // after it at 2i + 1.
    let mut busiest = (0.0f64, 0usize);
    for (i, (st, timeline)) in stages.iter_mut().zip(&sim.stages).enumerate() {
        let work = m * (2.0 * st.fwd_ms + st.bwd_ms) + st.exposed_allreduce_ms;
        st.memory_bytes = timeline.peak_memory_bytes;
        st.bubble_ms = Some((sim.iteration_ms - m * (2.0 * st.fwd_ms + st.bwd_ms)).max(0.0));
        if work > busiest.0 {
            busiest = (work, 2 * i);
        }
    }
    for (i, t) in transfers_ms.iter().enumerate() {
        if m * t > busiest.0 {
            busiest = (m * t, 2 * i + 1);
        }
    }
    let single = coster.single_device_ms();
    let (peak, fits) = peak_and_fit(&stages);
    Estimate {
        iteration_ms: Some(sim.iteration_ms),
        latency_ms: busiest.0,
        warmup_ms: 0.0,
        steady_ms: busiest.0,
        ending_ms: 0.0,
        pivot: position(busiest.1),
        paper_pivot: position(busiest.1),
        paper_latency_ms: busiest.0,
        single_device_ms: single,
        speedup: single / sim.iteration_ms,
        samples_per_second: f64::from(plan.inputs.global_batch_size) / sim.iteration_ms * 1e3,
        peak_memory_bytes: peak,
        fits_memory: fits,
        stages,
        transfers,
    }
}

/// The largest stage memory, and whether every stage fits its GPU.
fn peak_and_fit(stages: &[StageCost]) -> (f64, bool) {
    let peak = stages.iter().map(|s| s.memory_bytes).fold(0.0, f64::max);
    let fits = stages
        .iter()
        .all(|s| s.memory_bytes <= s.memory_limit_bytes);
    (peak, fits)
}

/// Pipe-stage index (computation and communication interleaved) to a
/// position users can read.
fn position(pipe_index: usize) -> PipelinePosition {
    PipelinePosition {
        kind: if pipe_index.is_multiple_of(2) {
            PositionKind::Stage
        } else {
            PositionKind::Transfer
        },
        index: pipe_index / 2,
    }
}
