//! Joins the job's communicator and checks allreduce sums of several sizes
//! (every rank contributes rank + 1): a smoke test of a job's collectives.
//!
//!     kolo run -np 6 -H h1:2,h2:2,h3:2 -- target/release/examples/allreduce_check

use kolo_comm::{Communicator, ReduceOp};

fn main() {
    let result = (|| -> Result<String, Box<dyn std::error::Error>> {
        let mut comm = Communicator::from_env()?;
        let (rank, size) = (comm.rank(), comm.size());
        let want = (size * (size + 1) / 2) as f32;
        for len in [1usize, 1000, 100_000, 1 << 20] {
            let send = vec![(rank + 1) as f32; len];
            let mut recv = vec![0.0f32; len];
            comm.allreduce(&send, &mut recv, ReduceOp::Sum)?;
            if let Some(i) = recv.iter().position(|&v| v != want) {
                return Err(format!("{len} elements: element {i} is {}, expected {want}", recv[i]).into());
            }
        }
        Ok(format!("rank {rank}/{size} on {} hosts: allreduce sums ok ({want})", comm.num_nodes()))
    })();
    match result {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("allreduce_check: {e}");
            std::process::exit(1);
        }
    }
}
