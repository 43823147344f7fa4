//! Device placement: which GPUs a new stage gets, by the paper's three
//! policies (section IV-B), on a symmetry-reduced view of the cluster.
//!
//! Machines of one group are interchangeable, so the search never asks
//! *which* machine but only *what kind*: a machine is described by its group,
//! its size, how many GPUs are taken and how many of those belong to the
//! neighbouring stage (the one a new stage will talk to). Sorting these
//! descriptions gives one canonical state for all symmetric placements.

/// One machine as the placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MachineUse {
    pub group: u16,
    pub capacity: u16,
    pub used: u16,
    /// GPUs of this machine that the most recently placed stage holds.
    pub adjacent: u16,
}

impl MachineUse {
    fn free(&self) -> u16 {
        self.capacity - self.used
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

/// Canonical cluster state: machines sorted by (group, used, adjacent).
/// Because the group comes first and group sizes never change, position p
/// always holds a machine of the same group as concrete machine p.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State(pub Vec<MachineUse>);

impl State {
    /// All machines free. `machines[i] = (group, gpus)` in device-id order,
    /// groups contiguous and ascending.
    pub fn empty(machines: &[(usize, u32)]) -> State {
        State(
            machines
                .iter()
                .map(|&(g, n)| MachineUse {
                    group: g as u16,
                    capacity: n as u16,
                    used: 0,
                    adjacent: 0,
                })
                .collect(),
        )
    }

    pub fn free(&self) -> u32 {
        self.0.iter().map(|m| u32::from(m.free())).sum()
    }

    /// The neighbouring stage as (position, gpus), positions ascending.
    pub fn adjacent_alloc(&self) -> Vec<(usize, u32)> {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, m)| m.adjacent > 0)
            .map(|(p, m)| (p, u32::from(m.adjacent)))
            .collect()
    }

    /// The machines after taking `counts[p]` GPUs of each position, in
    /// the old positions' order (not canonical yet).
    fn moved(&self, counts: &[u32]) -> Vec<MachineUse> {
        self.0
            .iter()
            .zip(counts)
            .map(|(m, &c)| MachineUse {
                used: m.used + c as u16,
                adjacent: c as u16,
                ..*m
            })
            .collect()
    }

    /// Take `counts[p]` GPUs of each position. Returns the canonical new
    /// state and, for each new position, the old position it came from.
    pub fn take(&self, counts: &[u32]) -> (State, Vec<usize>) {
        let moved = self.moved(counts);
        let mut order: Vec<usize> = (0..moved.len()).collect();
        order.sort_by_key(|&i| moved[i]);
        let sorted = order.iter().map(|&i| moved[i]).collect();
        (State(sorted), order)
    }

    /// The canonical state after taking `counts[p]` GPUs of each position:
    /// `take` without the positions, which only a replay needs (equal
    /// machines are interchangeable, so an unstable sort gives the same state).
    pub fn taken(&self, counts: &[u32]) -> State {
        let mut moved = self.moved(counts);
        moved.sort_unstable();
        State(moved)
    }

