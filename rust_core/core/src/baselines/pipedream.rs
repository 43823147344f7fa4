//! PipeDream's planner, as its own code computes it: msr-fiddle/pipedream,
//! `optimizer/optimizer_graph_hierarchical.py` at commit 7db6a1c, run with
//! `--use_memory_constraint --activation_compression_ratio 1`.
//!
//! PipeDream plans level by level, bottom up: first a pipeline inside one
//! machine for every range of the model (its GPUs at the machine's link
//! speed), then a pipeline over machines whose "compute time" for a range
//! is the best in-machine pipeline time of that range. Each level is a
//! dynamic programme over (first state, last state, workers): the time of a
//! plan is its slowest stage, a stage's time is `(compute + 4 (r-1) w /
//! (B r)) / r` on `r` replicas, and the transfers into and out of the last
//! stage, `2 a / (B r)`, also bound it. How the code differs from the
//! paper's formula is listed in docs/cost-model.md; this module follows the
//! code, including its memory constraint and the division of the first
//! replication term by the workers per machine.
//!
//! States are prefixes of the model. PipeDream's states are the antichains
//! of the layer graph; on graphs whose antichain DAG is a chain (VGG, BERT,
//! XLNet and AmoebaNet in the DAPPLE artifact, after PipeDream drops its
//! `Input*` sources and `__getitem__*` sinks) they are the prefixes of the
//! topological order, which is what this module uses on every graph. On
//! branching graphs (GNMT) the prefixes are a subset of the antichains, so
//! the plan found is the best over contiguous ranges of dapple's layer
//! order: PipeDream's enumeration of GNMT-16's antichains does not finish in
//! ten minutes, this takes milliseconds.
//!
//! Ties: PipeDream keeps the first candidate that is strictly better, in
//! the iteration order of a Python set of objects hashed by address, so its
//! equal plans vary from run to run (with address-space randomisation, not
//! only with `PYTHONHASHSEED`). Here a candidate must be better by more
//! than rounding ([`TIE_TOLERANCE`]); split points are tried from the last
//! one back and replica counts upwards, so among equal plans the shortest
//! last stage on the fewest replicas wins. That gives PipeDream's most
//! frequent plan on VGG-19 B, BERT-24 A and AmoebaNet-36 A. Everything is a
//! pure function of plain numbers.

/// Relative difference below which two times tie. PipeDream sums each
/// state's costs over a Python set, so its equal plans differ by rounding
/// (about 2e-15 relative in the reference runs); a candidate must beat the
/// one kept by more than this to replace it.
const TIE_TOLERANCE: f64 = 1e-9;

/// What PipeDream reads of each state: the model up to and including one
/// node. Sums are prefix sums over states (`*_prefix[s + 1]` covers states
/// `0..=s`), in PipeDream's units: seconds and bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct States {
    pub compute_s_prefix: Vec<f64>,
    pub activation_bytes_prefix: Vec<f64>,
    pub parameter_bytes_prefix: Vec<f64>,
    /// Bytes of the outputs that leave state `s`'s prefix (its augmented
    /// antichain's activations).
    pub output_activation_bytes: Vec<f64>,
}

impl States {
    /// States from per-state (not prefix) values.
    pub fn from_per_state(
        compute_s: &[f64],
        activation_bytes: &[f64],
        parameter_bytes: &[f64],
        output_activation_bytes: &[f64],
    ) -> States {
        let prefix = |v: &[f64]| {
            let mut p = Vec::with_capacity(v.len() + 1);
            p.push(0.0);
            for x in v {
                p.push(p.last().copied().unwrap_or(0.0) + x);
            }
            p
        };
        States {
            compute_s_prefix: prefix(compute_s),
            activation_bytes_prefix: prefix(activation_bytes),
            parameter_bytes_prefix: prefix(parameter_bytes),
            output_activation_bytes: output_activation_bytes.to_vec(),
        }
    }

    pub fn len(&self) -> usize {
        self.output_activation_bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn range(prefix: &[f64], first: usize, last: usize) -> f64 {
        prefix[last + 1] - prefix[first]
    }
}

/// One level of the hierarchy: how many workers it splits the model over
/// (GPUs of a machine, then machines) and the bandwidth between them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub workers: usize,
    pub bandwidth_bytes_per_s: f64,
}

