//! Running what the ranks agreed (upstream's `PerformOperation` in
//! `operations.cc`): each response's collective over its tensors' memory
//! (`exec`), or the device executor's for device tensors; errors,
//! barriers, joins and process-set changes; each entry finished as its
//! part is done.

use kolo_comm::CommError;

use crate::controller::{SetLoop, Stop};
use crate::device::{self, DeviceWork};
use crate::entry::{Entry, Failure, Output};
use crate::exec::{self, Aligned};
use crate::message::{Response, ResponseType};
use crate::state::{SetShared, Shared};
use crate::timeline::{self, Trace};

/// A process set a response added or removed: the loop makes or drops
/// its own side of it.
pub(crate) enum SetChange {
    /// Every rank registered `id` with these global ranks; its entries
    /// are finished once the loop has made it.
    Added {
        id: u32,
        ranks: Vec<u32>,
    },
    Removed(u32),
}

/// Runs one response of set `id` on `set`; each entry is taken from
/// `entries` as it finishes. A process set added or removed is the
/// loop's to make or drop: returned (an added set's entries wait for it).
pub(crate) fn perform(
    set: &mut SetLoop,
    shared: &Shared,
    id: u32,
    response: Response,
    fusion: &mut Aligned,
    entries: &mut [Option<Entry>],
) -> Result<Option<SetChange>, Stop> {
    let trace = Trace::of(shared);
    if device::on_device(&response) {
        let executor = shared.device.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(executor) = executor else {
            let no = "a tensor outside host memory came to Horovod's core, and nothing runs device collectives in \
                      this process";
            for entry in take_all(entries) {
                entry.finish(Err(Failure::invalid(no)));
            }
            return Ok(None);
        };
        let inputs = entries.iter().map(|e| e.as_ref().map(|e| e.submit.input.addr)).collect();
        trace
            .around(&response.names, timeline::device_name(response.kind), || {
                executor.execute(&DeviceWork { set: id, response: &response, inputs })
            })
            .map_err(|message| Stop::Failed(Failure::internal(message)))?;
        for entry in take_all(entries) {
            entry.finish(Ok(Output::default()));
        }
        return Ok(None);
    }
    match response.kind {
        ResponseType::Error => {
            for entry in take_all(entries) {
                entry.finish(Err(Failure::internal(response.error.clone())));
            }
        }
        ResponseType::Allreduce | ResponseType::Adasum => {
            let refs: Vec<Option<&Entry>> = entries.iter().map(Option::as_ref).collect();
            let outputs = exec::allreduce(&mut set.comm, &response, &refs, fusion, trace)?;
            finish_all(entries.iter_mut().map(Option::take), outputs);
        }
        ResponseType::Allgather => {
            let refs: Vec<&Entry> = entries.iter().flatten().collect();
            let activity = timeline::collective_name(response.kind);
            let outputs =
                trace.around(&response.names, activity, || exec::allgather(&mut set.comm, &response, &refs))?;
            finish_all(entries.iter_mut().filter_map(Option::take).map(Some), outputs);
        }
        ResponseType::Broadcast => {
            run_each(entries, (trace, &response), |_, entry| exec::broadcast(&mut set.comm, entry))?
        }
        ResponseType::Alltoall => {
            run_each(entries, (trace, &response), |_, entry| exec::alltoall(&mut set.comm, entry))?
        }
        ResponseType::Reducescatter => {
            let per = response.sizes.len() / response.names.len().max(1);
            run_each(entries, (trace, &response), |i, entry| {
                let mut single = response.clone();
                single.names = vec![response.names[i].clone()];
                single.sizes = response.sizes[i * per..(i + 1) * per].to_vec();
                exec::reducescatter(&mut set.comm, &single, entry)
            })?
        }
        ResponseType::Barrier => {
            set.comm.barrier()?;
            for entry in take_all(entries) {
                entry.finish(Ok(Output::default()));
            }
        }
        ResponseType::Join => {
            {
                let mut state = shared.lock();
                state.sets.get_mut(&id).expect("held").joined = false;
            }
            for entry in take_all(entries) {
                entry.finish(Ok(Output { last_joined_rank: response.last_joined_rank, ..Output::default() }));
            }
        }
        ResponseType::AddProcessSet => {
            let ranks: Vec<u32> = response.sizes.iter().map(|&r| r as u32).collect();
            let added = {
                let mut state = shared.lock();
                let added = state.ids.add(&response.sizes);
                if let Ok(new_id) = added {
                    let set = SetShared::new(ranks.clone(), shared.rank);
                    state.sets.insert(new_id, set);
                }
                added
            };
            match added {
                Ok(new_id) => return Ok(Some(SetChange::Added { id: new_id, ranks })),
                Err(e) => {
                    for entry in take_all(entries) {
                        entry.finish(Err(Failure::invalid(e.to_string())));
                    }
                }
            }
        }
        ResponseType::RemoveProcessSet => {
            let gone = response.sizes.first().copied().unwrap_or(0) as u32;
            let pending: Vec<Entry> = {
                let mut state = shared.lock();
                let _ = state.ids.remove(gone);
                state.sets.remove(&gone).map(|s| s.table.into_values().collect()).unwrap_or_default()
            };
            for entry in pending {
                entry.finish(Err(Failure::internal("Process set has been removed")));
            }
            for entry in take_all(entries) {
                entry.finish(Ok(Output::default()));
            }
            return Ok(Some(SetChange::Removed(gone)));
        }
    }
    Ok(None)
}

/// The entries still unfinished, taken out.
pub(crate) fn take_all(entries: &mut [Option<Entry>]) -> Vec<Entry> {
    entries.iter_mut().filter_map(Option::take).collect()
}

/// Runs each present entry's collective in order (`run` gets its index),
/// finishing it as soon as it is done; the first failure stops the rest.
/// Each is its tensor's activity on the trace.
fn run_each(
    entries: &mut [Option<Entry>],
    (trace, response): (Trace<'_>, &Response),
    mut run: impl FnMut(usize, &Entry) -> Result<Output, CommError>,
) -> Result<(), CommError> {
    let activity = timeline::collective_name(response.kind);
    for (i, slot) in entries.iter_mut().enumerate() {
        let Some(entry) = slot.as_ref() else { continue };
        let name = [response.names[i].as_str()];
        trace.activity(name, activity);
        let out = run(i, entry)?;
        trace.activity_end(name);
        slot.take().expect("present").finish(Ok(out));
    }
    Ok(())
}

fn finish_all(entries: impl IntoIterator<Item = Option<Entry>>, outputs: Vec<Output>) {
    for (entry, output) in entries.into_iter().zip(outputs) {
        if let Some(entry) = entry {
            entry.finish(Ok(output));
        }
    }
}
