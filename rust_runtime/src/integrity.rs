//! Bundle integrity: the files this runtime reads (`bundle::CHECKED_FILES`: config.json,
//! model.safetensors, tokenizer.json) are checked against the sha256 and byte count that the
//! exporter wrote into `manifest.json` (`files: {name: {sha256, bytes}}`, docs/design.md "The
//! bundle"). Each file is hashed in one streaming pass (1 MiB reads), which also warms the page
//! cache for the memory-mapped load that follows. The rule is Python's (`contract/bundle.py`): a bundle
//! without a manifest is refused — the exporter writes it last, so a folder without one is not a
//! finished export — unless the caller opts out (`verify=False`); a manifest that is unreadable,
//! not a Shalik manifest, of a newer `format_version`, lacking an entry for one of these files, or
//! disagreeing with one, is an error naming the file.

use crate::bundle::{CHECKED_FILES, FORMAT, FORMAT_MINOR, FORMAT_VERSION, MANIFEST, SKIP_VERIFY};
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Lowercase hex sha256 of a file and its length in bytes.
pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "cannot open the file to verify it", e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| Error::io(path, "cannot read the file to verify it", e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    let hex = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((hex, n))
}

/// `dir/manifest.json`, parsed and checked (`format` and `format_version`, whatever the caller's
/// `verify` setting: a newer major version may lay the bundle out differently) and read with today's
/// names (`upgrade`), or None when the folder has none. Errors: `Error::Format` for a manifest that is unreadable JSON, not a Shalik
/// manifest or of a newer `format_version` (naming both); `Error::Io` for an unreadable file.
pub fn read_manifest(dir: &Path) -> Result<Option<serde_json::Value>> {
    let mpath = dir.join(MANIFEST);
    let text = match std::fs::read_to_string(&mpath) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&mpath, "cannot read the bundle manifest", e)),
    };
    let mut manifest: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(format!("{}: not valid JSON ({e}); cannot verify the bundle", mpath.display())))?;
    check_format(&manifest, &mpath)?;
    upgrade(&mut manifest);
    Ok(Some(manifest))
}

/// A manifest of an older minor version (`format_minor` below `FORMAT_MINOR`, absent: 0) with today's
/// names, in place: the one place Rust reads old names, as `contract/bundle.py`'s `upgrade`. Minor 0 → 1:
/// the gate's forms keyed with an old name of `quant::ALIASES` ("rust int8") are keyed with the kind's
/// ("rust q8_0").
pub fn upgrade(manifest: &mut serde_json::Value) {
    if manifest.get("format_minor").and_then(|v| v.as_u64()).unwrap_or(0) >= FORMAT_MINOR {
        return;
    }
    if let Some(forms) = manifest.pointer_mut("/quantization/forms").and_then(|f| f.as_object_mut()) {
        let old: Vec<String> = forms.keys().cloned().collect();
        for key in old {
            let (runtime, scheme) = key.split_once(' ').unwrap_or((key.as_str(), ""));
            if let Some((_, new)) = crate::quant::ALIASES.iter().find(|(o, _)| *o == scheme) {
                let new_key = format!("{runtime} {new}");
                if let Some(mut entry) = forms.remove(&key) {
                    if let Some(e) = entry.as_object_mut() {
                        e.insert("scheme".into(), serde_json::Value::from(*new));
                    }
                    forms.insert(new_key, entry);
                }
            }
        }
    }
    if let Some(m) = manifest.as_object_mut() {
        m.insert("format_minor".into(), serde_json::Value::from(FORMAT_MINOR));
    }
}

