//! Every option of every `k3-prefill` command says what it does in `--help`.

use clap::{Args, Command};
use cuda_prefiller::cli;

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
        cli::synth::Args::augment_args(Command::new("synth")),
        cli::inspect::Args::augment_args(Command::new("inspect")),
        cli::forward::Args::augment_args(Command::new("forward")),
        cli::bench::Args::augment_args(Command::new("bench")),
        cli::serve::Args::augment_args(Command::new("serve")),
        cli::calibrate::Args::augment_args(Command::new("calibrate")),
        cli::prune::Args::augment_args(Command::new("prune")),
    ]
}

#[test]
fn every_option_of_every_command_has_help() {
    let mut missing = Vec::new();
    for c in commands() {
        for a in undocumented(&c) {
            missing.push(format!("k3-prefill {} {a}", c.get_name()));
        }
    }
    assert!(missing.is_empty(), "options without --help text:\n{}", missing.join("\n"));
}

/// The list above is the binary's: a new command is checked too.
#[test]
fn the_checked_commands_are_the_binarys() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-prefill")).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    let checked: Vec<String> = commands().iter().map(|c| c.get_name().to_string()).collect();
    assert_eq!(listed, checked, "k3-prefill --help:\n{text}");
}
