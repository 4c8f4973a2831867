//! The on-disk cache of NVRTC's PTX: a process that starts the element again reads the PTX an
//! earlier one compiled instead of paying NVRTC (about 20 s for kernels/neural.cu on 2 cores).
//!
//! One file per build, `<dir>/<file-stem>-<arch>-<key>.ptx`, the key a 64-bit FNV-1a hash of
//! everything the PTX depends on ([`key`]), so a changed kernel, option, NVRTC or toonflow is a
//! new file and never a stale hit. The directory is [`dir`]. The file is the PTX followed by one
//! comment line with its length and hash (still valid PTX), written to a temporary file and
//! renamed into place, so readers see a whole file or none; [`read`] rejects anything else. No
//! GPU, no NVRTC and no GStreamer here: every failure is an `io::Error` the caller ignores by
//! compiling (and writing the file again).

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The directory of the cache; `0`, `off` or empty turn the disk cache off.
pub const ENV: &str = "TOONFLOW_KERNEL_CACHE";

/// 64-bit FNV-1a, hand-written: the key must be the same in every build of toonflow (std's
/// `DefaultHasher` promises no such thing).
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Fnv1a {
    pub const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    pub const PRIME: u64 = 0x0000_0100_0000_01b3;

    pub fn new() -> Self {
        Fnv1a(Self::OFFSET_BASIS)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    /// `bytes` preceded by their length, so that consecutive fields cannot run into each other
    /// ("ab", "c" and "a", "bc" hash differently).
    pub fn field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

impl Default for Fnv1a {
    fn default() -> Self {
        Self::new()
    }
}

/// FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.write(bytes);
    h.finish()
}

/// What NVRTC's PTX depends on.
#[derive(Debug, Clone, Copy)]
pub struct Build<'a> {
    /// The translation unit's name (NVRTC's program name), e.g. "neural.cu".
    pub file: &'a str,
    /// e.g. "sm_90".
    pub arch: &'a str,
    /// The exact option list given to NVRTC.
    pub options: &'a [String],
    /// The whole translation unit.
    pub source: &'a str,
    /// `nvrtcVersion`: (major, minor).
    pub nvrtc: (i32, i32),
}

/// The cache key of `build`: FNV-1a over the crate version, NVRTC's version, the file name, the
/// architecture, the options and the source.
pub fn key(build: &Build) -> u64 {
    let mut h = Fnv1a::new();
    h.field(b"toonflow ptx cache 1");
    h.field(env!("CARGO_PKG_VERSION").as_bytes());
    h.field(format!("nvrtc {}.{}", build.nvrtc.0, build.nvrtc.1).as_bytes());
    h.field(build.file.as_bytes());
    h.field(build.arch.as_bytes());
    h.write(&(build.options.len() as u64).to_le_bytes());
    for option in build.options {
        h.field(option.as_bytes());
    }
    h.field(build.source.as_bytes());
    h.finish()
}

/// `<file-stem>-<arch>-<key as 16 hex digits>.ptx`.
pub fn file_name(build: &Build) -> String {
    let stem = Path::new(build.file)
        .file_stem()
        .map_or_else(|| build.file.into(), |s| s.to_string_lossy());
    format!("{stem}-{}-{:016x}.ptx", build.arch, key(build))
}

/// The cache directory from the values of `TOONFLOW_KERNEL_CACHE`, `XDG_CACHE_HOME` and `HOME`:
/// the first when set (`0`, `off` or empty: no disk cache), else `$XDG_CACHE_HOME/toonflow/kernels`
/// (when absolute, as the XDG specification asks), else `$HOME/.cache/toonflow/kernels`, else
/// none.
pub fn resolve_dir(
    setting: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(setting) = setting {
        let off = setting.is_empty() || setting == "0" || setting.eq_ignore_ascii_case("off");
        return (!off).then(|| PathBuf::from(setting));
    }
    let xdg = xdg_cache_home
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let base = xdg.or_else(|| {
        home.filter(|h| !h.is_empty())
            .map(|h| PathBuf::from(h).join(".cache"))
    })?;
    Some(base.join("toonflow").join("kernels"))
}