/// Check `dir`'s CHECKED_FILES against `dir/manifest.json`.
/// Errors: `Error::Format` for a missing or unreadable manifest, one whose `format` is not
/// `bundle::FORMAT` or whose `format_version` is newer than `bundle::FORMAT_VERSION` (naming both),
/// or a file whose size or sha256 differs from the manifest or that it does not list (naming the
/// file); `Error::Io` for an unreadable file. Returns the manifest.
pub fn verify_bundle(dir: &Path) -> Result<serde_json::Value> {
    let mpath = dir.join(MANIFEST);
    let Some(manifest) = read_manifest(dir)? else {
        return Err(Error::format(format!(
            "{} is missing: not an exported bundle, or its export did not finish (the manifest is \
             written last); export it with python -m export.onnx, or load with {SKIP_VERIFY} to skip the check",
            mpath.display()
        )));
    };
    let files = manifest.get("files").and_then(|f| f.as_object()).ok_or_else(|| {
        Error::format(format!("{}: no \"files\" table of sha256 sums; cannot verify the bundle", mpath.display()))
    })?;
    for name in CHECKED_FILES {
        let entry = files.get(name);
        let want = entry.and_then(|e| e.get("sha256")).and_then(|s| s.as_str());
        let bytes = entry.and_then(|e| e.get("bytes")).and_then(|b| b.as_u64());
        let (Some(want), Some(bytes)) = (want, bytes) else {
            return Err(Error::format(format!(
                "{}: no sha256 and bytes for {name}; the bundle cannot be verified (load with {SKIP_VERIFY} to \
                 skip the check)",
                mpath.display()
            )));
        };
        let path = dir.join(name);
        let len = std::fs::metadata(&path).map_err(|e| Error::io(&path, "cannot open the file to verify it", e))?.len();
        if len != bytes {
            return Err(Error::format(format!(
                "{}: {len} bytes, but {MANIFEST} says {bytes}: the bundle is truncated or altered",
                path.display()
            )));
        }
        let (got, _) = sha256_file(&path)?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(Error::format(format!(
                "{}: sha256 {got} differs from {MANIFEST}'s {want}: the file is corrupted or altered",
                path.display()
            )));
        }
    }
    Ok(manifest)
}

/// The manifest's `format` must be `bundle::FORMAT` and its `format_version` an integer from 1 to
/// `bundle::FORMAT_VERSION` (a newer major version may lay the bundle out differently).
fn check_format(manifest: &serde_json::Value, mpath: &Path) -> Result<()> {
    let format = manifest.get("format");
    if format.and_then(|f| f.as_str()) != Some(FORMAT) {
        return Err(Error::format(format!(
            "{}: format is {}, expected \"{FORMAT}\"",
            mpath.display(),
            format.map_or("missing".to_string(), |f| f.to_string())
        )));
    }
    match manifest.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v > FORMAT_VERSION => Err(Error::format(format!(
            "{}: format_version {v} is newer than this reader's {FORMAT_VERSION}; upgrade Shalik to read this bundle",
            mpath.display()
        ))),
        Some(v) if v >= 1 => Ok(()),
        _ => Err(Error::format(format!(
            "{}: format_version is {}, expected an integer >= 1",
            mpath.display(),
            manifest.get("format_version").map_or("missing".to_string(), |v| v.to_string())
        ))),
    }
}

/// The quality gate's figures as `serve/verdict.py`'s `FIGURES`: (key in a form's figures, label,
/// passes when `<=` (true) or `>=` (false), key of the limit in its thresholds, unit, signed).
const FIGURES: [(&str, &str, bool, &str, &str, bool); 3] = [
    ("delta", "val NLL change", true, "val_nll_delta_max", " nats/token", true),
    ("top1_agreement", "top-1 agreement with fp32", false, "top1_agreement_min", "", false),
    (
        "mean_abs_top_logprob_delta",
        "mean |Δ log p| of fp32's top token",
        true,
        "mean_abs_top_logprob_delta_max",
        " nats",
        false,
    ),
];
/// How a gate can be overridden, in every message (`serve.verdict.OVERRIDE`): the Python argument, the
/// CLIs' flag and the HTTP server's variable.
const OVERRIDE: &str = "allow_ungated=True (--allow-ungated, SHALIK_ALLOW_UNGATED=1)";

