//! The engine-level API over a backend: load an artifact and bind its weights, hand out KV pages
//! to sequences, prefill prompts (in chunks when longer than the largest prefill bucket) and
//! decode batches of sequences one token at a time.

use crate::bind::bind;
use crate::cpu::{CpuBackend, CpuOptions, Inputs};
use crate::cuda::CudaBackend;
use crate::emu_backend::EmuBackend;
use crate::error::RuntimeError;
use crate::plan::{read_artifact, Plan, PrefillPiece, ProgramKind};
use crate::weight_check;
use std::path::{Path, PathBuf};

/// The artifact's manifest, which records the checkpoint it was compiled from.
pub const MANIFEST_FILE: &str = "manifest.json";

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionOptions {
    pub cpu: CpuOptions,
    /// Show a progress bar while binding weights (only drawn on a terminal).
    pub progress: bool,
    pub backend: BackendKind,
    /// Before binding, scan every weight for NaN/Inf and check the hashes the artifact records
    /// (`--check-weights`; reads the whole checkpoint once).
    pub check_weights: bool,
    /// Run a prefill's short pieces as decode steps of the sequence's next tokens where the
    /// plan's predicted steps say that is faster per token ([`Plan::prefill_piece_by_decode`]).
    /// None: on the CUDA backend only, where speed is the point; the CPU and emulator backends
    /// check the plan's prefill programs as compiled.
    pub prefill_by_decode: Option<bool>,
}

/// Which backend executes the plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU reference backend (executes the ops).
    #[default]
    Cpu,
    /// The PTX emulator (executes the plan's kernels; needs a GPU-target plan).
    Emu,
    /// The GPUs, through the CUDA driver (programs replayed as CUDA graphs).
    Cuda,
}

/// The backend a [`Runner`] drives.
pub enum Backend {
    Cpu(CpuBackend),
    Emu(EmuBackend),
    Cuda(CudaBackend),
}

impl Backend {
    pub fn plan(&self) -> &Plan {
        match self {
            Backend::Cpu(b) => b.plan(),
            Backend::Emu(b) => b.plan(),
            Backend::Cuda(b) => b.plan(),
        }
    }

    /// Why the backend can run nothing any more (a GPU fault), if that happened.
    pub fn failure(&self) -> Option<&str> {
        match self {
            Backend::Cuda(b) => b.failure(),
            _ => None,
        }
    }

    fn run(&mut self, index: usize, inputs: &Inputs) -> Result<&[f32], RuntimeError> {
        match self {
            Backend::Cpu(b) => b.run(index, inputs),
            Backend::Emu(b) => b.run(index, inputs),
            Backend::Cuda(b) => b.run(index, inputs),
        }
    }
}

/// A sequence handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(u32);

/// Which rows of a prefill return logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// One row per prompt token.
    All,
    /// Only the last prompt token (what generation needs).
    Last,
}

struct Sequence {
    /// KV pages in order: position p lives in `pages[p / page_size]`.
    pages: Vec<u32>,
    /// Tokens in the cache.
    len: usize,
}

/// The weights directory: `--weights`, else the checkpoint recorded in the artifact's manifest.
pub fn weights_dir(artifact: &Path, weights: Option<&Path>) -> Result<PathBuf, RuntimeError> {
    if let Some(w) = weights {
        return Ok(w.to_path_buf());
    }
    let path = artifact.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| RuntimeError::Manifest {
        path: path.clone(),
        message: format!("{e}; pass the checkpoint directory with --weights"),
    })?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| RuntimeError::Manifest { path: path.clone(), message: format!("malformed JSON: {e}") })?;
    let dir = json.get("checkpoint_dir").and_then(|d| d.as_str()).ok_or_else(|| RuntimeError::Manifest {
        path: path.clone(),
        message: "no `checkpoint_dir`; pass the checkpoint directory with --weights".into(),
    })?;
    let dir = PathBuf::from(dir);
    if !dir.is_dir() {
        return Err(RuntimeError::Manifest {
            path,
            message: format!(
                "the checkpoint the artifact was compiled from, {}, no longer exists; pass it with --weights",
                dir.display()
            ),
        });
    }
    Ok(dir)
}

