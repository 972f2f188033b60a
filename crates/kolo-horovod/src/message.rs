//! What ranks tell the coordinator (requests) and what it answers
//! (responses), as Horovod's `horovod/common/message.h` defines them, with
//! the names upstream's messages print.

use serde::{Deserialize, Serialize};

/// The device of a tensor in host memory (upstream's `CPU_DEVICE_ID`).
pub const CPU_DEVICE_ID: i32 = -1;

/// A tensor in host memory that the device executor runs rather than the
/// core (kolo's own: CPU tensors through torch's gloo, run in the order
/// the core agrees, as CUDA tensors run through NCCL).
pub const HOST_EXECUTOR_DEVICE_ID: i32 = -2;

/// The name join's table entry takes: a second join while one is pending
/// is a duplicate name.
pub const JOIN_TENSOR_NAME: &str = "join.noname";

/// What a request asks for (upstream's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, strum::IntoStaticStr)]
#[strum(serialize_all = "SCREAMING_SNAKE_CASE")]
pub enum RequestType {
    /// Reduce across the ranks; every rank gets the result.
    Allreduce = 0,
    /// Concatenate every rank's tensor along the first dimension.
    Allgather = 1,
    /// Copy the root's tensor to every rank.
    Broadcast = 2,
    /// This rank has no more data: it stands in for the others' allreduces
    /// with zeros until every rank has joined.
    Join = 3,
    /// An allreduce with upstream's Adasum op.
    Adasum = 4,
    /// Each rank sends rows of its tensor to every rank, as its splits say.
    Alltoall = 5,
    /// Wait until every rank gets here.
    Barrier = 6,
    /// Reduce across the ranks; each rank keeps its part of the result.
    Reducescatter = 7,
    /// kolo's: every rank registers a process set (its ranks in `shape`).
    AddProcessSet = 100,
    /// kolo's: every rank removes a process set (its id in `shape`).
    RemoveProcessSet = 101,
}

impl RequestType {
    /// Upstream's `RequestType_Name`: what its messages print.
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// What a response tells every rank to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResponseType {
    /// Run an allreduce (of one or more fused tensors).
    Allreduce,
    /// Run an allgather (of one or more fused tensors).
    Allgather,
    /// Run a broadcast.
    Broadcast,
    /// Every rank has joined: the join completes.
    Join,
    /// Run an Adasum allreduce (kolo-comm's `adasum`).
    Adasum,
    /// Run an alltoall.
    Alltoall,
    /// Run a barrier.
    Barrier,
    /// Run a reduce-scatter (of one or more fused tensors).
    Reducescatter,
    /// Register a process set (its ranks in `sizes`).
    AddProcessSet,
    /// Remove a process set (its id in `sizes`).
    RemoveProcessSet,
    /// The ranks' requests do not agree: every rank fails the tensors with
    /// `error`.
    Error,
}

impl ResponseType {
    /// The response a request of this type gets when it succeeds.
    pub fn of(request: RequestType) -> ResponseType {
        match request {
            RequestType::Allreduce => ResponseType::Allreduce,
            RequestType::Allgather => ResponseType::Allgather,
            RequestType::Broadcast => ResponseType::Broadcast,
            RequestType::Join => ResponseType::Join,
            RequestType::Adasum => ResponseType::Adasum,
            RequestType::Alltoall => ResponseType::Alltoall,
            RequestType::Barrier => ResponseType::Barrier,
            RequestType::Reducescatter => ResponseType::Reducescatter,
            RequestType::AddProcessSet => ResponseType::AddProcessSet,
            RequestType::RemoveProcessSet => ResponseType::RemoveProcessSet,
        }
    }

    /// Whether responses of this type may be cached (upstream caches these
    /// four only).
    pub fn cacheable(self) -> bool {
        matches!(
            self,
            ResponseType::Allreduce | ResponseType::Allgather | ResponseType::Adasum | ResponseType::Alltoall
        )
    }
}

/// Element types, upstream's numbering and names. The names (numpy's and
/// torch's: `float32`, `bfloat16`...) are the one vocabulary every Python
/// front end passes element types in (`"float32".parse()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, strum::IntoStaticStr, strum::EnumString)]
#[strum(serialize_all = "lowercase")]
pub enum DataType {
    /// Unsigned byte.
    Uint8 = 0,
    /// Signed byte.
    Int8 = 1,
    /// 16-bit unsigned integer (no reductions in kolo).
    Uint16 = 2,
    /// 16-bit signed integer (no reductions in kolo).
    Int16 = 3,
    /// 32-bit signed integer.
    Int32 = 4,
    /// 64-bit signed integer.
    Int64 = 5,
    /// IEEE half float.
    Float16 = 6,
    /// 32-bit IEEE float.
    Float32 = 7,
    /// 64-bit IEEE float.
    Float64 = 8,
    /// One byte per boolean (no reductions in kolo).
    Bool = 9,
    /// bfloat16.
    Bfloat16 = 11,
}

