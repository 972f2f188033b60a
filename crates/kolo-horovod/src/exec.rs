//! Running a response: the collective every rank of the set runs for it,
//! on the set's kolo-comm communicator, over the tensors' own memory (or
//! the fusion buffer, for fused reductions).

use half::{bf16, f16};
use kolo_comm::{CommError, Communicator, DType};

use crate::entry::{Entry, Output};
use crate::message::{ReduceOp, Response, ResponseType};
use crate::timeline::{Trace, KOLO_ALLREDUCE, MEMCPY_IN_FUSION_BUFFER, MEMCPY_OUT_FUSION_BUFFER};

/// Multiplies every element by `factor` as upstream does on the CPU:
/// floats in their own precision (half types in f32), integers in f64,
/// truncated toward zero as C++ converts the product back.
pub(crate) fn scale(dtype: DType, bytes: &mut [u8], factor: f64) {
    if factor == 1.0 {
        return;
    }
    macro_rules! each {
        ($t:ty, $f:expr) => {{
            let values: &mut [$t] = bytemuck::cast_slice_mut(bytes);
            for v in values {
                *v = $f(*v);
            }
        }};
    }
    let f32_factor = factor as f32;
    match dtype {
        DType::F32 => each!(f32, |x: f32| x * f32_factor),
        DType::F64 => each!(f64, |x: f64| x * factor),
        DType::F16 => each!(f16, |x: f16| f16::from_f32(x.to_f32() * f32_factor)),
        DType::BF16 => each!(bf16, |x: bf16| bf16::from_f32(x.to_f32() * f32_factor)),
        DType::I32 => each!(i32, |x: i32| (f64::from(x) * factor) as i32),
        DType::I64 => each!(i64, |x: i64| (x as f64 * factor) as i64),
        DType::U8 => each!(u8, |x: u8| (f64::from(x) * factor) as u8),
        DType::I8 => each!(i8, |x: i8| (f64::from(x) * factor) as i8),
    }
}

fn comm_op(op: ReduceOp) -> kolo_comm::ReduceOp {
    match op {
        ReduceOp::Min => kolo_comm::ReduceOp::Min,
        ReduceOp::Max => kolo_comm::ReduceOp::Max,
        ReduceOp::Product => kolo_comm::ReduceOp::Prod,
        // an average sums, then scales by 1/size with the postscale
        ReduceOp::Average | ReduceOp::Sum | ReduceOp::Adasum => kolo_comm::ReduceOp::Sum,
    }
}

fn allreduce_in_place(
    comm: &mut Communicator,
    dtype: DType,
    bytes: &mut [u8],
    op: kolo_comm::ReduceOp,
) -> Result<(), CommError> {
    kolo_comm::with_element_type!(dtype, T => comm.allreduce_in_place::<T>(bytemuck::cast_slice_mut(bytes), op))
}

/// Bytes aligned for every element type (the fusion buffer, copies).
#[derive(Default, Debug)]
pub(crate) struct Aligned(Vec<u64>);

impl Aligned {
    /// `len` zero bytes.
    pub(crate) fn zeroed(&mut self, len: usize) -> &mut [u8] {
        let bytes = self.sized(len);
        bytes.fill(0);
        bytes
    }

