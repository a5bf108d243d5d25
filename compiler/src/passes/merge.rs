//! Launch merging (after lowering): where a step's last launch and the next step's first do not
//! depend on each other, one launch runs both kernels side by side (`kernels/merge.rs`) and the
//! two steps become one `Concurrent` step. Each merge saves a launch (a graph node) and lets a
//! small grid share the GPU with a large one; the kernels and their bits are unchanged.
//!
//! First, where a step's launch depends on the one before it (the router's selection on its gate
//! product), both are templates written for it ([`CHAINABLE`]) and the second is one block, the
//! second becomes the first's tail (chaining: the head's last block to finish runs it). A
//! chained launch may then take a side-by-side partner.
//!
//! Independence is checked on memory, not on names, because the workspace reuses bytes of dead
//! buffers: nothing the first step writes may overlap what the second's launch is passed, nor
//! the reverse; a KV-cache layer written by one may not be addressed by the other; where both
//! count tiles in the split-K region, the second takes the region's upper slot; collectives and
//! launches merged side by side stay as they are. Blocks of different sizes merge where every
//! block of the merged launch is resident at once (the merged block is the larger, with the
//! larger shared memory).

use crate::error::CompileError;
use crate::kernels::merge::{merge_ptx, MergePart, MERGED_ENTRY};
use kiln_runtime::perf::Constants;
use kiln_runtime::plan::{Arch, BufId, KernelFamily, KernelId, KernelInfo, KernelPart, Launch, LaunchArg, Op, Plan, Program, ProgramKind, Step};
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

/// Templates a chain may join, as head or tail: none returns some of a block's threads before a
/// barrier the others still wait at (a chained kernel's returns become branches to a barrier).
pub const CHAINABLE: [&str; 3] = ["linear_bf16_gemm", "linear_bf16_gemv", "router"];

/// Merges launches in every program of a GPU plan: a step's dependent one-block launch as a tail,
/// adjacent steps' independent launches side by side.
pub fn merge(plan: &mut Plan, smem_limit: u32) -> Result<(), CompileError> {
    let mut by_name: BTreeMap<String, KernelId> = plan.kernels.iter().enumerate().map(|(i, k)| (k.name.clone(), KernelId(i as u32))).collect();
    let mut programs = std::mem::take(&mut plan.programs);
    let sms = Constants::for_target(&plan.target).map_or(Constants::SM120A.sms, |(k, _)| k.sms);
    let first_merged = plan.kernels.len();
    let result = programs.iter_mut().try_for_each(|p| merge_program(plan, p, &mut by_name, smem_limit, sms));
    plan.programs = programs;
    drop_unlaunched_merges(plan, first_merged);
    result
}

/// Removes the merged kernels (from index `first`) no launch runs: a chain merged again beside a
/// partner leaves its own kernel behind, which would only cost the artifact and ptxas.
fn drop_unlaunched_merges(plan: &mut Plan, first: usize) {
    let launched: std::collections::BTreeSet<u32> = plan.programs.iter().flat_map(|p| &p.steps).flat_map(|s| &s.launches).map(|l| l.kernel.0).collect();
    let mut new_id = Vec::with_capacity(plan.kernels.len());
    let mut next = 0u32;
    for i in 0..plan.kernels.len() as u32 {
        let keep = (i as usize) < first || launched.contains(&i);
        new_id.push(keep.then_some(next));
        next += keep as u32;
    }
    let mut index = 0;
    plan.kernels.retain(|_| {
        index += 1;
        new_id[index - 1].is_some()
    });
    for l in plan.programs.iter_mut().flat_map(|p| &mut p.steps).flat_map(|s| &mut s.launches) {
        l.kernel = KernelId(new_id[l.kernel.0 as usize].expect("launched"));
    }
}

