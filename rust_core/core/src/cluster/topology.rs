//! Clusters: machines of GPUs joined by an intra-machine link (NVLink, PCIe)
//! and an inter-machine network (Ethernet, InfiniBand).
//!
//! Written either as a short spec (`2x8-nvlink`, `16x1-25gbps`,
//! `4x8-pcie-100gbps`), as one of the paper's named configurations (`A`, `B`,
//! `C`), or as a JSON file. Every machine group carries its GPU type, memory
//! and relative speed, so heterogeneous clusters need no format change.

use serde::{Deserialize, Serialize};

use crate::cluster::gpus::{default_gpu, find_gpu, gpu_type, known_gpu_types, GpuType, GPU_TYPES};
use crate::error::{Error, Result};
use crate::formats::format::{
    check_non_negative, check_positive, FileFormat, FileObject, TOPOLOGY,
};

/// The paper's clusters (Table III) by preset name, as specs; `from_spec`
/// also reads `config-a` and lower case.
pub const PRESETS: [(&str, &str); 3] = [
    ("A", "2x8-nvlink-25gbps"),
    ("B", "16x1-25gbps"),
    ("C", "16x1-10gbps"),
];

/// The GPU of untyped specs: the paper's V100 with 16 GiB, its DGX-1
/// NVLink ("up to 130 GB/s" = 1040 Gbit/s) and PCIe 3.0 x16 (16 GB/s).
pub const DEFAULT_GPU_TYPE: &str = GPU_TYPES[0].name;
/// Assumed per-message latencies; small against the transfers planned here.
pub const INTRA_LATENCY_US: f64 = 5.0;
pub const INTER_LATENCY_US: f64 = 20.0;
/// Inter-machine network when a spec names none (the paper's 25 Gbps).
pub const DEFAULT_INTER_GBPS: f64 = 25.0;
/// Most GPUs one machine may have: the search counts a machine's GPUs in
/// 16 bits, and no real machine comes near.
pub const MAX_GPUS_PER_MACHINE: u32 = 1024;
/// Most GPUs a topology may have (2^20): device ids are 32-bit, and every
/// machine is listed, so a count that wraps or asks for gigabytes is
/// refused where it enters.
pub const MAX_DEVICES: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    pub format: String,
    pub schema_version: u32,
    pub name: String,
    /// Groups of identical machines, in device-id order.
    pub machine_groups: Vec<MachineGroup>,
    /// Network between machines.
    pub inter_machine: Link,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineGroup {
    pub machines: u32,
    pub gpus_per_machine: u32,
    pub gpu: Gpu,
    /// Link between GPUs of one machine.
    pub intra_machine: Link,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    #[serde(rename = "type")]
    pub gpu_type: String,
    pub memory_bytes: u64,
    /// Speed relative to the GPU the profile was measured on (2.0 = twice
    /// as fast). Absent: a GPU type the profile timed runs at its own
    /// measured times; any other runs at the profile's device's speed when
    /// the profile times one device, and must be given when it times
    /// several (`cost::Cluster::for_model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relative_speed: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Free text: "nvlink", "pcie", "ethernet", "infiniband".
    pub kind: String,
    pub bandwidth_gbps: f64,
    #[serde(default)]
    pub latency_us: f64,
}

/// One machine after expanding the groups.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// Index of the group; machines of one group are interchangeable.
    pub group: usize,
    pub gpus: u32,
    /// Global id of this machine's first GPU.
    pub first_device: u32,
}

impl FileObject for Topology {
    const FORMAT: FileFormat = TOPOLOGY;

    fn check(&self) -> Result<()> {
        self.validate()
    }
}

impl Topology {
    /// A homogeneous cluster of `machines` x `gpus` GPUs of type `gpu`.
    pub fn homogeneous(
        name: &str,
        gpu: &GpuType,
        machines: u32,
        gpus: u32,
        intra: Link,
        inter: Link,
    ) -> Topology {
        Topology {
            format: TOPOLOGY.name.into(),
            schema_version: TOPOLOGY.version,
            name: name.into(),
            machine_groups: vec![MachineGroup {
                machines,
                gpus_per_machine: gpus,
                gpu: Gpu {
                    gpu_type: gpu.name.into(),
                    memory_bytes: gpu.memory_bytes,
                    relative_speed: None,
                },
                intra_machine: intra,
            }],
            inter_machine: inter,
        }
    }

