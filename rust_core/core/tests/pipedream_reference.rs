//! The PipeDream baseline against PipeDream's own optimizer: the plans in
//! `tests/data/pipedream-reference.json` were produced by running
//! msr-fiddle/pipedream's `optimizer_graph_hierarchical.py` at commit
//! 7db6a1c on the DAPPLE artifact profiles (`benchmarks/pipedream_reference.py`).
//! For every case it finished, dapple's baseline must return one of its
//! plans: the same layer ranges, the same GPU count per stage, on the same
//! GPUs. PipeDream breaks ties in Python's set order, so a case can have
//! more tied optima than the hash seeds it was run with found; on one-level
//! clusters a plan that is not among them is accepted when PipeDream's own
//! terms give it exactly the time of PipeDream's plans (which, evaluated the
//! same way, must give the time PipeDream printed).

use std::path::PathBuf;

use dapple_core::baselines::pipedream::one_level_time;
use dapple_core::baselines::{baseline_layout, Baseline, Layout, PipeDreamProblem};
use dapple_core::cluster::topology::Topology;
use dapple_core::model::profile::Profile;
use dapple_core::FileObject;
use serde_json::Value;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &PathBuf) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (layer start, layer end, devices) of each stage of a reference plan.
fn reference_stages(plan: &Value) -> Vec<(usize, usize, Vec<u32>)> {
    plan["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .map(|s| {
            let layers = s["layers"].as_array().expect("layers");
            let devices = s["devices"]
                .as_array()
                .expect("devices")
                .iter()
                .map(|d| d.as_u64().expect("device id") as u32)
                .collect();
            (
                layers[0].as_u64().unwrap() as usize,
                layers[1].as_u64().unwrap() as usize,
                devices,
            )
        })
        .collect()
}

#[test]
fn the_baseline_returns_pipedreams_plans() {
    let root = repo_root();
    let reference: Value =
        serde_json::from_str(&read(&root.join("tests/data/pipedream-reference.json"))).unwrap();
    assert_eq!(reference["format"], "dapple-pipedream-reference");
    let mut checked = 0;
    let mut tied = 0;
    let mut mismatches = Vec::new();
    for case in reference["cases"].as_array().expect("cases") {
        if case["finished"] != true {
            continue;
        }
        let profile = Profile::from_json(&read(
            &root.join(case["dapple_profile"].as_str().expect("dapple_profile")),
        ))
        .unwrap();
        let configuration = case["configuration"].as_str().expect("configuration");
        let topology = Topology::from_spec(configuration).unwrap();
        let ours = baseline_layout(
            Baseline::PipeDream,
            &profile,
            &topology,
            profile.min_slice(None),
        )
        .unwrap();
        let theirs: Vec<_> = case["plans"]
            .as_array()
            .expect("plans")
            .iter()
            .map(reference_stages)
            .collect();
        checked += 1;
        if theirs.contains(&ours) {
            continue;
        }
        let problem = PipeDreamProblem::new(&profile, &topology, profile.min_slice(None)).unwrap();
        if let [level] = problem.levels[..] {
            let time = |layout: &Layout| {
                let state_of = |layer: usize| {
                    problem
                        .first_layer
                        .iter()
                        .position(|&f| f == layer)
                        .expect("a state boundary")
                };
                let stages: Vec<_> = layout
                    .iter()
                    .map(|(s, e, d)| (state_of(*s), state_of(*e), d.len()))
                    .collect();
                one_level_time(&problem.states, level, problem.memory_bytes, &stages)
                    .expect("a plan within PipeDream's memory constraint")
            };
            let printed = case["pipeline_time_s"].as_f64().expect("pipeline_time_s");
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
            let all_theirs_tie = theirs.iter().all(|t| close(time(t), printed));
            // The terms tell plans apart: the whole model replicated on
            // every GPU is not one of these optima.
            let everything: Layout = vec![(
                0,
                profile.layers.len(),
                ours.iter().flat_map(|s| s.2.clone()).collect(),
            )];
            assert!(
                !close(time(&everything), printed),
                "{}: the evaluation cannot tell plans apart",
                case["model"]
            );
            if all_theirs_tie && close(time(&ours), printed) {
                tied += 1;
                continue; // a tied optimum the seeds did not happen to find
            }
        }
        {
            mismatches.push(format!(
                "{} on {configuration}: ours {:?}, PipeDream's {:?}",
                case["model"], ours, theirs
            ));
        }
    }
    assert!(
        checked >= 10,
        "only {checked} finished cases in the reference"
    );
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    // Most cases have one optimum, or PipeDream's seeds found ours.
    assert!(
        tied * 3 <= checked,
        "{tied} of {checked} cases matched only as ties"
    );
}
