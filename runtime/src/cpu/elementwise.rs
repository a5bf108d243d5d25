//! Row and element copies: the embedding lookup (vocab-parallel), `add` and `gather_rows`.

use super::Round;
use crate::numerics::bf16_to_f32;

/// `out[t] = table[ids[t] - first_row]` for a BF16 `[vocab_rows, h]` table slice owning rows
/// `first_row..first_row + vocab_rows`; ids outside it give zeros (another rank owns them).
pub(crate) fn embed(ids: &[i32], table: &[u8], vocab_rows: usize, first_row: i64, h: usize, round: Round, out: &mut [f32]) {
    for (row, &id) in out.chunks_exact_mut(h).zip(ids) {
        let local = id as i64 - first_row;
        if (0..vocab_rows as i64).contains(&local) {
            let src = &table[local as usize * h * 2..(local as usize + 1) * h * 2];
            for (v, b) in row.iter_mut().zip(src.chunks_exact(2)) {
                *v = round.apply(bf16_to_f32(u16::from_le_bytes([b[0], b[1]])));
            }
        } else {
            row.fill(0.0);
        }
    }
}

/// `out = a + b` elementwise (f32 sum, rounded once at the store).
pub(crate) fn add(a: &[f32], b: &[f32], round: Round, out: &mut [f32]) {
    for ((v, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *v = round.apply(x + y);
    }
}

/// `acc[i] = acc[i] + b[i]`, rounded: [`add`] in place (MoE's output plus the shared experts', a
/// residual plus the sub-layer output).
pub(crate) fn add_in_place(acc: &mut [f32], b: &[f32], round: Round) {
    for (v, &y) in acc.iter_mut().zip(b) {
        *v = round.apply(*v + y);
    }
}

/// `out[i] = src[rows[i]]` over rows of `h` values; an index outside `src` (negative included)
/// gives zeros.
pub(crate) fn gather_rows(src: &[f32], rows: &[i32], h: usize, round: Round, out: &mut [f32]) {
    for (row, &r) in out.chunks_exact_mut(h).zip(rows) {
        match usize::try_from(r).ok().and_then(|t| src.get(t * h..(t + 1) * h)) {
            Some(x) => row.iter_mut().zip(x).for_each(|(v, &x)| *v = round.apply(x)),
            None => row.fill(0.0),
        }
    }
}
