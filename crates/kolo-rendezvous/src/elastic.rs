//! What an elastic job's driver and processes agree on in the store
//! (the server answers these; kolo-comm's elastic API asks them).

/// The scope reserved for elastic rank assignment: `GET
/// /rank_and_size/<host>:<local_rank>` (Horovod's), and kolo's round key.
pub const RANK_AND_SIZE: &str = "rank_and_size";
/// `GET /rank_and_size/round`: the number of the round the assignments
/// belong to (kolo's own; Horovod's slot keys always hold a ':').
pub const ROUND_KEY: &str = "round";
/// A scope that survives new rounds: an elastic job's processes record
/// there the round they last joined (`<host>:<local_rank>` → round), so
/// that the driver knows which round last came together.
pub const JOINED_SCOPE: &str = "kolo_elastic_joined";
