//! The token that ends a communicator's waits when its elastic round is
//! over: the bootstrap and every collective ask it while they make no
//! progress.

use std::sync::Arc;

use crate::CommError;

/// Ends the waits of a communicator when its round is over: asked every
/// few tens of milliseconds while a bootstrap or a collective makes no
/// progress, it answers the new round's number once there is one, and the
/// wait fails with [`CommError::Interrupted`]. An elastic job's
/// communicators carry one ([`crate::elastic`]), so that a collective stuck
/// on a peer that vanished without closing its sockets (a host cut off)
/// ends as soon as kolo's driver has started a round without it.
#[derive(Clone)]
pub struct Interrupt(Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl Interrupt {
    /// Wraps `check`, which answers the new round's number once there is
    /// one and `None` until then.
    pub fn new(check: impl Fn() -> Option<u64> + Send + Sync + 'static) -> Interrupt {
        Interrupt(Arc::new(check))
    }

    pub(crate) fn check(&self) -> Result<(), CommError> {
        match (self.0)() {
            Some(round) => Err(CommError::Interrupted { round }),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupt")
    }
}

pub(crate) fn check_interrupt(interrupt: &Option<Interrupt>) -> Result<(), CommError> {
    interrupt.as_ref().map_or(Ok(()), Interrupt::check)
}
