//! Nothing but tests: kolo-comm's collectives and elastic rounds on real
//! worker processes, which the driver crates (kolo-exec, kolo-job) start.
//! They live here so that kolo-comm itself depends on nothing above it,
//! not even for its tests.

#![forbid(unsafe_code)]
