//! Sets COMMIT_ID and BUILD_REL_DATE (gst-plugin-version-helper) for the plugin's version, and
//! reruns when the checked-out commit changes, so gst-inspect shows the commit the library was
//! built from. The kernels need nothing here: `include_str!` makes rustc track them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `git rev-parse <arg>` in the crate's directory (a worktree's own git dir, or the common one).
fn git_path(arg: &str) -> Option<PathBuf> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let out = Command::new("git")
        .args(["rev-parse", arg])
        .current_dir(&manifest_dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    Some(if path.is_absolute() {
        path
    } else {
        Path::new(&manifest_dir).join(path)
    })
}

/// The files a commit, checkout or branch switch touches: HEAD and its reflog in this
/// worktree's git dir, the branch's loose ref and packed-refs in the common dir. Only files that
/// exist are named: cargo reruns the script on every build for a missing one.
fn watched_git_files() -> Vec<PathBuf> {
    let (Some(git_dir), Some(common_dir)) = (git_path("--git-dir"), git_path("--git-common-dir"))
    else {
        return Vec::new(); // not a git checkout (a release tarball): nothing changes
    };
    let mut files = vec![git_dir.join("HEAD"), git_dir.join("logs/HEAD")];
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD"))
        && let Some(reference) = head.trim().strip_prefix("ref: ")
    {
        files.push(common_dir.join(reference));
    }
    files.push(common_dir.join("packed-refs"));
    files.retain(|f| f.is_file());
    files
}

fn main() {
    for file in watched_git_files() {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    // With no file named at all, cargo's default (rerun when any package file changes) applies.
    println!("cargo:rerun-if-changed=build.rs");
    gst_plugin_version_helper::info()
}