/// Runs prefill chunks and decode batches for sequences whose KV pages the caller owns: the
/// layer the serving engine's scheduler drives and [`Session`] builds on.
pub struct Runner {
    backend: Backend,
    inputs: Inputs,
    out: Vec<f32>,
    /// Index of the program that ran last.
    last: Option<usize>,
    /// Predicted step of a program (by index) at a context, once asked for.
    step_costs: std::collections::HashMap<(usize, usize), Option<f64>>,
    /// [`SessionOptions::prefill_by_decode`], resolved for the backend.
    prefill_by_decode: bool,
    /// The final normed hidden rows of every token of the last call (plans with a draft model,
    /// CPU backend): what [`Runner::draft`] continues from.
    hidden: Vec<f32>,
}

/// One sequence of a decode batch: its pages (in position order), the position of `token`
/// (= tokens already cached) and the token.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    pub pages: &'a [u32],
    pub pos: usize,
    pub token: u32,
}

impl Runner {
    pub fn open(artifact: &Path, weights: Option<&Path>, opts: SessionOptions) -> Result<Runner, RuntimeError> {
        Runner::open_plan(read_artifact(artifact)?, artifact, weights, opts)
    }

    /// [`Runner::open`] for a plan the caller already read from `artifact` with
    /// [`read_artifact`] (the artifact still holds the kernels' cubins).
    pub fn open_plan(plan: Plan, artifact: &Path, weights: Option<&Path>, opts: SessionOptions) -> Result<Runner, RuntimeError> {
        let dir = weights_dir(artifact, weights)?;
        Runner::load(plan, Some(artifact), &dir, opts)
    }

    pub fn from_plan(plan: Plan, weights: &Path, opts: SessionOptions) -> Result<Runner, RuntimeError> {
        Runner::load(plan, None, weights, opts)
    }

    /// `artifact`, when known, holds the kernels' cubins (the CUDA backend loads them).
    fn load(plan: Plan, artifact: Option<&Path>, weights: &Path, opts: SessionOptions) -> Result<Runner, RuntimeError> {
        if opts.check_weights {
            weight_check::scan_checkpoint(&plan, artifact, weights, opts.progress)?.into_result()?;
        }
        let prefill_by_decode = opts.prefill_by_decode.unwrap_or(opts.backend == BackendKind::Cuda);
        let backend = match opts.backend {
            // Uploads from the mapped checkpoint itself: no host copy of the weights.
            BackendKind::Cuda => Backend::Cuda(CudaBackend::new(plan, artifact, weights, opts.progress)?),
            BackendKind::Cpu => {
                let arenas = bind(&plan, weights, opts.progress)?;
                Backend::Cpu(CpuBackend::new(plan, arenas, opts.cpu)?)
            }
            BackendKind::Emu => {
                let arenas = bind(&plan, weights, opts.progress)?;
                Backend::Emu(EmuBackend::new(plan, arenas)?)
            }
        };
        Ok(Runner { backend, inputs: Inputs::default(), out: Vec::new(), last: None, step_costs: Default::default(), prefill_by_decode, hidden: Vec::new() })
    }

    pub fn plan(&self) -> &Plan {
        self.backend.plan()
    }