    /// Where `placement` puts a stage of `want` GPUs, as counts per
    /// position; None when fewer than `want` GPUs are free (in its group,
    /// for a group's scatter).
    pub fn place(&self, want: u32, placement: Placement) -> Option<Vec<u32>> {
        if want == 0 || want > self.free() {
            return None;
        }
        let machines = &self.0;
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

    /// Distinct placements of `want` GPUs over all policies, each with the
    /// first placement that produced it: the policies alone, then, where
    /// the machines are of several groups, each policy preferring each
    /// group.
    pub fn placements(&self, want: u32) -> Vec<(Placement, Vec<u32>)> {
        let mut groups: Vec<u16> = self.0.iter().map(|m| m.group).collect();
        groups.dedup(); // sorted: the state is ordered by group
        let preferences = std::iter::once(None).chain(
            groups
                .iter()
                .copied()
                .map(Some)
                .filter(|_| groups.len() > 1),
        );
        let mut out: Vec<(Placement, Vec<u32>)> = Vec::with_capacity(3);
        for group in preferences {
            for policy in Policy::ALL {
                let placement = Placement { policy, group };
                if let Some(c) = self.place(want, placement) {
                    if !out.iter().any(|(_, o)| *o == c) {
                        out.push((placement, c));
                    }
                }
            }
        }
        out
    }
}

impl State {
    /// Placements of the machine-aligned search space: `want` whole fresh
    /// machines (fresh-first), or a divisor of a machine's GPUs inside one
    /// machine, either a partly used one (append-first) or a fresh one
    /// (fresh-first) as long as at most `max_partial` machines end up partly
    /// used. This keeps the number of distinct states small on big clusters.
    pub fn aligned_placements(&self, want: u32, max_partial: usize) -> Vec<(Placement, Vec<u32>)> {
        let machines = &self.0;
        let per_machine = machines
            .iter()
            .map(|m| u32::from(m.capacity))
            .max()
            .unwrap_or(1);
        let mut out = Vec::new();
        let mut counts = vec![0u32; machines.len()];
        if want.is_multiple_of(per_machine) {
            let mut need = want / per_machine;
            for (p, m) in machines.iter().enumerate() {
                if need > 0 && m.used == 0 && u32::from(m.capacity) == per_machine {
                    counts[p] = per_machine;
                    need -= 1;
                }
            }
            if need == 0 {
                out.push((Placement::of(Policy::FreshFirst), counts));
            }
            return out;
        }
        if per_machine % want != 0 {
            return out;
        }
        let partial = |m: &MachineUse| m.used > 0 && m.free() > 0;
        // Append: the partly used machine next to the neighbouring stage,
        // else the fullest one that still has room.
        if let Some(p) = (0..machines.len())
            .filter(|&p| partial(&machines[p]) && u32::from(machines[p].free()) >= want)
            .min_by_key(|&p| {
                (
                    std::cmp::Reverse(machines[p].adjacent),
                    machines[p].free(),
                    p,
                )
            })
        {
            let mut c = vec![0u32; machines.len()];
            c[p] = want;
            out.push((Placement::of(Policy::AppendFirst), c));
        }
        let partly_used = machines.iter().filter(|m| partial(m)).count();
        if partly_used < max_partial || want == per_machine {
            if let Some(p) = machines.iter().position(|m| m.used == 0) {
                let mut c = vec![0u32; machines.len()];
                c[p] = want;
                out.push((Placement::of(Policy::FreshFirst), c));
            }
        }
        out
    }
}

/// `(position, gpus)` pairs of a counts vector.
pub fn counts_to_alloc(counts: &[u32]) -> Vec<(usize, u32)> {
    counts
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(p, &c)| (p, c))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_by_eight() -> State {
        State::empty(&[(0, 8), (0, 8)])
    }

    #[test]
    fn fresh_first_takes_whole_machines() {
        let s = two_by_eight();
        assert_eq!(
            s.place(8, Placement::of(Policy::FreshFirst)),
            Some(vec![8, 0])
        );
        assert_eq!(
            s.place(10, Placement::of(Policy::FreshFirst)),
            Some(vec![8, 2])
        );
        let (s2, _) = s.take(&[0, 3]);
        // The partly used machine sorts last; a fresh one is first.
        assert_eq!(s2.0[1].used, 3);
        assert_eq!(
            s2.place(6, Placement::of(Policy::FreshFirst)),
            Some(vec![6, 0])
        );
        assert_eq!(
            s2.place(6, Placement::of(Policy::AppendFirst)),
            Some(vec![1, 5])
        );
    }

    #[test]
    fn scatter_first_spreads_evenly() {
        let s = two_by_eight();
        assert_eq!(
            s.place(8, Placement::of(Policy::ScatterFirst)),
            Some(vec![4, 4])
        );
        assert_eq!(
            s.place(3, Placement::of(Policy::ScatterFirst)),
            Some(vec![2, 1])
        );
        let (s2, _) = s.take(&[4, 4]);
        assert_eq!(
            s2.place(8, Placement::of(Policy::ScatterFirst)),
            Some(vec![4, 4])
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
    fn taken_is_take_without_the_positions() {
        let (s, _) = State::empty(&[(0, 8), (0, 8), (1, 4)]).take(&[3, 0, 4]);
        for counts in [[0, 8, 0], [5, 0, 0], [1, 1, 0], [0, 0, 0]] {
            assert_eq!(s.taken(&counts), s.take(&counts).0);
        }
    }

    #[test]
    fn symmetric_states_are_equal() {
        let s = two_by_eight();
        let (a, _) = s.take(&[8, 0]);
        let (b, _) = s.take(&[0, 8]);
        assert_eq!(a, b);
    }
}
