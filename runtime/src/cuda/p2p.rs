//! Peer-to-peer probe for `kiln doctor`: for every ordered GPU pair whose driver reports peer
//! capability, enable peer access, copy a pair-specific pattern from one GPU's memory into the
//! other's and read it back. Capability bits lie on some machines (translated IOMMU, ACS, VM
//! passthrough): peer access is granted but the writes never land, and NCCL then hangs or
//! corrupts data. Only data that arrived counts.

use super::hardware::{cu, describe};
use super::resources::{Context, DeviceBuffer, Stream};
use crate::error::RuntimeError;
use cudarc::driver::{result, sys};

const PROBE_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerResult {
    /// The pattern arrived intact.
    Ok,
    /// Peer access was granted but `bad` of the probe's bytes did not arrive.
    Lost { bad: usize },
    /// The driver reports no peer capability for this pair.
    Unsupported,
    Error(String),
}

#[derive(Debug, Clone)]
pub struct PeerProbe {
    pub from: usize,
    pub to: usize,
    pub result: PeerResult,
}

fn pattern(from: usize, to: usize) -> Vec<u8> {
    (0..PROBE_BYTES).map(|k| ((from * 31 + to * 7 + k) % 251) as u8 ^ 0x5a).collect()
}

/// Probes every ordered pair of the first `gpus` GPUs.
pub fn probe(gpus: usize) -> Result<Vec<PeerProbe>, RuntimeError> {
    if gpus < 2 {
        return Ok(Vec::new());
    }
    let contexts: Vec<Context> = (0..gpus).map(Context::open).collect::<Result<_, _>>()?;
    let mut bufs = Vec::with_capacity(gpus);
    let mut streams = Vec::with_capacity(gpus);
    for c in &contexts {
        c.bind()?;
        bufs.push((DeviceBuffer::zeroed(PROBE_BYTES as u64, "P2P probe source")?, DeviceBuffer::zeroed(PROBE_BYTES as u64, "P2P probe target")?));
        streams.push(Stream::new()?);
    }
    let mut out = Vec::new();
    for from in 0..gpus {
        for to in (0..gpus).filter(|&t| t != from) {
            let result = pair(&contexts, &bufs, &streams, from, to).unwrap_or_else(|e| PeerResult::Error(e.to_string()));
            out.push(PeerProbe { from, to, result });
        }
    }
    // Release in order: buffers and streams in their own contexts, then the contexts.
    for c in contexts.iter().rev() {
        c.bind()?;
        drop(bufs.pop());
        drop(streams.pop());
    }
    Ok(out)
}

fn pair(contexts: &[Context], bufs: &[(DeviceBuffer, DeviceBuffer)], streams: &[Stream], from: usize, to: usize) -> Result<PeerResult, RuntimeError> {
    let mut can = 0;
    // SAFETY: two valid devices.
    cu(|| "cuDeviceCanAccessPeer".into(), unsafe { sys::cuDeviceCanAccessPeer(&mut can, contexts[from].device, contexts[to].device) }.result())?;
    if can == 0 {
        return Ok(PeerResult::Unsupported);
    }
    contexts[from].bind()?;
    // SAFETY: enables access from the current context to `to`'s.
    match unsafe { sys::cuCtxEnablePeerAccess(contexts[to].ctx, 0) }.result() {
        Ok(()) => {}
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
        Err(e) => return Ok(PeerResult::Error(format!("cuCtxEnablePeerAccess: {}", describe(&e)))),
    }
    let data = pattern(from, to);
    let (src, dst) = (&bufs[from].0, &bufs[to].1);
    contexts[to].bind()?;
    // SAFETY: `dst` holds PROBE_BYTES.
    cu(|| "clearing the probe target".into(), unsafe { result::memset_d8_sync(dst.ptr, 0, PROBE_BYTES) })?;
    contexts[from].bind()?;
    // SAFETY: `src` holds PROBE_BYTES.
    cu(|| "writing the probe pattern".into(), unsafe { result::memcpy_htod_sync(src.ptr, &data) })?;
    // SAFETY: both buffers hold PROBE_BYTES; the stream belongs to `from`'s context.
    cu(|| format!("peer copy GPU {from} -> GPU {to}"), unsafe { result::memcpy_peer_async(contexts[to].ctx, dst.ptr, contexts[from].ctx, src.ptr, PROBE_BYTES, streams[from].0) })?;
    streams[from].sync()?;
    contexts[to].bind()?;
    let mut back = vec![0u8; PROBE_BYTES];
    // SAFETY: `dst` holds PROBE_BYTES.
    cu(|| "reading the probe target".into(), unsafe { result::memcpy_dtoh_sync(&mut back, dst.ptr) })?;
    let bad = back.iter().zip(&data).filter(|(a, b)| a != b).count();
    Ok(if bad == 0 { PeerResult::Ok } else { PeerResult::Lost { bad } })
}
