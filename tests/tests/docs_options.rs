//! The synopses in README.md and daemon/README.md name every long option each binary's
//! `--help` shows (for blkplanectl, every command's, found by walking the `Commands:` lists),
//! and no option that the binary lacks. Each synopsis is the fenced block, under its known
//! heading, whose first line starts with the binary's name. Fast: `--help` runs only.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use blkplane_tests::binaries;

/// Where each binary's synopsis is: the document (from the workspace root) and the heading
/// of the section it is in.
const SYNOPSES: [(&str, &str, &str); 4] = [
    ("blkplaned", "daemon/README.md", "## blkplaned"),
    ("blkplanectl", "daemon/README.md", "## blkplanectl"),
    (
        "blkplane-frontend",
        "README.md",
        "## blkplane-frontend (one per disk)",
    ),
    (
        "blkplane-iothread",
        "README.md",
        "## blkplane-frontend (one per disk)",
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace")
        .to_path_buf()
}

/// The lines of `binary`'s synopsis: the untagged fenced block, in the section under `heading`
/// (which ends at the next heading of its level or above), whose first line starts with the
/// binary's name.
fn synopsis<'a>(doc: &'a str, heading: &str, binary: &str) -> Result<Vec<&'a str>, String> {
    let level = heading.split(' ').next().unwrap_or("##");
    let mut lines = doc.lines().skip_while(|l| l.trim_end() != heading);
    if lines.next().is_none() {
        return Err(format!("no heading {heading:?}"));
    }
    let section: Vec<&str> = lines
        .take_while(|l| {
            let hashes = l.split(' ').next().unwrap_or("");
            !(hashes.starts_with('#') && hashes.chars().all(|c| c == '#') && hashes <= level)
        })
        .collect();
    // Untagged blocks only: the synopses are plain text, the examples ```sh.
    let mut blocks: Vec<Vec<&str>> = Vec::new();
    let mut open: Option<(bool, Vec<&str>)> = None;
    for line in section {
        let fence = line.trim_start().strip_prefix("```");
        match (fence, open.take()) {
            (Some(info), None) => open = Some((info.trim().is_empty(), Vec::new())),
            (Some(_), Some((plain, block))) => {
                if plain {
                    blocks.push(block);
                }
            }
            (None, Some((plain, mut block))) => {
                block.push(line);
                open = Some((plain, block));
            }
            (None, None) => {}
        }
    }
    blocks
        .into_iter()
        .find(|b| {
            b.first().is_some_and(|first| {
                first
                    .strip_prefix(binary)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
            })
        })
        .ok_or_else(|| format!("no fenced block starting with {binary:?} under {heading:?}"))
}

/// Every `--long` option named in `text` (`[--bps-read BYTES]`, `--tls-cert F`, `--x=…`).
fn named_options(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let before = start.checked_sub(1).map(|b| bytes[b]);
        let name: String = text[start + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        let word_start = before.is_none_or(|b| !(b.is_ascii_alphanumeric() || b == b'-'));
        if word_start && name.starts_with(|c: char| c.is_ascii_lowercase()) {
            found.insert(format!("--{}", name.trim_end_matches('-')));
        }
        i = start + 2 + name.len();
    }
    found
}

/// `binary ARGS --help`.
fn help(binary: &Path, args: &[String]) -> String {
    let out = Command::new(binary)
        .args(args)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "{} {args:?} --help: {out:?}",
        binary.display()
    );
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The long options of a `--help` text: clap's option lines, `  -x, --name …` or
/// `      --name …` (descriptions, indented further, are not read).
fn help_options(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("  ")?;
            let rest = match rest.as_bytes() {
                [b'-', short, b',', b' ', ..] if *short != b'-' => &rest[4..],
                _ => rest.strip_prefix("    ")?,
            };
            let name = rest.strip_prefix("--")?;
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(name.len());
            Some(format!("--{}", &name[..end]))
        })
        .collect()
}

/// The commands of a `--help` text's `Commands:` list, but `help`.
fn commands(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.strip_prefix("  ")?.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The long options of `binary ARGS` and of all its commands, below it.
fn all_options(binary: &Path, args: &[String]) -> BTreeSet<String> {
    let text = help(binary, args);
    let mut options = help_options(&text);
    for command in commands(&text) {
        let mut sub = args.to_vec();
        sub.push(command);
        options.extend(all_options(binary, &sub));
    }
    options
}

#[test]
fn synopses_name_every_option() {
    let bins = binaries();
    let mut problems = Vec::new();
    for (name, doc, heading) in SYNOPSES {
        let binary = match name {
            "blkplaned" => &bins.blkplaned,
            "blkplanectl" => &bins.blkplanectl,
            "blkplane-frontend" => &bins.frontend,
            _ => &bins.iothread,
        };
        let text = std::fs::read_to_string(workspace().join(doc))
            .unwrap_or_else(|e| panic!("reading {doc}: {e}"));
        let documented = match synopsis(&text, heading, name) {
            Ok(block) => named_options(&block.join("\n")),
            Err(e) => {
                problems.push(format!("{doc}: {e}"));
                continue;
            }
        };
        let actual = all_options(binary, &[]);
        let missing: Vec<_> = actual.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&actual).collect();
        if !missing.is_empty() {
            problems.push(format!("{doc}, {name} synopsis lacks {missing:?}"));
        }
        if !extra.is_empty() {
            problems.push(format!(
                "{doc}, {name} synopsis names {extra:?}, which {name} lacks"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_parsers_read_what_they_should() {
    let doc = "# t\n## a\n```sh\na --not-this\n```\n```\na [--x N] [--bps-read…]\n  b --y=1 -o|--out-put x--z\n```\n## b\n```\na --later\n```\n";
    let block = synopsis(doc, "## a", "a").unwrap();
    let want: BTreeSet<String> = ["--x", "--bps-read", "--y", "--out-put"]
        .map(String::from)
        .into();
    assert_eq!(named_options(&block.join("\n")), want);
    assert!(synopsis(doc, "## c", "a").is_err());
    assert!(synopsis(doc, "## a", "ab").is_err());
    let help = "Usage: x [OPTIONS] <COMMAND>\n\nCommands:\n  disk  Manage\n  help  Print\n\n\
                Options:\n      --socket <PATH>\n          says --not-an-option\n  -o, --output <F>\n  \
                -h, --help\n";
    let want: BTreeSet<String> = ["--socket", "--output", "--help"].map(String::from).into();
    assert_eq!(help_options(help), want);
    assert_eq!(commands(help), ["disk"]);
}
