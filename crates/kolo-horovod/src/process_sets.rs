//! Process sets (upstream's `process_set.cc`): subsets of the job's ranks
//! that negotiate and run collectives among themselves. Every process
//! keeps the same table: ids are given in registration order, freed ids
//! are reused first-in first-out, and the global set is id 0.

use std::collections::{BTreeMap, VecDeque};

/// Why a rank list cannot be a process set (upstream's texts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// The list names this rank twice.
    #[error("Tried to register process set with duplicate rank: {0}")]
    DuplicateRank(i64),
    /// This rank is negative or not below the job's size.
    #[error("Tried to register process set with invalid rank: {0}")]
    InvalidRank(i64),
    /// A set with exactly these (sorted) ranks is registered already.
    #[error("Attempted to add a duplicate process set: {0:?}")]
    Existing(Vec<u32>),
    /// The global set (id 0) cannot be removed.
    #[error("Attempted to remove global process set with id 0")]
    RemoveGlobal,
    /// No set has this id.
    #[error("Process set provided does not exist, or has not been registered.")]
    Unknown,
}

/// The sorted ranks of a valid set of a job of `size` processes.
pub fn checked_ranks(ranks: &[i64], size: usize) -> Result<Vec<u32>, SetError> {
    let mut sorted: Vec<i64> = ranks.to_vec();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        if pair[0] == pair[1] {
            return Err(SetError::DuplicateRank(pair[0]));
        }
    }
    if let Some(&bad) = sorted.iter().find(|&&r| r < 0 || r >= size as i64) {
        return Err(SetError::InvalidRank(bad));
    }
    Ok(sorted.into_iter().map(|r| r as u32).collect())
}

/// The registered process sets by id, the same on every process.
#[derive(Debug)]
pub struct SetTable {
    size: usize,
    sets: BTreeMap<u32, Vec<u32>>,
    free: VecDeque<u32>,
    next: u32,
}

impl SetTable {
    /// A job of `size` processes: the global set only.
    pub fn new(size: usize) -> SetTable {
        let mut sets = BTreeMap::new();
        sets.insert(0, (0..size as u32).collect());
        SetTable { size, sets, free: VecDeque::new(), next: 1 }
    }

    /// The id of a set with exactly these (sorted) ranks, if one is registered.
    pub fn find(&self, ranks: &[u32]) -> Option<u32> {
        self.sets.iter().find(|(_, r)| r.as_slice() == ranks).map(|(&id, _)| id)
    }

    /// Registers a set; its id. A set identical to a registered one is an error.
    pub fn add(&mut self, ranks: &[i64]) -> Result<u32, SetError> {
        let ranks = checked_ranks(ranks, self.size)?;
        if self.find(&ranks).is_some() {
            return Err(SetError::Existing(ranks));
        }
        let id = self.free.pop_front().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.sets.insert(id, ranks);
        Ok(id)
    }

    /// Unregisters set `id` and frees its id for reuse; its ranks. The
    /// global set cannot be removed.
    pub fn remove(&mut self, id: u32) -> Result<Vec<u32>, SetError> {
        if id == 0 {
            return Err(SetError::RemoveGlobal);
        }
        let ranks = self.sets.remove(&id).ok_or(SetError::Unknown)?;
        self.free.push_back(id);
        Ok(ranks)
    }

    /// The sorted global ranks of set `id`, if it is registered.
    pub fn ranks(&self, id: u32) -> Option<&[u32]> {
        self.sets.get(&id).map(Vec::as_slice)
    }

    /// Ids in ascending order, as every cycle visits them.
    pub fn ids(&self) -> Vec<u32> {
        self.sets.keys().copied().collect()
    }

    /// `rank`'s rank inside set `id`.
    pub fn rank_in(&self, id: u32, rank: u32) -> Option<u32> {
        self.sets.get(&id)?.iter().position(|&r| r == rank).map(|p| p as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_sorted_and_checked_with_upstreams_messages() {
        assert_eq!(checked_ranks(&[2, 0], 4), Ok(vec![0, 2]));
        assert_eq!(
            checked_ranks(&[1, 1], 4).unwrap_err().to_string(),
            "Tried to register process set with duplicate rank: 1"
        );
        assert_eq!(
            checked_ranks(&[0, 4], 4).unwrap_err().to_string(),
            "Tried to register process set with invalid rank: 4"
        );
        assert_eq!(
            checked_ranks(&[-1], 4).unwrap_err().to_string(),
            "Tried to register process set with invalid rank: -1"
        );
    }

    #[test]
    fn ids_come_in_order_and_freed_ones_are_reused_first_in_first_out() {
        let mut t = SetTable::new(4);
        assert_eq!(t.ranks(0), Some(&[0, 1, 2, 3][..]));
        assert_eq!(t.add(&[0, 2]), Ok(1));
        assert_eq!(t.add(&[1, 3]), Ok(2));
        assert_eq!(t.add(&[3]), Ok(3));
        assert_eq!(t.add(&[2, 0]), Err(SetError::Existing(vec![0, 2])));
        assert_eq!(t.add(&[0, 1, 2, 3]), Err(SetError::Existing(vec![0, 1, 2, 3])), "the global set exists");
        assert_eq!(t.remove(2), Ok(vec![1, 3]));
        assert_eq!(t.remove(1), Ok(vec![0, 2]));
        assert_eq!(t.add(&[1]), Ok(2));
        assert_eq!(t.add(&[2]), Ok(1));
        assert_eq!(t.add(&[0]), Ok(4));
        assert_eq!(t.remove(0), Err(SetError::RemoveGlobal));
        assert_eq!(t.remove(9), Err(SetError::Unknown));
        assert_eq!(t.ids(), vec![0, 1, 2, 3, 4]);
        assert_eq!((t.rank_in(3, 3), t.rank_in(3, 0)), (Some(0), None));
    }
}
