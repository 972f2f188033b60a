//! `kolo run --timeline FILE` (checked before the job; kolo-exec's
//! executor writes it at the job's end) and `kolo timeline FILE` (its
//! summary).

use std::path::Path;

use anyhow::{Context, Result};

/// `kolo timeline FILE`.
pub(crate) fn summarize(file: &Path) -> Result<i32> {
    let text = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let trace: serde_json::Value = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not JSON (a trace of kolo run --timeline is)", file.display()))?;
    let summary = kolo_timeline::Summary::of_trace(&trace).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    print!("{summary}");
    Ok(0)
}
