//! The map of the code and the user guide stay true: every path, type,
//! module and function that ARCHITECTURE.md names exists, every relative
//! link of README.md and docs/ leads to a file that exists, and no source
//! file grows past what one reads through.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Every file of the repository but build outputs and git's own, as paths
/// relative to its root with `/` separators.
fn repo_files(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                if !matches!(name.as_str(), ".git" | "target" | "node_modules" | "__pycache__") {
                    dirs.push(path);
                }
            } else {
                files.push(path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/"));
            }
        }
    }
    files
}

/// The names in backquotes that look like a file or a folder of the
/// repository: a known extension, or a slash and no spaces, calls or
/// options.
fn named_paths(text: &str) -> Vec<String> {
    const EXTENSIONS: [&str; 8] = [".rs", ".py", ".md", ".toml", ".cc", ".sh", ".txt", ".json"];
    let mut names = Vec::new();
    for (i, quoted) in text.split('`').enumerate() {
        if i % 2 == 0 || quoted.is_empty() || quoted.contains(char::is_whitespace) {
            continue;
        }
        let looks_like_file = EXTENSIONS.iter().any(|e| quoted.ends_with(e));
        let looks_like_dir = quoted.ends_with('/') && !quoted.starts_with('/') && !quoted.contains(['<', '$', '*']);
        if (looks_like_file || looks_like_dir) && !quoted.contains(['(', ':', '=', '<', '$', '*', '{']) {
            names.push(quoted.to_string());
        }
    }
    names
}

/// A name exists if it is a path from the repository's root, from
/// `crates/` or `python/`, or, written short as ARCHITECTURE.md does
/// inside a crate's paragraph, the end of some file's path.
fn exists(name: &str, files: &[String]) -> bool {
    let name = name.trim_start_matches("./");
    let suffix = format!("/{name}");
    files.iter().any(|f| {
        f == name
            || f.starts_with(&format!("{}/", name.trim_end_matches('/')))
            || f.ends_with(&suffix)
            || (name.ends_with('/') && f.contains(&format!("/{name}")))
    })
}

#[test]
fn every_path_architecture_names_exists() {
    let root = repo();
    let files = repo_files(&root);
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let names = named_paths(&text);
    assert!(names.len() > 50, "ARCHITECTURE.md names only {} paths: is the parser broken?", names.len());
    let missing: Vec<&String> = names.iter().filter(|n| !exists(n, &files)).collect();
    assert!(missing.is_empty(), "ARCHITECTURE.md names paths that do not exist: {missing:?}");
}

#[test]
fn a_path_that_is_not_there_is_caught() {
    let files = repo_files(&repo());
    assert!(exists("crates/kolo/tests/docs.rs", &files));
    assert!(exists("kolo/tests/docs.rs", &files));
    assert!(!exists("crates/kolo-exec/src/worker/mod.rs", &files));
    assert_eq!(named_paths("a `x/y.rs` and `--flag` and `kolo run -np 2` and `f(a/b.rs)`"), ["x/y.rs"]);
}

/// What the code defines, by name: Rust items (types, traits, functions,
/// modules, constants, statics, enum variants) and Python classes and
/// functions, and the modules their files make.
fn definitions(files: &[String]) -> std::collections::HashSet<String> {
    const ITEMS: [&str; 9] = ["struct ", "enum ", "trait ", "type ", "fn ", "mod ", "const ", "static ", "union "];
    const PREFIXES: [&str; 7] = ["pub(crate) ", "pub(super) ", "pub ", "async ", "unsafe ", "const fn ", "extern "];
    let root = repo();
    let mut names = std::collections::HashSet::new();
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    for file in files.iter().filter(|f| f.ends_with(".rs") || f.ends_with(".py")) {
        let path = Path::new(file);
        names.insert(path.file_stem().unwrap().to_string_lossy().to_string());
        if let Some(dir) = path.parent().and_then(Path::file_name) {
            names.insert(dir.to_string_lossy().to_string());
        }
        for line in std::fs::read_to_string(root.join(file)).unwrap_or_default().lines() {
            let mut item = line.trim_start();
            if file.ends_with(".py") {
                for keyword in ["class ", "def ", "async def "] {
                    if let Some(rest) = item.strip_prefix(keyword) {
                        names.insert(ident(rest));
                    }
                }
                continue;
            }
            while let Some(rest) = PREFIXES.iter().find_map(|p| item.strip_prefix(p)) {
                item = rest;
            }
            if let Some(rest) = ITEMS.iter().find_map(|k| item.strip_prefix(k)) {
                names.insert(ident(rest));
            } else if let Some(rest) = item.split("create_exception!(").nth(1) {
                // a Python exception class made in Rust: `create_exception!(module, Name, Base)`
                names.extend(rest.split(',').nth(1).map(|n| ident(n.trim())));
            } else if let Some(rest) = item.split(".add(\"").nth(1) {
                // a Python module's attribute set in Rust: `m.add("NAME", value)`
                names.insert(ident(rest));
            } else if line.starts_with("    ") && item.starts_with(char::is_lowercase) && !item.starts_with("let ") {
                // a struct's field: `name: Type,`
                let name = ident(item);
                if item[name.len()..].starts_with(": ") {
                    names.insert(name);
                }
            } else if line.starts_with("    ") && item.starts_with(char::is_uppercase) {
                // an enum's variant: `Name,` `Name(..)` `Name { .. }`
                let name = ident(item);
                if item[name.len()..].starts_with([',', '(', ' ', '{']) || item.len() == name.len() {
                    names.insert(name);
                }
            }
        }
    }
    names
}

