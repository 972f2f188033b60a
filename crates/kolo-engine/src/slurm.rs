//! The Slurm engine: workers started with one `srun` over the nodes of an
//! allocation, each task placed exactly where kolo's plan says (an
//! arbitrary distribution from a host file). Inside an allocation (`salloc`,
//! `sbatch`) it uses that one; outside, it asks Slurm for one and gives it
//! back at the end (the driver's janitor gives it back even if the driver
//! is killed). Worker death, `scancel` and time limits end the tasks,
//! whose connections close, and the driver reports them. The secret goes
//! to the tasks in srun's environment (Slurm has no per-task stdin).

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kolo_topology::{expand_nodelist, expand_tasks_per_node, HostResources};

use super::{Engine, WorkerLaunch};
use crate::ExecError;
use kolo_proto::launch as worker;
use kolo_sys::guard::Guard;

/// What to ask Slurm for when kolo makes the allocation itself.
#[derive(Clone, Debug, Default)]
pub struct SlurmOptions {
    /// Nodes to spread the tasks over evenly (`salloc -N`); none: one.
    pub nodes: Option<u32>,
    /// The partition (`salloc -p`); none: Slurm's default.
    pub partition: Option<String>,
    /// Slurm's time format (`10`, `1:00:00`, ...).
    pub time_limit: Option<String>,
    /// More `salloc` arguments.
    pub extra: Vec<String>,
}

/// Starts workers as the tasks of one `srun` step, in the allocation this
/// process runs in or in one it asks Slurm for.
pub struct SlurmEngine {
    /// The allocation, once there is one.
    job_id: Option<String>,
    nodes: Vec<(String, u32)>,
    /// What to ask for when there is no allocation yet.
    request: Option<(u32, SlurmOptions)>,
    /// Whether kolo made the allocation (and so gives it back).
    owned: bool,
    srun: Option<Child>,
    /// When the step was asked to end, if it was.
    ending: Option<std::time::Instant>,
    /// srun's step name, to find the step by.
    step_name: Option<String>,
    /// Private directory of the task layout file.
    dir: Option<tempfile::TempDir>,
    workers: Vec<u32>,
}

/// How long the step's processes have between SIGTERM and srun's SIGKILL.
const SRUN_TERM_GRACE: Duration = Duration::from_millis(1500);

fn slurm_err(what: &str, detail: impl std::fmt::Display) -> ExecError {
    ExecError::Slurm { what: what.to_string(), detail: detail.to_string() }
}

impl SlurmEngine {
    /// Whether this process runs inside a Slurm allocation.
    pub fn in_allocation() -> bool {
        std::env::var_os("SLURM_JOB_ID").is_some()
    }

    /// The allocation this process runs in.
    pub fn from_allocation() -> Result<Self, ExecError> {
        let (job_id, nodes) = Self::allocation()?;
        Ok(Self::new(Some(job_id), nodes, None))
    }

    /// The id and the nodes (each with its tasks) of the allocation this
    /// process runs in, from Slurm's variables.
    fn allocation() -> Result<(String, Vec<(String, u32)>), ExecError> {
        let var = |n: &str| {
            std::env::var(n).map_err(|_| slurm_err("not inside a Slurm allocation", format!("{n} is not set")))
        };
        let job_id = var("SLURM_JOB_ID")?;
        let nodes = expand_nodelist(&var("SLURM_JOB_NODELIST")?)?;
        let tasks = match std::env::var("SLURM_TASKS_PER_NODE") {
            Ok(spec) => expand_tasks_per_node(&spec)?,
            Err(_) => vec![1; nodes.len()],
        };
        if tasks.len() != nodes.len() {
            return Err(slurm_err("SLURM_TASKS_PER_NODE", format!("{} counts for {} nodes", tasks.len(), nodes.len())));
        }
        Ok((job_id, nodes.into_iter().zip(tasks).collect()))
    }

    /// The nodes of the allocation this process runs in, each with its
    /// tasks as slots: the hosts there are (none outside an allocation).
    pub fn allocation_hosts() -> Result<Vec<kolo_topology::HostSpec>, ExecError> {
        if !Self::in_allocation() {
            return Ok(Vec::new());
        }
        let (_, nodes) = Self::allocation()?;
        Ok(nodes.into_iter().map(|(name, tasks)| kolo_topology::HostSpec::new(name, tasks)).collect())
    }

    /// The allocation this process runs in, restricted to `hosts` (all of
    /// it when empty), each with its slots as tasks: an elastic job's
    /// round or cohort on the nodes it keeps.
    pub fn within_allocation(hosts: &[kolo_topology::HostSpec]) -> Result<Self, ExecError> {
        let mut engine = Self::from_allocation()?;
        if hosts.is_empty() {
            return Ok(engine);
        }
        let mut nodes = Vec::with_capacity(hosts.len());
        for host in hosts {
            if !engine.nodes.iter().any(|(name, _)| name == &host.name) {
                let have: Vec<&str> = engine.nodes.iter().map(|(n, _)| n.as_str()).collect();
                return Err(slurm_err(
                    "host list",
                    format!(
                        "{} is not a node of allocation {} ({})",
                        host.name,
                        engine.job_id.as_deref().unwrap_or("?"),
                        have.join(",")
                    ),
                ));
            }
            nodes.push((host.name.clone(), host.slots));
        }
        engine.nodes = nodes;
        Ok(engine)
    }

