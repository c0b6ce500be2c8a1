//! A directory of components this host compiled, so a restart deserializes
//! (tens of microseconds) instead of compiling (tens of milliseconds).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use wasmtime::component::Component;
use wasmtime::Engine;

/// Bumped when the cache file format changes.
const FORMAT: &str = "lockstep-policy-host component cache v1";

/// A directory of compiled components.
///
/// An entry is keyed by the BLAKE3 hash of the component's bytes, the
/// wasmtime version and the engine's compatibility hash (its configuration),
/// so a changed policy, a new wasmtime or a new configuration misses the
/// cache. A compiled component is native code that wasmtime loads without
/// checking it, so **only files this host wrote are ever loaded**: each entry
/// starts with a BLAKE3 hash of the rest, which catches truncated or
/// corrupted files, and policy authors never supply `.cwasm` files. The
/// directory must be writable only by the user running lockstep.
///
/// A cache that cannot be read or written is logged and ignored: it only
/// ever costs time.
#[derive(Debug)]
pub struct ComponentCache {
    dir: PathBuf,
    hits: AtomicU64,
    writes: AtomicU64,
}

/// Feeds `Hash` output into BLAKE3, so the engine's compatibility hash gives
/// a key that is stable across runs.
struct Blake3Hasher<'a>(&'a mut blake3::Hasher);

impl Hasher for Blake3Hasher<'_> {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

impl ComponentCache {
    /// A cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            hits: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        }
    }

    /// How many loads through this cache object deserialized an entry.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// How many entries this cache object wrote.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file the entry with this key lives in.
    fn entry_path(&self, engine_key: &str) -> PathBuf {
        self.dir.join(format!("{engine_key}.cwasm"))
    }

    fn key(engine: &Engine, wasm: &[u8]) -> String {
        let mut h = blake3::Hasher::new();
        h.update(FORMAT.as_bytes());
        h.update(crate::WASMTIME_VERSION.as_bytes());
        engine
            .precompile_compatibility_hash()
            .hash(&mut Blake3Hasher(&mut h));
        h.update(&(wasm.len() as u64).to_le_bytes());
        h.update(wasm);
        h.finalize().to_hex().to_string()
    }

    /// The path of the entry `wasm` has (or would have) in this cache.
    pub fn path_for(&self, wasm: &[u8]) -> PathBuf {
        self.entry_path(&Self::key(crate::load::engine(), wasm))
    }

    /// The cached component for `wasm`, if there is a sound entry.
    pub(crate) fn get(&self, engine: &Engine, wasm: &[u8]) -> Option<Component> {
        let path = self.entry_path(&Self::key(engine, wasm));
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), "cannot read the component cache: {e}");
                return None;
            }
        };
        if data.len() < 32 || blake3::hash(&data[32..]).as_bytes() != &data[..32] {
            tracing::warn!(path = %path.display(), "ignoring a corrupt component cache entry");
            return None;
        }
        // SAFETY: `deserialize` trusts its input to be code that wasmtime
        // produced. The entry was written by `put` below from
        // `Component::serialize` of this same engine configuration (the key
        // includes the wasmtime version and the engine's compatibility
        // hash, and wasmtime checks both again), and its BLAKE3 header
        // matches, so it is not truncated or corrupted. Policy authors never
        // supply these files; the directory is this host's own.
        #[allow(unsafe_code)]
        let component = unsafe { Component::deserialize(engine, &data[32..]) };
        match component {
            Ok(c) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(c)
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), "ignoring a component cache entry wasmtime refused: {e:#}");
                None
            }
        }
    }

    /// Stores `component`, compiled by this host from `wasm`. Written to a
    /// temporary file and renamed, so a reader never sees half an entry.
    pub(crate) fn put(&self, engine: &Engine, wasm: &[u8], component: &Component) {
        let path = self.entry_path(&Self::key(engine, wasm));
        let result = (|| -> Result<(), String> {
            let body = component.serialize().map_err(|e| format!("{e:#}"))?;
            std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
            let mut data = Vec::with_capacity(32 + body.len());
            data.extend_from_slice(blake3::hash(&body).as_bytes());
            data.extend_from_slice(&body);
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &data).map_err(|e| e.to_string())?;
            std::fs::rename(&tmp, &path).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                e.to_string()
            })
        })();
        match result {
            Ok(()) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), "cannot write the component cache: {e}")
            }
        }
    }
}
