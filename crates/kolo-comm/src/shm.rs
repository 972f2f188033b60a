//! Single-producer single-consumer byte rings in shared memory, one per
//! direction between two ranks of a host. Persistent and pre-faulted: a
//! collective never allocates or page-faults. Data moves in 8-byte units,
//! so every view a consumer gets is 8-byte aligned.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

/// Header: producer counter, consumer counter, each on its own cache line.
const HEADER: usize = 4096;
const HEAD_AT: usize = 0;
const TAIL_AT: usize = 128;
/// Set by either side that gave up on the connection (after an error).
const ABORT_AT: usize = 256;

/// Most bytes moved by one call, so a sender and a receiver alternate in
/// pieces that stay in cache.
pub const SEGMENT: usize = 256 * 1024;

pub struct Ring {
    map: MmapMut,
    capacity: usize,
    /// Local copy of our own counter (the other side only reads it).
    cursor: u64,
    /// The file to remove once every rank has mapped it (creator only).
    path: Option<PathBuf>,
}

impl Ring {
    /// Creates the ring's file under a temporary name, sizes and pre-faults
    /// it, then renames it into place so an opener never sees it half-made.
    pub fn create(path: &Path, capacity: usize) -> io::Result<Ring> {
        assert!(capacity.is_multiple_of(8) && capacity >= 8);
        let tmp = path.with_extension("tmp");
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp)?;
        file.set_len((HEADER + capacity) as u64)?;
        // SAFETY: the file is ours and sized above; other processes only map it after the rename.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        // touch every page now, not during a collective
        for page in map.chunks_mut(4096) {
            page[0] = 0;
        }
        std::fs::rename(&tmp, path)?;
        Ok(Ring { map, capacity, cursor: 0, path: Some(path.to_path_buf()) })
    }

    /// Maps a ring another rank created.
    pub fn open(path: &Path) -> io::Result<Ring> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        if len <= HEADER {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is not a kolo ring", path.display())));
        }
        // SAFETY: the creator sized the file before renaming it into place; it is never truncated.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        for page in map.chunks_mut(4096) {
            // reading is enough to fault the page in; keep the value
            std::hint::black_box(page[0]);
        }
        drop::<File>(file);
        Ok(Ring { map, capacity: len - HEADER, cursor: 0, path: None })
    }

    /// Tells the other side this connection is dead.
    pub fn abort(&self) {
        self.counter(ABORT_AT).store(1, Ordering::Release);
    }

    pub fn aborted(&self) -> bool {
        self.counter(ABORT_AT).load(Ordering::Acquire) != 0
    }

    /// Removes the file; the mappings stay valid.
    pub fn unlink(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is 8-aligned inside the page-aligned header; the
        // mapping lives as long as `self`; AtomicU64 has u64's layout.
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.map.as_ptr().add(HEADER) as *mut u8 }
    }

    /// Producer: copies up to `data.len()` bytes (a multiple of 8, except
    /// for a message's last piece, whose padding up to 8 is skipped) and
    /// returns how many ring bytes it advanced.
    pub fn push(&mut self, data: &[u8], padded_len: usize) -> usize {
        let tail = self.counter(TAIL_AT).load(Ordering::Acquire);
        let free = self.capacity - (self.cursor - tail) as usize;
        let n = padded_len.min(free).min(SEGMENT) & !7;
        if n == 0 {
            return 0;
        }
        let copy = n.min(data.len());
        let at = (self.cursor % self.capacity as u64) as usize;
        let first = copy.min(self.capacity - at);
        // SAFETY: [at, at+first) and [0, copy-first) lie in the data area;
        // the consumer does not read them until `head` is published below.
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
    pub fn pop(&mut self, max: usize, mut take: impl FnMut(&[u8])) -> usize {
        let head = self.counter(HEAD_AT).load(Ordering::Acquire);
        let n = ((head - self.cursor) as usize).min(max).min(SEGMENT) & !7;
        if n == 0 {
            return 0;
        }
        let at = (self.cursor % self.capacity as u64) as usize;
        let first = n.min(self.capacity - at);
        // SAFETY: the producer published these bytes (Acquire above) and
        // will not overwrite them until `tail` moves past them.
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

impl Drop for Ring {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_come_out_in_order_across_the_wrap() {
        let path = std::env::temp_dir().join(format!("kolo-ring-test-{}", std::process::id()));
        let mut tx = Ring::create(&path, 64).unwrap();
        let mut rx = Ring::open(&path).unwrap();
        tx.unlink();
        let data: Vec<u8> = (0..200u8).collect();
        let mut got = Vec::new();
        let mut sent = 0;
        while got.len() < 200 {
            let padded = 200usize.next_multiple_of(8) - sent;
            sent += tx.push(&data[sent.min(200)..], padded);
            rx.pop(usize::MAX, |piece| {
                assert_eq!(piece.as_ptr() as usize % 8, 0);
                got.extend_from_slice(piece)
            });
        }
        assert_eq!(&got[..200], &data[..]);
    }
}
