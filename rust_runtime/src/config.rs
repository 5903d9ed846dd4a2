//! `config.json` (a transformers `LlamaConfig`) read by hand, so that every field we depend on is
//! checked and nothing silently defaults (candle's serde config defaults rope_theta to 10000 when
//! transformers 5 moved it into `rope_parameters`).

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub eos_token_id: Option<u32>,
}

impl Config {
    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The KV head that query head `h` reads (GQA): consecutive query heads share a KV head,
    /// as transformers' `repeat_kv` lays them out (`h / group`, not `h % n_kv`).
    pub fn kv_head_for(&self, h: usize) -> usize {
        h / self.group_size()
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(path, "cannot read the model config (config.json)", e))?;
        Self::from_json_str(&text).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::format(format!("config.json is not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| Error::format("config.json: expected a JSON object at the top level"))?;
        Self::from_map(obj)
    }

    fn from_map(o: &Map<String, Value>) -> Result<Self> {
        if let Some(mt) = o.get("model_type") {
            if mt.as_str() != Some("llama") {
                return Err(Error::format(format!("config.json: model_type is {mt}, expected \"llama\"")));
            }
        }
        if let Some(act) = o.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(Error::format(format!("config.json: hidden_act is {act}, only \"silu\" is supported")));
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if let Some(b) = o.get(key) {
                if b.as_bool() != Some(false) && !b.is_null() {
                    return Err(Error::format(format!(
                        "config.json: {key} is {b}; biases are not supported (expected false)"
                    )));
                }
            }
        }

        let hidden_size = req_usize(o, "hidden_size")?;
        let num_hidden_layers = req_usize(o, "num_hidden_layers")?;
        let num_attention_heads = req_usize(o, "num_attention_heads")?;
        // transformers: num_key_value_heads defaults to num_attention_heads when absent/null.
        let num_key_value_heads = match o.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => req_usize(o, "num_key_value_heads")?,
        };
        let intermediate_size = req_usize(o, "intermediate_size")?;
        let max_position_embeddings = req_usize(o, "max_position_embeddings")?;
        let vocab_size = req_usize(o, "vocab_size")?;
        let rms_norm_eps = req_f64(o, "rms_norm_eps")?;
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(Error::format(format!(
                "config.json: rms_norm_eps is {rms_norm_eps}, expected a positive number"
            )));
        }
        let tie_word_embeddings = match o.get("tie_word_embeddings") {
            None | Some(Value::Null) => false, // LlamaConfig's default
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::format(format!(
                    "config.json: tie_word_embeddings is {other}, expected true or false"
                )))
            }
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::format(format!(
                "config.json: num_attention_heads {num_attention_heads} is not a multiple of \
                 num_key_value_heads {num_key_value_heads}"
            )));
        }
        if hidden_size % num_attention_heads != 0 {
            return Err(Error::format(format!(
                "config.json: hidden_size {hidden_size} is not a multiple of num_attention_heads \
                 {num_attention_heads}"
            )));
        }
        let head_dim = hidden_size / num_attention_heads;
        if let Some(hd) = o.get("head_dim") {
            if !hd.is_null() && hd.as_u64() != Some(head_dim as u64) {
                return Err(Error::format(format!(
                    "config.json: head_dim is {hd}, expected hidden_size / num_attention_heads = \
                     {head_dim} (other head sizes are not supported)"
                )));
            }
        }
        if head_dim % 2 != 0 {
            return Err(Error::format(format!(
                "config.json: head_dim {head_dim} is odd; rotary embeddings need an even head_dim"
            )));
        }
        let rope_theta = rope_theta(o)?;
        let eos_token_id = match o.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().and_then(|x| u32::try_from(x).ok()),
            Some(Value::Array(a)) => a.first().and_then(|n| n.as_u64()).and_then(|x| u32::try_from(x).ok()),
            _ => None,
        };
        Ok(Config {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            tie_word_embeddings,
            eos_token_id,
        })
    }
}

fn req_usize(o: &Map<String, Value>, key: &str) -> Result<usize> {
    match o.get(key) {
        None | Some(Value::Null) => {
            Err(Error::format(format!("config.json: {key} is missing, expected a positive integer")))
        }
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(n as usize),
            _ => Err(Error::format(format!("config.json: {key} is {v}, expected a positive integer"))),
        },
    }
}

fn req_f64(o: &Map<String, Value>, key: &str) -> Result<f64> {
    match o.get(key) {
        None | Some(Value::Null) => Err(Error::format(format!("config.json: {key} is missing, expected a number"))),
        Some(v) => v.as_f64().ok_or_else(|| Error::format(format!("config.json: {key} is {v}, expected a number"))),
    }
}

