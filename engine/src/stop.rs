//! Stop strings over streamed text: emits text as soon as it cannot be the start of a stop
//! string, and cuts the output where a stop string begins.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), stopped: false }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds a text delta; returns the text that is safe to emit now.
    pub fn push(&mut self, delta: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(delta);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// Text still held back when generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of splitting the text into two deltas gives the same output.
    fn run_all_splits(text: &str, stops: &[&str]) -> (String, bool) {
        let whole = {
            let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
            let mut out = m.push(text);
            out += &m.finish();
            (out, m.stopped())
        };
        for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
            let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
            let mut out = m.push(&text[..cut]);
            out += &m.push(&text[cut..]);
            if !m.stopped() {
                out += &m.finish();
            }
            assert_eq!((out, m.stopped()), whole, "split at {cut}");
        }
        whole
    }

    #[test]
    fn cuts_at_the_first_stop_string() {
        assert_eq!(run_all_splits("hello world. bye", &["."]), ("hello world".into(), true));
        assert_eq!(run_all_splits("a<|end|>b<|x", &["<|x", "<|end|>"]), ("a".into(), true));
        assert_eq!(run_all_splits("no stop here <", &["<|end|>"]), ("no stop here <".into(), false));
        assert_eq!(run_all_splits("héé stop", &["é s"]), ("hé".into(), true));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("abcST"), "abc");
        assert_eq!(m.push("x"), "STx");
        assert_eq!(m.push("ST"), "");
        assert_eq!(m.push("OP tail"), "");
        assert!(m.stopped());
    }
}
