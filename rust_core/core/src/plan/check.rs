//! Whether a plan can run: its batching, its stages' layers, devices and
//! slices on its own topology, and warm-up depths its schedule can run;
//! with a profile, also that the plan was made from it and covers its
//! layers. Nothing here costs a plan (that is `simulation/evaluate.rs`'s), so a plan
//! file is checked on reading without the cost model.

use crate::cost::shape::{Recompute, StageShape};
use crate::cost::{smallest_slice, Alloc, Cluster, WarmupPolicy};
use crate::error::{Error, Result};
use crate::model::profile::Profile;
use crate::schedule::ScheduleKind;

use super::{warmup_depth, Plan, ScheduleChoice, Stage};

/// Check that `plan` can run `profile` on its topology; returns each
/// stage's GPUs per machine and the warm-up policy.
pub fn check(plan: &Plan, profile: &Profile) -> Result<(Vec<Alloc>, WarmupPolicy)> {
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
    let hash = profile.map(Profile::sha256);
    check_layout_hashed(plan, profile.zip(hash.as_deref()))
}

/// [`check_layout`] with the profile's hash given beside it.
pub(crate) fn check_layout_hashed(
    plan: &Plan,
    profile: Option<(&Profile, &str)>,
) -> Result<Vec<Alloc>> {
    check_batching(plan)?;
    if let Some((_, hash)) = profile {
        check_made_from(plan, hash)?;
    }
    let profile = profile.map(|(p, _)| p);
    let layers = profile.map(|p| p.layers.len());
    let cluster = Cluster::new(&plan.inputs.topology);
    // The stage that uses each device so far.
    let mut used_by: Vec<Option<usize>> = vec![None; plan.inputs.topology.num_devices() as usize];
    let mut allocs: Vec<Alloc> = Vec::with_capacity(plan.stages.len());
    let mut expected_start = 0;
    let chunk_depths = check_chunks(plan)?;
    let stage_ranks = plan.stage_ranks();
    for (i, s) in plan.stages.iter().enumerate() {
        let at = format!("stages[{i}]");
        check_stage_layers(s, expected_start, layers).map_err(|e| e.under(&at))?;
        expected_start = s.layer_end;
        // A rank's later chunks run on its first chunk's devices, as it.
        let rank_first = stage_ranks[..i].iter().position(|&r| r == stage_ranks[i]);
        if let Some(j) = rank_first {
            check_same_rank(s, &plan.stages[j], j).map_err(|e| e.under(&at))?;
            check_stage_shape(plan, s, &cluster, &allocs[j], profile).map_err(|e| e.under(&at))?;
            check_warmup(plan, i, chunk_depths.as_deref()).map_err(|e| e.under(&at))?;
            allocs.push(allocs[j].clone());
            continue;
        }
        let alloc = check_stage_devices(s, i, &cluster, &mut used_by).map_err(|e| e.under(&at))?;
        // A bad t is refused below; `replicas` counts it as one replica till then.
        check_stage_slices(plan, s, s.replicas()).map_err(|e| e.under(&at))?;
        check_stage_shape(plan, s, &cluster, &alloc, profile).map_err(|e| e.under(&at))?;
        check_warmup(plan, i, chunk_depths.as_deref()).map_err(|e| e.under(&at))?;
        allocs.push(alloc);
    }
    match layers {
        Some(n) if expected_start != n => Err(Error::field(
            format!("stages[{}].layer_end", plan.stages.len() - 1),
            format!("value {expected_start}: the stages must cover all {n} layers of the profile"),
        )),
        _ => Ok(allocs),
    }
}

