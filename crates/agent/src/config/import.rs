//! `import`: snippets and files spliced into a Corefile's words, as CoreDNS's parser (Caddy v1)
//! splices them.
//!
//! - `(name) { ... }` at the top level defines a snippet: its words are kept, not parsed, and the
//!   block is not a server block.
//! - `import PATTERN` as the first word of a line (where a server block's keys, a directive or a
//!   line of a directive's block may stand) is replaced by the words of the snippet PATTERN, or
//!   of the files PATTERN names: a path or a glob with at most one `*` and one `?`, relative to
//!   the directory of the file the `import` is written in. A glob matching nothing is fine; a
//!   plain path that does not exist is an error, as in CoreDNS. The spliced words are read again,
//!   so an imported file may hold directives, whole server blocks, snippets or more imports.
//! - Cycles are an error naming the chain; nesting and the number of imports are bounded.
//!
//! Files are read through [`Files`], so a load stays a pure function of its inputs: the agent
//! reads the disk once ([`Disk`], which records what it read in [`Imports`]) and the load itself
//! reads that record.
//!
//! Words keep a line number that names their file too ([`Lines`]): the main file's words keep
//! their own line; the words of the k-th splice get `k * STRIDE + line`. Lines stay distinct
//! across splices (two imports of one single-line file are two lines, not one), and every
//! problem is put back at its real `file:line` ([`Lines::relocate`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

use super::Problem;
use super::corefile::{self, Word};

/// Lines per file in the numbering of [`Lines`]; a longer file cannot be imported.
pub(crate) const STRIDE: usize = 1 << 20;
/// Most imports expanded in one load (CoreDNS caps snippets at 10,000 and files at 100,000: a
/// node-local configuration needs a handful).
const MAX_IMPORTS: usize = 1000;
/// Deepest nesting of imports (an import in an imported file is one level deeper).
const MAX_DEPTH: usize = 10;

/// What a path held when the configuration was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    Directory,
    Text(String),
    /// Any other error, as the OS gave it.
    Unreadable(String),
}

/// The files and directory listings the Corefile's imports named, as read: [`super::Inputs`]
/// carries them so that a load reads nothing itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Imports {
    pub files: BTreeMap<PathBuf, Found>,
    /// Names in each directory a glob looked into; `None` when it is not a readable directory.
    pub dirs: BTreeMap<PathBuf, Option<Vec<String>>>,
}

impl Imports {
    /// Every file an import named (found or not), for the watcher.
    pub(crate) fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.keys().map(PathBuf::as_path)
    }
}

/// Where imported files come from.
pub(crate) trait Files {
    fn read(&mut self, path: &Path) -> Found;
    /// The names in `dir`, sorted; `None` when it is not a readable directory.
    fn list(&mut self, dir: &Path) -> Option<Vec<String>>;
}

/// The record of an earlier read: what it did not read is missing.
impl Files for &Imports {
    fn read(&mut self, path: &Path) -> Found {
        self.files.get(path).cloned().unwrap_or(Found::Missing)
    }

    fn list(&mut self, dir: &Path) -> Option<Vec<String>> {
        self.dirs.get(dir).cloned().flatten()
    }
}

/// The filesystem, with every answer recorded in `record`.
pub(crate) struct Disk<'a> {
    pub record: &'a mut Imports,
}

impl Files for Disk<'_> {
    fn read(&mut self, path: &Path) -> Found {
        let found = match std::fs::read_to_string(path) {
            Ok(text) => Found::Text(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Found::Missing,
            Err(_) if path.is_dir() => Found::Directory,
            Err(e) => Found::Unreadable(e.to_string()),
        };
        self.record.files.insert(path.to_path_buf(), found.clone());
        found
    }

    fn list(&mut self, dir: &Path) -> Option<Vec<String>> {
        let names = std::fs::read_dir(dir).ok().map(|entries| {
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        });
        self.record.dirs.insert(dir.to_path_buf(), names.clone());
        names
    }
}

/// The file each splice's words come from: index 0 is the Corefile itself.
#[derive(Debug, Clone)]
pub(crate) struct Lines {
    files: Vec<String>,
}

