pub mod bench;
pub mod compile;
pub mod emu;
pub mod inspect;
pub mod logits;
pub mod run;
pub mod synth;
pub mod serve;
