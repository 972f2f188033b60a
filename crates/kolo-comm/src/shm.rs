//! Single-producer single-consumer byte rings in shared memory, one per
//! direction between two ranks of a host. Persistent and pre-faulted: a
//! collective never allocates or page-faults. Data moves in 8-byte units,
//! so every view a consumer gets is 8-byte aligned.
//!
//! A ring lives in an anonymous memory file (`memfd_create`): the consumer
//! creates it and hands the descriptor to the producer over an
//! authenticated unix socket, so nothing is ever named in a file system
//! and nothing outlives the two processes. Both sides reach the shared
//! bytes through raw pointers only (never `&`/`&mut` over memory the other
//! side writes), so the ring's logic runs as well over a heap buffer, where
//! Miri checks it, run by hand (`cargo +nightly miri test -p kolo-comm
//! --lib shm`): CI does not run Miri.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

/// Header: producer counter, consumer counter, each on its own cache line.
pub(crate) const HEADER: usize = 4096;
const HEAD_AT: usize = 0;
const TAIL_AT: usize = 128;
/// Set by either side that gave up on the connection (after an error).
const ABORT_AT: usize = 256;
/// Largest ring accepted from a peer.
const MAX_CAPACITY: usize = 1 << 30;

/// Most bytes moved by one call, so a sender and a receiver alternate in
/// pieces that stay in cache.
pub(crate) const SEGMENT: usize = 256 * 1024;

