//! The seam between the engine and a backend: one forward pass over a prefill chunk of one
//! sequence, or over one decode token for each of several sequences. The engine owns the KV page
//! allocation and passes each sequence's page table.

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
    /// One token per sequence; returns `[items.len(), vocab_size]` logits, row-major.
    fn decode(&mut self, items: &[DecodeItem<'_>]) -> Result<Vec<f32>, String>;
    /// Why the backend can serve nothing any more (a GPU fault), once that has happened.
    fn failure(&self) -> Option<String> {
        None
    }
}
