//! Merges rendered kernels into one PTX entry whose blocks run one kernel's code each (horizontal
//! fusion): the merged launch's grid is the parts' blocks one after another, and a block finds
//! its part by its index, then the block index it has in that part's own grid. Each part's body
//! keeps its code: its parameters, labels and shared variables are renamed apart, its registers
//! live in a scope of their own, and `%ctaid` / `%nctaid` become its own block index and grid.
//! So a merged launch computes exactly what its parts' launches compute, one after the other,
//! where the parts touch no memory the other writes (the caller's check, `passes/merge.rs`).
//!
//! A part may instead be a tail of the part before it (chaining, for a dependent kernel of a few
//! blocks): the head's returns lead to an arrival point where each block, once all its threads
//! have stored, counts itself in at a u32 counter (`atom.inc` wrapping to zero, so replays find
//! it zeroed); the last block to arrive runs the tail's blocks one after another, a barrier
//! between them. Every store of the head is then visible to the tail (the split-K GEMMs' fence
//! and counter pattern), and the tail's non-coherent loads (`ld.global.nc`) become relaxed
//! loads at GPU scope, since they may read what the head wrote in the same launch. Returns
//! become branches, so a head or tail may not return some of a block's threads before a
//! barrier the others still wait at (the caller chains templates written that way).
//!
//! Why by hand: the templates are PTX text, one `.entry` each with the same simple layout
//! (module directives, `.extern .shared` arrays, the entry with its parameters and directives,
//! one body); no PTX library links two entries into one.

use kiln_runtime::plan::SplitKLayout;

/// The entry name of every merged kernel.
pub const MERGED_ENTRY: &str = "kiln_merged";

/// One kernel to merge: its rendered PTX and the grid its own launch had.
pub struct MergePart<'a> {
    pub ptx: &'a str,
    pub grid: [u32; 3],
    /// Runs after the part before it, on that part's last block to finish (see the module
    /// comment); its parameters are followed by one more, `.u64`: the address of the split-K
    /// region, whose u32 at [`SplitKLayout::CHAIN`] is its arrival counter (zeroed, and left
    /// zeroed by the launch).
    pub tail: bool,
}

/// What a template's PTX is made of.
struct Kernel {
    version: String,
    target: String,
    address_size: String,
    /// `.extern .shared` arrays: (alignment and element type, name).
    dynamic_shared: Vec<(String, String)>,
    /// Parameter declarations and their names.
    params: Vec<(String, String)>,
    /// `.maxntid x, 1, 1`: the block (one-dimensional).
    threads: u32,
    maxnreg: Option<u32>,
    minnctapersm: Option<u32>,
    /// `.shared` declarations of the body (hoisted to the merged entry's scope).
    shared: Vec<String>,
    shared_names: Vec<String>,
    labels: Vec<String>,
    body: String,
}

/// Opcodes that stand alone (no type suffix): no renamed name may be one of them.
const BARE_OPCODES: [&str; 6] = ["ret", "exit", "trap", "bra", "brkpt", "bar"];

