//! The Executor API on real worker processes. This test binary is its own
//! worker program: started in worker mode by the engine, it serves the
//! driver from `main` before the test harness ever runs.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use kolo_engine::{ExecError, LocalEngine, WorkerRequest};
use kolo_exec::{Executor, Settings};
use kolo_proto::{Executable, Function, Registry, Task, UserError, WorkerContext};
use kolo_topology::HostSpec;
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};

// ---- what the workers run -------------------------------------------------

/// A start value whose constructor takes ten minutes.
const SLOW_START: i64 = i64::MAX;

struct Counter {
    value: i64,
}

impl Executable for Counter {
    const NAME: &'static str = "counter";
    type Args = i64;
    fn create(start: i64, ctx: &WorkerContext) -> Result<Self, UserError> {
        if start < 0 {
            return Err(format!("rank {} cannot start below zero", ctx.rank()).into());
        }
        if start == SLOW_START {
            if let Ok(marker) = std::env::var("KOLO_TEST_CREATE_MARKER") {
                let _ = std::fs::write(format!("{marker}.{}", ctx.rank()), std::process::id().to_string());
            }
            std::thread::sleep(Duration::from_secs(600));
        }
        Ok(Counter { value: start })
    }
}

#[derive(Serialize, Deserialize)]
struct Add(i64);

impl Task<Counter> for Add {
    const NAME: &'static str = "add";
    type Output = (u32, i64);
    fn run(self, c: &mut Counter, ctx: &WorkerContext) -> Result<(u32, i64), UserError> {
        c.value += self.0;
        Ok((ctx.rank(), c.value))
    }
}

#[derive(Serialize, Deserialize)]
struct Get;

impl Task<Counter> for Get {
    const NAME: &'static str = "get";
    type Output = i64;
    fn run(self, c: &mut Counter, _: &WorkerContext) -> Result<i64, UserError> {
        Ok(c.value)
    }
}

/// Fails (or panics) on one rank.
#[derive(Serialize, Deserialize)]
struct FailOn {
    rank: u32,
    panic: bool,
}

impl Task<Counter> for FailOn {
    const NAME: &'static str = "fail-on";
    type Output = u32;
    fn run(self, _: &mut Counter, ctx: &WorkerContext) -> Result<u32, UserError> {
        if ctx.rank() == self.rank {
            if self.panic {
                panic!("rank {} gave up", ctx.rank());
            }
            return Err(format!("rank {} refuses", ctx.rank()).into());
        }
        Ok(ctx.rank())
    }
}

/// Sleeps, then adds one.
#[derive(Serialize, Deserialize)]
struct SlowAdd {
    millis: u64,
}

impl Task<Counter> for SlowAdd {
    const NAME: &'static str = "slow-add";
    type Output = i64;
    fn run(self, c: &mut Counter, _: &WorkerContext) -> Result<i64, UserError> {
        std::thread::sleep(Duration::from_millis(self.millis));
        c.value += 1;
        Ok(c.value)
    }
}

/// Reports `(rank, step)` for each step, the odd ones from another thread
/// of the call, then tries a value over the limit; returns the step count
/// and what the oversized report said.
#[derive(Serialize, Deserialize)]
struct Progress {
    steps: u32,
}

impl Task<Counter> for Progress {
    const NAME: &'static str = "progress";
    type Output = (u32, String);
    fn run(self, _: &mut Counter, ctx: &WorkerContext) -> Result<(u32, String), UserError> {
        let reporter = ctx.reporter().ok_or("no reporter in a call")?;
        for step in 0..self.steps {
            if step % 2 == 1 {
                let reporter = reporter.clone();
                let rank = ctx.rank();
                std::thread::spawn(move || reporter.report(&(rank, step))).join().map_err(|_| "panicked")??;
            } else {
                ctx.report(&(ctx.rank(), step))?;
            }
        }
        let oversized = ctx.reporter().unwrap().report_bytes(vec![0; kolo_proto::MAX_REPORT + 1]);
        Ok((self.steps, oversized.map(|_| String::new()).unwrap_or_else(|e| e.to_string())))
    }
}

/// Reports from a thread that outlives the call, after it returned.
#[derive(Serialize, Deserialize)]
struct ReportLate;

