//! Communicators made from others: by color and key, the members on this
//! host, the members with one local rank on every host, and the
//! hierarchy the collectives use across hosts.

use super::progress::P2P;
use super::{lock, Communicator};
use crate::CommError;

/// The id of a communicator split from `parent`: the same on every member
/// (they all count the same splits of the parent and give the same color).
fn child_id(parent: u64, split: u64, color: u32) -> u64 {
    // splitmix64 over the three
    let mut z = parent ^ split.rotate_left(21) ^ (u64::from(color) << 40) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) & !P2P
}

impl Communicator {
    /// A communicator of the members that gave the same `color`, ordered by
    /// `key` (then by rank). Collective: every member calls it.
    pub fn split(&mut self, color: u32, key: u32) -> Result<Communicator, CommError> {
        self.split_named(color, key, &format!("split {color}"))
    }

    fn split_named(&mut self, color: u32, key: u32, what: &str) -> Result<Communicator, CommError> {
        let mine = [(u64::from(color) << 32 | u64::from(key)) as i64];
        let mut all = vec![0i64; self.size()];
        self.allgather(&mine, &mut all)?;
        let mut members: Vec<(u32, usize)> =
            (0..self.size()).filter(|&m| (all[m] as u64 >> 32) as u32 == color).map(|m| (all[m] as u32, m)).collect();
        members.sort_unstable();
        let rank = members.iter().position(|&(_, m)| m == self.rank).expect("this rank gave its own color");
        self.splits += 1;
        let id = child_id(self.id, self.splits, color);
        let name = format!("{}/{what} #{}", self.name(), self.splits);
        lock(&self.shared.names).insert(id, name);
        Ok(Communicator::new(
            self.shared.clone(),
            id,
            members.iter().map(|&(_, m)| self.group[m]).collect(),
            rank,
            members.iter().map(|&(_, m)| self.nodes[m]).collect(),
        ))
    }

    /// The members on this host.
    pub fn split_local(&mut self) -> Result<Communicator, CommError> {
        self.split_named(self.nodes[self.rank] as u32, self.rank as u32, "local")
    }

    /// The members with the same local rank on every host.
    pub fn split_cross(&mut self) -> Result<Communicator, CommError> {
        let local_rank = (0..self.rank).filter(|&m| self.nodes[m] == self.nodes[self.rank]).count();
        self.split_named(local_rank as u32, self.rank as u32, "cross")
    }

    /// Sets up hierarchical algorithms when the members span hosts with the
    /// same number of ranks on each (collective).
    pub(crate) fn build_hierarchy(&mut self) -> Result<(), CommError> {
        let nodes = self.num_nodes();
        if nodes < 2 || nodes == self.size() {
            return Ok(());
        }
        let per_node: Vec<usize> = (0..nodes).map(|i| self.nodes.iter().filter(|&&n| n == i).count()).collect();
        if per_node.iter().any(|&c| c != per_node[0]) {
            return Ok(());
        }
        let local = self.split_local()?;
        let cross = self.split_cross()?;
        self.hierarchy = Some(Box::new((local, cross)));
        Ok(())
    }
}
