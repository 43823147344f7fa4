//! Pipeline schedules as data: the ordered action list of each stage.
//!
//! Every replica of a stage runs the same list on its slice of each
//! micro-batch. Early-backward (DAPPLE's 1F1B, sections III-B and V-C): stage
//! i runs K_i forwards, then alternates one backward and one forward until the
//! forwards run out, then the remaining backwards. GPipe runs all forwards,
//! then all backwards in reverse order. Both end with the gradient AllReduce
//! of the stage and the optimizer step.

use rustc_hash::FxHashSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::cost::WarmupPolicy;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    Forward,
    Backward,
    AllReduce,
    OptimizerStep,
}

/// One step of a stage; `micro_batch` is set for forwards and backwards only.
/// Written `F3`, `B2`, `AR`, `OPT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Action {
    pub kind: ActionKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
}

impl Action {
    pub const ALL_REDUCE: Action = Action::new(ActionKind::AllReduce, None);
    pub const OPTIMIZER_STEP: Action = Action::new(ActionKind::OptimizerStep, None);

    pub const fn new(kind: ActionKind, micro_batch: Option<u32>) -> Action {
        Action { kind, micro_batch }
    }
    pub fn forward(micro_batch: u32) -> Action {
        Action::new(ActionKind::Forward, Some(micro_batch))
    }
    pub fn backward(micro_batch: u32) -> Action {
        Action::new(ActionKind::Backward, Some(micro_batch))
    }
}

impl fmt::Display for Action {
    /// A forward or backward without a micro-batch (only possible when built
    /// by hand) shows as `F?` / `B?`, which does not parse back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let letter = match self.kind {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::AllReduce => return f.write_str("AR"),
            ActionKind::OptimizerStep => return f.write_str("OPT"),
        };
        match self.micro_batch {
            Some(m) => write!(f, "{letter}{m}"),
            None => write!(f, "{letter}?"),
        }
    }
}

impl FromStr for Action {
    type Err = Error;

    /// Only the canonical spelling: `AR`, `OPT`, or `F`/`B` followed by a
    /// micro-batch index in decimal without sign or leading zeros.
    fn from_str(s: &str) -> Result<Action> {
        let bad = || Error::invalid(format!("action {s:?} is not F<n>, B<n>, AR or OPT"));
        match s {
            "AR" => return Ok(Action::ALL_REDUCE),
            "OPT" => return Ok(Action::OPTIMIZER_STEP),
            _ => {}
        }
        let (kind, digits) = match s.split_at_checked(1) {
            Some(("F", d)) => (ActionKind::Forward, d),
            Some(("B", d)) => (ActionKind::Backward, d),
            _ => return Err(bad()),
        };
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        let m = digits.parse().ok().filter(|_| canonical).ok_or_else(bad)?;
        Ok(Action::new(kind, Some(m)))
    }
}

crate::named_enum! {
    /// How each stage orders its forwards and backwards.
    pub enum ScheduleKind("a schedule") {
        /// DAPPLE's early backward (1F1B): K_i forwards, then one backward
        /// and one forward in turn.
        EarlyBackward1F1B = "early-backward-1f1b",
        /// All forwards, then all backwards; every micro-batch is in flight at once.
        GPipe = "gpipe",
    }
}

/// One stage's early-backward list without AR and OPT: `k` forwards, then
/// one backward and one forward in turn until the forwards run out, then the
/// remaining backwards. The only place this order is written.
pub fn early_backward_actions(k: u32, micro_batches: u32) -> Vec<Action> {
    let mut actions: Vec<Action> = (0..k).map(Action::forward).collect();
    for m in 0..micro_batches {
        actions.push(Action::backward(m));
        if m + k < micro_batches {
            actions.push(Action::forward(m + k));
        }
    }
    actions
}

