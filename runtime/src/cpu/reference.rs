//! The CPU backend's ops on plain slices, for testing kernels against exactly the code the
//! backend runs (no plan needed). Values are f32; `*_bf16` flags round where a BF16 buffer would.

use super::linear::{linear, Linear, LinearScratch, Matrix};
use super::norm::rms_norm_row;
use super::{ActQuant, Round};
use crate::plan::Epilogue;

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