/// At least one stage, and micro-batches that make up the global batch.
fn check_batching(plan: &Plan) -> Result<()> {
    if plan.stages.is_empty() {
        return Err(Error::field("stages", "a plan needs at least one stage"));
    }
    if plan.micro_batch_size == 0 {
        return Err(Error::field("micro_batch_size", "value 0 must be >= 1"));
    }
    if plan.micro_batches == 0 {
        return Err(Error::field("micro_batches", "value 0 must be >= 1"));
    }
    if plan.schedule.kind == ScheduleKind::ZeroBubbleH1 {
        // torch's order runs the micro-batches in equal rounds.
        crate::schedule::Schedule::zero_bubble_h1(plan.stages.len(), plan.micro_batches)
            .map_err(|e| e.under("micro_batches"))?;
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
    Ok(())
}

/// `schedule.chunks` is 1 but for a chunked kind, whose stages make ranks
/// of that many chunks each and whose order builds for the plan's
/// micro-batches; returns the depth the order gives each stage there.
fn check_chunks(plan: &Plan) -> Result<Option<Vec<u32>>> {
    let ScheduleChoice { kind, chunks, .. } = plan.schedule;
    if !kind.is_chunked() {
        if chunks != 1 {
            return Err(Error::field(
                "schedule.chunks",
                format!("value {chunks}: {kind} runs one stage a rank; drop chunks or choose a chunked kind"),
            ));
        }
        return Ok(None);
    }
    let stages = plan.stages.len();
    if chunks == 0 || !stages.is_multiple_of(chunks as usize) {
        return Err(Error::field(
            "schedule.chunks",
            format!("value {chunks}: the plan's {stages} stages must make ranks of {chunks} chunks each"),
        ));
    }
    let order = plan.chunked_order().map_err(|e| match e.field {
        Some(_) => e.under("schedule"),
        None => e.under("micro_batches"),
    })?;
    Ok(Some(order.forwards_before_first_backward()))
}

/// Stage `s`, a later chunk of the rank whose first chunk is stage `j`,
/// runs on the same devices, slices and shape (its expert degree apart):
/// a rank holds one copy of each, whatever it computes.
fn check_same_rank(s: &Stage, first: &Stage, j: usize) -> Result<()> {
    let differs = |field: &str| {
        Err(Error::field(
            field,
            format!("differs from stages[{j}]'s: the chunks of a rank run on its devices, alike"),
        ))
    };
    if s.devices != first.devices {
        return differs("devices");
    }
    if s.slices != first.slices {
        return differs("slices");
    }
    if s.shape.tensor_parallel != first.shape.tensor_parallel {
        return differs("tensor_parallel");
    }
    if s.shape.shard_level != first.shape.shard_level {
        return differs("shard_level");
    }
    if s.shape.reshard_after_forward != first.shape.reshard_after_forward {
        return differs("reshard_after_forward");
    }
    // The expert degree and expert tensor degree may differ: they group
    // the GPUs of the chunks that have experts, and a chunk without any
    // has none to spread.
    Ok(())
}

/// The plan was made from the profile of hash `profile_sha256`, where it
/// records which (an empty hash is a hand-written plan's "unknown").
fn check_made_from(plan: &Plan, profile_sha256: &str) -> Result<()> {
    let expected_hash = &plan.inputs.profile_sha256;
    if expected_hash.is_empty() || expected_hash == profile_sha256 {
        return Ok(());
    }
    let mut e = Error::incompatible(format!(
        "the plan was made from another profile (sha256 {}..., this one is {}...)",
        // Characters, not bytes: a hand-edited hash may not be ASCII.
        expected_hash.chars().take(12).collect::<String>(),
        &profile_sha256[..12]
    ));
    e.field = Some("inputs.profile_sha256".into());
    Err(e)
}

/// The stage starts where the previous one ended and holds at least one
/// layer of the profile's `layers` (when known). Errors name the stage's
/// own field (`layer_start`, `layer_end`).
fn check_stage_layers(s: &Stage, expected_start: usize, layers: Option<usize>) -> Result<()> {
    if s.layer_start != expected_start {
        return Err(Error::field(
            "layer_start",
            format!(
                "value {} leaves a gap or overlap: the previous stage ends at {expected_start}",
                s.layer_start
            ),
        ));
    }
    if s.layer_end <= s.layer_start || layers.is_some_and(|n| s.layer_end > n) {
        let range = match layers {
            Some(n) => format!(
                "in {}..={n} (the profile has {n} layers)",
                s.layer_start + 1
            ),
            None => format!("above layer_start {}", s.layer_start),
        };
        return Err(Error::field(
            "layer_end",
            format!("value {} must be {range}", s.layer_end),
        ));
    }
    Ok(())
}

/// Stage `i`'s devices exist and no other stage (nor this one twice) uses
/// them; `used_by` records them. Returns the stage's GPUs per machine.
fn check_stage_devices(
    s: &Stage,
    i: usize,
    cluster: &Cluster,
    used_by: &mut [Option<usize>],
) -> Result<Alloc> {
    if s.devices.is_empty() {
        return Err(Error::field("devices", "a stage needs at least one device"));
    }
    let alloc = cluster
        .alloc_of(&s.devices)
        .map_err(|e| e.under("devices"))?;
    for &d in &s.devices {
        if let Some(other) = used_by[d as usize].replace(i) {
            let why = if other == i {
                format!("device {d} is listed twice")
            } else {
                format!("device {d} is used by two stages (also stages[{other}])")
            };
            return Err(Error::field("devices", why));
        }
    }
    Ok(alloc)
}

/// Every replica's slice of the micro-batch is at least the minimum: the
/// stage's own slices where it gives them, else the even split over its
/// `replicas`.
fn check_stage_slices(plan: &Plan, s: &Stage, replicas: u32) -> Result<()> {
    let min_slice = plan.inputs.options.min_micro_batch_size.max(1);
    if let Some(slices) = &s.slices {
        return check_slices(slices, s.devices.len(), plan.micro_batch_size, min_slice)
            .map_err(|e| e.under("slices"));
    }
    let smallest = smallest_slice(plan.micro_batch_size, replicas);
    if smallest < min_slice {
        return Err(Error::field(
            "devices",
            format!(
                "{replicas} replicas split micro-batch {} into slices of {smallest} samples, below the minimum {min_slice} \
                 (the profile's smallest measured batch size unless --min-micro-batch-size says otherwise)",
                plan.micro_batch_size,
            ),
        ));
    }
    Ok(())
}

/// A stage that splits, shards, re-computes or offloads runs on GPUs alike
/// with even slices and a synchronous schedule (offloading, to a host the
/// GPU catalog knows); its split groups are `t` consecutive
/// devices (`check_split_groups`); every layer that can split can split at
/// `t` (a layer that cannot split at all runs whole, data parallel, and its
/// slices are at least the minimum too).
fn check_stage_shape(
    plan: &Plan,
    s: &Stage,
    cluster: &Cluster,
    alloc: &Alloc,
    profile: Option<&Profile>,
) -> Result<()> {
    let shape = &s.shape;
    let t = shape.tensor_parallel;
    if t == 0 {
        return Err(Error::field("tensor_parallel", "value 0 must be >= 1"));
    }
    if shape.expert_parallel == 0 {
        return Err(Error::field("expert_parallel", "value 0 must be >= 1"));
    }
    if shape.context_parallel == 0 {
        return Err(Error::field("context_parallel", "value 0 must be >= 1"));
    }
    if shape.is_plain() {
        return Ok(());
    }
    check_shard_level(shape)?;
    let field = shaped_field(shape);
    if s.slices.is_some() {
        return Err(Error::field(
            field,
            "a stage that splits, shards or re-computes takes even slices: drop its slices",
        ));
    }
    if shape.sequence_parallel && t == 1 {
        return Err(Error::field(
            "sequence_parallel",
            "value true: sequence parallelism splits the sequence over a stage's tensor-parallel shards; \
             this stage has tensor_parallel 1",
        ));
    }
    if plan.schedule.kind.is_asynchronous()
        && matches!(shape.recompute, Recompute::PerLayer | Recompute::Selective)
    {
        return Err(Error::field(
            "recompute",
            format!(
                "value \"{}\": {} plans re-run a stage's forward whole on the backward's weights (\"full\")",
                shape.recompute, plan.schedule.kind
            ),
        ));
    }
    if plan.schedule.kind.is_asynchronous() && field != "recompute" {
        return Err(Error::field(
            field,
            format!(
                "{} plans run stages that neither split nor shard",
                plan.schedule.kind
            ),
        ));
    }
    // Alike by what the topology says of them (type, memory, speed): the
    // cost model prices such a stage at one GPU's times.
    let gpu_of = |m: usize| &plan.inputs.topology.machine_groups[cluster.machines[m].group].gpu;
    let first = gpu_of(alloc[0].0);
    if alloc.iter().any(|&(m, _)| gpu_of(m) != first) {
        return Err(Error::field(
            field,
            "a stage that splits, shards or re-computes runs on GPUs alike",
        ));
    }
    if !shape.offload.is_none() && cluster.machines[alloc[0].0].host.is_none() {
        return Err(Error::field(
            "offload",
            format!(
                "value \"{}\": GPU type {:?} has no host figures (memory, copy rate, CPU cores) to \
                 offload to; known types: {}",
                shape.offload,
                first.gpu_type,
                crate::cluster::gpus::known_gpu_types()
            ),
        ));
    }
    if t > 1 {
        check_split_groups(s, t, cluster)?;
    }
    if shape.context_parallel > 1 {
        check_context(s, cluster, profile)?;
    }
    if t > 1 || shape.context_parallel > 1 {
        if let Some(p) = profile {
            check_layers_split(p, s, t)?;
            check_whole_layer_slices(plan, p, s, t)?;
        }
    }
    check_expert_groups(s, profile)
}

/// A stage whose sequence is cut `c` ways (`model/context.rs`): its data
/// replicas, t c consecutive devices each, are even over machines as
/// split groups are; its experts are not spread (not modelled together
/// yet); each of its layers' patterns cuts the sequence into 2c chunks.
fn check_context(s: &Stage, cluster: &Cluster, profile: Option<&Profile>) -> Result<()> {
    let (c, t) = (s.shape.context_parallel, s.shape.tensor_parallel.max(1));
    let field = "context_parallel";
    if s.shape.expert_parallel > 1 {
        return Err(Error::field(
            field,
            format!(
                "value {c}: context parallelism beside spread experts (expert_parallel {}) is not modelled yet",
                s.shape.expert_parallel
            ),
        ));
    }
    if s.devices.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::field(
            "devices",
            format!("list the devices of a stage with context parallelism in ascending order: its replicas are {} consecutive devices", t * c),
        ));
    }
    if !s.devices.len().is_multiple_of((t * c) as usize) {
        return Err(Error::field(
            field,
            format!(
                "value {c} times tensor_parallel {t} does not divide the stage's {} devices",
                s.devices.len()
            ),
        ));
    }
    let alloc = cluster.alloc_of(&s.devices).expect("checked devices");
    if let Some((_, shape)) = crate::cost::shape::uneven_split_group(&alloc, t * c) {
        return Err(Error::field(
            field,
            format!(
                "value {c}: a replica of {} consecutive devices takes {shape:?} GPUs of its machines; each must \
                 take as many GPUs of each machine it uses as every other",
                t * c
            ),
        ));
    }
    let Some(profile) = profile else {
        return Ok(());
    };
    for l in s.layer_start..s.layer_end {
        let layer = &profile.layers[l];
        match &layer.context {
            None => {
                return Err(Error::field(
                    field,
                    format!(
                        "value {c}: layer {:?} (layers[{l}]) gives no context pattern: its sequence cannot be cut",
                        layer.name
                    ),
                ))
            }
            Some(p) if !p.allows(c) => {
                return Err(Error::field(
                    field,
                    format!(
                        "value {c} does not cut layer {:?}'s {} tokens (layers[{l}].context.sequence_length) into {} equal chunks",
                        layer.name,
                        p.sequence_length,
                        2 * c
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The field that makes a stage other than plain, for its errors: its
/// first of split, context, expert degrees, sharding, offloading and
/// re-computation.
fn shaped_field(shape: &StageShape) -> &'static str {
    if shape.tensor_parallel > 1 {
        "tensor_parallel"
    } else if shape.context_parallel > 1 {
        "context_parallel"
    } else if shape.expert_parallel > 1 {
        "expert_parallel"
    } else if shape.expert_tensor_parallel.is_some() {
        "expert_tensor_parallel"
    } else if shape.shard_level > 0 {
        "shard_level"
    } else if !shape.offload.is_none() {
        "offload"
    } else {
        "recompute"
    }
}

/// A sharding level that is one (`ShardLevel::from_fields`).
fn check_shard_level(shape: &StageShape) -> Result<()> {
    crate::cost::sharding::ShardLevel::from_fields(shape.shard_level, shape.reshard_after_forward)
        .map(|_| ())
        .map_err(|e| {
            let field = if shape.shard_level > 3 {
                "shard_level"
            } else {
                "reshard_after_forward"
            };
            Error::field(field, e)
        })
}

/// An expert tensor degree of the stage's own: at least 1, only where the
/// experts spread, a divisor of t, below t only under sequence parallelism.
fn check_expert_tensor_degree(shape: &StageShape) -> Result<()> {
    let (e, t) = (shape.expert_parallel, shape.tensor_parallel.max(1));
    let Some(et) = shape.expert_tensor_parallel else {
        return Ok(());
    };
    let field = "expert_tensor_parallel";
    if et == 0 {
        return Err(Error::field(field, "value 0 must be >= 1"));
    }
    if e == 1 {
        return Err(Error::field(
            field,
            format!("value {et}: only a stage that spreads its experts (expert_parallel > 1) splits them apart"),
        ));
    }
    if !t.is_multiple_of(et) {
        return Err(Error::field(
            field,
            format!("value {et} does not divide the stage's tensor_parallel {t}"),
        ));
    }
    if et < t && !shape.sequence_parallel {
        return Err(Error::field(
            field,
            format!(
                "value {et} below tensor_parallel {t} needs sequence_parallel: without it the {t} shards \
                 hold the same tokens"
            ),
        ));
    }
    Ok(())
}

/// Expert groups of `expert_parallel` expert replicas (of the expert
/// tensor degree's consecutive GPUs each) divide the stage's GPUs, and
/// the routed experts of each of its layers that has some (one of them at
/// least), on layers that split their sequence where each expert splits
/// fewer ways than t.
fn check_expert_groups(s: &Stage, profile: Option<&Profile>) -> Result<()> {
    let e = s.shape.expert_parallel;
    let t = s.shape.tensor_parallel.max(1);
    check_expert_tensor_degree(&s.shape)?;
    if e == 1 {
        return Ok(());
    }
    if s.devices.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::field(
            "devices",
            format!(
                "list the devices of a stage that spreads experts in ascending order: its expert groups are {e} \
                 consecutive replicas"
            ),
        ));
    }
    let et = s.shape.expert_tensor_degree();
    let gpus = s.devices.len() as u32;
    if et == t {
        let replicas = s.replicas();
        if !replicas.is_multiple_of(e) {
            return Err(Error::field(
                "expert_parallel",
                format!("value {e} does not divide the stage's {replicas} replicas"),
            ));
        }
    } else if !gpus.is_multiple_of(e * et) {
        return Err(Error::field(
            "expert_parallel",
            format!(
                "value {e} times the expert tensor degree {et} does not divide the stage's {gpus} GPUs"
            ),
        ));
    }
    let Some(profile) = profile else {
        return Ok(());
    };
    let mut any = false;
    for l in s.layer_start..s.layer_end {
        let layer = &profile.layers[l];
        if let Some(experts) = &layer.experts {
            // Each expert split fewer ways than the layer: only where the
            // layer's shards hold different tokens (split along the
            // sequence), as they would otherwise send the same.
            if et < t
                && crate::model::split::cheapest(&layer.split, t)
                    .is_some_and(|p| !p.sequence_parallel)
            {
                return Err(Error::field(
                    "expert_tensor_parallel",
                    format!(
                        "value {et} below tensor_parallel {t}: layer {:?} (layers[{l}]) does not split its \
                         sequence, so its {t} shards hold the same tokens",
                        layer.name
                    ),
                ));
            }
            if !experts.count.is_multiple_of(e) {
                return Err(Error::field(
                    "expert_parallel",
                    format!(
                        "value {e} does not divide the {} experts of layer {:?} (layers[{l}])",
                        experts.count, layer.name
                    ),
                ));
            }
            any = true;
        }
    }
    if !any {
        return Err(Error::field(
            "expert_parallel",
            format!(
                "value {e}: no layer of the stage (layers {}..{}) has experts",
                s.layer_start, s.layer_end
            ),
        ));
    }
    Ok(())
}

/// Layers of a split stage that do not split run data parallel over all
/// its GPUs: each GPU's slice of them is at least the minimum too.
fn check_whole_layer_slices(plan: &Plan, profile: &Profile, s: &Stage, t: u32) -> Result<()> {
    let whole =
        (s.layer_start..s.layer_end).any(|l| !profile.layers[l].split.iter().any(|p| p.allows(t)));
    // Whole layers run data parallel over the stage's context groups.
    let groups = s.devices.len() as u32 / s.shape.context_parallel.max(1);
    let smallest = smallest_slice(plan.micro_batch_size, groups);
    let min_slice = plan.inputs.options.min_micro_batch_size.max(1);
    if whole && smallest < min_slice {
        return Err(Error::field(
            "devices",
            format!(
                "{groups} GPUs (or context groups) split micro-batch {} into slices of {smallest} samples for the \
                 stage's layers that do not split, below the minimum {min_slice}",
                plan.micro_batch_size
            ),
        ));
    }
    Ok(())
}

/// The split groups, each `t` consecutive devices of the stage (listed in
/// ascending order, as the cost model groups them), are even
/// (`shape::uneven_split_group`).
fn check_split_groups(s: &Stage, t: u32, cluster: &Cluster) -> Result<()> {
    if s.devices.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::field(
            "devices",
            format!("list a split stage's devices in ascending order: its groups are {t} consecutive devices"),
        ));
    }
    if !s.devices.len().is_multiple_of(t as usize) {
        return Err(Error::field(
            "tensor_parallel",
            format!(
                "value {t} does not divide the stage's {} devices",
                s.devices.len()
            ),
        ));
    }
    let alloc = cluster.alloc_of(&s.devices).expect("checked devices");
    if let Some((k, shape)) = crate::cost::shape::uneven_split_group(&alloc, t) {
        let group = s.split_groups().nth(k).expect("the uneven group");
        return Err(Error::field(
            "tensor_parallel",
            format!(
                "value {t}: split group {group:?} takes {shape:?} GPUs of its machines; each group of {t} \
                 consecutive devices must take as many GPUs of each machine it uses as every other group"
            ),
        ));
    }
    Ok(())
}

/// Every layer of the stage that has sharding patterns has one `t` can split.
fn check_layers_split(profile: &Profile, s: &Stage, t: u32) -> Result<()> {
    for l in s.layer_start..s.layer_end {
        let layer = &profile.layers[l];
        if layer.split.is_empty() || layer.split.iter().any(|p| p.allows(t)) {
            continue;
        }
        let refusal = layer
            .split
            .iter()
            .find_map(|p| p.refusal(t))
            .expect("a pattern refuses t");
        return Err(Error::field(
            "tensor_parallel",
            format!(
                "value {t} does not divide the {} ({}) of layer {:?} (layers[{l}])",
                refusal.what, refusal.count, layer.name
            ),
        ));
    }
    Ok(())
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

/// Stage `i`'s warm-up depth K_i is the one its schedule and policy give,
/// or, where they leave it free, in 1..=micro-batches and no deeper than
/// the stage before it.
fn check_warmup(plan: &Plan, i: usize, chunk_depths: Option<&[u32]>) -> Result<()> {
    let ScheduleChoice {
        kind,
        warmup_policy: policy,
        ..
    } = plan.schedule;
    let stages_from_here = (plan.stages.len() - i) as u32;
    let k = plan.stages[i].warmup_micro_batches;
    let m = plan.micro_batches;
    let field = "warmup_micro_batches";
    let expected = match chunk_depths {
        Some(depths) => Some(depths[i]),
        None => warmup_depth(kind, policy, stages_from_here, m),
    };
    match expected {
        Some(expected) if k != expected => {
            let why = match kind {
                ScheduleKind::GPipe => "GPipe runs all micro-batches forward first".to_string(),
                ScheduleKind::ZeroBubbleH1 => {
                    "ZB-H1 runs one micro-batch ahead per stage from here".to_string()
                }
                ScheduleKind::ZeroBubbleH2 => {
                    "ZB-H2 runs two micro-batches ahead per stage from here, less one".to_string()
                }
                ScheduleKind::EarlyBackward1F1B => {
                    format!("warm-up policy {} gives this stage", policy.name())
                }
                chunked if chunked.is_chunked() => {
                    format!("{chunked}'s order runs of this stage before its first backward")
                }
                asynchronous => {
                    format!("{asynchronous} runs one micro-batch ahead per stage from here")
                }
            };
            Err(Error::field(
                field,
                format!("value {k} differs from K_i = {expected} that {why}; fix one of them"),
            ))
        }
        Some(_) => Ok(()),
        None if !(1..=m).contains(&k) => Err(Error::field(
            field,
            format!("value {k} must be in 1..={m} (the plan's micro-batches)"),
        )),
        None => match plan.stages[..i].last().map(|p| p.warmup_micro_batches) {
            // A stage that waits for more forwards than the stage before it
            // sends ahead of its own first backward deadlocks.
            Some(prev) if k > prev => Err(Error::field(
                field,
                format!(
                    "value {k} is deeper than stage {}'s {prev}: early backward deadlocks \
                     unless K_i never grows along the pipeline",
                    i - 1
                ),
            )),
            _ => Ok(()),
        },
    }
}
