//! Splits GLM output into reasoning and content, incrementally (SGLang/vLLM `glm45` reasoning
//! parser). With thinking on, the prompt already ends in `<think>`, so the output starts inside
//! the reasoning; `</think>` switches to content. GLM-5 can open a `<tool_call>` without closing
//! its reasoning: the reasoning ends there and the call goes to content, where the tool-call
//! parser finds it. Output cut off before `</think>` is all reasoning.
//!
//! Whitespace around the reasoning, and between `</think>` and the content, is dropped: the
//! template renders `<think>{{ r.strip() }}</think>{{ c.strip() }}`, so the model never sees it
//! in history, and SGLang strips it too.

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const TOOL_CALL_START: &str = "<tool_call>";

/// What one push produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
}

pub struct ReasoningParser {
    in_reasoning: bool,
    /// Text not yet decided: a possible tag prefix, or whitespace that may turn out to trail the
    /// reasoning.
    pending: String,
    /// Only whitespace seen so far, so a leading `<think>` may still come and is to be dropped.
    at_start: bool,
    reasoning_started: bool,
    content_started: bool,
}

impl ReasoningParser {
    /// `thinking`: the prompt ended in `<think>` (the default; off only for
    /// `enable_thinking: false`). With thinking off everything is content.
    pub fn new(thinking: bool) -> ReasoningParser {
        ReasoningParser {
            in_reasoning: thinking,
            pending: String::new(),
            at_start: thinking,
            reasoning_started: false,
            content_started: false,
        }
    }

