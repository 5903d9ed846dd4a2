//! Bundle integrity: the files this runtime reads (`bundle::CHECKED_FILES`: config.json,
//! model.safetensors, tokenizer.json) are checked against the sha256 and byte count that the
//! exporter wrote into `manifest.json` (`files: {name: {sha256, bytes}}`, docs/design.md "The
//! bundle"). Each file is hashed in one streaming pass (1 MiB reads), which also warms the page
//! cache for the memory-mapped load that follows. The rule is Python's (`serve.bundle`): a bundle
//! without a manifest is refused — the exporter writes it last, so a folder without one is not a
//! finished export — unless the caller opts out (`verify=False`); a manifest that is unreadable,
//! not a Shalik manifest, of a newer `format_version`, lacking an entry for one of these files, or
//! disagreeing with one, is an error naming the file.

use crate::bundle::{CHECKED_FILES, FORMAT, FORMAT_VERSION, MANIFEST};
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

/// Check `dir`'s CHECKED_FILES against `dir/manifest.json`.
/// Errors: `Error::Format` for a missing or unreadable manifest, one whose `format` is not
/// `bundle::FORMAT` or whose `format_version` is newer than `bundle::FORMAT_VERSION` (naming both),
/// or a file whose size or sha256 differs from the manifest or that it does not list (naming the
/// file); `Error::Io` for an unreadable file.
pub fn verify_bundle(dir: &Path) -> Result<()> {
    let mpath = dir.join(MANIFEST);
    let text = match std::fs::read_to_string(&mpath) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::format(format!(
                "{} is missing: not an exported bundle, or its export did not finish (the manifest is \
                 written last); export it with python -m export.onnx, or load with verify=False to skip the check",
                mpath.display()
            )))
        }
        Err(e) => return Err(Error::io(&mpath, "cannot read the bundle manifest", e)),
    };
    let manifest: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(format!("{}: not valid JSON ({e}); cannot verify the bundle", mpath.display())))?;
    check_format(&manifest, &mpath)?;
    let files = manifest.get("files").and_then(|f| f.as_object()).ok_or_else(|| {
        Error::format(format!("{}: no \"files\" table of sha256 sums; cannot verify the bundle", mpath.display()))
    })?;
    for name in CHECKED_FILES {
        let entry = files.get(name);
        let want = entry.and_then(|e| e.get("sha256")).and_then(|s| s.as_str());
        let bytes = entry.and_then(|e| e.get("bytes")).and_then(|b| b.as_u64());
        let (Some(want), Some(bytes)) = (want, bytes) else {
            return Err(Error::format(format!(
                "{}: no sha256 and bytes for {name}; the bundle cannot be verified (load with verify=False to skip \
                 the check)",
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
    Ok(())
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
        // no manifest: refused (as serve.bundle does), naming the manifest and the opt-out
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
        assert!(e.contains(&format!("format_version {} is newer than this reader's {FORMAT_VERSION}", FORMAT_VERSION + 1)), "{e}");
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
}
