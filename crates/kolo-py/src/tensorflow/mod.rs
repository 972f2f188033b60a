//! `kolo.horovod.tensorflow`'s TensorFlow ops: real TF ops and async CPU
//! kernels, registered through TensorFlow's C API at run time (see
//! `api.rs`), whose kernels submit their tensors to the process's Horovod
//! core by name and complete when the core has run the agreed collective.
//! They run eagerly and inside `tf.function`, read and write TensorFlow's
//! own buffers (no copy but where the result's size is only known at the
//! end: allgather, alltoall) and fail with TensorFlow's error classes.
//!
//! Every op is stateful: inside a `tf.function` they keep their program
//! order (the same on every rank), are never pruned or constant-folded,
//! and two alike are never merged. Python (`kolo/horovod/tensorflow`)
//! names them, registers their gradients and sets static shapes.

mod api;

use std::ffi::{c_int, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use kolo_horovod::{Buffer, Core, DataType, FailureKind, Handle, Outcome, ReduceOp, RequestType, Submit};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use api::*;

static API: OnceLock<Api> = OnceLock::new();
static REGISTERED: OnceLock<Result<Vec<String>, String>> = OnceLock::new();

fn api() -> &'static Api {
    API.get().expect("kernels run only after registration")
}

/// The core the kernels submit to, and what the topology ops report.
struct Served {
    core: Arc<Core>,
    local_rank: i32,
    local_size: i32,
}

static SERVED: Mutex<Option<Served>> = Mutex::new(None);

pub(crate) fn serve(core: Option<Arc<Core>>, local_rank: i32, local_size: i32) {
    *SERVED.lock().unwrap_or_else(|p| p.into_inner()) = core.map(|core| Served { core, local_rank, local_size });
}

/// TensorFlow's ops fail as uninitialized once `core` stops.
pub(crate) fn stop_serving(core: &Arc<Core>) {
    let mut served = SERVED.lock().unwrap_or_else(|p| p.into_inner());
    if served.as_ref().is_some_and(|s| Arc::ptr_eq(&s.core, core)) {
        *served = None;
    }
}

fn served_core() -> Option<Arc<Core>> {
    SERVED.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|s| s.core.clone())
}

const NOT_INITIALIZED: &str = "Horovod has not been initialized; use hvd.init().";

// ---- registration ----------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Kind {
    Allreduce = 0,
    Allgather = 1,
    Broadcast = 2,
    Alltoall = 3,
    Reducescatter = 4,
    Join = 5,
}

impl Kind {
    fn from_u8(k: u8) -> Kind {
        match k {
            0 => Kind::Allreduce,
            1 => Kind::Allgather,
            2 => Kind::Broadcast,
            3 => Kind::Alltoall,
            4 => Kind::Reducescatter,
            _ => Kind::Join,
        }
    }

    fn request(self) -> RequestType {
        match self {
            Kind::Allreduce => RequestType::Allreduce,
            Kind::Allgather => RequestType::Allgather,
            Kind::Broadcast => RequestType::Broadcast,
            Kind::Alltoall => RequestType::Alltoall,
            Kind::Reducescatter => RequestType::Reducescatter,
            Kind::Join => RequestType::Join,
        }
    }

    /// The prefix of its tensors' names, as kolo's horovod.torch names them.
    fn wire(self) -> &'static str {
        match self {
            Kind::Allreduce => "allreduce",
            Kind::Allgather => "allgather",
            Kind::Broadcast => "broadcast",
            Kind::Alltoall => "alltoall",
            Kind::Reducescatter => "reducescatter",
            Kind::Join => "join",
        }
    }
}

const REDUCIBLE: &str = "{uint8, int8, int32, int64, half, float, double, bfloat16}";
const MOVABLE: &str = "{uint8, int8, uint16, int16, int32, int64, half, float, double, bool, bfloat16}";
const SCATTERABLE: &str = "{int32, int64, half, float, double, bfloat16}";

/// How an op's output shapes follow from its inputs' (the rest Python sets).
#[derive(Clone, Copy)]
enum Shapes {
    /// Output i has input i's shape.
    AsInputs,
    /// Known only at run time.
    Unknown,
    /// One scalar.
    Scalar,
}

struct OpSpec {
    name: &'static str,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    attrs: Vec<String>,
    shapes: Shapes,
    kernel: KernelFns,
}

