//! Calls on the workers: `execute`, `run`, `run_remote` and their handles.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot};

use super::link::{CallError, CallResult, Link};
use super::Executor;
use kolo_engine::ExecError;
use kolo_proto::proto::{self, CallKind, ToWorker};
use kolo_proto::registry::{Executable, Function, Task};

/// A value a worker reported while a call ran ([`kolo_proto::WorkerContext::report`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The rank that reported it.
    pub rank: u32,
    /// What the worker sent: postcard bytes from `report`, as they were
    /// from `report_bytes`.
    pub data: Vec<u8>,
}

impl Report {
    /// The value, as `WorkerContext::report` sent it.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, postcard::Error> {
        postcard::from_bytes(&self.data)
    }
}

/// Reports queued per call before the workers that make them wait: with
/// values of up to `MAX_REPORT` this bounds what a call's reports hold.
pub const REPORTS_QUEUED: usize = 8;

impl Executor {
    /// Runs `task` on every worker's executable; results in rank order.
    pub async fn execute<E: Executable, T: Task<E>>(&self, task: &T) -> Result<Vec<T::Output>, ExecError> {
        let handles = self.call_all(CallKind::Task, T::NAME, task, None, None).await?;
        join_all(handles).await
    }

    /// Like `execute`, handing each value a worker reports while the task
    /// runs to `on_report`, in the order each worker sent them (horovod.ray's
    /// callbacks). Every report is handed over before this returns.
    pub async fn execute_reporting<E: Executable, T: Task<E>>(
        &self,
        task: &T,
        on_report: impl FnMut(Report),
    ) -> Result<Vec<T::Output>, ExecError> {
        self.call_reporting(CallKind::Task, T::NAME, task, on_report).await
    }

    /// `run` with reports, as `execute_reporting`.
    pub async fn run_reporting<F: Function>(
        &self,
        function: &F,
        on_report: impl FnMut(Report),
    ) -> Result<Vec<F::Output>, ExecError> {
        self.call_reporting(CallKind::Function, F::NAME, function, on_report).await
    }

    async fn call_reporting<A: serde::Serialize, O: DeserializeOwned + Send + 'static>(
        &self,
        kind: CallKind,
        name: &str,
        args: &A,
        on_report: impl FnMut(Report),
    ) -> Result<Vec<O>, ExecError> {
        let (tx, rx) = mpsc::channel(REPORTS_QUEUED);
        let handles = self.call_all(kind, name, args, None, Some(&tx)).await?;
        drop(tx);
        reporting(join_all(handles), rx, on_report).await
    }

    /// Like `execute`, but the first rank to fail ends the wait with its
    /// error, while the other ranks' calls still run (the caller then
    /// shuts the executor down): jobs in which one failure ends the job,
    /// as horovodrun's.
    pub async fn execute_until_failure<E: Executable, T: Task<E>>(
        &self,
        task: &T,
    ) -> Result<Vec<T::Output>, ExecError> {
        let handles = self.call_all(CallKind::Task, T::NAME, task, None, None).await?;
        let mut joins = tokio::task::JoinSet::new();
        let count = handles.len();
        for (position, handle) in handles.into_iter().enumerate() {
            joins.spawn(async move { (position, handle.join().await) });
        }
        let mut results: Vec<Option<T::Output>> = (0..count).map(|_| None).collect();
        while let Some(joined) = joins.join_next().await {
            let (position, result) = joined
                .map_err(|e| ExecError::Io { what: "waiting for a call".into(), source: std::io::Error::other(e) })?;
            results[position] = Some(result?);
        }
        Ok(results.into_iter().map(|r| r.expect("every call joined")).collect())
    }

    /// Runs `task` on rank 0 only.
    pub async fn execute_single<E: Executable, T: Task<E>>(&self, task: &T) -> Result<T::Output, ExecError> {
        let mut handles = self.call_all(CallKind::Task, T::NAME, task, Some(0), None).await?;
        handles.remove(0).join().await
    }

    /// Runs the plain function `function` on every worker; results in rank order.
    pub async fn run<F: Function>(&self, function: &F) -> Result<Vec<F::Output>, ExecError> {
        let handles = self.call_all(CallKind::Function, F::NAME, function, None, None).await?;
        join_all(handles).await
    }

    /// Starts `task` on every worker and returns a handle per rank at once.
    pub async fn run_remote<E: Executable, T: Task<E>>(
        &self,
        task: &T,
    ) -> Result<Vec<CallHandle<T::Output>>, ExecError> {
        self.call_all(CallKind::Task, T::NAME, task, None, None).await
    }

    /// Starts the plain function on every worker and returns a handle per rank.
    pub async fn run_remote_function<F: Function>(
        &self,
        function: &F,
    ) -> Result<Vec<CallHandle<F::Output>>, ExecError> {
        self.call_all(CallKind::Function, F::NAME, function, None, None).await
    }

    /// As `run_remote`, with what the workers report meanwhile sent to
    /// `reports` (bounded: a slow reader holds the workers back).
    pub async fn run_remote_reporting<E: Executable, T: Task<E>>(
        &self,
        task: &T,
        reports: &mpsc::Sender<Report>,
    ) -> Result<Vec<CallHandle<T::Output>>, ExecError> {
        self.call_all(CallKind::Task, T::NAME, task, None, Some(reports)).await
    }

    /// As `run_remote_function`, with what the workers report meanwhile
    /// sent to `reports`.
    pub async fn run_remote_function_reporting<F: Function>(
        &self,
        function: &F,
        reports: &mpsc::Sender<Report>,
    ) -> Result<Vec<CallHandle<F::Output>>, ExecError> {
        self.call_all(CallKind::Function, F::NAME, function, None, Some(reports)).await
    }

    pub(crate) async fn call_all<A: serde::Serialize, O: DeserializeOwned>(
        &self,
        kind: CallKind,
        name: &str,
        args: &A,
        only: Option<u32>,
        reports: Option<&mpsc::Sender<Report>>,
    ) -> Result<Vec<CallHandle<O>>, ExecError> {
        let running = self.running()?;
        let args = postcard::to_stdvec(args).map_err(ExecError::Encode)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let message = ToWorker::Call { id, kind, name: name.to_string(), args };
        let frame =
            proto::encode(&message).map_err(|source| ExecError::Io { what: "encoding a call".into(), source })?;
        let mut handles = Vec::new();
        for link in running.links.iter().filter(|l| only.is_none_or(|r| r == l.info.rank)) {
            let (tx, rx) = oneshot::channel();
            kolo_sys::lock(&link.pending).insert(id, tx);
            if let Some(reports) = reports {
                kolo_sys::lock(&link.reports).insert(id, reports.clone());
            }
            if let Err(e) = link.send_frame(&frame).await {
                kolo_sys::lock(&link.pending).remove(&id);
                kolo_sys::lock(&link.reports).remove(&id);
                return Err(e);
            }
            handles.push(CallHandle { link: link.clone(), id, rx: Some(rx), _output: PhantomData });
        }
        Ok(handles)
    }
}

