//! Element types and reduction kernels. Buffers travel as bytes; the
//! kernels view them as typed slices (every offset kolo-comm hands them is
//! a multiple of 8, so the views are aligned).

use half::{bf16, f16};

/// The element types collectives carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE half float (`half::f16`); reduced in f32.
    F16,
    /// bfloat16 (`half::bf16`); reduced in f32.
    BF16,
    /// 32-bit signed integer; sums and products wrap.
    I32,
    /// 64-bit signed integer; sums and products wrap.
    I64,
    /// Byte; sums and products wrap.
    U8,
    /// Signed byte; sums and products wrap.
    I8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::I8 => 1,
        }
    }

    /// The lowercase name (`"f32"`, `"bf16"`, ...) that `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::I8 => "i8",
        }
    }

    /// Every element type, in declaration order.
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8, DType::I8];
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype '{s}'; known: f32, f64, f16, bf16, i32, i64, u8, i8"))
    }
}

/// How values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Adds the values (integers wrap).
    Sum,
    /// Multiplies the values (integers wrap).
    Prod,
    /// Keeps the smallest value.
    Min,
    /// Keeps the largest value.
    Max,
    /// Sum, divided by the number of ranks at the end.
    Avg,
}

impl ReduceOp {
    /// Every op, in declaration order.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// How two values combine on the way: an average sums, and divides once
    /// at the end.
    pub fn combining(self) -> ReduceOp {
        if self == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            self
        }
    }

    /// The lowercase name (`"sum"`, `"avg"`, ...) that `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| format!("unknown op '{s}'; known: sum, prod, min, max, avg"))
    }
}

/// A type collectives can carry.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The [`DType`] that names this type on the wire.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i32 => I32, i64 => I64, u8 => U8, i8 => I8);

/// Arithmetic for the kernels; half types compute in f32.
trait Arith: Copy {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn divide(self, n: usize) -> Self;
}

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn divide(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
float_arith!(f32, f64);

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    // integers wrap, as MPI and NCCL leave overflow to the user
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            // in a wide type: `n as u8` is 0 at 256 ranks, and wrong beyond
            fn divide(self, n: usize) -> Self { (self as i128 / n as i128) as $t }
        }
    )*};
}
int_arith!(i32, i64, u8, i8);

macro_rules! half_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f32(f32::combine(op, a.to_f32(), b.to_f32()))
            }
            fn divide(self, n: usize) -> Self { <$t>::from_f32(self.to_f32() / n as f32) }
        }
    )*};
}
half_arith!(f16, bf16);

// Each op gets its own loop so the compiler vectorizes it.
fn into_typed<T: Arith + bytemuck::Pod>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let src: &[T] = bytemuck::cast_slice(src);
    macro_rules! each {
        ($op:expr) => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::combine($op, *d, *s);
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(ReduceOp::Sum),
        ReduceOp::Prod => each!(ReduceOp::Prod),
        ReduceOp::Min => each!(ReduceOp::Min),
        ReduceOp::Max => each!(ReduceOp::Max),
    }
}

fn to_typed<T: Arith + bytemuck::Pod>(op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let a: &[T] = bytemuck::cast_slice(a);
    let b: &[T] = bytemuck::cast_slice(b);
    macro_rules! each {
        ($op:expr) => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = T::combine($op, *x, *y);
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(ReduceOp::Sum),
        ReduceOp::Prod => each!(ReduceOp::Prod),
        ReduceOp::Min => each!(ReduceOp::Min),
        ReduceOp::Max => each!(ReduceOp::Max),
    }
}

fn divide_typed<T: Arith + bytemuck::Pod>(buf: &mut [u8], n: usize) {
    for v in bytemuck::cast_slice_mut::<u8, T>(buf) {
        *v = v.divide(n);
    }
}

/// `dst = dst op src`, element-wise.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    crate::with_element_type!(dtype, T => into_typed::<T>(op, dst, src))
}

/// `dst = a op b`, element-wise.
pub(crate) fn reduce_to(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    debug_assert!(dst.len() == a.len() && a.len() == b.len());
    crate::with_element_type!(dtype, T => to_typed::<T>(op, dst, a, b))
}

