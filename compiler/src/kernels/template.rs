//! The kernel template format (std only: the build script includes this file too).
//!
//! A template is a PTX file whose leading `//` comment block is a typed header:
//! ```text
//! // kiln-template: NAME          file stem
//! // family: FAMILY               a plan::KernelFamily variant
//! // entry: ENTRY                 the single .entry of the module
//! // doc: ...                     free text
//! // smem: EXPR                   dynamic shared memory per block in bytes (default 0): static
//! //                              `.shared` is capped at 48 KiB, larger arrays are `.extern`
//! // param NAME: u32 = doc        shape constants, in order
//! // arg NAME: ptr|u32|f32 = doc  kernel parameters, in .entry order; `rank_u32` is a `.u32`
//! //                              the runtime sets per rank to `rank * value` (LaunchArg::PerRank)
//! // end-header
//! ```
//! The body is PTX with `${EXPR}` placeholders and line directives `#for VAR in A..B`, `#end`,
//! `#if EXPR`, `#else`, `#endif` and `#let NAME = EXPR` (a constant for the lines after it, e.g.
//! a layout size that differs per target); `EXPR` is integer arithmetic (`+ - * / %`,
//! parentheses) and comparisons (`==`, `!=`: 1 or 0) over the params, loop variables, `#let`
//! constants and literals. Shapes are baked in: a rendered kernel has no shape arguments.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub name: String,
    pub family: String,
    pub entry: String,
    pub doc: Vec<String>,
    /// Dynamic shared memory per block (an expression over the params).
    pub smem: String,
    pub params: Vec<(String, String)>,
    /// (name, type, doc) with type `ptr`, `u32`, `rank_u32` (per rank: `rank * value`) or `f32`.
    pub args: Vec<(String, String, String)>,
}

/// Splits a template into its header and PTX body.
pub fn parse(text: &str) -> Result<(Header, &str), String> {
    let end = text.find("// end-header\n").ok_or("no `// end-header` line")?;
    let body = &text[end + "// end-header\n".len()..];
    let mut h = Header { name: String::new(), family: String::new(), entry: String::new(), doc: vec![], smem: "0".into(), params: vec![], args: vec![] };
    for (i, line) in text[..end].lines().enumerate() {
        let l = line.strip_prefix("//").ok_or_else(|| format!("header line {}: not a `//` comment", i + 1))?.trim();
        let (key, rest) = l.split_once(':').ok_or_else(|| format!("header line {}: expected `key: value`", i + 1))?;
        let rest = rest.trim();
        let words: Vec<&str> = key.split_whitespace().collect();
        match words.as_slice() {
            ["kiln-template"] => h.name = rest.into(),
            ["family"] => h.family = rest.into(),
            ["entry"] => h.entry = rest.into(),
            ["doc"] => h.doc.push(rest.into()),
            ["smem"] => h.smem = rest.into(),
            ["param", name] | ["arg", name] => {
                let (ty, doc) = rest.split_once('=').map(|(a, b)| (a.trim(), b.trim())).unwrap_or((rest, ""));
                let ok = if words[0] == "param" { ty == "u32" } else { matches!(ty, "ptr" | "u32" | "rank_u32" | "f32") };
                if !ok || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!("header line {}: bad {} `{name}: {ty}`", i + 1, words[0]));
                }
                if words[0] == "param" {
                    h.params.push((name.to_string(), doc.into()));
                } else {
                    h.args.push((name.to_string(), ty.into(), doc.into()));
                }
            }
            _ => return Err(format!("header line {}: unknown key `{key}`", i + 1)),
        }
    }
    if h.name.is_empty() || h.family.is_empty() || h.entry.is_empty() {
        return Err("the header needs kiln-template, family and entry".into());
    }
    Ok((h, body))
}

/// Checks that the body declares exactly the header's entry and arguments (names and PTX types,
/// in order) and renders with only the header's params. Run by the build script.
pub fn check(h: &Header, body: &str) -> Result<(), String> {
    let entry = format!(".visible .entry {}(", h.entry);
    let at = body.find(&entry).ok_or_else(|| format!("the body has no `{entry}`"))?;
    if body.matches(".entry").count() != 1 {
        return Err("a template holds exactly one .entry".into());
    }
    let list = &body[at + entry.len()..];
    let list = &list[..list.find(')').ok_or("unterminated .entry parameter list")?];
    let found: Vec<(String, String)> = list
        .split(',')
        .map(|p| {
            let w: Vec<&str> = p.split_whitespace().collect();
            match w.as_slice() {
                [".param", ty, name] => Ok((name.to_string(), ty.trim_start_matches('.').to_string())),
                _ => Err(format!("cannot read .entry parameter `{}`", p.trim())),
            }
        })
        .collect::<Result<_, _>>()?;
    let want: Vec<(String, String)> =
        h.args.iter().map(|(n, t, _)| (n.clone(), match t.as_str() {
            "ptr" => "u64".into(),
            "rank_u32" => "u32".into(),
            _ => t.clone(),
        })).collect();
    if found != want {
        return Err(format!("the .entry parameters {found:?} differ from the header's args {want:?}"));
    }
    // Every placeholder must evaluate with some value of the params (16 for all of them), and
    // with each target's `ARCH` (its branches).
    for arch in [16, 120, 90] {
        let values: Vec<(&str, u64)> = h.params.iter().map(|(n, _)| (n.as_str(), if n == "ARCH" { arch } else { 16 })).collect();
        eval_params(&h.smem, &values)?;
        render(body, &values).map_err(|e| format!("ARCH = {arch}: {e}"))?;
    }
    Ok(())
}

