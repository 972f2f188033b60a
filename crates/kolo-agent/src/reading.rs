//! Who reads the driver's messages once the user's code runs in an agent.
//!
//! Calls run on the agent's main thread (Python's signal handlers need
//! it), and while one runs, what must not wait for it still has to be read
//! and answered: heartbeats, `Cancel`, `WhoOwns`, `Inspect`, `Stop`. A
//! thread that always reads and hands each call to the main thread costs
//! every call a wake-up of a second thread, which is most of what a short
//! call costs beyond the call itself when many workers share few cores.
//! So the main thread reads for itself between calls, and a helper thread
//! takes the reading over only once a call has run for `TAKEOVER`
//! (a timer the main thread arms as the call starts and disarms as it
//! ends: two system calls, no wake-up), and gives it back when the call
//! ends. What the helper reads for the main thread waits in `queued`, in
//! the order it came.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};

use crate::reader::FrameReader;
use kolo_proto::proto::ToWorker;

/// How long a call runs before the helper reads in its place: short
/// enough that a `WhoOwns`, `Inspect` or `Stop` during a call waits
/// unnoticed, long enough that short calls do not wake the helper even
/// where workers outnumber cores (with 1 ms, 16 workers on 2 cores woke it
/// often enough to be slower than a hand-off on every call).
pub(super) const TAKEOVER: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// The main thread reads (or acts on what it read).
    Main,
    /// A call runs on the main thread, the timer is armed, nobody reads.
    Calling,
    /// The helper reads while the call runs.
    Helper,
}

pub(super) struct Reading {
    reader: Mutex<FrameReader>,
    /// The same socket, for the helper to wait on without the reader's lock.
    socket: TcpStream,
    role: Mutex<Role>,
    handed_back: Condvar,
    timer: TimerFd,
    give_back: EventFd,
    queued: Mutex<VecDeque<ToWorker>>,
}

impl Reading {
    pub(super) fn new(reader: FrameReader) -> std::io::Result<Arc<Reading>> {
        let socket = reader.socket().try_clone()?;
        Ok(Arc::new(Reading {
            reader: Mutex::new(reader),
            socket,
            role: Mutex::new(Role::Main),
            handed_back: Condvar::new(),
            timer: TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_CLOEXEC)?,
            give_back: EventFd::from_flags(EfdFlags::EFD_CLOEXEC)?,
            queued: Mutex::new(VecDeque::new()),
        }))
    }

    /// The reader, for the main thread between calls.
    pub(super) fn reader(&self) -> MutexGuard<'_, FrameReader> {
        kolo_sys::lock(&self.reader)
    }

    /// The next message the helper read during the last call, if any.
    pub(super) fn next_queued(&self) -> Option<ToWorker> {
        kolo_sys::lock(&self.queued).pop_front()
    }

    /// The main thread is about to run a call: the helper reads if it
    /// runs for `TAKEOVER`.
    pub(super) fn call_starts(&self) -> std::io::Result<()> {
        let mut role = kolo_sys::lock(&self.role);
        debug_assert_eq!(*role, Role::Main);
        self.timer.set(Expiration::OneShot(TimeSpec::from_duration(TAKEOVER)), TimerSetTimeFlags::empty())?;
        *role = Role::Calling;
        Ok(())
    }

    /// The call ended: the main thread reads again once the helper (if it
    /// took over) has handed the reader back.
    pub(super) fn call_ended(&self) -> std::io::Result<()> {
        let mut role = kolo_sys::lock(&self.role);
        match *role {
            Role::Calling => {
                // a timer that fired meanwhile finds the role taken back
                self.timer.unset()?;
                *role = Role::Main;
            }
            Role::Helper => {
                self.give_back.write(1)?;
                while *role != Role::Main {
                    role = self.handed_back.wait(role).unwrap_or_else(|e| e.into_inner());
                }
            }
            Role::Main => {}
        }
        Ok(())
    }

    /// The helper's loop: waits for a call to run long, then reads (with
    /// `read`, which acts on what must not wait and hands the rest back to
    /// be queued) until the main thread wants the reader back.
    pub(super) fn serve_helper(
        &self,
        mut read: impl FnMut(&mut FrameReader, &mut dyn FnMut(ToWorker)) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        loop {
            self.timer.wait()?;
            {
                let mut role = kolo_sys::lock(&self.role);
                if *role != Role::Calling {
                    continue; // the call ended first
                }
                *role = Role::Helper;
            }
            // frames the main thread read with the call's come first: the
            // socket may have nothing more to say
            let mut readable = true;
            loop {
                if readable {
                    let mut reader = kolo_sys::lock(&self.reader);
                    read(&mut reader, &mut |message| kolo_sys::lock(&self.queued).push_back(message))?;
                }
                let mut fds = [
                    PollFd::new(self.socket.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.give_back.as_fd(), PollFlags::POLLIN),
                ];
                match nix::poll::poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => return Err(e.into()),
                }
                let ready = |fd: &PollFd| fd.revents().is_some_and(|r| !r.is_empty());
                readable = ready(&fds[0]);
                if ready(&fds[1]) {
                    self.give_back.read()?;
                    *kolo_sys::lock(&self.role) = Role::Main;
                    self.handed_back.notify_all();
                    break;
                }
            }
        }
    }
}
