//! Corefile syntax, without meaning: words, server blocks, directives and their nested blocks.
//!
//! The rules are CoreDNS's (its Caddy v1 lexer and parser): words are separated by whitespace;
//! `"..."` quotes a word (it may span lines, `\"` is a literal quote); `#` starts a comment that
//! runs to the end of the line, wherever it appears outside quotes; `{` and `}` are words of their
//! own; a server block is a line of keys (a key ending in `,` continues on the next line) followed
//! by `{ ... }`, or by lines up to the next `}` or the end of the file; a directive is the first
//! word of a line and takes the words after it on that line, plus an optional `{ ... }` block of
//! its own lines. `{$NAME}` and `{%NAME%}` in a word are replaced by the environment variable
//! NAME, an unset one by nothing (with a warning). Snippets and `import` are spliced in first
//! ([`super::import`]).
//!
//! A block whose keys name several ports is one block per port (CoreDNS serves each key as its
//! own server with the block's directives), and a key's port is what follows its last `:` only
//! when that is a number, as in CoreDNS ([`split_port`]).
//!
//! Every word keeps its line, so every later error can name `file:line`.

use std::collections::HashMap;
use std::path::Path;

use super::Problem;
use super::import::{self, Files, Lines};

/// One word of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Word {
    pub text: String,
    pub line: usize,
    /// Written in quotes: never a brace, never a comment.
    pub quoted: bool,
}

/// A directive (or a line inside a directive's block): name, arguments, nested lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Directive {
    pub name: String,
    pub line: usize,
    pub args: Vec<Word>,
    /// Lines of the `{ ... }` block after the arguments; empty when there is none.
    pub block: Vec<Directive>,
    /// Whether a `{ ... }` block was written (even an empty one).
    pub has_block: bool,
}

/// A server block: its keys (`zone[:port]`, possibly several) and its directives in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Block {
    pub keys: Vec<Word>,
    pub line: usize,
    pub directives: Vec<Directive>,
}

/// Splits `text` into words. Never fails: an unterminated quote runs to the end of the file and
/// is reported by the caller through [`parse`].
fn lex(text: &str) -> (Vec<Word>, Option<usize>) {
    let mut words = Vec::new();
    let mut line = 1;
    let mut chars = text.chars().peekable();
    let mut current = String::new();
    let mut start = 1;
    let mut comment = false;
    let mut unterminated = None;
    while let Some(ch) = chars.next() {
        if ch.is_whitespace() {
            if ch == '\n' {
                line += 1;
                comment = false;
            }
            if !current.is_empty() {
                words.push(Word {
                    text: std::mem::take(&mut current),
                    line: start,
                    quoted: false,
                });
            }
            continue;
        }
        if comment {
            continue;
        }
        if ch == '#' {
            comment = true;
            if !current.is_empty() {
                words.push(Word {
                    text: std::mem::take(&mut current),
                    line: start,
                    quoted: false,
                });
            }
            continue;
        }
        if current.is_empty() && ch == '"' {
            // A quoted word: up to the next unescaped quote, newlines included.
            let opened = line;
            let mut value = String::new();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' if chars.peek() == Some(&'"') => {
                        chars.next();
                        value.push('"');
                    }
                    '"' => {
                        closed = true;
                        break;
                    }
                    '\n' => {
                        line += 1;
                        value.push(c);
                    }
                    _ => value.push(c),
                }
            }
            if !closed {
                unterminated = Some(opened);
            }
            words.push(Word {
                text: value,
                line: opened,
                quoted: true,
            });
            continue;
        }
        if current.is_empty() {
            start = line;
        }
        current.push(ch);
    }
    if !current.is_empty() {
        words.push(Word {
            text: current,
            line: start,
            quoted: false,
        });
    }
    (words, unterminated)
}

fn is_open(w: &Word) -> bool {
    !w.quoted && w.text == "{"
}

fn is_close(w: &Word) -> bool {
    !w.quoted && w.text == "}"
}

