//! PTX parser for the subset kiln emits: module directives, `.entry` kernels with `.param`
//! lists, `.reg` declarations (incl. `%r<N>` ranges), `.shared` arrays, nested `{}` scopes,
//! labels and (predicated) instructions. Instructions are handed to `decode` for lowering.

use super::decode::{decode, DecodeCtx};
use super::ir::{Inst, Sreg, Ty};
use super::lexer::{lex, Tok, Token};
use super::EmuError;
use std::collections::HashMap;

/// A parsed PTX module.
#[derive(Debug)]
pub struct Module {
    pub file: String,
    pub version: Option<String>,
    pub targets: Vec<String>,
    pub address_size: u32,
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub offset: usize,
    pub size: usize,
    /// Scalar type, or `None` for `.b8 name[N]` byte arrays.
    pub ty: Option<Ty>,
}

#[derive(Clone, Debug)]
pub struct RegInfo {
    pub name: String,
    pub ty: Ty,
}

/// One `.entry` kernel.
#[derive(Debug)]
pub struct Entry {
    pub name: String,
    pub line: u32,
    pub params: Vec<Param>,
    pub param_bytes: usize,
    pub regs: Vec<RegInfo>,
    /// Bit width of each register (mask applied on every write).
    pub reg_bits: Vec<u32>,
    /// Bytes of statically declared shared memory (module and entry scope).
    pub shared_static: usize,
    /// Offset of `.extern .shared` (dynamic) arrays, if declared.
    pub dynamic_shared_offset: usize,
    pub reqntid: Option<[u32; 3]>,
    pub maxntid: Option<[u32; 3]>,
    pub insts: Vec<Inst>,
}

impl Module {
    /// Parses PTX text; `file` names the source in error messages.
    pub fn parse(src: &str, file: &str) -> Result<Module, EmuError> {
        let toks = lex(src).map_err(|e| EmuError::Parse { file: file.to_string(), line: e.line, msg: e.msg })?;
        let mut p = Parser { toks, pos: 0, file: file.to_string(), src };
        p.module()
    }

    pub fn entry(&self, name: &str) -> Result<&Entry, EmuError> {
        self.entries.iter().find(|e| e.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
            EmuError::Launch(format!("{}: no entry named '{name}' (entries: {})", self.file, if names.is_empty() { "none".to_string() } else { names.join(", ") }))
        })
    }
}

/// Raw operand as written, with registers already resolved against the scope.
#[derive(Clone, Debug, PartialEq)]
pub enum ROp {
    Reg(u32),
    NotReg(u32),
    Special(Sreg),
    /// Label or variable name.
    Name(String),
    Int(i128),
    F32(u32),
    F64(u64),
    Float(f64),
    Vec(Vec<ROp>),
    Addr(RAddr),
    /// `d|p`
    Pipe(Box<ROp>, Box<ROp>),
    Sink,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RAddr {
    pub base: Option<RBase>,
    pub offset: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RBase {
    Reg(u32),
    Name(String),
}

/// An instruction before lowering.
#[derive(Clone, Debug)]
pub struct RawInst {
    pub opcode: String,
    pub guard: Option<(u32, bool)>,
    pub ops: Vec<ROp>,
    pub line: u32,
    pub text: String,
}

#[derive(Clone, Copy)]
struct SharedVar {
    offset: usize,
}

struct Parser<'a> {
    toks: Vec<Token>,
    pos: usize,
    file: String,
    src: &'a str,
}

/// Per-entry parsing state.
#[derive(Default)]
struct Body {
    regs: Vec<RegInfo>,
    scopes: Vec<HashMap<String, u32>>,
    shared: HashMap<String, SharedVar>,
    shared_size: usize,
    dynamic: Vec<(String, usize)>,
    dynamic_align: usize,
    labels: HashMap<String, u32>,
    raw: Vec<RawInst>,
}

impl Body {
    fn lookup(&self, name: &str) -> Option<u32> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }
}

