//! The `log` directive's rules, as CoreDNS's `log` plugin reads them: the names a rule covers,
//! the classes of answers it writes, and its format, parsed once when the configuration loads
//! (the query log in `serve` renders them).

/// CoreDNS's Common Log Format, the `{common}` shortcut.
pub(crate) const COMMON: &str = "{remote}:{port} - {>id} \"{type} {class} {name} {proto} {size} \
                                 {>do} {>bufsize}\" {rcode} {>rflags} {rsize} {duration}";

/// One rule: a NAME of a `log` line, with that line's classes and format. A query is logged by
/// the first rule of its block whose name it equals or is under, and only by it: CoreDNS tries
/// the rules in order and stops at the first whose name matches, whether its classes match or
/// not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRule {
    /// The name in wire form, lowercase (`.` when the line names none).
    pub scope: Vec<u8>,
    pub classes: LogClasses,
    /// `None`: no FORMAT on the line, nodedns's structured event (the facts of CoreDNS's
    /// default Common Log Format, as fields). `Some`: the line rendered from FORMAT.
    pub format: Option<LogFormat>,
}

/// The classes of answers a rule writes (`class all|success|denial|error...`; `all` sets
/// every one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogClasses {
    pub success: bool,
    pub denial: bool,
    pub error: bool,
}

impl LogClasses {
    pub const ALL: LogClasses = LogClasses {
        success: true,
        denial: true,
        error: true,
    };
    /// No `class` line read yet.
    pub(crate) const NONE: LogClasses = LogClasses {
        success: false,
        denial: false,
        error: false,
    };

