//! How the Python front ends get their communicators: the kolo job's,
//! from the variables kolo sets its ranks, or one of a single rank for a
//! process outside any job (its addresses in a book kept in-process).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kolo_comm::{AddressBook, CommError, Communicator, Config};
use pyo3::prelude::*;

/// The job's communicator, from its environment. `family` and `generation`
/// make its job id unique among the communicators the same processes make
/// (each front end has its family; every rank counts inits alike).
/// `timeout_s`: how long a bootstrap or a collective may wait without
/// progress (the job's start timeout when not given).
pub(crate) fn from_job_env(
    py: Python<'_>,
    family: &str,
    generation: u64,
    timeout_s: Option<f64>,
) -> PyResult<Communicator> {
    py.allow_threads(|| {
        let mut config = Config::from_env()?;
        config.job_id = format!("{}-{family}{generation}", config.job_id);
        if let Some(s) = timeout_s {
            config = config.with_timeout(seconds(s));
        }
        Communicator::connect(config)
    })
    .map_err(crate::errors::comm_error)
}

/// A communicator of one rank, named `job`.
pub(crate) fn single(py: Python<'_>, job: &str) -> PyResult<Communicator> {
    py.allow_threads(|| {
        let secret = kolo_comm::Secret::new("single").map_err(CommError::Secret)?;
        let book: Arc<dyn AddressBook> = Arc::new(LocalBook::default());
        Communicator::connect(Config::new(0, 1, "this-host", "", secret, job)?.with_book(book))
    })
    .map_err(crate::errors::comm_error)
}

/// A time limit Python passed, kept within what a `Duration` holds.
pub(crate) fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.001, 1e9))
}

/// An address book within this process (a one-rank communicator's).
#[derive(Default)]
struct LocalBook(Mutex<HashMap<String, Vec<u8>>>);

impl AddressBook for LocalBook {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        kolo_sys::lock(&self.0).insert(key.to_string(), value.to_vec());
        Ok(())
    }

    fn wait(&self, key: &str, _: Duration) -> Result<Option<Vec<u8>>, String> {
        Ok(kolo_sys::lock(&self.0).get(key).cloned())
    }
}
