use dapple_core::cost::WarmupPolicy;
use dapple_core::profile::Profile;
use dapple_core::search::{search, SearchOptions};
use dapple_core::topology::Topology;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let p = Profile::from_json(&std::fs::read_to_string(&a[1]).unwrap()).unwrap();
    let t = Topology::from_spec(&a[2]).unwrap();
    let mut o = SearchOptions::new(a[3].parse().unwrap());
    if a.len() > 4 {
        o.warmup_policy = WarmupPolicy::parse(&a[4]).unwrap();
    }
    let t0 = std::time::Instant::now();
    let r = search(&p, &t, &o).unwrap();
    let e = r.plan.estimate.as_ref().unwrap();
    println!(
        "{:?} {} sim {:?} states {} costed {} sel {:?}",
        t0.elapsed(),
        r.plan.shape(),
        e.iteration_ms,
        r.stats.states,
        r.stats.stages_costed,
        r.plan
            .selection
            .as_ref()
            .map(|s| (s.optimal, s.lower_bound_ms))
    );
}
