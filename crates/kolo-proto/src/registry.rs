//! User executables, tasks and functions: plain Rust types with serde
//! arguments and results, registered once in the program so that the same
//! binary can serve as a worker. Each has an explicit `NAME` (type names
//! are not stable across builds); the registry's names go into the build
//! id a worker reports, so a driver and a worker of different builds
//! (`--worker-program`) fail with a clear error instead of a missing name.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kolo_topology::env_names;
use serde::{de::DeserializeOwned, Serialize};

/// Errors a user's code returns; only the message travels to the driver.
pub type UserError = Box<dyn std::error::Error + Send + Sync>;

/// What a worker knows about its place in the job, for tasks to read.
#[derive(Clone, Debug, Default)]
pub struct WorkerContext {
    env: BTreeMap<String, String>,
    reporter: Option<Reporter>,
}

/// The largest value a worker may report at once; reports are progress
/// (metrics, a step count), not results.
pub const MAX_REPORT: usize = 8 << 20;

/// Why a report did not reach the driver.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reported outside a task or function (no driver call to tie it to).
    #[error("no call is running: values are reported while a task or function runs")]
    NoCall,
    /// The value's bytes are over [`MAX_REPORT`] (their count here).
    #[error("the reported value is {0} bytes, over the limit of {MAX_REPORT}")]
    TooLarge(usize),
    /// postcard could not encode the value.
    #[error("cannot encode the reported value: {0}")]
    Encode(#[from] postcard::Error),
    /// Writing to the driver's connection failed.
    #[error("cannot reach the driver: {0}")]
    Io(#[from] std::io::Error),
}

/// Sends values to the driver while a call runs (horovod.ray's callbacks:
/// the driver hands each to the caller as it arrives). Clone it to report
/// from other threads of the call.
#[derive(Clone)]
pub struct Reporter {
    send: std::sync::Arc<dyn Fn(Vec<u8>) -> Result<(), ReportError> + Send + Sync>,
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reporter")
    }
}

impl Reporter {
    /// A reporter that hands each value's bytes to `send` (the agent's
    /// sends a `Report` frame for the running call).
    pub fn new(send: impl Fn(Vec<u8>) -> Result<(), ReportError> + Send + Sync + 'static) -> Self {
        Reporter { send: std::sync::Arc::new(send) }
    }

    /// Sends `value` to the driver, in order with the call's other reports
    /// and before its result; blocks while the driver is behind.
    pub fn report<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), ReportError> {
        self.report_bytes(postcard::to_stdvec(value)?)
    }

    /// Sends bytes as they are (the driver gets them back from `Report::data`).
    pub fn report_bytes(&self, data: Vec<u8>) -> Result<(), ReportError> {
        if data.len() > MAX_REPORT {
            return Err(ReportError::TooLarge(data.len()));
        }
        (self.send)(data)
    }
}

impl WorkerContext {
    /// A context over the variables kolo set for this worker; `reporter`
    /// is `None` where nothing can be reported.
    pub fn new(env: BTreeMap<String, String>, reporter: Option<Reporter>) -> Self {
        WorkerContext { env, reporter }
    }

    /// Sends a value to the driver while this call runs (see [`Reporter`]);
    /// the driver takes it in `execute_reporting`/`run_reporting`.
    pub fn report<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), ReportError> {
        self.reporter.as_ref().ok_or(ReportError::NoCall)?.report(value)
    }

    /// A handle that reports from other threads too.
    pub fn reporter(&self) -> Option<Reporter> {
        self.reporter.clone()
    }

    /// A variable kolo set for this worker (`HOROVOD_RANK`, `MASTER_ADDR`, ...).
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// Every variable kolo set for this worker.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    fn number(&self, name: &str) -> u32 {
        self.env(name).and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// This worker's world rank (0 where it is not set).
    pub fn rank(&self) -> u32 {
        self.number(env_names::RANK)
    }
    /// The job's number of ranks (0 where it is not set).
    pub fn size(&self) -> u32 {
        self.number(env_names::SIZE)
    }
    /// This worker's rank among those on its host.
    pub fn local_rank(&self) -> u32 {
        self.number(env_names::LOCAL_RANK)
    }
    /// How many ranks run on this worker's host.
    pub fn local_size(&self) -> u32 {
        self.number(env_names::LOCAL_SIZE)
    }
    /// This worker's rank among the ranks of the same local rank on every
    /// host.
    pub fn cross_rank(&self) -> u32 {
        self.number(env_names::CROSS_RANK)
    }
    /// How many hosts have a rank of this worker's local rank.
    pub fn cross_size(&self) -> u32 {
        self.number(env_names::CROSS_SIZE)
    }
}