    /// The name of the program that ran last.
    pub fn last_program(&self) -> Option<&str> {
        self.last.map(|i| self.plan().programs[i].name.as_str())
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The CPU backend, when that is what runs the plan.
    pub fn cpu(&self) -> Option<&CpuBackend> {
        match &self.backend {
            Backend::Cpu(b) => Some(b),
            _ => None,
        }
    }

    pub fn cpu_mut(&mut self) -> Option<&mut CpuBackend> {
        match &mut self.backend {
            Backend::Cpu(b) => Some(b),
            _ => None,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.plan().model.vocab_size
    }

    pub fn page_size(&self) -> usize {
        self.plan().memory.kv.page_size.max(1)
    }

    pub fn total_pages(&self) -> usize {
        self.plan().memory.kv.pages
    }

    /// The longest sequence this plan serves.
    pub fn max_context(&self) -> usize {
        let p = self.plan();
        let kv = &p.memory.kv;
        kv.max_context.min(kv.pages_per_seq * kv.page_size).min(p.model.max_position_embeddings)
    }

    /// Largest decode batch of the plan (0 if it has none).
    pub fn max_decode_batch(&self) -> usize {
        self.plan().max_decode_batch().unwrap_or(0)
    }

    /// Largest prefill chunk of the plan (0 if it has none).
    pub fn max_prefill_chunk(&self) -> usize {
        self.plan().programs.iter().filter_map(|p| match p.kind {
            ProgramKind::Prefill { .. } => Some(p.tokens),
            _ => None,
        }).max().unwrap_or(0)
    }

    /// Predicted time of a decode step of `rows` rows, µs (the performance model's, for the
    /// decode program that runs them, at [`crate::perf::COST_CONTEXT`]): what speculative
    /// decoding weighs its drafts against. None for a CPU plan, which the model does not time,
    /// or more rows than the largest decode batch.
    pub fn predicted_decode_us(&mut self, rows: usize) -> Option<f64> {
        let index = self.plan().decode_program(rows)?;
        self.predicted_step_us(index, crate::perf::COST_CONTEXT)
    }

    /// The performance model's step of program `index` at `context`, µs, computed once each.
    fn predicted_step_us(&mut self, index: usize, context: usize) -> Option<f64> {
        let Runner { backend, step_costs, .. } = self;
        cached_step_us(step_costs, backend.plan(), index, context)
    }

    /// [`Plan::next_prefill_piece`] with the performance model's predicted steps (decode pieces
    /// only where [`SessionOptions::prefill_by_decode`] allows them).
    fn next_prefill_piece(&mut self, remaining: usize, first_position: usize) -> Option<PrefillPiece> {
        let Runner { backend, step_costs, prefill_by_decode, .. } = self;
        let plan = backend.plan();
        plan.next_prefill_piece(remaining, first_position, *prefill_by_decode, |index, context| cached_step_us(step_costs, plan, index, context))
    }

    pub fn check_ids(&self, ids: &[u32]) -> Result<(), RuntimeError> {
        let vocab = self.vocab_size();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(RuntimeError::input("token ids", format!("id {id} (at index {i}) is outside the vocabulary of {vocab} tokens")));
        }
        Ok(())
    }

    /// Checks that `pages` hold positions `0..len` and `len` fits the plan.
    fn check_pages(&self, pages: &[u32], len: usize) -> Result<(), RuntimeError> {
        let max = self.max_context();
        if len > max {
            return Err(RuntimeError::input(
                "token ids",
                format!("the sequence would be {len} tokens long; this plan serves at most {max} (compile with a larger --max-context)"),
            ));
        }
        let need = len.div_ceil(self.page_size());
        if pages.len() < need {
            return Err(RuntimeError::input("page table", format!("{len} tokens need {need} pages, the sequence has {}", pages.len())));
        }
        if let Some(p) = pages.iter().find(|&&p| p as usize >= self.total_pages()) {
            return Err(RuntimeError::input("page table", format!("page {p} does not exist; the cache has {} pages", self.total_pages())));
        }
        Ok(())
    }

    /// Appends `ids` at positions `start..` of the sequence that owns `pages` through the
    /// prefill programs (in chunks; or, where the plan's predicted steps say that is faster per
    /// token, as decode steps of the sequence's next tokens); returns the logits of `rows`.
    pub fn prefill(&mut self, pages: &[u32], start: usize, ids: &[u32], rows: LogitRows) -> Result<&[f32], RuntimeError> {
        if ids.is_empty() {
            return Err(RuntimeError::input("token ids", "no tokens to prefill"));
        }
        self.check_ids(ids)?;
        self.check_pages(pages, start + ids.len())?;
        let (vocab, page_size) = (self.vocab_size(), self.page_size());
        self.out.clear();
        self.hidden.clear();
        let mut done = 0;
        while done < ids.len() {
            let remaining = ids.len() - done;
            let next = self.next_prefill_piece(remaining, start + done).ok_or_else(|| RuntimeError::Unsupported { message: "the plan has no prefill program".into() })?;
            let (index, mut m) = match next {
                PrefillPiece::Prefill { program, tokens } => (program, tokens),
                PrefillPiece::Decode { rows: piece, .. } => {
                    let batch: Vec<DecodeRow> = (done..done + piece).map(|i| DecodeRow { pages, pos: start + i, token: ids[i] }).collect();
                    let mut out = std::mem::take(&mut self.out);
                    let hidden = std::mem::take(&mut self.hidden);
                    let logits = self.decode(&batch)?;
                    match rows {
                        LogitRows::All => out.extend_from_slice(logits),
                        LogitRows::Last if done + piece == ids.len() => out.extend_from_slice(&logits[logits.len() - vocab..]),
                        LogitRows::Last => {}
                    }
                    self.out = out;
                    self.hidden = [hidden, std::mem::take(&mut self.hidden)].concat();
                    done += piece;
                    continue;
                }
            };
            let logit_rows = self.plan().programs[index].logit_rows;
            if rows == LogitRows::All {
                m = m.min(logit_rows);
            }
            if m == 0 {
                return Err(RuntimeError::Unsupported { message: "the plan's prefill programs return no logit rows".into() });
            }
            let last = done + m == ids.len();
            let inputs = &mut self.inputs;
            let program = &self.backend.plan().programs[index];
            inputs.reset(program);
            if pages.len() > inputs.page_table.len() {
                return Err(RuntimeError::input("page table", format!("{} pages, a sequence holds at most {}", pages.len(), inputs.page_table.len())));
            }
            for i in 0..m {
                let pos = start + done + i;
                inputs.ids[i] = ids[done + i] as i32;
                inputs.positions[i] = pos as i32;
                inputs.token_seq[i] = 0;
                inputs.slots[i] = (pages[pos / page_size] as usize * page_size + pos % page_size) as i32;
            }
            inputs.page_table.iter_mut().zip(pages).for_each(|(d, &p)| *d = p as i32);
            match rows {
                LogitRows::All => inputs.logit_rows[..m].iter_mut().enumerate().for_each(|(i, r)| *r = i as i32),
                LogitRows::Last if last => inputs.logit_rows[0] = m as i32 - 1,
                LogitRows::Last => {}
            }
            self.last = Some(index);
            let logits = self.backend.run(index, &self.inputs)?;
            match rows {
                LogitRows::All => self.out.extend_from_slice(&logits[..m * vocab]),
                LogitRows::Last if last => self.out.extend_from_slice(&logits[..vocab]),
                LogitRows::Last => {}
            }
            self.keep_hidden(m);
            done += m;
        }
        Ok(&self.out)
    }

    /// One token for each row; returns `[rows.len(), vocab]`. Rows may be consecutive tokens of
    /// one sequence (speculative decoding checks drafts so): every row's KV is written before any
    /// row attends, and each row attends only to positions up to its own.
    pub fn decode(&mut self, batch: &[DecodeRow<'_>]) -> Result<&[f32], RuntimeError> {
        self.decode_rows(batch, None)
    }

    /// One step of the draft model (`kiln compile --draft mtp`): row i's `token` is the token at
    /// `pos + 1` and `hidden[i]` (`[rows, hidden_size]`) the hidden state at `pos` (the model's,
    /// from [`Runner::hidden`] after the call that computed `pos`, or the draft's own from its
    /// previous step); the row writes the draft layer's KV at `pos` and returns the draft's
    /// logits for the token at `pos + 2`, `[rows, vocab]`. Rows may be consecutive positions of
    /// one sequence, as in [`Runner::decode`].
    pub fn draft(&mut self, batch: &[DecodeRow<'_>], hidden: &[f32]) -> Result<&[f32], RuntimeError> {
        let h = self.plan().model.hidden_size;
        if hidden.len() != batch.len() * h {
            return Err(RuntimeError::input("draft hidden rows", format!("{} values for {} rows of {h}", hidden.len(), batch.len())));
        }
        if !self.plan().has_draft() {
            return Err(RuntimeError::Unsupported { message: "the plan has no draft model (compile with --draft mtp)".into() });
        }
        self.decode_rows(batch, Some(hidden))
    }

    /// The final normed hidden state of every token of the last prefill, decode or draft call,
    /// `[tokens, hidden_size]` (a draft call's: the draft's own, after `shared_head.norm`), in
    /// plans with a draft model; None elsewhere.
    pub fn hidden(&self) -> Option<&[f32]> {
        self.plan().has_draft().then_some(&self.hidden[..])
    }

    /// Appends the first `rows` hidden rows the last replay left (see [`Runner::hidden`]).
    fn keep_hidden(&mut self, rows: usize) {
        let h = self.plan().model.hidden_size;
        let out = match &self.backend {
            Backend::Cpu(b) => b.hidden_out(),
            Backend::Emu(b) => b.hidden_out(),
            Backend::Cuda(b) => b.hidden_out(),
        };
        if let Some(out) = out {
            self.hidden.extend_from_slice(&out[..rows * h]);
        }
    }

    fn decode_rows(&mut self, batch: &[DecodeRow<'_>], hidden: Option<&[f32]>) -> Result<&[f32], RuntimeError> {
        if batch.is_empty() {
            return Err(RuntimeError::input("decode batch", "no sequences"));
        }
        for r in batch {
            self.check_ids(std::slice::from_ref(&r.token))?;
            self.check_pages(r.pages, r.pos + 1)?;
        }
        let (vocab, page_size) = (self.vocab_size(), self.page_size());
        let largest = self.max_decode_batch();
        if largest == 0 {
            return Err(RuntimeError::Unsupported { message: "the plan has no decode program".into() });
        }
        self.out.clear();
        self.hidden.clear();
        let h = self.plan().model.hidden_size;
        for (g, group) in batch.chunks(largest).enumerate() {
            let index = match hidden {
                Some(_) => self.plan().draft_program(group.len()),
                None => self.plan().decode_program(group.len()),
            }
            .ok_or_else(|| RuntimeError::internal("no decode program holds the largest decode batch"))?;
            let inputs = &mut self.inputs;
            let program = &self.backend.plan().programs[index];
            let pages_per_seq = program.buffer(program.inputs.page_table).shape.get(1).copied().unwrap_or(0);
            inputs.reset(program);
            for (row, r) in group.iter().enumerate() {
                if r.pages.len() > pages_per_seq {
                    return Err(RuntimeError::input("page table", format!("{} pages, a sequence holds at most {pages_per_seq}", r.pages.len())));
                }
                inputs.ids[row] = r.token as i32;
                inputs.positions[row] = r.pos as i32;
                inputs.token_seq[row] = row as i32;
                inputs.slots[row] = (r.pages[r.pos / page_size] as usize * page_size + r.pos % page_size) as i32;
                for (d, &p) in inputs.page_table[row * pages_per_seq..].iter_mut().zip(r.pages) {
                    *d = p as i32;
                }
                inputs.logit_rows[row] = row as i32;
            }
            if let Some(rows) = hidden {
                let first = g * largest * h;
                inputs.hidden[..group.len() * h].copy_from_slice(&rows[first..first + group.len() * h]);
            }
            self.last = Some(index);
            let logits = self.backend.run(index, &self.inputs)?;
            self.out.extend_from_slice(&logits[..group.len() * vocab]);
            self.keep_hidden(group.len());
        }
        Ok(&self.out)
    }
}

/// [`crate::perf::program_step_us`], computed once per program and context.
fn cached_step_us(costs: &mut std::collections::HashMap<(usize, usize), Option<f64>>, plan: &Plan, index: usize, context: usize) -> Option<f64> {
    *costs.entry((index, context)).or_insert_with(|| crate::perf::program_step_us(plan, index, context))
}

/// A [`Runner`] that also owns the KV pages: sequences are created, fed and released by id.
pub struct Session {
    runner: Runner,
    /// Free KV pages (low ids handed out first).
    free: Vec<u32>,
    seqs: Vec<Option<Sequence>>,
}

impl Session {
    /// Loads `artifact/plan.bin` and binds the weights (`weights`, else the manifest's checkpoint).
    pub fn open(artifact: &Path, weights: Option<&Path>, opts: SessionOptions) -> Result<Session, RuntimeError> {
        Ok(Session::new(Runner::open(artifact, weights, opts)?))
    }

    pub fn from_plan(plan: Plan, weights: &Path, opts: SessionOptions) -> Result<Session, RuntimeError> {
        Ok(Session::new(Runner::from_plan(plan, weights, opts)?))
    }

    pub fn new(runner: Runner) -> Session {
        let free = (0..runner.total_pages() as u32).rev().collect();
        Session { runner, free, seqs: Vec::new() }
    }

    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    pub fn plan(&self) -> &Plan {
        self.runner.plan()
    }

    pub fn backend(&self) -> &Backend {
        self.runner.backend()
    }

    /// The CPU backend, when that is what runs the plan.
    pub fn cpu(&self) -> Option<&CpuBackend> {
        self.runner.cpu()
    }

    pub fn cpu_mut(&mut self) -> Option<&mut CpuBackend> {
        self.runner.cpu_mut()
    }

    pub fn vocab_size(&self) -> usize {
        self.runner.vocab_size()
    }

    pub fn max_context(&self) -> usize {
        self.runner.max_context()
    }

    pub fn new_sequence(&mut self) -> SeqId {
        let seq = Sequence { pages: Vec::new(), len: 0 };
        match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = Some(seq);
                SeqId(i as u32)
            }
            None => {
                self.seqs.push(Some(seq));
                SeqId(self.seqs.len() as u32 - 1)
            }
        }
    }

    /// Frees the sequence and its pages.
    pub fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq.0 as usize).and_then(Option::take) {
            self.free.extend(s.pages);
        }
    }

