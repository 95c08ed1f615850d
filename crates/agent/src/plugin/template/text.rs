//! The part of Go's `text/template` that CoreDNS `template` answers are written in.
//!
//! A template is text with actions `{{ PIPELINE }}` (`{{-` and `-}}` trim the white space beside
//! them, `{{/* … */}}` is a comment). A pipeline is commands joined by `|`, the value of each
//! passed as the last argument of the next; a command is a field (`.Name`, `.Group.a`), a
//! constant (`"text"`, `` `raw` ``, `16`), a parenthesized pipeline, or a call of `index`,
//! `parseInt` or `.Meta`. The fields are CoreDNS's `templateData`: `.Name`, `.Zone`, `.Class`,
//! `.Type`, `.Regex`, `.Match`, `.Group`, `.Remote`, `.Meta`. Everything else Go's templates
//! have (`if`, `range`, variables, `printf`, `.Message`, `.Question`, …) is refused when the
//! Corefile is read, with its name, rather than failing on the first query that uses it.
//!
//! Values print as Go's `fmt` prints them: strings as they are, numbers in decimal, `.Match` as
//! `[a b]`, `.Group` as `map[k:v …]` in key order, a missing map key as `<no value>`.

use std::collections::BTreeMap;
use std::fmt;

use crate::plugin::go;

/// A parsed template.
#[derive(Debug, Clone)]
pub(crate) struct Text {
    nodes: Vec<Node>,
}

#[derive(Debug, Clone)]
enum Node {
    Literal(String),
    Action(Pipeline),
}

#[derive(Debug, Clone)]
struct Pipeline {
    commands: Vec<Command>,
}

#[derive(Debug, Clone)]
enum Command {
    /// A field, a constant or a parenthesized pipeline, which takes no arguments.
    Operand(Operand),
    /// A function (or `.Meta`) and its arguments.
    Call(Func, Vec<Operand>),
}

#[derive(Debug, Clone)]
enum Operand {
    Field(Field),
    Str(String),
    Int(i64),
    Nested(Box<Pipeline>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Func {
    Index,
    ParseInt,
    Meta,
}

impl Func {
    fn name(self) -> &'static str {
        match self {
            Func::Index => "index",
            Func::ParseInt => "parseInt",
            Func::Meta => ".Meta",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Name,
    Zone,
    Class,
    Type,
    Regex,
    Match,
    Group,
    /// `.Group.KEY`
    GroupKey(String),
    Remote,
}

/// What one query gives the template (CoreDNS's `templateData`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Data {
    pub name: String,
    pub zone: String,
    pub class: String,
    pub rtype: String,
    pub regex: String,
    /// The whole match and every group, unmatched groups empty.
    pub matches: Vec<String>,
    /// Every group by its index and, for named ones, by name.
    pub groups: BTreeMap<String, String>,
    pub remote: String,
}

/// A value while a pipeline runs.
#[derive(Debug, Clone)]
enum Value {
    Str(String),
    Int(i64),
    Uint(u64),
    List(Vec<String>),
    Map(BTreeMap<String, String>),
    /// A key missing from a map, read as a field: Go prints `<no value>`.
    Missing,
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Str(s) => f.write_str(s),
            Value::Int(n) => write!(f, "{n}"),
            Value::Uint(n) => write!(f, "{n}"),
            Value::List(items) => write!(f, "[{}]", items.join(" ")),
            Value::Map(map) => {
                let pairs: Vec<String> = map.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                write!(f, "map[{}]", pairs.join(" "))
            }
            Value::Missing => f.write_str("<no value>"),
        }
    }
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Str(_) => "string",
            Value::Int(_) => "int",
            Value::Uint(_) => "uint64",
            Value::List(_) => "[]string",
            Value::Map(_) => "map[string]string",
            Value::Missing => "invalid value",
        }
    }
}

