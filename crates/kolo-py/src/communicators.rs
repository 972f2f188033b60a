//! An address book kept in this process, for communicators of one rank.

use std::sync::Mutex;
use std::time::Duration;

use kolo_comm::AddressBook;

/// An address book within this process (a one-rank communicator's).
#[derive(Default)]
pub(crate) struct LocalBook(Mutex<std::collections::HashMap<String, Vec<u8>>>);

impl AddressBook for LocalBook {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        kolo_sys::lock(&self.0).insert(key.to_string(), value.to_vec());
        Ok(())
    }

    fn wait(&self, key: &str, _: Duration) -> Result<Option<Vec<u8>>, String> {
        Ok(kolo_sys::lock(&self.0).get(key).cloned())
    }
}
