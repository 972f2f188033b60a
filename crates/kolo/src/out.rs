//! kolo's own output. A reader that goes away (`kolo ... | head`) ends what
//! kolo prints, quietly: no panic, no broken-pipe message.

use std::io::Write;

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Said {
    Written,
    /// The reader is gone; stop printing.
    Closed,
}

/// One line on stdout.
pub(crate) fn say(line: &str) -> std::io::Result<Said> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|_| out.flush()) {
        Ok(()) => Ok(Said::Written),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(Said::Closed),
        Err(e) => Err(e),
    }
}

/// One line on stderr; a closed stderr is ignored.
pub(crate) fn tell(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