/// What keeps a ring's memory alive.
enum Backing {
    Map(#[allow(dead_code)] MmapRaw),
    #[cfg(test)]
    Heap(#[allow(dead_code)] std::sync::Arc<heap::Region>),
}

pub(crate) struct Ring {
    /// Start of the region: header, then `capacity` bytes of data.
    base: *mut u8,
    capacity: usize,
    /// Local copy of our own counter (the other side only reads it).
    cursor: u64,
    _backing: Backing,
}

// SAFETY: the region is shared memory reached only through raw pointers
// and atomics; a Ring is one side's handle, used by one thread at a time.
unsafe impl Send for Ring {}

impl Ring {
    /// The consumer's side: a fresh anonymous memory file of `capacity`
    /// data bytes, pre-faulted, and its descriptor for the producer.
    pub(crate) fn create(capacity: usize) -> io::Result<(Ring, OwnedFd)> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        use nix::sys::stat::{fchmod, Mode};
        assert!(capacity.is_multiple_of(8) && (8..=MAX_CAPACITY).contains(&capacity));
        let fd = memfd_create(c"kolo-ring", MFdFlags::MFD_CLOEXEC).map_err(io::Error::from)?;
        // only its descriptor reaches it, but just in case
        fchmod(&fd, Mode::S_IRUSR | Mode::S_IWUSR).map_err(io::Error::from)?;
        let file = File::from(fd);
        file.set_len((HEADER + capacity) as u64)?;
        let map = MmapOptions::new().map_raw(&file)?;
        let base = map.as_mut_ptr();
        // touch every page now, not during a collective; no one else has
        // the memory yet
        for at in (0..map.len()).step_by(4096) {
            // SAFETY: `at` is inside the mapping, which is read-write and not
            // yet shared with anyone.
            unsafe { base.add(at).write_volatile(0) };
        }
        Ok((Ring { base, capacity, cursor: 0, _backing: Backing::Map(map) }, file.into()))
    }

    /// The producer's side: maps (pre-faulted) a ring another rank made.
    pub(crate) fn open(fd: OwnedFd) -> io::Result<Ring> {
        let file = File::from(fd);
        let len = file.metadata()?.len() as usize;
        let capacity = len.wrapping_sub(HEADER);
        if len <= HEADER || !capacity.is_multiple_of(8) || capacity > MAX_CAPACITY {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a ring of {len} bytes is not a kolo ring"),
            ));
        }
        let map = MmapOptions::new().populate().map_raw(&file)?;
        Ok(Ring { base: map.as_mut_ptr(), capacity, cursor: 0, _backing: Backing::Map(map) })
    }

    /// Tells the other side this connection is dead.
    pub(crate) fn abort(&self) {
        self.counter(ABORT_AT).store(1, Ordering::Release);
    }

    pub(crate) fn aborted(&self) -> bool {
        self.counter(ABORT_AT).load(Ordering::Acquire) != 0
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is 8-aligned inside the page-aligned (heap: 8-aligned)
        // header, which lives as long as `self`; both sides access it only
        // atomically.
        unsafe { AtomicU64::from_ptr(self.base.add(at) as *mut u64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the region.
        unsafe { self.base.add(HEADER) }
    }

    /// Producer: copies up to `data.len()` bytes (a multiple of 8, except
    /// for a message's last piece, whose padding up to 8 is skipped) and
    /// returns how many ring bytes it advanced.
    pub(crate) fn push(&mut self, data: &[u8], padded_len: usize) -> usize {
        let tail = self.counter(TAIL_AT).load(Ordering::Acquire);
        let free = self.capacity - (self.cursor - tail) as usize;
        let n = padded_len.min(free).min(SEGMENT) & !7;
        if n == 0 {
            return 0;
        }
        let copy = n.min(data.len());
        let at = (self.cursor % self.capacity as u64) as usize;
        let first = copy.min(self.capacity - at);
        // SAFETY: [at, at+first) and [0, copy-first) lie in the data area
        // (`copy <= free <= capacity`, given a consumer that keeps to the
        // protocol: it is a process of this job running this code); the
        // consumer does not read them until `head` is published below, and
        // freed them before `tail` (Acquire above) moved past them.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.data().add(at), first);
            std::ptr::copy_nonoverlapping(data.as_ptr().add(first), self.data(), copy - first);
        }
        self.cursor += n as u64;
        self.counter(HEAD_AT).store(self.cursor, Ordering::Release);
        n
    }

    /// Consumer: hands up to `max` available bytes (a multiple of 8) to
    /// `take` in at most two contiguous, 8-aligned pieces, then frees them.
    pub(crate) fn pop(&mut self, max: usize, mut take: impl FnMut(&[u8])) -> usize {
        let head = self.counter(HEAD_AT).load(Ordering::Acquire);
        let n = ((head - self.cursor) as usize).min(max).min(SEGMENT) & !7;
        if n == 0 {
            return 0;
        }
        let at = (self.cursor % self.capacity as u64) as usize;
        let first = n.min(self.capacity - at);
        // SAFETY: the producer published these bytes (Acquire above) and
        // does not write them until `tail` moves past them (below), so the
        // slices are not written while they live.
        unsafe {
            take(std::slice::from_raw_parts(self.data().add(at), first));
            if n > first {
                take(std::slice::from_raw_parts(self.data(), n - first));
            }
        }
        self.cursor += n as u64;
        self.counter(TAIL_AT).store(self.cursor, Ordering::Release);
        n
    }
}

#[cfg(test)]
mod heap {
    use super::*;
    use std::sync::Arc;

    /// A zeroed, 8-aligned heap buffer reached through a raw pointer only.
    pub(super) struct Region {
        ptr: *mut u64,
        words: usize,
    }

    // SAFETY: a Region owns its boxed buffer, which any thread may free; the
    // Rings over it reach the memory only through raw pointers and atomics,
    // as they would shared memory.
    unsafe impl Send for Region {}
    // SAFETY: a `&Region` gives at most the pointer's value (its fields are
    // private to this module and it has no methods); only the Rings touch the
    // memory, through raw pointers, atomics for the counters and the ring's
    // protocol for the data.
    unsafe impl Sync for Region {}

    impl Drop for Region {
        fn drop(&mut self) {
            // SAFETY: made from a boxed slice of `words` u64 in `pair`.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words)) });
        }
    }