/// Divides every element by `n` (the end of an average).
pub(crate) fn divide(dtype: DType, buf: &mut [u8], n: usize) {
    crate::with_element_type!(dtype, T => divide_typed::<T>(buf, n))
}

/// Copies with non-temporal stores: for results larger than the caches,
/// skipping the read-for-ownership of `dst` saves a third of the memory
/// traffic of a copy.
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = dst.len();
        let head = dst.as_ptr().align_offset(16).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let blocks = (n - head) / 16;
        // SAFETY: SSE2 is part of x86_64; `head + 16 * blocks <= n`, and
        // `src` is as long as `dst` (both callers slice `dst` to `src`'s
        // length; debug-asserted above), so the pointers cover `blocks`
        // 16-byte blocks inside both slices; `d` is 16-aligned by `head`
        // (the store needs it, the unaligned load does not).
        unsafe {
            let d = dst.as_mut_ptr().add(head) as *mut __m128i;
            let s = src.as_ptr().add(head) as *const __m128i;
            for i in 0..blocks {
                _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i)));
            }
            _mm_sfence();
        }
        let tail = head + blocks * 16;
        dst[tail..].copy_from_slice(&src[tail..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// `dst = a op b`, written with non-temporal stores through a small
/// cache-resident block.
pub(crate) fn reduce_to_streaming(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    let mut block = [0u64; 512];
    let block: &mut [u8] = bytemuck::cast_slice_mut(&mut block);
    let mut at = 0;
    while at < dst.len() {
        let end = (at + block.len()).min(dst.len());
        let tmp = &mut block[..end - at];
        reduce_to(dtype, op, tmp, &a[at..end], &b[at..end]);
        stream_copy(&mut dst[at..end], tmp);
        at = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // typed buffers viewed as bytes (a Vec<u8> need not be aligned for f32)
    fn b<T: bytemuck::Pod>(v: &mut [T]) -> &mut [u8] {
        bytemuck::cast_slice_mut(v)
    }

    fn r<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
        bytemuck::cast_slice(v)
    }

    #[test]
    fn kernels_per_type_and_op() {
        let mut d = [1.0f32, 5.0, -2.0];
        reduce_into(DType::F32, ReduceOp::Max, b(&mut d), r(&[3.0f32, 4.0, -1.0]));
        assert_eq!(d, [3.0, 5.0, -1.0]);
        let (a, bb) = ([200u8, 3], [100u8, 9]);
        let mut out = [0u8; 2];
        reduce_to(DType::U8, ReduceOp::Sum, &mut out, &a, &bb);
        assert_eq!(out, [44, 12]); // wraps
        let h = [bf16::from_f32(1.5), bf16::from_f32(2.0)];
        let mut hb = h;
        reduce_into(DType::BF16, ReduceOp::Prod, b(&mut hb), r(&h));
        assert_eq!(hb, [bf16::from_f32(2.25), bf16::from_f32(4.0)]);
        let mut i = [9i64, -9];
        divide(DType::I64, b(&mut i), 2);
        assert_eq!(i, [4, -4]);
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
        assert!("f8".parse::<DType>().unwrap_err().contains("unknown dtype 'f8'"));
    }

    #[test]
    fn integer_averages_divide_by_any_rank_count() {
        for n in [256usize, 1000, 70_000] {
            let mut u = [255u8, 7, 0];
            divide(DType::U8, &mut u, n);
            assert_eq!(u, [0, 0, 0], "u8 by {n}");
        }
        let mut u = [255u8, 200];
        divide(DType::U8, &mut u, 100);
        assert_eq!(u, [2, 2]);
        let mut i = [-5000i32, 5000, i32::MAX];
        divide(DType::I32, b(&mut i), 1000);
        assert_eq!(i, [-5, 5, i32::MAX / 1000]);
        let mut i = [i64::MIN, 256_000];
        divide(DType::I64, b(&mut i), 256);
        assert_eq!(i, [i64::MIN / 256, 1000]);
    }
}