/// The names in backquotes that the code must define: `UpperCamelCase`
/// types, `a::b` paths (the last segment, and the crate when it is
/// kolo's), `calls()`, and dotted Python modules of the package
/// (`kolo.x`, `horovod.x`, as files or folders under `python/kolo`).
/// What is wrong, by name; empty when all are there.
fn undefined_names(text: &str, files: &[String]) -> Vec<String> {
    let defined = definitions(files);
    let crates: Vec<String> = files
        .iter()
        .filter_map(|f| f.strip_prefix("crates/")?.strip_suffix("/Cargo.toml").map(|c| c.replace('-', "_")))
        .collect();
    let is_ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_');
    // what Python's and Rust's standard libraries define, which the text names
    const FOREIGN: [&str; 12] = [
        "ValueError",
        "TimeoutError",
        "RuntimeError",
        "KeyError",
        "TypeError",
        "Exception",
        "KeyboardInterrupt",
        "Mutex",
        "Condvar",
        "Arc",
        "Option",
        "Result",
    ];
    let module_exists = |dotted: &str| {
        // the extension module, built from kolo-py
        if dotted == "kolo._kolo" {
            return true;
        }
        let rel =
            dotted.replacen("horovod", "kolo/horovod", usize::from(dotted.starts_with("horovod"))).replace('.', "/");
        files.iter().any(|f| f == &format!("python/{rel}.py") || f.starts_with(&format!("python/{rel}/")))
    };
    let mut wrong = Vec::new();
    for (i, quoted) in text.split('`').enumerate() {
        if i % 2 == 0
            || quoted.is_empty()
            || quoted.contains(char::is_whitespace)
            || !named_paths(&format!("`{quoted}`")).is_empty()
        {
            continue;
        }
        let name = quoted.strip_suffix("()").unwrap_or(quoted);
        let call = name.len() < quoted.len();
        if name.contains("::") {
            let segments: Vec<&str> = name.split("::").collect();
            let last = segments.last().copied().unwrap_or("");
            // other crates' paths (`std::`, `clippy::`...) are theirs to keep
            let first = segments[0];
            let ours = first.starts_with("kolo") || first == "crate" || first.starts_with(char::is_uppercase);
            if !ours || !segments.iter().all(|s| is_ident(s)) {
                continue;
            }
            if segments[0].starts_with("kolo") && !crates.iter().any(|c| c == segments[0]) {
                wrong.push(format!("{quoted}: no crate {}", segments[0]));
            } else if !defined.contains(last) {
                wrong.push(format!("{quoted}: {last} is not defined"));
            }
        } else if name.contains('.') {
            let parts: Vec<&str> = name.split('.').collect();
            if !(parts[0] == "kolo" || parts[0] == "horovod") || !parts.iter().all(|p| is_ident(p)) {
                continue;
            }
            let last = parts.last().copied().unwrap_or("");
            let parent = parts[..parts.len() - 1].join(".");
            // `module.attribute` names a class, a call, or anything a module
            // that is not itself a module defines
            let (module, attribute) = if call || last.starts_with(char::is_uppercase) || !module_exists(name) {
                (parent, Some(last))
            } else {
                (name.to_string(), None)
            };
            if !module_exists(&module) {
                wrong.push(format!("{quoted}: no module {module}"));
            } else if let Some(attribute) = attribute.filter(|a| !defined.contains(*a)) {
                wrong.push(format!("{quoted}: {attribute} is not defined"));
            }
        } else if is_ident(name)
            && (call || name.starts_with(char::is_uppercase) && name.chars().any(char::is_lowercase))
            && !defined.contains(name)
            && !FOREIGN.contains(&name)
        {
            wrong.push(format!("{quoted}: not defined"));
        }
    }
    wrong
}

#[test]
fn every_type_module_and_function_architecture_names_exists() {
    let root = repo();
    let files = repo_files(&root);
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let wrong = undefined_names(&text, &files);
    assert!(wrong.is_empty(), "ARCHITECTURE.md names what the code does not define: {wrong:?}");
}