impl Text {
    /// Parses `source`; the error names what is wrong or not supported.
    pub(crate) fn parse(source: &str) -> Result<Text, String> {
        let mut nodes = Vec::new();
        let mut rest = source;
        let mut trim_next = false;
        while !rest.is_empty() {
            let Some(open) = rest.find("{{") else {
                push_literal(&mut nodes, rest, trim_next, false);
                break;
            };
            let after = &rest[open + 2..];
            let trim_before = after.starts_with("- ")
                || after.starts_with("-\t")
                || after.starts_with("-\n")
                || after.starts_with("-\r");
            push_literal(&mut nodes, &rest[..open], trim_next, trim_before);
            let body_start = if trim_before { 1 } else { 0 };
            let Some(close) = after.find("}}") else {
                return Err("an action `{{` is not closed by `}}`".to_owned());
            };
            let mut body = &after[body_start..close];
            trim_next = false;
            if body.ends_with(" -")
                || body.ends_with("\t-")
                || body.ends_with("\n-")
                || body.ends_with("\r-")
            {
                body = &body[..body.len() - 1];
                trim_next = true;
            }
            rest = &after[close + 2..];
            let trimmed = body.trim();
            if trimmed.starts_with("/*") {
                if !trimmed.ends_with("*/") {
                    return Err("a comment `{{/*` is not closed by `*/}}`".to_owned());
                }
                continue;
            }
            let tokens = lex(body)?;
            if tokens.is_empty() {
                return Err("an empty action `{{ }}`".to_owned());
            }
            let mut parser = Parser { tokens, at: 0 };
            let pipeline = parser.pipeline()?;
            if let Some(t) = parser.tokens.get(parser.at) {
                return Err(format!("unexpected `{t}` in an action"));
            }
            nodes.push(Node::Action(pipeline));
        }
        Ok(Text { nodes })
    }

    /// Renders the template for one query; the error is Go's reason (index out of range, a
    /// number parseInt cannot read, …).
    pub(crate) fn render(&self, data: &Data) -> Result<String, String> {
        let mut out = String::new();
        for node in &self.nodes {
            match node {
                Node::Literal(text) => out.push_str(text),
                Node::Action(p) => out.push_str(&p.run(data)?.to_string()),
            }
        }
        Ok(out)
    }
}

fn push_literal(nodes: &mut Vec<Node>, text: &str, trim_start: bool, trim_end: bool) {
    let mut text = text;
    if trim_start {
        text = text.trim_start();
    }
    if trim_end {
        text = text.trim_end();
    }
    if !text.is_empty() {
        nodes.push(Node::Literal(text.to_owned()));
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// `.`, `.Name`, `.Group.a`: the words after the first dot.
    Field(Vec<String>),
    Ident(String),
    Str(String),
    Int(i64),
    Pipe,
    Open,
    Close,
    Variable(String),
    Other(String),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Field(parts) => write!(f, ".{}", parts.join(".")),
            Token::Ident(s) | Token::Other(s) => f.write_str(s),
            Token::Variable(s) => write!(f, "${s}"),
            Token::Str(s) => write!(f, "{s:?}"),
            Token::Int(n) => write!(f, "{n}"),
            Token::Pipe => f.write_str("|"),
            Token::Open => f.write_str("("),
            Token::Close => f.write_str(")"),
        }
    }
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn lex(body: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = body.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        match c {
            '|' => {
                tokens.push(Token::Pipe);
                i += 1;
            }
            '(' => {
                tokens.push(Token::Open);
                i += 1;
            }
            ')' => {
                tokens.push(Token::Close);
                i += 1;
            }
            '"' => {
                let mut s = String::new();
                i += 1;
                loop {
                    let Some(&c) = chars.get(i) else {
                        return Err("a string constant is not closed by `\"`".to_owned());
                    };
                    i += 1;
                    match c {
                        '"' => break,
                        '\\' => {
                            let Some(&e) = chars.get(i) else {
                                return Err("a string constant ends in `\\`".to_owned());
                            };
                            i += 1;
                            s.push(match e {
                                'n' => '\n',
                                't' => '\t',
                                '\\' => '\\',
                                '"' => '"',
                                other => {
                                    return Err(format!(
                                        "the escape `\\{other}` in a string constant is not supported"
                                    ));
                                }
                            });
                        }
                        c => s.push(c),
                    }
                }
                tokens.push(Token::Str(s));
            }
            '`' => {
                let start = i + 1;
                let Some(len) = chars[start..].iter().position(|&c| c == '`') else {
                    return Err("a raw string constant is not closed by a backquote".to_owned());
                };
                tokens.push(Token::Str(chars[start..start + len].iter().collect()));
                i = start + len + 1;
            }
            '.' => {
                let mut parts = Vec::new();
                while chars.get(i) == Some(&'.') {
                    i += 1;
                    let start = i;
                    while chars.get(i).is_some_and(|&c| is_word(c)) {
                        i += 1;
                    }
                    if start == i {
                        break;
                    }
                    parts.push(chars[start..i].iter().collect());
                }
                tokens.push(Token::Field(parts));
            }
            '$' => {
                let start = i + 1;
                i = start;
                while chars.get(i).is_some_and(|&c| is_word(c)) {
                    i += 1;
                }
                tokens.push(Token::Variable(chars[start..i].iter().collect()));
            }
            c if c.is_ascii_digit() || c == '-' || c == '+' => {
                let start = i;
                i += 1;
                while chars.get(i).is_some_and(|&c| is_word(c) || c == '.') {
                    i += 1;
                }
                let text: String = chars[start..i].iter().collect();
                match parse_go_int(&text) {
                    Some(n) => tokens.push(Token::Int(n)),
                    None => {
                        return Err(format!(
                            "the number `{text}` is not supported (only whole numbers)"
                        ));
                    }
                }
            }
            c if is_word(c) => {
                let start = i;
                while chars.get(i).is_some_and(|&c| is_word(c)) {
                    i += 1;
                }
                tokens.push(Token::Ident(chars[start..i].iter().collect()));
            }
            other => {
                let start = i;
                i += 1;
                while chars
                    .get(i)
                    .is_some_and(|&c| !c.is_whitespace() && !is_word(c) && c != '.')
                {
                    i += 1;
                }
                let _ = other;
                tokens.push(Token::Other(chars[start..i].iter().collect()));
            }
        }
    }
    Ok(tokens)
}

