//! The quantization kinds a model can be loaded with (the names Python passes as `quantize=`),
//! and which storage each weight matrix gets under each kind: one table (`KINDS`, `Quantize::storage`),
//! which Python's list of schemes (`contract/quant.py`: its names, and the roles each keeps at 8 bits) must
//! equal (`rust_runtime.QUANTIZE_NAMES`, `rust_runtime.QUANTIZE_PLAN`, tests/test_rust_runtime.py).
//!
//! * `none`: every matrix f32 (packed, `kernels::PackedF32`).
//! * `q8_0`: every matrix q8_0, the lm_head (tied or not) included. `int8` is its old name, still
//!   accepted (`ALIASES`, with a deprecation line), as `contract/quant.py`'s `ALIASES` says.
//! * `q4_0`: every matrix q4_0, the embedding and lm_head included (what a pure GGUF Q4_0 holds).
//! * `q4_mix`: in the spirit of llama.cpp's Q4_K_M: q4_0 for q/k/o/gate/up, and q8_0 for the
//!   matrices where 4 bits cost the most: the embedding and lm_head, v_proj and down_proj
//!   (llama.cpp gives its output, and half of attn_v and ffn_down, 6 bits). The same blocks of 32 as
//!   q4_0 and q8_0, so ONNX's `MatMulNBits` form computes from the same numbers.
//!
//! GGML's q4_K (`BlockKind::Q4K`, super-blocks of 256) has kernels too (`kernels::int`, `kernels::qblocks`)
//! but no name: contract.quant has no Rust scheme that uses it.

use crate::error::{Error, Result};
use crate::kernels::int::{bits_per_weight, BlockKind};

/// How the weights of a model are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    None,
    Q8_0,
    Q4_0,
    Q4Mix,
}

/// Every kind and its name, in the order Python lists them (`rust_runtime.QUANTIZE_NAMES`).
pub const KINDS: [(&str, Quantize); 4] =
    [("none", Quantize::None), ("q8_0", Quantize::Q8_0), ("q4_0", Quantize::Q4_0), ("q4_mix", Quantize::Q4Mix)];

/// Old names still accepted, each the same numeric form as the kind it names (`rust_runtime.QUANTIZE_ALIASES`,
/// equal to `contract/quant.py`'s `ALIASES`).
pub const ALIASES: [(&str, &str); 1] = [("int8", "q8_0")];

/// What a weight matrix is in the model, by its Hugging Face name (`model.layers.N.self_attn.q_proj.weight`
/// → `QProj`): the unit `Quantize::storage` decides on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    EmbedTokens,
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
    LmHead,
}

/// Every role, in Python's order (`contract.quant.ROLES`).
pub const ROLES: [Role; 9] = [
    Role::EmbedTokens,
    Role::QProj,
    Role::KProj,
    Role::VProj,
    Role::OProj,
    Role::GateProj,
    Role::UpProj,
    Role::DownProj,
    Role::LmHead,
];

impl Role {
    /// The Hugging Face name part (`q_proj`, `lm_head`, ...), as Python spells the role.
    pub fn name(self) -> &'static str {
        match self {
            Role::EmbedTokens => "embed_tokens",
            Role::QProj => "q_proj",
            Role::KProj => "k_proj",
            Role::VProj => "v_proj",
            Role::OProj => "o_proj",
            Role::GateProj => "gate_proj",
            Role::UpProj => "up_proj",
            Role::DownProj => "down_proj",
            Role::LmHead => "lm_head",
        }
    }
}

impl Quantize {
    /// `None` / "none" → f32; any name of `KINDS` (case and surrounding spaces ignored), or an old name of
    /// `ALIASES` (see `parse_noted`). An unknown name is an `InvalidArgument` that lists the known ones.
    pub fn parse(s: Option<&str>) -> Result<Self> {
        Self::parse_noted(s).map(|(q, _)| q)
    }

    /// The one parser: `parse`'s kind, and for an old name of `ALIASES` the deprecation line to show
    /// ("quantize 'int8' is deprecated: use 'q8_0'", as Python's `contract.quant.parse` logs it).
    pub fn parse_noted(s: Option<&str>) -> Result<(Self, Option<String>)> {
        let Some(s) = s else { return Ok((Quantize::None, None)) };
        let key = s.trim().to_ascii_lowercase();
        let (key, note) = match ALIASES.iter().find(|(old, _)| *old == key) {
            Some((old, new)) => (new.to_string(), Some(format!("quantize '{old}' is deprecated: use '{new}'"))),
            None => (key, None),
        };
        let q = KINDS.iter().find(|(n, _)| *n == key).map(|(_, q)| *q).ok_or_else(|| {
            let names: Vec<String> = KINDS.iter().map(|(n, _)| format!("{n:?}")).collect();
            Error::arg(format!("quantize is {s:?}; expected one of {}", names.join(", ")))
        })?;
        Ok((q, note))
    }

