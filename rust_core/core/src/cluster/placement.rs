//! Device placement: which GPUs a new stage gets, by the paper's three
//! policies (section IV-B), on a symmetry-reduced view of the cluster.
//!
//! Machines of one group are interchangeable, so the search never asks
//! *which* machine but only *what kind*: a machine is described by its group,
//! its size, how many GPUs are taken and how many of those belong to the
//! neighbouring stage (the one a new stage will talk to). Machines alike in
//! all four form one class, kept once with its machine count, and the sorted
//! classes are one canonical state for all symmetric placements. A state's
//! size is its number of classes, not of machines: in the machine-aligned
//! space that is a handful whether the cluster has 4 machines or 2,048, so
//! placing, hashing and costing a stage do not grow with the cluster.

/// One machine as the placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MachineUse {
    pub group: u16,
    pub capacity: u16,
    pub used: u16,
    /// GPUs of this machine that the most recently placed stage holds.
    pub adjacent: u16,
}

/// Hashed as one word: states are hashed for every stage the search
/// places, and four separate fields cost four rounds.
impl std::hash::Hash for MachineUse {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let word = u64::from(self.group) << 48
            | u64::from(self.capacity) << 32
            | u64::from(self.used) << 16
            | u64::from(self.adjacent);
        state.write_u64(word);
    }
}

impl MachineUse {
    pub fn free(&self) -> u16 {
        self.capacity - self.used
    }

    /// Holds some stage and still has free GPUs.
    pub fn partly_used(&self) -> bool {
        self.used > 0 && self.free() > 0
    }
}

crate::named_enum! {
    /// The paper's three placement policies (section IV-B).
    pub enum Policy("a placement policy") {
        /// Take whole fresh machines first: keeps a stage's AllReduce on NVLink.
        FreshFirst = "fresh-first",
        /// Fill machines that already hold stages first: less fragmentation,
        /// and the neighbouring stage is likely on the same machine.
        AppendFirst = "append-first",
        /// Spread evenly over the machines in use (all machines when none is):
        /// activations stay local, AllReduce crosses machines.
        ScatterFirst = "scatter-first",
    }
}

/// Where a stage goes: one of the paper's policies, and on a cluster of
/// several machine groups (mixed GPUs), optionally the group whose machines
/// it takes first. The search thus places stages on GPU types knowing
/// their speed and memory (Whale section 3.3.2); on one group it is the
/// policy alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    pub policy: Policy,
    pub group: Option<u16>,
}

impl Placement {
    pub const fn of(policy: Policy) -> Placement {
        Placement {
            policy,
            group: None,
        }
    }
}

/// Part of a placement: `gpus` GPUs on each of `machines` machines of the
/// state's class `class`. Takes of one class use its machines front to
/// back, in the order the placement lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Take {
    pub class: usize,
    pub gpus: u32,
    pub machines: u32,
}

/// A placement policy's choice of GPUs for one stage: the policy, and the
/// takes that give the GPUs.
pub type PlacedTakes = (Placement, Vec<Take>);

/// Canonical cluster state: classes of alike machines sorted by (group,
/// capacity, used, adjacent), each with its machine count (at least one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State(pub Vec<(MachineUse, u32)>);

/// Merge sorted runs of equal machines into classes (`pieces` sorted by
/// machine, stably): counts add, and `join` merges what rides along.
fn merge_runs<T>(
    pieces: Vec<(MachineUse, T)>,
    mut join: impl FnMut(&mut T, T),
) -> Vec<(MachineUse, T)> {
    let mut out: Vec<(MachineUse, T)> = Vec::with_capacity(pieces.len());
    for (m, x) in pieces {
        match out.last_mut() {
            Some((last, acc)) if *last == m => join(acc, x),
            _ => out.push((m, x)),
        }
    }
    out
}

impl State {
    /// All machines free. `machines[i] = (group, gpus)` in device-id order,
    /// groups contiguous and ascending.
    pub fn empty(machines: &[(usize, u32)]) -> State {
        State::with_machines(machines).0
    }

