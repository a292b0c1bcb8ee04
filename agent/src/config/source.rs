//! Reads the config dir: every `*.yaml`/`*.yml` file, each holding one or
//! more documents. Follows Kubernetes ConfigMap mounts, whose files are
//! symlinks through `..data` that the kubelet swaps atomically.

use std::{
    fs,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use super::ConfigError;

/// One YAML document with where it came from.
#[derive(Debug, Clone)]
pub struct RawDocument {
    pub file: PathBuf,
    /// 1-based position of the document in its file.
    pub index: usize,
    pub value: serde_yaml::Value,
}

/// What the config dir holds right now.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub documents: Vec<RawDocument>,
    /// Files or documents that are not YAML at all.
    pub errors: Vec<ConfigError>,
    /// The dir is missing or has no config file: never a reason to wipe.
    pub empty: bool,
    /// A fingerprint of everything read, to notice changes cheaply.
    pub fingerprint: u64,
}

pub fn read_dir(dir: &Path) -> Snapshot {
    let mut snap = Snapshot::default();
    let mut files: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // `..data`, `..2024_...` are the kubelet's own entries.
                !name.starts_with('.')
                    && (name.ends_with(".yaml") || name.ends_with(".yml"))
                    && p.is_file()
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    snap.empty = files.is_empty();

    let mut fingerprint_parts: Vec<Vec<u8>> = Vec::new();
    for file in files {
        let text = match fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) => {
                snap.errors
                    .push(ConfigError::file(&file, format!("cannot read: {e}")));
                continue;
            }
        };
        fingerprint_parts.push(file.as_os_str().as_encoded_bytes().to_vec());
        fingerprint_parts.push(text.as_bytes().to_vec());
        for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            match serde_yaml::Value::deserialize(de) {
                Ok(serde_yaml::Value::Null) => {}
                Ok(value) => snap.documents.push(RawDocument {
                    file: file.clone(),
                    index: i + 1,
                    value,
                }),
                Err(e) => {
                    let mut err = ConfigError::file(&file, format!("not valid YAML: {e}"));
                    err.document = format!("document {}", i + 1);
                    snap.errors.push(err);
                    // The rest of a broken stream cannot be split reliably.
                    break;
                }
            }
        }
    }
    let parts: Vec<&[u8]> = fingerprint_parts.iter().map(|p| p.as_slice()).collect();
    snap.fingerprint = crate::hash::fnv1a(&parts);
    snap
}
