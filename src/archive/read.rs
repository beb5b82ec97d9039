//! Reading the archive back: its manifests, a segment's rows with their checksums checked.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::{Archive, Manifest};

/// What is wrong with a segment.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: SHA-256 {found}, the manifest says {expected}")]
    Checksum {
        path: String,
        expected: String,
        found: String,
    },
    #[error("{path}: {found} rows, the manifest says {expected}")]
    Rows {
        path: String,
        expected: u64,
        found: u64,
    },
    #[error("{path}: line {line} is not JSON: {error}")]
    Line {
        path: String,
        line: usize,
        error: String,
    },
}

impl Archive {
    /// Every manifest under the archive (of one table if given), oldest rows first.
    pub fn list(&self, table: Option<&str>) -> std::io::Result<Vec<Manifest>> {
        let mut out = Vec::new();
        let tables = match table {
            Some(t) => vec![self.root.join(t)],
            None => subdirs(&self.root)?,
        };
        for t in tables {
            for day in subdirs(&t)? {
                for entry in std::fs::read_dir(&day)? {
                    let path = entry?.path();
                    if path.to_string_lossy().ends_with(".manifest.json") {
                        let bytes = std::fs::read(&path)?;
                        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
                            std::io::Error::other(format!("{}: {e}", path.display()))
                        })?;
                        out.push(m);
                    }
                }
            }
        }
        out.sort_by(|a, b| (a.oldest_at, &a.segment_id).cmp(&(b.oldest_at, &b.segment_id)));
        Ok(out)
    }

    /// A segment's rows, after checking the file against its manifest: size, both checksums,
    /// the number of lines, each one JSON.
    pub fn read(&self, m: &Manifest) -> Result<Vec<serde_json::Value>, Problem> {
        let path = self.root.join(m.data_path());
        let shown = path.display().to_string();
        let io = |source| Problem::Io {
            path: shown.clone(),
            source,
        };
        let compressed = std::fs::read(&path).map_err(io)?;
        let found = hex::encode(Sha256::digest(&compressed));
        if found != m.sha256 {
            return Err(Problem::Checksum {
                path: shown,
                expected: m.sha256.clone(),
                found,
            });
        }
        let lines = zstd::decode_all(&compressed[..]).map_err(io)?;
        let found = hex::encode(Sha256::digest(&lines));
        if found != m.content_sha256 {
            return Err(Problem::Checksum {
                path: format!("{shown} (decompressed)"),
                expected: m.content_sha256.clone(),
                found,
            });
        }
        let mut rows = Vec::with_capacity(m.rows as usize);
        for (i, line) in lines.split(|&b| b == b'\n').enumerate() {
            if line.is_empty() {
                continue;
            }
            rows.push(serde_json::from_slice(line).map_err(|e| Problem::Line {
                path: shown.clone(),
                line: i + 1,
                error: e.to_string(),
            })?);
        }
        if rows.len() as u64 != m.rows {
            return Err(Problem::Rows {
                path: shown,
                expected: m.rows,
                found: rows.len() as u64,
            });
        }
        Ok(rows)
    }
}

/// The directories directly under `dir` (none if it does not exist).
fn subdirs(dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        if e.file_type()?.is_dir() {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}
