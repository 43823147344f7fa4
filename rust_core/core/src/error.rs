//! One error type for the whole core, with stable codes.
//!
//! The binding raises each `ErrorKind` as the Python exception class of
//! its code (`dapple.planner.errors.class_of_code`) and the CLI maps those to exit
//! codes, so a code here never changes meaning.

use std::fmt;

crate::named_enum! {
    /// What went wrong, by its stable machine-readable code: shown to users,
    /// matched by tests, and the key of the Python exception classes.
    pub enum ErrorKind("an error code") {
        /// A file or text that is not valid for its format (syntax, missing or
        /// bad field, unknown version).
        InvalidInput = "invalid_input",
        /// An input that is valid alone but cannot be used with the others
        /// (a batch size the GPUs cannot share, a plan for another topology).
        Incompatible = "incompatible_inputs",
        /// Nothing in the search space fits the devices' memory.
        Infeasible = "infeasible",
        /// Reading or writing a file failed.
        Io = "io_error",
        /// The work asked for is over a documented limit (`schedule::MAX_PASSES`).
        Limit = "limit_exceeded",
    }
}

impl ErrorKind {
    /// Stable machine-readable code (the enum's name).
    pub fn code(self) -> &'static str {
        self.name()
    }
}

/// Which of the inputs used together an error is about, where the core
/// does not know their files (a profile and a topology are matched in
/// `cost::Cluster::for_model`): the caller names that input's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    Profile,
    Topology,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Error {
    pub kind: ErrorKind,
    /// File (or other source) the error is about, if any.
    pub source: Option<String>,
    /// The input `field` is in, where `source` is not known here.
    pub input: Option<Input>,
    /// Dotted path of the offending field, e.g. `layers[3].measurements[0].fwd_ms`.
    pub field: Option<String>,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            source: None,
            input: None,
            field: None,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, message)
    }
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Error::invalid(message);
        e.field = Some(field.into());
        e
    }
    pub fn incompatible(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Incompatible, message)
    }
    pub fn infeasible(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Infeasible, message)
    }
    pub fn limit(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Limit, message)
    }
    /// Attach the file the error is about, unless one is already set.
    pub fn in_source(mut self, source: impl Into<String>) -> Self {
        if self.source.is_none() {
            self.source = Some(source.into());
        }
        self
    }
    /// Say which input the error is about.
    pub fn about(mut self, input: Input) -> Self {
        self.input = Some(input);
        self
    }
    /// Prefix the field path with `prefix` (used when a nested object is
    /// validated on its own and then embedded).
    pub fn under(mut self, prefix: &str) -> Self {
        self.field = Some(match self.field.take() {
            Some(f) if f.starts_with('[') => format!("{prefix}{f}"),
            Some(f) => format!("{prefix}.{f}"),
            None => prefix.to_string(),
        });
        self
    }
}

impl fmt::Display for Error {
    /// One line: `file: field X: message`. Control characters (a newline in
    /// a key or value of the input, say) are written escaped, so the line
    /// stays one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = String::new();
        if let Some(src) = &self.source {
            line.push_str(&format!("{src}: "));
        }
        if let Some(field) = &self.field {
            line.push_str(&format!("field {field}: "));
        }
        line.push_str(&self.message);
        for c in line.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                write!(f, "{c}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_is_one_line_whatever_the_input_holds() {
        let mut e = Error::field("inputs.\n", "unknown field `\n\t`");
        e.source = Some("a\rb.json".into());
        assert_eq!(
            e.to_string(),
            "a\\rb.json: field inputs.\\n: unknown field `\\n\\t`"
        );
    }
}
