//! A second request to stop while a job is stopping (Ctrl-C twice) means
//! "now", as mpirun users expect: teardown skips what is left of the kill
//! grace. Signals are the process's, so this is too: the front end that
//! catches them calls [`hurry`], every teardown in the process listens.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

use tokio::sync::Notify;

static HURRIED_BY: AtomicI32 = AtomicI32::new(0);

fn notify() -> &'static Notify {
    static NOTIFY: OnceLock<Notify> = OnceLock::new();
    NOTIFY.get_or_init(Notify::new)
}

/// Asks every teardown in this process to kill what still runs now.
pub fn hurry(signal: i32) {
    HURRIED_BY.store(signal.max(1), Ordering::SeqCst);
    notify().notify_waiters();
}

/// Forgets an earlier [`hurry`], for a process that goes on after the
/// teardown it hurried (a Python driver whose caller caught Ctrl-C's
/// KeyboardInterrupt): its later teardowns take their grace again.
pub fn calm() {
    HURRIED_BY.store(0, Ordering::SeqCst);
}

/// Resolves once [`hurry`] was called (at once if it was already), with
/// the signal that asked.
pub async fn hurried() -> i32 {
    loop {
        let notified = notify().notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match HURRIED_BY.load(Ordering::SeqCst) {
            0 => notified.await,
            signal => return signal,
        }
    }
}
