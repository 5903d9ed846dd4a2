//! Bundle integrity: the files this runtime reads (config.json, model.safetensors,
//! tokenizer.json) are checked against the sha256 and byte count that the exporter wrote into
//! `manifest.json` (`files: {name: {sha256, bytes}}`, docs/design.md "The bundle"). Each file is
//! hashed in one streaming pass (1 MiB reads), which also warms the page cache for the
//! memory-mapped load that follows. A bundle without a manifest.json is not checked (hand-made
//! bundles and test fixtures have none); a manifest that exists but is unreadable, lacks an
//! entry for one of these files, or disagrees with one, is an error naming the file.

use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// The files of a bundle that `Model::load` and the tokenizer read.
pub const CHECKED_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

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

/// Check `dir`'s CHECKED_FILES against `dir/manifest.json`. Returns whether a manifest was found.
/// Errors: `Error::Format` naming the file whose size or sha256 differs from the manifest, or
/// a manifest without an entry for it; `Error::Io` for an unreadable file.
pub fn verify_bundle(dir: &Path) -> Result<bool> {
    let mpath = dir.join("manifest.json");
    let text = match std::fs::read_to_string(&mpath) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(&mpath, "cannot read the bundle manifest", e)),
    };
    let manifest: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(format!("{}: not valid JSON ({e}); cannot verify the bundle", mpath.display())))?;
    let files = manifest.get("files").and_then(|f| f.as_object()).ok_or_else(|| {
        Error::format(format!("{}: no \"files\" table of sha256 sums; cannot verify the bundle", mpath.display()))
    })?;
    for name in CHECKED_FILES {
        let entry = files.get(name);
        let want = entry.and_then(|e| e.get("sha256")).and_then(|s| s.as_str()).ok_or_else(|| {
            Error::format(format!(
                "{}: no sha256 for {name}; the bundle cannot be verified (load with verify=False to skip the check)",
                mpath.display()
            ))
        })?;
        let path = dir.join(name);
        if let Some(bytes) = entry.and_then(|e| e.get("bytes")).and_then(|b| b.as_u64()) {
            let len =
                std::fs::metadata(&path).map_err(|e| Error::io(&path, "cannot open the file to verify it", e))?.len();
            if len != bytes {
                return Err(Error::format(format!(
                    "{}: {len} bytes, but manifest.json says {bytes}: the bundle is truncated or altered",
                    path.display()
                )));
            }
        }
        let (got, _) = sha256_file(&path)?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(Error::format(format!(
                "{}: sha256 {got} differs from manifest.json's {want}: the file is corrupted or altered",
                path.display()
            )));
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_names_the_altered_file() {
        let dir = std::env::temp_dir().join(format!("rust_runtime_integrity_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!verify_bundle(&dir).unwrap(), "no manifest: nothing to check");
        let mut files = serde_json::Map::new();
        for name in CHECKED_FILES {
            std::fs::write(dir.join(name), format!("contents of {name}")).unwrap();
            let (h, n) = sha256_file(&dir.join(name)).unwrap();
            files.insert(name.into(), serde_json::json!({"sha256": h, "bytes": n}));
        }
        let (empty, _) = {
            std::fs::write(dir.join("empty"), b"").unwrap();
            sha256_file(&dir.join("empty")).unwrap()
        };
        assert_eq!(empty, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let m = serde_json::json!({"format": "shalik-bundle", "files": files});
        std::fs::write(dir.join("manifest.json"), m.to_string()).unwrap();
        assert!(verify_bundle(&dir).unwrap());
        // same length, one byte changed
        std::fs::write(dir.join("model.safetensors"), "contents of model.safetensorZ").unwrap();
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("sha256"), "{e}");
        std::fs::write(dir.join("model.safetensors"), "short").unwrap();
        let e = verify_bundle(&dir).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("bytes"), "{e}");
        std::fs::write(dir.join("manifest.json"), "{not json").unwrap();
        assert!(verify_bundle(&dir).unwrap_err().to_string().contains("manifest.json"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
