//! Runs the conformance check on policy files and prints the reporting
//! contract's lines: what `lockstep policy check FILE` does.
//!
//! `cargo run -p lockstep-policy-host --example check -- target/lockstep/policies/*.wasm`

use std::process::ExitCode;

use lockstep_policy_host::conformance;

fn main() -> ExitCode {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: check FILE.wasm...");
        return ExitCode::from(2);
    }
    let mut ok = true;
    for file in files {
        match conformance::check(&file) {
            Ok(lines) => {
                print!("{}", conformance::report(&lines));
                ok &= lines.iter().all(|l| l.ok());
            }
            Err(e) => {
                eprintln!("error: {e}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