fn strip_comments(ptx: &str) -> String {
    ptx.lines().map(|l| l.split_once("//").map_or(l, |(code, _)| code)).collect::<Vec<_>>().join("\n")
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == '$'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

fn parse(ptx: &str) -> Result<Kernel, String> {
    if !ptx.is_ascii() {
        return Err("PTX that is not ASCII".into());
    }
    let text = strip_comments(ptx);
    let entry_at = text.find(".visible .entry").ok_or("no `.visible .entry`")?;
    let (head, rest) = text.split_at(entry_at);
    let mut k = Kernel {
        version: String::new(),
        target: String::new(),
        address_size: String::new(),
        dynamic_shared: Vec::new(),
        params: Vec::new(),
        threads: 0,
        maxnreg: None,
        minnctapersm: None,
        shared: Vec::new(),
        shared_names: Vec::new(),
        labels: Vec::new(),
        body: String::new(),
    };
    for stmt in head.split(['\n', ';']).map(str::trim).filter(|s| !s.is_empty()) {
        let words: Vec<&str> = stmt.split_whitespace().collect();
        match words[0] {
            ".version" => k.version = words.get(1).ok_or("`.version` without a number")?.to_string(),
            ".target" => k.target = words[1..].join(" "),
            ".address_size" => k.address_size = words.get(1).ok_or("`.address_size` without a size")?.to_string(),
            ".extern" => match words.as_slice() {
                [".extern", ".shared", ".align", align, ty, name] if name.ends_with("[]") && ty.starts_with('.') => {
                    k.dynamic_shared.push((format!("{align} {ty}"), name.trim_end_matches("[]").to_string()));
                }
                _ => return Err(format!("unsupported module declaration `{stmt}`")),
            },
            _ => return Err(format!("unsupported module statement `{stmt}`")),
        }
    }
    let open = rest.find('(').ok_or("no parameter list")?;
    let close = rest.find(')').ok_or("unclosed parameter list")?;
    for decl in rest[open + 1..close].split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let last = decl.split_whitespace().last().ok_or("empty parameter")?;
        let name = last.split('[').next().unwrap_or(last).to_string();
        k.params.push((decl.to_string(), name));
    }
    let brace = rest[close..].find('{').ok_or("no kernel body")? + close;
    for directive in rest[close + 1..brace].split('\n').map(str::trim).filter(|d| !d.is_empty()) {
        let (word, value) = directive.split_once(char::is_whitespace).unwrap_or((directive, ""));
        let number = || value.trim().parse::<u32>().map_err(|_| format!("`{directive}`: not a number"));
        match word {
            ".maxntid" => {
                let dims: Vec<&str> = value.split(',').map(str::trim).collect();
                k.threads = match dims.as_slice() {
                    [x, "1", "1"] | [x, "1"] | [x] => x.parse().map_err(|_| format!("`{directive}`: not a number"))?,
                    _ => return Err(format!("`{directive}`: only one-dimensional blocks merge")),
                };
            }
            ".maxnreg" => k.maxnreg = Some(number()?),
            ".minnctapersm" => k.minnctapersm = Some(number()?),
            _ => return Err(format!("unsupported entry directive `{directive}`")),
        }
    }
    if k.threads == 0 || k.threads % 32 != 0 {
        return Err("no `.maxntid` of whole warps".into());
    }
    let end = rest.rfind('}').filter(|&e| e > brace).ok_or("unclosed kernel body")?;
    let mut body = String::new();
    for line in rest[brace + 1..end].lines() {
        let t = line.trim();
        if t.starts_with(".shared") {
            let name = t.trim_end_matches(';').split_whitespace().last().and_then(|w| w.split('[').next()).ok_or_else(|| format!("`{t}`: no name"))?;
            k.shared_names.push(name.to_string());
            k.shared.push(t.to_string());
            continue;
        }
        if let Some((label, after)) = t.split_once(':') {
            if !label.is_empty() && label.chars().next().is_some_and(is_ident_start) && label.chars().all(is_ident) && !after.starts_with(':') {
                k.labels.push(label.to_string());
            }
        }
        body.push_str(line);
        body.push('\n');
    }
    k.body = body;
    Ok(k)
}

/// `text` with every name of `renames` (an identifier that is not part of a longer one, a
/// register, a directive or a type suffix) replaced, and `specials` (`%ctaid.x` …) by their
/// values. String literals are left alone. `text` is ASCII (`parse` checks).
fn rename(text: &str, renames: &[(String, String)], specials: &[(&str, String)]) -> String {
    let b = text.as_bytes();
    let ident = |c: u8| is_ident(c as char);
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    let mut i = 0;
    let mut in_string = false;
    while i < b.len() {
        let c = b[i];
        if c == b'"' {
            in_string = !in_string;
        }
        if !in_string && c == b'%' {
            if let Some((from, to)) = specials.iter().find(|(from, _)| text[i..].starts_with(from) && !b.get(i + from.len()).copied().is_some_and(ident)) {
                out.push_str(to);
                i += from.len();
                continue;
            }
        }
        let prev = if i == 0 { b' ' } else { b[i - 1] };
        if !in_string && is_ident_start(c as char) && !ident(prev) && prev != b'.' && prev != b'%' {
            let start = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            let word = &text[start..i];
            match renames.iter().find(|(from, _)| from == word) {
                Some((_, to)) if b.get(i) != Some(&b'.') => out.push_str(to),
                _ => out.push_str(word),
            }
            continue;
        }
        out.push(c as char);
        i += 1;
    }
    out
}

