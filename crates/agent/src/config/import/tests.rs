use std::collections::HashMap;
use std::path::Path;

use super::*;
use crate::config::corefile::{self, Block};

/// An `Imports` record of files under `/etc/coredns`, with directory listings made from them.
fn disk(files: &[(&str, &str)]) -> Imports {
    let mut imports = Imports::default();
    for (path, text) in files {
        let path = Path::new(path);
        imports
            .files
            .insert(path.to_path_buf(), Found::Text((*text).to_owned()));
        let mut dir = path;
        while let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
            let names = imports
                .dirs
                .entry(parent.to_path_buf())
                .or_insert_with(|| Some(Vec::new()))
                .as_mut()
                .unwrap();
            let name = name.to_string_lossy().into_owned();
            if !names.contains(&name) {
                names.push(name);
                names.sort();
            }
            dir = parent;
        }
    }
    imports
}

fn parse(text: &str, imports: &Imports) -> Result<corefile::Corefile, Vec<String>> {
    let env = HashMap::from([("ZONE".to_owned(), "example.org".to_owned())]);
    corefile::parse(
        "/etc/coredns/Corefile",
        text,
        &env,
        Path::new("/etc/coredns"),
        &mut &*imports,
    )
    .map_err(|p| p.iter().map(ToString::to_string).collect())
}

fn names(block: &Block) -> Vec<&str> {
    block.directives.iter().map(|d| d.name.as_str()).collect()
}

fn keys(block: &Block) -> Vec<&str> {
    block.keys.iter().map(|k| k.text.as_str()).collect()
}

fn err(text: &str, imports: &Imports) -> String {
    let errs = parse(text, imports).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:?}");
    errs[0].clone()
}

#[test]
fn a_snippet_is_spliced_where_it_is_imported_and_is_no_server_block() {
    let c = parse(
        "(common) {\n  errors\n  cache 30\n}\n.:53 {\n  import common\n  forward . 10.0.0.2\n}\n",
        &Imports::default(),
    )
    .unwrap();
    assert_eq!(c.blocks.len(), 1);
    assert_eq!(names(&c.blocks[0]), ["errors", "cache", "forward"]);
    assert_eq!(c.blocks[0].directives[1].args[0].text, "30");
}

#[test]
fn importing_a_one_line_snippet_twice_gives_two_directives() {
    let c = parse(
        "(e) {\n  errors\n}\n. {\n  import e\n  import e\n}\n",
        &Imports::default(),
    )
    .unwrap();
    assert_eq!(names(&c.blocks[0]), ["errors", "errors"]);
}

#[test]
fn a_file_may_hold_a_whole_server_block_and_directives() {
    let imports = disk(&[
        (
            "/etc/coredns/generated/extra.server",
            "global:53 {\n  errors\n  cache 30\n}\n",
        ),
        ("/etc/coredns/custom/a.override", "debug\n"),
        ("/etc/coredns/custom/b.override", "log\n"),
    ]);
    let c = parse(
        ". {\n  import custom/*.override\n  errors\n}\nimport generated/extra.server\n",
        &imports,
    )
    .unwrap();
    assert_eq!(c.blocks.len(), 2);
    // Glob matches in name order, spliced in place.
    assert_eq!(names(&c.blocks[0]), ["debug", "log", "errors"]);
    assert_eq!(keys(&c.blocks[1]), ["global:53"]);
    assert_eq!(names(&c.blocks[1]), ["errors", "cache"]);
}

#[test]
fn a_glob_matching_nothing_is_a_warning_a_missing_path_an_error() {
    let none = Imports::default();
    let c = parse(". {\n  import custom/*.override\n}\n", &none).unwrap();
    assert!(names(&c.blocks[0]).is_empty());
    assert_eq!(c.warnings.len(), 1);
    assert!(
        c.warnings[0].starts_with("/etc/coredns/Corefile:2: import `custom/*.override`"),
        "{:?}",
        c.warnings
    );
    let e = err(". {\n  import custom/extra.conf\n}\n", &none);
    assert!(
        e.starts_with("/etc/coredns/Corefile:2: import `custom/extra.conf`: /etc/coredns/custom/extra.conf does not exist"),
        "{e}"
    );
}