/// A stage of PipeDream's plan: states `first_state..end_state`, and for
/// each level (bottom first) how many workers of that level replicate it
/// and the index of its first worker there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeDreamStage {
    pub first_state: usize,
    pub end_state: usize,
    /// (replicas, first worker) per level, bottom level first.
    pub placement: Vec<(usize, usize)>,
}

impl PipeDreamStage {
    /// Workers of the bottom level (GPUs) the stage runs on in all.
    pub fn gpus(&self) -> usize {
        self.placement.iter().map(|(r, _)| r).product()
    }
}

/// The plan and its time: the slowest stage, in seconds per minibatch.
#[derive(Debug, Clone, PartialEq)]
pub struct PipeDreamPlan {
    pub pipeline_time_s: f64,
    pub stages: Vec<PipeDreamStage>,
}

/// One entry of PipeDream's table `A[i][j][m]`: the best time of states
/// `i..=j` on `m + 1` workers, the split before its last stage (`k`, workers
/// left), and the last stage's replicas.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cell {
    time_s: Option<f64>,
    split: Option<(usize, usize)>,
    replicas: usize,
}

const EMPTY: Cell = Cell {
    time_s: None,
    split: None,
    replicas: 0,
};

/// `A` of one level. Rows are first states; the top level stores row 0
/// only, since only whole-model pipelines are read from it.
struct Table {
    rows: usize,
    states: usize,
    workers: usize,
    cells: Vec<Cell>,
}

impl Table {
    fn index(&self, i: usize, j: usize, m: usize) -> usize {
        debug_assert!(i < self.rows && j < self.states && m < self.workers);
        (i * self.states + j) * self.workers + m
    }
    fn at(&self, i: usize, j: usize, m: usize) -> Cell {
        self.cells[self.index(i, j, m)]
    }
}

/// A range's time on `replicas` workers: its compute plus the weight
/// synchronisation `4 (r-1) |w| / (B r)` (divided by `sync_divisor`, the
/// workers per worker where the code divides it), all over `r`.
fn replicated_time_s(
    compute_s: f64,
    parameter_bytes: f64,
    replicas: usize,
    bandwidth: f64,
    sync_divisor: f64,
) -> f64 {
    let r = replicas as f64;
    (compute_s + 4.0 * (r - 1.0) * parameter_bytes / (bandwidth * r) / sync_divisor) / r
}

/// Sending `bytes` into or out of a stage on `replicas` workers: `2 a / (B r)`.
fn transfer_time_s(bytes: f64, replicas: usize, bandwidth: f64) -> f64 {
    2.0 * bytes / (bandwidth * replicas as f64)
}

/// PipeDream's memory constraint: a stage's activations and weights times
/// the minibatches in flight, `ceil((workers - used) / replicas)` (`used`:
/// the workers of the range being solved, this stage's included).
fn fits_memory(
    bytes: f64,
    workers: usize,
    used: usize,
    replicas: usize,
    memory_bytes: f64,
) -> bool {
    (workers - used).div_ceil(replicas) as f64 * bytes <= memory_bytes
}

/// Steps a level's dynamic programme takes, about: PipeDream's is cubic in
/// the states below the top level and quadratic in the workers.
pub fn planning_steps(num_states: usize, levels: &[Level]) -> f64 {
    let n = num_states as f64;
    levels
        .iter()
        .enumerate()
        .map(|(l, level)| {
            let rows = if l + 1 == levels.len() { 1.0 } else { n + 1.0 };
            let w = level.workers as f64;
            rows * n * n / 2.0 * w * w / 2.0
        })
        .sum()
}

