//! Lowering of `mma.sync.aligned` (dense bf16/f16 m16n8k16 and block-scaled e2m1 m16n8k64).

use super::decode::{count, DecodeCtx, Mods, R};
use super::ir::{Mma, MmaKind, Op, Ty};
use super::parser::ROp;

pub fn mma(m: &mut Mods, o: &[ROp], ctx: &DecodeCtx) -> R<Op> {
    if !(m.has("sync") && m.has("aligned")) {
        return Err("mma needs .sync.aligned".into());
    }
    if !(m.has("row") && m.has("col")) {
        return Err("mma needs .row.col".into());
    }
    let shape = m.one_of(&["m16n8k16", "m16n8k64"]).ok_or("unsupported mma shape (supported: m16n8k16, m16n8k64)")?;
    let types: Vec<&'static str> =
        m.take_all(|s| ["f32", "bf16", "f16", "e2m1", "ue4m3", "ue8m0", "f64", "s32", "e4m3", "e5m2", "tf32", "s8", "u8", "s4", "u4"].into_iter().find(|t| *t == s));
    let f32 = Ty::F32;
    match shape {
        "m16n8k16" => {
            let f16 = match types.as_slice() {
                ["f32", "bf16", "bf16", "f32"] => false,
                ["f32", "f16", "f16", "f32"] => true,
                _ => return Err(format!("mma.m16n8k16 supports .f32.bf16.bf16.f32 and .f32.f16.f16.f32, found .{}", types.join("."))),
            };
            count(o, 4)?;
            Ok(Op::Mma(Box::new(Mma {
                kind: MmaKind::Dense16 { f16 },
                d: ctx.vec_dst(&o[0], 4, f32)?,
                a: ctx.vec_src(&o[1], 4, Ty::B32)?,
                b: ctx.vec_src(&o[2], 2, Ty::B32)?,
                c: ctx.vec_src(&o[3], 4, f32)?,
                scales: Vec::new(),
            })))
        }
        _ => {
            let kind = m.one_of(&["kind::mxf4nvf4", "kind::mxf4"]).ok_or("mma.m16n8k64 needs .kind::mxf4nvf4 or .kind::mxf4 (other kinds are not supported)")?;
            if !m.has("block_scale") {
                return Err("mma.m16n8k64 .kind::mxf4* needs .block_scale".into());
            }
            let sv = m.one_of(&["scale_vec::2X", "scale_vec::4X"]);
            let stype = match types.as_slice() {
                ["f32", "e2m1", "e2m1", "f32", st @ ("ue4m3" | "ue8m0")] => *st,
                _ => return Err(format!("block-scaled mma supports .f32.e2m1.e2m1.f32.{{ue4m3,ue8m0}}, found .{}", types.join("."))),
            };
            let scale_vec = match (kind, sv, stype) {
                ("kind::mxf4nvf4", Some("scale_vec::4X"), _) => 4,
                ("kind::mxf4nvf4", Some(_), "ue8m0") => 2,
                ("kind::mxf4", None | Some("scale_vec::2X"), "ue8m0") => 2,
                ("kind::mxf4nvf4", None, _) => return Err(".kind::mxf4nvf4 needs .scale_vec::2X or ::4X".into()),
                _ => return Err(format!("invalid combination {kind} {} .{stype}", sv.unwrap_or("(default 2X)"))),
            };
            count(o, 8)?;
            let pair = |v: &ROp| -> R<Vec<_>> {
                match v {
                    ROp::Vec(x) if x.len() == 2 => Ok(vec![ctx.src(&x[0], Ty::U16)?, ctx.src(&x[1], Ty::U16)?]),
                    _ => Err("selector must be {byte-id, thread-id}".into()),
                }
            };
            let mut scales = vec![ctx.src(&o[4], Ty::B32)?];
            scales.extend(pair(&o[5])?);
            scales.push(ctx.src(&o[6], Ty::B32)?);
            scales.extend(pair(&o[7])?);
            Ok(Op::Mma(Box::new(Mma {
                kind: MmaKind::Fp4BlockScaled { scale_vec, ue4m3: stype == "ue4m3" },
                d: ctx.vec_dst(&o[0], 4, f32)?,
                a: ctx.vec_src(&o[1], 4, Ty::B32)?,
                b: ctx.vec_src(&o[2], 2, Ty::B32)?,
                c: ctx.vec_src(&o[3], 4, f32)?,
                scales,
            })))
        }
    }
}
