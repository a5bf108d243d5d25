//! The seam between the engine and a backend: one forward pass over a prefill chunk of one
//! sequence, or over decode tokens of several sequences (one each, or a speculative step's
//! consecutive tokens of one). The engine owns the KV page allocation and passes each
//! sequence's page table.

use kiln_runtime::session::{DecodeRow, LogitRows, Runner};

/// One sequence in a decode step.
#[derive(Debug, Clone, Copy)]
pub struct DecodeItem<'a> {
    /// The sequence's KV pages, in position order.
    pub pages: &'a [u32],
    /// Position of `token` (= tokens already cached).
    pub pos: usize,
    pub token: u32,
}

pub trait Forward: Send {
    fn vocab_size(&self) -> usize;
    /// Tokens per KV page.
    fn page_size(&self) -> usize;
    /// KV pages the backend holds.
    fn total_pages(&self) -> usize;
    /// Longest sequence (prompt + generated) the plan serves.
    fn max_context(&self) -> usize;
    /// Largest decode batch of the plan.
    fn max_decode_batch(&self) -> usize;
    /// Largest prefill chunk of the plan.
    fn max_prefill_chunk(&self) -> usize;
    /// Appends `tokens` at positions `start..` of the sequence that owns `pages` and returns the
    /// logits of the last one (`vocab_size` values).
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String>;
    /// One token per item; returns `[items.len(), vocab_size]` logits, row-major. Items of one
    /// sequence at consecutive positions (a speculative step's drafts) each see the positions up
    /// to their own, as if decoded one after the other.
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String>;
    /// Relative time of a decode step of `rows` rows (any unit, the same for every count), what
    /// speculative decoding weighs its drafts against; None: unknown (drafts then fill the rows
    /// a batch has to spare).
    fn decode_cost(&mut self, rows: usize) -> Option<f64> {
        let _ = rows;
        None
    }
    /// The width of the hidden rows the plan's draft model takes (`kiln compile --draft mtp`),
    /// where the backend can run it; None: no draft model.
    fn draft_hidden_size(&self) -> Option<usize> {
        None
    }
    /// With a draft model: the final normed hidden rows of every token of the last `prefill`
    /// or `decode` call, `[tokens, draft_hidden_size]`.
    fn hidden_rows(&self) -> Vec<f32> {
        Vec::new()
    }
    /// One step of the draft model: item i is the token at `pos + 1` of its sequence and
    /// `hidden` row i the hidden state at `pos` (the model's, or the draft's own from its
    /// previous step); each row writes the draft layer's KV at `pos`. Returns the draft's
    /// `[items.len(), vocab_size]` logits (for the token at `pos + 2`) and its own hidden rows.
    fn draft(&mut self, items: &[DecodeItem<'_>], hidden: &[f32]) -> Result<(Vec<f32>, Vec<f32>), String> {
        let _ = (items, hidden);
        Err("the plan has no draft model".into())
    }
    /// Why the backend can serve nothing any more (a GPU fault), once that has happened.
    fn failure(&self) -> Option<String> {
        None
    }
    /// The plan program the last prefill or decode ran (named in NaN reports).
    fn last_program(&self) -> Option<String> {
        None
    }
}

/// The runtime's runner is what the engine drives in `kiln serve` and `kiln run`.
impl Forward for Runner {
    fn vocab_size(&self) -> usize {
        Runner::vocab_size(self)
    }
    fn page_size(&self) -> usize {
        Runner::page_size(self)
    }
    fn total_pages(&self) -> usize {
        Runner::total_pages(self)
    }
    fn max_context(&self) -> usize {
        Runner::max_context(self)
    }
    fn max_decode_batch(&self) -> usize {
        Runner::max_decode_batch(self)
    }
    fn max_prefill_chunk(&self) -> usize {
        Runner::max_prefill_chunk(self)
    }
    fn failure(&self) -> Option<String> {
        self.backend().failure().map(str::to_string)
    }
    fn last_program(&self) -> Option<String> {
        Runner::last_program(self).map(str::to_string)
    }
    fn prefill(&mut self, pages: &[u32], start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
        Runner::prefill(self, pages, start, tokens, LogitRows::Last).map(<[f32]>::to_vec).map_err(|e| e.to_string())
    }
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String> {
        let rows: Vec<DecodeRow> = items.iter().map(|i| DecodeRow { pages: i.pages, pos: i.pos, token: i.token }).collect();
        Runner::decode(self, &rows).map(<[f32]>::to_vec).map_err(|e| e.to_string())
    }
    fn draft_hidden_size(&self) -> Option<usize> {
        self.hidden().map(|_| self.plan().model.hidden_size)
    }
    fn hidden_rows(&self) -> Vec<f32> {
        self.hidden().map(<[f32]>::to_vec).unwrap_or_default()
    }
    fn draft(&mut self, items: &[DecodeItem<'_>], hidden: &[f32]) -> Result<(Vec<f32>, Vec<f32>), String> {
        let rows: Vec<DecodeRow> = items.iter().map(|i| DecodeRow { pages: i.pages, pos: i.pos, token: i.token }).collect();
        let logits = Runner::draft(self, &rows, hidden).map_err(|e| e.to_string())?.to_vec();
        Ok((logits, self.hidden().map(<[f32]>::to_vec).unwrap_or_default()))
    }
    /// The plan's predicted step times (GPU plans; a CPU plan has none).
    fn decode_cost(&mut self, rows: usize) -> Option<f64> {
        Runner::predicted_decode_us(self, rows)
    }
}
