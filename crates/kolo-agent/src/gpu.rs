//! A rank's GPU use, through NVML (nvml-wrapper, which loads the driver's
//! library when first asked): nothing on a machine without one.

use std::sync::OnceLock;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

/// What the rank's processes hold and how busy their GPUs are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GpuUse {
    /// The busiest of the GPUs the rank runs on, over NVML's last sample period.
    pub(crate) percent: f64,
    /// GPU memory the rank's processes hold, on every GPU.
    pub(crate) memory_bytes: u64,
}

/// NVML, once loaded; none where the driver's library is missing.
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        // the versioned name: the unversioned one comes with the driver's
        // development files only
        Nvml::builder().lib_path("libnvidia-ml.so.1".as_ref()).init().or_else(|_| Nvml::init()).ok()
    })
    .as_ref()
}

/// Whether `pid` is `rank_pid` or in its process group (the rank's
/// command and what it started).
fn of_rank(pid: u32, rank_pid: u32) -> bool {
    pid == rank_pid || process_group(pid) == Some(rank_pid)
}

fn process_group(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // after the command: state, ppid, pgrp
    stat.rsplit_once(')')?.1.split_whitespace().nth(2)?.parse().ok()
}

/// The GPU use of the rank whose process (and process group) is `rank_pid`;
/// none without NVML or when it runs on no GPU.
pub(crate) fn usage(rank_pid: u32) -> Option<GpuUse> {
    let nvml = nvml()?;
    let mut found: Option<GpuUse> = None;
    for index in 0..nvml.device_count().ok()? {
        let Ok(device) = nvml.device_by_index(index) else { continue };
        let processes = device.running_compute_processes().unwrap_or_default();
        let mine: Vec<_> = processes.iter().filter(|p| of_rank(p.pid, rank_pid)).collect();
        if mine.is_empty() {
            continue;
        }
        let held: u64 = mine
            .iter()
            .map(|p| match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => bytes,
                UsedGpuMemory::Unavailable => 0,
            })
            .sum();
        let busy = device.utilization_rates().map_or(0.0, |u| f64::from(u.gpu));
        let total = found.get_or_insert(GpuUse { percent: 0.0, memory_bytes: 0 });
        total.percent = total.percent.max(busy);
        total.memory_bytes += held;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_belongs_to_the_rank_it_leads_or_whose_group_it_is_in() {
        let me = std::process::id();
        assert!(of_rank(me, me));
        let group = process_group(me).expect("this process's group");
        assert!(of_rank(me, group));
        assert!(!of_rank(me, u32::MAX));
    }

    #[test]
    fn a_machine_without_nvml_gives_no_gpu_use_rather_than_an_error() {
        // on a GPU machine this process holds no GPU memory: none either way
        assert_eq!(usage(std::process::id()), None);
    }
}