/// A call running on one worker.
pub struct CallHandle<T> {
    link: Arc<Link>,
    id: u64,
    rx: Option<oneshot::Receiver<CallResult>>,
    _output: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> CallHandle<T> {
    /// The rank the call runs on.
    pub fn rank(&self) -> u32 {
        self.link.info.rank
    }

    /// Waits for the result.
    pub async fn join(mut self) -> Result<T, ExecError> {
        let rx = self.rx.take().ok_or(ExecError::Cancelled)?;
        let result = rx.await.map_err(|_| self.link.lost_error("its connection ended".into()))?;
        self.decode(result)
    }

    /// The result if it is there, without waiting; `None` while running.
    pub fn try_result(&mut self) -> Option<Result<T, ExecError>> {
        let rx = self.rx.as_mut()?;
        match rx.try_recv() {
            Ok(result) => {
                self.rx = None;
                Some(self.decode(result))
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.rx = None;
                Some(Err(self.link.lost_error("its connection ended".into())))
            }
        }
    }

    /// Gives the call up: it is skipped if it has not started, and its
    /// result is dropped otherwise.
    pub async fn cancel(mut self) -> Result<(), ExecError> {
        self.rx = None;
        kolo_sys::lock(&self.link.pending).remove(&self.id);
        kolo_sys::lock(&self.link.reports).remove(&self.id);
        self.link.send(&ToWorker::Cancel { id: self.id }).await
    }

    fn decode(&self, result: CallResult) -> Result<T, ExecError> {
        let bytes = result.map_err(|e| match e {
            CallError::Task(message) => {
                ExecError::Task { rank: self.link.info.rank, host: self.link.info.hostname.clone(), message }
            }
            CallError::Lost(reason) => self.link.lost_error(reason),
        })?;
        postcard::from_bytes(&bytes).map_err(|source| ExecError::Decode { rank: self.link.info.rank, source })
    }
}

async fn join_all<T: DeserializeOwned + Send + 'static>(handles: Vec<CallHandle<T>>) -> Result<Vec<T>, ExecError> {
    // wait for every rank so the executor is idle again, then report the
    // first failure in rank order; but a lost worker breaks the job (its
    // peers may wait on it forever), so that is reported at once
    let mut joins = tokio::task::JoinSet::new();
    let count = handles.len();
    for (position, handle) in handles.into_iter().enumerate() {
        joins.spawn(async move { (position, handle.join().await) });
    }
    let mut results: Vec<Option<Result<T, ExecError>>> = (0..count).map(|_| None).collect();
    while let Some(joined) = joins.join_next().await {
        let (position, result) = joined
            .map_err(|e| ExecError::Io { what: "waiting for a call".into(), source: std::io::Error::other(e) })?;
        if let Err(lost @ ExecError::WorkerLost { .. }) = result {
            return Err(lost);
        }
        results[position] = Some(result);
    }
    results.into_iter().map(|r| r.expect("every call joined")).collect()
}

/// Hands reports to `on_report` while `work` runs, then the rest: a worker
/// sends its reports before its result, so once `work` is done every
/// report is queued.
async fn reporting<T>(
    work: impl std::future::Future<Output = T>,
    mut reports: mpsc::Receiver<Report>,
    mut on_report: impl FnMut(Report),
) -> T {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            Some(report) = reports.recv() => on_report(report),
            done = &mut work => {
                while let Ok(report) = reports.try_recv() {
                    on_report(report);
                }
                return done;
            }
        }
    }
}
