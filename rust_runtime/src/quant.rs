//! The quantization kinds a model can be loaded with (the names Python passes as `quantize=`),
//! and which storage each weight matrix gets under each kind. One table: `KINDS`.
//!
//! * `none`: every matrix f32 (packed, `kernels::PackedF32`).
//! * `int8`: every matrix q8_0, the lm_head (tied or not) included.
//! * `q4_0`: every matrix q4_0, the lm_head included (what a "pure" GGUF Q4_0 holds).
//! * `q4_mix`: q4_0 where 4 bits cost least, q8_0 where they cost most, in the spirit of llama.cpp's
//!   Q4_K_M (which keeps attn_v, ffn_down and the output at more bits): see `Quantize::storage`.
//!   The choice was measured on a trained `small` model (ΔNLL per tensor kind at 4 bits:
//!   `benchmarks/quant_mix.py`, `benchmarks/results/quant_mix.md`).

use crate::error::{Error, Result};
use crate::kernels_int::BlockKind;

/// How the weights of a model are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    None,
    Q8_0,
    Q4_0,
    Q4Mix,
}

/// Every kind and its name, in the order Python lists them (`rust_runtime.QUANTIZE_KINDS`).
pub const KINDS: [(&str, Quantize); 4] =
    [("none", Quantize::None), ("int8", Quantize::Q8_0), ("q4_0", Quantize::Q4_0), ("q4_mix", Quantize::Q4Mix)];

/// What a weight matrix is in the model: the unit `Quantize::storage` decides on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// self_attn.q_proj and k_proj
    AttnQk,
    AttnV,
    AttnO,
    /// mlp.gate_proj and up_proj
    MlpGateUp,
    MlpDown,
    /// lm_head, or the embedding it is tied to
    Head,
    /// model.embed_tokens of an untied model (only looked up, never multiplied)
    Embedding,
}

/// Every role, in the order of a layer then the model's ends.
pub const ROLES: [Role; 7] =
    [Role::AttnQk, Role::AttnV, Role::AttnO, Role::MlpGateUp, Role::MlpDown, Role::Head, Role::Embedding];

impl Role {
    /// The name used in errors and in `rust_runtime.quantize_plan`.
    pub fn name(self) -> &'static str {
        match self {
            Role::AttnQk => "attn_qk",
            Role::AttnV => "attn_v",
            Role::AttnO => "attn_o",
            Role::MlpGateUp => "mlp_gate_up",
            Role::MlpDown => "mlp_down",
            Role::Head => "lm_head",
            Role::Embedding => "embed_tokens",
        }
    }
}

impl Quantize {
    /// `None` / "none" → f32; any name of `KINDS` (case and surrounding spaces ignored). An unknown
    /// name is an `InvalidArgument` that lists the known ones.
    pub fn parse(s: Option<&str>) -> Result<Self> {
        let Some(s) = s else { return Ok(Quantize::None) };
        let key = s.trim().to_ascii_lowercase();
        KINDS.iter().find(|(n, _)| *n == key).map(|(_, q)| *q).ok_or_else(|| {
            let names: Vec<String> = KINDS.iter().map(|(n, _)| format!("{n:?}")).collect();
            Error::arg(format!("quantize is {s:?}; expected None or one of {}", names.join(", ")))
        })
    }

    pub fn name(&self) -> &'static str {
        KINDS.iter().find(|(_, q)| q == self).map(|(n, _)| *n).unwrap_or("none")
    }

    /// How a matrix of `role` is stored: `None` for f32, else its block kind.
    pub fn storage(&self, role: Role) -> Option<BlockKind> {
        match self {
            Quantize::None => None,
            Quantize::Q8_0 => Some(BlockKind::Q8_0),
            Quantize::Q4_0 => Some(BlockKind::Q4_0),
            Quantize::Q4Mix => Some(match role {
                Role::AttnV | Role::MlpDown | Role::Head | Role::Embedding => BlockKind::Q8_0,
                Role::AttnQk | Role::AttnO | Role::MlpGateUp => BlockKind::Q4_0,
            }),
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
        assert!(e.contains("int3") && e.contains("\"q4_0\"") && e.contains("\"int8\""), "{e}");
        assert!(Quantize::parse(Some("")).is_err());
    }

    #[test]
    fn the_mix_keeps_the_sensitive_matrices_at_8_bits() {
        let q = Quantize::Q4Mix;
        assert_eq!(q.storage(Role::AttnQk), Some(BlockKind::Q4_0));
        assert_eq!(q.storage(Role::MlpDown), Some(BlockKind::Q8_0));
        assert_eq!(q.storage(Role::Head), Some(BlockKind::Q8_0));
        assert!(ROLES.iter().all(|r| Quantize::None.storage(*r).is_none()));
        assert!(ROLES.iter().all(|r| Quantize::Q4_0.storage(*r) == Some(BlockKind::Q4_0)));
    }
}