    /// (producer, consumer) over a heap region.
    pub(super) fn pair(capacity: usize) -> (Ring, Ring) {
        let words = (HEADER + capacity) / 8;
        let ptr = Box::into_raw(vec![0u64; words].into_boxed_slice()) as *mut u64;
        let region = Arc::new(Region { ptr, words });
        let ring =
            |r: &Arc<Region>| Ring { base: r.ptr as *mut u8, capacity, cursor: 0, _backing: Backing::Heap(r.clone()) };
        (ring(&region), ring(&region))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `data` (padded to 8) through `tx` while draining `rx`.
    fn through(tx: &mut Ring, rx: &mut Ring, data: &[u8]) -> Vec<u8> {
        let total = data.len().next_multiple_of(8);
        let mut got = Vec::new();
        let mut sent = 0;
        while got.len() < total {
            sent += tx.push(&data[sent.min(data.len())..], total - sent);
            rx.pop(total - got.len(), |piece| {
                assert_eq!(piece.as_ptr() as usize % 8, 0);
                got.extend_from_slice(piece)
            });
        }
        got.truncate(data.len());
        got
    }

    #[test]
    #[cfg_attr(miri, ignore)] // memfd and mmap
    fn bytes_come_out_in_order_across_the_wrap_through_a_memfd() {
        let (mut rx, fd) = Ring::create(64).unwrap();
        let mut tx = Ring::open(fd).unwrap();
        let data: Vec<u8> = (0..200u8).collect();
        assert_eq!(through(&mut tx, &mut rx, &data), data);
        tx.abort();
        assert!(rx.aborted());
    }

    #[test]
    #[cfg_attr(miri, ignore)] // memfd and mmap
    fn a_file_that_is_not_a_ring_is_refused() {
        let (_, fd) = Ring::create(64).unwrap();
        let file = File::from(fd);
        file.set_len(100).unwrap();
        assert!(Ring::open(file.into()).is_err());
    }

    #[test]
    fn bytes_come_out_in_order_across_the_wrap_on_the_heap() {
        let (mut tx, mut rx) = heap::pair(64);
        let data: Vec<u8> = (0..200u8).collect();
        assert_eq!(through(&mut tx, &mut rx, &data), data);
    }

    /// xorshift: deterministic message sizes and contents, no dependency.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    fn checksum(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    }

    /// A producer and a consumer thread, messages of random sizes that wrap
    /// the ring at every offset, each checked against its checksum.
    #[test]
    fn two_threads_stress_the_ring() {
        let (messages, capacity) = if cfg!(miri) { (40, 96) } else { (20_000, 4096) };
        let (mut tx, mut rx) = heap::pair(capacity);
        let producer = std::thread::spawn(move || {
            let mut seed = 0x9e37_79b9_7f4a_7c15u64;
            for m in 0..messages {
                let len = (next(&mut seed) % (2 * capacity as u64 + 17)) as usize;
                let mut msg: Vec<u8> = (0..len).map(|i| (i as u64 ^ m as u64 ^ seed) as u8).collect();
                // length and checksum lead the message, 8 bytes each
                let mut framed = (len as u64).to_le_bytes().to_vec();
                framed.extend_from_slice(&checksum(&msg).to_le_bytes());
                framed.append(&mut msg);
                let total = framed.len().next_multiple_of(8);
                let mut sent = 0;
                while sent < total {
                    match tx.push(&framed[sent.min(framed.len())..], total - sent) {
                        0 => std::thread::yield_now(),
                        n => sent += n,
                    }
                }
            }
        });
        let mut recv_exact = |want: usize| -> Vec<u8> {
            let total = want.next_multiple_of(8);
            let mut got = Vec::with_capacity(total);
            while got.len() < total {
                if rx.pop(total - got.len(), |piece| got.extend_from_slice(piece)) == 0 {
                    std::thread::yield_now();
                }
            }
            got.truncate(want);
            got
        };
        for m in 0..messages {
            let head = recv_exact(16);
            let len = u64::from_le_bytes(head[..8].try_into().unwrap()) as usize;
            let sum = u64::from_le_bytes(head[8..].try_into().unwrap());
            let body = recv_exact(len);
            assert_eq!(checksum(&body), sum, "message {m} of {len} bytes");
        }
        producer.join().unwrap();
    }
}