    /// Parse a short spec or a preset name.
    ///
    /// `MxG[-TYPE][-INTRA][-INTER]`: TYPE is a GPU type of `gpus::GPU_TYPES`
    /// (`a100-80gb`, `h100`); INTRA is `nvlink`, `pcie` or `<n>gbps`; INTER
    /// is `<n>gbps` (the machine's whole network) or `ib` (100 Gbps
    /// InfiniBand). With one GPU per machine the single link token is the
    /// network. Without a type: the paper's V100-16GB, NVLink of 130 GB/s and
    /// 25 Gbps Ethernet. With a type, links not named are its usual server's:
    /// its NVLink, and its network per GPU times the GPUs of a machine.
    /// Presets: `A` = `2x8-nvlink-25gbps`, `B` = `16x1-25gbps`, `C` =
    /// `16x1-10gbps` (the paper's Table III).
    pub fn from_spec(spec: &str) -> Result<Topology> {
        let bad = |why: String| {
            Error::invalid(format!(
                "topology spec {spec:?} is not valid: {why}; expected MxG[-TYPE][-nvlink|-pcie][-<n>gbps|-ib] \
                 such as 2x8-nvlink, 16x1-25gbps, 64x8-a100-80gb, or a preset A, B, C, or a topology JSON file"
            ))
        };
        let expanded = expand_preset(spec);
        let mut parts = expanded.split('-');
        let (machines, gpus) = parse_shape(parts.next().unwrap_or("")).map_err(bad)?;
        let tokens: Vec<&str> = parts.collect();
        let (typed, links) = parse_gpu_type(&tokens).map_err(bad)?;
        let gpu = typed.unwrap_or(default_gpu());
        let (intra, inter) = parse_links(links, typed, gpus).map_err(bad)?;
        let topology = Topology::homogeneous(spec.trim(), gpu, machines, gpus, intra, inter);
        topology.validate().map_err(|e| {
            bad(e
                .field
                .map_or(e.message.clone(), |f| format!("{f}: {}", e.message)))
        })?;
        Ok(topology)
    }

    /// bf16 peak FLOP/s of all the GPUs, where every type is in the catalog.
    pub fn peak_flops(&self) -> Option<f64> {
        self.machine_groups.iter().try_fold(0.0, |sum, g| {
            let gpu = find_gpu(&g.gpu.gpu_type)?;
            Some(
                sum + f64::from(g.machines)
                    * f64::from(g.gpus_per_machine)
                    * gpu.bf16_tflops
                    * 1e12,
            )
        })
    }

    pub fn validate(&self) -> Result<()> {
        if self.machine_groups.is_empty() {
            return Err(Error::field(
                "machine_groups",
                "needs at least one machine group",
            ));
        }
        for (i, g) in self.machine_groups.iter().enumerate() {
            let at = |f: &str| format!("machine_groups[{i}].{f}");
            if g.machines == 0 {
                return Err(Error::field(at("machines"), "value 0 must be >= 1"));
            }
            if g.gpus_per_machine == 0 || g.gpus_per_machine > MAX_GPUS_PER_MACHINE {
                return Err(Error::field(
                    at("gpus_per_machine"),
                    format!(
                        "value {} must be in 1..={MAX_GPUS_PER_MACHINE}",
                        g.gpus_per_machine
                    ),
                ));
            }
            if g.gpu.memory_bytes == 0 {
                return Err(Error::field(at("gpu.memory_bytes"), "value 0 must be > 0"));
            }
            if let Some(speed) = g.gpu.relative_speed {
                check_positive(|| at("gpu.relative_speed"), speed)?;
            }
            check_positive(
                || at("intra_machine.bandwidth_gbps"),
                g.intra_machine.bandwidth_gbps,
            )?;
            check_non_negative(
                || at("intra_machine.latency_us"),
                g.intra_machine.latency_us,
            )?;
        }
        let devices: u64 = self
            .machine_groups
            .iter()
            .map(|g| u64::from(g.machines) * u64::from(g.gpus_per_machine))
            .sum();
        if devices > MAX_DEVICES {
            return Err(Error::field(
                "machine_groups",
                format!("{devices} GPUs in all is more than the {MAX_DEVICES} dapple plans for"),
            ));
        }
        check_positive(
            || "inter_machine.bandwidth_gbps".into(),
            self.inter_machine.bandwidth_gbps,
        )?;
        check_non_negative(
            || "inter_machine.latency_us".into(),
            self.inter_machine.latency_us,
        )?;
        Ok(())
    }

