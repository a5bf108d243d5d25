pub mod compile;
pub mod inspect;
pub mod synth;
