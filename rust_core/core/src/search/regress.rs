//! Plan-quality regression suites (`dapple.regress-suite`): cases to plan
//! and the simulated iteration each is expected to reach. Running them is
//! `planner/regress.py`'s; this is the file's one definition.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::formats::format::{check_non_negative, FileFormat, FileObject, REGRESS_SUITE};

/// How much slower than `expected_ms` a plan may simulate before its case
/// fails, when neither the case nor the suite says.
pub const DEFAULT_TOLERANCE: f64 = 0.01;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegressSuite {
    pub format: String,
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub about: Option<String>,
    /// A fraction; per case or suite-wide.
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
    pub cases: Vec<RegressCase>,
}

fn default_tolerance() -> f64 {
    DEFAULT_TOLERANCE
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegressCase {
    pub name: String,
    /// Relative to the suite file.
    pub profile: String,
    /// A spec, a preset or a topology file.
    pub topology: String,
    pub global_batch_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_micro_batch_size: Option<u32>,
    /// The plan's simulated iteration when the case was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_shape: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<f64>,
}

impl FileObject for RegressSuite {
    const FORMAT: FileFormat = REGRESS_SUITE;

    fn check(&self) -> Result<()> {
        check_non_negative(|| "tolerance".into(), self.tolerance)?;
        if self.cases.is_empty() {
            return Err(Error::field("cases", "needs a non-empty list of cases"));
        }
        for (i, case) in self.cases.iter().enumerate() {
            let at = |f: &str| format!("cases[{i}].{f}");
            for (field, value) in [
                ("name", &case.name),
                ("profile", &case.profile),
                ("topology", &case.topology),
            ] {
                if value.is_empty() {
                    return Err(Error::field(
                        at(field),
                        "value \"\" must be a non-empty string",
                    ));
                }
            }
            if case.global_batch_size == 0 {
                return Err(Error::field(
                    at("global_batch_size"),
                    "value 0 must be >= 1",
                ));
            }
            if case.min_micro_batch_size == Some(0) {
                return Err(Error::field(
                    at("min_micro_batch_size"),
                    "value 0 must be >= 1",
                ));
            }
            if let Some(ms) = case.expected_ms {
                check_non_negative(|| at("expected_ms"), ms)?;
            }
            if let Some(t) = case.tolerance {
                check_non_negative(|| at("tolerance"), t)?;
            }
            if self.cases[..i].iter().any(|c| c.name == case.name) {
                return Err(Error::field(
                    "cases",
                    format!(
                        "value {:?} names two cases; names must be unique",
                        case.name
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(cases: serde_json::Value) -> Result<RegressSuite> {
        RegressSuite::from_parts(serde_json::json!({ "cases": cases }))
    }

    #[test]
    fn suites_read_with_defaults_and_refuse_what_they_cannot_run() {
        let one = serde_json::json!({"name": "a", "profile": "p.json", "topology": "A", "global_batch_size": 64});
        let s = suite(serde_json::json!([one.clone()])).unwrap();
        assert_eq!(s.tolerance, DEFAULT_TOLERANCE);
        assert_eq!(RegressSuite::from_json(&s.to_json()).unwrap(), s);
        let e = suite(serde_json::json!([one.clone(), one.clone()])).unwrap_err();
        assert!(e.to_string().contains("unique"), "{e}");
        let mut zero = one.clone();
        zero["global_batch_size"] = 0.into();
        let e = suite(serde_json::json!([zero])).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("cases[0].global_batch_size"));
        let e = suite(serde_json::json!([])).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("cases"));
        let mut old = serde_json::to_value(&s).unwrap();
        old["schema_version"] = 1.into();
        let e = RegressSuite::from_value(old).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("schema_version"));
    }
}
