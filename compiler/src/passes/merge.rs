//! Launch merging (after lowering): where a step's last launch and the next step's first do not
//! depend on each other, one launch runs both kernels side by side (`kernels/merge.rs`) and the
//! two steps become one `Concurrent` step. Each merge saves a launch (a graph node) and lets a
//! small grid share the GPU with a large one; the kernels and their bits are unchanged.
//!
//! Independence is checked on memory, not on names, because the workspace reuses bytes of dead
//! buffers: nothing the first step writes may overlap what the second's launch is passed, nor
//! the reverse; a KV-cache layer written by one may not be addressed by the other; the split-K
//! region (scratch every split-K launch starts at) serves one of them at most; collectives and
//! already merged launches stay as they are. Blocks of different sizes merge where the smaller
//! kernel's blocks fit on the SMs side by side (the merged block is the larger).

use crate::error::CompileError;
use crate::kernels::merge::{merge_ptx, MergePart, MERGED_ENTRY};
use kiln_runtime::plan::{BufId, KernelFamily, KernelId, KernelInfo, KernelPart, Launch, LaunchArg, Op, Plan, Program, ProgramKind, Step};
use std::collections::BTreeMap;

/// Whether lowering may give adjacent steps' ops `a` and `b` of `p` one launch (where their
/// kernels allow): decode programs only (a prefill launch is long: a launch saved is nothing),
/// no collective, and `b` neither writes what `a` reads or writes (it may read what `a` wrote:
/// its first launch may not, which the merge checks). The memory plan keeps such steps'
/// buffers apart.
pub fn may_share_a_launch(p: &Program, a: &Op, b: &Op) -> bool {
    let collective = |o: &Op| o.leaves().iter().any(|o| matches!(o, Op::AllReduce { .. } | Op::AllGather { .. }));
    let (aw, ar) = (a.writes(), a.reads());
    matches!(p.kind, ProgramKind::Decode { .. }) && !collective(a) && !collective(b) && !b.writes().iter().any(|x| aw.contains(x) || ar.contains(x))
}

/// Merges the launches of adjacent independent steps in every program of a GPU plan.
pub fn merge(plan: &mut Plan, smem_limit: u32) -> Result<(), CompileError> {
    let mut by_name: BTreeMap<String, KernelId> = plan.kernels.iter().enumerate().map(|(i, k)| (k.name.clone(), KernelId(i as u32))).collect();
    let mut programs = std::mem::take(&mut plan.programs);
    let sms = kiln_runtime::perf::Constants::for_target(&plan.target).map_or(kiln_runtime::perf::Constants::SM120A.sms, |(k, _)| k.sms);
    let result = programs.iter_mut().try_for_each(|p| merge_program(plan, p, &mut by_name, smem_limit, sms));
    plan.programs = programs;
    result
}

fn merge_program(plan: &mut Plan, program: &mut Program, by_name: &mut BTreeMap<String, KernelId>, smem_limit: u32, sms: u32) -> Result<(), CompileError> {
    let mut s = 0;
    while s + 1 < program.steps.len() {
        if !may_share_a_launch(program, &program.steps[s].op, &program.steps[s + 1].op) || !independent(plan, program, &program.steps[s], &program.steps[s + 1], sms) {
            s += 1;
            continue;
        }
        let (a, b) = (program.steps[s].launches.last().expect("checked"), &program.steps[s + 1].launches[0]);
        let Some(kernel) = merged_kernel(plan, a, b, by_name, smem_limit)? else {
            s += 1;
            continue;
        };
        let merged = Launch {
            kernel,
            grid: [a.grid.iter().product::<u32>() + b.grid.iter().product::<u32>(), 1, 1],
            block: [a.block[0].max(b.block[0]), 1, 1],
            smem_dynamic: a.smem_dynamic.max(b.smem_dynamic),
            args: a.args.iter().chain(&b.args).copied().collect(),
        };
        let second = program.steps.remove(s + 1);
        let first = &mut program.steps[s];
        first.launches.pop();
        first.launches.push(merged);
        first.launches.extend(second.launches.into_iter().skip(1));
        let ops = first.op.leaves().iter().chain(second.op.leaves()).cloned().collect();
        first.op = Op::Concurrent { ops };
        first.kernel = KernelFamily::Merged;
    }
    Ok(())
}

