//! PTX lexer: identifiers (with dotted modifiers and `::`), numbers, punctuation; comments dropped.

#[derive(Clone, Debug, PartialEq)]
pub enum Tok {
    /// Identifiers, directives (`.reg`), opcodes with modifiers (`ld.global.v4.f32`), registers.
    Ident(String),
    /// Integer literal (decimal, hex `0x`, octal `0…`, binary `0b`), without sign.
    Int(u64),
    /// `0fXXXXXXXX`: f32 bits.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX`: f64 bits.
    F64(u64),
    /// Decimal floating-point literal.
    Float(f64),
    Str(String),
    Punct(char),
}

#[derive(Clone, Debug)]
pub struct Token {
    pub tok: Tok,
    pub line: u32,
    /// Byte range in the source.
    pub start: usize,
    pub end: usize,
}

#[derive(Debug)]
pub struct LexError {
    pub line: u32,
    pub msg: String,
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn ident_cont(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.')
}

pub fn lex(src: &str) -> Result<Vec<Token>, LexError> {
    let s = src.as_bytes();
    let mut i = 0;
    let mut line = 1u32;
    let mut out = Vec::new();
    while i < s.len() {
        let c = s[i];
        if c == b'\n' {
            line += 1;
            i += 1;
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c == b'/' && s.get(i + 1) == Some(&b'/') {
            while i < s.len() && s[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && s.get(i + 1) == Some(&b'*') {
            let start_line = line;
            i += 2;
            loop {
                if i + 1 >= s.len() {
                    return Err(LexError { line: start_line, msg: "unterminated /* comment".into() });
                }
                if s[i] == b'\n' {
                    line += 1;
                }
                if s[i] == b'*' && s[i + 1] == b'/' {
                    i += 2;
                    break;
                }
                i += 1;
            }
            continue;
        }
        let start = i;
        if c == b'"' {
            i += 1;
            while i < s.len() && s[i] != b'"' {
                if s[i] == b'\n' {
                    return Err(LexError { line, msg: "unterminated string".into() });
                }
                i += 1;
            }
            if i >= s.len() {
                return Err(LexError { line, msg: "unterminated string".into() });
            }
            i += 1;
            out.push(Token { tok: Tok::Str(src[start + 1..i - 1].to_string()), line, start, end: i });
            continue;
        }
        if ident_start(c) {
            i += 1;
            while i < s.len() {
                if ident_cont(s[i]) {
                    i += 1;
                } else if s[i] == b':' && s.get(i + 1) == Some(&b':') {
                    i += 2;
                } else {
                    break;
                }
            }
            out.push(Token { tok: Tok::Ident(src[start..i].to_string()), line, start, end: i });
            continue;
        }
        if c.is_ascii_digit() {
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'.' || s[i] == b'_') {
                // exponent sign of a decimal float: 1e-5
                i += 1;
                if i < s.len() && (s[i] == b'-' || s[i] == b'+') && matches!(s[i - 1], b'e' | b'E') && !is_prefixed(&src[start..i]) {
                    i += 1;
                }
            }
            let text = &src[start..i];
            let tok = number(text).ok_or_else(|| LexError { line, msg: format!("bad number literal '{text}'") })?;
            out.push(Token { tok, line, start, end: i });
            continue;
        }
        if b",;:[]{}()<>+-@!|=".contains(&c) {
            i += 1;
            out.push(Token { tok: Tok::Punct(c as char), line, start, end: i });
            continue;
        }
        return Err(LexError { line, msg: format!("unexpected character '{}'", c as char) });
    }
    Ok(out)
}

/// Hex, f32-bits and f64-bits literals, whose `e` digits are not exponents.
fn is_prefixed(t: &str) -> bool {
    let l = t.to_ascii_lowercase();
    l.starts_with("0x") || l.starts_with("0f") || l.starts_with("0d")
}

fn number(t: &str) -> Option<Tok> {
    let lower = t.to_ascii_lowercase();
    if let Some(h) = lower.strip_prefix("0f") {
        if h.len() == 8 {
            return u32::from_str_radix(h, 16).ok().map(Tok::F32);
        }
        return None;
    }
    if let Some(h) = lower.strip_prefix("0d") {
        if h.len() == 16 {
            return u64::from_str_radix(h, 16).ok().map(Tok::F64);
        }
        return None;
    }
    let body = lower.strip_suffix('u').unwrap_or(&lower);
    if let Some(h) = body.strip_prefix("0x") {
        return u64::from_str_radix(h, 16).ok().map(Tok::Int);
    }
    if let Some(b) = body.strip_prefix("0b") {
        return u64::from_str_radix(b, 2).ok().map(Tok::Int);
    }
    if body.contains('.') || body.contains('e') {
        return lower.parse::<f64>().ok().map(Tok::Float);
    }
    if body.len() > 1 && body.starts_with('0') {
        return u64::from_str_radix(&body[1..], 8).ok().map(Tok::Int);
    }
    body.parse::<u64>().ok().map(Tok::Int)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<Tok> {
        lex(s).unwrap().into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn lexes_opcodes_registers_and_numbers() {
        let t = toks("mma.sync.aligned.kind::mxf4nvf4.f32 {%r1,%r2}, [%rd1+-8]; // c\n0f3F800000 0x10 017 1.5 0b11 7U");
        assert_eq!(t[0], Tok::Ident("mma.sync.aligned.kind::mxf4nvf4.f32".into()));
        assert_eq!(t[1], Tok::Punct('{'));
        assert_eq!(t[2], Tok::Ident("%r1".into()));
        assert!(t.contains(&Tok::F32(0x3F80_0000)));
        assert!(t.contains(&Tok::Int(16)));
        assert!(t.contains(&Tok::Int(15)));
        assert!(t.contains(&Tok::Float(1.5)));
        assert!(t.contains(&Tok::Int(3)));
        assert!(t.contains(&Tok::Int(7)));
    }

    #[test]
    fn labels_end_at_single_colon_and_lines_count() {
        let v = lex("/* a\n b */ $L__BB0_1:\n  ret;").unwrap();
        assert_eq!(v[0].tok, Tok::Ident("$L__BB0_1".into()));
        assert_eq!(v[0].line, 2);
        assert_eq!(v[1].tok, Tok::Punct(':'));
        assert_eq!(v[2].line, 3);
    }
}
