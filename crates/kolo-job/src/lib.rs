//! kolo-job: a job as its user asked for it, and the elastic jobs.
//!
//! - [`JobSpec`] (`job`): the one job description `kolo run` and
//!   `kolo.Executor` translate their arguments into; checked once, it makes
//!   the kolo-exec executors of a fixed job and of every world or cohort of
//!   an elastic one.
//! - [`elastic`]: Horovod's mode in place and torchrun's restart mode,
//!   over kolo-exec's executors, with kolo-topology's `Membership`
//!   deciding.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod elastic;
mod job;

pub use job::{seconds, ElasticMode, ElasticOptions, Job, JobSpec, OptionNames, Slots, StartOptions, Workers};