/// Whether `b`'s first launch may run beside `a`'s last (see the module comment), for steps
/// that [`may_share_a_launch`].
fn independent(plan: &Plan, p: &Program, a: &Step, b: &Step, sms: u32) -> bool {
    let (Some(la), Some(lb)) = (a.launches.last(), b.launches.first()) else { return false };
    if la.block[1..] != [1, 1] || lb.block[1..] != [1, 1] {
        return false;
    }
    // blocks of different sizes: the merged block is the larger, so the smaller kernel's blocks
    // take the larger's room on an SM; only where they fit on the SMs side by side anyway
    let blocks = |l: &Launch| l.grid.iter().product::<u32>();
    if la.block != lb.block && blocks(if la.block[0] < lb.block[0] { la } else { lb }) > sms {
        return false;
    }
    let plain = |l: &Launch| {
        let k = plan.kernel(l.kernel);
        k.parts.is_empty() && k.family != KernelFamily::Collective && !l.args.contains(&LaunchArg::P2pRegion)
    };
    if !plain(la) || !plain(lb) {
        return false;
    }
    let split_k = |l: &Launch| l.args.contains(&LaunchArg::SplitKRegion);
    if split_k(la) && split_k(lb) {
        return false;
    }
    let kv = |l: &Launch| l.args.iter().any(|x| matches!(x, LaunchArg::KvCache { .. }));
    if (a.op.writes_kv_cache() && kv(lb)) || (b.op.writes_kv_cache() && kv(la)) {
        return false;
    }
    let range = |buf: BufId| {
        let b = p.buffer(buf);
        (b.offset, b.offset + b.bytes)
    };
    let passed = |l: &Launch| l.args.iter().filter_map(|x| if let LaunchArg::Buffer(b) = *x { Some(range(b)) } else { None }).collect::<Vec<_>>();
    let overlaps = |w: &[(u64, u64)], t: &[(u64, u64)]| w.iter().any(|&(w0, w1)| t.iter().any(|&(t0, t1)| w0 < t1 && t0 < w1));
    let writes = |st: &Step| st.op.writes().into_iter().map(range).collect::<Vec<_>>();
    !overlaps(&writes(a), &passed(lb)) && !overlaps(&writes(b), &passed(la))
}

/// The merged kernel of launches `a` and `b` (made once per pair of kernels and grids), or None
/// where its shared memory would not fit a block.
fn merged_kernel(plan: &mut Plan, a: &Launch, b: &Launch, by_name: &mut BTreeMap<String, KernelId>, smem_limit: u32) -> Result<Option<KernelId>, CompileError> {
    let (ka, kb) = (plan.kernel(a.kernel).clone(), plan.kernel(b.kernel).clone());
    // `merged_arch<N>_<templates>_<hash of the parts and grids>`: named like a template's kernels
    let arch = ka.params.iter().find(|(n, _)| n == "ARCH").map_or(0, |(_, v)| *v);
    let name = format!("merged_arch{arch}_{}_{}_{:016x}", ka.template, kb.template, fnv1a(&format!("{} {:?} {} {:?}", ka.name, a.grid, kb.name, b.grid)));
    if let Some(&id) = by_name.get(&name) {
        return Ok(Some(id));
    }
    let fail = |message: String| CompileError::Verifier { pass: "merge", message: format!("{name} ({} + {}): {message}", ka.name, kb.name) };
    let ptx = merge_ptx(&[MergePart { ptx: &ka.ptx, grid: a.grid }, MergePart { ptx: &kb.ptx, grid: b.grid }]).map_err(fail)?;
    // the parts' static shared arrays add up; their dynamic shared memory is one region
    let module = kiln_runtime::emu::Module::parse(&ptx, &name).map_err(|e| fail(e.to_string()))?;
    let static_bytes = module.entries.first().map_or(0, |e| e.shared_static) as u64;
    if static_bytes.next_multiple_of(16) + a.smem_dynamic.max(b.smem_dynamic) as u64 > smem_limit as u64 {
        return Ok(None);
    }
    let parts = vec![
        KernelPart { kernel: a.kernel, grid: a.grid, block: a.block, args: a.args.len() as u32 },
        KernelPart { kernel: b.kernel, grid: b.grid, block: b.block, args: b.args.len() as u32 },
    ];
    let id = KernelId(plan.kernels.len() as u32);
    plan.kernels.push(KernelInfo { name: name.clone(), family: KernelFamily::Merged, template: "merged".into(), entry: MERGED_ENTRY.into(), params: Vec::new(), ptx, resources: None, parts });
    by_name.insert(name, id);
    Ok(Some(id))
}

/// FNV-1a (64 bit): a short, stable name for a pair of kernels and grids.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, c| (h ^ c as u64).wrapping_mul(0x0100_0000_01b3))
}