/// GPipe's list without AR and OPT: F0 .. F(M-1), then B(M-1) .. B0.
pub fn gpipe_actions(micro_batches: u32) -> Vec<Action> {
    (0..micro_batches)
        .map(Action::forward)
        .chain((0..micro_batches).rev().map(Action::backward))
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSchedule {
    pub stage: usize,
    pub actions: Vec<Action>,
}

impl fmt::Display for StageSchedule {
    /// `stage 0: F0 F1 B0 ... AR OPT`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage {}:", self.stage)?;
        self.actions.iter().try_for_each(|a| write!(f, " {a}"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub micro_batches: u32,
    /// `stages[i].stage == i`, first pipeline stage first.
    pub stages: Vec<StageSchedule>,
}

fn check_shape(num_stages: usize, micro_batches: u32) -> Result<()> {
    if num_stages == 0 || micro_batches == 0 {
        return Err(Error::invalid(format!(
            "a schedule needs at least one stage and one micro-batch, got {num_stages} and {micro_batches}"
        )));
    }
    check_passes(num_stages, micro_batches)
}

/// Most micro-batch passes (stages x micro-batches) one schedule may hold.
/// Simulating a schedule costs time and memory in proportion to them, and
/// the search simulates each candidate many times to choose its warm-up
/// depths. At the limit `dapple simulate` takes 0.8 s and 285 MB, and a
/// search over sizes up to it (BERT-48, 2^21 samples on 2x8) 6.5 s and
/// 190 MB (`benchmarks/README.md`). A plan above it is refused
/// (`ErrorKind::Limit`); the search and the baselines leave out the
/// micro-batch sizes that would pass it.
pub const MAX_PASSES: u64 = 1 << 18;

/// Whether `num_stages` x `micro_batches` is within [`MAX_PASSES`].
pub fn within_passes(num_stages: usize, micro_batches: u32) -> bool {
    num_stages as u64 * u64::from(micro_batches) <= MAX_PASSES
}

/// [`within_passes`], or a limit error saying what to do.
pub fn check_passes(num_stages: usize, micro_batches: u32) -> Result<()> {
    if within_passes(num_stages, micro_batches) {
        return Ok(());
    }
    Err(Error::limit(format!(
        "{num_stages} stages x {micro_batches} micro-batches is over the limit of {MAX_PASSES} \
         micro-batch passes one simulation runs (its time and memory grow with them); \
         use fewer, larger micro-batches"
    )))
}

fn finish(kind: ScheduleKind, micro_batches: u32, lists: Vec<Vec<Action>>) -> Result<Schedule> {
    let stages = lists
        .into_iter()
        .enumerate()
        .map(|(stage, mut actions)| {
            actions.extend([Action::ALL_REDUCE, Action::OPTIMIZER_STEP]);
            StageSchedule { stage, actions }
        })
        .collect();
    let schedule = Schedule {
        kind,
        micro_batches,
        stages,
    };
    schedule.validate()?;
    Ok(schedule)
}

impl Schedule {
    /// Early-backward 1F1B with warm-up depth `warmup[i]` = K_i for stage i,
    /// each in 1..=M. The result is validated, so warm-ups that deadlock
    /// (a later stage warming up deeper than an earlier one, K_i < K_{i+1} < M)
    /// are an error.
    pub fn early_backward(
        num_stages: usize,
        micro_batches: u32,
        warmup: &[u32],
    ) -> Result<Schedule> {
        check_shape(num_stages, micro_batches)?;
        if warmup.len() != num_stages {
            return Err(Error::invalid(format!(
                "{} warm-up depths given for {num_stages} stages",
                warmup.len()
            )));
        }
        let lists = warmup.iter().enumerate().map(|(stage, &k)| {
            if !(1..=micro_batches).contains(&k) {
                return Err(Error::invalid(format!(
                    "stage {stage}: warm-up depth {k} is not in 1..={micro_batches}"
                )));
            }
            Ok(early_backward_actions(k, micro_batches))
        });
        finish(
            ScheduleKind::EarlyBackward1F1B,
            micro_batches,
            lists.collect::<Result<_>>()?,
        )
    }

    /// Early-backward 1F1B with K_i = `policy.warmup(S - i, M)` of a fixed
    /// policy (A or B); `Auto` has no rule of its own and is an error here.
    pub fn early_backward_with_policy(
        num_stages: usize,
        micro_batches: u32,
        policy: WarmupPolicy,
    ) -> Result<Schedule> {
        let warmup: Vec<u32> = (0..num_stages)
            .map(|i| policy.warmup((num_stages - i) as u32, micro_batches))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                Error::invalid("warm-up policy auto has no fixed K_i: give each stage's depth")
            })?;
        Schedule::early_backward(num_stages, micro_batches, &warmup)
    }

    /// GPipe: F0 .. F(M-1), then B(M-1) .. B0, on every stage.
    pub fn gpipe(num_stages: usize, micro_batches: u32) -> Result<Schedule> {
        check_shape(num_stages, micro_batches)?;
        let one = gpipe_actions(micro_batches);
        finish(ScheduleKind::GPipe, micro_batches, vec![one; num_stages])
    }

    /// Largest number of micro-batches whose forward is done and backward not
    /// yet done on `stage` (its activations in memory). Panics if `stage` is
    /// out of range.
    pub fn peak_in_flight(&self, stage: usize) -> u32 {
        let (mut now, mut peak) = (0u32, 0u32);
        for a in &self.stages[stage].actions {
            match a.kind {
                ActionKind::Forward => now += 1,
                ActionKind::Backward => now = now.saturating_sub(1),
                _ => {}
            }
            peak = peak.max(now);
        }
        peak
    }

    /// Checks each stage's list on its own (every F and B of 0..M exactly
    /// once, B_m after F_m, one AR after the last backward, OPT last), then
    /// runs all stages together with unit durations to prove the schedule
    /// cannot deadlock under pipeline dependencies.
    pub fn validate(&self) -> Result<()> {
        check_shape(self.stages.len(), self.micro_batches)?;
        for (i, s) in self.stages.iter().enumerate() {
            if s.stage != i {
                return Err(Error::invalid(format!(
                    "stage {i} is labelled stage {}",
                    s.stage
                )));
            }
            self.validate_stage(s)
                .map_err(|msg| Error::invalid(format!("stage {i}: {msg}")))?;
        }
        self.simulate()
    }

    fn validate_stage(&self, s: &StageSchedule) -> std::result::Result<(), String> {
        let m_count = self.micro_batches as usize;
        let (mut fwd, mut bwd) = (vec![None; m_count], vec![None; m_count]);
        let (mut ar, mut opt) = (None, None);
        for (i, a) in s.actions.iter().enumerate() {
            let at = |what: &str| format!("action {i} ({a}) {what}");
            if let Some(j) = opt {
                return Err(at(&format!("comes after OPT (action {j})")));
            }
            let slot = match (a.kind, a.micro_batch) {
                (ActionKind::Forward | ActionKind::Backward, None) => {
                    return Err(at("has no micro-batch"))
                }
                (ActionKind::AllReduce | ActionKind::OptimizerStep, Some(_)) => {
                    return Err(at("must not have a micro-batch"))
                }
                (_, Some(m)) if m >= self.micro_batches => {
                    return Err(at(&format!("is out of range 0..{}", self.micro_batches)))
                }
                (ActionKind::Forward, Some(m)) => &mut fwd[m as usize],
                (ActionKind::Backward, Some(m)) => {
                    if fwd[m as usize].is_none() {
                        return Err(at(&format!("comes before F{m}")));
                    }
                    if let Some(j) = ar {
                        return Err(format!("action {j} (AR) comes before B{m}"));
                    }
                    &mut bwd[m as usize]
                }
                (ActionKind::AllReduce, None) => &mut ar,
                (ActionKind::OptimizerStep, None) => &mut opt,
            };
            if let Some(j) = *slot {
                return Err(at(&format!("duplicates action {j}")));
            }
            *slot = Some(i);
        }
        let missing = |letter: &str, v: &[Option<usize>]| {
            v.iter()
                .position(Option::is_none)
                .map(|m| format!("{letter}{m} is missing"))
        };
        if let Some(msg) = missing("F", &fwd).or_else(|| missing("B", &bwd)) {
            return Err(msg);
        }
        match (ar, opt) {
            (None, _) => Err("AR is missing".into()),
            (_, None) => Err("OPT is missing".into()),
            _ => Ok(()),
        }
    }

    /// Lock-step simulation: in each unit of time every stage whose next
    /// action has its input from the neighbouring stage runs it. Assumes each
    /// stage passed validate_stage.
    fn simulate(&self) -> Result<()> {
        let n = self.stages.len();
        let mut next = vec![0usize; n];
        let mut done: FxHashSet<(usize, Action)> = FxHashSet::default();
        loop {
            let (mut ran, mut stuck) = (Vec::new(), Vec::new());
            for (s, st) in self.stages.iter().enumerate() {
                let Some(&a) = st.actions.get(next[s]) else {
                    continue;
                };
                // F_m needs F_m on the stage before, B_m needs B_m on the stage after.
                let from = match a.kind {
                    ActionKind::Forward if s > 0 => Some(s - 1),
                    ActionKind::Backward if s + 1 < n => Some(s + 1),
                    _ => None,
                };
                match from {
                    Some(o) if !done.contains(&(o, a)) => stuck.push(format!(
                        "stage {s} waits at action {} ({a}) for {a} on stage {o}",
                        next[s]
                    )),
                    _ => ran.push((s, a)),
                }
            }
            if ran.is_empty() {
                if stuck.is_empty() {
                    return Ok(());
                }
                return Err(Error::invalid(format!("deadlock: {}", stuck.join("; "))));
            }
            for (s, a) in ran {
                next[s] += 1;
                done.insert((s, a));
            }
        }
    }
}

impl fmt::Display for Schedule {
    /// One line per stage, `stage 0: F0 F1 B0 ... AR OPT`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Non-empty lines of a literal table, trimmed.
    fn lines(text: &str) -> Vec<&str> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// A schedule from a table in Display form, not validated.
    fn table(m: u32, text: &str) -> Schedule {
        let stages = lines(text).into_iter().enumerate().map(|(stage, line)| {
            let rest = line.strip_prefix(&format!("stage {stage}:")).unwrap();
            let actions = rest
                .split_whitespace()
                .map(|t| t.parse().unwrap())
                .collect();
            StageSchedule { stage, actions }
        });
        let (kind, stages) = (ScheduleKind::EarlyBackward1F1B, stages.collect());
        Schedule {
            kind,
            micro_batches: m,
            stages,
        }
    }

    fn check(s: Result<Schedule>, kind: ScheduleKind, text: &str) {
        let s = s.unwrap();
        assert_eq!(s.kind, kind);
        assert_eq!(s.stages, table(s.micro_batches, text).stages, "\n{s}");
        assert_eq!(s.to_string(), lines(text).join("\n"));
    }

    fn rejects(m: u32, text: &str, expected: &str) {
        let err = table(m, text).validate().unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::InvalidInput);
        assert_eq!(err.message, expected);
    }

    const EB: ScheduleKind = ScheduleKind::EarlyBackward1F1B;

    #[test]
    #[rustfmt::skip]
    fn literal_schedules() {
        check(Schedule::early_backward(2, 4, &[2, 1]), EB, "
            stage 0: F0 F1 B0 F2 B1 F3 B2 B3 AR OPT
            stage 1: F0 B0 F1 B1 F2 B2 F3 B3 AR OPT");
        // Policy A: K = [3, 2, 1].
        check(Schedule::early_backward_with_policy(3, 5, WarmupPolicy::A), EB, "
            stage 0: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 AR OPT
            stage 1: F0 F1 B0 F2 B1 F3 B2 F4 B3 B4 AR OPT
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 AR OPT");
        // Policy B: K = min(2(S - i) - 1, M) = [5, 3, 1]; stage 0 runs all
        // forwards first like GPipe, but backwards in forward order.
        check(Schedule::early_backward_with_policy(3, 5, WarmupPolicy::B), EB, "
            stage 0: F0 F1 F2 F3 F4 B0 B1 B2 B3 B4 AR OPT
            stage 1: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 AR OPT
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 AR OPT");
        check(Schedule::gpipe(2, 3), ScheduleKind::GPipe, "
            stage 0: F0 F1 F2 B2 B1 B0 AR OPT
            stage 1: F0 F1 F2 B2 B1 B0 AR OPT");
    }

    #[test]
    fn action_and_kind_round_trip() {
        for a in &Schedule::gpipe(1, 12).unwrap().stages[0].actions {
            assert_eq!(a.to_string().parse::<Action>().unwrap(), *a);
        }
        assert_eq!("F3".parse::<Action>().unwrap(), Action::forward(3));
        assert_eq!(Action::backward(2).to_string(), "B2");
        for bad in [
            "", "F", "B-1", "F+3", "F03", "f3", "AR0", "OPT1", "X2", "F3 ",
        ] {
            let err = bad.parse::<Action>().unwrap_err();
            assert!(err.message.contains(&format!("{bad:?}")), "{}", err.message);
        }
        for k in [ScheduleKind::EarlyBackward1F1B, ScheduleKind::GPipe] {
            assert_eq!(k.name().parse::<ScheduleKind>().unwrap(), k);
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        let s = Schedule::early_backward(2, 2, &[2, 1]).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
    }

    #[test]
    fn generated_schedules_validate_with_peak_k_or_m() {
        for n in 1..=6 {
            for m in 1..=8 {
                for p in [WarmupPolicy::A, WarmupPolicy::B] {
                    let s = Schedule::early_backward_with_policy(n, m, p).unwrap();
                    for i in 0..n {
                        assert_eq!(Some(s.peak_in_flight(i)), p.warmup((n - i) as u32, m));
                    }
                }
                let g = Schedule::gpipe(n, m).unwrap();
                assert!((0..n).all(|i| g.peak_in_flight(i) == m));
            }
        }
        // Policy B capped at M: uncapped [7, 5, 3, 1].
        let s = Schedule::early_backward_with_policy(4, 5, WarmupPolicy::B).unwrap();
        assert_eq!(
            (0..4).map(|i| s.peak_in_flight(i)).collect::<Vec<_>>(),
            [5, 5, 3, 1]
        );
        assert_eq!(
            Schedule::early_backward(2, 4, &[2, 1])
                .unwrap()
                .peak_in_flight(0),
            2
        );
    }

    #[test]
    #[rustfmt::skip]
    fn validate_rejects_bad_stage_lists() {
        let ok = "stage 0: F0 B0 F1 B1 AR OPT";
        rejects(2, &format!("{ok}\nstage 1: F0 B0 AR OPT"), "stage 1: F1 is missing");
        for (m, text, expected) in [
            (2, "stage 0: F0 B0 F1 AR OPT",        "stage 0: B1 is missing"),
            (2, "stage 0: F0 F1 B0 B1 B1 AR OPT",  "stage 0: action 4 (B1) duplicates action 3"),
            (3, "stage 0: F0 F1 B0 B2 F2 B1 AR OPT", "stage 0: action 3 (B2) comes before F2"),
            (2, "stage 0: F0 B0 F1 AR B1 OPT",     "stage 0: action 3 (AR) comes before B1"),
            (2, "stage 0: F0 B0 F1 B1 AR AR OPT",  "stage 0: action 5 (AR) duplicates action 4"),
            (2, "stage 0: F0 B0 F1 B1 OPT AR",     "stage 0: action 5 (AR) comes after OPT (action 4)"),
            (2, "stage 0: F0 B0 F1 B1 AR",         "stage 0: OPT is missing"),
            (2, "stage 0: F0 B0 F2 B1 AR OPT",     "stage 0: action 2 (F2) is out of range 0..2"),
        ] {
            rejects(m, text, expected);
        }
        let mut s = table(1, "stage 0: F0 B0 AR OPT");
        s.stages[0].actions[1].micro_batch = None;
        assert_eq!(s.validate().unwrap_err().message, "stage 0: action 1 (B?) has no micro-batch");
    }

    #[test]
    #[rustfmt::skip]
    fn validate_rejects_cross_stage_deadlock() {
        // Each list is fine alone: stage 0 wants B0 before F1, stage 1 wants F1 before B0.
        rejects(2, "
            stage 0: F0 B0 F1 B1 AR OPT
            stage 1: F0 F1 B0 B1 AR OPT",
            "deadlock: stage 0 waits at action 1 (B0) for B0 on stage 1; \
             stage 1 waits at action 1 (F1) for F1 on stage 0");
        // The generator validates: a later stage warming up deeper deadlocks.
        let err = Schedule::early_backward(3, 4, &[1, 2, 1]).unwrap_err();
        assert!(err.message.starts_with("deadlock: stage 0 waits at action 1 (B0)"), "{}", err.message);
        assert!(Schedule::early_backward(2, 4, &[2, 5]).is_err());
        assert!(Schedule::early_backward(2, 4, &[2]).is_err());
        assert!(Schedule::gpipe(0, 4).is_err());
    }
}
