//! How an engine starts a worker agent and what the agent tells the engine
//! on its stdout: the variables of worker mode, and the records of the
//! group registry (process groups and rank directories the engine cleans
//! up if the agent dies). Both the agent (writing) and the engines
//! (reading) use this module.

/// Variables an engine sets to start a process in worker mode.
pub mod env {
    /// `host:port` of the driver's control socket.
    pub const DRIVER: &str = "KOLO_WORKER_DRIVER";
    /// The worker's index in creation order (its world rank).
    pub const INDEX: &str = "KOLO_WORKER_INDEX";
    /// Set instead of `INDEX` by an engine that starts one process for
    /// several agents of a host (the local engine, for OS commands):
    /// their indices, comma-separated. Each agent keeps its own
    /// connection; one exec and one runtime start serve them all.
    pub const INDICES: &str = "KOLO_WORKER_INDICES";
    /// The job secret, for engines that cannot pass it on stdin (Slurm).
    pub use kolo_topology::env_names::SECRET;
    /// `INDEX` set to this means: the index is Slurm's task id (`SLURM_PROCID`).
    pub const INDEX_FROM_SLURM: &str = "SLURM_PROCID";
    /// Set when the secret comes on the first line of stdin instead.
    pub const SECRET_ON_STDIN: &str = "KOLO_WORKER_SECRET_ON_STDIN";
    /// Set for command jobs: the agent forks its guard first thing, while
    /// it is still one small thread (the cheapest fork there is).
    pub const GUARD: &str = "KOLO_WORKER_GUARD";
    /// Set by an engine that guards commands itself (the local engine):
    /// the agent's stdout is a pipe to the driver, on which each command
    /// says "my group is N" before it runs, and the agent "N is gone".
    pub const GROUPS_ON_STDOUT: &str = "KOLO_WORKER_GROUPS_ON_STDOUT";
    /// Set by an engine whose launcher holds the agent's stdin open for as
    /// long as the agent may run (Ray's actors): end of file on stdin means
    /// the launcher is gone, and the agent stops as if the driver were.
    pub const STDIN_LIFELINE: &str = "KOLO_WORKER_STDIN_LIFELINE";
}

/// Records on the group registry: this tag, then a process group
/// (big-endian) with `GROUP_GONE` set once the group is gone. The tag keeps
/// anything else written to the agent's stdout (by a runtime starting up
/// before the agent) from passing for a record.
pub const GROUP_TAG: [u8; 4] = *b"kolo";
/// The bit of a group record's value that says the group is gone rather
/// than new (process group ids never reach it).
pub const GROUP_GONE: u32 = 1 << 31;

/// A rank's private directory: this tag, the path's length (big-endian)
/// and the path, in one write no longer than a pipe writes whole.
pub const DIR_TAG: [u8; 4] = *b"kdir";
/// The longest path a directory record carries: with its 8-byte header,
/// 4096 bytes, the most a Linux pipe writes whole (`PIPE_BUF`).
pub const MAX_DIR_RECORD: usize = 4096 - 8;

/// A rank directory's record, or `None` for a path too long to write whole.
pub fn dir_record(dir: &std::path::Path) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let path = dir.as_os_str().as_bytes();
    if path.len() > MAX_DIR_RECORD {
        return None;
    }
    let mut record = DIR_TAG.to_vec();
    record.extend_from_slice(&(path.len() as u32).to_be_bytes());
    record.extend_from_slice(path);
    Some(record)
}

/// A process group's record (`GROUP_GONE` set: the group is gone).
pub fn group_record(group: u32) -> [u8; 8] {
    let mut record = [0u8; 8];
    record[..4].copy_from_slice(&GROUP_TAG);
    record[4..].copy_from_slice(&group.to_be_bytes());
    record
}

/// What an agent says on its registry ([`group_record`], [`dir_record`]).
#[derive(Debug, PartialEq)]
pub enum Record {
    /// A process group the agent started, to end if the agent dies.
    Group(u32),
    /// A group the agent has ended itself: the engine forgets it.
    Gone(u32),
    /// A rank's private directory, removed if the agent dies.
    Dir(std::path::PathBuf),
}

/// The whole records at the front of `pending` (the rest waits for more
/// bytes). Anything that is not a record makes the agent untrusted for
/// good: nothing more it says counts.
pub fn take_records(pending: &mut Vec<u8>, trusted: &mut bool) -> Vec<Record> {
    use std::os::unix::ffi::OsStrExt;
    let mut records = Vec::new();
    let mut at = 0;
    while *trusted && pending.len() - at >= 8 {
        let (tag, value) =
            (&pending[at..at + 4], u32::from_be_bytes(pending[at + 4..at + 8].try_into().unwrap_or_default()));
        if tag == GROUP_TAG {
            records.push(if value & GROUP_GONE != 0 {
                Record::Gone(value & !GROUP_GONE)
            } else {
                Record::Group(value)
            });
            at += 8;
            continue;
        }
        if tag == DIR_TAG && (value as usize) <= MAX_DIR_RECORD {
            let end = at + 8 + value as usize;
            if pending.len() < end {
                break;
            }
            let path = std::path::Path::new(std::ffi::OsStr::from_bytes(&pending[at + 8..end]));
            // only what an agent makes: a rank's directory, by its absolute path
            let named = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("kolo-rank-"));
            if path.is_absolute() && named {
                records.push(Record::Dir(path.to_path_buf()));
            }
            at = end;
            continue;
        }
        *trusted = false;
    }
    if *trusted {
        pending.drain(..at);
    } else {
        pending.clear();
    }
    records
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_split_anywhere_are_read_whole() {
        let mut bytes = group_record(42).to_vec();
        bytes.extend(dir_record(std::path::Path::new("/tmp/kolo-rank-x")).unwrap());
        bytes.extend(group_record(42 | GROUP_GONE));
        for split in 0..bytes.len() {
            let (mut pending, mut trusted, mut got) = (bytes[..split].to_vec(), true, Vec::new());
            got.extend(take_records(&mut pending, &mut trusted));
            pending.extend_from_slice(&bytes[split..]);
            got.extend(take_records(&mut pending, &mut trusted));
            let want = [Record::Group(42), Record::Dir("/tmp/kolo-rank-x".into()), Record::Gone(42)];
            assert_eq!(got, want, "split at {split}");
        }
    }
}