/// A Go integer constant: decimal, `0x`, `0o`, `0b`, or a leading `0` for octal.
fn parse_go_int(text: &str) -> Option<i64> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let value = i64::try_from(go::parse_uint(digits, 0, 64).ok()?).ok()?;
    Some(if negative { -value } else { value })
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

/// Go's keywords and built-in functions: named in the refusal so that the operator knows which
/// part of their template nodedns does not run.
const GO_KEYWORDS: &[&str] = &[
    "if", "else", "end", "range", "with", "define", "template", "block", "break", "continue",
];

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn pipeline(&mut self) -> Result<Pipeline, String> {
        let mut commands = vec![self.command()?];
        while self.peek() == Some(&Token::Pipe) {
            self.at += 1;
            let command = self.command()?;
            if let Command::Operand(_) = command {
                return Err("only a function can follow `|` in a pipeline".to_owned());
            }
            commands.push(command);
        }
        Ok(Pipeline { commands })
    }

    fn command(&mut self) -> Result<Command, String> {
        let func = match self.peek() {
            Some(Token::Ident(name)) => Some(match name.as_str() {
                "index" => Func::Index,
                "parseInt" => Func::ParseInt,
                keyword if GO_KEYWORDS.contains(&keyword) => {
                    return Err(format!(
                        "`{keyword}` actions are not supported in template answers"
                    ));
                }
                "true" | "false" | "nil" => {
                    return Err(format!("the constant `{name}` is not supported"));
                }
                other => {
                    return Err(format!(
                        "the function `{other}` is not supported (template answers may call \
                         `index`, `parseInt` and `.Meta`)"
                    ));
                }
            }),
            Some(Token::Field(parts)) if parts.first().is_some_and(|p| p == "Meta") => {
                if parts.len() > 1 {
                    return Err(format!("`.{}`: `.Meta` has no fields", parts.join(".")));
                }
                Some(Func::Meta)
            }
            _ => None,
        };
        if let Some(func) = func {
            self.at += 1;
            let mut args = Vec::new();
            while let Some(t) = self.peek() {
                if matches!(t, Token::Pipe | Token::Close) {
                    break;
                }
                args.push(self.operand()?);
            }
            let arity_ok = match func {
                Func::Index => !args.is_empty(),
                // The piped value may be the last argument.
                Func::ParseInt => (2..=3).contains(&args.len()),
                Func::Meta => args.len() <= 1,
            };
            if !arity_ok {
                return Err(format!(
                    "wrong number of arguments for `{}`: {}",
                    func.name(),
                    match func {
                        Func::Index => "index ITEM [KEY...]",
                        Func::ParseInt => "parseInt STRING BASE BITS",
                        Func::Meta => ".Meta NAME",
                    }
                ));
            }
            return Ok(Command::Call(func, args));
        }
        let operand = self.operand()?;
        if let Some(t) = self.peek() {
            if !matches!(t, Token::Pipe | Token::Close) {
                return Err(format!(
                    "`{t}` is given as an argument to a value, not a function"
                ));
            }
        }
        Ok(Command::Operand(operand))
    }

    fn operand(&mut self) -> Result<Operand, String> {
        let Some(token) = self.tokens.get(self.at).cloned() else {
            return Err("an action ends where a value is expected".to_owned());
        };
        self.at += 1;
        match token {
            Token::Str(s) => Ok(Operand::Str(s)),
            Token::Int(n) => Ok(Operand::Int(n)),
            Token::Open => {
                let inner = self.pipeline()?;
                if self.peek() != Some(&Token::Close) {
                    return Err("a `(` is not closed by `)`".to_owned());
                }
                self.at += 1;
                Ok(Operand::Nested(Box::new(inner)))
            }
            Token::Field(parts) => field(&parts).map(Operand::Field),
            Token::Variable(name) => {
                Err(format!("template variables (`${name}`) are not supported"))
            }
            Token::Ident(name) => Err(format!(
                "`{name}` can only be called as the first word of a command, or in `( )`"
            )),
            other => Err(format!("unexpected `{other}` in an action")),
        }
    }
}

