//! Every option of every `k3-decode` command says what it does in `--help`, and `serve --help`
//! says what it serves.

use clap::{Args, Command};
use mac_decoder::cli;

/// The options and positionals of `cmd` (flattened groups included) without help text.
fn undocumented(cmd: &Command) -> Vec<String> {
    cmd.get_arguments()
        .filter(|a| !a.is_hide_set() && a.get_id() != "help" && a.get_id() != "version")
        .filter(|a| a.get_help().is_none_or(|h| h.to_string().trim().is_empty()) && a.get_long_help().is_none())
        .map(|a| a.get_long().map(|l| format!("--{l}")).unwrap_or_else(|| a.get_id().to_string()))
        .collect()
}

fn commands() -> Vec<Command> {
    vec![
        cli::generate::Args::augment_args(Command::new("generate")),
        cli::encode_image::Args::augment_args(Command::new("encode-image")),
        cli::serve::Args::augment_args(Command::new("serve")),
        cli::render::RenderArgs::augment_args(Command::new("render")),
        cli::render::ParseArgs::augment_args(Command::new("parse")),
        cli::launch::Args::augment_args(Command::new("launch")),
    ]
}

#[test]
fn every_option_of_every_command_has_help() {
    let mut missing = Vec::new();
    for c in commands() {
        for a in undocumented(&c) {
            missing.push(format!("k3-decode {} {a}", c.get_name()));
        }
    }
    assert!(missing.is_empty(), "options without --help text:\n{}", missing.join("\n"));
}

fn help(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-decode")).args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The list above is the binary's: a new command is checked too.
#[test]
fn the_checked_commands_are_the_binarys() {
    let text = help(&["--help"]);
    let listed: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    let checked: Vec<String> = commands().iter().map(|c| c.get_name().to_string()).collect();
    assert_eq!(listed, checked, "k3-decode --help:\n{text}");
}

#[test]
fn serve_help_says_what_it_serves() {
    for text in [help(&["--help"]), help(&["serve", "--help"])] {
        assert!(text.contains("OpenAI- and Anthropic-compatible"), "{text}");
    }
}
