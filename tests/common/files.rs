//! `ConfigFile`: a configuration file of the test's own in a temporary directory, removed when
//! dropped, passed to warren as `--config <at>`.

use std::path::{Path, PathBuf};

/// A configuration file of this test's own (`warren.toml` in a temporary directory), removed
/// when dropped.
pub struct ConfigFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
    /// The path as text, for `--config`.
    at: String,
}

impl ConfigFile {
    /// The file holding `text`.
    pub fn new(text: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("warren.toml");
        let at = path.to_str().expect("a utf-8 temp path").to_string();
        let file = Self {
            _dir: dir,
            path,
            at,
        };
        file.write(text);
        file
    }

    /// Replaces its text (a reload's new configuration).
    pub fn write(&self, text: &str) {
        std::fs::write(&self.path, text).expect("write the config");
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path, as `--config` takes it.
    pub fn at(&self) -> &str {
        &self.at
    }
}