    /// [`State::empty`], and the machine ids of each class in position order.
    pub fn with_machines(machines: &[(usize, u32)]) -> (State, Vec<Vec<usize>>) {
        let mut pieces: Vec<(MachineUse, Vec<usize>)> = machines
            .iter()
            .enumerate()
            .map(|(id, &(g, n))| {
                let m = MachineUse {
                    group: g as u16,
                    capacity: n as u16,
                    used: 0,
                    adjacent: 0,
                };
                (m, vec![id])
            })
            .collect();
        pieces.sort_by_key(|p| p.0);
        let merged = merge_runs(pieces, |acc, ids| acc.extend(ids));
        let state = State(
            merged
                .iter()
                .map(|(m, ids)| (*m, ids.len() as u32))
                .collect(),
        );
        (state, merged.into_iter().map(|(_, ids)| ids).collect())
    }

    pub fn free(&self) -> u32 {
        self.0
            .iter()
            .map(|(m, count)| u32::from(m.free()) * count)
            .sum()
    }

    /// Machines that hold some GPUs but still have free ones.
    pub fn partly_used_machines(&self) -> u32 {
        self.0
            .iter()
            .filter(|(m, _)| m.partly_used())
            .map(|(_, count)| count)
            .sum()
    }

    /// The machines after a stage takes `takes`, as pieces (machine after,
    /// class before, machines) in the old positions' order: a class's taken
    /// machines in the order of its takes, then its untaken ones.
    fn pieces(&self, takes: &[Take]) -> Vec<(MachineUse, usize, u32)> {
        let mut out = Vec::with_capacity(self.0.len() + takes.len());
        for (c, &(m, count)) in self.0.iter().enumerate() {
            let mut taken = 0;
            for t in takes.iter().filter(|t| t.class == c) {
                let after = MachineUse {
                    used: m.used + t.gpus as u16,
                    adjacent: t.gpus as u16,
                    ..m
                };
                out.push((after, c, t.machines));
                taken += t.machines;
            }
            debug_assert!(
                taken <= count,
                "a placement took more machines than its class has"
            );
            if taken < count {
                out.push((MachineUse { adjacent: 0, ..m }, c, count - taken));
            }
        }
        out
    }

    /// The canonical state after a stage takes `takes`.
    pub fn taken(&self, takes: &[Take]) -> State {
        let mut pieces: Vec<(MachineUse, u32)> = self
            .pieces(takes)
            .into_iter()
            .map(|(m, _, n)| (m, n))
            .collect();
        pieces.sort_unstable_by_key(|p| p.0);
        State(merge_runs(pieces, |acc, n| *acc += n))
    }

    /// [`State::taken`], following concrete machines: `ids[c]` lists the
    /// machines of class c in position order. Returns the new state, its
    /// classes' machines, and the machines each take got.
    pub fn take_machines(
        &self,
        ids: &[Vec<usize>],
        takes: &[Take],
    ) -> (State, Vec<Vec<usize>>, Vec<Vec<usize>>) {
        let mut cursor = vec![0usize; self.0.len()];
        let mut given: Vec<Vec<usize>> = Vec::with_capacity(takes.len());
        for t in takes {
            let from = cursor[t.class];
            cursor[t.class] += t.machines as usize;
            given.push(ids[t.class][from..cursor[t.class]].to_vec());
        }
        let mut cursor = vec![0usize; self.0.len()];
        let mut pieces: Vec<(MachineUse, Vec<usize>)> = self
            .pieces(takes)
            .into_iter()
            .map(|(m, c, n)| {
                let from = cursor[c];
                cursor[c] += n as usize;
                (m, ids[c][from..cursor[c]].to_vec())
            })
            .collect();
        // Stable: alike machines keep their old positions' order.
        pieces.sort_by_key(|p| p.0);
        let merged = merge_runs(pieces, |acc, more| acc.extend(more));
        let state = State(merged.iter().map(|(m, v)| (*m, v.len() as u32)).collect());
        (state, merged.into_iter().map(|(_, v)| v).collect(), given)
    }

