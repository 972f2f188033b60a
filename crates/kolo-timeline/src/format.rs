//! The rank's timeline file: a header, then fixed-size records, in the
//! order they were recorded. The header's count is written after each
//! record, so a reader sees only whole records, even of a killed process.

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"KOLOTL\x00\x01";
/// The header's size.
pub const HEADER_BYTES: usize = 64;
/// Each record's size.
pub const RECORD_BYTES: usize = 192;
const OP_BYTES: usize = 16;
const NAME_BYTES: usize = RECORD_BYTES - 72;

/// Who recorded a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Source {
    /// A communicator's own collective (the `kolo` torch backend, kolo.elastic,
    /// Rust programs): matched across ranks by communicator and sequence.
    Comm,
    /// A tensor of Horovod's API: matched by process set and the order the
    /// core ran its tensors in, which every rank shares.
    Horovod,
}

impl Source {
    /// Its name in the trace.
    pub fn name(self) -> &'static str {
        match self {
            Source::Comm => "collectives",
            Source::Horovod => "horovod",
        }
    }
}

/// One collective as a rank recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Who recorded it.
    pub source: Source,
    /// `allreduce`, `broadcast`...
    pub op: String,
    /// Horovod's tensor name (empty for a communicator's collectives).
    pub name: String,
    /// The same on every rank for the same collective.
    pub key: (u64, u64),
    /// This rank's bytes in.
    pub bytes: u64,
    /// When the caller asked for it (ns since the epoch, this host's clock).
    pub submitted_ns: i64,
    /// When this rank began it.
    pub started_ns: i64,
    /// When it ended here.
    pub ended_ns: i64,
    /// It ended in an error.
    pub failed: bool,
}

/// The header of an empty file with room for `capacity` records.
pub(crate) fn header(capacity: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&(RECORD_BYTES as u32).to_le_bytes());
    h[12..16].copy_from_slice(&capacity.to_le_bytes());
    h
}

/// Writes the counts (records kept, records dropped for want of room).
pub(crate) fn set_counts(header: &mut [u8], count: u64, dropped: u64) {
    header[16..24].copy_from_slice(&count.to_le_bytes());
    header[24..32].copy_from_slice(&dropped.to_le_bytes());
}

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Writes one record into `out` (`RECORD_BYTES` long); names longer than
/// the room are cut at a character.
pub(crate) fn encode(span: &crate::Span<'_>, out: &mut [u8]) {
    out[..8].copy_from_slice(&span.key.0.to_le_bytes());
    out[8..16].copy_from_slice(&span.key.1.to_le_bytes());
    out[16..24].copy_from_slice(&span.submitted_ns.to_le_bytes());
    out[24..32].copy_from_slice(&span.started_ns.to_le_bytes());
    out[32..40].copy_from_slice(&span.ended_ns.to_le_bytes());
    out[40..48].copy_from_slice(&span.bytes.to_le_bytes());
    out[48] = span.source as u8;
    out[49] = span.failed as u8;
    let (op, name) = (cut(span.op, OP_BYTES), cut(span.name, NAME_BYTES));
    out[50] = op.len() as u8;
    out[51] = name.len() as u8;
    out[56..56 + op.len()].copy_from_slice(op.as_bytes());
    out[72..72 + name.len()].copy_from_slice(name.as_bytes());
}

/// The part of a timeline file that holds its header and its whole
/// records (the rest of the file is room never written).
pub fn used_bytes(file: &[u8]) -> &[u8] {
    match counts(file) {
        Ok((count, _)) => &file[..HEADER_BYTES + count * RECORD_BYTES],
        Err(_) => &[],
    }
}

/// How many bytes of a timeline file hold its header and records, read
/// from its header alone (so that a reader need not read the room never
/// written); `None` if it is not a timeline file.
pub fn recorded_len(header: &[u8]) -> Option<usize> {
    let (count, _) = header_counts(header).ok()?;
    // capped at the room the header gives: a damaged count asks for no more
    let capacity = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes")) as usize;
    Some(HEADER_BYTES + count.min(capacity) * RECORD_BYTES)
}

/// The header's counts: records kept (as written, unchecked against the
/// file's size) and records dropped.
fn header_counts(file: &[u8]) -> Result<(usize, u64), String> {
    if file.len() < HEADER_BYTES || &file[..8] != MAGIC {
        return Err("not a kolo timeline file (no header)".into());
    }
    let word = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().expect("8 bytes"));
    let record_bytes = u32::from_le_bytes(file[8..12].try_into().expect("4 bytes")) as usize;
    if record_bytes != RECORD_BYTES {
        return Err(format!("records of {record_bytes} bytes, not {RECORD_BYTES}: another version of kolo wrote it"));
    }
    Ok((word(16) as usize, word(24)))
}