    /// Tokens cached for `seq`.
    pub fn len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(seq.0 as usize)?.as_ref().map(|s| s.len)
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence, RuntimeError> {
        self.seqs.get(seq.0 as usize).and_then(Option::as_ref).ok_or_else(|| unknown(seq))
    }

    /// Gives `seq` pages for `len` tokens (nothing changes on error).
    fn reserve(&mut self, seq: SeqId, len: usize) -> Result<(), RuntimeError> {
        let max = self.max_context();
        let s = self.seq(seq)?;
        if len > max {
            return Err(RuntimeError::input(
                "token ids",
                format!("{} more tokens would make the sequence {len} tokens long; this plan serves at most {max} (compile with a larger --max-context)", len - s.len),
            ));
        }
        let need = len.div_ceil(self.runner.page_size()).saturating_sub(s.pages.len());
        let available = self.free.len();
        if need > available {
            return Err(RuntimeError::KvFull { message: format!("the sequence needs {need} more pages, {available} are free") });
        }
        let pages: Vec<u32> = self.free.split_off(available - need).into_iter().rev().collect();
        if let Some(s) = self.seqs[seq.0 as usize].as_mut() {
            s.pages.extend(pages);
        }
        Ok(())
    }

    /// Appends `ids` to `seq` (chunked prefill); returns the logits of `rows`
    /// (`[ids.len(), vocab]` or `[1, vocab]`).
    pub fn prefill(&mut self, seq: SeqId, ids: &[u32], rows: LogitRows) -> Result<&[f32], RuntimeError> {
        if ids.is_empty() {
            return Err(RuntimeError::input("token ids", "no tokens to prefill"));
        }
        self.runner.check_ids(ids)?;
        let start = self.seq(seq)?.len;
        self.reserve(seq, start + ids.len())?;
        let s = self.seqs[seq.0 as usize].as_mut().ok_or_else(|| unknown(seq))?;
        let out = self.runner.prefill(&s.pages, start, ids, rows)?;
        s.len = start + ids.len();
        Ok(out)
    }

