//! `kiln`: compile GLM-5 NVFP4 checkpoints ahead of time into static execution plans, inspect
//! them, and make synthetic checkpoints for tests and the demo.

mod bench;
mod commands;
mod server;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Ahead-of-time compiler and runtime for GLM-5 NVFP4 on SM120 GPUs",
    long_about = "kiln compiles a Hugging Face GLM-5 (glm_moe_dsa) checkpoint once into a static \
                  execution plan for one hardware target (memory plan proven to fit, sharded for \
                  --tp GPUs), so serving starts in seconds and never JIT-compiles.\n\n\
                  Quick start with the tiny synthetic model:\n  \
                  kiln synth tiny -o demo/ckpt\n  \
                  kiln compile demo/ckpt --target cpu -o demo/plan\n  \
                  kiln inspect demo/plan\n  \
                  kiln run demo/plan --chat --prompt \"Hello!\"\n  \
                  kiln serve demo/plan --port 8000\n\n\
                  For GLM-5-NVFP4 on 8x RTX PRO 6000: kiln compile CKPT --target sm_120a --tp 8 -o ART"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Synth(commands::synth::Args),
    Quantize(commands::quantize::Args),
    Compile(commands::compile::Args),
    Inspect(commands::inspect::Args),
    Run(commands::run::Args),
    Logits(commands::logits::Args),
    Serve(commands::serve::Args),
    Bench(commands::bench::Args),
    Verify(commands::verify::Args),
    VerifyWeights(commands::verify_weights::Args),
    Emu(commands::emu::Args),
    Doctor(commands::doctor::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(a) => commands::bench::run_cli(a),
        Command::Run(a) => commands::run::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Compile(a) => commands::compile::run(a),
        Command::Emu(a) => commands::emu::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Logits(a) => commands::logits::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::VerifyWeights(a) => commands::verify_weights::run(a),
        Command::Doctor(a) => commands::doctor::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}