/// `compute_partitioning` of one level. (Loops index the table by its
/// coordinates, as the code does.) `range_time_s[i][j]` is the time of
/// states `i..=j` as one unit at this level (compute at the bottom level,
/// the level below's best pipeline above it), `None` where that has none.
#[allow(clippy::needless_range_loop)]
fn solve_level(
    states: &States,
    range_time_s: &[Vec<Option<f64>>],
    level: Level,
    workers_per_worker: f64,
    memory_bytes: f64,
    top: bool,
) -> Table {
    let n = states.len();
    let w = level.workers;
    let bandwidth = level.bandwidth_bytes_per_s;
    let rows = if top { 1 } else { n + 1 };
    let mut a = Table {
        rows,
        states: n,
        workers: w,
        cells: vec![EMPTY; rows * n * w],
    };
    let activation = |i: usize, j: usize| States::range(&states.activation_bytes_prefix, i, j);
    let parameters = |i: usize, j: usize| States::range(&states.parameter_bytes_prefix, i, j);

    // Every range replicated over m + 1 workers, memory permitting.
    for i in 0..rows {
        for j in i..n {
            let (act, params) = (activation(i, j), parameters(i, j));
            for m in 0..w {
                let r = m + 1;
                if !fits_memory(act + params, w, r, r, memory_bytes) {
                    continue;
                }
                let idx = a.index(i, j, m);
                a.cells[idx] = match range_time_s[i][j] {
                    Some(t) => Cell {
                        time_s: Some(replicated_time_s(
                            t,
                            params,
                            r,
                            bandwidth,
                            workers_per_worker,
                        )),
                        split: None,
                        replicas: r,
                    },
                    None => EMPTY,
                };
            }
        }
    }

    // Then every split before a last stage of k + 1..=j on r' workers.
    for i in 0..rows {
        for m in 1..w {
            for j in i + 1..n {
                let mut best = a.at(i, j, m);
                // k ranges over the states before j, last first; for i > 0
                // the code skips those before i - 1, and k = i - 1 has no
                // entry in row i.
                for k in (i.saturating_sub(1)..j).rev() {
                    let Some(last_compute) = range_time_s[k + 1][j] else {
                        continue;
                    };
                    let last_act = activation(k + 1, j);
                    let last_params = parameters(k + 1, j);
                    for replicas in 1..=m {
                        if !fits_memory(last_act + last_params, w, m + 1, replicas, memory_bytes) {
                            continue;
                        }
                        let Some(before) = a.at(i, k, m - replicas).time_s else {
                            continue;
                        };
                        let last =
                            replicated_time_s(last_compute, last_params, replicas, bandwidth, 1.0);
                        let input =
                            transfer_time_s(states.output_activation_bytes[k], replicas, bandwidth);
                        let mut time = before.max(last).max(input);
                        if j < n - 1 {
                            let output = states.output_activation_bytes[j];
                            time = time.max(transfer_time_s(output, replicas, bandwidth));
                        }
                        if best.time_s.is_none_or(|b| b > time * (1.0 + TIE_TOLERANCE)) {
                            best = Cell {
                                time_s: Some(time),
                                split: Some((k, m - replicas)),
                                replicas,
                            };
                        }
                    }
                }
                let idx = a.index(i, j, m);
                a.cells[idx] = best;
            }
        }
    }
    a
}

/// `analyze_partitioning`: the stages of states `start..end` on all of a
/// level's workers, as (first state, end state, replicas), in order.
fn stages_of(a: &Table, start: usize, end: usize) -> Option<Vec<(usize, usize, usize)>> {
    let mut cell = a.at(start, end - 1, a.workers - 1);
    cell.time_s?;
    let mut stages = Vec::new();
    let mut stage_end = end;
    while let Some((k, workers_left)) = cell.split {
        stages.push((k + 1, stage_end, cell.replicas));
        stage_end = k + 1;
        cell = a.at(start, k, workers_left);
    }
    stages.push((start, stage_end, cell.replicas));
    stages.reverse();
    Some(stages)
}

/// PipeDream's plan of `states` over `levels` (bottom level first), each
/// GPU holding `memory_bytes`. `None` when no plan fits PipeDream's memory
/// constraint.
pub fn pipedream_plan(
    states: &States,
    levels: &[Level],
    memory_bytes: f64,
) -> Option<PipeDreamPlan> {
    let n = states.len();
    if n == 0 || levels.is_empty() || levels.iter().any(|l| l.workers == 0) {
        return None;
    }
    let mut range_time_s: Vec<Vec<Option<f64>>> = (0..=n)
        .map(|i| {
            (0..n)
                .map(|j| (j >= i).then(|| States::range(&states.compute_s_prefix, i, j)))
                .collect()
        })
        .collect();
    let mut tables = Vec::with_capacity(levels.len());
    let mut workers_per_worker = 1.0;
    for (l, level) in levels.iter().enumerate() {
        let top = l + 1 == levels.len();
        let table = solve_level(
            states,
            &range_time_s,
            *level,
            workers_per_worker,
            memory_bytes,
            top,
        );
        if !top {
            for (i, row) in range_time_s.iter_mut().enumerate() {
                for (j, t) in row.iter_mut().enumerate() {
                    *t = if j >= i {
                        table.at(i, j, level.workers - 1).time_s
                    } else {
                        None
                    };
                }
            }
        }
        workers_per_worker = level.workers as f64;
        tables.push(table);
    }
    let top = tables.last().expect("at least one level");
    let pipeline_time_s = top.at(0, n - 1, top.workers - 1).time_s?;

    // Top down: each stage of a level is split again by the level below,
    // inside each of its workers.
    let mut stages = vec![PipeDreamStage {
        first_state: 0,
        end_state: n,
        placement: Vec::new(),
    }];
    for (l, table) in tables.iter().enumerate().rev() {
        let mut next = Vec::new();
        for stage in &stages {
            let mut first_worker = 0;
            for (first, end, replicas) in stages_of(table, stage.first_state, stage.end_state)? {
                let mut placement = vec![(replicas, first_worker)];
                placement.extend(stage.placement.iter().copied());
                next.push(PipeDreamStage {
                    first_state: first,
                    end_state: end,
                    placement,
                });
                first_worker += replicas;
            }
            debug_assert_eq!(first_worker, levels[l].workers);
        }
        stages = next;
    }
    Some(PipeDreamPlan {
        pipeline_time_s,
        stages,
    })
}

