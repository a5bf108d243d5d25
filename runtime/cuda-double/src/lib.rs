//! A CUDA driver + NCCL double for machines without a GPU: one shared library, linked to as
//! `libcuda.so` and `libnccl.so` (see `scripts/with-cuda-double.sh`), that exports the driver
//! and NCCL functions kiln's CUDA backend calls through cudarc and runs every kernel in kiln's
//! PTX emulator. It is as strict as the driver where kiln could go wrong: kernel arguments are
//! decoded by the entry's `.param` list, every global access is checked against live
//! allocations (a fault fails the context for good: `CUDA_ERROR_ILLEGAL_ADDRESS`), cubins must
//! match the GPU's architecture, PTX must suit the driver version, stream-capture rules are
//! enforced, allocations count against the configured memory (backed lazily, so a 96 GB plan
//! costs only the pages it touches) and come back uncleared (all-ones bytes up to 64 MiB, and
//! in pinned host memory), and collectives rendezvous across ranks.
//!
//! Written by hand because nothing else runs modern PTX behind the driver ABI (see
//! `../shared/reference/cuda.md` §6): the simulated machine is set by `KILN_DOUBLE_*`
//! variables ([`config`]).

pub mod api;
pub mod config;
pub mod driver;
pub mod module;
pub mod nccl;
pub mod status;