#[test]
fn an_absolute_path_is_read_as_written_and_placeholders_apply() {
    let imports = disk(&[("/srv/example.org.conf", "example.org {\n  errors\n}\n")]);
    let c = parse("import /srv/{$ZONE}.conf\n", &imports).unwrap();
    assert_eq!(keys(&c.blocks[0]), ["example.org"]);
}

#[test]
fn imports_nest_relative_to_the_importing_file() {
    let imports = disk(&[
        ("/etc/coredns/a/one.conf", "import two.conf\n"),
        ("/etc/coredns/a/two.conf", "errors\n"),
    ]);
    let c = parse(". {\n  import a/one.conf\n}\n", &imports).unwrap();
    assert_eq!(names(&c.blocks[0]), ["errors"]);
}

#[test]
fn an_import_inside_a_directive_block_splices_its_lines() {
    let c = parse(
        "(ttls) {\n  success 9984 30\n  denial 9984 5\n}\n. {\n  cache {\n    import ttls\n  }\n}\n",
        &Imports::default(),
    )
    .unwrap();
    let cache = &c.blocks[0].directives[0];
    let lines: Vec<&str> = cache.block.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(lines, ["success", "denial"]);
}

#[test]
fn a_cycle_is_an_error_naming_the_chain() {
    let imports = disk(&[
        ("/etc/coredns/a.conf", "import b.conf\n"),
        ("/etc/coredns/b.conf", "import a.conf\n"),
    ]);
    let e = err(". {\n  import a.conf\n}\n", &imports);
    assert_eq!(
        e,
        "/etc/coredns/b.conf:1: import cycle: /etc/coredns/a.conf → /etc/coredns/b.conf → \
         /etc/coredns/a.conf"
    );
    let e = err(
        "(s) {\n  import s\n}\n. {\n  import s\n}\n",
        &Imports::default(),
    );
    assert!(e.contains("import cycle: (s) → (s)"), "{e}");
}

#[test]
fn nesting_is_bounded() {
    let files: Vec<(String, String)> = (0..=MAX_DEPTH)
        .map(|i| {
            (
                format!("/etc/coredns/{i}.conf"),
                format!("import {}.conf\n", i + 1),
            )
        })
        .collect();
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, t)| (p.as_str(), t.as_str()))
        .collect();
    let e = err(". {\n  import 0.conf\n}\n", &disk(&refs));
    assert!(e.contains("nested more than 10 deep"), "{e}");
}

#[test]
fn the_number_of_imports_is_bounded() {
    let mut text = String::from("(e) {\n}\n. {\n");
    for _ in 0..=MAX_IMPORTS {
        text.push_str("  import e\n");
    }
    text.push_str("}\n");
    let e = err(&text, &Imports::default());
    assert!(e.contains("more than 1000 imports"), "{e}");
}

#[test]
fn syntax_errors_in_an_imported_file_name_its_file_and_line() {
    let imports = disk(&[("/etc/coredns/x.conf", "errors\ncache {\n  success 1\n")]);
    let e = err(". {\n  import x.conf\n}\n", &imports);
    // The `{` of `cache` swallows the block's `}`, so the block never closes.
    assert!(e.starts_with("/etc/coredns/"), "{e}");
    let imports = disk(&[("/etc/coredns/x.conf", "errors\n  log \"open\n")]);
    let e = err(". {\n  import x.conf\n}\n", &imports);
    assert_eq!(e, "/etc/coredns/x.conf:2: unterminated quoted string");
    let imports = disk(&[("/etc/coredns/x.conf", "\n\n{\n")]);
    let e = err("import x.conf\n", &imports);
    assert!(
        e.starts_with("/etc/coredns/x.conf:3: expected a server block's zone"),
        "{e}"
    );
}