/// PipeDream's time for a given one-level plan, `(first state, end state,
/// replicas)` per stage over all of `level`'s workers, by the terms its
/// table uses (the first stage as a replicated range, each later stage as
/// the last stage of a split); `None` where a stage breaks its memory
/// constraint. Tied optima evaluate equal: this is how a test tells a tie
/// from a different plan.
pub fn one_level_time(
    states: &States,
    level: Level,
    memory_bytes: f64,
    stages: &[(usize, usize, usize)],
) -> Option<f64> {
    let n = states.len();
    let w = level.workers;
    let bandwidth = level.bandwidth_bytes_per_s;
    let mut used = 0;
    let mut time: Option<f64> = None;
    for &(first, end, replicas) in stages {
        let last = end - 1;
        used += replicas;
        let compute = States::range(&states.compute_s_prefix, first, last);
        let params = States::range(&states.parameter_bytes_prefix, first, last);
        let act = States::range(&states.activation_bytes_prefix, first, last);
        if used > w || !fits_memory(act + params, w, used, replicas, memory_bytes) {
            return None;
        }
        let stage = replicated_time_s(compute, params, replicas, bandwidth, 1.0);
        time = Some(match time {
            None => stage,
            Some(before) => {
                let input = states.output_activation_bytes[first - 1];
                let mut t = before
                    .max(stage)
                    .max(transfer_time_s(input, replicas, bandwidth));
                if last < n - 1 {
                    let output = states.output_activation_bytes[last];
                    t = t.max(transfer_time_s(output, replicas, bandwidth));
                }
                t
            }
        });
    }
    (used == w).then_some(time?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(n: usize, compute_s: f64, act: f64, params: f64) -> States {
        States::from_per_state(
            &vec![compute_s; n],
            &vec![act; n],
            &vec![params; n],
            &vec![act; n],
        )
    }

    fn shape(plan: &PipeDreamPlan) -> Vec<(usize, usize, usize)> {
        plan.stages
            .iter()
            .map(|s| (s.first_state, s.end_state, s.gpus()))
            .collect()
    }

    #[test]
    fn one_level_balances_the_slowest_stage() {
        // Four states of 1 s, no communication cost: four one-GPU stages and
        // one four-way replicated stage both take 1 s; the replicated one is
        // found first (the table starts from it) and ties keep it.
        let states = uniform(4, 1.0, 0.0, 0.0);
        let level = Level {
            workers: 4,
            bandwidth_bytes_per_s: 1e9,
        };
        let plan = pipedream_plan(&states, &[level], 1e12).unwrap();
        assert_eq!(plan.pipeline_time_s, 1.0);
        assert_eq!(shape(&plan), vec![(0, 4, 4)]);
    }

    #[test]
    fn weight_synchronisation_makes_pipelining_win() {
        // Heavy weights: replicating costs 4 (r-1) w / (B r) per replica,
        // so a straight pipeline is faster.
        let states = uniform(4, 1.0, 0.0, 1e9);
        let level = Level {
            workers: 4,
            bandwidth_bytes_per_s: 1e9,
        };
        let plan = pipedream_plan(&states, &[level], 1e12).unwrap();
        assert_eq!(
            shape(&plan),
            vec![(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)]
        );
        assert_eq!(plan.pipeline_time_s, 1.0);
    }

    #[test]
    fn transfers_bound_the_pipeline() {
        // Activations of 4e9 bytes cost 2 * 4e9 / 1e9 = 8 s per crossing:
        // more than running everything replicated (4 s / 4 = 1 s + sync 0).
        let states = uniform(4, 1.0, 4e9, 0.0);
        let level = Level {
            workers: 4,
            bandwidth_bytes_per_s: 1e9,
        };
        let plan = pipedream_plan(&states, &[level], 1e12).unwrap();
        assert_eq!(shape(&plan), vec![(0, 4, 4)]);
    }

    #[test]
    fn memory_constraint_counts_minibatches_in_flight() {
        // Two states with heavy weights: replicating both over two GPUs
        // costs (2 + 4 * 2e9 / (1e9 * 2)) / 2 = 3 s, a 1:1 pipeline 1 s.
        // The first stage has ceil((2 - 1) / 1) = 1 minibatch in flight and
        // holds 0.5 + 1e9 bytes; replication over every worker counts none.
        let states = uniform(2, 1.0, 0.5, 1e9);
        let level = Level {
            workers: 2,
            bandwidth_bytes_per_s: 1e9,
        };
        let roomy = pipedream_plan(&states, &[level], 2e9).unwrap();
        assert_eq!(shape(&roomy), vec![(0, 1, 1), (1, 2, 1)]);
        assert_eq!(roomy.pipeline_time_s, 1.0);
        let tight = pipedream_plan(&states, &[level], 1e9).unwrap();
        assert_eq!(shape(&tight), vec![(0, 2, 2)]);
        assert_eq!(tight.pipeline_time_s, 3.0);
    }

    #[test]
    fn two_levels_compose_machine_and_gpu_splits() {
        // Two machines of two GPUs and a slow network: replicating over
        // machines costs thousands of seconds, so the model is cut once
        // between machines. Inside a machine, states of 0.5 s and 1.5 s
        // replicated over both GPUs take (2 + 4 * 2e6 / (1e12 * 2)) / 2 s, a
        // split 1.5 s.
        let states = States::from_per_state(&[0.5, 1.5, 0.5, 1.5], &[1.0; 4], &[1e6; 4], &[1.0; 4]);
        let levels = [
            Level {
                workers: 2,
                bandwidth_bytes_per_s: 1e12,
            },
            Level {
                workers: 2,
                bandwidth_bytes_per_s: 1e3,
            },
        ];
        let plan = pipedream_plan(&states, &levels, 1e12).unwrap();
        assert_eq!(shape(&plan), vec![(0, 2, 2), (2, 4, 2)]);
        // Bottom level first: both GPUs of the second machine.
        assert_eq!(plan.stages[1].placement, vec![(2, 0), (1, 1)]);
        assert!((plan.pipeline_time_s - (1.0 + 2e-6)).abs() < 1e-12);
    }

    #[test]
    fn a_plans_evaluated_time_is_the_tables() {
        // Uneven states with weights and activations: whatever plan the
        // table returns, its terms evaluated alone give the same time.
        let compute: Vec<f64> = (0..9).map(|i| 0.5 + f64::from(i % 4) * 0.3).collect();
        let act: Vec<f64> = (0..9).map(|i| 1e7 * f64::from(1 + i % 3)).collect();
        let params: Vec<f64> = (0..9).map(|i| 1e8 * f64::from(i % 5)).collect();
        let states = States::from_per_state(&compute, &act, &params, &act);
        for workers in 1..=6 {
            let level = Level {
                workers,
                bandwidth_bytes_per_s: 1e9,
            };
            let plan = pipedream_plan(&states, &[level], 2e9).unwrap();
            let stages: Vec<_> = plan
                .stages
                .iter()
                .map(|s| (s.first_state, s.end_state, s.gpus()))
                .collect();
            assert_eq!(
                one_level_time(&states, level, 2e9, &stages),
                Some(plan.pipeline_time_s)
            );
        }
    }

    #[test]
    fn replication_over_every_worker_always_fits() {
        // The code counts ceil(0 / r) = 0 minibatches in flight for a range
        // on all of a level's workers, so the whole model replicated is a
        // plan under any memory size.
        let states = uniform(2, 1.0, 10.0, 10.0);
        let level = Level {
            workers: 4,
            bandwidth_bytes_per_s: 1e9,
        };
        let plan = pipedream_plan(&states, &[level], 1.0).unwrap();
        assert_eq!(shape(&plan), vec![(0, 2, 4)]);
    }
}
