//! `kolo bench ...`: figures side by side with their references.

use anyhow::Result;
use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {}

pub async fn bench(args: BenchArgs) -> Result<i32> {
    match args.what {}
}