    pub fn name(&self) -> &'static str {
        KINDS.iter().find(|(_, q)| q == self).map(|(n, _)| *n).unwrap_or("none")
    }

    /// How a matrix of `role` is stored: `None` for f32, else its block kind.
    pub fn storage(&self, role: Role) -> Option<BlockKind> {
        let kept = matches!(role, Role::EmbedTokens | Role::LmHead | Role::VProj | Role::DownProj);
        match self {
            Quantize::None => None,
            Quantize::Q8_0 => Some(BlockKind::Q8_0),
            Quantize::Q4Mix if kept => Some(BlockKind::Q8_0),
            Quantize::Q4_0 | Quantize::Q4Mix => Some(BlockKind::Q4_0),
        }
    }

    /// The storage of a tied embedding, which is the lm_head too: the finer of the two roles'.
    pub fn tied_storage(&self) -> Option<BlockKind> {
        match (self.storage(Role::EmbedTokens), self.storage(Role::LmHead)) {
            (None, _) | (_, None) => None,
            (Some(a), Some(b)) => Some(if bits_per_weight(a) >= bits_per_weight(b) { a } else { b }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known_ones() {
        for (n, q) in KINDS {
            assert_eq!(Quantize::parse(Some(n)).unwrap(), q);
            assert_eq!(q.name(), n);
            assert_eq!(Quantize::parse(Some(&format!(" {} ", n.to_uppercase()))).unwrap(), q);
        }
        assert_eq!(Quantize::parse(None).unwrap(), Quantize::None);
        let e = Quantize::parse(Some("int3")).unwrap_err().to_string();
        assert!(e.contains("int3") && e.contains("\"q4_0\"") && e.contains("\"q8_0\""), "{e}");
        assert!(!e.contains("int8"), "{e}"); // the error lists the canonical names only
        assert!(Quantize::parse(Some("")).is_err());
        assert_eq!(Quantize::parse_noted(Some("q8_0")).unwrap(), (Quantize::Q8_0, None));
        let (q, note) = Quantize::parse_noted(Some(" INT8 ")).unwrap();
        assert_eq!((q, q.name()), (Quantize::Q8_0, "q8_0"));
        assert_eq!(note.as_deref(), Some("quantize 'int8' is deprecated: use 'q8_0'"));
    }

    #[test]
    fn the_4_bit_kinds_keep_the_sensitive_matrices_at_8_bits() {
        let at8 = |q: Quantize| -> Vec<&str> {
            ROLES.iter().filter(|r| q.storage(**r) == Some(BlockKind::Q8_0)).map(|r| r.name()).collect()
        };
        assert!(at8(Quantize::Q4_0).is_empty());
        assert_eq!(at8(Quantize::Q4Mix), ["embed_tokens", "v_proj", "down_proj", "lm_head"]);
        assert_eq!(at8(Quantize::Q8_0).len(), 9);
        assert!(ROLES.iter().all(|r| Quantize::None.storage(*r).is_none()));
        assert_eq!(Quantize::Q4_0.storage(Role::QProj), Some(BlockKind::Q4_0));
        assert_eq!(Quantize::Q4Mix.storage(Role::GateProj), Some(BlockKind::Q4_0));
        assert_eq!(Quantize::Q4Mix.tied_storage(), Some(BlockKind::Q8_0));
        assert_eq!(Quantize::Q4_0.tied_storage(), Some(BlockKind::Q4_0));
        assert_eq!(Quantize::None.tied_storage(), None);
    }
}

/// The module attributes that let Python hold its list of schemes to this one:
/// `QUANTIZE_NAMES` (a tuple, `KINDS`' order), `QUANTIZE_ALIASES` ({old name: name}) and `QUANTIZE_PLAN`
/// ({name: {role: "q8_0" | "q4_0" | None}}),
/// plus `int_simd_level` (the integer kernels' level, `kernels::int::int_level`).
#[cfg(feature = "python")]
pub fn register(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    use pyo3::prelude::*;
    use pyo3::types::{PyDict, PyTuple};
    let py = m.py();
    m.add("QUANTIZE_NAMES", PyTuple::new(py, KINDS.iter().map(|(n, _)| *n))?)?;
    let aliases = PyDict::new(py);
    for (old, new) in ALIASES {
        aliases.set_item(old, new)?;
    }
    m.add("QUANTIZE_ALIASES", aliases)?;
    let plan = PyDict::new(py);
    for (name, q) in KINDS {
        let roles = PyDict::new(py);
        for r in ROLES {
            roles.set_item(r.name(), q.storage(r).map(|k| k.name()))?;
        }
        plan.set_item(name, roles)?;
    }
    m.add("QUANTIZE_PLAN", plan)?;
    m.add("int_simd_level", format!("{:?}", crate::kernels::int::int_level()))?;
    Ok(())
}