    /// Where the neighbouring stage is `w` whole machines of one class and
    /// nothing else: (this state with those machines no longer marked
    /// adjacent, their class, w). Two such states equal but for w differ
    /// only in the next transfer, which is no slower with more machines
    /// receiving (`dp.rs` uses it to compare suffixes across them).
    pub fn adjacent_whole_machines(&self) -> Option<(State, MachineUse, u32)> {
        let mut adjacent = self.0.iter().filter(|(m, _)| m.adjacent > 0);
        let &(class, w) = adjacent.next()?;
        if adjacent.next().is_some()
            || class.used != class.capacity
            || class.adjacent != class.capacity
        {
            return None;
        }
        let mut pieces: Vec<(MachineUse, u32)> = self
            .0
            .iter()
            .map(|&(m, n)| {
                if m == class {
                    (MachineUse { adjacent: 0, ..m }, n)
                } else {
                    (m, n)
                }
            })
            .collect();
        pieces.sort_by_key(|p| p.0);
        Some((State(merge_runs(pieces, |acc, n| *acc += n)), class, w))
    }

    /// Where `placement` puts a stage of `want` GPUs; None when fewer than
    /// `want` GPUs are free (in its group, for a group's scatter).
    pub fn place(&self, want: u32, placement: Placement) -> Option<Vec<Take>> {
        if want == 0 || want > self.free() {
            return None;
        }
        let (mut fresh, mut partial) = self.fresh_and_partly_used(placement);
        let mut takes: Vec<Take> = Vec::new();
        let mut left = want;
        match placement.policy {
            Policy::FreshFirst => {
                self.fill(&fresh, &mut takes, &mut left);
                self.fill(&partial, &mut takes, &mut left);
            }
            Policy::AppendFirst => {
                self.fill(&partial, &mut takes, &mut left);
                self.fill(&fresh, &mut takes, &mut left);
            }
            Policy::ScatterFirst => {
                // A group's scatter stays inside the group.
                if let Some(g) = placement.group {
                    fresh.retain(|&c| self.0[c].0.group == g);
                    partial.retain(|&c| self.0[c].0.group == g);
                }
                let partial_free: u32 = partial.iter().map(|&c| self.class_free(c)).sum();
                let mut spread: Vec<usize> = partial.clone();
                if partial.is_empty() || partial_free < want {
                    spread.extend(&fresh);
                }
                left = self.scatter(&spread, want, &mut takes)?;
            }
        }
        (left == 0).then_some(takes)
    }

    /// The classes of fresh machines and of partly used ones, in the order
    /// `placement` fills them: a preferred group's machines first, keeping
    /// the order within each part; partly used machines next to the
    /// neighbouring stage first, then the fullest.
    fn fresh_and_partly_used(&self, placement: Placement) -> (Vec<usize>, Vec<usize>) {
        let classes = &self.0;
        let free = |c: usize| u32::from(classes[c].0.free());
        let preferred = |c: &usize| placement.group.is_some_and(|g| classes[*c].0.group != g);
        let mut fresh: Vec<usize> = (0..classes.len())
            .filter(|&c| classes[c].0.used == 0)
            .collect();
        fresh.sort_by_key(preferred);
        let mut partial: Vec<usize> = (0..classes.len())
            .filter(|&c| classes[c].0.partly_used())
            .collect();
        partial.sort_by_key(|&c| {
            (
                preferred(&c),
                std::cmp::Reverse(classes[c].0.adjacent),
                free(c),
                c,
            )
        });
        (fresh, partial)
    }

    /// Free GPUs of every machine of class `c`.
    fn class_free(&self, c: usize) -> u32 {
        u32::from(self.0[c].0.free()) * self.0[c].1
    }

    /// Each machine of the classes in `order` in turn takes what it has
    /// free, until `left` GPUs are no longer wanted.
    fn fill(&self, order: &[usize], takes: &mut Vec<Take>, left: &mut u32) {
        for &c in order {
            if *left == 0 {
                break;
            }
            let (free, count) = (u32::from(self.0[c].0.free()), self.0[c].1);
            let whole = (*left / free).min(count);
            if whole > 0 {
                takes.push(Take {
                    class: c,
                    gpus: free,
                    machines: whole,
                });
                *left -= whole * free;
            }
            if whole < count && *left > 0 {
                takes.push(Take {
                    class: c,
                    gpus: *left,
                    machines: 1,
                });
                *left = 0;
            }
        }
    }