#[derive(Clone, Copy)]
enum KernelFns {
    Async(CreateFn),
    Sync(CreateFn, ComputeFn),
}

fn specs() -> Vec<OpSpec> {
    // every collective's: its process set and how its name is taken
    let with = |types: &str, more: &[&str]| {
        let mut attrs = vec![types.to_string()];
        attrs.extend(more.iter().map(|a| a.to_string()));
        attrs.extend(["process_set_id: int = 0".into(), "ignore_name_scope: bool = false".into()]);
        attrs
    };
    let reduce = ["reduce_op: int", "prescale_factor: float", "postscale_factor: float"];
    // a group's tensors may differ in type: a list of types, one per tensor
    let list = |types: &str| format!("T: list({types}) >= 1");
    let one = |types: &str| format!("T: {types}");
    vec![
        OpSpec {
            name: "KoloHorovodAllreduce",
            inputs: &["tensors: T"],
            outputs: &["outputs: T"],
            attrs: with(&list(REDUCIBLE), &reduce),
            shapes: Shapes::AsInputs,
            kernel: KernelFns::Async(create::<0>),
        },
        OpSpec {
            name: "KoloHorovodAllgather",
            inputs: &["tensors: T"],
            outputs: &["outputs: T"],
            attrs: with(&list(MOVABLE), &[]),
            shapes: Shapes::Unknown,
            kernel: KernelFns::Async(create::<1>),
        },
        OpSpec {
            name: "KoloHorovodBroadcast",
            inputs: &["tensor: T"],
            outputs: &["output: T"],
            attrs: with(&one(MOVABLE), &["root_rank: int"]),
            shapes: Shapes::AsInputs,
            kernel: KernelFns::Async(create::<2>),
        },
        OpSpec {
            name: "KoloHorovodAlltoall",
            inputs: &["tensor: T", "splits: int32"],
            outputs: &["output: T", "received_splits: int32"],
            attrs: with(&one(MOVABLE), &[]),
            shapes: Shapes::Unknown,
            kernel: KernelFns::Async(create::<3>),
        },
        OpSpec {
            name: "KoloHorovodReducescatter",
            inputs: &["tensors: T"],
            outputs: &["outputs: T"],
            attrs: with(&list(SCATTERABLE), &reduce),
            shapes: Shapes::Unknown,
            kernel: KernelFns::Async(create::<4>),
        },
        OpSpec {
            name: "KoloHorovodJoin",
            inputs: &[],
            outputs: &["last_joined_rank: int32"],
            attrs: Vec::new(),
            shapes: Shapes::Scalar,
            kernel: KernelFns::Async(create::<5>),
        },
        OpSpec {
            name: "KoloHorovodTopology",
            inputs: &[],
            outputs: &["value: int32"],
            attrs: vec!["what: int".into(), "process_set_id: int = 0".into()],
            shapes: Shapes::Scalar,
            kernel: KernelFns::Sync(create_topology, compute_topology),
        },
    ]
}

/// A TF_Status, freed on drop.
struct Status(*mut TF_Status);

impl Status {
    fn new() -> Status {
        // SAFETY: plain constructor.
        Status(unsafe { (api().TF_NewStatus)() })
    }

    fn set(code: c_int, message: &str) -> Status {
        let status = Status::new();
        let text = CString::new(message.replace('\0', " ")).expect("no NUL");
        // SAFETY: a live status; TF copies the message.
        unsafe { (api().TF_SetStatus)(status.0, code, text.as_ptr()) };
        status
    }

    fn error(&self) -> Option<String> {
        // SAFETY: a live status.
        unsafe {
            if (api().TF_GetCode)(self.0) == TF_OK {
                return None;
            }
            let m = (api().TF_Message)(self.0);
            Some(if m.is_null() {
                "unknown".into()
            } else {
                std::ffi::CStr::from_ptr(m).to_string_lossy().into_owned()
            })
        }
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        // SAFETY: ours.
        unsafe { (api().TF_DeleteStatus)(self.0) };
    }
}