    /// Adds the classes of one `class` line (several lines add up, as in CoreDNS).
    pub(crate) fn add_line(&mut self, words: &[&str]) -> Result<(), String> {
        if words.is_empty() {
            return Err("log class: expected `class all|success|denial|error...`".to_owned());
        }
        for word in words {
            match *word {
                "all" => *self = LogClasses::ALL,
                "success" => self.success = true,
                "denial" => self.denial = true,
                "error" => self.error = true,
                _ => {
                    return Err(format!(
                        "log class: `{word}` is not a class (all, success, denial, error)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The classes read, or `all` when no `class` line was.
    pub(crate) fn or_all(self) -> LogClasses {
        if self == LogClasses::NONE {
            LogClasses::ALL
        } else {
            self
        }
    }

    pub fn all(self) -> bool {
        self == LogClasses::ALL
    }
}

/// A parsed FORMAT: literal text and placeholders, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFormat(pub Vec<Piece>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Field(Field),
}

/// The placeholders CoreDNS's replacer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `{type}`
    Type,
    /// `{name}`
    Name,
    /// `{class}`
    Class,
    /// `{proto}`
    Proto,
    /// `{remote}`
    Remote,
    /// `{local}`
    Local,
    /// `{size}`
    Size,
    /// `{port}`
    Port,
    /// `{duration}`
    Duration,
    /// `{rcode}`
    Rcode,
    /// `{rsize}`
    Rsize,
    /// `{>rflags}`
    Rflags,
    /// `{>bufsize}`
    Bufsize,
    /// `{>do}`
    Do,
    /// `{>id}`
    Id,
    /// `{>opcode}`
    Opcode,
    /// `{/LABEL}`: a metadata label. nodedns has no metadata, so it is `-`, as CoreDNS writes a
    /// label no plugin set.
    Metadata,
}

impl Field {
    fn named(text: &str) -> Option<Field> {
        Some(match text {
            "{type}" => Field::Type,
            "{name}" => Field::Name,
            "{class}" => Field::Class,
            "{proto}" => Field::Proto,
            "{remote}" => Field::Remote,
            "{local}" => Field::Local,
            "{size}" => Field::Size,
            "{port}" => Field::Port,
            "{duration}" => Field::Duration,
            "{rcode}" => Field::Rcode,
            "{rsize}" => Field::Rsize,
            "{>rflags}" => Field::Rflags,
            "{>bufsize}" => Field::Bufsize,
            "{>do}" => Field::Do,
            "{>id}" => Field::Id,
            "{>opcode}" => Field::Opcode,
            _ if text.starts_with("{/") => Field::Metadata,
            _ => return None,
        })
    }
}

impl LogFormat {
    /// FORMAT as CoreDNS reads it: `{common}` and `{combined}` expanded first; then, scanning
    /// for each `}` and the last `{` before it, a known placeholder is a field and anything
    /// else (an unknown `{x}`, a lone brace) is text, kept as written.
    pub fn parse(format: &str) -> LogFormat {
        let combined = format!("{COMMON} \"{{>opcode}}\"");
        let expanded = format
            .replace("{common}", COMMON)
            .replace("{combined}", &combined);
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = expanded.as_str();
        while let Some(close) = rest.find('}') {
            let (head, tail) = rest.split_at(close + 1);
            match head
                .rfind('{')
                .and_then(|open| Some((open, Field::named(&head[open..])?)))
            {
                Some((open, field)) => {
                    text.push_str(&head[..open]);
                    if !text.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    pieces.push(Piece::Field(field));
                }
                None => text.push_str(head),
            }
            rest = tail;
        }
        text.push_str(rest);
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        LogFormat(pieces)
    }
}

/// The rules of one `log` line (one per NAME) with its `classes`, or the problem with it.
pub(crate) fn rules(args: &[&str], classes: LogClasses) -> Result<Vec<LogRule>, String> {
    // FORMAT only as the last of two or more arguments, and only if it holds a `{`: otherwise
    // every argument is a name (`log . combined` logs `.` and `combined.`).
    let (names, format) = match args {
        [] => (&["."][..], None),
        [names @ .., last] if !names.is_empty() && last.contains('{') => {
            (names, Some(LogFormat::parse(last)))
        }
        _ => (args, None),
    };
    let classes = classes.or_all();
    names
        .iter()
        .map(|name| {
            let canonical = super::values::canonical_name(name).map_err(|e| format!("log: {e}"))?;
            Ok(LogRule {
                scope: super::values::wire(&canonical),
                classes,
                format: format.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Piece {
        Piece::Text(s.to_owned())
    }

    #[test]
    fn a_format_is_fields_and_text_as_coredns_splits_it() {
        use Field::*;
        assert_eq!(
            LogFormat::parse("{remote}:{port} {type} {name} {rcode}").0,
            [
                Piece::Field(Remote),
                text(":"),
                Piece::Field(Port),
                text(" "),
                Piece::Field(Type),
                text(" "),
                Piece::Field(Name),
                text(" "),
                Piece::Field(Rcode),
            ]
        );
        // Unknown placeholders and lone braces stay text; `{ {name} }` finds the inner one.
        assert_eq!(
            LogFormat::parse("A } {x} { {name} } {/pod} end").0,
            [
                text("A } {x} { "),
                Piece::Field(Name),
                text(" } "),
                Piece::Field(Metadata),
                text(" end"),
            ]
        );
        assert_eq!(LogFormat::parse("{common}"), LogFormat::parse(COMMON));
        let combined = LogFormat::parse("{combined}").0;
        assert_eq!(
            combined[..combined.len() - 3],
            LogFormat::parse(COMMON).0[..]
        );
        assert_eq!(
            combined[combined.len() - 3..],
            [text(" \""), Piece::Field(Opcode), text("\"")]
        );
    }

    #[test]
    fn the_last_argument_is_a_format_only_when_it_holds_a_brace() {
        let all = LogClasses::NONE;
        let one = rules(&[], all).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(
            (one[0].scope.as_slice(), &one[0].format),
            (&[0u8][..], &None)
        );
        assert!(one[0].classes.all());
        // lablabs' `log . combined`: two names, the default format.
        let two = rules(&[".", "combined"], all).unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[1].scope, b"\x08combined\x00");
        assert!(two.iter().all(|r| r.format.is_none()));
        // A single argument is a name whatever it holds.
        assert_eq!(rules(&["{common}"], all).unwrap()[0].format, None);
        let mut denial = LogClasses::NONE;
        denial.add_line(&["denial"]).unwrap();
        let formatted = rules(&["example.org", ".", "{name} {rcode}"], denial).unwrap();
        assert_eq!(formatted.len(), 2);
        assert_eq!(formatted[0].scope, b"\x07example\x03org\x00");
        assert!(
            formatted
                .iter()
                .all(|r| r.format.is_some() && r.classes == denial && !r.classes.all())
        );
    }

    #[test]
    fn classes_add_up_and_bad_ones_are_errors() {
        let mut c = LogClasses::NONE;
        c.add_line(&["denial"]).unwrap();
        c.add_line(&["error"]).unwrap();
        assert_eq!(
            c,
            LogClasses {
                success: false,
                denial: true,
                error: true
            }
        );
        let mut c = LogClasses::NONE;
        c.add_line(&["success", "all"]).unwrap();
        assert!(c.all());
        assert!(LogClasses::NONE.or_all().all());
        let mut c = LogClasses::NONE;
        assert_eq!(
            c.add_line(&[]).unwrap_err(),
            "log class: expected `class all|success|denial|error...`"
        );
        let err = c.add_line(&["nodata"]).unwrap_err();
        assert!(err.contains("`nodata` is not a class"), "{err}");
    }
}