    /// Scatter `want` GPUs one at a time, round robin over the machines of
    /// the classes in `spread`, in order, so the stage is even over the
    /// machines it touches: after t whole rounds each machine has
    /// min(free, t), and the last round's GPUs go to the first machines
    /// with room. Returns the GPUs still wanted after every machine of
    /// `spread` was used up; None when they cannot hold `want`.
    fn scatter(&self, spread: &[usize], want: u32, takes: &mut Vec<Take>) -> Option<u32> {
        let free = |c: usize| u32::from(self.0[c].0.free());
        let count = |c: usize| self.0[c].1;
        let level = |t: u32| -> u32 { spread.iter().map(|&c| free(c).min(t) * count(c)).sum() };
        let most = spread.iter().map(|&c| free(c)).max().unwrap_or(0);
        if level(most) < want {
            return None;
        }
        // The most whole rounds that do not pass `want`.
        let (mut lo, mut hi) = (0u32, most);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if level(mid) <= want {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let rounds = lo;
        let mut extra = want - level(rounds);
        for &c in spread {
            if free(c) > rounds {
                let plus = extra.min(count(c));
                extra -= plus;
                for (gpus, machines) in [(rounds + 1, plus), (rounds, count(c) - plus)] {
                    if gpus > 0 && machines > 0 {
                        takes.push(Take {
                            class: c,
                            gpus,
                            machines,
                        });
                    }
                }
            } else {
                takes.push(Take {
                    class: c,
                    gpus: free(c),
                    machines: count(c),
                });
            }
        }
        Some(extra)
    }

    /// Distinct placements of `want` GPUs over all policies, each with the
    /// first placement that produced it: the policies alone, then, where
    /// the machines are of several groups, each policy preferring each
    /// group.
    pub fn placements(&self, want: u32) -> Vec<PlacedTakes> {
        let mut groups: Vec<u16> = self.0.iter().map(|(m, _)| m.group).collect();
        groups.dedup(); // sorted: the state is ordered by group
        let preferences = std::iter::once(None).chain(
            groups
                .iter()
                .copied()
                .map(Some)
                .filter(|_| groups.len() > 1),
        );
        let mut out: Vec<PlacedTakes> = Vec::with_capacity(3);
        // Takes that differ only in order place the same GPUs.
        let mut seen: Vec<Vec<Take>> = Vec::with_capacity(3);
        for group in preferences {
            for policy in Policy::ALL {
                let placement = Placement { policy, group };
                if let Some(takes) = self.place(want, placement) {
                    let mut sorted = takes.clone();
                    sorted.sort_unstable();
                    if !seen.contains(&sorted) {
                        seen.push(sorted);
                        out.push((placement, takes));
                    }
                }
            }
        }
        out
    }

    /// Placements of the machine-aligned search space: `want` whole fresh
    /// machines (fresh-first), or a divisor of a machine's GPUs inside one
    /// machine, either a partly used one (append-first) or a fresh one
    /// (fresh-first) as long as at most `max_partial` machines end up partly
    /// used. This keeps the number of distinct states small on big clusters.
    pub fn aligned_placements(&self, want: u32, max_partial: u32) -> Vec<PlacedTakes> {
        let classes = &self.0;
        let per_machine = classes
            .iter()
            .map(|(m, _)| u32::from(m.capacity))
            .max()
            .unwrap_or(1);
        let mut out = Vec::new();
        if want.is_multiple_of(per_machine) {
            let mut need = want / per_machine;
            let mut takes = Vec::new();
            for (c, &(m, count)) in classes.iter().enumerate() {
                if need > 0 && m.used == 0 && u32::from(m.capacity) == per_machine {
                    let machines = need.min(count);
                    takes.push(Take {
                        class: c,
                        gpus: per_machine,
                        machines,
                    });
                    need -= machines;
                }
            }
            if need == 0 {
                out.push((Placement::of(Policy::FreshFirst), takes));
            }
            return out;
        }
        if per_machine % want != 0 {
            return out;
        }
        let one = |class: usize| {
            vec![Take {
                class,
                gpus: want,
                machines: 1,
            }]
        };
        // Append: the partly used machine next to the neighbouring stage,
        // else the fullest one that still has room.
        if let Some(c) = (0..classes.len())
            .filter(|&c| classes[c].0.partly_used() && u32::from(classes[c].0.free()) >= want)
            .min_by_key(|&c| {
                (
                    std::cmp::Reverse(classes[c].0.adjacent),
                    classes[c].0.free(),
                    c,
                )
            })
        {
            out.push((Placement::of(Policy::AppendFirst), one(c)));
        }
        if self.partly_used_machines() < max_partial {
            if let Some(c) = classes
                .iter()
                .position(|(m, _)| m.used == 0 && u32::from(m.capacity) >= want)
            {
                out.push((Placement::of(Policy::FreshFirst), one(c)));
            }
        }
        out
    }
}

impl State {
    /// The machine-aligned space's scatter: `want` GPUs spread evenly over
    /// every partly used machine, or over every fresh machine when none is
    /// partly used, the same number on each. Stages spread so share every
    /// machine, so activations move over NVLink; the machines stay alike,
    /// so the state stays small however many there are.
    pub fn even_scatter(&self, want: u32) -> Option<Vec<Take>> {
        let spread: Vec<usize> = if self.0.iter().any(|(m, _)| m.partly_used()) {
            (0..self.0.len())
                .filter(|&c| self.0[c].0.partly_used())
                .collect()
        } else {
            (0..self.0.len())
                .filter(|&c| self.0[c].0.used == 0)
                .collect()
        };
        let machines: u32 = spread.iter().map(|&c| self.0[c].1).sum();
        if machines < 2 || want == 0 || !want.is_multiple_of(machines) {
            return None;
        }
        let gpus = want / machines;
        spread
            .iter()
            .map(|&c| {
                (u32::from(self.0[c].0.free()) >= gpus).then_some(Take {
                    class: c,
                    gpus,
                    machines: self.0[c].1,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_by_eight() -> State {
        State::empty(&[(0, 8), (0, 8)])
    }

    /// GPUs per machine, classes in order and each class's machines front
    /// to back, as the paper's policies are usually drawn.
    fn per_position(state: &State, takes: &[Take]) -> Vec<u32> {
        let mut out = Vec::new();
        for (c, &(_, count)) in state.0.iter().enumerate() {
            let mut class: Vec<u32> = takes
                .iter()
                .filter(|t| t.class == c)
                .flat_map(|t| std::iter::repeat_n(t.gpus, t.machines as usize))
                .collect();
            class.resize(count as usize, 0);
            out.extend(class);
        }
        out
    }

    /// The takes that give `counts` per machine (classes in order), for
    /// counts that, within a class, do not grow front to back (takes use a
    /// class's machines from the front).
    fn takes_of(state: &State, counts: &[u32]) -> Vec<Take> {
        let mut takes: Vec<Take> = Vec::new();
        let mut p = 0;
        for (c, &(_, count)) in state.0.iter().enumerate() {
            for &gpus in &counts[p..p + count as usize] {
                match takes.last_mut() {
                    Some(t) if t.class == c && t.gpus == gpus => t.machines += 1,
                    _ => takes.push(Take {
                        class: c,
                        gpus,
                        machines: 1,
                    }),
                }
            }
            p += count as usize;
        }
        takes.retain(|t| t.gpus > 0);
        takes
    }

    fn place(s: &State, want: u32, policy: Policy) -> Option<Vec<u32>> {
        s.place(want, Placement::of(policy))
            .map(|t| per_position(s, &t))
    }

    /// The placement as it was written per machine before states counted
    /// alike machines once (commit fc762ec): the reference the counted
    /// form must agree with.
    fn place_per_machine(
        machines: &[MachineUse],
        want: u32,
        placement: Placement,
    ) -> Option<Vec<u32>> {
        let total: u32 = machines.iter().map(|m| u32::from(m.free())).sum();
        if want == 0 || want > total {
            return None;
        }
        // A group's machines first, keeping the order within each part.
        let preferred = |p: &usize| placement.group.is_some_and(|g| machines[*p].group != g);
        let mut fresh: Vec<usize> = (0..machines.len())
            .filter(|&p| machines[p].used == 0)
            .collect();
        fresh.sort_by_key(preferred);
        let mut partial: Vec<usize> = (0..machines.len())
            .filter(|&p| machines[p].used > 0 && machines[p].free() > 0)
            .collect();
        // Next to the neighbouring stage first, then the fullest machine.
        partial.sort_by_key(|&p| {
            (
                preferred(&p),
                std::cmp::Reverse(machines[p].adjacent),
                machines[p].free(),
                p,
            )
        });
        let mut counts = vec![0u32; machines.len()];
        let mut left = want;
        let fill = |order: &[usize], counts: &mut Vec<u32>, left: &mut u32| {
            for &p in order {
                let take = u32::from(machines[p].free())
                    .saturating_sub(counts[p])
                    .min(*left);
                counts[p] += take;
                *left -= take;
            }
        };
        match placement.policy {
            Policy::FreshFirst => {
                fill(&fresh, &mut counts, &mut left);
                fill(&partial, &mut counts, &mut left);
            }
            Policy::AppendFirst => {
                fill(&partial, &mut counts, &mut left);
                fill(&fresh, &mut counts, &mut left);
            }
            Policy::ScatterFirst => {
                // A group's scatter stays inside the group.
                if let Some(g) = placement.group {
                    fresh.retain(|&p| machines[p].group == g);
                    partial.retain(|&p| machines[p].group == g);
                }
                let partial_free: u32 =
                    partial.iter().map(|&p| u32::from(machines[p].free())).sum();
                let mut spread: Vec<usize> = partial.clone();
                if partial.is_empty() || partial_free < want {
                    spread.extend(&fresh);
                }
                // One GPU at a time, round robin, so the stage is even over
                // the machines it touches.
                while left > 0 {
                    let mut progressed = false;
                    for &p in &spread {
                        if left > 0 && counts[p] < u32::from(machines[p].free()) {
                            counts[p] += 1;
                            left -= 1;
                            progressed = true;
                        }
                    }
                    if !progressed {
                        break;
                    }
                }
            }
        }
        (left == 0).then_some(counts)
    }

    #[test]
    fn counted_placements_match_the_per_machine_ones() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(11);
        let mut checked = 0;
        for _ in 0..300 {
            // Up to 6 machines of up to 2 groups, group sizes 1, 2, 4 or 8.
            let mut machines: Vec<(usize, u32)> = Vec::new();
            for group in 0..rng.gen_range(1..=2usize) {
                let gpus = [1, 2, 4, 8][rng.gen_range(0..4)];
                for _ in 0..rng.gen_range(1..=3) {
                    machines.push((group, gpus));
                }
            }
            let mut state = State::empty(&machines);
            for _ in 0..rng.gen_range(0..4) {
                // Each class's machines front to back, as positions.
                let expanded: Vec<MachineUse> = state
                    .0
                    .iter()
                    .flat_map(|&(m, n)| std::iter::repeat_n(m, n as usize))
                    .collect();
                for want in 1..=state.free() {
                    for placement in state
                        .placements(want)
                        .into_iter()
                        .map(|(p, _)| p)
                        .chain(Policy::ALL.into_iter().map(Placement::of))
                    {
                        let counted = state
                            .place(want, placement)
                            .map(|t| per_position(&state, &t));
                        let reference = place_per_machine(&expanded, want, placement);
                        assert_eq!(counted, reference, "{state:?} want {want} {placement:?}");
                        checked += 1;
                    }
                }
                let free = state.free();
                if free == 0 {
                    break;
                }
                let want = rng.gen_range(1..=free);
                let options = state.placements(want);
                let (_, takes) = &options[rng.gen_range(0..options.len())];
                state = state.taken(takes);
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    #[test]
    fn fresh_first_takes_whole_machines() {
        let s = two_by_eight();
        assert_eq!(place(&s, 8, Policy::FreshFirst), Some(vec![8, 0]));
        assert_eq!(place(&s, 10, Policy::FreshFirst), Some(vec![8, 2]));
        let s2 = s.taken(&takes_of(&s, &[3, 0]));
        // The partly used machine sorts last; a fresh one is first.
        assert_eq!(s2.0[1].0.used, 3);
        assert_eq!(place(&s2, 6, Policy::FreshFirst), Some(vec![6, 0]));
        assert_eq!(place(&s2, 6, Policy::AppendFirst), Some(vec![1, 5]));
    }

    #[test]
    fn scatter_first_spreads_evenly() {
        let s = two_by_eight();
        assert_eq!(place(&s, 8, Policy::ScatterFirst), Some(vec![4, 4]));
        assert_eq!(place(&s, 3, Policy::ScatterFirst), Some(vec![2, 1]));
        let s2 = s.taken(&takes_of(&s, &[4, 4]));
        assert_eq!(place(&s2, 8, Policy::ScatterFirst), Some(vec![4, 4]));
        // Five machines of 4 GPUs, one with 1 taken (it sorts after the
        // four fresh ones): 11 GPUs go round robin, the machine in use
        // first, so it gets the GPU of the last, partial round.
        let s = State::empty(&[(0, 4); 5]);
        let s3 = s.taken(&takes_of(&s, &[1, 0, 0, 0, 0]));
        assert_eq!(
            place(&s3, 11, Policy::ScatterFirst),
            Some(vec![2, 2, 2, 2, 3])
        );
    }

    #[test]
    fn asking_for_too_much_gives_none() {
        let s = two_by_eight();
        assert_eq!(s.place(17, Placement::of(Policy::FreshFirst)), None);
        assert_eq!(s.place(0, Placement::of(Policy::FreshFirst)), None);
    }

    #[test]
    fn placements_are_deduplicated() {
        let s = State::empty(&[(0, 1); 4]);
        // On single-GPU machines every policy gives the same result.
        assert_eq!(s.placements(2).len(), 1);
    }

    #[test]
    fn alike_machines_are_one_class_however_many() {
        let few = State::empty(&[(0, 8); 2]);
        let many = State::empty(&[(0, 8); 2048]);
        assert_eq!(few.0.len(), 1);
        assert_eq!(many.0, vec![(few.0[0].0, 2048)]);
        // 100 whole machines, then a quarter of one: three classes.
        let (_, takes) = &many.aligned_placements(800, 2)[0];
        let after = many.taken(takes);
        assert_eq!(after.0.len(), 2);
        let (_, takes) = &after.aligned_placements(2, 2)[0];
        assert_eq!(after.taken(takes).0.len(), 3);
        assert_eq!(after.taken(takes).free(), 2048 * 8 - 802);
    }

    #[test]
    fn following_machines_keeps_their_positions() {
        let machines = [(0, 8), (0, 8), (1, 4)];
        let (s, ids) = State::with_machines(&machines);
        assert_eq!(ids, vec![vec![0, 1], vec![2]]);
        let takes = takes_of(&s, &[3, 0, 4]);
        let (next, next_ids, given) = s.take_machines(&ids, &takes);
        assert_eq!(next, s.taken(&takes));
        // Machine 1 is fresh and sorts first in its group, then machine 0.
        assert_eq!(next_ids, vec![vec![1], vec![0], vec![2]]);
        assert_eq!(given, vec![vec![0], vec![2]]);
    }

    #[test]
    fn even_scatter_shares_every_machine_or_nothing() {
        let s = State::empty(&[(0, 8); 4]);
        // 8 GPUs: 2 on each fresh machine; then 8 more: 2 on each machine
        // in use, which stay alike (one class).
        let first = s.even_scatter(8).unwrap();
        assert_eq!(per_position(&s, &first), vec![2, 2, 2, 2]);
        let s2 = s.taken(&first);
        let second = s2.even_scatter(8).unwrap();
        assert_eq!(s2.taken(&second).0.len(), 1);
        // Not a multiple of the machines, or more than they have: none.
        assert_eq!(s2.even_scatter(6), None);
        assert_eq!(s2.even_scatter(28), None);
        // One machine is no scatter.
        assert_eq!(State::empty(&[(0, 8)]).even_scatter(4), None);
    }

    #[test]
    fn symmetric_states_are_equal() {
        // Which of two alike machines takes 8 GPUs and which 3 does not
        // matter: the same state.
        let s = two_by_eight();
        let eight_then_three = [
            Take {
                class: 0,
                gpus: 8,
                machines: 1,
            },
            Take {
                class: 0,
                gpus: 3,
                machines: 1,
            },
        ];
        let three_then_eight = [eight_then_three[1], eight_then_three[0]];
        assert_eq!(s.taken(&eight_then_three), s.taken(&three_then_eight));
        assert_ne!(s.taken(&eight_then_three), s.taken(&eight_then_three[..1]));
    }
}
