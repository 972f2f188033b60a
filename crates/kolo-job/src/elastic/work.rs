//! What every process of an elastic job runs (an OS command, a task on an
//! executable, a function) and how its processes' ends are reported.

use std::future::Future;
use std::pin::Pin;

use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use kolo_engine::ExecError;
use kolo_exec::Cause;
use kolo_exec::{CallHandle, Executor, Report};
use kolo_proto::{Executable, Function, Task};

/// How one process of a cohort ended.
pub enum ProcessEnd<O> {
    /// Succeeded, with what it returned (`()` for a command exiting 0).
    Succeeded(O),
    /// Failed: why, as "exited with code 3" or the error.
    Failed(String),
    /// Its worker was lost (the host is gone).
    Lost(String),
}

/// A cohort's processes ending, by rank in the cohort.
pub type Ends<O> = mpsc::UnboundedReceiver<(u32, ProcessEnd<O>)>;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where work starts: a world's or cohort's executor, what is added to
/// every process's environment, and where what the processes report
/// (`WorkerContext::report`) goes.
pub struct Launch<'a> {
    /// The executor whose workers run the work.
    pub executor: &'a mut Executor,
    /// Added to every process's environment.
    pub env: &'a [(String, String)],
    /// Where the processes' reports go.
    pub reports: &'a mpsc::Sender<Report>,
}

/// What every process of an elastic job runs: started in each cohort's
/// executor, its processes' ends reported.
pub trait ElasticWork: Send + Sync + 'static {
    /// What one process returns when it succeeds.
    type Output: Send + 'static;
    /// Starts the work where `at` says.
    fn start<'a>(&'a self, at: Launch<'a>) -> BoxFuture<'a, Result<Ends<Self::Output>, ExecError>>;
}

/// Called with each executor whose command has just started (`kolo run`
/// says what it set there).
pub type OnStarted = Box<dyn Fn(&Executor) + Send + Sync>;

/// An OS command in every process (`kolo run --in-place` and restart mode).
pub struct CommandWork {
    /// The command and its arguments.
    pub argv: Vec<std::ffi::OsString>,
    /// Called once the command has started in a cohort's executor.
    pub on_started: Option<OnStarted>,
}

impl CommandWork {
    /// Runs `argv` in every process, with no start callback.
    pub fn new(argv: Vec<std::ffi::OsString>) -> Self {
        CommandWork { argv, on_started: None }
    }

    /// Starts the command in every worker of `executor`.
    pub(crate) async fn start_command(
        &self,
        executor: &mut Executor,
        env: &[(String, String)],
    ) -> Result<(), ExecError> {
        executor.start_command(&self.argv, env).await?;
        if let Some(on_started) = &self.on_started {
            on_started(executor);
        }
        Ok(())
    }
}

impl ElasticWork for CommandWork {
    type Output = ();
    fn start<'a>(&'a self, at: Launch<'a>) -> BoxFuture<'a, Result<Ends<()>, ExecError>> {
        Box::pin(async move {
            self.start_command(at.executor, at.env).await?;
            let mut events = at.executor.take_rank_events().ok_or(ExecError::NotStarted)?;
            let (tx, ends) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    let end = match event.cause {
                        Cause::Exited { code: Some(0), .. } => ProcessEnd::Succeeded(()),
                        Cause::Lost(reason) => ProcessEnd::Lost(reason),
                        other => ProcessEnd::Failed(other.to_string()),
                    };
                    if tx.send((event.rank, end)).is_err() {
                        return;
                    }
                }
            });
            Ok(ends)
        })
    }
}

/// A task on an executable `E` created in every process from `args`
/// (RayExecutor's `start(executable_cls)` then `execute`).
pub struct TaskWork<E: Executable, T: Task<E>> {
    /// What each process's executable is created from.
    pub args: E::Args,
    /// The task run on the executable.
    pub task: T,
}

impl<E, T> ElasticWork for TaskWork<E, T>
where
    E: Executable,
    E::Args: Send + Sync,
    T: Task<E> + Send + Sync + 'static,
    T::Output: DeserializeOwned + Send + 'static,
{
    type Output = T::Output;
    fn start<'a>(&'a self, at: Launch<'a>) -> BoxFuture<'a, Result<Ends<T::Output>, ExecError>> {
        Box::pin(async move {
            at.executor.start::<E>(&self.args, at.env).await?;
            Ok(ends_of(at.executor.run_remote_reporting::<E, T>(&self.task, at.reports).await?))
        })
    }
}

/// A plain function in every process (`run`).
pub struct FunctionWork<F: Function> {
    /// The function each process runs.
    pub function: F,
}

impl<F> ElasticWork for FunctionWork<F>
where
    F: Function + Send + Sync + 'static,
    F::Output: DeserializeOwned + Send + 'static,
{
    type Output = F::Output;
    fn start<'a>(&'a self, at: Launch<'a>) -> BoxFuture<'a, Result<Ends<F::Output>, ExecError>> {
        Box::pin(async move {
            at.executor.start_workers(at.env).await?;
            Ok(ends_of(at.executor.run_remote_function_reporting(&self.function, at.reports).await?))
        })
    }
}

fn ends_of<O: DeserializeOwned + Send + 'static>(handles: Vec<CallHandle<O>>) -> Ends<O> {
    let (tx, ends) = mpsc::unbounded_channel();
    for handle in handles {
        let tx = tx.clone();
        tokio::spawn(async move {
            let rank = handle.rank();
            let end = match handle.join().await {
                Ok(output) => ProcessEnd::Succeeded(output),
                Err(ExecError::WorkerLost { reason, .. }) => ProcessEnd::Lost(reason),
                Err(ExecError::Task { message, .. }) => ProcessEnd::Failed(format!("raised {message}")),
                Err(e) => ProcessEnd::Failed(e.to_string()),
            };
            let _ = tx.send((rank, end));
        });
    }
    ends
}
