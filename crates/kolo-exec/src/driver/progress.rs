//! A one-line progress report for long waits.

use std::time::Duration;

use tokio::time::Instant;

/// A one-line progress report on stderr for waits over a second, shown
/// only when stderr is a terminal and erased when the wait ends.
pub(crate) struct Progress {
    what: &'static str,
    since: Instant,
    shown: bool,
    tty: bool,
    last: String,
}

impl Progress {
    pub(crate) fn new(what: &'static str) -> Self {
        use std::io::IsTerminal;
        Progress {
            what,
            since: Instant::now(),
            shown: false,
            tty: std::io::stderr().is_terminal(),
            last: String::new(),
        }
    }

    pub(crate) fn show(&mut self, state: &str, limit: Duration) {
        let waited = self.since.elapsed();
        if self.tty && waited > Duration::from_secs(1) {
            let line = format!("kolo: {}: {state} ({} s of {:.0} s)", self.what, waited.as_secs(), limit.as_secs_f64());
            if line != self.last {
                eprint!("\r{line}\x1b[K");
                self.last = line;
                self.shown = true;
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.shown {
            eprint!("\r\x1b[K");
        }
    }
}
