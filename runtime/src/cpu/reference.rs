//! The CPU backend's ops on plain slices, for testing kernels against exactly the code the
//! backend runs (no plan needed). Values are f32; `*_bf16` flags round where a BF16 buffer would.

use super::linear::{linear, Linear, LinearScratch, Matrix};
use super::norm::rms_norm_row;
use super::rope::Rope;
use super::{ActQuant, Round};
use crate::plan::{DType, Epilogue, KvLayout};

fn round(bf16: bool) -> Round {
    Round(bf16)
}

/// `Op::Linear` over NVFP4 weights (W4A4): `out` is `[tokens, N]` (`[tokens, N/2]` for SiLU-mul).
#[allow(clippy::too_many_arguments)]
pub fn linear_nvfp4(x: &[f32], tokens: usize, packed: &[u8], scales: &[u8], k: usize, parts: &[usize], scale_2: &[f32], input_scale: &[f32], epilogue: Epilogue, out_bf16: bool, out: &mut [f32]) {
    let lin = Linear { matrix: Matrix::Nvfp4 { packed, scales }, k, parts, scale_2, input_scale };
    linear(x, tokens, &lin, ActQuant::W4A4, epilogue, round(out_bf16), &mut LinearScratch::default(), out);
}

/// `Op::Linear` over BF16 weights (`w` little-endian `[N, K]`).
pub fn linear_bf16(x: &[f32], tokens: usize, w: &[u8], k: usize, n: usize, out_bf16: bool, out: &mut [f32]) {
    let parts = [n];
    let lin = Linear { matrix: Matrix::Bf16(w), k, parts: &parts, scale_2: &[], input_scale: &[] };
    linear(x, tokens, &lin, ActQuant::W4A4, Epilogue::None, round(out_bf16), &mut LinearScratch::default(), out);
}

/// `Op::RmsNorm` on `[rows, h]`: with a residual, `residual = round(residual + x)` first and the
/// residual is normalised.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(x: &[f32], residual: Option<(&mut [f32], bool)>, w: &[f32], eps: f32, h: usize, x_bf16: bool, out_bf16: bool, out: &mut [f32]) {
    let (src, src_bf16): (&[f32], bool) = match residual {
        Some((res, res_bf16)) => {
            res.iter_mut().zip(x).for_each(|(a, &b)| *a = round(res_bf16).apply(*a + b));
            (res, res_bf16)
        }
        None => (x, x_bf16),
    };
    for (xr, or) in src.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        rms_norm_row(xr, w, eps, round(src_bf16), round(out_bf16), or);
    }
}

/// `Op::Embed` on one rank: the BF16 `[vocab_rows, h]` table slice owns rows
/// `first_row..first_row + vocab_rows`; other ids give zero rows.
#[allow(clippy::too_many_arguments)]
pub fn embed(ids: &[i32], table: &[u8], vocab_rows: usize, first_row: usize, h: usize, out_bf16: bool, out: &mut [f32]) {
    super::elementwise::embed(ids, table, vocab_rows, first_row as i64, h, round(out_bf16), out);
}

/// `Op::Add`: `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out_bf16: bool, out: &mut [f32]) {
    super::elementwise::add(a, b, round(out_bf16), out);
}

/// `Op::GatherRows` over rows of `h` values (indices outside `src` give zeros).
pub fn gather_rows(src: &[f32], rows: &[i32], h: usize, out_bf16: bool, out: &mut [f32]) {
    super::elementwise::gather_rows(src, rows, h, round(out_bf16), out);
}

/// `Op::Router`: `x` is `[tokens, hidden]`, `gate` the BF16 `[experts, hidden]` bytes, `bias` the
/// correction bias; `ids` / `weights` are `[tokens, top_k]`.
pub fn router(x: &[f32], hidden: usize, gate: &[u8], bias: &[f32], params: &crate::plan::RouterParams, ids: &mut [i32], weights: &mut [f32]) {
    super::router::route(x, hidden, gate, bias, params, ids, weights);
}

/// The per-token inputs of cache-aware ops (a program's input buffers).
#[derive(Clone, Copy)]
pub struct TokenInputs<'a> {
    pub positions: &'a [i32],
    /// Sequence of each token (-1: padding).
    pub token_seq: &'a [i32],
    /// Cache slot each token writes (-1: none).
    pub slots: &'a [i32],
    /// `[seqs, pages_per_seq]` page ids (-1: unassigned).
    pub page_table: &'a [i32],
    pub pages_per_seq: usize,
}

impl<'a> TokenInputs<'a> {
    fn tokens(&self) -> super::Tokens<'a> {
        super::Tokens { positions: self.positions, token_seq: self.token_seq, slots: self.slots, page_table: self.page_table, pages_per_seq: self.pages_per_seq }
    }
}

/// One rank's KV cache, readable and writable in the GPU byte layout of [`KvLayout`].
pub struct Cache {
    kv: super::kv_cache::KvCache,
    layout: KvLayout,
}

