//! fnmatch-style patterns as ModelOpt writes them in `exclude_modules` / `ignore`.

/// Full match of `name` against `pattern` with `*` (any run, dots included), `?` (one char) and
/// `[...]` character classes (`[!...]` negated), like Python's `fnmatch.fnmatchcase`.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    matches_from(&p, &n)
}

fn matches_from(p: &[char], n: &[char]) -> bool {
    // Iterative matcher with single-star backtracking (linear in practice).
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() {
            match p[pi] {
                '*' => {
                    star = Some((pi, ni));
                    pi += 1;
                    continue;
                }
                '?' => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                '[' => {
                    if let Some((hit, next)) = class(&p[pi..], n[ni]) {
                        if hit {
                            pi += next;
                            ni += 1;
                            continue;
                        }
                    } else if n[ni] == '[' {
                        pi += 1;
                        ni += 1;
                        continue;
                    }
                }
                c if c == n[ni] => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, sn)) => {
                pi = sp + 1;
                ni = sn + 1;
                star = Some((sp, sn + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Matches one `[...]` class at the start of `p`; returns (matched, pattern chars consumed), or
/// None when the bracket is unterminated (then it is a literal `[`).
fn class(p: &[char], c: char) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = p.get(1) == Some(&'!');
    if negate {
        i += 1;
    }
    let start = i;
    let mut hit = false;
    while i < p.len() && (p[i] != ']' || i == start) {
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            hit |= p[i] <= c && c <= p[i + 2];
            i += 3;
        } else {
            hit |= p[i] == c;
            i += 1;
        }
    }
    (i < p.len()).then_some((hit != negate, i + 1))
}

/// ModelOpt/sglang exclusion rule: a module is excluded when a pattern matches its full dotted
/// name, or when a pattern without dots matches one of its dot-separated components.
pub fn module_excluded<'p>(module: &str, patterns: &'p [String]) -> Option<&'p str> {
    patterns
        .iter()
        .find(|pat| {
            fnmatch(pat, module) || (!pat.contains('.') && module.split('.').any(|part| fnmatch(pat, part)))
        })
        .map(|s| s.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_crosses_dots_like_python_fnmatch() {
        assert!(fnmatch("model.layers.*.self_attn*", "model.layers.12.self_attn.indexer.wk"));
        assert!(fnmatch("*mlp.gate", "model.layers.3.mlp.gate"));
        assert!(!fnmatch("*mlp.gate", "model.layers.3.mlp.gate_proj"));
        assert!(fnmatch("lm_head", "lm_head"));
        assert!(!fnmatch("lm_head", "lm_head2"));
        assert!(fnmatch("model.layers.?.mlp", "model.layers.7.mlp"));
        assert!(!fnmatch("model.layers.?.mlp", "model.layers.17.mlp"));
        assert!(fnmatch("model.layers.[0-2].mlp*", "model.layers.1.mlp.up_proj"));
        assert!(!fnmatch("model.layers.[!0-2].mlp*", "model.layers.1.mlp.up_proj"));
        assert!(fnmatch("a[b", "a[b"));
    }

    #[test]
    fn component_rule_for_dotless_patterns() {
        let pats = vec!["lm_head".to_string(), "model.layers.78*".to_string()];
        assert_eq!(module_excluded("lm_head", &pats), Some("lm_head"));
        assert_eq!(module_excluded("model.layers.78.mlp.experts.0.up_proj", &pats), Some("model.layers.78*"));
        assert_eq!(module_excluded("model.layers.7.mlp.experts.0.up_proj", &pats), None);
        let pats = vec!["self_attn".to_string()];
        assert!(module_excluded("model.layers.0.self_attn.q_a_proj", &pats).is_some());
    }
}
