//! Enums that files and users spell by name: each is declared once with its
//! table of names, and gets `ALL`, `name`, `parse`, `Display`, `FromStr` and
//! serde from that table. The binding hands the same tables to Python (the
//! CLI's choices, `planner.BASELINES`), so a name is written only here.

/// Number of identifiers given (for the length of `ALL`).
#[doc(hidden)]
#[macro_export]
macro_rules! count_idents {
    () => { 0usize };
    ($head:ident $($tail:ident)*) => { 1usize + $crate::count_idents!($($tail)*) };
}

/// `named_enum! { /// docs  pub enum Kind("a kind") { /// docs  Variant = "name" | "alias", ... } }`
///
/// The first name of a variant is the one written; aliases are also read.
/// `what` completes the error "value "x" is not <what>; use ...".
#[macro_export]
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident($what:literal) {
            $($(#[$vmeta:meta])* $variant:ident = $text:literal $(| $alias:literal)*),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in the order users see them.
            pub const ALL: [$name; $crate::count_idents!($($variant)+)] = [$($name::$variant),+];

            /// The name files and users write.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// Every name, in the order of `ALL`.
            pub fn names() -> Vec<&'static str> {
                Self::ALL.iter().map(|v| v.name()).collect()
            }

            /// The value named `text` (a name or an alias).
            pub fn parse(text: &str) -> $crate::error::Result<$name> {
                match text {
                    $($text $(| $alias)* => Ok($name::$variant),)+
                    other => Err($crate::error::Error::invalid(format!(
                        "value {other:?} is not {}; use {}",
                        $what,
                        $crate::formats::names::one_of(&Self::names())
                    ))),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::error::Error;
            fn from_str(text: &str) -> $crate::error::Result<$name> {
                $name::parse(text)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<$name, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                $name::parse(&text).map_err(|e| serde::de::Error::custom(e.message))
            }
        }
    };
}

/// "a", "a or b", "a, b or c".
pub fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [only] => (*only).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    crate::named_enum! {
        pub enum Fruit("a fruit") {
            Apple = "apple" | "APPLE",
            Pear = "pear",
        }
    }

    #[test]
    fn names_parse_and_serde_come_from_one_table() {
        assert_eq!(Fruit::ALL, [Fruit::Apple, Fruit::Pear]);
        assert_eq!(Fruit::names(), vec!["apple", "pear"]);
        assert_eq!(Fruit::parse("APPLE").unwrap(), Fruit::Apple);
        assert_eq!(
            Fruit::parse("plum").unwrap_err().message,
            "value \"plum\" is not a fruit; use apple or pear"
        );
        assert_eq!(serde_json::to_string(&Fruit::Pear).unwrap(), "\"pear\"");
        let read: Fruit = serde_json::from_str("\"APPLE\"").unwrap();
        assert_eq!(read, Fruit::Apple);
        let bad = serde_json::from_str::<Fruit>("\"plum\"").unwrap_err();
        assert!(bad.to_string().contains("is not a fruit"), "{bad}");
    }

    #[test]
    fn lists_read_as_english() {
        assert_eq!(super::one_of(&["a"]), "a");
        assert_eq!(super::one_of(&["a", "b", "c"]), "a, b or c");
    }
}