    pub fn machines(&self) -> Vec<Machine> {
        let mut out = Vec::new();
        let mut next = 0;
        for (gi, g) in self.machine_groups.iter().enumerate() {
            for _ in 0..g.machines {
                out.push(Machine {
                    group: gi,
                    gpus: g.gpus_per_machine,
                    first_device: next,
                });
                next += g.gpus_per_machine;
            }
        }
        out
    }

    /// The same cluster with each run of neighbouring groups alike in
    /// every field but their machine count written as one group: device
    /// ids stay as they were, and the search, whose cluster states count
    /// machines per group, sees 1,000 groups of 2 machines as one group of
    /// 2,000 (issue 44: searched as different groups, their tables passed
    /// 1 GiB). Groups alike but apart stay apart: merging them would
    /// renumber the devices between them.
    pub fn with_alike_groups_merged(&self) -> Topology {
        let mut groups: Vec<MachineGroup> = Vec::with_capacity(self.machine_groups.len());
        for g in &self.machine_groups {
            match groups.last_mut() {
                Some(last)
                    if (last.gpus_per_machine, &last.gpu, &last.intra_machine)
                        == (g.gpus_per_machine, &g.gpu, &g.intra_machine) =>
                {
                    last.machines += g.machines;
                }
                _ => groups.push(g.clone()),
            }
        }
        Topology {
            machine_groups: groups,
            ..self.clone()
        }
    }

    pub fn num_devices(&self) -> u32 {
        self.machine_groups
            .iter()
            .map(|g| g.machines * g.gpus_per_machine)
            .sum()
    }

    pub fn num_machines(&self) -> usize {
        self.machine_groups
            .iter()
            .map(|g| g.machines as usize)
            .sum()
    }

    /// Machine index of a global device id.
    pub fn machine_of(&self, device: u32) -> Option<usize> {
        self.machines()
            .iter()
            .position(|m| device >= m.first_device && device < m.first_device + m.gpus)
    }

    /// Short human description, e.g. "2 x 8 V100-16GB, nvlink 1040 Gbps, ethernet 25 Gbps".
    pub fn describe(&self) -> String {
        let groups: Vec<String> = self
            .machine_groups
            .iter()
            .map(|g| {
                let speed = g
                    .gpu
                    .relative_speed
                    .map_or(String::new(), |s| format!(", speed {s}"));
                format!(
                    "{} x {} {} ({:.1} GiB{speed}), {} {} Gbps",
                    g.machines,
                    g.gpus_per_machine,
                    g.gpu.gpu_type,
                    g.gpu.memory_bytes as f64 / (1u64 << 30) as f64,
                    g.intra_machine.kind,
                    g.intra_machine.bandwidth_gbps
                )
            })
            .collect();
        format!(
            "{}; between machines {} {} Gbps",
            groups.join(" + "),
            self.inter_machine.kind,
            self.inter_machine.bandwidth_gbps
        )
    }
}

/// The spec a preset name (`A`, or `config-a`) stands for, else the spec
/// itself; lower case, trimmed.
fn expand_preset(spec: &str) -> String {
    let lower = spec.trim().to_ascii_lowercase();
    PRESETS
        .iter()
        .find(|(name, _)| {
            let name = name.to_ascii_lowercase();
            lower == name || lower == format!("config-{name}")
        })
        .map_or(lower.clone(), |(_, preset)| preset.to_string())
}