unsafe extern "C" fn shapes_as_inputs(ctx: *mut TF_ShapeInferenceContext, status: *mut TF_Status) {
    let a = api();
    // SAFETY: TF's context and status, valid during the call.
    unsafe {
        let n = (a.TF_ShapeInferenceContextNumInputs)(ctx);
        let handle = (a.TF_NewShapeHandle)();
        for i in 0..n as c_int {
            (a.TF_ShapeInferenceContextGetInput)(ctx, i, handle, status);
            if (a.TF_GetCode)(status) != TF_OK {
                break;
            }
            (a.TF_ShapeInferenceContextSetOutput)(ctx, i, handle, status);
        }
        (a.TF_DeleteShapeHandle)(handle);
    }
}

unsafe extern "C" fn shapes_unknown(ctx: *mut TF_ShapeInferenceContext, status: *mut TF_Status) {
    // SAFETY: as above.
    unsafe { (api().TF_ShapeInferenceContextSetUnknownShape)(ctx, status) };
}

unsafe extern "C" fn shapes_scalar(ctx: *mut TF_ShapeInferenceContext, status: *mut TF_Status) {
    // SAFETY: as above.
    unsafe {
        let scalar = (api().TF_ShapeInferenceContextScalar)(ctx);
        (api().TF_ShapeInferenceContextSetOutput)(ctx, 0, scalar, status);
        (api().TF_DeleteShapeHandle)(scalar);
    }
}

fn register(api: &Api) -> Result<Vec<String>, String> {
    let cstr = |s: &str| CString::new(s).expect("no NUL");
    let mut names = Vec::new();
    for spec in specs() {
        let name = cstr(spec.name);
        // SAFETY: the builder is consumed by TF_RegisterOpDefinition; the
        // strings are copied by TensorFlow.
        unsafe {
            let b = (api.TF_NewOpDefinitionBuilder)(name.as_ptr());
            for i in spec.inputs {
                (api.TF_OpDefinitionBuilderAddInput)(b, cstr(i).as_ptr());
            }
            for o in spec.outputs {
                (api.TF_OpDefinitionBuilderAddOutput)(b, cstr(o).as_ptr());
            }
            for a in &spec.attrs {
                (api.TF_OpDefinitionBuilderAddAttr)(b, cstr(a).as_ptr());
            }
            (api.TF_OpDefinitionBuilderSetIsStateful)(b, true);
            let shape_fn: ShapeFn = match spec.shapes {
                Shapes::AsInputs => shapes_as_inputs,
                Shapes::Unknown => shapes_unknown,
                Shapes::Scalar => shapes_scalar,
            };
            (api.TF_OpDefinitionBuilderSetShapeInferenceFunction)(b, shape_fn);
            let status = Status::new();
            (api.TF_RegisterOpDefinition)(b, status.0);
            if let Some(e) = status.error() {
                return Err(format!("cannot register TensorFlow op {}: {e}", spec.name));
            }
            let cpu = cstr("CPU");
            let builder = match spec.kernel {
                KernelFns::Async(create) => {
                    (api.TF_NewAsyncKernelBuilder)(name.as_ptr(), cpu.as_ptr(), create, compute_async, delete_kernel)
                }
                KernelFns::Sync(create, compute) => {
                    (api.TF_NewKernelBuilder)(name.as_ptr(), cpu.as_ptr(), create, compute, delete_kernel)
                }
            };
            (api.TF_RegisterKernelBuilder)(name.as_ptr(), builder, status.0);
            if let Some(e) = status.error() {
                return Err(format!("cannot register the CPU kernel of TensorFlow op {}: {e}", spec.name));
            }
        }
        names.push(spec.name.to_string());
    }
    Ok(names)
}

/// Registers kolo's Horovod ops with the TensorFlow loaded in this process
/// (`framework_library`: the path of its `libtensorflow_framework.so.2`);
/// their names. Once per process: later calls give the first answer.
#[pyfunction]
fn tensorflow_register_ops(framework_library: &str) -> PyResult<Vec<String>> {
    let registered = REGISTERED.get_or_init(|| {
        let api = match Api::load(framework_library) {
            Ok(api) => API.get_or_init(|| api),
            Err(e) => return Err(e),
        };
        register(api)
    });
    registered.clone().map_err(PyRuntimeError::new_err)
}

// ---- kernels ---------------------------------------------------------------

/// What a kernel knows from its node: its attributes and name.
struct Kernel {
    kind: Kind,
    /// The node's name: the collective's name on every rank.
    name: String,
    set: u32,
    reduce_op: i64,
    prescale: f64,
    postscale: f64,
    root_rank: i64,
}