/// Replaces `{%NAME%}`, then `{$NAME}`, in `word` from `env`, as CoreDNS does. An unset
/// variable is replaced by nothing, as in CoreDNS, and noted in `warnings`: the word that is left
/// may still mean something (`prometheus {$HOST_IP}:9253` listens on every address). A value is
/// not searched again by the pass that put it there (CoreDNS would loop on `A={$A}`).
fn substitute_env(
    word: &mut Word,
    env: &HashMap<String, String>,
    file: &str,
    warnings: &mut Vec<String>,
) {
    for (open, close) in [("{%", "%}"), ("{$", "}")] {
        let mut out = String::new();
        let mut rest = word.text.as_str();
        while let Some(at) = rest.find(open) {
            let after = &rest[at + open.len()..];
            let Some(end) = after.find(close) else { break };
            let name = &after[..end];
            if name.is_empty() {
                break;
            }
            out.push_str(&rest[..at]);
            match env.get(name) {
                Some(value) => out.push_str(value),
                None => warnings.push(format!(
                    "{file}:{}: environment variable {name} (in {:?}) is not set: replaced by \
                     nothing, as CoreDNS does",
                    word.line, word.text
                )),
            }
            rest = &after[end + close.len()..];
        }
        out.push_str(rest);
        word.text = out;
    }
}

/// The words of one file, environment placeholders replaced.
pub(crate) fn words(
    file: &str,
    text: &str,
    env: &HashMap<String, String>,
    warnings: &mut Vec<String>,
) -> Result<Vec<Word>, Problem> {
    let (mut words, unterminated) = lex(text);
    if let Some(line) = unterminated {
        return Err(Problem::at(
            file,
            line,
            "unterminated quoted string".to_owned(),
        ));
    }
    for w in &mut words {
        substitute_env(w, env, file, warnings);
    }
    // CoreDNS drops a key that is empty after substitution; a directive's empty argument stays.
    Ok(words)
}

/// A parsed Corefile: its server blocks, where each line comes from, and what only deserves a
/// warning.
#[derive(Debug)]
pub(crate) struct Corefile {
    pub blocks: Vec<Block>,
    /// Real `file:line` of every word's line ([`Lines::relocate`] for messages made later).
    pub lines: Lines,
    pub warnings: Vec<String>,
}

/// Parses a whole Corefile into server blocks, imports spliced in (relative paths from `dir`,
/// files read through `files`). Syntax errors stop the parse: what follows an unbalanced brace
/// has no reliable meaning.
pub(crate) fn parse(
    file: &str,
    text: &str,
    env: &HashMap<String, String>,
    dir: &Path,
    files: &mut dyn Files,
) -> Result<Corefile, Vec<Problem>> {
    let mut warnings = Vec::new();
    let mut lines = Lines::new(file);
    let words = words(file, text, env, &mut warnings).map_err(|p| vec![p])?;
    let words =
        import::expand(words, dir, files, env, &mut lines, &mut warnings).map_err(|p| vec![p])?;
    let mut p = Parser {
        words,
        pos: 0,
        lines: &lines,
        warnings: &mut warnings,
    };
    let blocks = p.blocks().map_err(|p| vec![p])?;
    Ok(Corefile {
        blocks: split_ports(blocks),
        lines,
        warnings,
    })
}