fn counts(file: &[u8]) -> Result<(usize, u64), String> {
    let (count, dropped) = header_counts(file)?;
    let whole = (file.len() - HEADER_BYTES) / RECORD_BYTES;
    // the count is written after its record: never more than the file holds
    Ok((count.min(whole), dropped))
}

/// The records of a timeline file and how many were dropped for want of
/// room; an error names what is wrong with the file.
pub fn decode(file: &[u8]) -> Result<(Vec<Record>, u64), String> {
    let (count, dropped) = counts(file)?;
    let mut records = Vec::with_capacity(count);
    for i in 0..count {
        let r = &file[HEADER_BYTES + i * RECORD_BYTES..][..RECORD_BYTES];
        let word = |at: usize| u64::from_le_bytes(r[at..at + 8].try_into().expect("8 bytes"));
        let source = match r[48] {
            0 => Source::Comm,
            1 => Source::Horovod,
            other => return Err(format!("record {i} has an unknown source {other}")),
        };
        let (op_len, name_len) = (r[50] as usize, r[51] as usize);
        if op_len > OP_BYTES || name_len > NAME_BYTES {
            return Err(format!("record {i} is damaged (names longer than their room)"));
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        records.push(Record {
            source,
            op: text(&r[56..56 + op_len]),
            name: text(&r[72..72 + name_len]),
            key: (word(0), word(8)),
            bytes: word(40),
            submitted_ns: word(16) as i64,
            started_ns: word(24) as i64,
            ended_ns: word(32) as i64,
            failed: r[49] != 0,
        });
    }
    Ok((records, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Span;

    fn file_of(spans: &[Span<'_>], dropped: u64) -> Vec<u8> {
        let mut file = header(spans.len() as u32 + 1).to_vec();
        for span in spans {
            let mut r = [0u8; RECORD_BYTES];
            encode(span, &mut r);
            file.extend_from_slice(&r);
        }
        set_counts(&mut file, spans.len() as u64, dropped);
        // room never written follows the records
        file.extend_from_slice(&[0u8; RECORD_BYTES]);
        file
    }

    fn span(name: &str) -> Span<'_> {
        Span {
            source: Source::Horovod,
            op: "allreduce",
            name,
            key: (3, 7),
            bytes: 4096,
            submitted_ns: 1_000,
            started_ns: 2_000,
            ended_ns: 5_000,
            failed: false,
        }
    }

    #[test]
    fn records_read_back_as_written_and_the_unwritten_room_is_not_read() {
        let long = "ü".repeat(100);
        let file = file_of(&[span("grad.w"), Span { failed: true, source: Source::Comm, ..span(&long) }], 2);
        let (records, dropped) = decode(&file).unwrap();
        assert_eq!(dropped, 2);
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].name, "grad.w");
        assert_eq!((records[0].key, records[0].bytes, records[0].ended_ns), ((3, 7), 4096, 5_000));
        // cut at a character inside the room, never in the middle of one
        assert_eq!(records[1].name, "ü".repeat(NAME_BYTES / 2));
        assert!(records[1].failed && records[1].source == Source::Comm);
        assert_eq!(used_bytes(&file).len(), HEADER_BYTES + 2 * RECORD_BYTES);
        assert_eq!(recorded_len(&file[..HEADER_BYTES]), Some(HEADER_BYTES + 2 * RECORD_BYTES));
        assert_eq!(recorded_len(b"short"), None);
        // a damaged count asks for no more than the file's room
        let mut damaged = file[..HEADER_BYTES].to_vec();
        set_counts(&mut damaged, u64::MAX, 0);
        assert_eq!(recorded_len(&damaged), Some(HEADER_BYTES + 3 * RECORD_BYTES));
    }

    #[test]
    fn a_count_past_the_end_of_a_cut_file_reads_only_whole_records() {
        let mut file = file_of(&[span("a"), span("b")], 0);
        file.truncate(HEADER_BYTES + RECORD_BYTES + 10);
        assert_eq!(decode(&file).unwrap().0.len(), 1);
    }

    #[test]
    fn other_files_are_named_not_misread() {
        assert!(decode(b"hello").unwrap_err().contains("not a kolo timeline file"));
        let mut file = file_of(&[span("a")], 0);
        file[8] = 9;
        assert!(decode(&file).unwrap_err().contains("another version of kolo"));
        assert!(used_bytes(b"garbage").is_empty());
        let mut file = file_of(&[span("a")], 0);
        file[HEADER_BYTES + 48] = 7;
        assert!(decode(&file).unwrap_err().contains("unknown source 7"));
    }
}