impl DataType {
    /// Upstream's `DataType_Name`.
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// kolo-comm's element type for it: what kolo's collectives reduce
    /// (None: moved as bytes only, never reduced).
    pub fn comm(self) -> Option<kolo_comm::DType> {
        use kolo_comm::DType;
        Some(match self {
            DataType::Uint8 => DType::U8,
            DataType::Int8 => DType::I8,
            DataType::Int32 => DType::I32,
            DataType::Int64 => DType::I64,
            DataType::Float16 => DType::F16,
            DataType::Float32 => DType::F32,
            DataType::Float64 => DType::F64,
            DataType::Bfloat16 => DType::BF16,
            DataType::Uint16 | DataType::Int16 | DataType::Bool => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Uint8 | DataType::Int8 | DataType::Bool => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Float64 => 8,
        }
    }
}

/// Reduction operations, upstream's numbering (messages print the number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum divided by the number of ranks.
    Average = 0,
    /// The sum.
    Sum = 1,
    /// Upstream's Adasum (a request of its own type once submitted).
    Adasum = 2,
    /// The smallest value.
    Min = 3,
    /// The largest value.
    Max = 4,
    /// The product.
    Product = 5,
}

/// One rank's request for one named tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// The rank inside the process set.
    pub rank: u32,
    /// Which collective (or join, barrier, process-set change).
    pub kind: RequestType,
    /// The tensor's element type.
    pub dtype: DataType,
    /// The name every rank submits the tensor under.
    pub name: String,
    /// The tensor's dimensions; for process-set requests, the set's ranks
    /// (add) or id (remove).
    pub shape: Vec<i64>,
    /// `CPU_DEVICE_ID` or a GPU's index.
    pub device: i32,
    /// Broadcast's root, as a rank inside the process set.
    pub root_rank: u32,
    /// Reductions: each rank's input is multiplied by this first.
    pub prescale: f64,
    /// Reductions: the result is multiplied by this at the end.
    pub postscale: f64,
    /// Reductions: how the ranks' values combine.
    pub reduce_op: ReduceOp,
}

impl Request {
    /// A request with upstream's defaults (scale factors 1, Sum).
    pub fn new(rank: u32, kind: RequestType, dtype: DataType, name: impl Into<String>, shape: Vec<i64>) -> Request {
        Request {
            rank,
            kind,
            dtype,
            name: name.into(),
            shape,
            device: CPU_DEVICE_ID,
            root_rank: 0,
            prescale: 1.0,
            postscale: 1.0,
            reduce_op: ReduceOp::Sum,
        }
    }

    /// The tensor's element count: the product of its dimensions (1 for a
    /// scalar).
    pub fn elements(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// What every rank of a set does for one or more tensors (more once fused).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// What to run.
    pub kind: ResponseType,
    /// The tensors it covers, in the order they run (several once fused).
    pub names: Vec<String>,
    /// For `Error`: the message every rank raises.
    pub error: String,
    /// Each set rank's device.
    pub devices: Vec<i32>,
    /// Allreduce, Adasum, Reducescatter: each tensor's element count.
    /// Allgather: each tensor's first dimension on every set rank, tensor
    /// after tensor. Process sets: the set's ranks (add) or id (remove).
    pub sizes: Vec<i64>,
    /// The tensors' element type.
    pub dtype: DataType,
    /// Reductions: each rank's input is multiplied by this first.
    pub prescale: f64,
    /// Reductions: the result is multiplied by this at the end.
    pub postscale: f64,
    /// Allreduce: how the ranks' values combine (Sum for the others).
    pub reduce_op: ReduceOp,
    /// Join: the global rank that joined last.
    pub last_joined_rank: i32,
}

impl Response {
    /// A response of `kind` for one name, with upstream's defaults (no
    /// devices or sizes, Uint8, scale factors 1, Sum, no joined rank).
    pub fn new(kind: ResponseType, name: impl Into<String>) -> Response {
        Response {
            kind,
            names: vec![name.into()],
            error: String::new(),
            devices: Vec::new(),
            sizes: Vec::new(),
            dtype: DataType::Uint8,
            prescale: 1.0,
            postscale: 1.0,
            reduce_op: ReduceOp::Sum,
            last_joined_rank: -1,
        }
    }

    /// An `Error` response: every rank fails `name` with `message`.
    pub fn error(name: impl Into<String>, message: String) -> Response {
        let mut r = Response::new(ResponseType::Error, name);
        r.error = message;
        r
    }