/// One PTX module with entry [`MERGED_ENTRY`] that runs `parts` side by side: blocks
/// `[0, blocks(parts[0]))` run the first, the next `blocks(parts[1])` the second, and so on; a
/// tail part has no blocks of its own and runs after its head (see the module comment). The
/// parameters are the parts' in order (a tail's followed by its counter's address). The block is
/// the largest part's (one-dimensional): a part of fewer threads runs on its first warps, its
/// barriers counting only those.
pub fn merge_ptx(parts: &[MergePart]) -> Result<String, String> {
    if parts.len() < 2 {
        return Err("merging needs two kernels or more".into());
    }
    if parts[0].tail || parts.windows(2).any(|w| w[0].tail && w[1].tail) {
        return Err("a tail part follows a part with blocks of its own".into());
    }
    let kernels = parts.iter().enumerate().map(|(i, p)| parse(p.ptx).map_err(|e| format!("kernel {i}: {e}"))).collect::<Result<Vec<_>, _>>()?;
    let first = &kernels[0];
    for (i, k) in kernels.iter().enumerate().skip(1) {
        if (&k.version, &k.target, &k.address_size) != (&first.version, &first.target, &first.address_size) {
            return Err(format!("kernel {i} is PTX {} for {}, kernel 0 PTX {} for {}", k.version, k.target, first.version, first.target));
        }
        if parts[i].tail && k.threads != kernels[i - 1].threads {
            return Err(format!("tail kernel {i} has blocks of {} threads, its head {}", k.threads, kernels[i - 1].threads));
        }
    }
    // the merged block is the largest part's; a smaller part's surplus warps exit at once and
    // its barriers count its own threads
    let threads = kernels.iter().map(|k| k.threads).max().unwrap_or(0);
    if threads > 1024 {
        return Err(format!("blocks of {threads} threads"));
    }
    if kernels.iter().any(|k| k.body.contains("%kmerge") || k.body.contains("KMERGE_") || k.body.contains("kmerge_")) {
        return Err("a kernel already uses the merged kernel's names".into());
    }
    let mut ptx = format!(".version {}\n.target {}\n.address_size {}\n\n", first.version, first.target, first.address_size);
    let mut params = Vec::new();
    let mut shared = Vec::new();
    let mut bodies = Vec::new();
    // a head: a part whose next part is its tail
    let heads: Vec<bool> = (0..parts.len()).map(|i| parts.get(i + 1).is_some_and(|p| p.tail)).collect();
    for (i, (k, part)) in kernels.iter().zip(parts).enumerate() {
        let prefix = |n: &str| format!("m{i}_{n}");
        let mut renames: Vec<(String, String)> = Vec::new();
        for n in k.params.iter().map(|(_, n)| n).chain(&k.shared_names).chain(k.dynamic_shared.iter().map(|(_, n)| n)) {
            renames.push((n.clone(), prefix(n)));
        }
        for l in &k.labels {
            renames.push((l.clone(), format!("M{i}_{l}")));
        }
        if let Some((n, _)) = renames.iter().find(|(n, _)| BARE_OPCODES.contains(&n.as_str())) {
            return Err(format!("kernel {i} names something `{n}`, an opcode"));
        }
        for (align_type, name) in &k.dynamic_shared {
            ptx.push_str(&format!(".extern .shared .align {align_type} {}[];\n", prefix(name)));
        }
        for (decl, _) in &k.params {
            params.push(format!("    {}", rename(decl, &renames, &[])));
        }
        if part.tail {
            params.push(format!("    .param .u64 kmerge_counter{i}"));
        }
        for s in &k.shared {
            shared.push(format!("    {}", rename(s, &renames, &[])));
        }
        let [gx, gy, gz] = part.grid.map(|g| g.to_string());
        let specials = [
            ("%ctaid.x", "%kmerge_x".to_string()),
            ("%ctaid.y", "%kmerge_y".to_string()),
            ("%ctaid.z", "%kmerge_z".to_string()),
            ("%nctaid.x", gx),
            ("%nctaid.y", gy),
            ("%nctaid.z", gz),
        ];
        let mut body = rename(&k.body, &renames, &specials);
        // a head's returns lead to its arrival, a tail's to the end of its block's turn
        if heads[i] {
            body = returns_to(&body, &format!("KMERGE_ARRIVE{i}"))?;
        }
        if part.tail {
            body = returns_to(&coherent_loads(&body), &format!("KMERGE_TURN{i}"))?;
        }
        bodies.push(if k.threads < threads { counted_barriers(&body, k.threads)? } else { body });
    }
    ptx.push_str(&format!("\n.visible .entry {MERGED_ENTRY}(\n{}\n)\n", params.join(",\n")));
    ptx.push_str(&format!(".maxntid {threads}, 1, 1\n"));
    // a part's own cap, else the most a thread of such a block may have (64K registers per
    // block): left to itself ptxas caps the merged body lower than either part's and spills
    let fits = (65_536 / threads / 8 * 8).min(255);
    let maxnreg = kernels.iter().filter_map(|k| k.maxnreg).chain([fits]).min().unwrap_or(fits);
    ptx.push_str(&format!(".maxnreg {maxnreg}\n"));
    if let Some(n) = kernels.iter().filter_map(|k| k.minnctapersm).max() {
        ptx.push_str(&format!(".minnctapersm {n}\n"));
    }
    ptx.push_str("{\n    .reg .b32 %kmerge_b;\n    .reg .b32 %kmerge_x;\n    .reg .b32 %kmerge_y;\n    .reg .b32 %kmerge_z;\n    .reg .b32 %kmerge_t;\n    .reg .pred %kmerge_p;\n");
    if parts.iter().any(|p| p.tail) {
        ptx.push_str("    .reg .b32 %kmerge_i;\n    .reg .b64 %kmerge_c;\n    .shared .align 4 .u32 kmerge_last;\n");
    }
    for s in &shared {
        ptx.push_str(s);
        ptx.push('\n');
    }
    ptx.push_str("    mov.u32 %kmerge_b, %ctaid.x;\n");
    // the side-by-side parts (with blocks of their own) in block order, each with its tail
    let sides: Vec<usize> = (0..parts.len()).filter(|&i| !parts[i].tail).collect();
    for (n, &i) in sides.iter().enumerate() {
        let (part, k) = (&parts[i], &kernels[i]);
        let blocks = part.grid.iter().product::<u32>();
        if n > 0 {
            let before = &parts[sides[n - 1]];
            ptx.push_str(&format!("KMERGE_{i}:\n    sub.u32 %kmerge_b, %kmerge_b, {};\n", before.grid.iter().product::<u32>()));
        }
        if let Some(&next) = sides.get(n + 1) {
            ptx.push_str(&format!("    setp.ge.u32 %kmerge_p, %kmerge_b, {blocks};\n    @%kmerge_p bra KMERGE_{next};\n"));
        }
        ptx.push_str(&block_index(part.grid, "%kmerge_b"));
        let bar = if k.threads < threads { format!("bar.sync 0, {}", k.threads) } else { "bar.sync 0".to_string() };
        if k.threads < threads {
            ptx.push_str(&format!("    mov.u32 %kmerge_t, %tid.x;\n    setp.ge.u32 %kmerge_p, %kmerge_t, {};\n    @%kmerge_p ret;\n", k.threads));
        }
        ptx.push_str("    {\n");
        ptx.push_str(&bodies[i]);
        ptx.push_str("    }\n");
        if heads[i] {
            let t = i + 1;
            let tail = &parts[t];
            // every thread's stores before the block's arrival; the last block of the head's
            // grid to arrive runs the tail's blocks
            ptx.push_str(&format!(
                "KMERGE_ARRIVE{i}:\n    fence.acq_rel.gpu;\n    {bar};\n    mov.u32 %kmerge_t, %tid.x;\n    setp.eq.u32 %kmerge_p, %kmerge_t, 0;\n    ld.param.u64 %kmerge_c, [kmerge_counter{t}];\n    add.s64 %kmerge_c, %kmerge_c, {};\n    @%kmerge_p atom.acq_rel.gpu.global.inc.u32 %kmerge_t, [%kmerge_c], {};\n    @%kmerge_p st.shared.u32 [kmerge_last], %kmerge_t;\n    {bar};\n    ld.shared.u32 %kmerge_t, [kmerge_last];\n    setp.ne.u32 %kmerge_p, %kmerge_t, {};\n    @%kmerge_p ret;\n    fence.acq_rel.gpu;\n    mov.u32 %kmerge_i, 0;\nKMERGE_LOOP{t}:\n",
                SplitKLayout::CHAIN,
                blocks - 1,
                blocks - 1
            ));
            ptx.push_str(&block_index(tail.grid, "%kmerge_i"));
            ptx.push_str("    {\n");
            ptx.push_str(&bodies[t]);
            ptx.push_str(&format!(
                "    }}\nKMERGE_TURN{t}:\n    {bar};\n    add.u32 %kmerge_i, %kmerge_i, 1;\n    setp.lt.u32 %kmerge_p, %kmerge_i, {};\n    @%kmerge_p bra KMERGE_LOOP{t};\n",
                tail.grid.iter().product::<u32>()
            ));
        }
        ptx.push_str("    ret;\n");
    }
    ptx.push_str("}\n");
    Ok(ptx)
}