/// `MxG`: machines and GPUs per machine, each at least 1.
fn parse_shape(shape: &str) -> std::result::Result<(u32, u32), String> {
    let (m, g) = shape.split_once('x').ok_or("no MxG part")?;
    let machines: u32 = m
        .parse()
        .map_err(|_| "machine count is not a positive integer")?;
    let gpus: u32 = g
        .parse()
        .map_err(|_| "GPU count is not a positive integer")?;
    if machines == 0 || gpus == 0 {
        return Err("machine and GPU counts must be at least 1".into());
    }
    Ok((machines, gpus))
}

/// A link rate token: `<n>gbps` or `ib` (100 Gbps InfiniBand).
fn parse_rate(t: &str) -> Option<f64> {
    if t == "ib" {
        return Some(100.0);
    }
    let n: f64 = t.strip_suffix("gbps")?.parse().ok()?;
    (n.is_finite() && n > 0.0).then_some(n)
}

fn unknown_link(t: &str) -> String {
    format!("unknown link {t:?}: use nvlink, pcie, <n>gbps or ib")
}

/// The GPU type named first after `MxG`, if any (a type may hold a dash,
/// `a100-80gb`), and the tokens after it. A first token that is neither a
/// type nor a link is an unknown type.
fn parse_gpu_type<'t>(
    tokens: &'t [&'t str],
) -> std::result::Result<(Option<&'static GpuType>, &'t [&'t str]), String> {
    let Some(&first) = tokens.first() else {
        return Ok((None, tokens));
    };
    // A size after the name belongs to it: `a100-81gb` is no `a100`.
    let sized = tokens
        .get(1)
        .is_some_and(|t| t.ends_with("gb") && !t.ends_with("gbps"));
    let take = if sized { 2 } else { 1 };
    let name = tokens[..take].join("-");
    match find_gpu(&name) {
        Some(found) => Ok((Some(found), &tokens[take..])),
        None if sized => Err(gpu_type(&name).expect_err("not a known type").message),
        // A typing mistake in either a type or a link: name both lists.
        None if !is_link(first) => Err(format!(
            "unknown link or GPU type {first:?}: links are nvlink, pcie, <n>gbps or ib; known types: {}",
            known_gpu_types()
        )),
        None => Ok((None, tokens)),
    }
}

fn is_link(token: &str) -> bool {
    matches!(token, "nvlink" | "pcie") || parse_rate(token).is_some()
}

/// The link tokens after `MxG[-TYPE]`: the intra-machine link and the
/// network of `gpus`-GPU machines. Links not named are the GPU type's
/// usual server's, or without a type the paper's NVLink and 25 Gbps.
fn parse_links(
    tokens: &[&str],
    typed: Option<&GpuType>,
    gpus: u32,
) -> std::result::Result<(Link, Link), String> {
    let gpu = typed.unwrap_or(default_gpu());
    let mut intra = Link {
        kind: "nvlink".into(),
        bandwidth_gbps: gpu.nvlink_gbps,
        latency_us: INTRA_LATENCY_US,
    };
    let mut inter = match typed {
        Some(t) => Link {
            kind: "infiniband".into(),
            bandwidth_gbps: t.network_gbps_per_gpu * f64::from(gpus),
            latency_us: INTER_LATENCY_US,
        },
        None => Link {
            kind: "ethernet".into(),
            bandwidth_gbps: DEFAULT_INTER_GBPS,
            latency_us: INTER_LATENCY_US,
        },
    };
    let mut rest = tokens;
    // An intra-machine link is named first; a lone rate is the network
    // (single-GPU machines have no intra link worth naming).
    if let Some(&first) = rest.first() {
        if matches!(first, "nvlink" | "pcie") || rest.len() > 1 {
            match first {
                "nvlink" => {}
                "pcie" => {
                    intra.kind = "pcie".into();
                    intra.bandwidth_gbps = gpu.pcie_gbps;
                }
                t => {
                    intra.kind = "custom".into();
                    intra.bandwidth_gbps = parse_rate(t).ok_or_else(|| unknown_link(t))?;
                }
            }
            rest = &rest[1..];
        }
    }
    match rest {
        [] => {}
        [t] => {
            inter.bandwidth_gbps = parse_rate(t).ok_or_else(|| unknown_link(t))?;
            inter.kind = if *t == "ib" { "infiniband" } else { "ethernet" }.into();
        }
        _ => return Err("too many parts".into()),
    }
    Ok((intra, inter))
}

/// Test clusters on mixed GPUs: `spec`'s first group split in two, one
/// machine as it is and one whose GPUs (type "slow") run at `speed` times
/// its speed.
#[cfg(test)]
pub(crate) fn with_one_slow_machine(spec: &str, speed: f64) -> Topology {
    let mut topology = Topology::from_spec(spec).unwrap();
    let mut slow = topology.machine_groups[0].clone();
    topology.machine_groups[0].machines = 1;
    slow.machines = 1;
    slow.gpu.gpu_type = "slow".into();
    slow.gpu.relative_speed = Some(speed);
    topology.machine_groups.push(slow);
    topology
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_counts_that_wrap_or_exhaust_memory_are_refused() {
        for spec in [
            "65536x65536-nvlink",
            "99999x99999",
            "4294967295x1",
            "1x2000-nvlink",
        ] {
            let e = Topology::from_spec(spec).unwrap_err();
            assert_eq!(e.kind, crate::ErrorKind::InvalidInput, "{spec}");
            assert!(e.message.contains(spec), "{spec}: {}", e.message);
        }
        assert_eq!(
            Topology::from_spec("2048x8-nvlink").unwrap().num_devices(),
            16_384
        );
        assert_eq!(
            Topology::from_spec("1024x1024").unwrap().num_devices(),
            1 << 20
        );
    }

    #[test]
    fn neighbouring_groups_alike_merge_and_groups_apart_stay() {
        let one = Topology::from_spec("2x8-nvlink").unwrap();
        let mut many = one.clone();
        many.machine_groups = vec![one.machine_groups[0].clone(); 1000];
        let merged = many.with_alike_groups_merged();
        assert_eq!(merged.machine_groups.len(), 1);
        assert_eq!(merged.machine_groups[0].machines, 2000);
        assert_eq!(merged.num_devices(), many.num_devices());
        // A slow machine between two fast groups: three groups still, so
        // that device 8 is the slow machine's first GPU in both.
        let mut apart = with_one_slow_machine("2x8-nvlink", 0.5);
        apart.machine_groups.push(apart.machine_groups[0].clone());
        let merged = apart.with_alike_groups_merged();
        assert_eq!(merged.machine_groups, apart.machine_groups);
        // Alike but for memory: not merged.
        let mut other = one.clone();
        let mut bigger = one.machine_groups[0].clone();
        bigger.gpu.memory_bytes *= 2;
        other.machine_groups.push(bigger);
        assert_eq!(other.with_alike_groups_merged().machine_groups.len(), 2);
    }

    #[test]
    fn typed_specs_take_the_type_and_its_usual_server() {
        // spec -> GPU type, GiB, intra link (kind, Gbps), network (kind, Gbps per machine).
        // DGX A100: one 200 Gb/s HDR port per GPU; DGX H100 one 400 Gb/s NDR port.
        // Untyped specs are the paper's V100-16GB, as before types existed.
        #[rustfmt::skip]
        let table = [
            ("64x8-a100-80gb", "A100-80GB", 80, ("nvlink", 2400.0), ("infiniband", 1600.0)),
            ("2x8-H100", "H100-80GB", 80, ("nvlink", 3600.0), ("infiniband", 3200.0)),
            ("4x8-v100-32gb-nvlink-50gbps", "V100-32GB", 32, ("nvlink", 1040.0), ("ethernet", 50.0)),
            ("1x8-h200-pcie", "H200", 141, ("pcie", 512.0), ("infiniband", 3200.0)),
            ("2x8-nvlink-25gbps", "V100-16GB", 16, ("nvlink", 1040.0), ("ethernet", 25.0)),
        ];
        for (spec, gpu, gib, intra, inter) in table {
            let t = Topology::from_spec(spec).unwrap();
            let g = &t.machine_groups[0];
            let link = |l: &Link| (l.kind.clone(), l.bandwidth_gbps);
            assert_eq!(
                (
                    g.gpu.gpu_type.as_str(),
                    g.gpu.memory_bytes >> 30,
                    link(&g.intra_machine),
                    link(&t.inter_machine)
                ),
                (
                    gpu,
                    gib,
                    (intra.0.to_string(), intra.1),
                    (inter.0.to_string(), inter.1)
                ),
                "{spec}"
            );
        }
    }

    #[test]
    fn an_unknown_gpu_type_in_a_spec_lists_the_known_ones() {
        let e = Topology::from_spec("8x8-a100-81gb")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown GPU type \"a100-81gb\"; known types: V100-16GB, "),
            "{e}"
        );
        for (spec, meant) in [("2x8-tpu", "tpu"), ("2x8-rtx4090-nvlink", "rtx4090")] {
            let e = Topology::from_spec(spec).unwrap_err().to_string();
            let expected = format!(
                "unknown link or GPU type {meant:?}: links are nvlink, pcie, <n>gbps or ib; known types: V100-16GB, "
            );
            assert!(e.contains(&expected), "{e}");
        }
        // A misspelt link after a valid type is still a link error.
        let e = Topology::from_spec("2x8-a100-nvlnk-25gbps")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown link \"nvlnk\""), "{e}");
    }

    #[test]
    fn specs_and_presets() {
        let a = Topology::from_spec("A").unwrap();
        assert_eq!(a.num_devices(), 16);
        assert_eq!(a.machine_groups[0].intra_machine.bandwidth_gbps, 1040.0);
        assert_eq!(a.inter_machine.bandwidth_gbps, 25.0);
        let b = Topology::from_spec("16x1-25gbps").unwrap();
        assert_eq!(b.num_machines(), 16);
        assert_eq!(b.inter_machine.bandwidth_gbps, 25.0);
        let c = Topology::from_spec("C").unwrap();
        assert_eq!(c.inter_machine.bandwidth_gbps, 10.0);
        let p = Topology::from_spec("4x8-pcie-100gbps").unwrap();
        assert_eq!(p.machine_groups[0].intra_machine.kind, "pcie");
        assert_eq!(p.inter_machine.bandwidth_gbps, 100.0);
        let n = Topology::from_spec("2x8-nvlink").unwrap();
        assert_eq!(n.inter_machine.bandwidth_gbps, DEFAULT_INTER_GBPS);
        let r = Topology::from_spec("2x4-10gbps").unwrap();
        assert_eq!(r.machine_groups[0].intra_machine.kind, "nvlink");
        assert_eq!(r.inter_machine.bandwidth_gbps, 10.0);
    }

    #[test]
    fn bad_specs_name_the_spec() {
        for s in [
            "",
            "2x",
            "0x8",
            "2x8-warp",
            "2x8-nvlink-25gbps-extra",
            "x8",
            "2x8-nvlink--3gbps",
        ] {
            let e = Topology::from_spec(s).unwrap_err();
            assert!(e.message.contains(&format!("{s:?}")), "{e}");
        }
    }

    #[test]
    fn file_round_trip_and_validation() {
        let t = Topology::from_spec("2x8-nvlink").unwrap();
        assert_eq!(Topology::from_json(&t.to_json()).unwrap(), t);
        let mut bad = t.clone();
        bad.machine_groups[0].gpu.relative_speed = Some(0.0);
        let e = Topology::from_json(&bad.to_json()).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("machine_groups[0].gpu.relative_speed")
        );
    }

    #[test]
    fn device_ids_are_machine_major() {
        let t = Topology::from_spec("2x8-nvlink").unwrap();
        assert_eq!(t.machine_of(7), Some(0));
        assert_eq!(t.machine_of(8), Some(1));
        assert_eq!(t.machine_of(16), None);
    }
}