    /// Whether every rank's device is the CPU.
    pub fn on_cpu(&self) -> bool {
        self.devices.iter().all(|&d| d == CPU_DEVICE_ID)
    }
}

/// One rank's requests of a cycle, sent to the coordinator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestList {
    /// The requests this rank took from its queue this cycle, in order.
    pub requests: Vec<Request>,
    /// This rank wants the core to shut down, and why (`hvd.shutdown()`,
    /// its process exiting, a stall past its shutdown time).
    pub shutdown: Option<Stopping>,
}

/// Why a rank stops the job's core (or, in a response list, why the ranks
/// that stop it do).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stopping {
    /// Who and why, as every rank's errors say it.
    pub reason: String,
    /// A rank that stops is exiting: it will not start a core again.
    pub exiting: bool,
}

/// The coordinator's answer to a cycle: every rank runs exactly these, in
/// this order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseList {
    /// What to run, in order.
    pub responses: Vec<Response>,
    /// Some rank wants to shut down (or a stall passed its shutdown time):
    /// every rank stops after this cycle; the text says who and why.
    pub shutdown: Option<Stopping>,
}

/// `[a, b]`: upstream's `TensorShape::DebugString`.
pub fn shape_text(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// A double as C++'s default ostream prints it (`%g` with 6 significant
/// digits): `1`, `0.5`, `1e-05`, `1.5e+10`.
pub fn double_text(x: f64) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() { "-0".into() } else { "0".into() };
    }
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x < 0.0 { "-inf".into() } else { "inf".into() };
    }
    const PRECISION: i32 = 6;
    // the exponent after rounding to 6 significant digits
    let sci = format!("{:.*e}", (PRECISION - 1) as usize, x);
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("an integer exponent");
    if !(-4..PRECISION).contains(&exponent) {
        let mantissa = strip_zeros(mantissa);
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    } else {
        let decimals = (PRECISION - 1 - exponent).max(0) as usize;
        strip_zeros(&format!("{x:.decimals$}")).to_string()
    }
}

fn strip_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_print_as_cpp_streams_print_them() {
        for (x, text) in [
            (1.0, "1"),
            (0.5, "0.5"),
            (2.0, "2"),
            (0.25, "0.25"),
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (123456.0, "123456"),
            (1234567.0, "1.23457e+06"),
            (1.5e10, "1.5e+10"),
            (0.1 + 0.2, "0.3"),
            (-3.0, "-3"),
            (1.0 / 3.0, "0.333333"),
            (0.0, "0"),
        ] {
            assert_eq!(double_text(x), text, "{x}");
        }
    }

    #[test]
    fn names_are_upstreams() {
        use DataType as D;
        use RequestType as R;
        let requests = [
            (R::Allreduce, "ALLREDUCE"),
            (R::Allgather, "ALLGATHER"),
            (R::Broadcast, "BROADCAST"),
            (R::Join, "JOIN"),
            (R::Adasum, "ADASUM"),
            (R::Alltoall, "ALLTOALL"),
            (R::Barrier, "BARRIER"),
            (R::Reducescatter, "REDUCESCATTER"),
            (R::AddProcessSet, "ADD_PROCESS_SET"),
            (R::RemoveProcessSet, "REMOVE_PROCESS_SET"),
        ];
        for (kind, name) in requests {
            assert_eq!(kind.name(), name);
        }
        let dtypes = [
            (D::Uint8, "uint8"),
            (D::Int8, "int8"),
            (D::Uint16, "uint16"),
            (D::Int16, "int16"),
            (D::Int32, "int32"),
            (D::Int64, "int64"),
            (D::Float16, "float16"),
            (D::Float32, "float32"),
            (D::Float64, "float64"),
            (D::Bool, "bool"),
            (D::Bfloat16, "bfloat16"),
        ];
        for (dtype, name) in dtypes {
            assert_eq!(dtype.name(), name);
        }
    }

    #[test]
    fn shapes_print_as_upstreams_debug_string() {
        assert_eq!(shape_text(&[17, 3]), "[17, 3]");
        assert_eq!(shape_text(&[]), "[]");
    }

    #[test]
    fn lists_go_over_the_wire_and_back() {
        let mut r = Request::new(1, RequestType::Allgather, DataType::Float32, "allgather.x", vec![3, 4]);
        r.prescale = 0.5;
        let list =
            RequestList { requests: vec![r], shutdown: Some(Stopping { reason: "asked".into(), exiting: true }) };
        let bytes = postcard::to_stdvec(&list).unwrap();
        assert_eq!(postcard::from_bytes::<RequestList>(&bytes).unwrap(), list);
    }
}
