//! Tensors whose memory the core does not reach (a GPU's): the core
//! negotiates them by name like the rest, and hands each agreed response
//! to the process's device executor, which runs the collective where the
//! memory is (torch's NCCL for CUDA tensors). Every rank gets the
//! responses in the same order, so the executor's collectives match.

use crate::message::{Response, ResponseType, CPU_DEVICE_ID};

/// Runs the collective of one response over device memory, before it
/// returns (a device's own queue may still be running it: the executor
/// makes the caller's later work wait for it). An error stops the core:
/// the ranks' device collectives are then out of step.
pub trait DeviceExecutor: Send + Sync + std::fmt::Debug {
    /// Runs `work`'s collective; an error's text becomes the core's failure.
    fn execute(&self, work: &DeviceWork<'_>) -> Result<(), String>;
}

/// One response for the device executor.
pub struct DeviceWork<'a> {
    /// The process set it runs in.
    pub set: u32,
    /// The agreed response: which collective, over which names and sizes.
    pub response: &'a Response,
    /// The input address this rank submitted under each of the response's
    /// names (what tells its tensor apart from another submitted under the
    /// same name); none for a rank that joined, which takes part with zeros.
    pub inputs: Vec<Option<usize>>,
}

/// Whether a response runs on the device executor: a collective over
/// tensors that some rank holds outside host memory (negotiation has made
/// sure that no rank holds its tensor in host memory then, except one
/// that joined).
pub(crate) fn on_device(response: &Response) -> bool {
    matches!(
        response.kind,
        ResponseType::Allreduce
            | ResponseType::Adasum
            | ResponseType::Allgather
            | ResponseType::Broadcast
            | ResponseType::Alltoall
            | ResponseType::Reducescatter
    ) && response.devices.iter().any(|&d| d != CPU_DEVICE_ID)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_collectives_with_a_device_tensor_go_to_the_executor() {
        let mut r = Response::new(ResponseType::Allreduce, "allreduce.x");
        r.devices = vec![CPU_DEVICE_ID, CPU_DEVICE_ID];
        assert!(!on_device(&r));
        // a joined rank's slot stays on the host
        r.devices = vec![0, CPU_DEVICE_ID];
        assert!(on_device(&r));
        r.kind = ResponseType::Error;
        assert!(!on_device(&r));
        r.kind = ResponseType::Join;
        assert!(!on_device(&r));
    }
}
