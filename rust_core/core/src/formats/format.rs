//! Versioned JSON envelopes shared by every file format.
//!
//! Every file carries `format` (which kind of file) and `schema_version`.
//! Readers check both before looking at anything else, so a plan handed in as
//! a profile, or a file from a newer dapple, is rejected by name instead of
//! failing on some unrelated field.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// A file format: its name, the version dapple writes, and the versions it
/// reads. Every format is declared here and nowhere else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileFormat {
    pub name: &'static str,
    pub version: u32,
    pub reads: &'static [u32],
}

impl FileFormat {
    const fn new(name: &'static str, version: u32, reads: &'static [u32]) -> FileFormat {
        FileFormat {
            name,
            version,
            reads,
        }
    }
}

/// The optional `other_devices` (the model's layer times on more GPU
/// types) came without a new version: a dapple that predates it refuses
/// such a file by naming the field, and reads every other profile; so did
/// the measurements' optional `selective_stored_bytes` and
/// `selective_recompute_ms` (issue 45), and a layer's `experts` (issue 46)
/// with their `split_gather_bytes_per_sample`, `compute_fraction` and
/// `imbalance`, and a split pattern's `shard_compute` (issue 65).
pub const PROFILE: FileFormat = FileFormat::new("dapple.profile", 1, &[1]);
pub const TOPOLOGY: FileFormat = FileFormat::new("dapple.topology", 1, &[1]);
/// Version 2 adds the simulated `estimate.iteration_ms`, per-stage
/// `bubble_ms` and warm-up policy "auto"; version 3 adds per-device
/// `stages[i].slices`. Older plans still read. The optional
/// `selection.refined_from_ms` came without a new version: a dapple that
/// predates it refuses such a plan by naming the field. Version 4: an
/// asynchronous plan re-computes only the stages whose `recompute` says so;
/// before, every stage of one did, and an older asynchronous plan is read
/// that way (`Plan::recomputes_every_stage`). Version 5: the chunked kinds
/// (interleaved 1F1B, interleaved zero bubble, ZB-V), whose ranks hold
/// `schedule.chunks` stages each. Version 6: `recompute` "per-layer".
/// Version 7: `stages[i].sequence_parallel` and `recompute` "selective".
/// Version 8: `schedule.overlap` (what the runtime hides behind
/// computation; absent: DAPPLE's overlap, as every older plan has it).
/// Version 9: `stages[i].expert_parallel`; version 10
/// `stages[i].expert_tensor_parallel`; version 11 `stages[i].offload`.
/// Version 12: `stages[i].shard_level` and `reshard_after_forward` (ZeRO-2
/// and -3); older plans' `shard_optimizer: true` reads as level 1.
/// Version 13: `stages[i].context_parallel`; the optional
/// `selection.space_fits` came after it without a new version.
pub const PLAN: FileFormat = FileFormat::new(
    "dapple.plan",
    13,
    &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
);
/// Version 2 adds asynchronous schedules: `mini_batches`, `span_ms` and
/// per-stage `peak_weight_copies`; version 3 the split backward's task
/// kinds `input_gradient` and `weight_gradient`; version 4 the chunked
/// kinds, whose `stages` are one timeline a rank and whose `stage_ranks`
/// say which rank runs each task's stage.
pub const SIMULATION: FileFormat = FileFormat::new("dapple.simulation", 4, &[1, 2, 3, 4]);
/// `dapple regress` suites (`search/regress.rs`). Version 1 held formula (2)
/// estimates, which cannot be compared with simulated times.
pub const REGRESS_SUITE: FileFormat = FileFormat::new("dapple.regress-suite", 2, &[2]);
/// What `dapple run --metrics` writes (`simulation/metrics.rs`). Version 2 adds
/// `optimizer`, `schedule` and `evaluations`; version 3
/// `median_iteration_ms` and `first_steps_left_out`; version 4 `dtype`.
pub const RUN_METRICS: FileFormat = FileFormat::new("dapple.run-metrics", 4, &[1, 2, 3, 4]);

/// Every format, for the binding's `FORMATS` table.
pub const FORMATS: [FileFormat; 6] = [
    PROFILE,
    TOPOLOGY,
    PLAN,
    SIMULATION,
    REGRESS_SUITE,
    RUN_METRICS,
];

/// The object of a file format, read from JSON text (`from_json`) or from
/// plain data (`from_value`, as the binding hands it over), and checked the
/// same way either way.
pub trait FileObject: Sized + Serialize + DeserializeOwned {
    const FORMAT: FileFormat;

    /// Checks beyond the types (ranges, references between fields); every
    /// read runs them.
    fn check(&self) -> Result<()> {
        Ok(())
    }

    fn from_json(text: &str) -> Result<Self> {
        // The text as plain data first: the envelope is checked on it, so
        // that another kind of file is named as such, and so are the
        // shapes of what is read. Then the struct straight from the text,
        // which also refuses a key given twice (plain data keeps the last).
        let input: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("not valid JSON ({e}){}", nan_hint(text))))?;
        let mut de = serde_json::Deserializer::from_str(text);
        Self::read_checked(&input, || {
            tracked(serde_path_to_error::deserialize(&mut de))
        })
    }

    /// From the data a file holds, `format` and `schema_version` included.
    fn from_value(value: serde_json::Value) -> Result<Self> {
        Self::read_checked(&value, || tracked(serde_path_to_error::deserialize(&value)))
    }

    /// `read` once `input`'s envelope is this format's, then its shapes and
    /// `check`.
    fn read_checked(
        input: &serde_json::Value,
        read: impl FnOnce() -> Result<Self>,
    ) -> Result<Self> {
        let fields = input.as_object().ok_or_else(|| {
            Error::invalid(format!(
                "expected a JSON object for a {} file",
                Self::FORMAT.name
            ))
        })?;
        check_envelope(fields, Self::FORMAT)?;
        let read = read()?;
        check_objects(input, &to_value(&read), "")?;
        read.check()?;
        Ok(read)
    }

    /// From plain data without the envelope: this dapple's `format` and
    /// `schema_version` are filled in where absent, so a writer never
    /// spells them.
    fn from_parts(mut value: serde_json::Value) -> Result<Self> {
        if let serde_json::Value::Object(obj) = &mut value {
            obj.entry("format")
                .or_insert_with(|| Self::FORMAT.name.into());
            obj.entry("schema_version")
                .or_insert_with(|| Self::FORMAT.version.into());
        }
        Self::from_value(value)
    }

    /// Pretty JSON with a trailing newline, the form every file has.
    fn to_json(&self) -> String {
        to_json(self)
    }
}