impl Lines {
    pub fn new(main: &str) -> Lines {
        Lines {
            files: vec![main.to_owned()],
        }
    }

    fn add(&mut self, file: String) -> usize {
        self.files.push(file);
        self.files.len() - 1
    }

    /// The real file and line of a word's line.
    pub fn locate(&self, line: usize) -> (&str, usize) {
        let file = self.files.get(line / STRIDE).unwrap_or(&self.files[0]);
        (file, line % STRIDE)
    }

    pub fn problem(&self, line: usize, message: String) -> Problem {
        let (file, line) = self.locate(line);
        Problem::at(file, line, message)
    }

    /// `text` with each mention of a spliced line put back in its file: `CORE:N` (a location)
    /// and `line N` (a reference inside a message) become `FILE:LINE` when N is a line of an
    /// import. Lines of the Corefile itself are left as they are.
    pub fn relocate(&self, text: &str) -> String {
        if self.files.len() == 1 {
            return text.to_owned();
        }
        let location = format!("{}:", self.files[0]);
        let mut out = String::with_capacity(text.len());
        // `text[copied..]` is still to be copied; digit runs are found from `at`.
        let (mut copied, mut at) = (0, 0);
        while let Some(found) = text[at..].find(|c: char| c.is_ascii_digit()) {
            let start = at + found;
            let end = text[start..]
                .find(|c: char| !c.is_ascii_digit())
                .map_or(text.len(), |e| start + e);
            at = end;
            let before = &text[..start];
            let prefix = [location.as_str(), "line "]
                .into_iter()
                .find(|p| before.ends_with(p));
            let (Some(v), Some(p)) = (text[start..end].parse::<usize>().ok(), prefix) else {
                continue;
            };
            if v < STRIDE || start - p.len() < copied {
                continue;
            }
            let (file, line) = self.locate(v);
            out.push_str(&text[copied..start - p.len()]);
            out.push_str(&format!("{file}:{line}"));
            copied = end;
        }
        out.push_str(&text[copied..]);
        out
    }
}

/// A snippet: its words, the directory its relative imports start from, its file's index.
#[derive(Debug, Clone)]
struct Snippet {
    words: Vec<Word>,
    dir: PathBuf,
}

/// Splices every import into `words` (the Corefile's, already lexed, in directory `dir`).
/// Returns the words to parse; `lines` learns each splice's file, `warnings` what CoreDNS only
/// warns about (a glob that matched nothing, an unset environment variable in an imported file).
pub(crate) fn expand(
    words: Vec<Word>,
    dir: &Path,
    files: &mut dyn Files,
    env: &HashMap<String, String>,
    lines: &mut Lines,
    warnings: &mut Vec<String>,
) -> Result<Vec<Word>, Problem> {
    let mut e = Expander {
        files,
        env,
        lines,
        warnings,
        snippets: HashMap::new(),
        out: Vec::new(),
        depth: 0,
        prev_line: None,
        imports: 0,
        chain: Vec::new(),
    };
    e.run(words, dir)?;
    Ok(e.out)
}

struct Expander<'a> {
    files: &'a mut dyn Files,
    env: &'a HashMap<String, String>,
    lines: &'a mut Lines,
    warnings: &'a mut Vec<String>,
    snippets: HashMap<String, Snippet>,
    out: Vec<Word>,
    /// Braces open in `out`: 0 where server blocks (and snippets) start.
    depth: usize,
    /// Line of the last word taken: a word on another line starts one.
    prev_line: Option<usize>,
    imports: usize,
    /// What is being spliced, outermost first: files by path, snippets as `(name)`.
    chain: Vec<String>,
}

fn is_open(w: &Word) -> bool {
    !w.quoted && w.text == "{"
}

fn is_close(w: &Word) -> bool {
    !w.quoted && w.text == "}"
}