impl<'a> Parser<'a> {
    fn err<T>(&self, line: u32, msg: impl Into<String>) -> Result<T, EmuError> {
        Err(EmuError::Parse { file: self.file.clone(), line, msg: msg.into() })
    }

    fn line(&self) -> u32 {
        self.toks.get(self.pos).or(self.toks.last()).map(|t| t.line).unwrap_or(1)
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.tok)
    }

    fn peek_at(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.pos + k).map(|t| &t.tok)
    }

    fn next(&mut self) -> Result<Tok, EmuError> {
        match self.toks.get(self.pos) {
            Some(t) => {
                self.pos += 1;
                Ok(t.tok.clone())
            }
            None => self.err(self.line(), "unexpected end of file"),
        }
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Punct(c))
    }

    fn expect_punct(&mut self, c: char) -> Result<(), EmuError> {
        let line = self.line();
        match self.next()? {
            Tok::Punct(x) if x == c => Ok(()),
            t => self.err(line, format!("expected '{c}', found {}", show(&t))),
        }
    }

    fn ident(&mut self) -> Result<String, EmuError> {
        let line = self.line();
        match self.next()? {
            Tok::Ident(s) => Ok(s),
            t => self.err(line, format!("expected a name, found {}", show(&t))),
        }
    }

    fn uint(&mut self) -> Result<u64, EmuError> {
        let line = self.line();
        match self.next()? {
            Tok::Int(v) => Ok(v),
            t => self.err(line, format!("expected an integer, found {}", show(&t))),
        }
    }

    /// Skips the rest of the current source line (for `.loc`, `.file`).
    fn skip_line(&mut self, line: u32) {
        while self.toks.get(self.pos).is_some_and(|t| t.line == line) {
            self.pos += 1;
        }
    }

    fn module(&mut self) -> Result<Module, EmuError> {
        let mut m = Module { file: self.file.clone(), version: None, targets: Vec::new(), address_size: 64, entries: Vec::new() };
        let mut module_shared: Vec<(String, usize, usize, u32)> = Vec::new();
        let mut pending_visibility = false;
        while let Some(tok) = self.peek().cloned() {
            let line = self.line();
            let Tok::Ident(word) = tok else {
                return self.err(line, format!("unexpected {} at module scope", show(&tok)));
            };
            self.pos += 1;
            match word.as_str() {
                ".version" => {
                    let t = self.next()?;
                    if !matches!(t, Tok::Float(_) | Tok::Int(_)) {
                        return self.err(line, format!("bad .version {}", show(&t)));
                    }
                    let tk = &self.toks[self.pos - 1];
                    m.version = Some(self.src[tk.start..tk.end].to_string());
                }
                ".target" => loop {
                    m.targets.push(self.ident()?);
                    if !self.is_punct(',') {
                        break;
                    }
                    self.pos += 1;
                },
                ".address_size" => {
                    let v = self.uint()?;
                    if v != 64 {
                        return self.err(line, format!(".address_size {v} is not supported (only 64)"));
                    }
                    m.address_size = 64;
                }
                ".visible" | ".weak" => pending_visibility = true,
                ".extern" => {
                    // `.extern .shared` at module scope: dynamic shared memory.
                    if self.peek() == Some(&Tok::Ident(".shared".into())) {
                        self.pos += 1;
                        let (name, size, align) = self.var_decl(line)?;
                        if size != 0 {
                            return self.err(line, "`.extern .shared` arrays must be no_size (`name[]`)");
                        }
                        module_shared.push((name, usize::MAX, align, line));
                    } else {
                        pending_visibility = true;
                    }
                }
                ".entry" => {
                    let e = self.entry(line, &module_shared)?;
                    if m.entries.iter().any(|x| x.name == e.name) {
                        return self.err(line, format!("duplicate entry '{}'", e.name));
                    }
                    m.entries.push(e);
                    pending_visibility = false;
                }
                ".shared" => {
                    let (name, size, align) = self.var_decl(line)?;
                    module_shared.push((name, size, align, line));
                }
                ".file" | ".loc" | ".section" => self.skip_line(line),
                ".pragma" => {
                    self.next()?;
                    self.expect_punct(';')?;
                }
                ".func" => return self.err(line, "`.func` (device functions / call) is not supported by the emulator"),
                ".global" | ".const" | ".local" => return self.err(line, format!("module-scope `{word}` variables are not supported by the emulator")),
                _ => return self.err(line, format!("unsupported module directive '{word}'")),
            }
        }
        let _ = pending_visibility;
        Ok(m)
    }

    /// `[.align N] .type name[N][M]... [= init]` ; returns (name, bytes, align). `name[]` gives 0.
    fn var_decl(&mut self, line: u32) -> Result<(String, usize, usize), EmuError> {
        let mut align = 0usize;
        let mut elem = 0usize;
        loop {
            let w = self.ident()?;
            match w.as_str() {
                ".align" => align = self.uint()? as usize,
                _ if w.starts_with('.') => {
                    let ty = Ty::parse(&w[1..]).filter(|t| *t != Ty::Pred);
                    let Some(ty) = ty else {
                        return self.err(line, format!("unsupported variable type '{w}'"));
                    };
                    elem = ty.bytes() as usize;
                }
                _ => {
                    if elem == 0 {
                        return self.err(line, format!("variable '{w}' has no type"));
                    }
                    let mut count = 1usize;
                    let mut no_size = false;
                    while self.is_punct('[') {
                        self.pos += 1;
                        if self.is_punct(']') {
                            no_size = true;
                        } else {
                            let n = self.uint()?;
                            count = count.checked_mul(n as usize).filter(|c| c.saturating_mul(elem) <= 1 << 32).ok_or_else(|| EmuError::Parse {
                                file: self.file.clone(),
                                line,
                                msg: format!("variable '{w}' is too large"),
                            })?;
                        }
                        self.expect_punct(']')?;
                    }
                    if self.is_punct('=') {
                        return self.err(line, "initialised shared variables are not supported (shared memory has no initialiser in PTX)");
                    }
                    self.expect_punct(';')?;
                    if align == 0 {
                        align = elem;
                    }
                    return Ok((w, if no_size { 0 } else { count * elem }, align));
                }
            }
        }
    }

    fn entry(&mut self, line: u32, module_shared: &[(String, usize, usize, u32)]) -> Result<Entry, EmuError> {
        let name = self.ident()?;
        let mut params = Vec::new();
        let mut off = 0usize;
        self.expect_punct('(')?;
        while !self.is_punct(')') {
            let pl = self.line();
            if self.ident()? != ".param" {
                return self.err(pl, "expected `.param`");
            }
            let mut align = 0usize;
            let mut ty = None;
            let pname = loop {
                let w = self.ident()?;
                match w.as_str() {
                    ".align" => align = self.uint()? as usize,
                    ".ptr" | ".global" | ".shared" | ".const" | ".local" => {}
                    _ if w.starts_with('.') => match Ty::parse(&w[1..]) {
                        Some(t) if t != Ty::Pred => ty = Some(t),
                        _ => return self.err(pl, format!("unsupported parameter type '{w}'")),
                    },
                    _ => break w,
                }
            };
            let Some(t) = ty else {
                return self.err(pl, format!("parameter '{pname}' has no type"));
            };
            let mut size = t.bytes() as usize;
            let mut scalar = Some(t);
            if self.is_punct('[') {
                self.pos += 1;
                let n = self.uint()?;
                self.expect_punct(']')?;
                if n > 1 << 16 {
                    return self.err(pl, format!("parameter '{pname}' is too large"));
                }
                size *= n as usize;
                scalar = None;
            }
            if align == 0 {
                align = t.bytes() as usize;
            }
            off = off.next_multiple_of(align.max(1));
            params.push(Param { name: pname, offset: off, size, ty: scalar });
            off += size;
            if self.is_punct(',') {
                self.pos += 1;
            }
        }
        self.expect_punct(')')?;
        let mut reqntid = None;
        let mut maxntid = None;
        while let Some(Tok::Ident(w)) = self.peek().cloned() {
            let dl = self.line();
            self.pos += 1;
            match w.as_str() {
                ".maxntid" | ".reqntid" => {
                    let mut v = [1u32; 3];
                    for (i, slot) in v.iter_mut().enumerate() {
                        if i > 0 {
                            if !self.is_punct(',') {
                                break;
                            }
                            self.pos += 1;
                        }
                        *slot = self.uint()? as u32;
                    }
                    if w == ".maxntid" {
                        maxntid = Some(v);
                    } else {
                        reqntid = Some(v);
                    }
                }
                ".minnctapersm" | ".maxnreg" | ".maxnctapersm" | ".maxclusterrank" => {
                    self.uint()?;
                }
                ".reqnctapercluster" | ".explicitcluster" => {
                    while !self.is_punct('{') && self.peek().is_some() {
                        self.pos += 1;
                    }
                }
                ".noreturn" => {}
                ".pragma" => {
                    self.next()?;
                    self.expect_punct(';')?;
                }
                _ => return self.err(dl, format!("unsupported entry directive '{w}'")),
            }
        }
        let mut body = Body::default();
        // Module-scope shared variables come first.
        for (n, size, align, l) in module_shared {
            self.add_shared(&mut body, n, *size, *align, *l)?;
        }
        self.expect_punct('{')?;
        body.scopes.push(HashMap::new());
        self.block(&mut body)?;
        let dyn_off = body.shared_size.next_multiple_of(body.dynamic_align.max(16));
        for (n, _) in &body.dynamic {
            body.shared.insert(n.clone(), SharedVar { offset: dyn_off });
        }
        let mut shared_syms = HashMap::new();
        for (k, v) in &body.shared {
            shared_syms.insert(k.clone(), v.offset as u64);
        }
        let param_syms: HashMap<String, u64> = params.iter().map(|p: &Param| (p.name.clone(), p.offset as u64)).collect();
        let reg_tys: Vec<Ty> = body.regs.iter().map(|r| r.ty).collect();
        let ctx = DecodeCtx { labels: &body.labels, shared: &shared_syms, params: &param_syms, reg_tys: &reg_tys };
        let mut insts = Vec::with_capacity(body.raw.len());
        for raw in &body.raw {
            insts.push(decode(raw, &ctx).map_err(|msg| EmuError::Parse { file: self.file.clone(), line: raw.line, msg: format!("`{}`: {msg}", raw.text) })?);
        }
        let reg_bits = body.regs.iter().map(|r| r.ty.bits()).collect();
        Ok(Entry { name, line, params, param_bytes: off, regs: body.regs, reg_bits, shared_static: body.shared_size, dynamic_shared_offset: dyn_off, reqntid, maxntid, insts })
    }

    fn add_shared(&self, body: &mut Body, name: &str, size: usize, align: usize, line: u32) -> Result<(), EmuError> {
        if body.shared.contains_key(name) || body.dynamic.iter().any(|(n, _)| n == name) {
            return self.err(line, format!("duplicate shared variable '{name}'"));
        }
        if size == usize::MAX || size == 0 {
            body.dynamic.push((name.to_string(), align));
            body.dynamic_align = body.dynamic_align.max(align);
            return Ok(());
        }
        let off = body.shared_size.next_multiple_of(align.max(1));
        body.shared.insert(name.to_string(), SharedVar { offset: off });
        body.shared_size = off + size;
        Ok(())
    }

    /// Statements until the closing `}` of the current scope.
    fn block(&mut self, body: &mut Body) -> Result<(), EmuError> {
        loop {
            let line = self.line();
            let Some(tok) = self.peek().cloned() else {
                return self.err(line, "missing '}' at end of kernel body");
            };
            match tok {
                Tok::Punct('}') => {
                    self.pos += 1;
                    body.scopes.pop();
                    return Ok(());
                }
                Tok::Punct('{') => {
                    self.pos += 1;
                    body.scopes.push(HashMap::new());
                    self.block(body)?;
                }
                Tok::Punct('@') => self.instruction(body)?,
                Tok::Ident(w) => {
                    if self.peek_at(1) == Some(&Tok::Punct(':')) && !w.starts_with('.') {
                        self.pos += 2;
                        if body.labels.insert(w.clone(), body.raw.len() as u32).is_some() {
                            return self.err(line, format!("duplicate label '{w}'"));
                        }
                        continue;
                    }
                    match w.as_str() {
                        ".reg" => {
                            self.pos += 1;
                            self.reg_decl(body, line)?;
                        }
                        ".shared" => {
                            self.pos += 1;
                            let (n, size, align) = self.var_decl(line)?;
                            if size == 0 {
                                return self.err(line, format!("shared array '{n}' has no size (use `.extern .shared` for dynamic shared memory)"));
                            }
                            self.add_shared(body, &n, size, align, line)?;
                        }
                        ".extern" => {
                            self.pos += 1;
                            if self.ident()? != ".shared" {
                                return self.err(line, "only `.extern .shared` is supported inside a kernel");
                            }
                            let (n, size, align) = self.var_decl(line)?;
                            if size != 0 {
                                return self.err(line, "`.extern .shared` arrays must be no_size (`name[]`)");
                            }
                            self.add_shared(body, &n, usize::MAX, align, line)?;
                        }
                        ".local" => return self.err(line, "`.local` variables are not supported by the emulator"),
                        ".param" => return self.err(line, "`.param` variables inside a kernel (call) are not supported"),
                        ".pragma" => {
                            self.pos += 1;
                            self.next()?;
                            self.expect_punct(';')?;
                        }
                        ".loc" | ".file" => {
                            self.pos += 1;
                            self.skip_line(line);
                        }
                        _ if w.starts_with('.') => return self.err(line, format!("unsupported directive '{w}' in kernel body")),
                        _ => self.instruction(body)?,
                    }
                }
                t => return self.err(line, format!("unexpected {}", show(&t))),
            }
        }
    }

    fn reg_decl(&mut self, body: &mut Body, line: u32) -> Result<(), EmuError> {
        let tw = self.ident()?;
        if tw == ".v2" || tw == ".v4" {
            return self.err(line, "vector register declarations (`.reg .v4 ...`) are not supported");
        }
        let Some(ty) = tw.strip_prefix('.').and_then(Ty::parse) else {
            return self.err(line, format!("unsupported register type '{tw}'"));
        };
        loop {
            let name = self.ident()?;
            if name.starts_with('.') {
                return self.err(line, format!("unexpected '{name}' in .reg declaration"));
            }
            let scope = body.scopes.last_mut().expect("scope stack is never empty inside a body");
            if self.is_punct('<') {
                self.pos += 1;
                let n = self.uint()?;
                self.expect_punct('>')?;
                if n > 1 << 20 {
                    return self.err(line, format!("register range {name}<{n}> is too large"));
                }
                for i in 0..n {
                    let full = format!("{name}{i}");
                    reserved_check(&full).or_else(|e| self.err(line, e))?;
                    scope.insert(full.clone(), body.regs.len() as u32);
                    body.regs.push(RegInfo { name: full, ty });
                }
            } else {
                reserved_check(&name).or_else(|e| self.err(line, e))?;
                scope.insert(name.clone(), body.regs.len() as u32);
                body.regs.push(RegInfo { name, ty });
            }
            if self.is_punct(',') {
                self.pos += 1;
                continue;
            }
            self.expect_punct(';')?;
            return Ok(());
        }
    }

    fn instruction(&mut self, body: &mut Body) -> Result<(), EmuError> {
        let line = self.line();
        let start = self.toks[self.pos].start;
        let mut guard = None;
        if self.is_punct('@') {
            self.pos += 1;
            let neg = if self.is_punct('!') {
                self.pos += 1;
                true
            } else {
                false
            };
            let p = self.ident()?;
            let Some(r) = body.lookup(&p) else {
                return self.err(line, format!("undeclared predicate register '{p}'"));
            };
            if body.regs[r as usize].ty != Ty::Pred {
                return self.err(line, format!("guard '{p}' is not a .pred register"));
            }
            guard = Some((r, neg));
        }
        let opcode = self.ident()?;
        let mut ops = Vec::new();
        if !self.is_punct(';') {
            loop {
                ops.push(self.operand(body)?);
                if self.is_punct(',') {
                    self.pos += 1;
                    continue;
                }
                break;
            }
        }
        let end_line = self.line();
        if !self.is_punct(';') {
            let t = self.peek().cloned();
            return self.err(end_line, format!("expected ';' after `{opcode}` operands, found {}", t.as_ref().map(show).unwrap_or_else(|| "end of file".into())));
        }
        let end = self.toks[self.pos].end;
        self.pos += 1;
        let text = self.src[start..end].split_whitespace().collect::<Vec<_>>().join(" ");
        body.raw.push(RawInst { opcode, guard, ops, line, text });
        Ok(())
    }

    fn name_operand(&self, body: &Body, name: String) -> ROp {
        if name == "_" {
            return ROp::Sink;
        }
        if let Some(r) = body.lookup(&name) {
            return ROp::Reg(r);
        }
        if name.starts_with('%') {
            if let Some(s) = Sreg::parse(&name) {
                return ROp::Special(s);
            }
        }
        ROp::Name(name)
    }

    fn operand(&mut self, body: &Body) -> Result<ROp, EmuError> {
        let line = self.line();
        let t = self.next()?;
        let op = match t {
            Tok::Punct('{') => {
                let mut v = Vec::new();
                while !self.is_punct('}') {
                    v.push(self.operand(body)?);
                    if self.is_punct(',') {
                        self.pos += 1;
                    } else if !self.is_punct('}') {
                        return self.err(line, "expected ',' or '}' in vector operand");
                    }
                }
                self.pos += 1;
                ROp::Vec(v)
            }
            Tok::Punct('[') => {
                let mut a = RAddr { base: None, offset: 0 };
                match self.next()? {
                    Tok::Ident(n) => {
                        a.base = Some(match self.name_operand(body, n.clone()) {
                            ROp::Reg(r) => RBase::Reg(r),
                            ROp::Name(n) => RBase::Name(n),
                            _ => return self.err(line, format!("'{n}' cannot be used as an address")),
                        });
                        while self.is_punct('+') || self.is_punct('-') {
                            let neg = self.is_punct('-');
                            self.pos += 1;
                            let neg2 = if self.is_punct('-') {
                                self.pos += 1;
                                true
                            } else {
                                false
                            };
                            let v = self.uint()? as i64;
                            a.offset += if neg ^ neg2 { -v } else { v };
                        }
                    }
                    Tok::Int(v) => a.offset = v as i64,
                    t => return self.err(line, format!("bad address operand {}", show(&t))),
                }
                self.expect_punct(']')?;
                ROp::Addr(a)
            }
            Tok::Punct('!') => {
                let n = self.ident()?;
                match body.lookup(&n) {
                    Some(r) => ROp::NotReg(r),
                    None => return self.err(line, format!("undeclared predicate register '{n}'")),
                }
            }
            Tok::Punct('-') => match self.next()? {
                Tok::Int(v) => ROp::Int(-(v as i128)),
                Tok::Float(f) => ROp::Float(-f),
                Tok::F32(b) => ROp::F32(b ^ 0x8000_0000),
                Tok::F64(b) => ROp::F64(b ^ (1 << 63)),
                t => return self.err(line, format!("bad operand -{}", show(&t))),
            },
            Tok::Int(v) => ROp::Int(v as i128),
            Tok::F32(b) => ROp::F32(b),
            Tok::F64(b) => ROp::F64(b),
            Tok::Float(f) => ROp::Float(f),
            Tok::Ident(n) => {
                if n.starts_with('%') && body.lookup(&n).is_none() && Sreg::parse(&n).is_none() {
                    return self.err(line, format!("undeclared register '{n}'"));
                }
                self.name_operand(body, n)
            }
            t => return self.err(line, format!("unexpected {} in operand list", show(&t))),
        };
        if self.is_punct('|') {
            self.pos += 1;
            let second = self.operand(body)?;
            return Ok(ROp::Pipe(Box::new(op), Box::new(second)));
        }
        Ok(op)
    }
}