fn to_value<T: Serialize>(read: &T) -> serde_json::Value {
    serde_json::to_value(read).expect("plain data always serializes")
}

/// Objects stay objects. Serde also reads a struct from an array of its
/// fields in order (`"options": [5]` as `{"min_micro_batch_size": 5}`),
/// which no schema allows: wherever what was read is an object, the input
/// must have been one.
fn check_objects(input: &serde_json::Value, read: &serde_json::Value, path: &str) -> Result<()> {
    use serde_json::Value;
    let at = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match (input, read) {
        (Value::Object(given), Value::Object(kept)) => {
            for (key, value) in kept {
                if let Some(original) = given.get(key) {
                    check_objects(original, value, &at(key))?;
                }
            }
            Ok(())
        }
        (Value::Array(given), Value::Array(kept)) => given
            .iter()
            .zip(kept)
            .enumerate()
            .try_for_each(|(i, (g, k))| check_objects(g, k, &format!("{path}[{i}]"))),
        (Value::Array(_), Value::Object(_)) => {
            let message = "invalid type: sequence, expected an object with named fields";
            Err(if path.is_empty() {
                Error::invalid(message)
            } else {
                Error::field(path, message)
            })
        }
        _ => Ok(()),
    }
}

/// A deserialisation's result, its error naming the field it happened at.
fn tracked<T, E: std::fmt::Display>(
    read: std::result::Result<T, serde_path_to_error::Error<E>>,
) -> Result<T> {
    read.map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        if path.is_empty() || path == "." {
            Error::invalid(msg)
        } else {
            Error::field(path, msg)
        }
    })
}

/// Check the `format` and `schema_version` of a file's top-level object (or
/// of a file embedded in another, such as a plan's topology).
pub fn check_envelope(
    obj: &serde_json::Map<String, serde_json::Value>,
    format: FileFormat,
) -> Result<()> {
    let (format_name, supported) = (format.name, format.reads);
    match obj.get("format") {
        Some(serde_json::Value::String(f)) if f == format_name => {}
        Some(other) => {
            return Err(Error::field(
                "format",
                format!("value {other} is not {format_name:?}: this is not a {format_name} file"),
            ))
        }
        None => {
            return Err(Error::field(
                "format",
                format!("missing; expected {format_name:?}"),
            ))
        }
    }
    match obj.get("schema_version") {
        Some(serde_json::Value::Number(n)) => {
            let v = n.as_u64().unwrap_or(u64::MAX);
            if !supported.iter().any(|&s| u64::from(s) == v) {
                return Err(Error::field(
                    "schema_version",
                    format!(
                        "value {n} is not supported by this dapple (supported: {}); \
                         upgrade dapple or re-create the file",
                        supported
                            .iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        Some(other) => {
            return Err(Error::field(
                "schema_version",
                format!("value {other} is not an integer"),
            ))
        }
        None => return Err(Error::field("schema_version", "missing")),
    }
    Ok(())
}

/// Pretty JSON with a trailing newline, the form every writer uses.
pub fn to_json<T: Serialize>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).expect("plain data always serializes");
    s.push('\n');
    s
}

/// JSON has no NaN or Infinity; Python's json module writes them anyway.
fn nan_hint(text: &str) -> &'static str {
    if text.contains("NaN") || text.contains("Infinity") {
        "; NaN and Infinity are not numbers in JSON"
    } else {
        ""
    }
}

/// Largest time, rate or latency a file may give (1e12: about 32 years in
/// milliseconds). With every input below it and above [`MIN_POSITIVE`],
/// every time, size and memory the planner computes from them stays a
/// finite number, so an infinite estimate can never be written.
pub const MAX_MEASURE: f64 = 1e12;
/// Smallest speed or bandwidth a file may give (1e-9: one bit per second).
pub const MIN_POSITIVE: f64 = 1e-9;

/// Reject NaN, infinities, negatives and values above [`MAX_MEASURE`] in a
/// field that must be a non-negative number.
pub fn check_non_negative(field: impl FnOnce() -> String, value: f64) -> Result<()> {
    if !(0.0..=MAX_MEASURE).contains(&value) {
        return Err(Error::field(
            field(),
            format!("value {value} must be a number in 0..={MAX_MEASURE:e}"),
        ));
    }
    Ok(())
}

/// Same, but the value must be at least [`MIN_POSITIVE`].
pub fn check_positive(field: impl FnOnce() -> String, value: f64) -> Result<()> {
    if !(MIN_POSITIVE..=MAX_MEASURE).contains(&value) {
        return Err(Error::field(
            field(),
            format!("value {value} must be a number in {MIN_POSITIVE:e}..={MAX_MEASURE:e}"),
        ));
    }
    Ok(())
}