#[test]
fn import_takes_exactly_one_argument() {
    let none = Imports::default();
    assert!(err(". {\n  import\n}\n", &none).contains("expected `import PATTERN`"));
    assert!(err(". {\n  import a b\n}\n", &none).contains("takes one argument"));
}

#[test]
fn globs_with_several_wildcards_are_refused_as_in_coredns() {
    let none = Imports::default();
    assert!(err(". {\n  import */*.conf\n}\n", &none).contains("one `*`"));
    assert!(err(". {\n  import [ab].conf\n}\n", &none).contains("one `*`"));
}

#[test]
fn a_directory_matched_by_a_glob_is_an_error() {
    let mut imports = disk(&[("/etc/coredns/c/sub/x", "")]);
    imports
        .files
        .insert("/etc/coredns/c/sub".into(), Found::Directory);
    let e = err(". {\n  import c/*\n}\n", &imports);
    assert!(e.contains("/etc/coredns/c/sub: it is a directory"), "{e}");
}

#[test]
fn a_snippet_defined_twice_is_an_error() {
    let e = err("(a) {\n}\n(a) {\n}\n", &Imports::default());
    assert_eq!(e, "/etc/coredns/Corefile:3: snippet `a` is defined twice");
}

#[test]
fn glob_patterns_match_one_component() {
    assert!(matches(b"*.override", b"x.override"));
    assert!(matches(b"*.override", b".override"));
    assert!(!matches(b"*.override", b"x.override.bak"));
    assert!(matches(b"a?c", b"abc"));
    assert!(!matches(b"a?c", b"ac"));
    assert!(matches(b"a\\*", b"a*"));
    assert!(!matches(b"a\\*", b"ab"));
}

#[test]
fn relocate_puts_spliced_lines_back_in_their_files() {
    let mut lines = Lines::new("Corefile");
    let k = lines.add("custom/a.override".to_owned());
    let v = k * STRIDE + 7;
    assert_eq!(
        lines.relocate(&format!(
            "Corefile:{v}: `cache` is already given at line {v}"
        )),
        "custom/a.override:7: `cache` is already given at custom/a.override:7"
    );
    assert_eq!(
        lines.relocate("Corefile:3: given at line 2"),
        "Corefile:3: given at line 2"
    );
    // Digits in the path before the line number.
    let mut lines = Lines::new("/tmp/run-42/Corefile");
    let k = lines.add("/tmp/run-42/a.conf".to_owned());
    let v = k * STRIDE + 3;
    assert_eq!(
        lines.relocate(&format!("/tmp/run-42/Corefile:{v}: x, see line {v}")),
        "/tmp/run-42/a.conf:3: x, see /tmp/run-42/a.conf:3"
    );
}

#[test]
fn the_disk_records_what_it_read() {
    let dir = crate::config::tests::TempDir::new("import");
    std::fs::create_dir_all(dir.path().join("custom")).unwrap();
    std::fs::write(dir.path().join("custom/a.override"), "log\n").unwrap();
    let mut record = Imports::default();
    let main = dir.path().join("Corefile");
    let c = corefile::parse(
        &main.display().to_string(),
        ". {\n  import custom/*.override\n}\n",
        &HashMap::new(),
        dir.path(),
        &mut Disk {
            record: &mut record,
        },
    )
    .unwrap();
    assert_eq!(names(&c.blocks[0]), ["log"]);
    let again = corefile::parse(
        &main.display().to_string(),
        ". {\n  import custom/*.override\n}\n",
        &HashMap::new(),
        dir.path(),
        &mut &record,
    )
    .unwrap();
    assert_eq!(again.blocks, c.blocks);
    assert_eq!(
        record.paths().collect::<Vec<_>>(),
        [dir.path().join("custom/a.override")]
    );
}
