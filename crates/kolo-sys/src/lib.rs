//! kolo-sys: what every kolo process needs from the operating system, the
//! driver and the worker agents alike: the guard that cleans up after a
//! process killed with SIGKILL, process groups, who owns a local socket,
//! the one way to wait on a condition, and locks that survive a panic.
//! No kolo protocol and no policy here.

#![warn(missing_docs)]

pub mod guard;
pub mod hurry;
pub mod process;
pub mod sockets;
pub mod wait;

pub use guard::{Guard, GuardOptions};
pub use hurry::{calm, hurried, hurry};

/// Locks `mutex` even if a thread panicked while holding it: what kolo
/// keeps behind its locks is whole at every point a panic could happen,
/// and one panicking task must not take the driver or an agent down.
pub fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
