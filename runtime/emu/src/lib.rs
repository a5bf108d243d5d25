//! CPU emulator for the PTX that kiln emits, so kernels can be run and checked on machines
//! without a GPU.
//!
//! `Module::parse` reads PTX text and lowers it to an IR; `launch` runs one kernel over a grid.
//! Warps execute in lockstep under an active mask (divergent lanes reconverge where their paths
//! meet); collectives (`mma.sync`, `ldmatrix`, `shfl.sync`, `bar.warp.sync`) wait until every
//! participating lane has arrived, `bar.sync`/`bar.arrive` work per warp at block level, and
//! blocks run in parallel (rayon). Global-memory bytes read and written are counted per launch.
//! Anything outside the supported subset is rejected with the file and line, never ignored;
//! faults at run time (bad addresses, misalignment, deadlocks, undefined collectives) are
//! errors naming the kernel, line, instruction, block and lane.
//!
//! Supported (see `decode*.rs` for the exact modifier sets):
//! * data: `mov` (incl. special registers, variable addresses, `{a,b,..}` pack/unpack),
//!   `ld`/`st` `.param/.global/.shared`/generic, scalar `.v2 .v4`, `.nc`, cache and memory-order
//!   qualifiers; `cvta{.to}.{global,shared}.u64`; `cp.async.{ca,cg}.shared.global` (src-size,
//!   ignore-src) with `commit_group`/`wait_group`/`wait_all`;
//! * integer: `add sub (.sat) mul/mad .lo/.hi/.wide div rem min max neg abs and or xor not cnot
//!   shl shr popc clz brev prmt lop3`, predicate logic;
//! * float (.f32/.f64): `add sub mul (.rn .ftz .sat) fma.rn mad.rn div (.rn .approx .full) min max
//!   (.NaN) neg abs rcp sqrt (.rn .approx) rsqrt ex2 lg2 sin cos tanh (.approx)`; half
//!   (.f16/.f16x2): `add sub mul fma` `.rn` (subnormals kept; `.ftz`/`.sat` refused);
//! * `setp` (all comparisons incl. unordered, `.and/.or/.xor`, `p|q`), `selp`;
//! * `cvt`: integer widths (.sat), int→float .rn, float→int .rni/.rzi/.rmi/.rpi, f16/bf16/f32/f64,
//!   `.rn.bf16x2/.f16x2.f32`, `.rn.satfinite{.relu}.{e4m3x2,e2m1x2}.f32` (a → high half),
//!   `.rn{.relu}.f16x2.{e4m3x2,e2m1x2}`;
//! * control and sync: `@p`/`@!p`, `bra{.uni}`, `ret`, `exit`, `bar{.cta}.sync`, `barrier.sync`,
//!   `bar.arrive`, `bar.warp.sync`, `membar`, `fence`, `nanosleep`, `trap` (an execution error);
//! * warp: `shfl.sync.{up,down,bfly,idx}`, `ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.b16`,
//!   `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`,
//!   `mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::{4X,2X}.f32.e2m1.e2m1.f32.{ue4m3,ue8m0}`
//!   (and `.kind::mxf4`);
//! * `atom`/`red` on global/shared: add (u32 s32 u64 f32 f64), min/max, and/or/xor, exch, cas,
//!   inc/dec;
//! * special registers `%tid %ntid %ctaid %nctaid %laneid %warpid %nwarpid %lanemask_*
//!   %dynamic_smem_size %total_smem_size`.
//!
//! Numerics: rounding conversions are bit-exact (`crate::formats` for bf16/e4m3/e2m1, IEEE half
//! here); `mma` forms exact products and rounds the f64 sum once to f32 (the ISA leaves the
//! accumulation order open); `.approx` functions are computed to f32 precision, inside the ISA's
//! error bounds.
//!
//! ```no_run
//! use kiln_emu::{launch, GlobalMemory, KernelArg, Module};
//! let m = Module::parse(&std::fs::read_to_string("k.ptx").unwrap(), "k.ptx").unwrap();
//! let mut g = GlobalMemory::new();
//! let out = g.alloc("out", 4 * 256);
//! let stats = launch(&m, "k", [1, 1, 1], [256, 1, 1], 0, &[KernelArg::U64(g.addr(out))], &mut g).unwrap();
//! println!("{} B read, {} B written", stats.global_bytes_read(), stats.global_bytes_written());
//! ```

mod access;
mod alu;
mod block;
mod collective;
mod convert;
mod decode;
mod decode_alu;
mod decode_cvt;
mod decode_mma;
pub mod formats;
mod half;
pub mod ir;
mod launch;
mod lexer;
mod memory;
mod mma;
mod parser;
mod regs;
mod special;
pub mod versions;
mod warp;

pub use convert::{f16_to_f32, f32_to_f16};
pub use launch::{launch, launch_params, launch_params_with_peers, launch_with_peers, KernelArg, LaunchStats, MAX_SHARED_PER_BLOCK, MAX_THREADS_PER_BLOCK};
pub use memory::{BufferId, GlobalMemory, GLOBAL_BASE, SHARED_WINDOW};
pub use parser::{Entry, Module, Param};
pub use warp::Counters;

/// Everything that can go wrong parsing or running PTX.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// Malformed or unsupported PTX, with its source position.
    #[error("{file}:{line}: {msg}")]
    Parse { file: String, line: u32, msg: String },
    /// A fault while executing an instruction (bad address, deadlock, undefined behaviour).
    #[error("{file}:{line}: in kernel '{entry}', `{inst}`: {msg}")]
    Exec { file: String, line: u32, entry: String, inst: String, msg: String },
    /// Bad launch configuration or arguments.
    #[error("{0}")]
    Launch(String),
}