fn field(parts: &[String]) -> Result<Field, String> {
    let written = format!(".{}", parts.join("."));
    let Some(first) = parts.first() else {
        return Err(
            "`.` (the whole data) is not supported; name a field, such as `.Name`".to_owned(),
        );
    };
    let simple = match first.as_str() {
        "Name" => Field::Name,
        "Zone" => Field::Zone,
        "Class" => Field::Class,
        "Type" => Field::Type,
        "Regex" => Field::Regex,
        "Match" => Field::Match,
        "Remote" => Field::Remote,
        "Group" => match parts {
            [_] => Field::Group,
            [_, key] => return Ok(Field::GroupKey(key.clone())),
            _ => return Err(format!("`{written}`: a group's value has no fields")),
        },
        "Message" | "Question" => {
            return Err(format!(
                "`{written}`: `.{first}` is not supported (template answers may use .Name, \
                 .Zone, .Class, .Type, .Regex, .Match, .Group, .Remote and .Meta)"
            ));
        }
        other => {
            return Err(format!(
                "`{written}`: there is no field `{other}` (template answers may use .Name, \
                 .Zone, .Class, .Type, .Regex, .Match, .Group, .Remote and .Meta)"
            ));
        }
    };
    if parts.len() > 1 {
        return Err(format!("`{written}`: `.{first}` has no fields"));
    }
    Ok(simple)
}

impl Pipeline {
    fn run(&self, data: &Data) -> Result<Value, String> {
        let mut piped: Option<Value> = None;
        for command in &self.commands {
            piped = Some(command.run(data, piped.take())?);
        }
        Ok(piped.unwrap_or(Value::Missing))
    }
}

impl Command {
    fn run(&self, data: &Data, piped: Option<Value>) -> Result<Value, String> {
        match self {
            Command::Operand(o) => o.eval(data),
            Command::Call(func, args) => {
                let mut values = args
                    .iter()
                    .map(|a| a.eval(data))
                    .collect::<Result<Vec<_>, _>>()?;
                values.extend(piped);
                call(*func, values)
            }
        }
    }
}