/// rope_theta from the top level and/or `rope_parameters.rope_theta` (transformers 5). Both
/// present → they must agree; neither → error (never the silent 10000 default). Any rope type
/// other than "default" (linear, dynamic, yarn, llama3, ...) is refused, as is the legacy
/// `rope_scaling` with a non-default type.
fn rope_theta(o: &Map<String, Value>) -> Result<f64> {
    let top = match o.get("rope_theta") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64().ok_or_else(|| Error::format(format!("config.json: rope_theta is {v}, expected a number")))?,
        ),
    };
    let mut nested = None;
    for section in ["rope_parameters", "rope_scaling"] {
        match o.get(section) {
            None | Some(Value::Null) => {}
            Some(Value::Object(p)) => {
                let ty = p.get("rope_type").or_else(|| p.get("type"));
                match ty {
                    None | Some(Value::Null) => {}
                    Some(t) if t.as_str() == Some("default") => {}
                    Some(t) => {
                        return Err(Error::format(format!(
                            "config.json: {section}.rope_type is {t}; only \"default\" RoPE is \
                             supported"
                        )))
                    }
                }
                if let Some(f) = p.get("partial_rotary_factor") {
                    if !f.is_null() && f.as_f64() != Some(1.0) {
                        return Err(Error::format(format!(
                            "config.json: {section}.partial_rotary_factor is {f}; only 1.0 is \
                             supported"
                        )));
                    }
                }
                match p.get("rope_theta") {
                    None | Some(Value::Null) => {}
                    Some(v) => {
                        let t = v.as_f64().ok_or_else(|| {
                            Error::format(format!("config.json: {section}.rope_theta is {v}, expected a number"))
                        })?;
                        if let Some(prev) = nested {
                            if prev != t {
                                return Err(Error::format(format!(
                                    "config.json: rope_scaling.rope_theta {t} and \
                                     rope_parameters.rope_theta {prev} disagree"
                                )));
                            }
                        }
                        nested = Some(t);
                    }
                }
            }
            Some(v) => return Err(Error::format(format!("config.json: {section} is {v}, expected an object or null"))),
        }
    }
    let theta = match (top, nested) {
        (Some(a), Some(b)) if a != b => {
            return Err(Error::format(format!(
                "config.json: rope_theta {a} (top level) and rope_parameters.rope_theta {b} \
                 disagree"
            )))
        }
        (Some(a), _) => a,
        (None, Some(b)) => b,
        (None, None) => {
            return Err(Error::format(
                "config.json: no rope_theta (looked at the top level and in \
                 rope_parameters.rope_theta); refusing to guess 10000",
            ))
        }
    };
    if !(theta.is_finite() && theta > 1.0) {
        return Err(Error::format(format!("config.json: rope_theta is {theta}, expected a number > 1")));
    }
    Ok(theta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "tie_word_embeddings": true,
            "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}
        })
    }

    fn parse(v: &serde_json::Value) -> Result<Config> {
        Config::from_json_str(&v.to_string())
    }

    #[test]
    fn reads_nested_rope_theta() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.head_dim, 16);
        assert!(c.tie_word_embeddings);
    }

    #[test]
    fn top_level_and_nested_must_agree() {
        let mut v = base();
        v["rope_theta"] = serde_json::json!(50000.0);
        assert_eq!(parse(&v).unwrap().rope_theta, 50000.0);
        v["rope_theta"] = serde_json::json!(10000.0);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("disagree"), "{e}");
    }

    #[test]
    fn missing_theta_is_an_error_not_10000() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("rope_parameters");
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("rope_theta"), "{e}");
        v["rope_theta"] = serde_json::json!(20000.0);
        assert_eq!(parse(&v).unwrap().rope_theta, 20000.0);
    }

    #[test]
    fn refuses_non_default_rope_and_bad_shapes() {
        let mut v = base();
        v["rope_parameters"]["rope_type"] = serde_json::json!("yarn");
        assert!(parse(&v).unwrap_err().to_string().contains("yarn"));
        let mut v = base();
        v["num_key_value_heads"] = serde_json::json!(3);
        assert!(parse(&v).is_err());
        let mut v = base();
        v["head_dim"] = serde_json::json!(32);
        assert!(parse(&v).unwrap_err().to_string().contains("head_dim"));
        let mut v = base();
        v["attention_bias"] = serde_json::json!(true);
        assert!(parse(&v).is_err());
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(parse(&v).unwrap_err().to_string().contains("hidden_size"));
    }

    #[test]
    fn gqa_maps_consecutive_heads() {
        let c = parse(&base()).unwrap(); // 4 heads / 2 kv
        let m: Vec<usize> = (0..4).map(|h| c.kv_head_for(h)).collect();
        assert_eq!(m, vec![0, 0, 1, 1]); // h / 2, not h % 2 = [0, 1, 0, 1]
        let mut v = base();
        v["num_key_value_heads"] = serde_json::json!(1);
        let c = parse(&v).unwrap();
        assert_eq!((0..4).map(|h| c.kv_head_for(h)).collect::<Vec<_>>(), vec![0, 0, 0, 0]);
        let mut v = base();
        v["num_attention_heads"] = serde_json::json!(8);
        v["num_key_value_heads"] = serde_json::json!(4);
        v["hidden_size"] = serde_json::json!(128);
        let c = parse(&v).unwrap();
        assert_eq!((0..8).map(|h| c.kv_head_for(h)).collect::<Vec<_>>(), vec![0, 0, 1, 1, 2, 2, 3, 3]);
    }
}
