//! Where an elastic job's hosts come from: a discovery script, a source
//! such as a Ray cluster's nodes, or a fixed list; asked every interval.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kolo_topology::{parse_discovery, Decision, Event, HostSpec, Membership};

use kolo_engine::ExecError;
pub use kolo_engine::HostSource;

/// The longest a discovery script may run.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the hosts come from and how often to ask.
#[derive(Clone, Debug)]
pub struct Discovery {
    /// A script printing `host[:slots]` lines; none: `source`, else `fixed`.
    pub script: Option<PathBuf>,
    /// An engine's own source of hosts (a Ray cluster's alive nodes), used
    /// when there is no script.
    pub source: Option<Arc<dyn HostSource>>,
    /// The hosts when there is neither a script nor a source.
    pub fixed: Vec<HostSpec>,
    /// How long between two discoveries.
    pub interval: Duration,
    /// Slots of a host the script prints without `:slots`.
    pub slots_per_host: u32,
}

impl Discovery {
    /// A fixed host list, looked at every second.
    pub fn fixed(hosts: Vec<HostSpec>) -> Discovery {
        Discovery { script: None, source: None, fixed: hosts, interval: Duration::from_secs(1), slots_per_host: 1 }
    }

    /// Whether the hosts never change (a fixed list).
    pub fn is_fixed(&self) -> bool {
        self.script.is_none() && self.source.is_none()
    }

    /// Asks the script or source once: its hosts, or why not.
    pub async fn hosts(&self) -> Result<Vec<HostSpec>, ExecError> {
        if let (None, Some(source)) = (&self.script, &self.source) {
            let source = source.clone();
            return tokio::task::spawn_blocking(move || source.hosts())
                .await
                .map_err(|e| ExecError::Discovery(format!("host discovery: {e}")))?;
        }
        let Some(script) = &self.script else { return Ok(self.fixed.clone()) };
        let bad = |what: String| ExecError::Discovery(format!("host discovery script {}: {what}", script.display()));
        let run = |program: &Path, args: &[&Path]| {
            let out = tokio::process::Command::new(program).args(args).kill_on_drop(true).output();
            tokio::time::timeout(DISCOVERY_TIMEOUT, out)
        };
        let too_long = |_| bad(format!("ran longer than {DISCOVERY_TIMEOUT:?}"));
        let out = match run(script, &[]).await.map_err(too_long)? {
            // a script without a `#!` line runs in the shell, as a shell
            // (and horovodrun, which runs it through one) would run it
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOEXEC) => {
                run(Path::new("/bin/sh"), &[script.as_path()]).await.map_err(too_long)?
            }
            other => other,
        }
        .map_err(|e| {
            let script = script.display();
            ExecError::Discovery(format!("cannot run host discovery script {script} (is it executable?): {e}"))
        })?;
        if !out.status.success() {
            return Err(bad(format!("failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim())));
        }
        let text = String::from_utf8(out.stdout).map_err(|_| bad("printed something not UTF-8".into()))?;
        parse_discovery(&text, self.slots_per_host).map_err(|e| bad(e.to_string()))
    }

    /// Asks again and tells `membership`; a failing script keeps the last
    /// hosts (and says so).
    pub async fn poll(&self, membership: &mut Membership, now: Duration) -> Decision {
        Self::decide(self.hosts().await, membership, now)
    }

    /// Tells `membership` what one discovery found; a failure keeps the
    /// last hosts (and says so).
    pub fn decide(found: Result<Vec<HostSpec>, ExecError>, membership: &mut Membership, now: Duration) -> Decision {
        match found {
            Ok(hosts) => membership.on(Event::Discovered(&hosts), now),
            Err(e) => {
                tracing::warn!("{e}; keeping the hosts discovered before");
                membership.on(Event::Tick, now)
            }
        }
    }

    /// Discovers again every `interval` on a task of its own, each answer
    /// sent as it comes; the next discovery starts once the last answer
    /// was taken. The task ends with the receiver.
    pub fn watch(&self) -> tokio::sync::mpsc::Receiver<Result<Vec<HostSpec>, ExecError>> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let discovery = self.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(discovery.interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let found = tokio::select! {
                    found = discovery.hosts() => found,
                    () = tx.closed() => return,
                };
                if tx.send(found).await.is_err() {
                    return;
                }
            }
        });
        rx
    }
}