/// Names PTX reserves for special registers (ISA §10). ptxas accepts a `.reg` of such a name
/// and then reads the special register where the kernel uses it: `%pm1` declared as a predicate
/// read performance counter 1 on an H200 (a split NVFP4 GEMM then dropped half its rows) while
/// this emulator used the declared register. So a declaration of one is an error here.
fn reserved_check(name: &str) -> Result<(), String> {
    let Some(bare) = name.strip_prefix('%') else { return Ok(()) };
    let numbered = |prefix: &str, below: u32| bare.strip_prefix(prefix).and_then(|n| n.parse::<u32>().ok()).is_some_and(|n| n < below);
    let fixed = [
        "tid", "ntid", "laneid", "warpid", "nwarpid", "ctaid", "nctaid", "smid", "nsmid", "gridid", "is_explicit_cluster", "clusterid", "nclusterid",
        "cluster_ctaid", "cluster_nctaid", "cluster_ctarank", "cluster_nctarank", "lanemask_eq", "lanemask_le", "lanemask_lt", "lanemask_ge",
        "lanemask_gt", "clock", "clock_hi", "clock64", "globaltimer", "globaltimer_lo", "globaltimer_hi", "total_smem_size", "aggr_smem_size",
        "dynamic_smem_size", "current_graph_exec", "reserved_smem_offset_begin", "reserved_smem_offset_end", "reserved_smem_offset_cap",
    ];
    let counter = bare.strip_suffix("_64").unwrap_or(bare);
    let reserved = fixed.contains(&bare)
        || (counter.len() == 3 && counter.starts_with("pm") && counter.as_bytes()[2].is_ascii_digit() && counter.as_bytes()[2] < b'8')
        || numbered("envreg", 32)
        || numbered("reserved_smem_offset_", 2);
    if reserved {
        return Err(format!("register '{name}' is the name of PTX's special register {name}: ptxas reads the special register where the kernel uses it (rename the register)"));
    }
    Ok(())
}