fn merge_program(plan: &mut Plan, program: &mut Program, by_name: &mut BTreeMap<String, KernelId>, smem_limit: u32, sms: u32) -> Result<(), CompileError> {
    // a step's dependent launches first: a one-block kernel as the tail of the launch before it
    for s in 0..program.steps.len() {
        let mut li = 0;
        while li + 1 < program.steps[s].launches.len() {
            let step = &program.steps[s];
            let chained = if chains(plan, program, step, li) { merged_kernel(plan, &step.launches[li], &step.launches[li + 1], true, by_name, smem_limit)? } else { None };
            let Some((kernel, args)) = chained else {
                li += 1;
                continue;
            };
            let launches = &mut program.steps[s].launches;
            let tail = launches.remove(li + 1);
            let head = &mut launches[li];
            *head = Launch { kernel, grid: head.grid, block: head.block, smem_dynamic: head.smem_dynamic.max(tail.smem_dynamic), args };
        }
    }
    // then adjacent steps' independent launches side by side
    let mut s = 0;
    while s + 1 < program.steps.len() {
        if !may_share_a_launch(program, &program.steps[s].op, &program.steps[s + 1].op) || !independent(plan, program, &program.steps[s], &program.steps[s + 1], sms) {
            s += 1;
            continue;
        }
        let (a, b) = (program.steps[s].launches.last().expect("checked"), &program.steps[s + 1].launches[0]);
        let Some((kernel, args)) = merged_kernel(plan, a, b, false, by_name, smem_limit)? else {
            s += 1;
            continue;
        };
        let merged = Launch {
            kernel,
            grid: [a.grid.iter().product::<u32>() + b.grid.iter().product::<u32>(), 1, 1],
            block: [a.block[0].max(b.block[0]), 1, 1],
            smem_dynamic: a.smem_dynamic.max(b.smem_dynamic),
            args,
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

/// A launch's parts: a merged one's, else itself as one part.
fn parts_of(plan: &Plan, l: &Launch) -> Vec<KernelPart> {
    let k = plan.kernel(l.kernel);
    if k.parts.is_empty() {
        vec![KernelPart { kernel: l.kernel, grid: l.grid, block: l.block, args: l.args.len() as u32, tail: false }]
    } else {
        k.parts.clone()
    }
}

/// Whether a kernel is one template's, not merged and not a collective.
fn plain(plan: &Plan, id: KernelId) -> bool {
    let k = plan.kernel(id);
    k.parts.is_empty() && k.family != KernelFamily::Collective
}

/// Whether a launch is one template kernel or a chain (a head and its tail): what may merge.
fn mergeable(plan: &Plan, l: &Launch) -> bool {
    let k = plan.kernel(l.kernel);
    !l.args.contains(&LaunchArg::P2pRegion) && (plain(plan, l.kernel) || (k.parts.len() == 2 && k.parts[1].tail && k.parts.iter().all(|q| plain(plan, q.kernel))))
}

/// Whether launch `li + 1` of `step` may run as the tail of launch `li` (see the module comment):
/// a decode program, no collective, both one [`CHAINABLE`] template kernel of the same
/// one-dimensional block, the tail one block that does not use the split-K region. One block:
/// on the head's last block it costs what its own launch would, less the launch
/// (`perf::tail_us`); a tail of several would run them one after another, each for its latency
/// more than its bytes, which the performance model does not price.
fn chains(plan: &Plan, p: &Program, step: &Step, li: usize) -> bool {
    if !matches!(p.kind, ProgramKind::Decode { .. }) || step.op.leaves().iter().any(|o| matches!(o, Op::AllReduce { .. } | Op::AllGather { .. })) {
        return false;
    }
    let (la, lb) = (&step.launches[li], &step.launches[li + 1]);
    let chainable = |l: &Launch| {
        plain(plan, l.kernel)
            && CHAINABLE.contains(&plan.kernel(l.kernel).template.as_str())
            && l.block[1..] == [1, 1]
            && !l.args.iter().any(|x| matches!(x, LaunchArg::P2pRegion | LaunchArg::SplitKRegionUpper))
    };
    chainable(la) && chainable(lb) && la.block == lb.block && lb.grid == [1, 1, 1] && !lb.args.contains(&LaunchArg::SplitKRegion)
}

/// Whether `b`'s first launch may run beside `a`'s last (see the module comment), for steps
/// that [`may_share_a_launch`].
fn independent(plan: &Plan, p: &Program, a: &Step, b: &Step, sms: u32) -> bool {
    let (Some(la), Some(lb)) = (a.launches.last(), b.launches.first()) else { return false };
    if la.block[1..] != [1, 1] || lb.block[1..] != [1, 1] {
        return false;
    }
    // blocks of different sizes: the merged block is the larger, with the larger shared memory,
    // so the smaller kernel's blocks take the larger's room on an SM; only where every block of
    // the merged launch is resident at once (a second wave would cost a block's whole time, a
    // launch saved 1.5 µs; e.g. the indexer's 1,024-thread selection beside attention's absorb
    // from 61 selecting blocks)
    let blocks = |l: &Launch| l.grid.iter().product::<u32>();
    let per_sm = resident_blocks(plan.target.arch, la.block[0].max(lb.block[0]), la.smem_dynamic.max(lb.smem_dynamic));
    if la.block != lb.block && blocks(la) + blocks(lb) > sms * per_sm {
        return false;
    }
    // a chained launch first, a plain one beside it (a chain's block is its parts')
    if !mergeable(plan, la) || !plan.kernel(lb.kernel).parts.is_empty() || !mergeable(plan, lb) {
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

/// Blocks of `threads` threads and `smem` bytes of dynamic shared memory one SM is sure to hold
/// at once: by its threads, its shared memory (1 KiB of it reserved per block) and its 64K
/// registers at the most a thread of such a block may get (64K / threads, at most 255: merging
/// runs before ptxas chooses); sm_120a 1,536 threads and 100 KiB (`shared/reference/sm120_ptx.md`),
/// sm_90a 2,048 and 228 KiB.
fn resident_blocks(arch: Arch, threads: u32, smem: u32) -> u32 {
    let (threads_per_sm, smem_per_sm) = if arch == Arch::Sm90a { (2048, 228 << 10) } else { (1536, 100 << 10) };
    let threads = threads.max(1);
    let registers = (65_536 / threads).min(255);
    (threads_per_sm / threads).min(smem_per_sm / (smem + 1024)).min(65_536 / (registers * threads))
}

/// The merged kernel of launches `a` and `b` (made once per set of parts and grids) and the
/// merged launch's arguments, or None where its shared memory would not fit a block. `tail`: `b`
/// runs as `a`'s tail (its arguments then the split-K region, its arrival counter's). Otherwise
/// a `b` that uses the split-K region beside an `a` that does too (a chain's counter counts)
/// takes the upper slot.
fn merged_kernel(plan: &mut Plan, a: &Launch, b: &Launch, tail: bool, by_name: &mut BTreeMap<String, KernelId>, smem_limit: u32) -> Result<Option<(KernelId, Vec<LaunchArg>)>, CompileError> {
    let a_parts = parts_of(plan, a);
    let a_split_k = a.args.iter().any(|x| matches!(x, LaunchArg::SplitKRegion | LaunchArg::SplitKRegionUpper));
    let mut b_args = b.args.clone();
    if tail {
        b_args.push(LaunchArg::SplitKRegion);
    } else if a_split_k {
        b_args.iter_mut().filter(|x| **x == LaunchArg::SplitKRegion).for_each(|x| *x = LaunchArg::SplitKRegionUpper);
    }
    let mut parts = a_parts;
    parts.push(KernelPart { kernel: b.kernel, grid: b.grid, block: b.block, args: b_args.len() as u32, tail });
    let args: Vec<LaunchArg> = a.args.iter().chain(&b_args).copied().collect();
    let kernels: Vec<KernelInfo> = parts.iter().map(|q| plan.kernel(q.kernel).clone()).collect();
    // `merged_arch<N>_<templates>_<hash of the parts, grids and chaining>`: named like a template's kernels
    let arch = kernels[0].params.iter().find(|(n, _)| n == "ARCH").map_or(0, |(_, v)| *v);
    let templates = kernels.iter().map(|k| k.template.as_str()).collect::<Vec<_>>().join("_");
    let what = parts.iter().zip(&kernels).map(|(q, k)| format!("{} {:?}{}", k.name, q.grid, if q.tail { " tail" } else { "" })).collect::<Vec<_>>().join(" ");
    let name = format!("merged_arch{arch}_{templates}_{:016x}", fnv1a(&what));
    if let Some(&id) = by_name.get(&name) {
        return Ok(Some((id, args)));
    }
    let fail = |message: String| CompileError::Verifier { pass: "merge", message: format!("{name} ({}): {message}", kernels.iter().map(|k| k.name.as_str()).collect::<Vec<_>>().join(" + ")) };
    let merge_parts: Vec<MergePart> = parts.iter().zip(&kernels).map(|(q, k)| MergePart { ptx: &k.ptx, grid: q.grid, tail: q.tail }).collect();
    let ptx = merge_ptx(&merge_parts).map_err(fail)?;
    // the parts' static shared arrays add up; their dynamic shared memory is one region
    let module = kiln_runtime::emu::Module::parse(&ptx, &name).map_err(|e| fail(e.to_string()))?;
    let static_bytes = module.entries.first().map_or(0, |e| e.shared_static) as u64;
    if static_bytes.next_multiple_of(16) + a.smem_dynamic.max(b.smem_dynamic) as u64 > smem_limit as u64 {
        return Ok(None);
    }
    let id = KernelId(plan.kernels.len() as u32);
    plan.kernels.push(KernelInfo { name: name.clone(), family: KernelFamily::Merged, template: "merged".into(), entry: MERGED_ENTRY.into(), params: Vec::new(), ptx, resources: None, parts });
    by_name.insert(name, id);
    Ok(Some((id, args)))
}

/// FNV-1a (64 bit): a short, stable name for a pair of kernels and grids.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, c| (h ^ c as u64).wrapping_mul(0x0100_0000_01b3))
}