/// Reads an attribute, or fails the construction (None).
unsafe fn attr<T: Default>(
    ctx: *mut TF_OpKernelConstruction,
    name: &str,
    get: unsafe extern "C" fn(*mut TF_OpKernelConstruction, *const std::ffi::c_char, *mut T, *mut TF_Status),
) -> Option<T> {
    let status = Status::new();
    let mut value = T::default();
    let cname = CString::new(name).expect("no NUL");
    // SAFETY: TF's construction context; `value` outlives the call.
    unsafe {
        get(ctx, cname.as_ptr(), &mut value, status.0);
        if status.error().is_some() {
            (api().TF_OpKernelConstruction_Failure)(ctx, status.0);
            return None;
        }
    }
    Some(value)
}

unsafe extern "C" fn create<const KIND: u8>(ctx: *mut TF_OpKernelConstruction) -> *mut c_void {
    let a = api();
    let kind = Kind::from_u8(KIND);
    // SAFETY: TF's construction context, valid during the call.
    unsafe {
        let mut name = (a.TF_OpKernelConstruction_GetName)(ctx).to_string_lossy();
        let mut kernel =
            Kernel { kind, name: String::new(), set: 0, reduce_op: 1, prescale: 1.0, postscale: 1.0, root_rank: 0 };
        if kind != Kind::Join {
            let Some(set) = attr(ctx, "process_set_id", a.TF_OpKernelConstruction_GetAttrInt64) else {
                return std::ptr::null_mut();
            };
            kernel.set = set.clamp(0, i64::from(u32::MAX)) as u32;
            let Some(ignore_scope) = attr(ctx, "ignore_name_scope", a.TF_OpKernelConstruction_GetAttrBool) else {
                return std::ptr::null_mut();
            };
            if ignore_scope != 0 {
                name = name.rsplit('/').next().unwrap_or(&name).to_string();
            }
        }
        if matches!(kind, Kind::Allreduce | Kind::Reducescatter) {
            let (Some(op), Some(pre), Some(post)) = (
                attr(ctx, "reduce_op", a.TF_OpKernelConstruction_GetAttrInt64),
                attr(ctx, "prescale_factor", a.TF_OpKernelConstruction_GetAttrFloat),
                attr(ctx, "postscale_factor", a.TF_OpKernelConstruction_GetAttrFloat),
            ) else {
                return std::ptr::null_mut();
            };
            kernel.reduce_op = op;
            kernel.prescale = f64::from(pre);
            kernel.postscale = f64::from(post);
        }
        if kind == Kind::Broadcast {
            let Some(root) = attr(ctx, "root_rank", a.TF_OpKernelConstruction_GetAttrInt64) else {
                return std::ptr::null_mut();
            };
            kernel.root_rank = root;
        }
        kernel.name = format!("{}.{name}", kind.wire());
        Box::into_raw(Box::new(KernelState::Collective(kernel))).cast()
    }
}

unsafe extern "C" fn delete_kernel(state: *mut c_void) {
    if !state.is_null() {
        // SAFETY: a Box<KernelState> made by a create function.
        unsafe { drop(Box::from_raw(state.cast::<KernelState>())) };
    }
}

/// Every kernel's state, for the one delete function.
enum KernelState {
    Collective(Kernel),
    Topology { what: i64, set: u32 },
}

fn data_type(tf: c_int) -> Option<DataType> {
    Some(match tf {
        1 => DataType::Float32,
        2 => DataType::Float64,
        3 => DataType::Int32,
        4 => DataType::Uint8,
        5 => DataType::Int16,
        6 => DataType::Int8,
        9 => DataType::Int64,
        10 => DataType::Bool,
        14 => DataType::Bfloat16,
        17 => DataType::Uint16,
        19 => DataType::Float16,
        _ => return None,
    })
}

fn reduce_op(code: i64) -> Result<ReduceOp, String> {
    Ok(match code {
        0 => ReduceOp::Average,
        1 => ReduceOp::Sum,
        2 => ReduceOp::Adasum,
        3 => ReduceOp::Min,
        4 => ReduceOp::Max,
        5 => ReduceOp::Product,
        other => return Err(format!("unknown reduction op {other}")),
    })
}

