//! Builds meson-sample/ (a C application embedding toonflow) with meson and ninja in a temporary
//! build directory and runs it against the freshly built plugin: a normal run must print
//! `toonflow-stats` messages, change properties while PLAYING and end at EOS with status 0; a run
//! with --provoke-error must report the element's error message and exit with status 2.
//!
//! Needs meson, ninja, a C compiler and libgstreamer1.0-dev (`scripts/install-deps.sh`).

mod common;

use common::{plugin_dir, repo_root};
use std::path::PathBuf;
use std::process::{Command, Output};

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn run(cmd: &mut Command, what: &str) -> Output {
    cmd.output().unwrap_or_else(|e| {
        panic!("{what}: cannot run {cmd:?} ({e}); install meson, ninja-build and gcc (sudo ./scripts/install-deps.sh)")
    })
}

#[test]
fn meson_sample_builds_prints_stats_and_handles_errors() {
    let build = TempDir(std::env::temp_dir().join(format!(
        "toonflow-meson-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    )));
    let source = repo_root().join("meson-sample");

    let out = run(
        Command::new("meson")
            .arg("setup")
            .arg(&build.0)
            .arg(&source),
        "meson setup",
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "meson setup failed:\n{o}{e}");
    let out = run(Command::new("ninja").arg("-C").arg(&build.0), "ninja");
    let (o, e) = text(&out);
    assert!(out.status.success(), "ninja failed:\n{o}{e}");
    let exe = build.0.join("toonflow-sample");
    println!("built {}", exe.display());

    // A normal run.
    let out = run(
        Command::new(&exe)
            .args(["--backend", "auto", "--frames", "45", "--size", "160x120"])
            .env("GST_PLUGIN_PATH", plugin_dir()),
        "toonflow-sample",
    );
    let (o, e) = text(&out);
    println!("{o}{e}");
    assert!(
        out.status.success(),
        "toonflow-sample exited with {}",
        out.status
    );
    let stats = o.matches("\nstats: backend=").count();
    assert!(
        stats >= 4,
        "expected 4 toonflow-stats messages, got {stats}"
    );
    assert!(o.contains("toonflow-stats, backend=(string)"));
    assert!(
        o.contains("set while PLAYING after frame 10: levels=4 edge-strength=0.50"),
        "properties were not changed while PLAYING"
    );
    assert!(o.contains("\nEOS\n"));
    assert!(
        o.contains("frames=(guint64)45"),
        "the final stats property counts 45 frames"
    );

    // A run whose element fails: an error message on the bus, reported, exit status 2.
    let out = run(
        Command::new(&exe)
            .args(["--provoke-error", "--size", "160x120"])
            .env("GST_PLUGIN_PATH", plugin_dir()),
        "toonflow-sample --provoke-error",
    );
    let (o, e) = text(&out);
    println!("{o}{e}");
    assert_eq!(
        out.status.code(),
        Some(2),
        "--provoke-error must exit with status 2"
    );
    assert!(
        e.contains("error from element toon: "),
        "the element's error was not reported"
    );
    assert!(!o.contains("\nEOS\n"));
}