#[test]
fn a_name_that_is_not_there_is_caught() {
    let files = repo_files(&repo());
    let fine = "`Executor`, `kolo_comm::Communicator`, `Core::submit`, `ElasticEvent::Joined`, `serve_if_worker()`, \
                `kolo.horovod.torch`, `horovod.ray`, `kolo.Executor`, `HorovodCore`, `KOLO_RANK`, `kolo run -np 2`";
    assert_eq!(undefined_names(fine, &files), Vec::<String>::new());
    let wrong =
        "`Executorr`, `kolo_nothing::Communicator`, `Core::submitt`, `serve_if_wrker()`, `kolo.horovod.torchh`, \
                 `horovod.nothere`";
    assert_eq!(undefined_names(wrong, &files).len(), 6, "{:?}", undefined_names(wrong, &files));
}

/// No source file outgrows what one reads through: 800 lines (Rust and
/// Python, the tests' too).
#[test]
fn no_source_file_is_over_800_lines() {
    let root = repo();
    let long: Vec<String> = repo_files(&root)
        .into_iter()
        .filter(|f| (f.ends_with(".rs") || f.ends_with(".py")) && !f.starts_with("target"))
        .filter_map(|f| {
            let lines = std::fs::read_to_string(root.join(&f)).ok()?.lines().count();
            (lines > 800).then(|| format!("{f}: {lines} lines"))
        })
        .collect();
    assert!(long.is_empty(), "split these by concern: {long:?}");
}

/// The relative targets of Markdown links `[text](target)`, without their
/// `#anchor`.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            targets.push(target.to_string());
        }
        rest = &rest[end..];
    }
    targets
}

#[test]
fn every_relative_link_of_the_readme_and_the_guide_leads_somewhere() {
    let root = repo();
    let mut pages = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in link_targets(&text) {
            if !page.parent().unwrap().join(&target).exists() {
                broken.push(format!("{}: {target}", page.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing: {broken:?}");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for page in pages.iter().filter(|p| p.parent().is_some_and(|d| d.ends_with("docs"))) {
        let name = page.file_name().unwrap().to_string_lossy();
        let index = std::fs::read_to_string(root.join("docs/README.md")).unwrap_or_default();
        assert!(
            readme.contains(&format!("docs/{name}")) || index.contains(&format!("({name}")) || name == "README.md",
            "docs/{name} is reachable neither from README.md nor from docs/README.md"
        );
    }
}

/// The non-test code lines (1-based number, text before any `//`) of the
/// Rust sources under `crates/` whose path starts with `prefix`: what a
/// source-level rule checks, the tests after `#[cfg(test)]` left out.
fn code_lines(prefix: &str) -> Vec<(String, usize, String)> {
    let root = repo();
    let mut lines = Vec::new();
    for file in repo_files(&root).into_iter().filter(|f| f.starts_with(prefix) && f.ends_with(".rs")) {
        let text = std::fs::read_to_string(root.join(&file)).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            lines.push((file.clone(), n + 1, line.split("//").next().unwrap_or("").to_string()));
        }
    }
    lines
}

/// ARCHITECTURE.md's invariant "kolo-topology has no I/O and no clock",
/// kept: its sources name no file, socket, process, environment or clock.
#[test]
fn kolo_topology_does_no_io_and_reads_no_clock() {
    const FORBIDDEN: [&str; 9] = [
        "std::fs",
        "std::net",
        "std::process",
        "std::env::var",
        "Instant::now",
        "SystemTime",
        "std::io::stdin",
        "tokio",
        "std::thread",
    ];
    let lines = code_lines("crates/kolo-topology/src/");
    assert!(lines.len() > 1000, "kolo-topology's sources were not found");
    let found: Vec<String> = lines
        .iter()
        .flat_map(|(file, n, line)| {
            FORBIDDEN.iter().filter(|w| line.contains(*w)).map(move |w| format!("{file}:{n}: {w}"))
        })
        .collect();
    assert!(found.is_empty(), "kolo-topology must stay pure: {found:?}");
}

/// ARCHITECTURE.md's rule on locks, kept: no library code panics on a
/// lock a panicking thread left poisoned (kolo-sys's `lock`, or the same
/// rule inline where a crate is loaded into users' processes).
#[test]
fn no_lock_is_unwrapped_outside_tests() {
    const PANICKING: [&str; 4] = [".lock().unwrap()", ".lock().expect(", ".read().unwrap()", ".write().unwrap()"];
    // a condition variable's wait hands the lock back as lock() does
    const WAITS: [&str; 2] = [".wait(", ".wait_timeout("];
    let lines: Vec<_> = code_lines("crates/").into_iter().filter(|(file, ..)| file.contains("/src/")).collect();
    assert!(lines.len() > 10_000, "the crates' sources were not found");
    let unwrapped_wait = |line: &str| {
        WAITS.iter().any(|w| line.contains(w)) && line.contains(".unwrap()") && !line.contains("into_inner")
    };
    let found: Vec<String> = lines
        .iter()
        .filter(|(_, _, line)| PANICKING.iter().any(|p| line.contains(p)) || unwrapped_wait(line))
        .map(|(file, n, _)| format!("{file}:{n}"))
        .collect();
    assert!(found.is_empty(), "a poisoned lock would panic here: {found:?}");
}