/// A figure with three decimals, more while that would print the threshold itself for a value
/// that differs from it (`serve.verdict.fmt_figure`).
pub fn fmt_figure(value: f64, limit: f64, signed: bool) -> String {
    if !value.is_finite() {
        return format!("{value}");
    }
    let mut s = String::new();
    for d in 3..8 {
        s = if signed { format!("{value:+.d$}") } else { format!("{value:.d$}") };
        let printed: f64 = s.parse().unwrap_or(f64::NAN);
        let lim: f64 = format!("{limit:.d$}").parse().unwrap_or(f64::NAN);
        if value == limit || printed != lim {
            break;
        }
    }
    s
}

/// The figures of one form's gate entry that miss their threshold, per language then over all
/// (`serve.verdict.misses`).
fn misses(entry: &serde_json::Value) -> Vec<String> {
    let th = entry.get("thresholds");
    let mut out = Vec::new();
    let mut places: Vec<(String, &serde_json::Value)> = Vec::new();
    if let Some(by) = entry.get("by_lang").and_then(|b| b.as_object()) {
        places.extend(by.iter().map(|(k, v)| (k.clone(), v)));
    }
    if let Some(all) = entry.get("all") {
        places.push(("all".into(), all));
    }
    for (place, figs) in places {
        for (key, label, at_most, limit_key, unit, signed) in FIGURES {
            let (Some(value), Some(limit)) =
                (figs.get(key).and_then(|v| v.as_f64()), th.and_then(|t| t.get(limit_key)).and_then(|v| v.as_f64()))
            else {
                continue;
            };
            let ok = value.is_finite() && if at_most { value <= limit } else { value >= limit };
            if !ok {
                let broken = if at_most { ">" } else { "<" };
                out.push(format!("{place}: {label} {}{unit} {broken} {limit:.2}", fmt_figure(value, limit, signed)));
            }
        }
    }
    out
}

