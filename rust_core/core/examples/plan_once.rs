//! Plan once and print the time the search took, without Python: for
//! profiling the search (`perf record`) and quick timings.
//!
//!     cargo run --release -p dapple-core --example plan_once -- \
//!         profiles/artifact/gnmt-32-pbs-64.json 2x8-nvlink-25gbps 1024 [auto|A|B] [SPACE] [refine|no-refine]
//!
//! With `PLAN_ONCE_OUT=plan.json` in the environment it also writes the plan.

use dapple_core::cluster::topology::Topology;
use dapple_core::cost::WarmupPolicy;
use dapple_core::model::profile::Profile;
use dapple_core::search::{search, SearchOptions, SearchSpace};
use dapple_core::FileObject;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: plan_once PROFILE TOPOLOGY GLOBAL_BATCH_SIZE [auto|A|B] [SEARCH_SPACE] [refine|no-refine]");
        std::process::exit(2);
    }
    let text = std::fs::read_to_string(&args[1]).expect("readable profile");
    let profile = Profile::from_json(&text).expect("valid profile");
    let topology = Topology::from_spec(&args[2]).expect("valid topology spec");
    let mut opts = SearchOptions::new(args[3].parse().expect("global batch size"));
    if let Some(policy) = args.get(4) {
        opts.warmup_policy = WarmupPolicy::parse(policy).expect("auto, A or B");
    }
    if let Some(space) = args.get(5) {
        opts.search_space = SearchSpace::parse(space).expect("auto, full or machine-aligned");
    }
    if let Some(refine) = args.get(6) {
        opts.refine = match refine.as_str() {
            "refine" => true,
            "no-refine" => false,
            other => panic!("refine or no-refine, not {other:?}"),
        };
    }
    let start = std::time::Instant::now();
    let result = search(&profile, &topology, &opts).expect("a plan");
    let elapsed = start.elapsed();
    let estimate = result.plan.estimate.as_ref().expect("costed");
    let selection = result.plan.selection.as_ref().expect("searched");
    println!(
        "{elapsed:.2?}  {}  simulated {:.1} ms  bound {:.1} ms  optimal {:?}  refined from {:?}  states {}  stages costed {}  refinement plans costed {}",
        result.plan.shape(),
        estimate.iteration_ms.unwrap_or(estimate.latency_ms),
        selection.lower_bound_ms.unwrap_or(f64::NAN),
        selection.optimal,
        selection.refined_from_ms,
        result.stats.states,
        result.stats.stages_costed,
        result.stats.refine_plans_costed
    );
    // For a closer look at the plan found: its whole file.
    if let Ok(path) = std::env::var("PLAN_ONCE_OUT") {
        std::fs::write(&path, result.plan.to_json()).expect("writable plan file");
    }
}