/// The instructions that set `%kmerge_x/y/z` to the block index `index` (a register) has in a
/// grid of `grid`: x fastest, as the hardware numbers a grid's blocks.
fn block_index(grid: [u32; 3], index: &str) -> String {
    let [gx, gy, _] = grid;
    format!("    rem.u32 %kmerge_x, {index}, {gx};\n    div.u32 %kmerge_y, {index}, {gx};\n    div.u32 %kmerge_z, %kmerge_y, {gy};\n    rem.u32 %kmerge_y, %kmerge_y, {gy};\n")
}

/// `body` with every return (`ret`, predicated or not) a branch to `label`; `exit` is refused.
fn returns_to(body: &str, label: &str) -> Result<String, String> {
    let mut out = String::with_capacity(body.len());
    for line in body.lines() {
        let code = line.trim_start();
        let (guard, inst) = match code.strip_prefix('@') {
            Some(rest) => rest.split_once(char::is_whitespace).map_or((code, ""), |(g, r)| (&code[..g.len() + 1], r.trim_start())),
            None => ("", code),
        };
        let op = inst.split(|c: char| c.is_whitespace() || c == ';').next().unwrap_or("");
        if op == "exit" {
            return Err("`exit` in a chained kernel".into());
        }
        if op == "ret" || op == "ret.uni" {
            // a predicated branch may diverge: `.uni` only where every thread takes it
            out.push_str(&if guard.is_empty() { format!("    bra.uni {label};\n") } else { format!("    {guard} bra {label};\n") });
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

/// `body` with its non-coherent global loads made relaxed loads at GPU scope: a tail may read
/// what its head stored in the same launch, which the non-coherent path need not see.
fn coherent_loads(body: &str) -> String {
    body.replace("ld.global.nc.", "ld.relaxed.gpu.global.")
}

/// `body` with every barrier that waits for the whole block (`bar.sync n;`) made to wait for
/// the first `threads` threads only (`bar.sync n, threads;`): a part of fewer threads than the
/// merged block, whose surplus warps have exited.
fn counted_barriers(body: &str, threads: u32) -> Result<String, String> {
    let mut out = String::with_capacity(body.len());
    for line in body.lines() {
        let code = line.trim_start();
        let inst = if code.starts_with('@') { code.split_once(char::is_whitespace).map_or("", |(_, r)| r.trim_start()) } else { code };
        let op = inst.split_whitespace().next().unwrap_or("");
        let barrier = op.starts_with("bar.") || op.starts_with("barrier.");
        if barrier && !op.starts_with("bar.warp") {
            if !op.ends_with(".sync") {
                return Err(format!("`{}`: only whole-block barriers (`bar.sync`) in a smaller part", code.trim()));
            }
            let (head, _) = line.rsplit_once(';').ok_or_else(|| format!("`{}`: no `;`", code.trim()))?;
            if head.contains(',') {
                out.push_str(line);
            } else {
                out.push_str(&format!("{head}, {threads};"));
            }
            out.push('\n');
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = ".version 8.7\n.target sm_120a\n.address_size 64\n\n.extern .shared .align 16 .b8 gsm[];\n\n.visible .entry kiln_a(\n    .param .u64 x,\n    .param .u32 n\n)\n.maxntid 64, 1, 1\n.maxnreg 128\n{\n    .reg .b32 %r<4>;\n    .shared .align 4 .f32 acc[8];\n    // x is the input\n    ld.param.u64 %rd1, [x];\n    mov.u32 %r1, %ctaid.y;\n    mov.u32 %r2, %nctaid.x;\nLOOP:\n    bra.uni LOOP;\n    mov.u32 %r3, acc;\n    ret;\n}\n";

    #[test]
    fn parts_are_renamed_apart_and_find_their_own_block_index() {
        let ptx = merge_ptx(&[MergePart { ptx: A, grid: [3, 2, 1], tail: false }, MergePart { ptx: A, grid: [5, 1, 1], tail: false }]).unwrap();
        // parameters, labels and shared arrays of each part under their own names
        for name in ["m0_x", "m1_x", "m0_n", "m1_n", "M0_LOOP:", "M1_LOOP:", "m0_acc[8]", "m1_acc[8]", "m0_gsm[]", "m1_gsm[]", "[m1_x]", "bra.uni M1_LOOP", "%r3, m1_acc"] {
            assert!(ptx.contains(name), "{name} missing in\n{ptx}");
        }
        // the grid's size and block index are the part's: 3 x 2 blocks, then 5
        assert!(ptx.contains("%r2, 3;") && ptx.contains("%r2, 5;"), "{ptx}");
        assert!(ptx.contains("setp.ge.u32 %kmerge_p, %kmerge_b, 6;") && ptx.contains("sub.u32 %kmerge_b, %kmerge_b, 6;"), "{ptx}");
        assert!(!ptx.contains("%ctaid.y") && ptx.matches("%ctaid.x").count() == 1, "{ptx}");
        // opcodes and their suffixes are not names: `ld.param` stays
        assert!(ptx.contains("ld.param.u64") && !ptx.contains("m0_ld"), "{ptx}");
        assert!(ptx.contains(".maxntid 64, 1, 1") && ptx.contains(".maxnreg 128"));
    }

    #[test]
    fn a_part_of_fewer_threads_exits_its_surplus_warps_and_counts_its_barriers() {
        let small = A.replace("    ret;\n}", "    bar.sync 0;\n    @%p1 bar.sync 1;\n    bar.sync 2, 32;\n    bar.warp.sync 0xffffffff;\n    ret;\n}");
        let big = A.replace(".maxntid 64", ".maxntid 1024").replace(".maxnreg 128\n", "");
        let ptx = merge_ptx(&[MergePart { ptx: &small, grid: [2, 1, 1], tail: false }, MergePart { ptx: &big, grid: [1, 1, 1], tail: false }]).unwrap();
        assert!(ptx.contains(".maxntid 1024, 1, 1") && ptx.contains(".maxnreg 64"), "{ptx}");
        assert!(ptx.contains("setp.ge.u32 %kmerge_p, %kmerge_t, 64;\n    @%kmerge_p ret;"), "{ptx}");
        assert!(ptx.contains("bar.sync 0, 64;") && ptx.contains("@%p1 bar.sync 1, 64;") && ptx.contains("bar.sync 2, 32;") && ptx.contains("bar.warp.sync 0xffffffff;"), "{ptx}");
        // the 1,024-thread part keeps its own barriers
        assert_eq!(ptx.matches("bar.sync 0, 64;").count(), 1, "{ptx}");
        let arrive = A.replace("    ret;\n}", "    bar.arrive 1, 64;\n    ret;\n}");
        assert!(merge_ptx(&[MergePart { ptx: &arrive, grid: [1, 1, 1], tail: false }, MergePart { ptx: &big, grid: [1, 1, 1], tail: false }]).is_err());
    }

    #[test]
    fn a_tail_runs_on_its_heads_last_block_after_every_block_arrived() {
        let head = A.replace("    ret;\n}", "    @%p1 ret;\n    ret;\n}");
        let tail = A.replace("ld.param.u64 %rd1, [x];", "ld.param.u64 %rd1, [x];\n    ld.global.nc.f32 %f1, [%rd1];\n    ld.global.nc.v2.f32 {%f2, %f3}, [%rd1];");
        let side = A.replace(".maxntid 64", ".maxntid 128");
        let parts = [MergePart { ptx: &head, grid: [3, 2, 1], tail: false }, MergePart { ptx: &tail, grid: [4, 1, 1], tail: true }, MergePart { ptx: &side, grid: [5, 1, 1], tail: false }];
        let ptx = merge_ptx(&parts).unwrap();
        // the tail's parameters are followed by its counter's; it has no blocks of its own: the
        // side part starts after the head's 6
        assert!(ptx.contains("    .param .u64 m1_x,\n    .param .u32 m1_n,\n    .param .u64 kmerge_counter1,\n    .param .u64 m2_x"), "{ptx}");
        assert!(ptx.contains("setp.ge.u32 %kmerge_p, %kmerge_b, 6;\n    @%kmerge_p bra KMERGE_2;") && ptx.contains("KMERGE_2:\n    sub.u32 %kmerge_b, %kmerge_b, 6;"), "{ptx}");
        // the head's returns reach its arrival (a predicated one without `.uni`); each block
        // counts itself in, wrapping at the head's 6 blocks, and only the last goes on
        assert!(ptx.contains("@%p1 bra KMERGE_ARRIVE0;") && ptx.contains("bra.uni KMERGE_ARRIVE0;"), "{ptx}");
        let counter = format!("ld.param.u64 %kmerge_c, [kmerge_counter1];\n    add.s64 %kmerge_c, %kmerge_c, {};", SplitKLayout::CHAIN);
        assert!(ptx.contains(&counter) && ptx.contains("atom.acq_rel.gpu.global.inc.u32 %kmerge_t, [%kmerge_c], 5;") && ptx.contains("setp.ne.u32 %kmerge_p, %kmerge_t, 5;\n    @%kmerge_p ret;"), "{ptx}");
        // the tail's 4 blocks one after another, its block index from the loop, its returns
        // the end of a turn, its barriers those of the head's 64 threads (the merged block is 128)
        assert!(ptx.contains("rem.u32 %kmerge_x, %kmerge_i, 4;") && ptx.contains("setp.lt.u32 %kmerge_p, %kmerge_i, 4;\n    @%kmerge_p bra KMERGE_LOOP1;"), "{ptx}");
        assert!(ptx.contains("bra.uni KMERGE_TURN1;") && ptx.contains("KMERGE_TURN1:\n    bar.sync 0, 64;") && ptx.contains("KMERGE_ARRIVE0:\n    fence.acq_rel.gpu;\n    bar.sync 0, 64;"), "{ptx}");
        // the tail reads what the head stored in this launch: no non-coherent loads
        assert!(!ptx.contains("ld.global.nc") && ptx.contains("ld.relaxed.gpu.global.f32 %f1") && ptx.contains("ld.relaxed.gpu.global.v2.f32"), "{ptx}");
        // a tail first, two tails in a row, a tail of another block size, an `exit`: refused
        let t = |ptx: &'static str, tail| MergePart { ptx, grid: [1, 1, 1], tail };
        assert!(merge_ptx(&[t(A, true), t(A, false)]).is_err());
        assert!(merge_ptx(&[t(A, false), t(A, true), t(A, true)]).is_err());
        let wide: &'static str = Box::leak(side.into_boxed_str());
        assert!(merge_ptx(&[t(A, false), t(wide, true)]).unwrap_err().contains("threads"));
        let exits: &'static str = Box::leak(A.replace("    ret;\n}", "    exit;\n}").into_boxed_str());
        assert!(merge_ptx(&[t(A, false), t(exits, true)]).unwrap_err().contains("exit"));
    }

    #[test]
    fn parts_of_other_targets_are_refused() {
        let b = A.replace(".maxntid 64, 1, 1", ".maxntid 64, 2, 1");
        assert!(merge_ptx(&[MergePart { ptx: A, grid: [1, 1, 1], tail: false }, MergePart { ptx: &b, grid: [1, 1, 1], tail: false }]).unwrap_err().contains("one-dimensional"));
        let c = A.replace("sm_120a", "sm_90a");
        assert!(merge_ptx(&[MergePart { ptx: A, grid: [1, 1, 1], tail: false }, MergePart { ptx: &c, grid: [1, 1, 1], tail: false }]).is_err());
        assert!(merge_ptx(&[MergePart { ptx: A, grid: [1, 1, 1], tail: false }]).is_err());
    }
}