/// State that lives in every worker between calls (RayExecutor's
/// `executable_cls`), created from serde arguments.
pub trait Executable: Sized + Send + 'static {
    /// The name the executable is registered and called by.
    const NAME: &'static str;
    /// What the driver passes to `start`, sent to every worker.
    type Args: Serialize + DeserializeOwned + Send;
    /// Makes the worker's instance; an error fails the start.
    fn create(args: Self::Args, ctx: &WorkerContext) -> Result<Self, UserError>;
}

/// A call on every worker's executable (`execute(fn)`); the value is the
/// task's arguments.
pub trait Task<E: Executable>: Serialize + DeserializeOwned + Send + 'static {
    /// The name the task is registered and called by.
    const NAME: &'static str;
    /// What each worker returns to the driver.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// Runs the task on this worker's executable; an error (or a panic)
    /// becomes this worker's failed result.
    fn run(self, executable: &mut E, ctx: &WorkerContext) -> Result<Self::Output, UserError>;
}

/// A plain function run on every worker (`run(fn, args)`); the value is
/// the function's arguments.
pub trait Function: Serialize + DeserializeOwned + Send + 'static {
    /// The name the function is registered and called by.
    const NAME: &'static str;
    /// What each worker returns to the driver.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// Runs the function on this worker; an error (or a panic) becomes
    /// this worker's failed result.
    fn call(self, ctx: &WorkerContext) -> Result<Self::Output, UserError>;
}

type Creator = Box<dyn Fn(&[u8], &WorkerContext) -> Result<Box<dyn Any + Send>, String> + Send + Sync>;
type TaskRunner = Box<dyn Fn(&[u8], &mut (dyn Any + Send), &WorkerContext) -> Result<Vec<u8>, String> + Send + Sync>;
type FunctionRunner = Box<dyn Fn(&[u8], &WorkerContext) -> Result<Vec<u8>, String> + Send + Sync>;

/// The executables, tasks and functions a worker can run. Build it in
/// `main` and hand it to `serve_if_worker` (kolo-agent) before anything else.
#[derive(Default)]
pub struct Registry {
    names: std::collections::HashSet<&'static str>,
    executables: HashMap<&'static str, Creator>,
    tasks: HashMap<&'static str, TaskRunner>,
    functions: HashMap<&'static str, FunctionRunner>,
}

static BUILD_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Records this program's build id (from its registry); `serve_if_worker`
/// does it, in the driver as in the workers. A driver that never calls
/// `serve_if_worker` (one embedded in another language) calls this with
/// the registry its workers serve.
pub fn set_build_id(id: String) {
    let _ = BUILD_ID.set(id);
}

/// This program's build: kolo's version, the protocol and the names it
/// registered.
pub fn build_id() -> String {
    BUILD_ID.get().cloned().unwrap_or_else(|| Registry::new().build_id())
}

fn claim(names: &mut std::collections::HashSet<&'static str>, kind: &str, name: &'static str) {
    // two types under one name would run the wrong code: a programming
    // error that shows at the first start
    assert!(names.insert(name), "two {kind}s are registered under the name '{name}'; give each its own NAME");
}

impl Registry {
    /// An empty registry, to add to with the builder methods below.
    pub fn new() -> Self {
        Self::default()
    }