impl Task<Counter> for ReportLate {
    const NAME: &'static str = "report-late";
    type Output = ();
    fn run(self, _: &mut Counter, ctx: &WorkerContext) -> Result<(), UserError> {
        let reporter = ctx.reporter().ok_or("no reporter in a call")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = rx.recv();
            // the call has returned by now: nothing runs, nothing is sent
            std::thread::sleep(Duration::from_millis(50));
            let said = reporter.report(&"late").map(|_| String::new()).unwrap_or_else(|e| e.to_string());
            std::fs::write(std::env::var("KOLO_TEST_LATE_FILE").unwrap(), said).unwrap();
        });
        tx.send(()).map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// What a worker sees of its place in the job.
#[derive(Serialize, Deserialize)]
struct Whoami;

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Place {
    rank: u32,
    local_rank: u32,
    local_size: u32,
    cross_rank: u32,
    cross_size: u32,
    node: String,
    cuda: Option<String>,
    process_env_rank: Option<String>,
    pid: u32,
}

impl Function for Whoami {
    const NAME: &'static str = "whoami";
    type Output = Place;
    fn call(self, ctx: &WorkerContext) -> Result<Place, UserError> {
        Ok(Place {
            rank: ctx.rank(),
            local_rank: ctx.local_rank(),
            local_size: ctx.local_size(),
            cross_rank: ctx.cross_rank(),
            cross_size: ctx.cross_size(),
            node: ctx.env("HOROVOD_HOSTNAME").unwrap_or_default().to_string(),
            cuda: ctx.env("CUDA_VISIBLE_DEVICES").map(String::from),
            process_env_rank: std::env::var("HOROVOD_RANK").ok(),
            pid: std::process::id(),
        })
    }
}

fn registry() -> Registry {
    Registry::new()
        .executable::<Counter>()
        .task::<Counter, Add>()
        .task::<Counter, Get>()
        .task::<Counter, FailOn>()
        .task::<Counter, SlowAdd>()
        .task::<Counter, Progress>()
        .task::<Counter, ReportLate>()
        .function::<Whoami>()
}

// ---- helpers ---------------------------------------------------------------

fn block(f: impl std::future::Future<Output = Result<(), Failed>>) -> Result<(), Failed> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(f)
}

fn check(cond: bool, what: impl Into<String>) -> Result<(), Failed> {
    if cond {
        Ok(())
    } else {
        Err(what.into().into())
    }
}

fn quick_settings() -> Settings {
    let mut s = Settings::default();
    s.heartbeat_interval = Duration::from_millis(100);
    s.heartbeat_timeout = Duration::from_millis(1500);
    s.kill_grace = Duration::from_millis(500);
    s.start_timeout = Duration::from_secs(20);
    s
}

fn hosts(spec: &[(&str, u32, u32)]) -> Box<LocalEngine> {
    Box::new(LocalEngine::with_hosts(
        spec.iter().map(|&(n, slots, gpus)| HostSpec { name: n.into(), slots, gpus: Some(gpus) }).collect(),
    ))
}

async fn counter_executor(workers: u32) -> Result<Executor, Failed> {
    let mut ex = Executor::with_engine(quick_settings(), WorkerRequest::pack(workers), hosts(&[("node", 16, 0)]))?;
    ex.start::<Counter>(&10, &[]).await?;
    Ok(ex)
}

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X")),
        Err(_) => false,
    }
}

async fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Result<(), Failed> {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

// ---- tests -----------------------------------------------------------------

async fn results_in_rank_order_and_state_kept() -> Result<(), Failed> {
    let mut ex = counter_executor(4).await?;
    let first = ex.execute(&Add(5)).await?;
    check(first == vec![(0, 15), (1, 15), (2, 15), (3, 15)], format!("{first:?}"))?;
    let second = ex.execute(&Add(1)).await?;
    check(second.iter().all(|&(_, v)| v == 16), format!("state kept: {second:?}"))?;
    let env = ex.run(&Whoami).await?;
    check(
        env.iter().enumerate().all(|(i, p)| p.rank == i as u32 && p.process_env_rank == Some(i.to_string())),
        format!("{env:?}"),
    )?;
    let single = ex.execute_single(&Get).await?;
    check(single == 16, format!("execute_single: {single}"))?;
    let pids: Vec<u32> = ex.workers().iter().map(|w| w.pid).collect();
    let rendezvous = ex.rendezvous_addr().unwrap();
    ex.shutdown().await;
    for pid in pids {
        check(!alive(pid), format!("worker {pid} outlived shutdown"))?;
    }
    check(TcpStream::connect(rendezvous).is_err(), "rendezvous server still listening after shutdown")
}

async fn reports_reach_the_caller_in_order_before_the_results() -> Result<(), Failed> {
    let mut ex = counter_executor(3).await?;
    let mut reports: Vec<(u32, u32, u32)> = Vec::new();
    let mut slow_caller = true;
    let results = ex
        .execute_reporting(&Progress { steps: 40 }, |report| {
            let (rank, step): (u32, u32) = report.decode().expect("a (rank, step) report");
            reports.push((report.rank, rank, step));
            // a caller slower than the workers holds them back, loses nothing
            if slow_caller && reports.len() == 5 {
                std::thread::sleep(Duration::from_millis(300));
                slow_caller = false;
            }
        })
        .await?;
    check(
        results.iter().all(|(steps, said)| *steps == 40 && said.contains("over the limit")),
        format!("results {results:?}"),
    )?;
    for rank in 0..3 {
        let steps: Vec<u32> = reports.iter().filter(|r| r.0 == rank).map(|r| r.2).collect();
        check(steps == (0..40).collect::<Vec<_>>(), format!("rank {rank}'s reports: {steps:?}"))?;
        check(reports.iter().filter(|r| r.0 == rank).all(|r| r.1 == rank), "a report under another rank")?;
    }
    // without a caller listening, reports are dropped and the call goes on
    let quiet = ex.execute(&Progress { steps: 1000 }).await?;
    check(quiet.iter().all(|(steps, _)| *steps == 1000), format!("{quiet:?}"))?;
    ex.shutdown().await;
    Ok(())
}

async fn shutdown_ends_calls_that_run_or_wait_without_waiting_for_them() -> Result<(), Failed> {
    let mut settings = quick_settings();
    // far longer than the test may take: a worker that waits for its call
    // to end, or the driver for the grace, fails it
    settings.kill_grace = Duration::from_secs(600);
    settings.heartbeat_timeout = Duration::from_secs(600);
    let mut ex = Executor::with_engine(settings, WorkerRequest::pack(2), hosts(&[("node", 2, 0)]))?;
    ex.start::<Counter>(&0, &[]).await?;
    let pids: Vec<u32> = ex.workers().iter().map(|w| w.pid).collect();
    let _running = ex.run_remote(&SlowAdd { millis: 600_000 }).await?;
    let _waiting = ex.run_remote(&SlowAdd { millis: 600_000 }).await?;
    tokio::time::timeout(Duration::from_secs(60), ex.shutdown())
        .await
        .map_err(|_| "shutdown waited for the running call")?;
    for pid in pids {
        check(!alive(pid), format!("worker {pid} outlived shutdown"))?;
    }
    // a constructor is the user's code too: a start given up (Ctrl-C)
    // does not wait for it
    let marker = std::env::temp_dir().join(format!("kolo-slow-create-{}", std::process::id()));
    let marked = |rank: u32| std::path::PathBuf::from(format!("{}.{rank}", marker.display()));
    let mut settings = quick_settings();
    settings.kill_grace = Duration::from_secs(600);
    // nor may a silent driver end the workers first
    settings.heartbeat_timeout = Duration::from_secs(600);
    let mut ex = Executor::with_engine(settings, WorkerRequest::pack(2), hosts(&[("node", 2, 0)]))?;
    let env = [("KOLO_TEST_CREATE_MARKER".to_string(), marker.display().to_string())];
    tokio::select! {
        started = ex.start::<Counter>(&SLOW_START, &env) => {
            return Err(format!("the slow start ended: {:?}", started.err()).into())
        }
        waited = wait_until("both constructors to run", Duration::from_secs(30), || (0..2).all(|r| marked(r).exists())) => waited?,
    }
    let pids: Vec<u32> =
        (0..2).map(|r| std::fs::read_to_string(marked(r)).unwrap_or_default().parse().unwrap_or(0)).collect();
    for rank in 0..2 {
        let _ = std::fs::remove_file(marked(rank));
    }
    tokio::time::timeout(Duration::from_secs(60), ex.shutdown())
        .await
        .map_err(|_| "shutdown waited for the running constructors")?;
    for pid in pids {
        check(pid != 0 && !alive(pid), format!("worker {pid} outlived shutdown"))?;
    }
    Ok(())
}

async fn a_report_after_its_call_returned_is_refused() -> Result<(), Failed> {
    let late = std::env::temp_dir().join(format!("kolo-late-{}", std::process::id()));
    let mut ex = Executor::with_engine(quick_settings(), WorkerRequest::pack(1), hosts(&[("node", 1, 0)]))?;
    let env = [("KOLO_TEST_LATE_FILE".to_string(), late.display().to_string())];
    ex.start::<Counter>(&0, &env).await?;
    let mut reports = 0;
    ex.execute_reporting(&ReportLate, |_| reports += 1).await?;
    wait_until("the late report's outcome", Duration::from_secs(10), || late.exists()).await?;
    let said = std::fs::read_to_string(&late)?;
    let _ = std::fs::remove_file(&late);
    ex.shutdown().await;
    check(reports == 0, format!("{reports} reports"))?;
    check(said.contains("no call is running"), format!("the late report: {said:?}"))
}

async fn remote_handles_can_be_awaited_polled_and_cancelled() -> Result<(), Failed> {
    let mut ex = counter_executor(2).await?;
    let mut slow = ex.run_remote(&SlowAdd { millis: 300 }).await?;
    let queued = ex.run_remote(&SlowAdd { millis: 0 }).await?;
    let polled = slow.remove(1);
    check(slow[0].rank() == 0, "handles in rank order")?;
    // cancel the queued call before it starts: it must never run
    for handle in queued {
        handle.cancel().await?;
    }
    let mut polled = polled;
    let value = loop {
        if let Some(result) = polled.try_result() {
            break result?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    check(value == 11, format!("polled {value}"))?;
    check(slow.remove(0).join().await? == 11, "joined")?;
    let now = ex.execute(&Get).await?;
    check(now == vec![11, 11], format!("the cancelled call ran: {now:?}"))?;
    ex.shutdown().await;
    Ok(())
}

async fn calls_sent_during_a_long_call_run_after_it_in_order() -> Result<(), Failed> {
    let mut ex = counter_executor(2).await?;
    let mut expected = ex.execute(&Get).await?[0];
    // a call long enough for another thread of the agent to read in its
    // place, calls sent meanwhile (queued there, some maybe already read
    // with the long one), then short ones again, read by the agent itself
    for round in 0..3 {
        let mut sent = vec![ex.run_remote(&SlowAdd { millis: 100 }).await?];
        for _ in 0..5 {
            sent.push(ex.run_remote(&SlowAdd { millis: 0 }).await?);
        }
        for handles in sent {
            expected += 1;
            for handle in handles {
                let value = handle.join().await?;
                check(value == expected, format!("round {round}: got {value}, not {expected}"))?;
            }
        }
        for _ in 0..20 {
            expected += 1;
            let values = ex.execute(&SlowAdd { millis: 0 }).await?;
            check(values == vec![expected; 2], format!("round {round}: {values:?}, not {expected}"))?;
        }
    }
    ex.shutdown().await;
    Ok(())
}

async fn a_failing_task_names_its_rank_and_the_executor_goes_on() -> Result<(), Failed> {
    let mut ex = counter_executor(3).await?;
    for panic in [false, true] {
        let err = ex.execute(&FailOn { rank: 1, panic }).await.unwrap_err();
        let text = err.to_string();
        let expected = if panic { "panicked: rank 1 gave up" } else { "rank 1 refuses" };
        check(matches!(err, ExecError::Task { rank: 1, .. }) && text.contains(expected), text)?;
    }
    let after = ex.execute(&Add(1)).await?;
    check(after.len() == 3 && after.iter().all(|&(_, v)| v == 11), format!("usable afterwards: {after:?}"))?;
    ex.shutdown().await;
    Ok(())
}

async fn a_create_failure_is_an_error_naming_the_rank() -> Result<(), Failed> {
    let mut ex = Executor::with_engine(quick_settings(), WorkerRequest::pack(2), hosts(&[("node", 4, 0)]))?;
    let err = ex.start::<Counter>(&-1, &[]).await.unwrap_err().to_string();
    check(err.contains("rank 0") && err.contains("cannot start below zero"), err)
}

async fn a_worker_killed_mid_task_is_reported() -> Result<(), Failed> {
    let mut ex = counter_executor(3).await?;
    let victim = ex.workers()[1].pid;
    let running = ex.run_remote(&SlowAdd { millis: 20_000 }).await?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim as i32), nix::sys::signal::Signal::SIGKILL)?;
    let mut handles = running.into_iter();
    let _rank0 = handles.next();
    let err = handles.next().unwrap().join().await.unwrap_err();
    check(matches!(err, ExecError::WorkerLost { rank: 1, .. }), err.to_string())?;
    check(err.to_string().contains("host node"), err.to_string())?;
    let later = ex.execute(&Get).await.unwrap_err();
    check(matches!(later, ExecError::WorkerLost { rank: 1, .. }), later.to_string())?;
    let pids: Vec<u32> = ex.workers().iter().map(|w| w.pid).collect();
    ex.shutdown().await;
    for pid in pids {
        check(!alive(pid), format!("worker {pid} outlived shutdown"))?;
    }
    // `execute` reports a lost worker at once, not after its peers' 20 s
    let mut ex = counter_executor(3).await?;
    let victim = nix::unistd::Pid::from_raw(ex.workers()[1].pid as i32);
    let began = Instant::now();
    let (result, killed) = tokio::join!(ex.execute(&SlowAdd { millis: 20_000 }), async {
        nix::sys::signal::kill(victim, nix::sys::signal::Signal::SIGKILL)
    });
    killed?;
    let err = result.unwrap_err();
    check(matches!(err, ExecError::WorkerLost { rank: 1, .. }), err.to_string())?;
    check(began.elapsed() < Duration::from_secs(10), format!("reported after {:?}", began.elapsed()))?;
    let pids: Vec<u32> = ex.workers().iter().map(|w| w.pid).collect();
    ex.shutdown().await;
    for pid in pids {
        check(!alive(pid), format!("worker {pid} outlived shutdown"))?;
    }
    Ok(())
}

async fn a_hung_worker_is_reported_within_the_heartbeat_timeout() -> Result<(), Failed> {
    let mut ex = counter_executor(2).await?;
    let victim = ex.workers()[1].pid;
    let pid = nix::unistd::Pid::from_raw(victim as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)?;
    let started = Instant::now();
    let err = ex.execute(&Get).await.unwrap_err();
    let waited = started.elapsed();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    check(
        matches!(err, ExecError::WorkerLost { rank: 1, .. }) && err.to_string().contains("no heartbeat"),
        err.to_string(),
    )?;
    // the bound is the configured timeout; generous slack for a loaded machine
    check(waited < Duration::from_secs(10), format!("took {waited:?}"))?;
    ex.shutdown().await;
    check(!alive(victim), "hung worker outlived shutdown")
}

async fn placement_colocated_and_pack_with_gpus() -> Result<(), Failed> {
    let request = WorkerRequest::from_args(None, Some(2), Some(2), 1, true, None)?;
    let engine = hosts(&[("small", 1, 0), ("a", 4, 4), ("b", 4, 2)]);
    let mut ex = Executor::with_engine(quick_settings(), request, engine)?;
    ex.start::<Counter>(&0, &[]).await?;
    let places = ex.run(&Whoami).await?;
    ex.shutdown().await;
    let got: Vec<(String, u32, u32, u32, u32, Option<String>)> = places
        .iter()
        .map(|p| (p.node.clone(), p.local_rank, p.local_size, p.cross_rank, p.cross_size, p.cuda.clone()))
        .collect();
    let want = vec![
        ("a".to_string(), 0, 2, 0, 2, Some("0,1".to_string())),
        ("a".to_string(), 1, 2, 0, 2, Some("0,1".to_string())),
        ("b".to_string(), 0, 2, 1, 2, Some("0,1".to_string())),
        ("b".to_string(), 1, 2, 1, 2, Some("0,1".to_string())),
    ];
    check(got == want, format!("colocated: {got:?}"))?;

    let request = WorkerRequest::pack(3).cpus_per_worker(2);
    let mut ex = Executor::with_engine(quick_settings(), request, hosts(&[("a", 4, 0), ("b", 4, 0)]))?;
    ex.start::<Counter>(&0, &[]).await?;
    let places = ex.run(&Whoami).await?;
    ex.shutdown().await;
    let got: Vec<(String, u32, u32, u32, u32)> =
        places.iter().map(|p| (p.node.clone(), p.local_rank, p.local_size, p.cross_rank, p.cross_size)).collect();
    let want = vec![("a".into(), 0, 2, 0, 2), ("a".into(), 1, 2, 0, 1), ("b".into(), 0, 1, 1, 2)];
    check(got == want, format!("pack: {got:?}"))?;
    check(places.iter().all(|p| p.cuda.is_none()), "no GPUs asked, none given")
}

async fn infeasible_placement_names_what_was_asked_and_what_is_there() -> Result<(), Failed> {
    let request = WorkerRequest::from_args(Some(3), None, None, 2, true, Some(1))?;
    let mut ex = Executor::with_engine(quick_settings(), request, hosts(&[("a", 4, 1), ("b", 2, 0)]))?;
    let err = ex.start::<Counter>(&0, &[]).await.unwrap_err().to_string();
    check(
        err.contains("3 workers with 2 CPUs and 1 GPU each") && err.contains("a (4 CPUs, 1 GPU), b (2 CPUs, 0 GPUs)"),
        err,
    )?;
    for (args, needle) in [
        ((Some(2), Some(1), Some(1), 1, false, None), "not both"),
        ((None, None, None, 1, false, None), "give num_workers"),
        ((Some(2), None, None, 1, false, Some(1)), "use_gpu"),
        ((Some(2), None, None, 0, false, None), "cpus_per_worker"),
    ] {
        let (w, h, p, c, g, gp) = args;
        let err = WorkerRequest::from_args(w, h, p, c, g, gp).unwrap_err().to_string();
        check(err.contains(needle), err)?;
    }
    Ok(())
}

/// Run as a child process: a driver that starts workers running a command
/// and waits forever, printing the workers' and commands' pids.
fn driver_child() {
    block(async {
        let mut ex = Executor::with_engine(quick_settings(), WorkerRequest::pack(2), hosts(&[("node", 4, 0)]))?;
        let dir = std::env::var("KOLO_TEST_PIDS").unwrap();
        let script = format!("sleep 1000 & echo $$ $! > {dir}/$RANK.pid; wait");
        ex.start_command(&["sh".into(), "-c".into(), script.into()], &[]).await?;
        let pids: Vec<String> = ex.workers().iter().map(|w| w.pid.to_string()).collect();
        println!("{}", pids.join(" "));
        std::future::pending::<()>().await;
        Ok(())
    })
    .unwrap();
}

async fn workers_exit_when_the_driver_dies() -> Result<(), Failed> {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("kolo-driver-dies-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut driver = std::process::Command::new(std::env::current_exe()?)
        .env("KOLO_TEST_DRIVER", "1")
        .env("KOLO_TEST_PIDS", &dir)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(driver.stdout.take().unwrap()).read_line(&mut line)?;
    let mut pids: Vec<u32> = line.split_whitespace().map(|p| p.parse().unwrap()).collect();
    check(pids.len() == 2, format!("worker pids: {line:?}"))?;
    let pid_files = || std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    wait_until("both commands to start", Duration::from_secs(20), || pid_files() == 2).await?;
    for entry in std::fs::read_dir(&dir)? {
        for p in std::fs::read_to_string(entry?.path())?.split_whitespace() {
            pids.push(p.parse()?);
        }
    }
    driver.kill()?;
    driver.wait()?;
    wait_until("workers and their commands to exit", Duration::from_secs(20), || pids.iter().all(|&p| !alive(p)))
        .await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[path = "executor/tampering.rs"]
mod tampering;
use tampering::{
    a_protocol_version_mismatch_is_named, a_wrong_secret_is_refused, another_build_of_the_worker_program_is_named,
    strangers_without_the_secret_change_nothing,
};

fn main() {
    kolo_agent::serve_if_worker(registry());
    if std::env::var("KOLO_TEST_DRIVER").is_ok() {
        driver_child();
        return;
    }
    let args = Arguments::from_args();
    macro_rules! trials {
        ($($name:ident),* $(,)?) => { vec![$(Trial::test(stringify!($name), || block($name())),)*] };
    }
    let tests = trials![
        results_in_rank_order_and_state_kept,
        reports_reach_the_caller_in_order_before_the_results,
        a_report_after_its_call_returned_is_refused,
        remote_handles_can_be_awaited_polled_and_cancelled,
        shutdown_ends_calls_that_run_or_wait_without_waiting_for_them,
        calls_sent_during_a_long_call_run_after_it_in_order,
        a_failing_task_names_its_rank_and_the_executor_goes_on,
        a_create_failure_is_an_error_naming_the_rank,
        a_worker_killed_mid_task_is_reported,
        a_hung_worker_is_reported_within_the_heartbeat_timeout,
        placement_colocated_and_pack_with_gpus,
        infeasible_placement_names_what_was_asked_and_what_is_there,
        a_wrong_secret_is_refused,
        a_protocol_version_mismatch_is_named,
        another_build_of_the_worker_program_is_named,
        strangers_without_the_secret_change_nothing,
        workers_exit_when_the_driver_dies,
    ];
    libtest_mimic::run(&args, tests).exit();
}
