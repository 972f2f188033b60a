//! kolo's collective exceptions, shared by `kolo.torch`, `hvd` and the
//! elastic loops: a failed collective is a `CollectiveError`; a change of
//! the job's membership its subclass `MembershipError`, which elastic loops
//! go on after.

use kolo_comm::CommError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

pyo3::create_exception!(
    _kolo,
    CollectiveError,
    PyRuntimeError,
    "A collective failed: a peer died or disagreed, or the group was closed."
);

// a collective's failure too: kolo.horovod and kolo.torch catch
// CollectiveError; elastic loops tell membership changes apart by this type
pyo3::create_exception!(_kolo, MembershipError, CollectiveError, "The job's membership changed: join the next round.");
pyo3::create_exception!(_kolo, HostsUpdated, MembershipError, "Hosts came or went: join the new round.");
pyo3::create_exception!(_kolo, Removed, pyo3::exceptions::PyException, "This worker has no place in the new round.");

/// kolo-comm's error as the exception elastic loops and hvd tell apart.
pub(crate) fn comm_error(e: CommError) -> PyErr {
    match e {
        CommError::Removed { .. } => Removed::new_err(e.to_string()),
        CommError::HostsUpdated { .. } => HostsUpdated::new_err(e.to_string()),
        e if e.is_membership() => MembershipError::new_err(e.to_string()),
        e => CollectiveError::new_err(e.to_string()),
    }
}

/// A queued collective's failure: `MembershipError` when the job's
/// membership changed, `CollectiveError` otherwise.
pub(crate) fn collective_failed(message: String, membership: bool) -> PyErr {
    if membership {
        MembershipError::new_err(message)
    } else {
        CollectiveError::new_err(message)
    }
}