    /// An engine that asks Slurm for `np` tasks (on `options.nodes` nodes,
    /// evenly) when the driver first needs hosts, and gives them back.
    pub fn allocate(np: u32, options: SlurmOptions) -> Self {
        Self::new(None, Vec::new(), Some((np, options)))
    }

    /// Runs `salloc`, waiting in the queue up to `timeout`.
    fn request_allocation(&mut self, np: u32, options: &SlurmOptions, timeout: Duration) -> Result<(), ExecError> {
        let nodes = options.nodes.unwrap_or(1).max(1);
        let per_node = np.div_ceil(nodes);
        let mut salloc = Command::new("salloc");
        salloc.args(["--no-shell", "--job-name", "kolo", "-N", &nodes.to_string()]);
        // the placement timeout: Slurm itself gives up waiting in the queue
        salloc.arg(format!("--immediate={}", timeout.as_secs().max(1)));
        salloc.args(["--ntasks-per-node", &per_node.to_string()]);
        if let Some(p) = &options.partition {
            salloc.args(["-p", p]);
        }
        if let Some(t) = &options.time_limit {
            salloc.args(["-t", t]);
        }
        salloc.args(&options.extra);
        let started = std::time::Instant::now();
        let mut child = salloc
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ExecError::Io { what: "cannot run salloc (is Slurm installed?)".into(), source })?;
        // salloc says on stderr when the job waits in the queue: pass that
        // on as progress, keep everything for its job id or its reason
        let mut text = String::new();
        if let Some(stderr) = child.stderr.take() {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("queued") || line.contains("Pending") {
                    eprintln!("kolo: waiting for Slurm (up to {} s): {line}", timeout.as_secs().max(1));
                }
                text.push_str(&line);
                text.push('\n');
            }
        }
        let status = child.wait().map_err(|source| ExecError::Io { what: "waiting for salloc".into(), source })?;
        if !status.success() {
            let asked = format!("{nodes} node(s) x {per_node} task(s)");
            let what = if started.elapsed() + Duration::from_millis(500) >= timeout {
                format!(
                    "salloc got no allocation of {asked} within the placement timeout ({} s)",
                    timeout.as_secs().max(1)
                )
            } else {
                format!("salloc refused an allocation of {asked}")
            };
            return Err(slurm_err(&what, text.trim()));
        }
        let job_id = text
            .split_whitespace()
            .skip_while(|w| *w != "allocation")
            .nth(1)
            .map(String::from)
            .ok_or_else(|| slurm_err("salloc did not say which allocation it granted", text.trim()))?;
        let list = Command::new("squeue").args(["-h", "-j", &job_id, "-o", "%N"]).output();
        let list = match list {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
            _ => {
                let _ = Command::new("scancel").arg(&job_id).status();
                return Err(slurm_err("cannot list the nodes of allocation", &job_id));
            }
        };
        let names = expand_nodelist(&list)?;
        self.nodes = names.into_iter().map(|n| (n, per_node)).collect();
        self.job_id = Some(job_id);
        self.owned = true;
        Ok(())
    }

    fn new(job_id: Option<String>, nodes: Vec<(String, u32)>, request: Option<(u32, SlurmOptions)>) -> Self {
        SlurmEngine {
            job_id,
            nodes,
            request,
            owned: false,
            srun: None,
            ending: None,
            step_name: None,
            dir: None,
            workers: Vec::new(),
        }
    }

    /// The allocation's id, once there is one.
    pub fn job_id(&self) -> Option<&str> {
        self.job_id.as_deref()
    }
}

