//! From a file to a checked, compiled component.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use wasmtime::component::types::ComponentItem;
use wasmtime::component::Component;
use wasmtime::{Config, Engine};

use crate::{ComponentCache, LoadError, PolicyKind, WIT_VERSION};

/// The one engine every policy runs on. Its configuration is part of the
/// compiled code's identity (fuel metering is compiled in), so it is fixed.
pub(crate) fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut config = Config::new();
        config.consume_fuel(true);
        config.wasm_component_model(true);
        config.concurrency_support(false);
        Engine::new(&config).expect("the policy engine's configuration is valid")
    })
}

/// The name of the types interface a policy of this host's version imports.
pub(crate) fn types_interface() -> String {
    format!("lockstep:policy/types@{WIT_VERSION}")
}

/// A compiled component and where it came from.
pub(crate) struct Loaded {
    pub(crate) component: Component,
    pub(crate) path: PathBuf,
    pub(crate) name: String,
}

/// Reads, checks the header of, and compiles (or fetches from `cache`) the
/// component at `path`.
pub(crate) fn compile(path: &Path, cache: Option<&ComponentCache>) -> Result<Loaded, LoadError> {
    let path = path.to_path_buf();
    let bytes = std::fs::read(&path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            LoadError::Missing { path: path.clone() }
        } else {
            LoadError::Read {
                path: path.clone(),
                source,
            }
        }
    })?;
    check_header(&path, &bytes)?;
    let engine = engine();
    let name = crate::policy_name(&path);
    let started = Instant::now();
    if let Some(component) = cache.and_then(|c| c.get(engine, &bytes)) {
        tracing::debug!(policy = %name, elapsed = ?started.elapsed(), "policy loaded from the component cache");
        return Ok(Loaded {
            component,
            path,
            name,
        });
    }
    let component = Component::new(engine, &bytes).map_err(|e| LoadError::Compile {
        path: path.clone(),
        reason: format!("{e:#}"),
    })?;
    tracing::debug!(policy = %name, elapsed = ?started.elapsed(), "policy compiled");
    if let Some(cache) = cache {
        cache.put(engine, &bytes, &component);
    }
    Ok(Loaded {
        component,
        path,
        name,
    })
}

/// Tells a component from a core module from anything else by the preamble:
/// `\0asm`, then a version and a layer (layer 0: core module, 1: component).
fn check_header(path: &Path, bytes: &[u8]) -> Result<(), LoadError> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(LoadError::NotWasm {
            path: path.to_path_buf(),
        });
    }
    // Bytes 4..8: version 1, layer 0 for a core module (0x0d, layer 1 for a
    // component).
    if bytes[4..8] == [1, 0, 0, 0] {
        return Err(LoadError::CoreModule {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// The names of a component's exported functions and of its imports.
struct Surface {
    exports: Vec<String>,
    imports: Vec<(String, bool)>,
}

fn surface(component: &Component) -> Surface {
    let engine = engine();
    let ty = component.component_type();
    Surface {
        exports: ty
            .exports(engine)
            .filter(|(_, item)| matches!(item.ty, ComponentItem::ComponentFunc(_)))
            .map(|(name, _)| name.to_string())
            .collect(),
        imports: ty
            .imports(engine)
            .map(|(name, item)| {
                (
                    name.to_string(),
                    matches!(item.ty, ComponentItem::ComponentFunc(_)),
                )
            })
            .collect(),
    }
}

/// The kind whose exports the component has, if any.
fn kind_of(s: &Surface) -> Option<PolicyKind> {
    [PolicyKind::Distribution, PolicyKind::Orphans]
        .into_iter()
        .find(|k| k.exports().iter().all(|e| s.exports.iter().any(|x| x == e)))
}

/// Checks that `loaded` implements `expected` and imports nothing but what
/// this host gives (`log` and the types interface of this version). The
/// message names every missing export and every unknown import.
pub(crate) fn check_world(loaded: &Loaded, expected: PolicyKind) -> Result<(), LoadError> {
    let s = surface(&loaded.component);
    let mut problems = Vec::new();
    let missing: Vec<&str> = expected
        .exports()
        .iter()
        .copied()
        .filter(|e| !s.exports.iter().any(|x| x == e))
        .collect();
    if !missing.is_empty() {
        let mut p = format!(
            "missing export{} {}",
            if missing.len() > 1 { "s" } else { "" },
            missing
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        match kind_of(&s) {
            Some(other) if other != expected => {
                p.push_str(&format!(" (it is a policy of the {other} world)"));
            }
            _ if !s.exports.is_empty() => {
                p.push_str(&format!(" (it exports {})", quoted(&s.exports)));
            }
            _ => p.push_str(" (it exports no functions)"),
        }
        problems.push(p);
    }
    let types = types_interface();
    for (name, is_func) in &s.imports {
        if (name == "log" && *is_func) || *name == types {
            continue;
        }
        if let Some(version) = name.strip_prefix("lockstep:policy/types@") {
            problems.push(format!(
                "it was built against lockstep:policy@{version} (it imports `{name}`), this host speaks @{WIT_VERSION} and provides `{types}`"
            ));
        } else {
            problems.push(format!(
                "it imports `{name}`, which this host does not provide (policies get only `log`: no WASI, filesystem, network or clock)"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(LoadError::WrongWorld {
            path: loaded.path.clone(),
            expected,
            reason: problems.join("; "),
        })
    }
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Which world the component at `path` implements, without instantiating
/// it: the conformance check uses this to pick its scenarios.
pub fn detect_kind(path: impl AsRef<Path>) -> Result<PolicyKind, LoadError> {
    let loaded = compile(path.as_ref(), None)?;
    let s = surface(&loaded.component);
    match kind_of(&s) {
        Some(kind) => Ok(kind),
        None => Err(LoadError::UnknownKind {
            path: loaded.path,
            reason: if s.exports.is_empty() {
                "it exports no functions".to_string()
            } else {
                format!(
                    "it exports {}; a distribution policy exports `choose` and `on-mismatch`, an orphan policy `classify`",
                    quoted(&s.exports)
                )
            },
        }),
    }
}

/// Turns a type-check failure of `instantiate_pre` or of the bindings into a
/// wrong-world error that keeps wasmtime's detail.
pub(crate) fn wrong_world(loaded: &Loaded, expected: PolicyKind, e: wasmtime::Error) -> LoadError {
    LoadError::WrongWorld {
        path: loaded.path.clone(),
        expected,
        reason: format!("{e:#}"),
    }
}
