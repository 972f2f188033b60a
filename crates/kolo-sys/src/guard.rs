//! A watchdog process that outlives its parent just long enough to clean up
//! after it. Killing a process with SIGKILL runs none of its cleanup: a
//! worker agent killed that way would leave its rank's command running as
//! an orphan, and a driver killed that way would leave ssh sessions, srun,
//! a Slurm allocation and temporary files. So each forks a guard first and
//! tells it, over a pipe, what to clean up: process groups to end (SIGTERM,
//! a grace period, SIGKILL), paths to remove, a command to run (`scancel`).
//! The guard acts when the pipe reaches end-of-file (the parent died or
//! exited), when it is sent SIGTERM (a batch system ending the whole job
//! step) or, if asked, when the parent falls silent (stopped or hung).
//!
//! The parent is multi-threaded, so the guard (a fork without exec) uses
//! only async-signal-safe system calls: no allocation, no locks. Everything
//! it needs lives in memory allocated before the fork.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Records on the pipe: a kind byte, a 2-byte length, the payload.
const BEAT: u8 = 1;
const GROUP: u8 = 2;
/// A group record's kind byte, for a child that registers itself.
pub const GROUP_RECORD: u8 = GROUP;
const PATH: u8 = 3;
const COMMAND: u8 = 4;
const RELEASE: u8 = 5;
const ARM: u8 = 6;

const MAX_GROUPS: usize = 1024;
const MAX_PATHS: usize = 16;
const PATH_BYTES: usize = 4096;
const COMMAND_BYTES: usize = 4096;
const MAX_ARGS: usize = 32;

/// What the guard does when its parent goes.
#[derive(Clone, Copy, Debug)]
pub struct GuardOptions {
    /// Between SIGTERM and SIGKILL for the registered groups.
    pub grace: Duration,
    /// Act when no beat came for this long, and then also SIGKILL the
    /// (stopped or hung) parent.
    pub silence: Option<Duration>,
}

/// The parent's end of a guard.
pub struct Guard {
    /// `None` once released.
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
}

/// Registers process groups with a guard from elsewhere than its owner.
pub struct GroupWriter(OwnedFd);

impl GroupWriter {
    /// Has the guard end process group `pgid` when the parent goes, like
    /// [`Guard::watch_group`].
    pub fn watch_group(&self, pgid: u32) -> io::Result<()> {
        let mut record = [GROUP, 0, 4, 0, 0, 0, 0];
        record[3..].copy_from_slice(&pgid.to_be_bytes());
        write_all(self.0.as_raw_fd(), &record)
    }
}

/// The guard's memory, allocated before the fork.
struct State {
    grace_ms: i64,
    /// Silence past this makes the guard act; 0: silence is no sign.
    silence_ms: i64,
    groups: Vec<libc::pid_t>,
    paths: Vec<[u8; PATH_BYTES]>,
    path_count: usize,
    command: [u8; COMMAND_BYTES],
    command_len: usize,
    buf: [u8; 8192],
    filled: usize,
}