    /// One new token for each `(sequence, id)`; returns `[batch.len(), vocab]` logits. A
    /// sequence may appear more than once: its ids take its next positions in batch order, as
    /// one token after the other would.
    pub fn decode(&mut self, batch: &[(SeqId, u32)]) -> Result<&[f32], RuntimeError> {
        if batch.is_empty() {
            return Err(RuntimeError::input("decode batch", "no sequences"));
        }
        // each row's position: its sequence's length plus its earlier rows in the batch
        let mut positions = Vec::with_capacity(batch.len());
        for (i, &(seq, _)) in batch.iter().enumerate() {
            let earlier = batch[..i].iter().filter(|&&(other, _)| other == seq).count();
            positions.push(self.seq(seq)?.len + earlier);
        }
        let ids: Vec<u32> = batch.iter().map(|&(_, id)| id).collect();
        self.runner.check_ids(&ids)?;
        for (&(seq, _), &pos) in batch.iter().zip(&positions) {
            self.reserve(seq, pos + 1)?;
        }
        let rows: Vec<DecodeRow> = batch
            .iter()
            .zip(&positions)
            .map(|(&(seq, token), &pos)| {
                let s = self.seqs[seq.0 as usize].as_ref().expect("checked above");
                DecodeRow { pages: &s.pages, pos, token }
            })
            .collect();
        self.runner.decode(&rows)?;
        for &(seq, _) in batch {
            if let Some(s) = self.seqs[seq.0 as usize].as_mut() {
                s.len += 1;
            }
        }
        Ok(&self.runner.out)
    }

