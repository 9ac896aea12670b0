//! The README and docs/ describe the product as it is, for its users: no words from the
//! project's own history (which work session measured what, which issue asked for it, what a
//! round of work left undone). Dates and commits say when a figure was measured
//! (docs/measurements.md); what is unmeasured or below its goal is said as a fact of the code.

use std::path::{Path, PathBuf};

/// Phrases that only make sense inside the project's history (lowercase).
const PHRASES: &[&str] = &[
    "fixed since",
    "not re-run",
    "not met",
    "this session",
    "earlier session",
    "previous session",
    "last session",
    "next session",
    "end of session",
    "since session",
];

/// Words that are history when a number follows them ("session 4", "issue 22", "issue #22",
/// "round 2"). "sessions 8" stays: the decoder's session counts in printed output.
const NUMBERED: &[&str] = &["session", "issue", "round", "phase", "milestone"];

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Every history wording in `text`: (line number, the matched words, the line).
fn findings(text: &str) -> Vec<(usize, String, String)> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        for p in PHRASES {
            if lower.contains(p) {
                found.push((i + 1, p.to_string(), line.to_string()));
            }
        }
        for word in NUMBERED {
            for (at, _) in lower.match_indices(word) {
                let before_ok = lower[..at].chars().next_back().is_none_or(|c| !c.is_alphanumeric());
                let rest = &lower[at + word.len()..];
                let gap = rest.len() - rest.trim_start_matches([' ', '\t']).len();
                let number = rest[gap..].trim_start_matches('#');
                if before_ok && gap > 0 && number.starts_with(|c: char| c.is_ascii_digit()) {
                    let n: String = number.chars().take_while(|c| c.is_ascii_digit()).collect();
                    found.push((i + 1, format!("{word} {}{n}", if rest[gap..].starts_with('#') { "#" } else { "" }), line.to_string()));
                }
            }
        }
    }
    found
}

#[test]
fn readme_and_docs_have_no_project_history_wording() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let mut report = String::new();
    let files = markdown_files(&root);
    assert!(files.len() > 5, "README.md and docs/*.md not found under {}", root.display());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (line, what, text) in findings(&text) {
            report += &format!("{}:{line}: \"{what}\": {}\n", f.strip_prefix(&root).unwrap().display(), text.trim());
        }
    }
    assert!(report.is_empty(), "project-history wording in the user documentation (say what is, with a date where it matters):\n{report}");
}

#[test]
fn the_check_finds_what_it_should() {
    let bad = "measured in session 5; targets 80 %: not met\nsee issue #22 and round 2\nfixed since, not re-run";
    let got: Vec<String> = findings(bad).into_iter().map(|f| f.1).collect();
    for want in ["session 5", "not met", "issue #22", "round 2", "fixed since", "not re-run"] {
        assert!(got.iter().any(|g| g == want), "missed {want:?} in {got:?}");
    }
    let good =
        "the session store holds 8 sessions\nnode sessions 194 (69.8 MB)\nan issue with the driver\nround-trip 2 GiB\none continuing a session): 4 requests";
    assert!(findings(good).is_empty(), "{:?}", findings(good));
}
