//! Each tensor this rank ran, for `kolo run --timeline` (kolo-timeline):
//! from its submission to the end of the response that ran it, matched
//! across ranks by process set and the order responses ran in, which
//! every rank of a set shares. Not Horovod's own timeline (rank 0's,
//! `HOROVOD_TIMELINE`): that one is `timeline.rs`.

use std::collections::BTreeMap;

use crate::entry::Entry;
use crate::message::Response;

/// The tensors of one response, as they were before it ran.
pub(crate) struct Running {
    set: u32,
    first: u64,
    op: String,
    started_ns: i64,
    /// Per name of the response: (name, bytes, submitted) where this rank had it.
    tensors: Vec<Option<(String, u64, i64)>>,
}

impl Running {
    /// `None` unless this process records; `run` counts each set's tensors.
    pub(crate) fn of(
        set: u32,
        response: &Response,
        entries: &[Option<Entry>],
        run: &mut BTreeMap<u32, u64>,
    ) -> Option<Running> {
        if !kolo_timeline::recording() {
            return None;
        }
        let count = run.entry(set).or_default();
        let first = *count;
        *count += response.names.len() as u64;
        let tensors = entries
            .iter()
            .map(|e| e.as_ref().map(|e| (e.submit.name.clone(), e.submit.input.len as u64, e.submitted_ns)))
            .collect();
        let op = format!("{:?}", response.kind).to_lowercase();
        Some(Running { set, first, op, started_ns: kolo_timeline::now_ns(), tensors })
    }

    /// The response ran (or failed, `ok` false).
    pub(crate) fn ended(self, ok: bool) {
        let ended_ns = kolo_timeline::now_ns();
        for (i, tensor) in self.tensors.iter().enumerate() {
            let Some((name, bytes, submitted_ns)) = tensor else { continue };
            kolo_timeline::record_span(&kolo_timeline::Span {
                source: kolo_timeline::Source::Horovod,
                op: &self.op,
                name,
                key: (u64::from(self.set), self.first + i as u64),
                bytes: *bytes,
                submitted_ns: (*submitted_ns).min(self.started_ns),
                started_ns: self.started_ns,
                ended_ns,
                failed: !ok,
            });
        }
    }
}