/// [`resolve_dir`] of this process's environment (read on every call).
pub fn dir() -> Option<PathBuf> {
    resolve_dir(
        std::env::var_os(ENV),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

const TRAILER: &str = "// toonflow kernel cache: ";

fn trailer(ptx: &str) -> String {
    format!(
        "\n{TRAILER}{} bytes of PTX, FNV-1a {:016x}\n",
        ptx.len(),
        fnv1a(ptx.as_bytes())
    )
}

fn invalid(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

/// The PTX in the cache file `path`, written by [`write()`] for `arch`. An error when the file is
/// missing or unreadable, or is not what [`write()`] wrote (truncated, changed, empty, PTX without
/// a `.version` line or for another architecture).
pub fn read(path: &Path, arch: &str) -> io::Result<String> {
    let text = fs::read_to_string(path)?;
    let body = text
        .strip_suffix('\n')
        .ok_or_else(|| invalid("no final line"))?;
    let (ptx, last) = body
        .rsplit_once('\n')
        .ok_or_else(|| invalid("no trailer"))?;
    if format!("\n{last}\n") != trailer(ptx) {
        return Err(invalid("length or hash differ from the trailer's"));
    }
    if ptx.is_empty() {
        return Err(invalid("empty"));
    }
    if !ptx.lines().any(|l| l.starts_with(".version ")) {
        return Err(invalid("no .version line"));
    }
    let target = |l: &str| {
        l.strip_prefix(".target")
            .and_then(|rest| rest.split([' ', '\t', ',']).find(|t| !t.is_empty()))
            == Some(arch)
    };
    if !ptx.lines().any(target) {
        return Err(invalid("no .target line for the architecture"));
    }
    Ok(ptx.to_string())
}

/// Writes `ptx` to `path` (creating its directory): into a temporary file beside it (named after
/// the process and a counter, so concurrent writers never share one), then renamed over `path`.
pub fn write(path: &Path, ptx: &str) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().ok_or_else(|| invalid("no directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| invalid("no file name"))?
        .to_string_lossy();
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = fs::File::create_new(&tmp)?;
        f.write_all(ptx.as_bytes())?;
        f.write_all(trailer(ptx).as_bytes())?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = "//\n// Generated by NVIDIA NVVM Compiler\n//\n\n.version 8.7\n.target sm_90\n\
                       .address_size 64\n\n.visible .entry k()\n{\n\tret;\n}\n";

    fn build<'a>(source: &'a str, arch: &'a str, options: &'a [String]) -> Build<'a> {
        Build {
            file: "neural_frame.cu",
            arch,
            options,
            source,
            nvrtc: (12, 8),
        }
    }

    /// A fresh directory under the system's temporary one, removed by [`Scratch::drop`].
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "toonflow-ptx-cache-{name}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            let _ = fs::remove_dir_all(&dir);
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference (Fowler, Noll, Vo; draft-eastlake-fnv).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_key_is_stable_and_covers_every_input() {
        let opts = vec!["--fmad=false".to_string(), "--std=c++14".into()];
        let base = key(&build("src", "sm_90", &opts));
        assert_eq!(base, key(&build("src", "sm_90", &opts.clone())));
        assert_ne!(base, key(&build("src ", "sm_90", &opts)));
        assert_ne!(base, key(&build("src", "sm_89", &opts)));
        let fmad = vec!["--fmad=true".to_string(), "--std=c++14".into()];
        assert_ne!(base, key(&build("src", "sm_90", &fmad)));
        assert_ne!(base, key(&build("src", "sm_90", &opts[..1])));
        let nvrtc = Build {
            nvrtc: (12, 9),
            ..build("src", "sm_90", &opts)
        };
        assert_ne!(base, key(&nvrtc));
        let file = Build {
            file: "neural.cu",
            ..build("src", "sm_90", &opts)
        };
        assert_ne!(base, key(&file));
        // Field boundaries are part of the key.
        let a = ["ab".to_string(), "c".into()];
        let b = ["a".to_string(), "bc".into()];
        assert_ne!(key(&build("", "x", &a)), key(&build("", "x", &b)));
    }

    #[test]
    fn the_file_is_named_after_stem_arch_and_key() {
        let opts = vec!["--fmad=false".to_string()];
        let b = build("src", "sm_90", &opts);
        let name = file_name(&b);
        assert_eq!(name, format!("neural_frame-sm_90-{:016x}.ptx", key(&b)));
        assert_eq!(name.len(), "neural_frame-sm_90-".len() + 16 + ".ptx".len());
    }

    #[test]
    fn the_directory_comes_from_the_variable_then_xdg_then_home() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            resolve_dir(os("/tmp/k"), os("/xdg"), os("/home/u")),
            Some(PathBuf::from("/tmp/k"))
        );
        for off in ["0", "off", "OFF", ""] {
            assert_eq!(
                resolve_dir(os(off), os("/xdg"), os("/home/u")),
                None,
                "{off}"
            );
        }
        assert_eq!(
            resolve_dir(None, os("/xdg"), os("/home/u")),
            Some(PathBuf::from("/xdg/toonflow/kernels"))
        );
        // A relative (invalid) XDG_CACHE_HOME is ignored, as the specification says.
        for xdg in [os("rel"), os(""), None] {
            assert_eq!(
                resolve_dir(None, xdg, os("/home/u")),
                Some(PathBuf::from("/home/u/.cache/toonflow/kernels"))
            );
        }
        assert_eq!(resolve_dir(None, None, None), None);
        assert_eq!(resolve_dir(None, os("rel"), os("")), None);
    }

    #[test]
    fn a_written_file_reads_back_identically() {
        let scratch = Scratch::new("roundtrip");
        let path = scratch.0.join("nested").join("k-sm_90-0.ptx");
        assert_eq!(
            read(&path, "sm_90").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        write(&path, PTX).unwrap();
        assert_eq!(read(&path, "sm_90").unwrap(), PTX);
        // The file is the PTX and one comment line (still PTX), and no temporary file is left.
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(PTX));
        assert_eq!(text.lines().count(), PTX.lines().count() + 2);
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);
        // Another architecture's name is not this file.
        assert!(read(&path, "sm_89").is_err());
        assert!(read(&path, "sm_9").is_err());
        // Overwriting replaces it.
        let other = PTX.replace("ret;", "exit;");
        write(&path, &other).unwrap();
        assert_eq!(read(&path, "sm_90").unwrap(), other);
    }

    #[test]
    fn a_damaged_file_is_rejected_and_rewritten() {
        let scratch = Scratch::new("damaged");
        let path = scratch.0.join("k-sm_90-0.ptx");
        write(&path, PTX).unwrap();
        let whole = fs::read(&path).unwrap();
        let mut changed = whole.clone();
        changed[PTX.find("ret").unwrap()] = b'R';
        let damaged: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("truncated in the PTX", whole[..PTX.len() / 2].to_vec()),
            (
                "truncated in the trailer",
                whole[..whole.len() - 5].to_vec(),
            ),
            ("no final newline", whole[..whole.len() - 1].to_vec()),
            ("a changed byte", changed),
            ("not UTF-8", vec![0xff, 0xfe, b'\n']),
            ("bare PTX", PTX.as_bytes().to_vec()),
        ];
        for (what, bytes) in damaged {
            fs::write(&path, &bytes).unwrap();
            assert!(read(&path, "sm_90").is_err(), "{what}");
            write(&path, PTX).unwrap();
            assert_eq!(read(&path, "sm_90").unwrap(), PTX, "{what}");
        }
        // What write wrote but is no PTX for the architecture.
        for (what, text) in [
            ("empty", ""),
            ("no .version", ".target sm_90\n"),
            ("no .target", ".version 8.7\n"),
        ] {
            write(&path, text).unwrap();
            assert!(read(&path, "sm_90").is_err(), "{what}");
        }
    }

    #[test]
    fn an_unwritable_directory_is_an_error_not_a_panic() {
        let scratch = Scratch::new("unwritable");
        fs::create_dir_all(&scratch.0).unwrap();
        // The "directory" is a regular file.
        let file = scratch.0.join("file");
        fs::write(&file, b"x").unwrap();
        assert!(write(&file.join("k-sm_90-0.ptx"), PTX).is_err());
        assert!(read(&file.join("k-sm_90-0.ptx"), "sm_90").is_err());
        // Nothing but the file itself is left behind.
        assert_eq!(fs::read_dir(&scratch.0).unwrap().count(), 1);
    }
}