impl Expander<'_> {
    fn run(&mut self, words: Vec<Word>, dir: &Path) -> Result<(), Problem> {
        let mut i = 0;
        while i < words.len() {
            let w = &words[i];
            let starts_line = self.prev_line != Some(w.line);
            let same_line = |j: usize| words.get(j).filter(|n| n.line == w.line);
            if self.depth == 0 && starts_line && !w.quoted {
                // CoreDNS: a snippet is a block whose only key is in parentheses.
                let alone = words
                    .get(i + 1)
                    .is_some_and(|n| is_open(n) || n.line != w.line);
                if let Some(name) = snippet_name(&w.text).filter(|_| alone) {
                    i = self.define(name, &words, i, dir)?;
                    continue;
                }
            }
            if w.text == "import" && starts_line {
                let Some(pattern) = same_line(i + 1) else {
                    return Err(self
                        .lines
                        .problem(w.line, "import: expected `import PATTERN`".to_owned()));
                };
                if same_line(i + 2).is_some() {
                    return Err(self.lines.problem(
                        w.line,
                        "import takes one argument, a snippet's name, a file or a glob".to_owned(),
                    ));
                }
                let pattern = pattern.clone();
                self.prev_line = Some(w.line);
                self.import(&pattern, dir)?;
                i += 2;
                continue;
            }
            if is_open(w) {
                self.depth += 1;
            } else if is_close(w) {
                self.depth = self.depth.saturating_sub(1);
            }
            self.prev_line = Some(w.line);
            self.out.push(w.clone());
            i += 1;
        }
        Ok(())
    }

    /// Keeps the snippet whose key is `words[at]`; returns the index after its closing brace.
    fn define(
        &mut self,
        name: &str,
        words: &[Word],
        at: usize,
        dir: &Path,
    ) -> Result<usize, Problem> {
        let key = &words[at];
        if !words.get(at + 1).is_some_and(is_open) {
            return Err(self.lines.problem(
                key.line,
                format!("snippet `{}`: expected `{{` after it", key.text),
            ));
        }
        let mut depth = 1;
        let mut body = Vec::new();
        let mut j = at + 2;
        while let Some(w) = words.get(j) {
            if is_close(w) {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            } else if is_open(w) {
                depth += 1;
            }
            body.push(w.clone());
            j += 1;
        }
        let Some(close) = words.get(j) else {
            return Err(self.lines.problem(
                key.line,
                format!("snippet `{}`: its `{{` is never closed", key.text),
            ));
        };
        if self.snippets.contains_key(name) {
            return Err(self
                .lines
                .problem(key.line, format!("snippet `{name}` is defined twice")));
        }
        self.snippets.insert(
            name.to_owned(),
            Snippet {
                words: body,
                dir: dir.to_path_buf(),
            },
        );
        self.prev_line = Some(close.line);
        Ok(j + 1)
    }

    fn import(&mut self, pattern: &Word, dir: &Path) -> Result<(), Problem> {
        let err = |lines: &Lines, message: String| lines.problem(pattern.line, message);
        if pattern.text.is_empty() {
            return Err(err(self.lines, "import: the pattern is empty".to_owned()));
        }
        if self.imports >= MAX_IMPORTS {
            return Err(err(
                self.lines,
                format!("import `{}`: more than {MAX_IMPORTS} imports", pattern.text),
            ));
        }
        if self.chain.len() >= MAX_DEPTH {
            return Err(err(
                self.lines,
                format!(
                    "import `{}`: imports nested more than {MAX_DEPTH} deep ({})",
                    pattern.text,
                    self.chain.join(" → ")
                ),
            ));
        }
        self.imports += 1;
        if let Some(snippet) = self.snippets.get(&pattern.text).cloned() {
            let name = format!("({})", pattern.text);
            self.cycle(&name, pattern)?;
            let (file, _) = self
                .lines
                .locate(snippet.words.first().map_or(0, |w| w.line));
            let k = self.lines.add(file.to_owned());
            let words = renumber(snippet.words, k);
            self.chain.push(name);
            self.run(words, &snippet.dir)?;
            self.chain.pop();
            return Ok(());
        }
        let text = pattern.text.as_str();
        let wildcards = text.matches('*').count() > 1
            || text.matches('?').count() > 1
            || (text.contains('[') && text.contains(']'));
        if wildcards {
            return Err(err(
                self.lines,
                format!(
                    "import `{text}`: a glob may hold one `*` and one `?` at most, and no `[...]` \
                     (as in CoreDNS)"
                ),
            ));
        }
        let full = dir.join(text);
        let matches = glob(&full, self.files);
        if matches.is_empty() {
            if text.contains(['*', '?']) {
                let (file, line) = self.lines.locate(pattern.line);
                self.warnings.push(format!(
                    "{file}:{line}: import `{text}`: no file matches {}",
                    full.display()
                ));
            } else {
                return Err(err(
                    self.lines,
                    format!(
                        "import `{text}`: {} does not exist (and is not a snippet defined above)",
                        full.display()
                    ),
                ));
            }
        }
        for path in matches {
            let shown = path.display().to_string();
            let text = match self.files.read(&path) {
                Found::Text(t) => t,
                Found::Directory => {
                    return Err(err(
                        self.lines,
                        format!("import: cannot import {shown}: it is a directory"),
                    ));
                }
                Found::Missing => {
                    return Err(err(self.lines, format!("import: {shown} does not exist")));
                }
                Found::Unreadable(e) => {
                    return Err(err(self.lines, format!("import: cannot read {shown}: {e}")));
                }
            };
            self.cycle(&shown, pattern)?;
            let k = self.lines.add(shown.clone());
            let words = corefile::words(&shown, &text, self.env, self.warnings)?;
            if let Some(w) = words.iter().find(|w| w.line >= STRIDE) {
                return Err(Problem::at(
                    &shown,
                    w.line,
                    format!("has more than {} lines: too long to import", STRIDE - 1),
                ));
            }
            let words = renumber(words, k);
            self.chain.push(shown);
            self.run(words, path.parent().unwrap_or(Path::new("")))?;
            self.chain.pop();
        }
        Ok(())
    }

    fn cycle(&self, what: &str, pattern: &Word) -> Result<(), Problem> {
        if self.chain.iter().any(|c| c == what) {
            let mut chain = self.chain.clone();
            chain.push(what.to_owned());
            return Err(self
                .lines
                .problem(pattern.line, format!("import cycle: {}", chain.join(" → "))));
        }
        Ok(())
    }
}