impl Guard {
    /// Forks the guard.
    pub fn spawn(options: GuardOptions) -> io::Result<Guard> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` is a writable array of exactly the two c_ints pipe2
        // fills, and pipe2 keeps no pointer to it.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are open descriptors it just made;
        // nothing else holds them, and each is wrapped exactly once.
        let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut state = Box::new(State {
            grace_ms: options.grace.as_millis() as i64,
            silence_ms: options.silence.map_or(0, |d| d.as_millis() as i64),
            groups: Vec::with_capacity(MAX_GROUPS),
            paths: vec![[0u8; PATH_BYTES]; MAX_PATHS],
            path_count: 0,
            command: [0; COMMAND_BYTES],
            command_len: 0,
            buf: [0; 8192],
            filled: 0,
        });
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: fork has no memory preconditions. The parent may be
        // multi-threaded, so the child only moves fds out of their owners
        // (no drop, no close) and enters `watch`, which makes only
        // async-signal-safe calls on memory allocated above and never returns
        // (no destructor or unwinding in the forked copy). The parent side
        // only owns its write end and closes the read end.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                let read_fd = read_end.as_raw_fd();
                std::mem::forget(read_end);
                std::mem::forget(write_end);
                // SAFETY: this is the freshly forked guard; `read_fd` is the
                // pipe's read end, left open since its owner was forgotten,
                // and `state` was allocated before the fork (`watch`'s contract).
                unsafe { watch(read_fd, parent, &mut state) }
            }
            pid => {
                drop(read_end);
                Ok(Guard { pipe: Some(write_end), pid })
            }
        }
    }

    /// The guard process's id (to reap it, or to check it is alive).
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let mut record = Vec::with_capacity(3 + payload.len());
        record.push(kind);
        record.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        record.extend_from_slice(payload);
        let pipe = self.pipe.as_ref().ok_or_else(|| io::Error::other("the guard was released"))?;
        write_all(pipe.as_raw_fd(), &record)
    }

    /// "Still here": resets the silence clock.
    pub fn beat(&self) -> io::Result<()> {
        self.send(BEAT, &[])
    }

    /// End this process group when the parent goes.
    pub fn watch_group(&self, pgid: u32) -> io::Result<()> {
        self.send(GROUP, &pgid.to_be_bytes())
    }

    /// Remove this file or empty directory when the parent goes (files
    /// first: register a directory before what it holds).
    pub fn remove_path(&self, path: &std::path::Path) -> io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let bytes = path.as_os_str().as_bytes();
        if bytes.len() >= PATH_BYTES || bytes.contains(&0) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "path too long for the guard"));
        }
        self.send(PATH, bytes)
    }

    /// Run this command (argv) when the parent goes, after the groups ended.
    pub fn run_on_exit(&self, argv: &[&str]) -> io::Result<()> {
        let mut payload = Vec::new();
        for arg in argv.iter().take(MAX_ARGS - 1) {
            let c = CString::new(*arg).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            payload.extend_from_slice(c.as_bytes_with_nul());
        }
        if payload.len() > COMMAND_BYTES || payload.len() > u16::MAX as usize {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "command too long for the guard"));
        }
        self.send(COMMAND, &payload)
    }

    /// Sets the grace period and the silence limit now (a guard forked
    /// early, before they were known); the silence clock starts afresh.
    pub fn arm(&self, grace: Duration, silence: Option<Duration>) -> io::Result<()> {
        let mut payload = [0u8; 16];
        payload[..8].copy_from_slice(&(grace.as_millis() as u64).to_be_bytes());
        payload[8..].copy_from_slice(&silence.map_or(0, |s| s.as_millis() as u64).to_be_bytes());
        self.send(ARM, &payload)
    }

    /// The parent cleaned up itself: the guard exits without acting. It is
    /// not waited for (a parent on its way out need not linger); reap it
    /// with [`Guard::reap`] where the process lives on.
    pub fn release(mut self) -> u32 {
        let _ = self.send(RELEASE, &[]);
        self.pipe = None;
        self.pid as u32
    }

    /// The pipe's descriptor, for a child to register itself between fork
    /// and exec.
    pub fn pipe_fd(&self) -> Option<std::os::fd::RawFd> {
        self.pipe.as_ref().map(|p| p.as_raw_fd())
    }

    /// A second writer of group records, for another thread to register
    /// groups while this guard lives (records are too small to interleave).
    pub fn group_writer(&self) -> io::Result<GroupWriter> {
        use std::os::fd::AsFd;
        let pipe = self.pipe.as_ref().ok_or_else(|| io::Error::other("the guard was released"))?;
        Ok(GroupWriter(pipe.as_fd().try_clone_to_owned()?))
    }

    /// Waits for a released guard to exit.
    pub fn reap(pid: u32) {
        // SAFETY: waitpid takes a pid and a status pointer that may be null;
        // no memory is touched, and for a pid that is not our child it fails
        // with ECHILD.
        unsafe {
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // closing the pipe (after this) makes the guard act; reap it then
        // from a thread so a drop never blocks on the grace period
        if self.pipe.is_none() {
            return;
        }
        let pid = self.pid;
        let _ = std::thread::Builder::new().name("kolo-guard-reaper".into()).spawn(move || {
            // SAFETY: as in `reap`: a null status pointer is allowed and no
            // memory is touched; the pid is this guard's, our own child.
            unsafe {
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        });
    }
}

fn write_all(fd: RawFd, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length come from a live slice, readable
        // for the whole call, and write keeps no pointer to it. A bad `fd`
        // only makes write fail (EBADF).
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

fn now_ms() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec on the stack, which
    // clock_gettime only fills (and it is async-signal-safe).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1000 + ts.tv_nsec / 1_000_000
}

fn nap_ms(ms: i64) {
    let ts = libc::timespec { tv_sec: ms / 1000, tv_nsec: (ms % 1000) * 1_000_000 };
    // SAFETY: `ts` is a valid timespec for nanosleep to read; the remainder
    // pointer may be null (and nanosleep is async-signal-safe).
    unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
}

/// The guard's life. Only async-signal-safe calls from here on.
///
/// # Safety
///
/// Only in the guard process just forked from the parent: it may call
/// async-signal-safe functions only (no allocation, no locks), and
/// `state` was made before the fork.
unsafe fn watch(pipe: RawFd, parent: libc::pid_t, state: &mut State) -> ! {
    // SAFETY: by the contract this is the guard just forked, one thread, so
    // nothing else uses these descriptors or `state`. Every call is a system
    // call wrapper that neither allocates nor locks, given pointers to
    // locals or to `state.buf` with its true free length; a zeroed sigset_t
    // is a valid (empty) set; `take_records` only fills reserved capacity.
    unsafe {
        // own session: no terminal signals, not in the parent's process group
        // (which engines kill as a whole)
        libc::setsid();
        for signal in [libc::SIGINT, libc::SIGHUP, libc::SIGPIPE, libc::SIGQUIT, libc::SIGUSR1] {
            libc::signal(signal, libc::SIG_IGN);
        }
        // SIGTERM is read, not ignored: a batch system ending the whole step
        // (Slurm: SIGTERM to every process of it, SIGKILL after KillWait)
        // leaves the guard only that moment to clean up
        let mut term: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut term);
        libc::sigaddset(&mut term, libc::SIGTERM);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        libc::sigprocmask(libc::SIG_SETMASK, &term, std::ptr::null_mut());
        // keep only the pipe: an inherited socket would keep the driver from
        // seeing this process's parent go; stdio goes to /dev/null
        libc::dup2(pipe, 3);
        if libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32) != 0 {
            let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            for fd in 4..(limit.rlim_cur.min(1 << 16) as RawFd) {
                libc::close(fd);
            }
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        for fd in 0..3 {
            libc::dup2(null, fd);
        }
        let pipe: RawFd = 3;
        let terminated = libc::signalfd(-1, &term, libc::SFD_CLOEXEC);
        let mut last_beat = now_ms();
        loop {
            let timeout = match state.silence_ms {
                0 => -1,
                limit => (last_beat + limit - now_ms()).clamp(0, 1000) as libc::c_int,
            };
            let mut pfds = [
                libc::pollfd { fd: pipe, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: terminated, events: libc::POLLIN, revents: 0 },
            ];
            let ready = libc::poll(pfds.as_mut_ptr(), if terminated >= 0 { 2 } else { 1 }, timeout);
            if ready > 0 && pfds[1].revents != 0 {
                clean_up(state, None);
            }
            let pfd = pfds[0];
            if ready > 0 && pfd.revents != 0 {
                let free = &mut state.buf[state.filled..];
                let n = libc::read(pipe, free.as_mut_ptr().cast(), free.len());
                if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                    clean_up(state, None);
                }
                if n > 0 {
                    state.filled += n as usize;
                    last_beat = now_ms();
                    if take_records(state) {
                        libc::_exit(0);
                    }
                }
            }
            if state.silence_ms > 0 && now_ms() - last_beat > state.silence_ms {
                clean_up(state, Some(parent));
            }
        }
    }
}

/// Applies the whole records in the buffer; true on release.
fn take_records(state: &mut State) -> bool {
    let mut at = 0;
    while state.filled - at >= 3 {
        let kind = state.buf[at];
        let len = u16::from_be_bytes([state.buf[at + 1], state.buf[at + 2]]) as usize;
        if state.filled - at < 3 + len {
            break;
        }
        let payload_at = at + 3;
        match kind {
            GROUP if len == 4 && state.groups.len() < MAX_GROUPS => {
                let b = &state.buf[payload_at..payload_at + 4];
                // the capacity was reserved before the fork: no allocation
                state.groups.push(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as libc::pid_t);
            }
            PATH if len < PATH_BYTES && state.path_count < MAX_PATHS => {
                let slot = &mut state.paths[state.path_count];
                slot[..len].copy_from_slice(&state.buf[payload_at..payload_at + len]);
                slot[len] = 0;
                state.path_count += 1;
            }
            COMMAND if len <= COMMAND_BYTES => {
                state.command[..len].copy_from_slice(&state.buf[payload_at..payload_at + len]);
                state.command_len = len;
            }
            ARM if len == 16 => {
                let word = |at: usize| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&state.buf[payload_at + at..payload_at + at + 8]);
                    u64::from_be_bytes(b) as i64
                };
                state.grace_ms = word(0);
                state.silence_ms = word(8);
            }
            RELEASE => return true,
            _ => {}
        }
        at += 3 + len;
    }
    state.buf.copy_within(at..state.filled, 0);
    state.filled -= at;
    false
}

/// Ends the groups, kills a silent parent, runs the command, removes the
/// paths (the last registered first), and exits.
///
/// # Safety
///
/// Only in the guard process just forked from the parent: it may call
/// async-signal-safe functions only (no allocation, no locks), and
/// `state` was made before the fork.
unsafe fn clean_up(state: &mut State, silent_parent: Option<libc::pid_t>) -> ! {
    // SAFETY: by the contract this is the single-threaded guard; kill,
    // killpg, unlink, rmdir and _exit are async-signal-safe, and each path
    // passed is a NUL-terminated slot (zeroed before the fork, and
    // `take_records` puts a NUL after every path it copies).
    unsafe {
        let groups = &state.groups[..];
        if let Some(parent) = silent_parent {
            // stopped or hung: it will not clean up; SIGCONT lets a stopped
            // one die at once
            libc::kill(parent, libc::SIGKILL);
            libc::kill(parent, libc::SIGCONT);
        }
        let mut any = false;
        for &g in groups {
            any |= libc::killpg(g, libc::SIGTERM) == 0;
            libc::killpg(g, libc::SIGCONT);
        }
        // the files first: a batch system ending the whole step (Slurm kills
        // this process with the rest) must not cut the clean-up short
        for slot in state.paths[..state.path_count].iter().rev() {
            let path = slot.as_ptr().cast::<libc::c_char>();
            if libc::unlink(path) != 0 {
                libc::rmdir(path);
            }
        }
        if any {
            let deadline = now_ms() + state.grace_ms;
            while now_ms() < deadline && groups.iter().any(|&g| libc::killpg(g, 0) == 0) {
                nap_ms(10);
            }
            for &g in groups {
                libc::killpg(g, libc::SIGKILL);
            }
        }
        if state.command_len > 0 {
            run_command(&state.command[..state.command_len]);
        }
        libc::_exit(0)
    }
}

/// Runs a NUL-separated argv, waiting up to 30 s.
///
/// # Safety
///
/// Only in the guard process just forked from the parent: it may call
/// async-signal-safe functions only (no allocation, no locks), and
/// `bytes` lives in memory made before the fork.
unsafe fn run_command(bytes: &[u8]) {
    // SAFETY: every `argv` entry points into `bytes` at the start of an
    // argument ending at a NUL inside it, and at most MAX_ARGS - 1 are set,
    // so the array stays NULL-terminated. By the contract this process has
    // one thread, so its fork copies no lock held elsewhere; the child only
    // calls execvp and _exit. execvp is not on POSIX's async-signal-safe
    // list (it searches PATH): that part rests on the libc, not on this code.
    unsafe {
        let mut argv: [*const libc::c_char; MAX_ARGS] = [std::ptr::null(); MAX_ARGS];
        let mut count = 0;
        let mut start = 0;
        for (i, &b) in bytes.iter().enumerate() {
            if b == 0 && count < MAX_ARGS - 1 {
                argv[count] = bytes[start..].as_ptr().cast();
                count += 1;
                start = i + 1;
            }
        }
        if count == 0 {
            return;
        }
        let pid = libc::fork();
        if pid == 0 {
            libc::execvp(argv[0], argv.as_ptr());
            libc::_exit(127);
        }
        if pid < 0 {
            return;
        }
        let deadline = now_ms() + 30_000;
        while now_ms() < deadline {
            if libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) != 0 {
                return;
            }
            nap_ms(20);
        }
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn alive(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => {
                !matches!(stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X"))
            }
            Err(_) => false,
        }
    }

    fn wait_for(limit: Duration, cond: impl FnMut() -> bool) -> bool {
        crate::wait::wait_until(std::time::Instant::now() + limit, Duration::from_millis(10), cond)
    }

    #[test]
    fn a_dropped_guard_ends_its_groups_and_removes_its_paths() {
        use std::os::unix::process::CommandExt;
        let guard = Guard::spawn(GuardOptions { grace: Duration::from_millis(200), silence: None }).unwrap();
        let mut child =
            Command::new("sh").args(["-c", "trap '' TERM; sleep 100 & wait"]).process_group(0).spawn().unwrap();
        let dir = std::env::temp_dir().join(format!("kolo-guard-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("file"), b"x").unwrap();
        guard.watch_group(child.id()).unwrap();
        guard.remove_path(&dir).unwrap();
        guard.remove_path(&dir.join("file")).unwrap();
        let marker = dir.with_extension("ran");
        guard.run_on_exit(&["touch", marker.to_str().unwrap()]).unwrap();
        drop(guard);
        // the shell ignores SIGTERM: it goes at SIGKILL after the grace
        assert!(wait_for(Duration::from_secs(10), || child.try_wait().unwrap().is_some()));
        assert!(wait_for(Duration::from_secs(10), || !dir.exists() && marker.exists()));
        std::fs::remove_file(marker).unwrap();
    }

    #[test]
    fn a_released_guard_leaves_everything() {
        use std::os::unix::process::CommandExt;
        let guard = Guard::spawn(GuardOptions { grace: Duration::ZERO, silence: None }).unwrap();
        let mut child = Command::new("sleep").arg("100").process_group(0).spawn().unwrap();
        guard.watch_group(child.id()).unwrap();
        let pid = guard.pid() as i32;
        Guard::reap(guard.release());
        assert!(!alive(pid));
        assert!(child.try_wait().unwrap().is_none());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_silent_parent_is_treated_as_gone() {
        use std::os::unix::process::CommandExt;
        let mut sleeper = Command::new("sleep").arg("100").process_group(0).spawn().unwrap();
        let pgid = sleeper.id();
        // the parent must go silent, so it is a forked child of this test
        // that starts a guard and then stops itself
        // SAFETY: fork itself has no memory preconditions. The test harness
        // is multi-threaded, and the child allocates (Guard::spawn) before
        // it stops or _exits: that relies on glibc's malloc being usable in
        // a fork child, which glibc provides; the child never returns into
        // the harness.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let options = GuardOptions { grace: Duration::ZERO, silence: Some(Duration::from_millis(300)) };
            if let Ok(guard) = Guard::spawn(options) {
                let _ = guard.watch_group(pgid);
                std::mem::forget(guard);
                // SAFETY: raise takes no pointers; SIGSTOP stops this child
                // so that it goes silent.
                unsafe { libc::raise(libc::SIGSTOP) };
            }
            // SAFETY: _exit takes no pointers and ends the forked child at
            // once, running none of the harness's exit handlers.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        assert!(wait_for(Duration::from_secs(10), || sleeper.try_wait().unwrap().is_some()), "group not ended");
        let mut status = 0;
        // SAFETY: `status` is a valid, writable c_int for waitpid to fill;
        // `pid` is our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "stopped parent not killed");
    }
}