fn show(t: &Tok) -> String {
    match t {
        Tok::Ident(s) => format!("'{s}'"),
        Tok::Int(v) => format!("'{v}'"),
        Tok::F32(b) => format!("'0f{b:08X}'"),
        Tok::F64(b) => format!("'0d{b:016X}'"),
        Tok::Float(f) => format!("'{f}'"),
        Tok::Str(s) => format!("\"{s}\""),
        Tok::Punct(c) => format!("'{c}'"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Op, Operand, Symbol};

    const HEAD: &str = ".version 8.7\n.target sm_120a\n.address_size 64\n";

    #[test]
    fn registers_scopes_params_shared_and_labels() {
        let src = format!(
            "{HEAD}.extern .shared .align 16 .b8 dyn[];\n.visible .entry k(.param .u32 n, .param .align 16 .b8 blob[24], .param .u64 p)\n.maxntid 128, 1, 1\n{{\n\
             .reg .b32 %r<100>;\n .reg .pred %p;\n .shared .align 8 .b8 a[12];\n .shared .b32 b[3];\n\
             {{ .reg .b8 t; mov.b32 %r1, {{t, t, t, t}}; }}\n{{ .reg .b16 t; mov.b32 %r2, {{t, t}}; }}\n\
             L0: @!%p bra L0;\n mov.u32 %r99, b;\n ret;\n}}\n"
        );
        let m = Module::parse(&src, "t.ptx").unwrap();
        let e = m.entry("k").unwrap();
        assert_eq!(m.version.as_deref(), Some("8.7"));
        assert_eq!(m.targets, vec!["sm_120a".to_string()]);
        // 100 + %p + two scoped `t` registers with different widths.
        assert_eq!(e.regs.len(), 103);
        assert_eq!(e.regs[101].ty, Ty::B8);
        assert_eq!(e.regs[102].ty, Ty::B16);
        let offs: Vec<(usize, usize)> = e.params.iter().map(|p| (p.offset, p.size)).collect();
        assert_eq!(offs, vec![(0, 4), (16, 24), (40, 8)]);
        assert_eq!(e.param_bytes, 48);
        // a at 0 (12 B), b aligned to 4 at 12; dynamic shared memory after, 16-aligned.
        assert_eq!(e.shared_static, 24);
        assert_eq!(e.dynamic_shared_offset, 32);
        assert_eq!(e.maxntid, Some([128, 1, 1]));
        assert_eq!(e.insts.len(), 5);
        assert!(matches!(e.insts[2].op, Op::Bra { target: 2, .. }));
        assert_eq!(e.insts[2].guard, Some((100, true)));
        assert!(matches!(e.insts[3].op, Op::Mov { a: Operand::Sym(Symbol::Shared(12)), .. }));
        assert_eq!(e.insts[0].line, 12);
    }

    #[test]
    fn unknown_things_are_errors_with_lines() {
        let bad = |body: &str| Module::parse(&format!("{HEAD}.visible .entry k()\n{{\n{body}\n}}\n"), "b.ptx").unwrap_err().to_string();
        assert!(
            bad(".reg .b32 %r<2>;\nld.global.L2::cache_hint.u32 %r1, [%r0];").contains("b.ptx:7: `ld.global.L2::cache_hint.u32 %r1, [%r0];`: unsupported modifier .L2::cache_hint")
        );
        // ptxas takes these as the special registers, whatever the declaration says
        assert!(bad(".reg .pred %pm<4>;").contains("register '%pm0' is the name of PTX's special register %pm0"));
        assert!(bad(".reg .b64 %pm3_64;").contains("'%pm3_64'"));
        assert!(bad(".reg .b32 %clock;").contains("'%clock'"));
        assert!(bad(".reg .b32 %envreg<32>;").contains("'%envreg0'"));
        assert!(Module::parse(&format!("{HEAD}.visible .entry k()\n{{\n.reg .pred %pm8, %pmx, %prow<4>;\n.reg .b32 %envreg32, %clocks;\nret;\n}}\n"), "ok.ptx").is_ok());
        assert!(bad(".local .b8 stack[16];").contains("b.ptx:6: `.local` variables are not supported"));
        assert!(bad(".reg .b32 %r<2>;\nL: ret;\nL: ret;").contains("duplicate label 'L'"));
        assert!(bad(".reg .b32 %r<2>;\nadd.u32 %r1, %r0;").contains("expected 3 operands, found 2"));
        assert!(bad(".reg .b32 %r<2>;\nshfl.idx.b32 %r1, %r0, 0, 0x1f;").contains("only shfl.sync"));
        let e = Module::parse(&format!("{HEAD}.func f()\n{{\nret;\n}}\n"), "f.ptx").unwrap_err().to_string();
        assert!(e.contains("f.ptx:4:") && e.contains(".func"), "{e}");
    }
}