    /// Kolo's version, the protocol and a hash of every registered name.
    pub fn build_id(&self) -> String {
        let mut names: Vec<String> = Vec::new();
        names.extend(self.executables.keys().map(|n| format!("e:{n}")));
        names.extend(self.tasks.keys().map(|n| format!("t:{n}")));
        names.extend(self.functions.keys().map(|n| format!("f:{n}")));
        names.sort();
        // FNV-1a: stable across builds and platforms, unlike std's hasher
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in names.join(",").bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        format!("kolo {} protocol {} registry {hash:016x}", env!("CARGO_PKG_VERSION"), crate::proto::PROTOCOL_VERSION)
    }

    /// Adds executable `E` under `E::NAME`; panics if the name is taken.
    pub fn executable<E: Executable>(mut self) -> Self {
        claim(&mut self.names, "executable", E::NAME);
        self.executables.insert(
            E::NAME,
            Box::new(|args, ctx| {
                let args: E::Args = decode_args(args)?;
                let made = guarded(|| E::create(args, ctx))?;
                Ok(Box::new(made) as Box<dyn Any + Send>)
            }),
        );
        self
    }

    /// Adds task `T` on executable `E` under `T::NAME`; panics if the name
    /// is taken.
    pub fn task<E: Executable, T: Task<E>>(mut self) -> Self {
        claim(&mut self.names, "task", T::NAME);
        self.tasks.insert(
            T::NAME,
            Box::new(|args, executable, ctx| {
                let task: T = decode_args(args)?;
                let executable = executable.downcast_mut::<E>().ok_or_else(|| {
                    format!("task {} runs on {}, but the worker holds another executable", T::NAME, E::NAME)
                })?;
                let output = guarded(|| task.run(executable, ctx))?;
                postcard::to_stdvec(&output).map_err(|e| format!("cannot encode the result: {e}"))
            }),
        );
        self
    }

    /// Adds function `F` under `F::NAME`; panics if the name is taken.
    pub fn function<F: Function>(mut self) -> Self {
        claim(&mut self.names, "function", F::NAME);
        self.functions.insert(
            F::NAME,
            Box::new(|args, ctx| {
                let function: F = decode_args(args)?;
                let output = guarded(|| function.call(ctx))?;
                postcard::to_stdvec(&output).map_err(|e| format!("cannot encode the result: {e}"))
            }),
        );
        self
    }

    /// Makes the executable registered as `name` from postcard-encoded
    /// `args`; the error is the message for the driver.
    pub fn create(&self, name: &str, args: &[u8], ctx: &WorkerContext) -> Result<Box<dyn Any + Send>, String> {
        let creator = self.executables.get(name).ok_or_else(|| {
            format!("executable {name} is not registered in this worker; add .executable::<{name}>() to its Registry")
        })?;
        creator(args, ctx)
    }

    /// Runs task `name` on `executable` (the one `create` made, if any);
    /// returns its postcard-encoded output or the message for the driver.
    pub fn run_task(
        &self,
        name: &str,
        args: &[u8],
        executable: Option<&mut (dyn Any + Send)>,
        ctx: &WorkerContext,
    ) -> Result<Vec<u8>, String> {
        let runner = self.tasks.get(name).ok_or_else(|| {
            format!("task {name} is not registered in this worker; add .task::<_, {name}>() to its Registry")
        })?;
        let executable = executable.ok_or("no executable was started in this worker; call start first")?;
        runner(args, executable, ctx)
    }

    /// Runs function `name`; returns its postcard-encoded output or the
    /// message for the driver.
    pub fn run_function(&self, name: &str, args: &[u8], ctx: &WorkerContext) -> Result<Vec<u8>, String> {
        let runner = self.functions.get(name).ok_or_else(|| {
            format!("function {name} is not registered in this worker; add .function::<{name}>() to its Registry")
        })?;
        runner(args, ctx)
    }
}

fn decode_args<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    postcard::from_bytes(bytes)
        .map_err(|e| format!("cannot decode the arguments of {}: {e}", std::any::type_name::<T>()))
}

/// Runs user code, turning its error or panic into a message.
fn guarded<T>(f: impl FnOnce() -> Result<T, UserError>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(format!("panicked: {message}"))
        }
    }
}