/// `name` of a `(name)` key.
fn snippet_name(text: &str) -> Option<&str> {
    text.strip_prefix('(')?.strip_suffix(')')
}

/// `words` as the words of splice `k`.
fn renumber(mut words: Vec<Word>, k: usize) -> Vec<Word> {
    for w in &mut words {
        w.line = k * STRIDE + w.line % STRIDE;
    }
    words
}

/// The paths `pattern` matches, sorted within each directory, as Go's `filepath.Glob`: `*` and
/// `?` match within one path component (a leading `.` included), `\` escapes. A pattern without
/// wildcards matches itself if it exists.
fn glob(pattern: &Path, files: &mut dyn Files) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::new()];
    let mut wild = false;
    for component in pattern.components() {
        let part = match component {
            Component::Normal(part) => part.to_string_lossy(),
            other => {
                for f in &mut found {
                    f.push(other.as_os_str());
                }
                continue;
            }
        };
        if !part.contains(['*', '?', '\\']) {
            for f in &mut found {
                f.push(part.as_ref());
            }
            continue;
        }
        wild = true;
        let mut next = Vec::new();
        for dir in &found {
            let listed = if dir.as_os_str().is_empty() {
                files.list(Path::new("."))
            } else {
                files.list(dir)
            };
            for name in listed.unwrap_or_default() {
                if matches(part.as_bytes(), name.as_bytes()) {
                    next.push(dir.join(name));
                }
            }
        }
        found = next;
    }
    if !wild {
        found.retain(|p| files.read(p) != Found::Missing);
    }
    found
}

/// Whether `name` matches the glob `pattern` (`*`, `?`, `\` escapes).
fn matches(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|i| matches(rest, &name[i..])),
        Some((b'?', rest)) => !name.is_empty() && matches(rest, &name[1..]),
        Some((b'\\', rest)) if !rest.is_empty() => {
            name.first() == rest.first() && matches(&rest[1..], &name[1..])
        }
        Some((c, rest)) => name.first() == Some(c) && matches(rest, &name[1..]),
    }
}

#[cfg(test)]
mod tests;
