//! The core's settings (upstream's `utils/env_parser.cc` and the knobs of
//! `global_state.h`), read once, at start, from `HOROVOD_*`.

use std::time::Duration;

use crate::autotune::AutotuneSettings;
use crate::stall::StallSettings;
use crate::timeline::TimelineTarget;

/// The knobs upstream reads from the environment once, at start.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// `HOROVOD_CYCLE_TIME` (ms, default 1).
    pub cycle_time: Duration,
    /// `HOROVOD_FUSION_THRESHOLD` (bytes, default 128 MiB; 0: no fusion).
    pub fusion_threshold: u64,
    /// `HOROVOD_CACHE_CAPACITY` (default 1024; 0: no cache).
    pub cache_capacity: usize,
    /// The stall inspector's switches and times (`HOROVOD_STALL_*`).
    pub stall: StallSettings,
    /// `HOROVOD_DYNAMIC_PROCESS_SETS`: sets may come and go after start.
    pub dynamic_sets: bool,
    /// Where the coordinator writes its last stall warning for kolo's hang
    /// report (`KOLO_STALL_FILE`, set by the rank's agent).
    pub stall_file: Option<std::path::PathBuf>,
    /// `HOROVOD_TIMELINE`: a file rank 0 records into, or `DYNAMIC`.
    pub timeline: Option<TimelineTarget>,
    /// `HOROVOD_TIMELINE_MARK_CYCLES`: a `CYCLE_START` mark per cycle.
    pub timeline_mark_cycles: bool,
    /// `HOROVOD_AUTOTUNE` and its knobs; None: off.
    pub autotune: Option<AutotuneSettings>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cycle_time: Duration::from_millis(1),
            fusion_threshold: 128 << 20,
            cache_capacity: 1024,
            stall: StallSettings::default(),
            dynamic_sets: false,
            stall_file: None,
            timeline: None,
            timeline_mark_cycles: false,
            autotune: None,
        }
    }
}

impl Settings {
    /// From `HOROVOD_*` as upstream reads them (booleans are set when a
    /// number above 0); a value that is not a number is an error naming it.
    pub fn from_env() -> Result<Settings, String> {
        Settings::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading each variable through `var`
    /// (tests pass a map).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let mut s = Settings::default();
        let number = |name: &str| -> Result<Option<f64>, String> {
            match var(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
                None => Ok(None),
                Some(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .map(Some)
                    .ok_or_else(|| format!("{name}='{v}' is not a number of 0 or more")),
            }
        };
        if let Some(ms) = number("HOROVOD_CYCLE_TIME")? {
            s.cycle_time = Duration::from_secs_f64(ms / 1000.0);
        }
        if let Some(b) = number("HOROVOD_FUSION_THRESHOLD")? {
            s.fusion_threshold = b as u64;
        }
        if let Some(c) = number("HOROVOD_CACHE_CAPACITY")? {
            s.cache_capacity = c as usize;
        }
        let flag = |name: &str| number(name).map(|v| v.is_some_and(|v| v > 0.0));
        s.dynamic_sets = flag("HOROVOD_DYNAMIC_PROCESS_SETS")?;
        s.stall.enabled = !flag("HOROVOD_STALL_CHECK_DISABLE")?;
        if let Some(t) = number("HOROVOD_STALL_CHECK_TIME_SECONDS")? {
            s.stall.warning = Duration::from_secs(t as u64);
        }
        if let Some(t) = number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")? {
            s.stall.shutdown = Duration::from_secs(t as u64);
        }
        s.timeline = var("HOROVOD_TIMELINE").filter(|t| !t.is_empty()).map(|t| match t.as_str() {
            "DYNAMIC" => TimelineTarget::Dynamic,
            _ => TimelineTarget::File(t.into()),
        });
        s.timeline_mark_cycles = flag("HOROVOD_TIMELINE_MARK_CYCLES")?;
        s.autotune = AutotuneSettings::from_lookup(&var)?;
        s.stall_file = var(kolo_topology::env_names::STALL_FILE).filter(|f| !f.is_empty()).map(Into::into);
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_is_a_file_or_dynamic_and_cycles_are_marked_on_a_flag() {
        let of = |pairs: &'static [(&'static str, &'static str)]| {
            Settings::from_lookup(|n| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
        };
        assert_eq!(of(&[]).unwrap().timeline, None);
        assert_eq!(of(&[("HOROVOD_TIMELINE", "")]).unwrap().timeline, None);
        let file = of(&[("HOROVOD_TIMELINE", "/tmp/t.json"), ("HOROVOD_TIMELINE_MARK_CYCLES", "1")]).unwrap();
        assert_eq!(file.timeline, Some(TimelineTarget::File("/tmp/t.json".into())));
        assert!(file.timeline_mark_cycles);
        assert_eq!(of(&[("HOROVOD_TIMELINE", "DYNAMIC")]).unwrap().timeline, Some(TimelineTarget::Dynamic));
        let bad = of(&[("HOROVOD_TIMELINE_MARK_CYCLES", "yes")]).unwrap_err();
        assert!(bad.contains("HOROVOD_TIMELINE_MARK_CYCLES"), "{bad}");
    }
}
