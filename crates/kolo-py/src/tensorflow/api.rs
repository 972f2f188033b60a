//! TensorFlow's C API for ops and kernels (`tensorflow/c/ops.h`,
//! `kernels.h`, `tf_tensor.h`, `tf_status.h`), looked up at run time in
//! the `libtensorflow_framework.so.2` the process has already loaded: kolo
//! is built without TensorFlow and works with whichever version is
//! installed, as long as it exports these functions.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_void};

macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub(super) struct $name {
            _private: [u8; 0],
        }
    )*};
}

opaque!(
    TF_Status,
    TF_Tensor,
    TF_OpKernelContext,
    TF_OpKernelConstruction,
    TF_KernelBuilder,
    TF_OpDefinitionBuilder,
    TF_ShapeInferenceContext,
    TF_ShapeHandle,
    TF_AsyncOpKernelDoneCallback
);

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct TF_StringView {
    pub(super) data: *const c_char,
    pub(super) len: usize,
}

impl TF_StringView {
    pub(super) fn to_string_lossy(self) -> String {
        if self.data.is_null() {
            return String::new();
        }
        // SAFETY: TensorFlow's view of `len` bytes, valid during the call.
        let bytes = unsafe { std::slice::from_raw_parts(self.data.cast::<u8>(), self.len) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// `TF_Code` values kolo reports with.
pub(super) const TF_OK: c_int = 0;
pub(super) const TF_UNKNOWN: c_int = 2;
pub(super) const TF_INVALID_ARGUMENT: c_int = 3;
pub(super) const TF_FAILED_PRECONDITION: c_int = 9;
pub(super) const TF_ABORTED: c_int = 10;
pub(super) const TF_UNIMPLEMENTED: c_int = 12;

pub(super) type CreateFn = unsafe extern "C" fn(*mut TF_OpKernelConstruction) -> *mut c_void;
pub(super) type ComputeFn = unsafe extern "C" fn(*mut c_void, *mut TF_OpKernelContext);
pub(super) type ComputeAsyncFn =
    unsafe extern "C" fn(*mut c_void, *mut TF_OpKernelContext, *mut TF_AsyncOpKernelDoneCallback);
pub(super) type DeleteFn = unsafe extern "C" fn(*mut c_void);
pub(super) type ShapeFn = unsafe extern "C" fn(*mut TF_ShapeInferenceContext, *mut TF_Status);

macro_rules! tf_api {
    ($($name:ident : fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The functions, resolved once.
        pub(super) struct Api {
            _library: libloading::os::unix::Library,
            $(pub(super) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Api {
            /// Resolves every function in `library` (already loaded by
            /// TensorFlow); names the first one missing.
            pub(super) fn load(path: &str) -> Result<Api, String> {
                use libloading::os::unix::{Library, RTLD_NOW};
                // RTLD_NOLOAD: the copy TensorFlow loaded, never a second one
                const RTLD_NOLOAD: c_int = 4;
                // SAFETY: the library is already loaded (NOLOAD): no initializers run.
                let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_NOLOAD) }
                    .map_err(|e| format!("TensorFlow's {path} is not loaded in this process ({e}): import tensorflow first"))?;
                $(
                    // SAFETY: the signature is the C header's.
                    let $name = unsafe {
                        *library
                            .get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|_| format!(
                                "this TensorFlow's {path} has no {} (kolo's Horovod ops need TensorFlow's C kernel API, as in TensorFlow 2.21)",
                                stringify!($name)
                            ))?
                    };
                )*
                Ok(Api { _library: library, $($name,)* })
            }
        }
    };
}

tf_api! {
    TF_NewStatus: fn() -> *mut TF_Status;
    TF_DeleteStatus: fn(*mut TF_Status);
    TF_GetCode: fn(*const TF_Status) -> c_int;
    TF_Message: fn(*const TF_Status) -> *const c_char;
    TF_SetStatus: fn(*mut TF_Status, c_int, *const c_char);

    TF_NewOpDefinitionBuilder: fn(*const c_char) -> *mut TF_OpDefinitionBuilder;
    TF_OpDefinitionBuilderAddInput: fn(*mut TF_OpDefinitionBuilder, *const c_char);
    TF_OpDefinitionBuilderAddOutput: fn(*mut TF_OpDefinitionBuilder, *const c_char);
    TF_OpDefinitionBuilderAddAttr: fn(*mut TF_OpDefinitionBuilder, *const c_char);
    TF_OpDefinitionBuilderSetIsStateful: fn(*mut TF_OpDefinitionBuilder, bool);
    TF_OpDefinitionBuilderSetShapeInferenceFunction: fn(*mut TF_OpDefinitionBuilder, ShapeFn);
    TF_RegisterOpDefinition: fn(*mut TF_OpDefinitionBuilder, *mut TF_Status);

    TF_NewShapeHandle: fn() -> *mut TF_ShapeHandle;
    TF_DeleteShapeHandle: fn(*mut TF_ShapeHandle);
    TF_ShapeInferenceContextNumInputs: fn(*mut TF_ShapeInferenceContext) -> i64;
    TF_ShapeInferenceContextGetInput: fn(*mut TF_ShapeInferenceContext, c_int, *mut TF_ShapeHandle, *mut TF_Status);
    TF_ShapeInferenceContextSetOutput: fn(*mut TF_ShapeInferenceContext, c_int, *mut TF_ShapeHandle, *mut TF_Status);
    TF_ShapeInferenceContextScalar: fn(*mut TF_ShapeInferenceContext) -> *mut TF_ShapeHandle;
    TF_ShapeInferenceContextSetUnknownShape: fn(*mut TF_ShapeInferenceContext, *mut TF_Status);

    TF_NewKernelBuilder: fn(*const c_char, *const c_char, CreateFn, ComputeFn, DeleteFn) -> *mut TF_KernelBuilder;
    TF_NewAsyncKernelBuilder: fn(*const c_char, *const c_char, CreateFn, ComputeAsyncFn, DeleteFn) -> *mut TF_KernelBuilder;
    TF_RegisterKernelBuilder: fn(*const c_char, *mut TF_KernelBuilder, *mut TF_Status);

    TF_OpKernelConstruction_GetName: fn(*mut TF_OpKernelConstruction) -> TF_StringView;
    TF_OpKernelConstruction_GetAttrInt64: fn(*mut TF_OpKernelConstruction, *const c_char, *mut i64, *mut TF_Status);
    TF_OpKernelConstruction_GetAttrFloat: fn(*mut TF_OpKernelConstruction, *const c_char, *mut f32, *mut TF_Status);
    TF_OpKernelConstruction_GetAttrBool: fn(*mut TF_OpKernelConstruction, *const c_char, *mut u8, *mut TF_Status);
    TF_OpKernelConstruction_Failure: fn(*mut TF_OpKernelConstruction, *mut TF_Status);

    TF_NumInputs: fn(*mut TF_OpKernelContext) -> c_int;
    TF_GetInput: fn(*mut TF_OpKernelContext, c_int, *mut *mut TF_Tensor, *mut TF_Status);
    TF_AllocateOutput: fn(*mut TF_OpKernelContext, c_int, c_int, *const i64, c_int, usize, *mut TF_Status) -> *mut TF_Tensor;
    TF_OpKernelContext_Failure: fn(*mut TF_OpKernelContext, *mut TF_Status);

    TF_TensorType: fn(*const TF_Tensor) -> c_int;
    TF_NumDims: fn(*const TF_Tensor) -> c_int;
    TF_Dim: fn(*const TF_Tensor, c_int) -> i64;
    TF_TensorByteSize: fn(*const TF_Tensor) -> usize;
    TF_TensorData: fn(*const TF_Tensor) -> *mut c_void;
    TF_DeleteTensor: fn(*mut TF_Tensor);
}

unsafe extern "C" {
    /// done.cc: TensorFlow's done callback, moved to the heap.
    pub(super) fn kolo_tf_take_done(done: *mut TF_AsyncOpKernelDoneCallback) -> *mut c_void;
    /// done.cc: runs a taken callback once and frees it.
    pub(super) fn kolo_tf_run_done(taken: *mut c_void);
}