/// Evaluates an expression over the param values.
pub fn eval_params(expr: &str, params: &[(&str, u64)]) -> Result<i64, String> {
    let vars: BTreeMap<String, i64> = params.iter().map(|(k, v)| (k.to_string(), *v as i64)).collect();
    eval(expr, &vars, 0)
}

/// Renders the body with the given param values.
pub fn render(body: &str, params: &[(&str, u64)]) -> Result<String, String> {
    let mut vars: BTreeMap<String, i64> = params.iter().map(|(k, v)| (k.to_string(), *v as i64)).collect();
    let lines: Vec<&str> = body.lines().collect();
    let mut out = String::with_capacity(body.len() * 2);
    render_lines(&lines, 0, lines.len(), &mut vars, &mut out)?;
    Ok(out)
}

fn render_lines(lines: &[&str], mut i: usize, end: usize, vars: &mut BTreeMap<String, i64>, out: &mut String) -> Result<(), String> {
    while i < end {
        let line = lines[i];
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#for ") {
            let close = matching(lines, i, end, "#for ", "#end", None)?.0;
            let (var, range) = rest.split_once(" in ").ok_or_else(|| format!("line {}: `#for VAR in A..B`", i + 1))?;
            let (a, b) = range.split_once("..").ok_or_else(|| format!("line {}: `#for VAR in A..B`", i + 1))?;
            let (a, b) = (eval(a, vars, i)?, eval(b, vars, i)?);
            let var = var.trim().to_string();
            let saved = vars.get(&var).copied();
            for v in a..b {
                vars.insert(var.clone(), v);
                render_lines(lines, i + 1, close, vars, out)?;
            }
            match saved {
                Some(s) => vars.insert(var, s),
                None => vars.remove(&var),
            };
            i = close + 1;
        } else if let Some(cond) = t.strip_prefix("#if ") {
            let (close, els) = matching(lines, i, end, "#if ", "#endif", Some("#else"))?;
            if eval(cond, vars, i)? != 0 {
                render_lines(lines, i + 1, els.unwrap_or(close), vars, out)?;
            } else if let Some(e) = els {
                render_lines(lines, e + 1, close, vars, out)?;
            }
            i = close + 1;
        } else if let Some(rest) = t.strip_prefix("#let ") {
            let (name, expr) = rest.split_once('=').ok_or_else(|| format!("line {}: `#let NAME = EXPR`", i + 1))?;
            let name = name.trim();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || vars.contains_key(name) {
                return Err(format!("line {}: `#let {name}` must name a new constant", i + 1));
            }
            let v = eval(expr, vars, i)?;
            vars.insert(name.to_string(), v);
            i += 1;
        } else if t.starts_with('#') {
            return Err(format!("line {}: unexpected `{}`", i + 1, t));
        } else {
            let mut rest = line;
            while let Some(p) = rest.find("${") {
                out.push_str(&rest[..p]);
                let close = rest[p..].find('}').ok_or_else(|| format!("line {}: unterminated ${{", i + 1))?;
                out.push_str(&eval(&rest[p + 2..p + close], vars, i)?.to_string());
                rest = &rest[p + close + 1..];
            }
            out.push_str(rest);
            out.push('\n');
            i += 1;
        }
    }
    Ok(())
}

/// The line of the directive closing the one at `start` (and of its `#else`).
fn matching(lines: &[&str], start: usize, end: usize, open: &str, close: &str, mid: Option<&str>) -> Result<(usize, Option<usize>), String> {
    let mut depth = 0;
    let mut els = None;
    for (j, l) in lines.iter().enumerate().take(end).skip(start + 1) {
        let t = l.trim_start();
        if t.starts_with(open) {
            depth += 1;
        } else if t.trim_end() == close {
            if depth == 0 {
                return Ok((j, els));
            }
            depth -= 1;
        } else if depth == 0 && mid.is_some_and(|m| t.trim_end() == m) {
            els = Some(j);
        }
    }
    Err(format!("line {}: `{}` without `{close}`", start + 1, lines[start].trim()))
}

fn eval(expr: &str, vars: &BTreeMap<String, i64>, line: usize) -> Result<i64, String> {
    let toks = tokens(expr).map_err(|e| format!("line {}: {e} in `{expr}`", line + 1))?;
    let mut pos = 0;
    let v = compare(&toks, &mut pos, vars).map_err(|e| format!("line {}: {e} in `{expr}`", line + 1))?;
    if pos != toks.len() {
        return Err(format!("line {}: trailing input in `{expr}`", line + 1));
    }
    Ok(v)
}

