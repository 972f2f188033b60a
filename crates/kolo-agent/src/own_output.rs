//! The agent's own stdout and stderr (a Rust executable's prints), sent
//! to the driver as the rank's output.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::sync::Arc;

use kolo_proto::proto::ToDriver;

use crate::Agent;

/// The agent's own stdout/stderr, redirected into pipes that are forwarded.
pub(crate) struct OwnOutput {
    pub(crate) pumps: mpsc::Receiver<()>,
}

/// Points fds 1 and 2 at pipes whose contents go to the driver as output.
pub(crate) fn redirect_own_output(agent: &Arc<Agent>) -> io::Result<()> {
    let (done_tx, done_rx) = mpsc::channel();
    for stderr in [false, true] {
        let (read, write) = nix::unistd::pipe().map_err(io::Error::from)?;
        if stderr {
            nix::unistd::dup2_stderr(write.as_fd()).map_err(io::Error::from)?;
        } else {
            nix::unistd::dup2_stdout(write.as_fd()).map_err(io::Error::from)?;
        }
        drop(write);
        let (agent, done) = (agent.clone(), done_tx.clone());
        std::thread::spawn(move || {
            pump(&agent, File::from(read), stderr);
            let _ = done.send(());
        });
    }
    *kolo_sys::lock(&agent.own_output) = Some(OwnOutput { pumps: done_rx });
    Ok(())
}

pub(crate) fn pump(agent: &Agent, mut from: impl Read, stderr: bool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if agent.send(&ToDriver::Output { stderr, data: buf[..n].to_vec() }).is_err() {
                    return;
                }
            }
        }
    }
}