/// One kernel call in flight: TensorFlow's context, its done callback and
/// the tensor handles kolo holds; `done` runs exactly once, on `finish` or
/// on drop.
struct Call {
    ctx: *mut TF_OpKernelContext,
    done: *mut c_void,
    held: Vec<*mut TF_Tensor>,
}

// SAFETY: TensorFlow's context stays valid until `done` runs, from any
// thread (Horovod's own kernels complete on its background thread).
unsafe impl Send for Call {}

impl Call {
    fn fail(self, code: c_int, message: &str) {
        let status = Status::set(code, message);
        // SAFETY: the context is live until done runs (in drop).
        unsafe { (api().TF_OpKernelContext_Failure)(self.ctx, status.0) };
    }

    /// An output of `dims` (bytes `len`), held until done; its buffer.
    fn allocate(&mut self, index: usize, dtype: c_int, dims: &[i64], len: usize) -> Result<Buffer, String> {
        let status = Status::new();
        // SAFETY: a live context; dims outlive the call.
        let tensor = unsafe {
            (api().TF_AllocateOutput)(
                self.ctx,
                index as c_int,
                dtype,
                dims.as_ptr(),
                dims.len() as c_int,
                len,
                status.0,
            )
        };
        if let Some(e) = status.error() {
            return Err(format!("cannot allocate output {index}: {e}"));
        }
        self.held.push(tensor);
        // SAFETY: the tensor just allocated.
        let data = unsafe { (api().TF_TensorData)(tensor) };
        Ok(Buffer::new(data as usize, len))
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // SAFETY: the handles are ours to release; done was taken by
        // kolo_tf_take_done and runs once, here.
        unsafe {
            for t in self.held.drain(..) {
                (api().TF_DeleteTensor)(t);
            }
            kolo_tf_run_done(self.done);
        }
    }
}

/// An input's type, shape and memory.
struct Input {
    tf_type: c_int,
    dims: Vec<i64>,
    buffer: Buffer,
}

impl Call {
    fn input(&mut self, index: usize) -> Result<Input, String> {
        let a = api();
        let status = Status::new();
        let mut tensor = std::ptr::null_mut();
        // SAFETY: a live context; the handle is released on drop.
        unsafe {
            (a.TF_GetInput)(self.ctx, index as c_int, &mut tensor, status.0);
            if let Some(e) = status.error() {
                return Err(format!("cannot read input {index}: {e}"));
            }
            self.held.push(tensor);
            let dims = (0..(a.TF_NumDims)(tensor)).map(|d| (a.TF_Dim)(tensor, d)).collect();
            let len = (a.TF_TensorByteSize)(tensor);
            let data = (a.TF_TensorData)(tensor);
            Ok(Input { tf_type: (a.TF_TensorType)(tensor), dims, buffer: Buffer::new(data as usize, len) })
        }
    }
}

unsafe extern "C" fn compute_async(
    state: *mut c_void,
    ctx: *mut TF_OpKernelContext,
    done: *mut TF_AsyncOpKernelDoneCallback,
) {
    // SAFETY: TF's done callback, moved to the heap before this returns.
    let call = Call { ctx, done: unsafe { kolo_tf_take_done(done) }, held: Vec::new() };
    // SAFETY: made by a create function; lives as long as the kernel.
    let KernelState::Collective(kernel) = (unsafe { &*state.cast::<KernelState>() }) else {
        return call.fail(TF_UNKNOWN, "a kolo Horovod kernel with another kernel's state");
    };
    start(kernel, call);
}