impl Cache {
    /// An all-zero cache of the layout's full capacity; values stored are rounded to BF16 when
    /// the layout's dtype is BF16 (as the CPU backend's bf16 precision does).
    pub fn new(layout: &KvLayout) -> Cache {
        let round = Round(layout.dtype == DType::BF16);
        let mut kv = super::kv_cache::KvCache::new(layout, round);
        kv.reserve(layout.pages * layout.page_size).expect("the full capacity fits");
        Cache { kv, layout: layout.clone() }
    }

    /// One layer in the GPU byte layout (all slots).
    pub fn layer_bytes(&self, layer: usize) -> Vec<u8> {
        self.kv.layer_bytes(layer, self.layout.pages * self.layout.page_size, self.layout.dtype)
    }

    /// Replaces one layer from the GPU byte layout.
    pub fn set_layer_bytes(&mut self, layer: usize, bytes: &[u8]) {
        self.kv.set_layer_bytes(layer, bytes, self.layout.dtype).expect("bytes within the capacity");
    }
}

/// The MLA part of `Op::KvCacheWrite`: `kv` rows `[latent | k_rope]`; `kv_bf16` is the kv buffer's dtype (the
/// normalised latent is rounded to it before the weight multiplies, as transformers does).
#[allow(clippy::too_many_arguments)]
pub fn mla_kv_write(kv: &[f32], kv_bf16: bool, norm: &[f32], eps: f32, t: &TokenInputs, cache: &mut Cache, layer: usize, rope: &Rope) {
    super::kv_cache::mla_write(kv, norm, eps, round(kv_bf16), &t.tokens(), &mut cache.kv, layer, rope);
}

/// The indexer key part of `Op::KvCacheWrite`: `k` rows of `index_dim` values.
#[allow(clippy::too_many_arguments)]
pub fn indexer_key_write(k: &[f32], norm: &[f32], bias: &[f32], eps: f32, t: &TokenInputs, cache: &mut Cache, layer: usize, rope: &Rope) {
    super::indexer::key_write(k, norm, bias, eps, &t.tokens(), &mut cache.kv, layer, rope);
}

/// `Op::IndexerTopK`: `q` `[tokens, heads * index_dim]` (pre-RoPE), `w` `[tokens, heads]`;
/// `out` `[tokens, topk]`.
#[allow(clippy::too_many_arguments)]
pub fn indexer_topk(q: &[f32], w: &[f32], heads: usize, t: &TokenInputs, cache: &Cache, layer: usize, rope: &Rope, topk: usize, out: &mut [i32]) {
    super::indexer::top_k(q, w, heads, &t.tokens(), &cache.kv, layer, rope, topk, (0, 1), out);
}

/// The attention geometry of `Op::MlaAttention` on one rank (kv_b: BF16 `[heads * (nope + v),
/// latent]` bytes).
pub use super::attention::Mla as MlaGeometry;

/// `Op::MlaAttention`: `q` `[tokens, heads * (nope + rope)]` (pre-RoPE); `topk` the selected
/// positions `[tokens, k]` (None: every causal position); `out` `[tokens, heads * v]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(q: &[f32], topk: Option<(&[i32], usize)>, t: &TokenInputs, cache: &Cache, layer: usize, g: &MlaGeometry, rope: &Rope, out_bf16: bool, out: &mut [f32]) {
    super::attention::mla_attention(q, topk, &t.tokens(), &cache.kv, layer, g, rope, round(out_bf16), out);
}

/// A stack of NVFP4 expert matrices `[experts, rows, k]`: packed codes, block scales and
/// `[experts, parts]` weight_scale_2 / input_scale.
pub struct Nvfp4Stack<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub scale_2: &'a [f32],
    pub input_scale: &'a [f32],
}

/// `Op::MoeExperts` over NVFP4 stacks (W4A4; the SwiGLU intermediate rounded to BF16 when
/// `bf16`): `x` `[tokens, hidden]`, `ids`/`weights` `[tokens, top_k]`; tokens with
/// `token_seq < 0` are padding. `first` is the global id of the rank's first expert (EP).
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    x: &[f32],
    token_seq: &[i32],
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
    gate_up: &Nvfp4Stack,
    down: &Nvfp4Stack,
    experts_local: usize,
    first: usize,
    intermediate: usize,
    hidden: usize,
    bf16: bool,
    out: &mut [f32],
) {
    fn stack<'b>(s: &Nvfp4Stack<'b>) -> super::moe::Stack<'b> {
        super::moe::Stack::Nvfp4 { packed: s.packed, scales: s.scales, scale_2: s.scale_2, input_scale: s.input_scale }
    }
    let ex = super::moe::Experts { gate_up: stack(gate_up), down: stack(down), local: experts_local, first, intermediate, hidden };
    let tokens = token_seq.len();
    let mut s = super::moe::MoeScratch::default();
    super::moe::experts(x, tokens, |t| token_seq[t] >= 0, ids, weights, top_k, &ex, ActQuant::W4A4, round(bf16), round(bf16), &mut s, out);
}