/// Refuse to serve a quantized form that the export's quality gate did not pass (the rule of
/// `serve/verdict.py`): `manifest` is the bundle's (None: it has none), `form` is "rust <scheme>".
/// Ok(None) when it passed; Ok(Some(what is overridden)) when it did not and `allow_ungated`;
/// else `Error::InvalidArgument` (ValueError: the quantization asked for is refused, as serve's
/// UngatedError is a ValueError) naming the form, the figure and the threshold (a failed form) or why there
/// is no verdict and how to get one.
pub fn check_form(
    manifest: Option<&serde_json::Value>,
    place: &Path,
    form: &str,
    allow_ungated: bool,
) -> Result<Option<String>> {
    let entry = manifest.and_then(|m| m.get("quantization")).and_then(|q| q.get("forms")).and_then(|f| f.get(form));
    let scheme = form.split(' ').nth(1).unwrap_or(form);
    let (what, how) = match (manifest, entry, entry.and_then(|e| e.get("ok")).and_then(|o| o.as_bool())) {
        (_, _, Some(true)) => return Ok(None),
        (_, Some(e), Some(false)) => {
            let m = misses(e);
            let passed: Vec<&str> = manifest
                .and_then(|m| m.get("quantization"))
                .and_then(|q| q.get("forms"))
                .and_then(|f| f.as_object())
                .map(|f| {
                    f.iter()
                        .filter(|(_, r)| r.get("ok").and_then(|o| o.as_bool()) == Some(true))
                        .map(|(k, _)| k.as_str())
                        .collect()
                })
                .unwrap_or_default();
            let passed = if passed.is_empty() {
                "none passed; float32 always serves".to_string()
            } else {
                format!("passed: {}", passed.join(", "))
            };
            (
                format!(
                    "{form} failed the export's quality gate ({})",
                    if m.is_empty() { "failed".into() } else { m.join("; ") }
                ),
                format!("serve a form that passed ({passed}), or load it anyway with {OVERRIDE}"),
            )
        }
        (m, e, _) => {
            let detail = match (m, e) {
                (None, _) => "the bundle has no manifest.json".to_string(),
                (_, None) => "manifest.json records no quality-gate verdict for it".to_string(),
                (_, Some(e)) => format!(
                    "not measured: {}",
                    e.get("note").and_then(|n| n.as_str()).filter(|n| !n.is_empty()).unwrap_or("no reason recorded")
                ),
            };
            (
                format!("{form} has no quality-gate verdict ({detail})"),
                format!(
                    "export the bundle again to measure it (python -m export.onnx RUN --force gates every form \
                     rust_runtime makes; --quantize {scheme} adds and gates the ONNX graph), or load it anyway with {OVERRIDE}"
                ),
            )
        }
    };
    if allow_ungated {
        Ok(Some(format!("{}: serving {what}, because allow_ungated overrides the gate", place.display())))
    } else {
        Err(Error::arg(format!("{}: {what}; {how}", place.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::{CONFIG, WEIGHTS};

    fn write_manifest(dir: &Path, format: &str, version: u64) {
        let mut files = serde_json::Map::new();
        for name in CHECKED_FILES {
            let (h, n) = sha256_file(&dir.join(name)).unwrap();
            files.insert(name.into(), serde_json::json!({"sha256": h, "bytes": n}));
        }
        let m = serde_json::json!({"format": format, "format_version": version, "files": files});
        std::fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
    }

    #[test]
    fn verify_names_the_altered_file() {
        let dir = std::env::temp_dir().join(format!("rust_runtime_integrity_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for name in CHECKED_FILES {
            std::fs::write(dir.join(name), format!("contents of {name}")).unwrap();
        }
        // no manifest: refused (as contract.bundle does), naming the manifest and the opt-out
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(e.contains("manifest.json is missing") && e.contains("verify=False"), "{e}");
        let (empty, _) = {
            std::fs::write(dir.join("empty"), b"").unwrap();
            sha256_file(&dir.join("empty")).unwrap()
        };
        assert_eq!(empty, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        write_manifest(&dir, FORMAT, FORMAT_VERSION);
        verify_bundle(&dir).unwrap();
        // a newer major version is refused naming both versions; another format is refused
        write_manifest(&dir, FORMAT, FORMAT_VERSION + 1);
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&format!("format_version {} is newer than this reader's {FORMAT_VERSION}", FORMAT_VERSION + 1)),
            "{e}"
        );
        write_manifest(&dir, "something-else", FORMAT_VERSION);
        assert!(verify_bundle(&dir).unwrap_err().to_string().contains("something-else"));
        write_manifest(&dir, FORMAT, FORMAT_VERSION);
        // same length, one byte changed
        std::fs::write(dir.join(WEIGHTS), "contents of model.safetensorZ").unwrap();
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(e.contains(WEIGHTS) && e.contains("sha256"), "{e}");
        std::fs::write(dir.join(WEIGHTS), "short").unwrap();
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(e.contains(WEIGHTS) && e.contains("bytes"), "{e}");
        // an entry without its size cannot vouch for the file
        let m = serde_json::json!({"format": FORMAT, "format_version": 1, "files": {CONFIG: {"sha256": empty}}});
        std::fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
        assert!(verify_bundle(&dir).unwrap_err().to_string().contains(CONFIG));
        std::fs::write(dir.join(MANIFEST), "{not json").unwrap();
        assert!(verify_bundle(&dir).unwrap_err().to_string().contains(MANIFEST));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_newer_major_version_is_refused_without_hashing_too() {
        let dir = std::env::temp_dir().join(format!("rust_runtime_manifest_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(read_manifest(&dir).unwrap().is_none()); // no manifest: a hand-made folder, allowed unverified
        let m = serde_json::json!({"format": FORMAT, "format_version": FORMAT_VERSION + 1, "files": {}});
        std::fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
        let e = read_manifest(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&format!("format_version {} is newer than this reader's {FORMAT_VERSION}", FORMAT_VERSION + 1)),
            "{e}"
        );
        let m = serde_json::json!({"format": FORMAT, "format_version": FORMAT_VERSION, "files": {}});
        std::fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
        assert!(read_manifest(&dir).unwrap().is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_form_the_gate_did_not_pass_is_refused_naming_the_figure_and_the_threshold() {
        let th = serde_json::json!({"val_nll_delta_max": 0.1, "top1_agreement_min": 0.85,
                                    "mean_abs_top_logprob_delta_max": 0.25});
        let fig =
            |d: f64, t: f64| serde_json::json!({"delta": d, "top1_agreement": t, "mean_abs_top_logprob_delta": 0.05});
        let m = serde_json::json!({"quantization": {"forms": {
            "rust q8_0": {"ok": true, "thresholds": th, "by_lang": {"bn": fig(0.0, 0.99)}, "all": fig(0.0, 0.99)},
            "rust q4_0": {"ok": false, "thresholds": th, "by_lang": {"bn": fig(0.112, 0.8496), "en": fig(0.05, 0.9)},
                          "all": fig(0.09, 0.87)},
            "rust q4_mix": {"ok": null, "note": "step 0 (random init)"}}}});
        let place = Path::new("runs/x/bundle");
        assert_eq!(check_form(Some(&m), place, "rust q8_0", false).unwrap(), None);
        let e = check_form(Some(&m), place, "rust q4_0", false).unwrap_err().to_string();
        assert!(
            e.contains(
                "runs/x/bundle: rust q4_0 failed the export's quality gate (bn: val NLL change +0.112 \
                            nats/token > 0.10; bn: top-1 agreement with fp32 0.8496 < 0.85)"
            ),
            "{e}"
        );
        assert!(e.contains("passed: rust q8_0") && e.contains("allow_ungated=True"), "{e}");
        let e = check_form(Some(&m), place, "rust q4_mix", false).unwrap_err().to_string();
        assert!(e.contains("rust q4_mix has no quality-gate verdict (not measured: step 0 (random init))"), "{e}");
        let e = check_form(None, place, "rust q4_mix", false).unwrap_err().to_string();
        assert!(e.contains("(the bundle has no manifest.json)") && e.contains("--quantize q4_mix"), "{e}");
        let ok = check_form(Some(&m), place, "rust q4_0", true).unwrap().unwrap();
        assert!(
            ok.contains("serving rust q4_0 failed the export's quality gate") && ok.contains("allow_ungated"),
            "{ok}"
        );
        assert_eq!(fmt_figure(0.853, 0.85, false), "0.853");
        assert_eq!(fmt_figure(0.85, 0.85, false), "0.850");
        assert_eq!(fmt_figure(0.1001, 0.1, true), "+0.1001");
    }

    #[test]
    fn a_minor_0_manifest_reads_its_int8_forms_as_q8_0() {
        let old = serde_json::json!({"format": FORMAT, "format_version": 1, "files": {},
            "quantization": {"forms": {"rust int8": {"scheme": "int8", "ok": true},
                                       "onnx int8": {"scheme": "int8", "ok": false},
                                       "rust q4_0": {"scheme": "q4_0", "ok": true}}}});
        let mut m = old.clone();
        upgrade(&mut m);
        let forms = m.pointer("/quantization/forms").unwrap().as_object().unwrap();
        let keys: Vec<&str> = forms.keys().map(|k| k.as_str()).collect();
        assert_eq!(keys.len(), 3);
        assert!(keys.contains(&"rust q8_0") && keys.contains(&"onnx q8_0") && keys.contains(&"rust q4_0"), "{keys:?}");
        assert_eq!(forms["rust q8_0"], serde_json::json!({"scheme": "q8_0", "ok": true}));
        assert_eq!(m["format_minor"], FORMAT_MINOR);
        assert_eq!(check_form(Some(&m), Path::new("b"), "rust q8_0", false).unwrap(), None);
        // a current manifest is left as it is, even one whose forms spell an old name
        let mut cur = old.clone();
        cur["format_minor"] = serde_json::Value::from(FORMAT_MINOR);
        let before = cur.clone();
        upgrade(&mut cur);
        assert_eq!(cur, before);
    }
}