    /// `len` bytes, whatever they held (the caller writes them all): no
    /// pass over memory that is about to be overwritten.
    pub(crate) fn sized(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() < len.div_ceil(8) {
            self.0.resize(len.div_ceil(8), 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.0)[..len]
    }
}

/// A reduction (fused or not; a sum, an average... or Adasum, as upstream
/// with the prescale before it and the postscale after): `entries[i]` is the response's tensor `i`,
/// or `None` on a rank that joined (it reduces zeros). The outcomes by
/// tensor; `fusion` is the persistent fusion buffer. Each step is its
/// tensors' activity on `trace`.
pub(crate) fn allreduce(
    comm: &mut Communicator,
    response: &Response,
    entries: &[Option<&Entry>],
    fusion: &mut Aligned,
    trace: Trace<'_>,
) -> Result<Vec<Output>, CommError> {
    let dtype = response.dtype.comm().expect("reductions of this type are refused when submitted");
    let esize = dtype.size();
    let (op, postscale) = match response.reduce_op {
        // a plain average is the exact quotient, made in the reduction's
        // last step (no pass of its own): what `t / size` gives, where
        // upstream's multiplication by 1/size is off by an ulp for a third
        // of the values at 3 ranks (and its own tests expect the quotient)
        ReduceOp::Average if response.postscale == 1.0 => (kolo_comm::ReduceOp::Avg, 1.0),
        ReduceOp::Average => (kolo_comm::ReduceOp::Sum, response.postscale / comm.size() as f64),
        other => (comm_op(other), response.postscale),
    };
    // Adasum combines each tensor by its own dot products: the reduction
    // is told where each tensor of the buffer it reduces starts
    let adasum = response.kind == ResponseType::Adasum;
    let run = |comm: &mut Communicator, bytes: &mut [u8], counts: &[usize], prescale: f64, postscale: f64| {
        scale(dtype, bytes, prescale);
        match adasum {
            true => {
                kolo_comm::with_element_type!(dtype, T => comm.adasum::<T>(bytemuck::cast_slice_mut(bytes), counts))?
            }
            false => allreduce_in_place(comm, dtype, bytes, op)?,
        }
        scale(dtype, bytes, postscale);
        Ok::<(), CommError>(())
    };
    let lens: Vec<usize> = response.sizes.iter().map(|&n| n as usize * esize).collect();
    // a tensor alone, or a large one, is reduced in its caller's memory:
    // fusing a large one would only add two copies of it (all ranks
    // decide alike: the sizes are the response's); the rest go together
    // through the fusion buffer, in the response's order
    let alone = |len: usize| entries.len() == 1 || len >= ALONE_BYTES;
    for (i, (entry, &len)) in entries.iter().zip(&lens).enumerate() {
        if !alone(len) {
            continue;
        }
        let name = [response.names[i].as_str()];
        trace.activity(name, KOLO_ALLREDUCE);
        match entry {
            Some(entry) => {
                let submit = &entry.submit;
                // SAFETY: the submitter's buffers, theirs to keep valid until done.
                let out = unsafe { submit.output.unwrap_or(submit.input).bytes() };
                if let Some(output) = submit.output.filter(|o| *o != submit.input) {
                    // SAFETY: as above; input and output do not overlap (the caller's two tensors).
                    out[..output.len.min(submit.input.len)].copy_from_slice(unsafe { &submit.input.bytes()[..] });
                }
                run(comm, &mut out[..len], &[len / esize], response.prescale, postscale)?;
            }
            // a rank that joined reduces zeros
            None => run(comm, fusion.zeroed(len), &[len / esize], 1.0, 1.0)?,
        }
        trace.activity_end(name);
    }
    let together: usize = lens.iter().filter(|&&len| !alone(len)).sum();
    if together > 0 {
        let fused = || response.names.iter().zip(&lens).filter(|(_, &len)| !alone(len)).map(|(n, _)| n.as_str());
        trace.activity(fused(), MEMCPY_IN_FUSION_BUFFER);
        let buffer = fusion.sized(together);
        let mut at = 0;
        for (entry, &len) in entries.iter().zip(&lens).filter(|(_, &len)| !alone(len)) {
            match entry {
                // SAFETY: as above.
                Some(entry) => buffer[at..at + len].copy_from_slice(unsafe { &entry.submit.input.bytes()[..len] }),
                None => buffer[at..at + len].fill(0),
            }
            at += len;
        }
        let counts: Vec<usize> = lens.iter().filter(|&&len| !alone(len)).map(|len| len / esize).collect();
        trace.activity(fused(), KOLO_ALLREDUCE);
        run(comm, buffer, &counts, response.prescale, postscale)?;
        trace.activity(fused(), MEMCPY_OUT_FUSION_BUFFER);
        let mut at = 0;
        for (entry, &len) in entries.iter().zip(&lens).filter(|(_, &len)| !alone(len)) {
            if let Some(entry) = entry {
                let submit = &entry.submit;
                // SAFETY: as above.
                let out = unsafe { submit.output.unwrap_or(submit.input).bytes() };
                out[..len].copy_from_slice(&buffer[at..at + len]);
            }
            at += len;
        }
        trace.activity_end(fused());
    }
    Ok(vec![Output::default(); entries.len()])
}

/// Tensors this large are reduced in their own memory, not fused.
const ALONE_BYTES: usize = 1 << 20;

/// Allgather (fused or not): each tensor's rows from every rank, in rank
/// order, in memory the core makes.
pub(crate) fn allgather(
    comm: &mut Communicator,
    response: &Response,
    entries: &[&Entry],
) -> Result<Vec<Output>, CommError> {
    let n = comm.size();
    let row_bytes: Vec<usize> = entries
        .iter()
        .map(|e| e.submit.shape.iter().skip(1).product::<i64>() as usize * e.submit.dtype.size())
        .collect();
    let dims = |i: usize| &response.sizes[i * n..(i + 1) * n];
    let mut send = Vec::new();
    for e in entries {
        // SAFETY: the submitter's buffer.
        send.extend_from_slice(unsafe { e.submit.input.bytes() });
    }
    let counts: Vec<usize> =
        (0..n).map(|r| (0..entries.len()).map(|i| dims(i)[r] as usize * row_bytes[i]).sum()).collect();
    let mut recv = vec![0u8; counts.iter().sum()];
    comm.allgatherv(&send, &mut recv, &counts)?;
    let mut outputs: Vec<Output> = (0..entries.len())
        .map(|i| Output {
            data: Some(Vec::with_capacity(dims(i).iter().sum::<i64>() as usize * row_bytes[i])),
            dims: vec![dims(i).iter().sum()],
            last_joined_rank: -1,
        })
        .collect();
    let mut at = 0;
    for r in 0..n {
        for (i, out) in outputs.iter_mut().enumerate() {
            let len = dims(i)[r] as usize * row_bytes[i];
            out.data.as_mut().expect("made above").extend_from_slice(&recv[at..at + len]);
            at += len;
        }
    }
    Ok(outputs)
}

/// Broadcast, in place in the caller's tensor.
pub(crate) fn broadcast(comm: &mut Communicator, entry: &Entry) -> Result<Output, CommError> {
    // SAFETY: the submitter's buffer.
    let bytes = unsafe { entry.submit.output.unwrap_or(entry.submit.input).bytes() };
    if let Some(output) = entry.submit.output.filter(|o| *o != entry.submit.input) {
        // SAFETY: as above.
        bytes[..output.len.min(entry.submit.input.len)].copy_from_slice(unsafe { entry.submit.input.bytes() });
    }
    comm.broadcast::<u8>(bytes, entry_root(entry))?;
    Ok(Output::default())
}

fn entry_root(entry: &Entry) -> usize {
    entry.submit.root_rank as usize
}

/// Alltoall: rows to each rank as the splits say; the rows received from
/// each come back with the result.
pub(crate) fn alltoall(comm: &mut Communicator, entry: &Entry) -> Result<Output, CommError> {
    let n = comm.size();
    let submit = &entry.submit;
    let row = submit.shape.iter().skip(1).product::<i64>() as usize * submit.dtype.size();
    let splits: Vec<i64> = match submit.splits.is_empty() {
        false => submit.splits.clone(),
        true => vec![submit.shape.first().copied().unwrap_or(0) / n as i64; n],
    };
    let mut received = vec![0i64; n];
    let ones = vec![1usize; n];
    comm.alltoallv::<i64>(&splits, &ones, &mut received, &ones)?;
    let send_counts: Vec<usize> = splits.iter().map(|&s| s as usize * row).collect();
    let recv_counts: Vec<usize> = received.iter().map(|&s| s as usize * row).collect();
    // SAFETY: the submitter's buffer.
    let input = unsafe { submit.input.bytes() };
    let sent: usize = send_counts.iter().sum();
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    comm.alltoallv::<u8>(&input[..sent], &send_counts, &mut recv, &recv_counts)?;
    Ok(Output { data: Some(recv), dims: received, last_joined_rank: -1 })
}

/// Reducescatter: this rank's rows of the reduction (the first `dim0 %
/// size` ranks get one more), into the caller's output.
pub(crate) fn reducescatter(comm: &mut Communicator, response: &Response, entry: &Entry) -> Result<Output, CommError> {
    let n = comm.size();
    let submit = &entry.submit;
    let dtype = submit.dtype.comm().expect("reductions of this type are refused when submitted");
    let dim0 = submit.shape.first().copied().unwrap_or(0) as usize;
    let row = submit.shape.iter().skip(1).product::<i64>() as usize;
    let counts: Vec<usize> = kolo_comm::split_counts(dim0, n).into_iter().map(|rows| rows * row).collect();
    let mut copy = Aligned::default();
    let input = copy.zeroed(submit.input.len);
    // SAFETY: the submitter's buffer.
    input.copy_from_slice(unsafe { submit.input.bytes() });
    scale(dtype, input, response.prescale);
    let output = submit.output.expect("reducescatter's output is made by the caller");
    // SAFETY: as above.
    let out = unsafe { output.bytes() };
    kolo_comm::with_element_type!(dtype, T => comm.reduce_scatter_counts::<T>(
        bytemuck::cast_slice(input),
        bytemuck::cast_slice_mut(out),
        &counts,
        comm_op(response.reduce_op),
    ))?;
    scale(dtype, out, response.postscale);
    Ok(Output::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_truncates_integers_toward_zero_and_leaves_factor_one_alone() {
        let mut ints = bytemuck::cast_slice::<i32, u8>(&[7, -7, 3]).to_vec();
        scale(DType::I32, &mut ints, 0.5);
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&ints), [3, -3, 1]);
        let mut floats = bytemuck::cast_slice::<f32, u8>(&[1.0, 2.5]).to_vec();
        scale(DType::F32, &mut floats, 2.0);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&floats), [2.0, 5.0]);
        let mut halves = bytemuck::cast_slice::<f16, u8>(&[f16::from_f32(3.0)]).to_vec();
        scale(DType::F16, &mut halves, 1.0 / 3.0);
        assert_eq!(bytemuck::cast_slice::<u8, f16>(&halves)[0], f16::from_f64(1.0));
    }

    #[test]
    fn element_type_names_parse_back_and_only_kolo_comms_types_reduce() {
        use crate::message::DataType::{self, *};
        for t in [Uint8, Int8, Uint16, Int16, Int32, Int64, Float16, Float32, Float64, Bool, Bfloat16] {
            assert_eq!(t.name().parse::<DataType>(), Ok(t));
            if let Some(d) = t.comm() {
                assert_eq!(d.size(), t.size(), "{t:?}");
            }
        }
        assert!("bf16".parse::<DataType>().is_err(), "one vocabulary: numpy's names");
        assert_eq!(DataType::Float32.comm(), Some(DType::F32));
        assert_eq!(DataType::Int16.comm(), None);
        assert_eq!(DataType::Bool.comm(), None);
    }
}
