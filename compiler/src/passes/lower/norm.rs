//! RMSNorm: `Op::RmsNorm`, one block per row — or, for a few rows (decode), the residual added
//! in an `add` launch and the norm over column blocks that each sum the whole row (the same bits
//! as one block), when the byte model predicts that faster: one block per row streams a
//! 6,144-wide row on one SM.

use super::{candidate_us, fits, float_flag, numel, of, of_grid, width, Cx, Instance, ELEMENTWISE_MAX_GRID, THREADS};
use crate::kernels::{AddArgs, AddParams, Ptr, RmsnormArgs, RmsnormParams};
use kiln_runtime::perf::Constants;
use kiln_runtime::plan::{BufId, Op};

// The CPU reference sums a row's squares in the order of a block of this many threads, so the
// rmsnorm kernel and the split GEMM's NORM form normalise to its bits.
const _: () = assert!(THREADS as usize == kiln_runtime::cpu::NORM_THREADS);

/// (column blocks, predicted µs) of the cheapest column split of a RES = 0 norm over `rows` rows
/// of `h` values: every block reads its row (`x_size` bytes a value), the weight and output
/// columns it owns.
fn column_blocks(rows: usize, h: usize, x_size: usize, w_size: usize, out_size: usize, k: &Constants) -> (u32, f64) {
    let per_thread = h.div_ceil(THREADS as usize);
    let cost = |cb: usize| {
        let blocks = (rows * cb) as f64;
        candidate_us((rows * h * w_size) as f64, (rows * h * (x_size * cb + out_size)) as f64, 0.0, blocks, k)
    };
    (1..=per_thread).filter(|cb| cb.is_power_of_two() || *cb == per_thread).map(|cb| (cb as u32, cost(cb))).fold((1, f64::MAX), |best, c| if c.1 < best.1 { c } else { best })
}

/// Blocks of the `add` launch over `n` values.
fn add_grid(n: usize) -> u32 {
    (n as u32).div_ceil(THREADS).clamp(1, ELEMENTWISE_MAX_GRID)
}

/// The predicted µs of [`residual_add`] of `x` into `residual`: both read, the residual written.
pub(super) fn residual_add_us(cx: &Cx, residual: BufId, x: BufId) -> f64 {
    let p = cx.program;
    let bytes = 2 * p.buffer(residual).bytes + p.buffer(x).bytes;
    candidate_us(0.0, bytes as f64, 0.0, add_grid(numel(p, residual)) as f64, &cx.consts)
}

/// The predicted µs of a norm without a residual (the one [`instances`] makes: its cheapest
/// column split).
pub(super) fn predicted_us(cx: &Cx, op: &Op) -> Result<f64, String> {
    let Op::RmsNorm { input, residual: None, weight, out, .. } = *op else {
        return Err("not an rmsnorm without a residual".into());
    };
    let p = cx.program;
    let h = width(p, out);
    let size = |bf16: u32| if bf16 == 1 { 2 } else { 4 };
    let x = size(float_flag(p.buffer(input).dtype, "the input")?);
    let w = size(float_flag(cx.plan.weight(weight).dtype, "the weight")?);
    let o = size(float_flag(p.buffer(out).dtype, "the output")?);
    Ok(column_blocks(numel(p, out) / h.max(1), h, x, w, o, &cx.consts).1)
}

pub(super) fn instances(cx: &Cx, op: &Op) -> Result<Vec<Instance>, String> {
    let Op::RmsNorm { input, residual, weight, eps, out } = *op else {
        return Err("not an rmsnorm".into());
    };
    let (plan, p) = (cx.plan, cx.program);
    let h = width(p, out);
    let rows = numel(p, out) / h.max(1);
    fits(h * 4 + 128, cx.smem_limit, &format!("rmsnorm over {h} values"))?;
    let x_bf16 = float_flag(p.buffer(input).dtype, "the input")?;
    let res_bf16 = match residual {
        Some(r) => float_flag(p.buffer(r).dtype, "the residual")?,
        None => 0,
    };
    let w_bf16 = float_flag(plan.weight(weight).dtype, "the weight")?;
    let out_bf16 = float_flag(p.buffer(out).dtype, "the output")?;
    let size = |bf16: u32| if bf16 == 1 { 2 } else { 4 };
    let params = RmsnormParams {
        arch: cx.arch,
        rows: rows as u32,
        h: h as u32,
        threads: THREADS,
        x_bf16,
        res: residual.is_some() as u32,
        res_bf16,
        src_bf16: if residual.is_some() { res_bf16 } else { x_bf16 },
        w_bf16,
        out_bf16,
        cb: 1,
    };
    let args = |x| RmsnormArgs { x: Ptr::Buffer(x), residual: Ptr::Buffer(residual.unwrap_or(input)), weight: Ptr::Weight(weight), out: Ptr::Buffer(out), eps };
    let one_block = || Ok(vec![of(&params, rows as u32, args(input).launch_args())]);
    // a RES = 0 norm of `x` over `params.cb` column blocks
    let columns = |params: RmsnormParams, x| of_grid(&params, [rows as u32, params.cb, 1], THREADS, args(x).launch_args());
    let k = &cx.consts;
    let Some(r) = residual else {
        let (cb, _) = column_blocks(rows, h, size(x_bf16), size(w_bf16), size(out_bf16), k);
        if cb == 1 {
            return one_block();
        }
        return Ok(vec![columns(RmsnormParams { cb, ..params }, input)]);
    };
    // with a residual: one block per row, or `residual += x` (an add launch: the same f32 sum
    // and rounding) then the norm of the residual over column blocks
    let n = rows * h;
    let one = candidate_us((h * size(w_bf16) * rows) as f64, (n * (size(x_bf16) + 2 * size(res_bf16) + size(out_bf16))) as f64, 0.0, rows as f64, k);
    let grid = (n as u32).div_ceil(THREADS).clamp(1, ELEMENTWISE_MAX_GRID);
    let add_us = candidate_us(0.0, (n * (size(x_bf16) + 2 * size(res_bf16))) as f64, 0.0, grid as f64, k);
    let (cb, norm_us) = column_blocks(rows, h, size(res_bf16), size(w_bf16), size(out_bf16), k);
    if cb == 1 || add_us + norm_us >= one {
        return one_block();
    }
    let norm = RmsnormParams { res: 0, res_bf16: 0, x_bf16: res_bf16, src_bf16: res_bf16, cb, ..params };
    Ok(vec![residual_add(cx, r, input)?, columns(norm, r)])
}

/// `residual = round(residual + x)` elementwise in an `add` launch: the residual add of a decode
/// rmsnorm, or of an all-reduce that took it over (`AllReduce { residual }`, after NCCL).
pub(super) fn residual_add(cx: &Cx, residual: BufId, x: BufId) -> Result<Instance, String> {
    let p = cx.program;
    let n = numel(p, residual);
    let grid = add_grid(n);
    let res_bf16 = float_flag(p.buffer(residual).dtype, "the residual")?;
    let x_bf16 = float_flag(p.buffer(x).dtype, "the input")?;
    let add = AddParams { arch: cx.arch, n: n as u32, grid, threads: THREADS, a_bf16: res_bf16, b_bf16: x_bf16, out_bf16: res_bf16 };
    Ok(of(&add, grid, AddArgs { a: Ptr::Buffer(residual), b: Ptr::Buffer(x), out: Ptr::Buffer(residual) }.launch_args()))
}
