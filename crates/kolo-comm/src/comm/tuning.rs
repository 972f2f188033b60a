//! Which algorithm for which size and rank count.

use crate::CommError;

/// Default for [`Tuning::direct_bytes`]: measured with `kolo bench
/// allreduce` and `KOLO_COMM_DIRECT=0/1` on the 2-core machine, 4 ranks:
/// the rings win at 256 KiB (192 vs 219 us), direct reads from 1 MiB
/// (621 vs 702 us) and by 1.3-1.4x at 16-64 MiB; at 2 ranks they tie.
const DIRECT_BYTES: usize = 1 << 20;

/// Algorithm choices, by size and rank count; overridable with
/// environment variables.
///
/// Measured on the 2-core development machine (`kolo bench allreduce` with
/// the variables below): with 2 ranks the ring beats recursive doubling
/// from 16 KiB (1.8 vs 2.9 us) and at 64 KiB (5.3 vs 8.9 us); with 4 ranks
/// recursive doubling wins up to 64 KiB (48 vs 113 us) and the ring beats
/// Rabenseifner from 256 KiB. Rabenseifner pays off from 8 ranks, where
/// its log2(n) steps save most over the ring's 2(n-1).
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Allreduce of at most this many bytes uses recursive doubling
    /// (`KOLO_COMM_SMALL_BYTES`; default 8 KiB for 2 ranks, 64 KiB beyond).
    pub small_bytes: Option<usize>,
    /// Allreduce of at most this many bytes (and above the small size) uses
    /// recursive halving-doubling (Rabenseifner); larger ones the ring
    /// (`KOLO_COMM_MID_BYTES`; default 1 MiB from 8 ranks, none below).
    pub mid_bytes: Option<usize>,
    /// Hierarchical allreduce across hosts from this many bytes
    /// (`KOLO_COMM_HIER_BYTES`).
    pub hierarchical_bytes: usize,
    /// Most bytes of shared-memory ring per direction (`KOLO_COMM_RING_BYTES`);
    /// rings shrink as ranks per host grow.
    pub ring_bytes: usize,
    /// Allreduce of at least this many bytes among ranks of one host reads
    /// the peers' buffers directly where the kernel allows it
    /// (`KOLO_COMM_DIRECT_BYTES`; `KOLO_COMM_DIRECT=0` turns it off).
    pub direct_bytes: Option<usize>,
    /// How long a rank without progress yields its core before it naps
    /// (`KOLO_COMM_YIELD_US`, default 5 ms).
    pub yield_window: std::time::Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            small_bytes: None,
            mid_bytes: None,
            hierarchical_bytes: 256 * 1024,
            ring_bytes: 2 << 20,
            direct_bytes: Some(DIRECT_BYTES),
            yield_window: std::time::Duration::from_millis(5),
        }
    }
}

impl Tuning {
    /// Largest allreduce done by recursive doubling among `n` ranks.
    pub fn small_for(&self, n: usize) -> usize {
        self.small_bytes.unwrap_or(if n <= 2 { 8 << 10 } else { 64 << 10 })
    }

    /// Largest allreduce done by Rabenseifner among `n` ranks.
    pub fn mid_for(&self, n: usize) -> usize {
        self.mid_bytes.unwrap_or(if n >= 8 { 1 << 20 } else { 0 })
    }

    /// The defaults, overridden by the `KOLO_COMM_*` variables named on the
    /// fields; a value that does not parse is an error.
    pub fn from_env() -> Result<Tuning, CommError> {
        let mut t = Tuning::default();
        let bytes = |name: &str| -> Result<Option<usize>, CommError> {
            match std::env::var(name) {
                Ok(v) => v.parse().map(Some).map_err(|_| CommError::Env(format!("{name}='{v}' is not a byte count"))),
                Err(_) => Ok(None),
            }
        };
        t.small_bytes = bytes("KOLO_COMM_SMALL_BYTES")?;
        t.mid_bytes = bytes("KOLO_COMM_MID_BYTES")?;
        for (name, field) in
            [("KOLO_COMM_HIER_BYTES", &mut t.hierarchical_bytes), ("KOLO_COMM_RING_BYTES", &mut t.ring_bytes)]
        {
            if let Ok(v) = std::env::var(name) {
                *field = v.parse().map_err(|_| CommError::Env(format!("{name}='{v}' is not a byte count")))?;
            }
        }
        if let Some(b) = bytes("KOLO_COMM_DIRECT_BYTES")? {
            t.direct_bytes = Some(b);
        }
        match std::env::var("KOLO_COMM_DIRECT").as_deref() {
            Err(_) | Ok("1") => {}
            Ok("0") => t.direct_bytes = None,
            Ok(v) => return Err(CommError::Env(format!("KOLO_COMM_DIRECT='{v}' must be 0 (off) or 1 (on)"))),
        }
        if let Some(us) = bytes("KOLO_COMM_YIELD_US")? {
            t.yield_window = std::time::Duration::from_micros(us as u64);
        }
        Ok(t)
    }
}