impl Operand {
    fn eval(&self, data: &Data) -> Result<Value, String> {
        Ok(match self {
            Operand::Str(s) => Value::Str(s.clone()),
            Operand::Int(n) => Value::Int(*n),
            Operand::Nested(p) => p.run(data)?,
            Operand::Field(f) => match f {
                Field::Name => Value::Str(data.name.clone()),
                Field::Zone => Value::Str(data.zone.clone()),
                Field::Class => Value::Str(data.class.clone()),
                Field::Type => Value::Str(data.rtype.clone()),
                Field::Regex => Value::Str(data.regex.clone()),
                Field::Remote => Value::Str(data.remote.clone()),
                Field::Match => Value::List(data.matches.clone()),
                Field::Group => Value::Map(data.groups.clone()),
                Field::GroupKey(k) => data
                    .groups
                    .get(k)
                    .map_or(Value::Missing, |v| Value::Str(v.clone())),
            },
        })
    }
}

fn call(func: Func, args: Vec<Value>) -> Result<Value, String> {
    match func {
        // Without the metadata plugin's providers (node-cache compiles none in), every name is
        // unknown and CoreDNS returns "".
        Func::Meta => match args.as_slice() {
            [Value::Str(_)] => Ok(Value::Str(String::new())),
            [other] => Err(format!(
                "error calling Meta: wrong type for value; expected string; got {}",
                other.kind()
            )),
            _ => Err("error calling Meta: wrong number of args: want 1".to_owned()),
        },
        Func::Index => {
            let mut args = args.into_iter();
            let mut item = args.next().unwrap_or(Value::Missing);
            for key in args {
                item = match (item, key) {
                    (Value::List(list), key) => {
                        let i = match key {
                            Value::Int(i) => i128::from(i),
                            Value::Uint(i) => i128::from(i),
                            other => {
                                return Err(format!(
                                    "error calling index: cannot index slice/array with type {}",
                                    other.kind()
                                ));
                            }
                        };
                        match usize::try_from(i).ok().and_then(|i| list.get(i)) {
                            Some(v) => Value::Str(v.clone()),
                            None => {
                                return Err(format!(
                                    "error calling index: index out of range: {i}"
                                ));
                            }
                        }
                    }
                    // A missing key gives the element type's zero value.
                    (Value::Map(map), Value::Str(k)) => {
                        Value::Str(map.get(&k).cloned().unwrap_or_default())
                    }
                    (Value::Map(_), key) => {
                        return Err(format!(
                            "error calling index: value has type {}; should be string",
                            key.kind()
                        ));
                    }
                    (item, _) => {
                        return Err(format!(
                            "error calling index: can't index item of type {}",
                            item.kind()
                        ));
                    }
                };
            }
            Ok(item)
        }
        Func::ParseInt => {
            let [text, base, bits] = <[Value; 3]>::try_from(args)
                .map_err(|_| "error calling parseInt: wrong number of args: want 3".to_owned())?;
            let Value::Str(text) = text else {
                return Err(format!(
                    "error calling parseInt: wrong type for value; expected string; got {}",
                    text.kind()
                ));
            };
            let int = |v: Value| match v {
                Value::Int(n) => Ok(n),
                other => Err(format!(
                    "error calling parseInt: wrong type for value; expected int; got {}",
                    other.kind()
                )),
            };
            let (base, bits) = (int(base)?, int(bits)?);
            // Go rejects a negative or huge base or size the same way as an invalid one.
            let base = u32::try_from(base).unwrap_or(1);
            let bits = u32::try_from(bits).unwrap_or(65);
            go::parse_uint(&text, base, bits)
                .map(Value::Uint)
                .map_err(|e| {
                    format!("error calling parseInt: strconv.ParseUint: parsing {text:?}: {e}")
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> Data {
        let mut groups = BTreeMap::new();
        for (k, v) in [
            ("0", "ip-10-95-12-8.example."),
            ("1", ""),
            ("2", "95"),
            ("b", "95"),
        ] {
            groups.insert(k.to_owned(), v.to_owned());
        }
        Data {
            name: "ip-10-95-12-8.example.".to_owned(),
            zone: "example.".to_owned(),
            class: "IN".to_owned(),
            rtype: "A".to_owned(),
            regex: "x".to_owned(),
            matches: vec![
                "ip-10-95-12-8.example.".to_owned(),
                String::new(),
                "95".to_owned(),
            ],
            groups,
            remote: "10.240.0.1".to_owned(),
        }
    }

    fn render(source: &str) -> Result<String, String> {
        Text::parse(source)?.render(&data())
    }

    #[test]
    fn fields_and_groups_render_as_go_prints_them() {
        assert_eq!(
            render("{{ .Name }} 60 {{ .Class }} {{ .Type }} 10.{{ .Group.b }}.0.1").unwrap(),
            "ip-10-95-12-8.example. 60 IN A 10.95.0.1"
        );
        assert_eq!(
            render("{{ .Zone }}|{{ .Remote }}").unwrap(),
            "example.|10.240.0.1"
        );
        assert_eq!(
            render(r#"{{ index .Group "b" }}{{ index .Match 2 }}"#).unwrap(),
            "9595"
        );
        assert_eq!(render(r#"[{{ index .Group "nope" }}]"#).unwrap(), "[]");
        assert_eq!(render("{{ .Group.nope }}").unwrap(), "<no value>");
        assert_eq!(
            render("{{ .Match }}").unwrap(),
            "[ip-10-95-12-8.example.  95]"
        );
        assert_eq!(
            render("{{ .Group }}").unwrap(),
            "map[0:ip-10-95-12-8.example. 1: 2:95 b:95]"
        );
        assert_eq!(
            render(r#"{{ .Meta "kubernetes/client-namespace" }}x"#).unwrap(),
            "x"
        );
    }

    #[test]
    fn parse_int_is_strconv_parse_uint() {
        assert_eq!(render(r#"{{ parseInt "0a" 16 8 }}"#).unwrap(), "10");
        assert_eq!(render(r#"{{ parseInt "ff" 16 8 }}"#).unwrap(), "255");
        assert_eq!(render(r#"{{ 8 | parseInt "0x1f" 0 }}"#).unwrap(), "31");
        assert_eq!(
            render(r#"{{ parseInt (index .Match 2) 10 8 }}"#).unwrap(),
            "95"
        );
        assert_eq!(
            render(r#"{{ parseInt "gg" 16 8 }}"#).unwrap_err(),
            r#"error calling parseInt: strconv.ParseUint: parsing "gg": invalid syntax"#
        );
        assert_eq!(
            render(r#"{{ parseInt "100" 16 8 }}"#).unwrap_err(),
            r#"error calling parseInt: strconv.ParseUint: parsing "100": value out of range"#
        );
        assert!(render(r#"{{ parseInt "1" "16" 8 }}"#).is_err());
    }

    #[test]
    fn index_out_of_range_fails_at_render_time() {
        let text = Text::parse("{{ .Name }} 60 IN TXT \"{{ index .Match 3 }}\"").unwrap();
        assert_eq!(
            text.render(&data()).unwrap_err(),
            "error calling index: index out of range: 3"
        );
    }

    #[test]
    fn trim_markers_and_comments_follow_go() {
        assert_eq!(render("a  {{- .Zone -}}  b").unwrap(), "aexample.b");
        assert_eq!(render("a {{-3}}").unwrap(), "a -3");
        assert_eq!(render("a{{/* note */}}b").unwrap(), "ab");
        assert_eq!(render("{{ `raw \"q\"` }}").unwrap(), "raw \"q\"");
    }

    #[test]
    fn unsupported_parts_are_refused_by_name() {
        for (source, named) in [
            ("{{ if .Name }}x{{ end }}", "`if`"),
            ("{{ printf \"%s\" .Name }}", "`printf`"),
            ("{{ .Question.Name }}", "`.Question`"),
            ("{{ .Message }}", "`.Message`"),
            ("{{ $x := 1 }}", "`$x`"),
            ("{{ .Nope }}", "`Nope`"),
            ("{{ .Name", "not closed"),
            ("{{ .Name .Zone }}", "not a function"),
            ("{{ .Name | .Zone }}", "only a function"),
            (
                "{{ parseInt \"1\" }}",
                "wrong number of arguments for `parseInt`",
            ),
        ] {
            let err = Text::parse(source).unwrap_err();
            assert!(err.contains(named), "{source}: {err}");
        }
    }
}
