//! `cargo xtask`: the project's tasks as a plain Rust binary (the rust-analyzer
//! pattern), so that building, testing and running the demo need nothing but
//! cargo. Each task lives in its own module; `main` only dispatches.

mod bench;
mod buf;
mod chaos;
mod chart;
mod deny;
#[cfg(test)]
mod doclinks;
mod image;
mod kube;
mod kube_control_plane;
mod kube_node;
mod leftovers;
mod model;
mod network;
mod new_policy;
mod outside;
mod policies;
mod prereqs;
mod scale;
mod soak;
mod stages;
mod tasks;
mod upgrade;
mod util;

use clap::{Parser, Subcommand};

/// lockstep's project tasks.
#[derive(Parser)]
#[command(name = "cargo xtask", about = "lockstep's project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build every host crate and every WASM policy.
    Build,
    /// Build the WASM policies under policies/ to target/lockstep/policies/*.wasm.
    BuildPolicies,
    /// Everything CI checks: fmt, clippy -D warnings, policies, every test.
    Test {
        /// Skip `cargo fmt --check` and clippy (faster local iteration).
        #[arg(long)]
        no_lint: bool,
        /// Skip a step on purpose (repeat for several): python, hosts or
        /// image. Listed again in the closing summary; nothing else is
        /// ever skipped (a missing piece is installed, or fails the run).
        #[arg(long = "skip", value_name = "NAME")]
        skip: Vec<String>,
    },
    /// The main job: run the demo on the embedded default.
    Demo,
    /// Run the criterion benchmarks; write target/lockstep/bench.json, a latency chart and
    /// docs/bench/results.md, and print a Markdown table.
    Bench {
        /// A short run for CI-sized machines.
        #[arg(long)]
        quick: bool,
        /// Also replace docs/status.md's Results section (between the bench markers).
        #[arg(long)]
        readme: bool,
        /// Only the instruction counts per operation (callgrind): write
        /// target/lockstep/instructions.json and print their table.
        #[arg(long, conflicts_with = "readme")]
        instructions: bool,
    },
    /// Soak a real environment: rounds of writes, peeks, dataflows and
    /// subscriptions with the environment killed between rounds; checks every
    /// answer and that costs stay flat; writes target/lockstep/soak.json and
    /// soak.svg and ends with `soak: ok`.
    Soak {
        /// 25 rounds and 1,000,000 rows (a few minutes) instead of 100 rounds.
        #[arg(long)]
        quick: bool,
    },
    /// Scaffold a WASM policy crate under policies/NAME.
    NewPolicy {
        /// The policy's name (lower-case, dashes): policies/NAME, NAME.wasm.
        name: String,
        /// Which world it implements.
        #[arg(long, value_enum)]
        kind: new_policy::Kind,
        /// Write a standalone crate DIR/NAME (its own workspace) instead of
        /// policies/NAME, for a policy kept outside this repository.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// With --out: take lockstep-policy-sdk from this git repository
        /// instead of this checkout's path.
        #[arg(long, requires = "out")]
        sdk_git: Option<String>,
    },
    /// Check (`cargo check`) the reachability family from a scratch directory outside the
    /// checkout, as an adopter's repository would (part of `test`).
    OutsideFamily,
    /// Rewrite the checked-in standalone policy templates
    /// (templates/my-distribution-policy, templates/my-orphan-policy) from
    /// the generator `new-policy --out` uses, then build one from a scratch
    /// directory outside the checkout and check it (as `test` does).
    PolicyTemplates,
    /// Fault suites on real processes (`orphans`, `distribution`, `security`, `campaign`, `hostile`); prints the JSON summary lines.
    Chaos {
        /// The suite to run: `orphans`, `distribution`, `security`, `campaign` (a seeded random fault campaign) or `hostile` (a seeded hostile-neighbour campaign).
        suite: String,
        /// For `distribution`: the variants to run (default: broadcast barrier log log@postgres naive naive+history-check); for `campaign`: the strategies (default: broadcast barrier log naive).
        #[arg(long = "strategy")]
        strategies: Vec<String>,
        #[command(flatten)]
        campaign: chaos::CampaignArgs,
    },
    /// Build the container image lockstep:dev (podman, or docker) from the
    /// host's binaries and check it: `lockstep demo` and `lockstep serve`
    /// inside it; then remove it. `test` runs it on the debug binaries.
    /// See docs/image.md.
    Image {
        /// Build everything inside the container (a release build in the Rust
        /// image, which must come from a registry).
        #[arg(long)]
        from_source: bool,
        /// Build the host's release binaries first and put those in the
        /// image (what ships; a cold release build takes about 13 minutes
        /// on 2 cores, which is why `test` uses the debug binaries).
        #[arg(long, conflicts_with = "from_source")]
        release: bool,
        /// Keep the image and the build context (target/lockstep/image).
        #[arg(long)]
        keep: bool,
    },
    /// Today's `lockstep serve` adopts the replica processes of the newest
    /// release in RELEASES (built from a git worktree into its own target
    /// dir); not part of `test`. See docs/compatibility.md.
    Upgrade,
    /// `buf lint` and `buf breaking` of proto/ against the newest release in
    /// RELEASES (buf installed into target/buf); part of `test`.
    Buf,
    /// `cargo deny check licenses bans sources` with deny.toml (cargo-deny
    /// built once into the cache); part of `test`.
    Deny,
    /// Model-check the protocols (stateright, CI-sized bounds); prints the JSON summary lines.
    Model {
        /// Variants to check (default: all).
        variants: Vec<String>,
    },
    /// Build (tools/kube/ into target/kube/bin) and start a real Kubernetes
    /// control plane on loopback (etcd, kube-apiserver, controller manager,
    /// scheduler, kwok's fake node); print the admin kubeconfig's path and
    /// wait until Ctrl-C. Files and logs in target/kube/up/.
    KubeUp,
    /// The Kubernetes backend and deploy/kubernetes against a real API
    /// server on loopback (xtask/src/kube.rs): the manifests applied with
    /// strict server-side validation, the Role through the real authorizer,
    /// the orphan suite as the shipped service account, a replica's
    /// restart, upgrade and drop timed; then replicas on a real node
    /// (kubelet, containerd, CoreDNS; root) faulted and checked; ends with
    /// `kube: ok`.
    Kube {
        /// Only the real node's part (step 6).
        #[arg(long)]
        node_only: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Build => tasks::build(),
        Task::BuildPolicies => policies::build_all().map(|_| ()),
        Task::Test { no_lint, skip } => tasks::test(!no_lint, &skip),
        Task::Demo => tasks::demo(),
        Task::Bench {
            quick,
            instructions: true,
            ..
        } => bench::instructions_only(quick),
        Task::Bench { quick, readme, .. } => bench::bench(quick, readme),
        Task::Soak { quick } => soak::soak(quick),
        Task::Upgrade => upgrade::upgrade(),
        Task::Buf => buf::check(),
        Task::Deny => deny::check(),
        Task::Chaos {
            suite,
            strategies,
            campaign,
        } => chaos::run_suite_with(&suite, &strategies, &campaign),
        Task::Image {
            from_source,
            release,
            keep,
        } => image::image(&image::Options {
            from_source,
            release,
            keep,
        }),
        Task::Model { variants } => model::run(&variants),
        Task::KubeUp => kube_control_plane::kube_up(),
        Task::Kube { node_only } => kube::kube(node_only),
        Task::OutsideFamily => outside::check_family(),
        Task::PolicyTemplates => {
            new_policy::write_templates(&util::root())?;
            policies::check_standalone(&util::target_dir().join("debug/lockstep"))
        }
        Task::NewPolicy {
            name,
            kind,
            out: None,
            ..
        } => new_policy::scaffold(&name, kind),
        Task::NewPolicy {
            name,
            kind,
            out: Some(out),
            sdk_git,
        } => {
            let sdk = match sdk_git {
                Some(url) => new_policy::Sdk::Git(url),
                None => new_policy::Sdk::Path(util::root().join("crates/policy-sdk")),
            };
            new_policy::scaffold_standalone(&name, kind, &out, &sdk)
        }
    }
}