fn start(kernel: &Kernel, mut call: Call) {
    let Some(core) = served_core() else {
        return call.fail(TF_FAILED_PRECONDITION, NOT_INITIALIZED);
    };
    // SAFETY: a live context.
    let inputs = unsafe { (api().TF_NumInputs)(call.ctx) } as usize;
    let tensors = if kernel.kind == Kind::Alltoall { 1 } else { inputs };
    let mut submits = Vec::with_capacity(tensors);
    let mut types = Vec::with_capacity(tensors);
    let op = match kernel.kind {
        Kind::Allreduce | Kind::Reducescatter => match reduce_op(kernel.reduce_op) {
            Ok(op) => op,
            Err(e) => return call.fail(TF_UNIMPLEMENTED, &e),
        },
        _ => ReduceOp::Sum,
    };
    if kernel.kind == Kind::Join {
        let mut s = Submit::new(RequestType::Join, "join", DataType::Uint8, vec![0], Buffer::new(0, 0));
        s.reduce_op = op;
        submits.push(s);
    }
    for i in 0..if kernel.kind == Kind::Join { 0 } else { tensors } {
        let input = match call.input(i) {
            Ok(input) => input,
            Err(e) => return call.fail(TF_UNKNOWN, &e),
        };
        let Some(dtype) = data_type(input.tf_type) else {
            return call.fail(TF_INVALID_ARGUMENT, &format!("Tensor type {} is not supported.", input.tf_type));
        };
        let name = if tensors > 1 { format!("{}_{}of{tensors}", kernel.name, i + 1) } else { kernel.name.clone() };
        let mut s = Submit::new(kernel.kind.request(), name, dtype, input.dims.clone(), input.buffer);
        s.reduce_op = op;
        s.prescale = kernel.prescale;
        s.postscale = kernel.postscale;
        s.root_rank = kernel.root_rank;
        let output = match kernel.kind {
            Kind::Allreduce | Kind::Broadcast => {
                call.allocate(i, input.tf_type, &input.dims, input.buffer.len).map(Some)
            }
            Kind::Reducescatter => scattered_rows(&core, kernel.set, &input.dims).and_then(|rows| {
                let mut dims = input.dims.clone();
                dims[0] = rows;
                let row_bytes = if input.dims[0] == 0 { 0 } else { input.buffer.len / input.dims[0] as usize };
                call.allocate(i, input.tf_type, &dims, rows as usize * row_bytes).map(Some)
            }),
            _ => Ok(None),
        };
        match output {
            Ok(output) => s.output = output,
            Err(e) => return call.fail(TF_INVALID_ARGUMENT, &e),
        }
        if kernel.kind == Kind::Alltoall {
            match call.input(1).and_then(|splits| splits_of(&splits)) {
                Ok(splits) => s.splits = splits,
                Err(e) => return call.fail(TF_INVALID_ARGUMENT, &e),
            }
        }
        types.push((input.tf_type, input.dims));
        submits.push(s);
    }
    let handle = match core.submit(kernel.set, submits) {
        Ok(handle) => handle,
        Err(refused) => {
            let code = if refused.kind == FailureKind::Invalid { TF_INVALID_ARGUMENT } else { TF_FAILED_PRECONDITION };
            return call.fail(code, &refused.message);
        }
    };
    let kind = kernel.kind;
    let finished = handle.clone();
    handle.on_done(Box::new(move || complete(kind, call, &finished, &types)));
}

/// This rank's rows of a reducescatter: the first dim0 % size ranks of the
/// set get one more.
fn scattered_rows(core: &Core, set: u32, dims: &[i64]) -> Result<i64, String> {
    let Some(&rows) = dims.first() else {
        return Err("Reducescatter does not support scalar inputs".into());
    };
    let ranks = core.process_set_ranks(set).ok_or_else(|| format!("Invalid process set id: {set}"))?;
    let me = ranks
        .iter()
        .position(|&r| r == core.rank())
        .ok_or_else(|| format!("Reducescatter: Rank {} is not a member of the provided process set.", core.rank()))?;
    let n = ranks.len() as i64;
    Ok(rows / n + i64::from((me as i64) < rows % n))
}

fn splits_of(splits: &Input) -> Result<Vec<i64>, String> {
    if splits.tf_type != 3 || splits.dims.len() != 1 {
        return Err("alltoall expects splits to be a 1-D tensor of 32-bit integers".into());
    }
    // SAFETY: TensorFlow's int32 buffer of `len` bytes, held by the call.
    let bytes = unsafe { std::slice::from_raw_parts(splits.buffer.addr as *const u8, splits.buffer.len) };
    Ok(bytes.chunks_exact(4).map(|c| i64::from(i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))).collect())
}