    /// Whether text pushed now would be reasoning; count a generated token as a reasoning token
    /// when this holds before its text is pushed.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    pub fn push(&mut self, text: &str) -> ReasoningDelta {
        self.pending.push_str(text);
        let mut out = ReasoningDelta::default();
        self.drain(&mut out, false);
        out
    }

    /// Flushes what is held back; call once when generation ends.
    pub fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        self.drain(&mut out, true);
        out
    }

    fn drain(&mut self, out: &mut ReasoningDelta, last: bool) {
        if self.in_reasoning {
            if self.at_start {
                let rest = self.pending.trim_start();
                if let Some(after) = rest.strip_prefix(THINK_START) {
                    self.pending = after.to_string();
                    self.at_start = false;
                } else if THINK_START.starts_with(rest) && !last {
                    return; // whitespace only, or a prefix of `<think>`
                } else {
                    self.at_start = false;
                }
            }
            let end = self.pending.find(THINK_END);
            let call = self.pending.find(TOOL_CALL_START);
            let (cut, resume) = match (end, call) {
                // A call before `</think>` ends the reasoning; the call itself stays for the content side.
                (Some(e), Some(c)) if c < e => (c, c),
                (Some(e), _) => (e, e + THINK_END.len()),
                (None, Some(c)) => (c, c),
                (None, None) => {
                    if last {
                        let text = std::mem::take(&mut self.pending);
                        self.emit_reasoning(out, text.trim_end());
                    } else {
                        let hold = held_suffix(&self.pending, &[THINK_END, TOOL_CALL_START]);
                        let ready = self.pending[..self.pending.len() - hold].trim_end().len();
                        let text: String = self.pending.drain(..ready).collect();
                        self.emit_reasoning(out, &text);
                    }
                    return;
                }
            };
            let text = self.pending[..cut].trim_end().to_string();
            self.emit_reasoning(out, &text);
            self.pending.drain(..resume);
            self.in_reasoning = false;
        }
        if !self.content_started {
            let skip = self.pending.len() - self.pending.trim_start().len();
            self.pending.drain(..skip);
            if self.pending.is_empty() {
                return;
            }
            self.content_started = true;
        }
        out.content.push_str(&self.pending);
        self.pending.clear();
    }

    fn emit_reasoning(&mut self, out: &mut ReasoningDelta, text: &str) {
        let text = if self.reasoning_started { text } else { text.trim_start() };
        if !text.is_empty() {
            self.reasoning_started = true;
            out.reasoning.push_str(text);
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text that
/// may become a tag once more arrives.
pub(crate) fn held_suffix(text: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        for len in (best + 1..tag.len().min(text.len() + 1)).rev() {
            if text.is_char_boundary(text.len() - len) && text.ends_with(&tag[..len]) {
                best = len;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_split(text: &str, thinking: bool, cuts: &[usize]) -> ReasoningDelta {
        let mut p = ReasoningParser::new(thinking);
        let mut all = ReasoningDelta::default();
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
            let d = p.push(&text[from..cut]);
            all.reasoning += &d.reasoning;
            all.content += &d.content;
            from = cut;
        }
        let d = p.finish();
        all.reasoning += &d.reasoning;
        all.content += &d.content;
        all
    }

    /// The result of one push, checked against every two-way split and char-by-char feeding.
    fn parse(text: &str, thinking: bool) -> (String, String) {
        let whole = parse_split(text, thinking, &[]);
        let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &bounds {
            assert_eq!(parse_split(text, thinking, &[i]), whole, "split at {i} of {text:?}");
        }
        assert_eq!(parse_split(text, thinking, &bounds), whole, "char by char: {text:?}");
        (whole.reasoning, whole.content)
    }

    fn pair(r: &str, c: &str) -> (String, String) {
        (r.to_string(), c.to_string())
    }

    #[test]
    fn reasoning_then_content() {
        assert_eq!(parse("Let me think.</think>The answer is 4.", true), pair("Let me think.", "The answer is 4."));
        assert_eq!(parse("\n  step 1\nstep 2\n</think>\n\nDone.\n", true), pair("step 1\nstep 2", "Done.\n"));
        assert_eq!(parse("</think>Hi", true), pair("", "Hi"));
    }

    #[test]
    fn a_leading_think_is_stripped() {
        assert_eq!(parse("<think>hmm</think>ok", true), pair("hmm", "ok"));
        assert_eq!(parse("\n<think>\nhmm</think>ok", true), pair("hmm", "ok"));
        // Only a leading one: later ones are text.
        assert_eq!(parse("a<think>b</think>c", true), pair("a<think>b", "c"));
    }

    #[test]
    fn truncated_reasoning_is_all_reasoning() {
        assert_eq!(parse("I was thinking about", true), pair("I was thinking about", ""));
        assert_eq!(parse("almost done </thi", true), pair("almost done </thi", ""));
        assert_eq!(parse("<thi", true), pair("<thi", ""));
        assert_eq!(parse("", true), pair("", ""));
    }

    #[test]
    fn a_tool_call_ends_the_reasoning() {
        assert_eq!(
            parse("I need the weather. <tool_call>get_weather<arg_key>city</arg_key>", true),
            pair("I need the weather.", "<tool_call>get_weather<arg_key>city</arg_key>")
        );
        assert_eq!(
            parse("r</think>text <tool_call>f</tool_call></think>", true),
            pair("r", "text <tool_call>f</tool_call></think>")
        );
    }

    #[test]
    fn thinking_off_is_all_content() {
        assert_eq!(parse("  Hello <think>x</think>", false), pair("", "Hello <think>x</think>"));
    }

    #[test]
    fn in_reasoning_tracks_the_switch() {
        let mut p = ReasoningParser::new(true);
        assert!(p.in_reasoning());
        assert_eq!(p.push("abc </thi"), ReasoningDelta { reasoning: "abc".into(), content: String::new() });
        assert!(p.in_reasoning());
        assert_eq!(p.push("nk>  x"), ReasoningDelta { reasoning: String::new(), content: "x".into() });
        assert!(!p.in_reasoning());
        assert!(!ReasoningParser::new(false).in_reasoning());
    }

    #[test]
    fn held_suffix_finds_tag_prefixes() {
        assert_eq!(held_suffix("abc</thi", &[THINK_END]), 5);
        assert_eq!(held_suffix("abc<", &[THINK_END, TOOL_CALL_START]), 1);
        assert_eq!(held_suffix("abc</think>", &[THINK_END]), 0);
        assert_eq!(held_suffix("é", &[THINK_END]), 0);
    }
}