fn tokens(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let cs: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let st = i;
            while i < cs.len() && (cs[i].is_ascii_alphanumeric() || cs[i] == '_') {
                i += 1;
            }
            out.push(cs[st..i].iter().collect());
        } else if (c == '=' || c == '!') && cs.get(i + 1) == Some(&'=') {
            out.push(format!("{c}="));
            i += 2;
        } else if "+-*/%()".contains(c) {
            out.push(c.to_string());
            i += 1;
        } else {
            return Err(format!("unexpected `{c}`"));
        }
    }
    Ok(out)
}

/// `a == b` / `a != b` (1 or 0; one comparison, below `+ -`), else a sum.
fn compare(t: &[String], pos: &mut usize, vars: &BTreeMap<String, i64>) -> Result<i64, String> {
    let a = sum(t, pos, vars)?;
    match t.get(*pos).map(String::as_str) {
        Some(op @ ("==" | "!=")) => {
            let eq = op == "==";
            *pos += 1;
            let b = sum(t, pos, vars)?;
            Ok(((a == b) == eq) as i64)
        }
        _ => Ok(a),
    }
}

fn sum(t: &[String], pos: &mut usize, vars: &BTreeMap<String, i64>) -> Result<i64, String> {
    let mut v = product(t, pos, vars)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "+" || *o == "-") {
        *pos += 1;
        let r = product(t, pos, vars)?;
        v = if op == "+" { v + r } else { v - r };
    }
    Ok(v)
}

fn product(t: &[String], pos: &mut usize, vars: &BTreeMap<String, i64>) -> Result<i64, String> {
    let mut v = atom(t, pos, vars)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "*" || *o == "/" || *o == "%").cloned() {
        *pos += 1;
        let r = atom(t, pos, vars)?;
        v = match op.as_str() {
            "*" => v * r,
            _ if r == 0 => return Err("division by zero".into()),
            "/" => v / r,
            _ => v % r,
        };
    }
    Ok(v)
}

fn atom(t: &[String], pos: &mut usize, vars: &BTreeMap<String, i64>) -> Result<i64, String> {
    let tok = t.get(*pos).ok_or("unexpected end")?.clone();
    *pos += 1;
    if tok == "(" {
        let v = compare(t, pos, vars)?;
        if t.get(*pos).map(String::as_str) != Some(")") {
            return Err("missing `)`".into());
        }
        *pos += 1;
        Ok(v)
    } else if tok == "-" {
        Ok(-atom(t, pos, vars)?)
    } else if let Ok(n) = tok.parse::<i64>() {
        Ok(n)
    } else {
        vars.get(&tok).copied().ok_or_else(|| format!("unknown name `{tok}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_loops_conditions_and_expressions() {
        let body = "a ${N*2+1}\n#for i in 0..N\nx${i}\n#if i%2\nodd\n#else\neven\n#endif\n#end\n";
        assert_eq!(render(body, &[("N", 3)]).unwrap(), "a 7\nx0\neven\nx1\nodd\nx2\neven\n");
    }

    #[test]
    fn compares_and_lets() {
        let body = "#if ARCH == 120\n#let W = 3\n#else\n#let W = 8\n#endif\n${W*2} ${(ARCH!=90)+1} ${ARCH==90}\n";
        assert_eq!(render(body, &[("ARCH", 120)]).unwrap(), "6 2 0\n");
        assert_eq!(render(body, &[("ARCH", 90)]).unwrap(), "16 1 1\n");
        assert!(render("#let ARCH = 1\n", &[("ARCH", 90)]).unwrap_err().contains("line 1: `#let ARCH` must name a new constant"));
        assert!(render("${1 == 1 == 1}\n", &[]).unwrap_err().contains("trailing input"));
        assert_eq!(eval_params("(ARCH==120)*5+2", &[("ARCH", 120)]).unwrap(), 7);
    }

    #[test]
    fn errors_name_the_line() {
        assert!(render("ok\n${M}\n", &[("N", 1)]).unwrap_err().contains("line 2: unknown name `M`"));
        assert!(render("#for i in 0..2\nx\n", &[]).unwrap_err().contains("without `#end`"));
        assert!(render("${N/0}\n", &[("N", 1)]).unwrap_err().contains("division by zero"));
    }

    #[test]
    fn header_and_entry_must_agree() {
        let t = "// kiln-template: k\n// family: Add\n// entry: kk\n// param N: u32 = n\n// arg a: ptr = a\n// arg n: u32 = n\n// end-header\n.visible .entry kk(\n    .param .u64 a,\n    .param .u32 n\n)\n{ ret; }\n";
        let (h, body) = parse(t).unwrap();
        assert_eq!(h.args.len(), 2);
        check(&h, body).unwrap();
        let swapped = t.replace("// arg a: ptr = a\n// arg n: u32 = n\n", "// arg n: u32 = n\n// arg a: ptr = a\n");
        let (h, body) = parse(&swapped).unwrap();
        assert!(check(&h, body).unwrap_err().contains("differ from the header"));
    }
}