    /// One step of the draft model (see [`Runner::draft`]) for each `(sequence, token)`: the row
    /// sits at the sequence's last cached position, beside `hidden[i]` (that position's hidden
    /// state, `[rows, hidden_size]`), `token` being the one that follows it; writes the draft
    /// layer's KV there and returns the draft's logits `[rows, vocab]`. The sequences' lengths
    /// do not change.
    pub fn draft(&mut self, batch: &[(SeqId, u32)], hidden: &[f32]) -> Result<&[f32], RuntimeError> {
        let mut rows = Vec::with_capacity(batch.len());
        for &(seq, token) in batch {
            let s = self.seqs.get(seq.0 as usize).and_then(Option::as_ref).ok_or_else(|| unknown(seq))?;
            if s.len == 0 {
                return Err(RuntimeError::input("draft batch", format!("sequence {} has no cached position to draft from", seq.0)));
            }
            rows.push(DecodeRow { pages: &s.pages, pos: s.len - 1, token });
        }
        self.runner.draft(&rows, hidden)
    }

    /// Logits `[ids.len(), vocab]` of a fresh sequence fed `ids`: one (chunked) prefill, or with
    /// `decode` one token at a time through the KV cache. The sequence is released afterwards.
    pub fn logits(&mut self, ids: &[u32], decode: bool) -> Result<Vec<f32>, RuntimeError> {
        if ids.is_empty() {
            return Err(RuntimeError::input("token ids", "no tokens given"));
        }
        self.runner.check_ids(ids)?;
        if ids.len() > self.max_context() {
            return Err(RuntimeError::input(
                "token ids",
                format!("{} tokens, but this plan serves at most {} per sequence (compile with a larger --max-context)", ids.len(), self.max_context()),
            ));
        }
        let seq = self.new_sequence();
        let result = if decode {
            let mut all = Vec::with_capacity(ids.len() * self.vocab_size());
            ids.iter().try_for_each(|&id| self.decode(&[(seq, id)]).map(|l| all.extend_from_slice(l))).map(|()| all)
        } else {
            self.prefill(seq, ids, LogitRows::All).map(<[f32]>::to_vec)
        };
        self.release(seq);
        result
    }
}

fn unknown(seq: SeqId) -> RuntimeError {
    RuntimeError::input("sequence", format!("{} is not an active sequence", seq.0))
}