/// The collective is done: outputs whose size was unknown are made and
/// filled, a failure is reported with TensorFlow's class, then done runs.
fn complete(kind: Kind, mut call: Call, handle: &Handle, types: &[(c_int, Vec<i64>)]) {
    let outcomes: Vec<Outcome> = handle.outcomes().unwrap_or_default();
    let mut filled = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        match outcome {
            Ok(out) => filled.push(out),
            Err(f) => {
                let code = match (f.kind, f.membership) {
                    (FailureKind::Invalid, _) => TF_INVALID_ARGUMENT,
                    (FailureKind::Internal, true) => TF_ABORTED,
                    (FailureKind::Internal, false) => TF_FAILED_PRECONDITION,
                };
                return call.fail(code, &f.message);
            }
        }
    }
    let result = match kind {
        Kind::Allgather => filled.iter().zip(types).enumerate().try_for_each(|(i, (out, (tf_type, dims)))| {
            let mut shape = dims.clone();
            if shape.is_empty() {
                shape.push(1);
            }
            shape[0] = out.dims.first().copied().unwrap_or(0);
            fill(&mut call, i, *tf_type, &shape, out.data.as_deref().unwrap_or_default())
        }),
        Kind::Alltoall => filled.first().zip(types.first()).map_or(Ok(()), |(out, (tf_type, dims))| {
            let mut shape = dims.clone();
            shape[0] = out.dims.iter().sum();
            fill(&mut call, 0, *tf_type, &shape, out.data.as_deref().unwrap_or_default())?;
            let received: Vec<u8> = out.dims.iter().flat_map(|&d| (d as i32).to_ne_bytes()).collect();
            fill(&mut call, 1, 3, &[out.dims.len() as i64], &received)
        }),
        Kind::Join => {
            let last = filled.first().map_or(-1, |o| o.last_joined_rank);
            fill(&mut call, 0, 3, &[], &last.to_ne_bytes())
        }
        _ => Ok(()),
    };
    if let Err(e) = result {
        call.fail(TF_UNKNOWN, &e);
    }
}

fn fill(call: &mut Call, index: usize, tf_type: c_int, dims: &[i64], data: &[u8]) -> Result<(), String> {
    let buffer = call.allocate(index, tf_type, dims, data.len())?;
    if !data.is_empty() {
        // SAFETY: TensorFlow's fresh output of exactly data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buffer.addr as *mut u8, data.len()) };
    }
    Ok(())
}

// ---- topology (size_op, rank_op...) ----------------------------------------

unsafe extern "C" fn create_topology(ctx: *mut TF_OpKernelConstruction) -> *mut c_void {
    let a = api();
    // SAFETY: TF's construction context.
    unsafe {
        let (Some(what), Some(set)) = (
            attr(ctx, "what", a.TF_OpKernelConstruction_GetAttrInt64),
            attr(ctx, "process_set_id", a.TF_OpKernelConstruction_GetAttrInt64),
        ) else {
            return std::ptr::null_mut();
        };
        let set = set.clamp(0, i64::from(u32::MAX)) as u32;
        Box::into_raw(Box::new(KernelState::Topology { what, set })).cast()
    }
}

/// `what`: 0 the set's size, 1 this rank, 2 the local size, 3 the local
/// rank, 4 whether this rank is in the set.
unsafe extern "C" fn compute_topology(state: *mut c_void, ctx: *mut TF_OpKernelContext) {
    // SAFETY: made by create_topology.
    let KernelState::Topology { what, set } = (unsafe { &*state.cast::<KernelState>() }) else {
        return;
    };
    let value = {
        let served = SERVED.lock().unwrap_or_else(|p| p.into_inner());
        served.as_ref().ok_or(NOT_INITIALIZED.to_string()).and_then(|s| {
            let ranks = || s.core.process_set_ranks(*set).ok_or(format!("Invalid process set id: {set}"));
            Ok(match what {
                0 => ranks()?.len() as i32,
                1 => s.core.rank() as i32,
                2 => s.local_size,
                3 => s.local_rank,
                _ => i32::from(ranks()?.contains(&s.core.rank())),
            })
        })
    };
    let a = api();
    let status = Status::new();
    // SAFETY: a live context; the output handle is released at once.
    unsafe {
        match value {
            Ok(v) => {
                let t = (a.TF_AllocateOutput)(ctx, 0, 3, std::ptr::null(), 0, 4, status.0);
                if status.error().is_none() {
                    *(a.TF_TensorData)(t).cast::<i32>() = v;
                    (a.TF_DeleteTensor)(t);
                } else {
                    (a.TF_OpKernelContext_Failure)(ctx, status.0);
                }
            }
            Err(e) => (a.TF_OpKernelContext_Failure)(ctx, Status::set(TF_FAILED_PRECONDITION, &e).0),
        }
    }
}

pub(crate) fn register_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tensorflow_register_ops, m)?)?;
    Ok(())
}