/// A key's zone and port text, as CoreDNS splits them (`plugin.SplitHostPort`): the port is what
/// follows the last `:` when that is a number; otherwise the whole key is the zone. A scheme
/// (`dns://`) stays on the zone.
pub(crate) fn split_port(key: &str) -> (&str, Option<&str>) {
    match key.rsplit_once(':') {
        Some((zone, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            (zone, Some(port))
        }
        _ => (key, None),
    }
}

/// Each block whose keys name more than one port, as one block per port (in the order the ports
/// first appear), each with the block's directives. A key without a port is on the port of the
/// first key without one.
fn split_ports(blocks: Vec<Block>) -> Vec<Block> {
    let mut out = Vec::with_capacity(blocks.len());
    for block in blocks {
        let mut ports: Vec<Option<&str>> = Vec::new();
        for k in &block.keys {
            let port = split_port(&k.text).1;
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        if ports.len() < 2 {
            out.push(block);
            continue;
        }
        for port in ports {
            out.push(Block {
                keys: block
                    .keys
                    .iter()
                    .filter(|k| split_port(&k.text).1 == port)
                    .cloned()
                    .collect(),
                line: block.line,
                directives: block.directives.clone(),
            });
        }
    }
    out
}

struct Parser<'a> {
    words: Vec<Word>,
    pos: usize,
    lines: &'a Lines,
    warnings: &'a mut Vec<String>,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Word> {
        self.words.get(self.pos)
    }

    fn err(&self, line: usize, message: String) -> Problem {
        self.lines.problem(line, message)
    }

    fn blocks(&mut self) -> Result<Vec<Block>, Problem> {
        let mut blocks = Vec::new();
        while self.peek().is_some() {
            blocks.push(self.block()?);
        }
        Ok(blocks)
    }

    fn block(&mut self) -> Result<Block, Problem> {
        let first = self.peek().cloned().expect("caller checked");
        if is_open(&first) || is_close(&first) {
            return Err(self.err(
                first.line,
                format!(
                    "expected a server block's zone (such as `.:53`), found `{}`",
                    first.text
                ),
            ));
        }
        // Keys: the rest of this line; a trailing comma continues on the next line.
        let mut keys = Vec::new();
        let mut line = first.line;
        let mut expect_more = false;
        while let Some(w) = self.peek().cloned() {
            if is_open(&w) {
                if expect_more {
                    return Err(self.err(w.line, "expected another zone after `,`".to_owned()));
                }
                break;
            }
            if w.line != line && !expect_more {
                break;
            }
            if is_close(&w) {
                return Err(self.err(w.line, "unexpected `}` in the list of zones".to_owned()));
            }
            self.pos += 1;
            line = w.line;
            if !w.quoted && w.text.len() > 1 && w.text.ends_with('{') {
                // CoreDNS reads `zone:1053{` as one key (a zone named with the brace, on the
                // default port) and the block as open until the next `}`.
                let (file, at) = self.lines.locate(w.line);
                self.warnings.push(format!(
                    "{file}:{at}: `{}` is one key, as CoreDNS reads it: a zone named `{}.` on \
                     the block's default port, not `{} {{`; write a space before `{{`",
                    w.text,
                    w.text,
                    &w.text[..w.text.len() - 1]
                ));
            }
            for part in w.text.split(',') {
                if !part.is_empty() {
                    keys.push(Word {
                        text: part.to_owned(),
                        line: w.line,
                        quoted: w.quoted,
                    });
                }
            }
            expect_more = w.text.ends_with(',');
        }
        if expect_more {
            return Err(self.err(
                line,
                "the file ends after `,`: expected another zone".to_owned(),
            ));
        }
        let braced = self.peek().is_some_and(is_open);
        if braced {
            self.pos += 1;
        }
        let directives = self.lines(braced, first.line)?;
        Ok(Block {
            keys,
            line: first.line,
            directives,
        })
    }

    /// Lines up to the `}` that closes the block opened at `opened` (consumed), or to the end of
    /// the file when `braced` is false.
    fn lines(&mut self, braced: bool, opened: usize) -> Result<Vec<Directive>, Problem> {
        let mut out = Vec::new();
        loop {
            let Some(w) = self.peek().cloned() else {
                if braced {
                    let (_, at) = self.lines.locate(opened);
                    return Err(self.err(
                        opened,
                        format!("the `{{` opened at line {at} is never closed"),
                    ));
                }
                return Ok(out);
            };
            // A server block without `{` runs to the end of the file or to a `}`, which closes
            // it (CoreDNS).
            if is_close(&w) {
                self.pos += 1;
                return Ok(out);
            }
            if is_open(&w) {
                return Err(self.err(w.line, "unexpected `{`: expected a directive".to_owned()));
            }
            self.pos += 1;
            let mut d = Directive {
                name: w.text.clone(),
                line: w.line,
                args: Vec::new(),
                block: Vec::new(),
                has_block: false,
            };
            // Arguments: the rest of the line, up to a brace.
            while let Some(a) = self.peek() {
                if a.line != d.line || is_close(a) {
                    break;
                }
                if is_open(a) {
                    let opened = a.line;
                    self.pos += 1;
                    d.has_block = true;
                    d.block = self.lines(true, opened)?;
                    break;
                }
                d.args.push(a.clone());
                self.pos += 1;
            }
            out.push(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> HashMap<String, String> {
        HashMap::from([("UPSTREAM".to_owned(), "10.0.0.10".to_owned())])
    }

    fn parsed(text: &str) -> Result<Corefile, Vec<Problem>> {
        let none = import::Imports::default();
        parse("Corefile", text, &env(), Path::new(""), &mut &none)
    }

    fn parse_ok(text: &str) -> Vec<Block> {
        parsed(text).unwrap_or_else(|p| panic!("{p:?}")).blocks
    }

    fn parse_err(text: &str) -> Vec<String> {
        parsed(text)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn texts(words: &[Word]) -> Vec<&str> {
        words.iter().map(|w| w.text.as_str()).collect()
    }

    #[test]
    fn blocks_directives_and_nested_blocks_keep_their_lines() {
        let blocks = parse_ok(
            "cluster.local:53 {\n    errors\n    cache {\n        success 9984 30\n    }\n}\n\
             .:53 {\n    forward . 1.1.1.1\n}\n",
        );
        assert_eq!(blocks.len(), 2);
        assert_eq!(texts(&blocks[0].keys), ["cluster.local:53"]);
        assert_eq!(blocks[0].directives[0].name, "errors");
        assert_eq!(blocks[0].directives[0].line, 2);
        let cache = &blocks[0].directives[1];
        assert!(cache.has_block);
        assert_eq!(cache.block[0].name, "success");
        assert_eq!(cache.block[0].line, 4);
        assert_eq!(texts(&cache.block[0].args), ["9984", "30"]);
        assert_eq!(blocks[1].line, 7);
        assert_eq!(texts(&blocks[1].directives[0].args), [".", "1.1.1.1"]);
    }

    #[test]
    fn comments_run_to_end_of_line_even_inside_a_word() {
        let blocks = parse_ok("# header\n. { # open\n  log#comment\n  errors # trailing\n}\n");
        let names: Vec<_> = blocks[0]
            .directives
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names, ["log", "errors"]);
        assert_eq!(blocks[0].directives[1].line, 4);
    }

    #[test]
    fn quotes_keep_spaces_hashes_and_escaped_quotes() {
        let blocks = parse_ok(". {\n  log \"a # b \\\"c\\\"\" x\n}\n");
        assert_eq!(texts(&blocks[0].directives[0].args), ["a # b \"c\"", "x"]);
        assert!(blocks[0].directives[0].args[0].quoted);
    }

    #[test]
    fn a_quoted_word_spanning_lines_advances_the_line_count() {
        let blocks = parse_ok(". {\n  log \"a\nb\"\n  errors\n}\n");
        assert_eq!(blocks[0].directives[1].line, 4);
    }

    #[test]
    fn several_zones_per_block_with_commas_and_continuation_lines() {
        let blocks = parse_ok("a.example b.example,\n  c.example:1053, d.example {\n  errors\n}\n");
        assert_eq!(
            texts(&blocks[0].keys),
            ["a.example", "b.example", "d.example"]
        );
        assert_eq!(texts(&blocks[1].keys), ["c.example:1053"]);
    }

    #[test]
    fn a_single_block_file_needs_no_braces() {
        let blocks = parse_ok(".:1053\nforward . 1.1.1.1\nerrors\n");
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].directives.len(), 2);
    }

    #[test]
    fn environment_variables_are_substituted_in_words() {
        let blocks = parse_ok(". {\n  forward . {$UPSTREAM}:53 {%UPSTREAM%}\n}\n");
        assert_eq!(
            texts(&blocks[0].directives[0].args),
            [".", "10.0.0.10:53", "10.0.0.10"]
        );
    }

    #[test]
    fn an_unset_environment_variable_is_replaced_by_nothing_with_a_warning() {
        let c = parsed(". {\n  errors\n  prometheus {$NOPE}:9253 {%ALSO_NOPE%}x\n}\n").unwrap();
        assert_eq!(texts(&c.blocks[0].directives[1].args), [":9253", "x"]);
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(
            c.warnings[0].starts_with("Corefile:3: environment variable NOPE"),
            "{:?}",
            c.warnings
        );
        assert!(c.warnings[1].contains("ALSO_NOPE"), "{:?}", c.warnings);
    }

    #[test]
    fn windows_placeholders_are_replaced_before_unix_ones() {
        let env = HashMap::from([
            ("A".to_owned(), "{$B}".to_owned()),
            ("B".to_owned(), "b".to_owned()),
        ]);
        let none = import::Imports::default();
        let c = parse(
            "Corefile",
            ". {\n  log {%A%} {$B}\n}\n",
            &env,
            Path::new(""),
            &mut &none,
        )
        .unwrap();
        // `{%A%}` gives `{$B}`, which the `{$` pass then replaces, as in CoreDNS.
        assert_eq!(texts(&c.blocks[0].directives[0].args), ["b", "b"]);
    }

    #[test]
    fn an_empty_key_after_substitution_is_dropped() {
        let blocks = parse_ok("{$NOPE} example.org {\n}\n");
        assert_eq!(texts(&blocks[0].keys), ["example.org"]);
    }

    #[test]
    fn keys_on_different_ports_are_one_block_per_port() {
        let blocks = parse_ok("example.com example.io:1053 example.net {\n  cache 5\n}\n");
        assert_eq!(blocks.len(), 2);
        assert_eq!(texts(&blocks[0].keys), ["example.com", "example.net"]);
        assert_eq!(texts(&blocks[1].keys), ["example.io:1053"]);
        assert_eq!(blocks[0].directives, blocks[1].directives);
        assert_eq!(blocks[1].line, 1);
    }

    #[test]
    fn a_port_is_only_a_number_after_the_last_colon() {
        assert_eq!(split_port("example.io:1053"), ("example.io", Some("1053")));
        assert_eq!(split_port("example.io:1053{"), ("example.io:1053{", None));
        assert_eq!(split_port("fd00::/8"), ("fd00::/8", None));
        assert_eq!(split_port("fd00::/8:53"), ("fd00::/8", Some("53")));
        assert_eq!(split_port("dns://.:53"), ("dns://.", Some("53")));
        assert_eq!(split_port("example.io:"), ("example.io:", None));
    }

    #[test]
    fn a_key_glued_to_its_brace_opens_a_block_the_next_brace_closes() {
        let c = parsed("example.com example.io:1053{\n  errors\n}\n.:53 {\n  log\n}\n").unwrap();
        assert_eq!(c.blocks.len(), 2);
        assert_eq!(
            texts(&c.blocks[0].keys),
            ["example.com", "example.io:1053{"]
        );
        assert_eq!(c.blocks[0].directives[0].name, "errors");
        assert_eq!(c.blocks[1].directives[0].name, "log");
        assert!(
            c.warnings[0].starts_with("Corefile:1: `example.io:1053{` is one key"),
            "{:?}",
            c.warnings
        );
    }

    #[test]
    fn an_unclosed_block_names_the_line_that_opened_it() {
        let errs = parse_err(". {\n  cache {\n    success 1\n}\n");
        assert_eq!(
            errs,
            ["Corefile:1: the `{` opened at line 1 is never closed"]
        );
        let errs = parse_err(". {\n  errors\n  cache {\n    success 1\n");
        assert_eq!(
            errs,
            ["Corefile:3: the `{` opened at line 3 is never closed"]
        );
    }

    #[test]
    fn a_stray_closing_brace_is_an_error_with_its_line() {
        let errs = parse_err(". {\n  errors\n}\n}\n");
        assert_eq!(errs.len(), 1);
        assert!(errs[0].starts_with("Corefile:4:"), "{errs:?}");
    }

    #[test]
    fn a_block_without_braces_ends_at_a_closing_brace() {
        let blocks = parse_ok(".:1053\nerrors\n}\nexample.org {\n  log\n}\n");
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].directives.len(), 1);
    }

    #[test]
    fn a_stray_opening_brace_is_an_error_with_its_line() {
        let errs = parse_err(". {\n  errors\n  {\n  }\n}\n");
        assert!(
            errs[0].starts_with("Corefile:3: unexpected `{`"),
            "{errs:?}"
        );
    }

    #[test]
    fn an_unterminated_quote_is_an_error_with_its_line() {
        let errs = parse_err(". {\n  log \"oops\n}\n");
        assert_eq!(errs, ["Corefile:2: unterminated quoted string"]);
    }

    #[test]
    fn a_dangling_comma_is_an_error() {
        let errs = parse_err("a.example,");
        assert!(errs[0].contains("after `,`"), "{errs:?}");
        let errs = parse_err("a.example, {\n}\n");
        assert!(errs[0].contains("expected another zone"), "{errs:?}");
    }

    #[test]
    fn an_empty_file_has_no_blocks() {
        assert!(parse_ok("# nothing here\n\n").is_empty());
    }
}
