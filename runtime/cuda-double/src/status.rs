//! The `CUresult` codes the double returns, with the driver's names and messages (printed by
//! cudarc through `cuGetErrorName` / `cuGetErrorString`).

use std::ffi::CStr;

pub type CuResult = u32;

pub const SUCCESS: CuResult = 0;
pub const INVALID_VALUE: CuResult = 1;
pub const OUT_OF_MEMORY: CuResult = 2;
pub const NOT_INITIALIZED: CuResult = 3;
pub const NO_DEVICE: CuResult = 100;
pub const INVALID_DEVICE: CuResult = 101;
pub const INVALID_IMAGE: CuResult = 200;
pub const INVALID_CONTEXT: CuResult = 201;
pub const NO_BINARY_FOR_GPU: CuResult = 209;
pub const PEER_ACCESS_UNSUPPORTED: CuResult = 217;
pub const INVALID_PTX: CuResult = 218;
pub const UNSUPPORTED_PTX_VERSION: CuResult = 222;
pub const FILE_NOT_FOUND: CuResult = 301;
pub const INVALID_HANDLE: CuResult = 400;
pub const ILLEGAL_STATE: CuResult = 401;
pub const NOT_FOUND: CuResult = 500;
pub const NOT_READY: CuResult = 600;
pub const ILLEGAL_ADDRESS: CuResult = 700;
pub const LAUNCH_OUT_OF_RESOURCES: CuResult = 701;
pub const PEER_ACCESS_ALREADY_ENABLED: CuResult = 704;
pub const MISALIGNED_ADDRESS: CuResult = 716;
pub const LAUNCH_FAILED: CuResult = 719;
pub const NOT_SUPPORTED: CuResult = 801;
pub const STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;
pub const STREAM_CAPTURE_INVALIDATED: CuResult = 901;
pub const STREAM_CAPTURE_ISOLATION: CuResult = 905;
pub const STREAM_CAPTURE_IMPLICIT: CuResult = 906;
pub const CAPTURED_EVENT: CuResult = 907;
pub const STREAM_CAPTURE_WRONG_THREAD: CuResult = 908;
pub const UNKNOWN: CuResult = 999;

/// `(code, name, message)`; the messages paraphrase the driver's.
const TABLE: &[(CuResult, &CStr, &CStr)] = &[
    (SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (INVALID_VALUE, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (NOT_INITIALIZED, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (NO_DEVICE, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (INVALID_DEVICE, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (INVALID_IMAGE, c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
    (INVALID_CONTEXT, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (NO_BINARY_FOR_GPU, c"CUDA_ERROR_NO_BINARY_FOR_GPU", c"no kernel image is available for execution on the device"),
    (PEER_ACCESS_UNSUPPORTED, c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", c"peer access is not supported between these two devices"),
    (INVALID_PTX, c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
    (UNSUPPORTED_PTX_VERSION, c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", c"the provided PTX was compiled with an unsupported toolchain"),
    (FILE_NOT_FOUND, c"CUDA_ERROR_FILE_NOT_FOUND", c"file not found"),
    (INVALID_HANDLE, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (ILLEGAL_STATE, c"CUDA_ERROR_ILLEGAL_STATE", c"the operation is not permitted in the current state"),
    (NOT_FOUND, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (NOT_READY, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (ILLEGAL_ADDRESS, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (LAUNCH_OUT_OF_RESOURCES, c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", c"too many resources requested for launch"),
    (PEER_ACCESS_ALREADY_ENABLED, c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", c"peer access is already enabled"),
    (MISALIGNED_ADDRESS, c"CUDA_ERROR_MISALIGNED_ADDRESS", c"misaligned address"),
    (LAUNCH_FAILED, c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
    (NOT_SUPPORTED, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (STREAM_CAPTURE_UNSUPPORTED, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", c"operation not permitted when stream is capturing"),
    (STREAM_CAPTURE_INVALIDATED, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", c"operation failed due to a previous error during capture"),
    (STREAM_CAPTURE_ISOLATION, c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION", c"dependency created on uncaptured work in another stream"),
    (STREAM_CAPTURE_IMPLICIT, c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", c"operation would make the legacy stream depend on a capturing blocking stream"),
    (CAPTURED_EVENT, c"CUDA_ERROR_CAPTURED_EVENT", c"operation not permitted on an event last recorded in a capturing stream"),
    (STREAM_CAPTURE_WRONG_THREAD, c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", c"attempt to terminate a thread-local capture sequence from another thread"),
    (UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// NUL-terminated name and message of `code` (None for codes the double never returns).
pub fn describe(code: CuResult) -> Option<(&'static CStr, &'static CStr)> {
    TABLE.iter().find(|(c, _, _)| *c == code).map(|&(_, n, m)| (n, m))
}
