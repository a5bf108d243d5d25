//! Turns every `kernel-templates/*.ptx` header into typed Rust (proc-macro2 + quote): per
//! template a `…Params` struct (its shape constants, with `render()` to PTX) and a `…Args`
//! struct (its kernel arguments, in `.entry` order). The build fails when a template's header and
//! its `.entry` disagree, or when a placeholder names an undeclared parameter, so a template and
//! its use can never disagree silently. The generated file is included by `src/kernels/mod.rs`.

#[path = "src/kernels/template.rs"]
#[allow(dead_code)]
mod template;

use proc_macro2::{Ident, Span, TokenStream};
use quote::quote;
use std::path::Path;

fn camel(name: &str) -> String {
    name.split('_').map(|w| w[..1].to_ascii_uppercase() + &w[1..]).collect()
}

fn ident(s: &str) -> Ident {
    Ident::new(s, Span::call_site())
}

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernel-templates");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .collect();
    files.sort();
    let mut items = TokenStream::new();
    let mut names = Vec::new();
    for path in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (h, body) = template::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        template::check(&h, body).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        assert_eq!(h.name, stem, "{}: kiln-template must equal the file name", path.display());
        names.push(h.name.clone());
        let params = ident(&format!("{}Params", camel(&h.name)));
        let args = ident(&format!("{}Args", camel(&h.name)));
        let family = ident(&h.family);
        let (tname, entry, smem) = (&h.name, &h.entry, &h.smem);
        let doc = format!(" Shape parameters of `kernel-templates/{}.ptx`:{}", h.name, h.doc.iter().map(|d| format!(" {d}")).collect::<String>());
        let pfields: Vec<Ident> = h.params.iter().map(|(n, _)| ident(&n.to_ascii_lowercase())).collect();
        let pdocs: Vec<String> = h.params.iter().map(|(_, d)| format!(" {d}")).collect();
        let pnames: Vec<&str> = h.params.iter().map(|(n, _)| n.as_str()).collect();
        let afields: Vec<Ident> = h.args.iter().map(|(n, _, _)| ident(n)).collect();
        let adocs: Vec<String> = h
            .args
            .iter()
            .map(|(_, t, d)| if t == "rank_u32" { format!(" {d} (per rank: the launch passes `rank * this`)") } else { format!(" {d}") })
            .collect();
        let atypes: Vec<TokenStream> = h
            .args
            .iter()
            .map(|(_, t, _)| match t.as_str() {
                "ptr" => quote!(Ptr),
                "u32" | "rank_u32" => quote!(u32),
                _ => quote!(f32),
            })
            .collect();
        let aconv: Vec<TokenStream> = h
            .args
            .iter()
            .map(|(n, t, _)| {
                let f = ident(n);
                match t.as_str() {
                    "ptr" => quote!(self.#f.into()),
                    "u32" => quote!(LaunchArg::U32(self.#f)),
                    "rank_u32" => quote!(LaunchArg::PerRank(self.#f)),
                    _ => quote!(LaunchArg::F32(self.#f)),
                }
            })
            .collect();
        let anames: Vec<&str> = h.args.iter().map(|(n, _, _)| n.as_str()).collect();
        items.extend(quote! {
            #[doc = #doc]
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
            pub struct #params {
                #( #[doc = #pdocs] pub #pfields: u32, )*
            }

            impl #params {
                pub const TEMPLATE: &'static str = #tname;
                pub const ENTRY: &'static str = #entry;
                pub const FAMILY: KernelFamily = KernelFamily::#family;
                const SOURCE: &'static str = #body;

                /// `(NAME, value)` of every parameter, in header order.
                pub fn values(&self) -> Vec<(&'static str, u64)> {
                    vec![ #( (#pnames, self.#pfields as u64), )* ]
                }

                /// Dynamic shared memory per block of a launch, in bytes (the header's `smem`).
                pub fn dynamic_smem(&self) -> Result<u32, String> {
                    let v = template::eval_params(#smem, &self.values())?;
                    u32::try_from(v).map_err(|_| format!("dynamic shared memory {v} B"))
                }

                /// The PTX of this instance.
                pub fn render(&self) -> Result<String, String> {
                    template::render(Self::SOURCE, &self.values())
                }
            }

            impl KernelParams for #params {
                const TEMPLATE: &'static str = #tname;
                const ENTRY: &'static str = #entry;
                const FAMILY: KernelFamily = KernelFamily::#family;
                fn values(&self) -> Vec<(&'static str, u64)> {
                    #params::values(self)
                }
                fn dynamic_smem(&self) -> Result<u32, String> {
                    #params::dynamic_smem(self)
                }
                fn render(&self) -> Result<String, String> {
                    #params::render(self)
                }
            }

            /// Kernel arguments, in `.entry` order.
            #[derive(Debug, Clone, Copy, PartialEq)]
            pub struct #args {
                #( #[doc = #adocs] pub #afields: #atypes, )*
            }

            impl #args {
                pub const NAMES: &'static [&'static str] = &[ #(#anames),* ];

                pub fn launch_args(&self) -> Vec<LaunchArg> {
                    vec![ #(#aconv),* ]
                }
            }
        });
    }
    items.extend(quote! {
        /// Every template, by file stem.
        pub const TEMPLATES: &[&str] = &[ #(#names),* ];
    });
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.rs");
    std::fs::write(&out, items.to_string()).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}