impl Engine for SlurmEngine {
    fn name(&self) -> &'static str {
        "slurm"
    }

    fn hosts(&mut self, placement_timeout: Duration) -> Result<Vec<HostResources>, ExecError> {
        if self.job_id.is_none() {
            let (np, options) = self.request.clone().ok_or_else(|| slurm_err("no allocation", "none was asked for"))?;
            self.request_allocation(np, &options, placement_timeout)?;
        }
        Ok(self
            .nodes
            .iter()
            .map(|(name, tasks)| HostResources {
                hostname: name.clone(),
                node_id: name.clone(),
                cpus: *tasks,
                gpus: Vec::new(),
            })
            .collect())
    }

    fn driver_addr(&self) -> IpAddr {
        // the address this machine uses toward the first node
        super::ssh::route_to(self.nodes.first().map(|n| n.0.as_str()).unwrap_or("localhost"), 6818)
    }

    fn default_nics(&self) -> Vec<String> {
        Vec::new()
    }

    fn spawn(&mut self, workers: Vec<WorkerLaunch>, janitor: &Guard) -> Result<(), ExecError> {
        let Some(first) = workers.first() else { return Ok(()) };
        let job_id = self.job_id.clone().ok_or_else(|| slurm_err("no allocation", "hosts were never asked for"))?;
        if self.owned {
            let _ = janitor.run_on_exit(&["scancel", &job_id]);
        }
        // task i runs where the plan put worker i; the layout file lives in
        // a private directory that the janitor removes if the driver dies
        let io = |what: String| move |source| ExecError::Io { what, source };
        let dir = tempfile::Builder::new()
            .prefix("kolo-slurm-")
            .tempdir()
            .map_err(io("making a temporary directory".into()))?;
        let hostfile = dir.path().join("hosts");
        let _ = janitor.remove_path(dir.path());
        let _ = janitor.remove_path(&hostfile);
        let mut file = std::fs::File::create(&hostfile).map_err(io(format!("writing {}", hostfile.display())))?;
        for w in &workers {
            writeln!(file, "{}", w.host.hostname).map_err(io(format!("writing {}", hostfile.display())))?;
        }
        drop(file);
        let mut srun = Command::new("srun");
        srun.args(["--jobid", &job_id, "-n", &workers.len().to_string(), "--distribution=arbitrary"]);
        srun.args(["--kill-on-bad-exit=0", "--export=ALL", "--quiet"]);
        // an elastic job starts more steps on nodes whose CPUs an earlier
        // step still holds (its removed tasks): they may share them
        srun.arg("--overlap");
        // a name to find the step by at teardown (`kill_all`)
        let step_name =
            format!("kolo-{}-{}", std::process::id(), dir.path().file_name().unwrap_or_default().to_string_lossy());
        srun.args(["--job-name", &step_name]);
        srun.arg(&first.program).args(&first.args);
        srun.env("SLURM_HOSTFILE", &hostfile);
        for (k, v) in &first.env {
            // per-task values come from Slurm: the index is the task id
            match k.as_str() {
                worker::env::INDEX => srun.env(k, worker::env::INDEX_FROM_SLURM),
                _ => srun.env(k, v),
            };
        }
        srun.env(worker::env::SECRET, &first.secret);
        srun.stdin(Stdio::null()).stdout(Stdio::inherit()).stderr(Stdio::inherit()).process_group(0);
        let child = srun
            .spawn()
            .map_err(|source| ExecError::Io { what: "cannot run srun (is Slurm installed?)".into(), source })?;
        let _ = janitor.watch_group(child.id());
        self.srun = Some(child);
        self.step_name = Some(step_name);
        self.dir = Some(dir);
        self.workers = workers.iter().map(|w| w.index).collect();
        Ok(())
    }

    fn exited(&mut self) -> Vec<(u32, String)> {
        match self.srun.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(status))) => {
                let how = format!("srun {}", kolo_sys::process::describe(status));
                self.workers.iter().map(|&i| (i, how.clone())).collect()
            }
            _ => Vec::new(),
        }
    }

    fn all_exited(&mut self) -> bool {
        let Some(srun) = self.srun.as_mut() else { return true };
        if matches!(srun.try_wait(), Ok(Some(_))) {
            return true;
        }
        if self.ending.is_some_and(|asked| asked.elapsed() > SRUN_TERM_GRACE) {
            let _ = srun.kill();
        }
        false
    }

    /// The step's processes hear SIGTERM first (`scancel --signal=TERM`):
    /// ending a step through srun is a SIGKILL to all of them, which would
    /// leave the guard of an agent that cannot clean up itself (stopped or
    /// hung) no moment to end its command and remove its files. srun gets
    /// SIGKILL after a grace (`all_exited`). Looking the step up takes
    /// Slurm's commands: it runs on a thread of its own.
    fn kill_all(&mut self) {
        let Some(srun) = self.srun.as_mut() else { return };
        if !matches!(srun.try_wait(), Ok(None)) || self.ending.is_some() {
            return;
        }
        self.ending = Some(std::time::Instant::now());
        if let (Some(job), Some(name)) = (self.job_id.clone(), self.step_name.clone()) {
            std::thread::spawn(move || {
                let Ok(out) = Command::new("squeue").args(["-h", "-s", "-j", &job, "-o", "%i %j"]).output() else {
                    return;
                };
                let listing = String::from_utf8_lossy(&out.stdout);
                let step = listing
                    .lines()
                    .find_map(|l| l.split_once(' ').filter(|(_, n)| n.trim() == name).map(|(id, _)| id.to_string()));
                if let Some(step) = step {
                    let _ = Command::new("scancel").args(["--quiet", "--signal=TERM", &step]).status();
                }
            });
        }
    }
}

impl Drop for SlurmEngine {
    fn drop(&mut self) {
        self.kill_all();
        let deadline = std::time::Instant::now() + SRUN_TERM_GRACE * 2;
        kolo_sys::wait::wait_until(deadline, Duration::from_millis(10), || self.all_exited());
        if let Some(mut srun) = self.srun.take() {
            let _ = srun.kill();
            let _ = srun.wait();
        }
        if let (true, Some(job_id)) = (self.owned, &self.job_id) {
            let _ = Command::new("scancel").arg(job_id).status();
        }
    }
}
