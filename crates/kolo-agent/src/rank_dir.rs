//! A rank's private directory, and the removal of those whose every kolo
//! process was killed.
//!
//! It lives in `TMPDIR` when the user set one, else in `/dev/shm` (memory):
//! creating a directory and its files on a disk file system (ext4's inode
//! allocation) was a fifth of an agent's own CPU at start, on a machine
//! where ranks share cores that is time every rank waits for; else in the
//! system's temporary folder.
//!
//! The agent, its guard, or the driver on its own host removes a rank's
//! directory. When all of them die at once (SIGKILL to every kolo process
//! on a host), nothing is left to do it. So the agent holds an advisory
//! lock on a file inside for the rank's whole life; the kernel drops the
//! lock when the agent dies however it dies, and the next agent on the
//! host removes every rank directory whose lock it can take. No pids are
//! compared, so pid reuse and pid namespaces cannot fool it.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use kolo_sys::guard::Guard;

const PREFIX: &str = "kolo-rank-";
/// The lock's name; it appears only once locked (see `RankDir::create`).
const LOCK: &str = "lock";
/// At most this many entries of the temporary folder are looked at per
/// sweep: a folder flooded with names must not slow every rank's start.
const MAX_SWEPT_ENTRIES: usize = 100_000;

/// A rank's directory, removed when dropped; its lock lives as long.
pub(super) struct RankDir {
    // fields drop in order: the directory goes while the lock is held
    dir: tempfile::TempDir,
    _lock: Option<Flock<File>>,
}

impl RankDir {
    /// Creates the directory (0700) in the temporary folder and locks it;
    /// with a guard, the guard removes both if this process dies.
    pub(super) fn create(guard: Option<&Guard>) -> Option<RankDir> {
        use std::os::unix::fs::PermissionsExt;
        let private = std::fs::Permissions::from_mode(0o700);
        let dir = tempfile::Builder::new().prefix(PREFIX).permissions(private).tempdir_in(base()).ok()?;
        if let Some(guard) = guard {
            // the guard removes the last registered first: the lock, then
            // the (then empty) directory
            let _ = guard.remove_path(dir.path());
            let _ = guard.remove_path(&dir.path().join(LOCK));
        }
        let lock = lock(dir.path());
        Some(RankDir { dir, _lock: lock })
    }

    pub(super) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Where rank directories go (see the module's notes).
pub(super) fn base() -> PathBuf {
    use nix::unistd::{access, AccessFlags};
    if std::env::var_os("TMPDIR").is_some_and(|t| !t.is_empty()) {
        return std::env::temp_dir();
    }
    let memory = Path::new("/dev/shm");
    if memory.is_dir() && access(memory, AccessFlags::W_OK | AccessFlags::X_OK).is_ok() {
        return memory.to_path_buf();
    }
    std::env::temp_dir()
}

/// Locks a fresh file under a staging name, then gives it the lock's name:
/// a sweeper that finds the lock finds it already held.
fn lock(dir: &Path) -> Option<Flock<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let staging = dir.join(".lock");
    let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&staging).ok()?;
    let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).ok()?;
    std::fs::rename(&staging, dir.join(LOCK)).ok()?;
    Some(lock)
}

/// Removes the rank directories in `tmp` that belong to this user and whose
/// lock is free: their agent is gone and nothing removed them. Returns
/// those removed.
pub(super) fn sweep_abandoned(tmp: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(tmp) else { return removed };
    for entry in entries.take(MAX_SWEPT_ENTRIES).flatten() {
        if !entry.file_name().to_str().is_some_and(|n| n.starts_with(PREFIX)) {
            continue;
        }
        let path = entry.path();
        // a real directory of this user's, never a link someone planted
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == me);
        if !ours {
            continue;
        }
        // no lock file: made by an older kolo, or not yet locked; left alone
        let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path.join(LOCK));
        let Ok(file) = opened else { continue };
        // held while the directory goes, so no other sweeper races it
        if let Ok(_held) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            if std::fs::remove_dir_all(&path).is_ok() {
                removed.push(path);
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("kolo-sweep-test-").tempdir().unwrap()
    }

    /// A rank directory in `base` as `RankDir::create` makes it, with
    /// its lock.
    fn rank_dir_in(base: &Path, name: &str) -> (PathBuf, Option<Flock<File>>) {
        let dir = base.join(name);
        std::fs::create_dir(&dir).unwrap();
        let lock = lock(&dir);
        assert!(lock.is_some() && dir.join(LOCK).exists() && !dir.join(".lock").exists());
        (dir, lock)
    }

    #[test]
    fn a_held_directory_stays_and_an_abandoned_one_goes() {
        let base = base();
        let (live, live_lock) = rank_dir_in(base.path(), "kolo-rank-live");
        let (dead, dead_lock) = rank_dir_in(base.path(), "kolo-rank-dead");
        std::fs::write(dead.join("error.json"), "{}").unwrap();
        drop(dead_lock);
        assert_eq!(sweep_abandoned(base.path()), vec![dead.clone()]);
        assert!(live.exists() && !dead.exists());
        drop(live_lock);
        assert_eq!(sweep_abandoned(base.path()), vec![live.clone()]);
    }

    #[test]
    fn what_the_sweep_does_not_own_is_left_alone() {
        let base = base();
        // not kolo's name, no lock yet, a link to a directory elsewhere
        let (other, other_lock) = rank_dir_in(base.path(), "someone-else");
        drop(other_lock);
        let unlocked = base.path().join("kolo-rank-unlocked");
        std::fs::create_dir(&unlocked).unwrap();
        let target = base.path().join("target");
        let (_, target_lock) = rank_dir_in(base.path(), "target");
        drop(target_lock);
        std::os::unix::fs::symlink(&target, base.path().join("kolo-rank-link")).unwrap();
        assert!(sweep_abandoned(base.path()).is_empty());
        assert!(other.exists() && unlocked.exists() && target.join(LOCK).exists());
    }

    #[test]
    fn a_lock_held_by_another_process_keeps_the_directory() {
        // flock belongs to the open file: another process's is as real as
        // a dead agent's free one is free
        let base = base();
        let (dir, lock) = rank_dir_in(base.path(), "kolo-rank-child");
        drop(lock);
        // the shell's descriptor, locked by flock(1), is the sleep's after exec
        let script = "exec 9>>\"$0\"; flock -x 9 && echo held && exec sleep 1000";
        let mut holder = std::process::Command::new("sh")
            .args(["-c", script])
            .arg(dir.join(LOCK))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line).unwrap();
        assert_eq!(line, "held\n");
        assert!(sweep_abandoned(base.path()).is_empty());
        holder.kill().unwrap();
        holder.wait().unwrap();
        assert_eq!(sweep_abandoned(base.path()), vec![dir]);
    }
}
