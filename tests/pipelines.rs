//! Runs every script in pipelines/ the way a user would (gst-launch-1.0 in a child process, the
//! freshly built plugin on GST_PLUGIN_PATH), with small sizes and frame counts, window sinks
//! replaced through SINK, and checks what comes out: the frame count, and that the frames are
//! the stylized input (compared with the same source run through toonflow in this process).
//! rtmp-relay.sh needs a server and is run by tests/relay.rs.
//!
//! Also checks that README.md's property table lists every property of the element with its
//! type, range, default and whether it can change while playing, and that its table of
//! environment variables lists every one the sources read.

mod common;

use common::{TempDir, app_sink, plugin_dir, repo_root};
use std::path::Path;
use std::process::Command;

use gst::glib;
use gst::prelude::*;

/// Every file in pipelines/ and the test that runs it.
const TESTED_ELSEWHERE: &[(&str, &str)] = &[
    ("rtmp-relay.sh", "tests/relay.rs"),
    ("nvcodec-file-to-file.sh", "tests/cuda_memory.rs"),
];
const TESTED_HERE: &[&str] = &[
    "file-to-file.sh",
    "test-pattern-to-window.sh",
    "camera-to-window.sh",
];

fn init() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        gst::init().unwrap();
        gsttoonflow::plugin_register_static().unwrap();
    });
}

/// Runs a script of pipelines/ with `env`, failing with its output when it fails or reports an
/// error.
fn run_script(name: &str, args: &[&Path], env: &[(&str, String)]) -> String {
    let script = repo_root().join("pipelines").join(name);
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .args(args)
        .env("GST_PLUGIN_PATH", plugin_dir());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !text.contains("ERROR"),
        "{name} failed ({}):\n{text}",
        out.status
    );
    text
}

/// Luma (GRAY8) frames of a pipeline description ending in `appsink name=sink`.
fn gray_frames(description: &str) -> Vec<Vec<u8>> {
    init();
    let pipeline = gst::parse::launch(description).unwrap();
    let sink = app_sink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut frames = Vec::new();
    while let Ok(sample) = sink.pull_sample() {
        let map = sample.buffer().unwrap().map_readable().unwrap();
        frames.push(map.to_vec());
    }
    let bus = pipeline.bus().unwrap();
    let err = bus.pop_filtered(&[gst::MessageType::Error]);
    pipeline.set_state(gst::State::Null).unwrap();
    if let Some(msg) = err
        && let gst::MessageView::Error(e) = msg.view()
    {
        panic!("{description}: {} {:?}", e.error(), e.debug());
    }
    frames
}

/// The first frame of a videotestsrc pattern at w×h, as luma, with and without toonflow.
fn pattern_references(pattern: &str, w: usize, h: usize) -> (Vec<u8>, Vec<u8>) {
    let make = |filter: &str| {
        gray_frames(&format!(
            "videotestsrc pattern={pattern} num-buffers=1 \
             ! video/x-raw,format=NV12,width={w},height={h},framerate=30/1 ! {filter} \
             videoconvert ! video/x-raw,format=GRAY8 ! appsink name=sink sync=false"
        ))
        .remove(0)
    };
    (make(""), make("toonflow backend=cpu !"))
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .sum::<f64>()
        / a.len() as f64
}

/// Asserts that `frame` is the stylized reference, not the plain one (`slack`: codec error).
fn assert_stylized(what: &str, frame: &[u8], plain: &[u8], styled: &[u8], slack: f64) {
    let to_styled = mean_abs_diff(frame, styled);
    let to_plain = mean_abs_diff(frame, plain);
    println!(
        "{what}: mean |luma difference| to the stylized reference {to_styled:.2}, \
         to the input {to_plain:.2}"
    );
    assert!(
        to_styled < slack && to_styled < 0.35 * to_plain,
        "{what}: output is not the stylized input ({to_styled:.2} from the stylized reference, \
         {to_plain:.2} from the input)"
    );
}

/// Reads raw GRAY8 frames of w×h written by a filesink.
fn read_gray(path: &Path, w: usize, h: usize) -> Vec<Vec<u8>> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        data.len() % (w * h),
        0,
        "partial frame in {}",
        path.display()
    );
    data.chunks_exact(w * h).map(<[u8]>::to_vec).collect()
}

/// A SINK value that writes the luma of every frame to `path`.
fn gray_file_sink(path: &Path) -> String {
    format!(
        "video/x-raw,format=GRAY8 ! filesink location={}",
        path.display()
    )
}

#[test]
fn every_pipeline_script_is_tested() {
    let mut names: Vec<String> = std::fs::read_dir(repo_root().join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in &names {
        let here = TESTED_HERE.contains(&name.as_str());
        let elsewhere = TESTED_ELSEWHERE.iter().find(|(n, _)| n == name);
        assert!(
            here || elsewhere.is_some(),
            "pipelines/{name} is run by no test: add it to tests/pipelines.rs"
        );
        if let Some((_, test)) = elsewhere {
            assert!(repo_root().join(test).exists(), "{test} is missing");
        }
        let path = repo_root().join("pipelines").join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("#!") && text.contains("# Needs:"),
            "pipelines/{name} lacks its #! line or its '# Needs:' header comment"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert!(mode & 0o111 != 0, "pipelines/{name} is not executable");
        }
    }
    println!("pipelines/: {names:?}");
}

#[test]
fn test_pattern_to_window() {
    let (w, h, n) = (160, 120, 8);
    let dir = TempDir::new("pattern");
    let out = dir.path("luma.raw");
    run_script(
        "test-pattern-to-window.sh",
        &[],
        &[
            ("SINK", gray_file_sink(&out)),
            ("NUM_BUFFERS", n.to_string()),
            ("WIDTH", w.to_string()),
            ("HEIGHT", h.to_string()),
            ("PATTERN", "circular".into()),
        ],
    );
    let frames = read_gray(&out, w, h);
    assert_eq!(frames.len(), n, "frames written");
    let (plain, styled) = pattern_references("circular", w, h);
    assert_stylized(
        "test-pattern-to-window.sh",
        &frames[0],
        &plain,
        &styled,
        1.0,
    );
}

#[test]
fn camera_to_window() {
    // videotestsrc's own size, so that the replacement source is not scaled.
    let (w, h, n) = (320, 240, 8);
    let dir = TempDir::new("camera");
    let out = dir.path("luma.raw");
    let camera = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().starts_with("video"))
        })
        .unwrap_or(false);
    let mut env = vec![
        ("SINK", gray_file_sink(&out)),
        ("NUM_BUFFERS", n.to_string()),
        ("WIDTH", w.to_string()),
        ("HEIGHT", h.to_string()),
    ];
    if camera {
        println!("camera-to-window.sh: running on the camera at /dev/video*");
    } else {
        println!(
            "camera-to-window.sh: no /dev/video* here, so the camera is replaced by \
             SOURCE=\"videotestsrc is-live=true pattern=circular\"; the script's decode, \
             convert and toonflow part still runs"
        );
        env.push((
            "SOURCE",
            "videotestsrc is-live=true pattern=circular".into(),
        ));
    }
    run_script("camera-to-window.sh", &[], &env);
    let frames = read_gray(&out, w, h);
    // A live source behind a leaky queue may lose frames when the machine is busy.
    assert!(
        frames.len() >= 2 && frames.len() <= n,
        "{} frames written, {n} captured",
        frames.len()
    );
    if !camera {
        let (plain, styled) = pattern_references("circular", w, h);
        // The source reaches NV12 through decodebin and videoconvert from its own format.
        assert_stylized("camera-to-window.sh", &frames[0], &plain, &styled, 3.0);
    }
}

#[test]
fn file_to_file() {
    let (w, h, n) = (176, 144, 20);
    let dir = TempDir::new("file");
    let input = dir.path("in.mkv");
    let output = dir.path("out.mp4");
    make_mkv_to(&input, w, h, n);
    run_script("file-to-file.sh", &[&input, &output], &[]);
    let frames = gray_frames(&format!(
        "filesrc location=\"{}\" ! qtdemux ! video/x-h264 ! h264parse ! avdec_h264 \
         ! videoconvert ! video/x-raw,format=GRAY8 ! appsink name=sink sync=false",
        output.display()
    ));
    assert_eq!(frames.len(), n, "H.264 frames in the MP4");
    let (plain, styled) = pattern_references("circular", w, h);
    // VP8 then H.264: allow some codec error.
    assert_stylized("file-to-file.sh", &frames[0], &plain, &styled, 4.0);
}

#[test]
fn file_to_file_with_audio_and_options() {
    let (w, h, n) = (176, 144, 20);
    let dir = TempDir::new("file-audio");
    let input = dir.path("in.mkv");
    let output = dir.path("out.mp4");
    make_mkv_to(&input, w, h, n);
    run_script(
        "file-to-file.sh",
        &[&input, &output],
        &[
            ("AUDIO", "1".into()),
            ("WIDTH", "96".into()),
            ("HEIGHT", "64".into()),
            ("NUM_BUFFERS", "10".into()),
            ("TOONFLOW", "levels=4 edge-strength=0.5".into()),
        ],
    );
    let frames = gray_frames(&format!(
        "filesrc location=\"{}\" ! qtdemux ! video/x-h264 ! h264parse ! avdec_h264 \
         ! videoconvert ! video/x-raw,format=GRAY8 ! appsink name=sink sync=false",
        output.display()
    ));
    assert_eq!(frames.len(), 10, "NUM_BUFFERS=10 frames");
    assert_eq!(frames[0].len(), 96 * 64, "scaled to WIDTH x HEIGHT");
    let audio = gray_frames(&format!(
        "filesrc location=\"{}\" ! qtdemux ! audio/mpeg,mpegversion=4 ! aacparse \
         ! appsink name=sink sync=false",
        output.display()
    ));
    assert!(!audio.is_empty(), "AUDIO=1 writes an AAC track");
}

/// A short clip with video (VP8) and audio (Vorbis) in Matroska: a container and codecs other
/// than the H.264/MP4 the script writes.
fn make_mkv_to(path: &Path, w: usize, h: usize, frames: usize) {
    let line = format!(
        "videotestsrc pattern=circular num-buffers={frames} \
         ! video/x-raw,width={w},height={h},framerate=15/1 \
         ! vp8enc deadline=1 target-bitrate=2000000 ! queue ! matroskamux name=mux \
         ! filesink location=\"{}\" \
         audiotestsrc num-buffers={frames} samplesperbuffer=2940 \
         ! audio/x-raw,rate=44100 ! vorbisenc ! queue ! mux.",
        path.display()
    );
    init();
    let pipeline = gst::parse::launch(&line).unwrap();
    common::play_to_eos(&pipeline, 60, "making the input clip");
}

/// scripts/demo.c, the program behind the README's main command (scripts/demo.sh), on a short,
/// small clip: it writes an H.264 MP4 of the side-by-side frames and three PNG stills.
#[test]
fn demo_program_makes_video_and_stills() {
    let dir = TempDir::new("demo");
    let exe = dir.path("toonflow-demo");
    let flags = Command::new("pkg-config")
        .args([
            "--cflags",
            "--libs",
            "gstreamer-1.0",
            "gstreamer-controller-1.0",
        ])
        .output()
        .expect("pkg-config (sudo ./scripts/install-deps.sh)");
    assert!(flags.status.success(), "pkg-config gstreamer-1.0 failed");
    let status = Command::new("gcc")
        .arg("-O2")
        .arg("-Wall")
        .arg(repo_root().join("scripts/demo.c"))
        .arg("-o")
        .arg(&exe)
        .args(String::from_utf8_lossy(&flags.stdout).split_whitespace())
        .status()
        .expect("gcc (sudo ./scripts/install-deps.sh)");
    assert!(status.success(), "compiling scripts/demo.c failed");
    let video = dir.path("demo.mp4");
    let out = Command::new(&exe)
        .arg(repo_root().join("tests/data/astronaut.png"))
        .arg(&video)
        .arg(&dir.0)
        .args(["160", "90", "1"])
        .env("GST_PLUGIN_PATH", plugin_dir())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "toonflow-demo failed:\n{text}");
    let frames = gray_frames(&format!(
        "filesrc location=\"{}\" ! qtdemux ! video/x-h264 ! h264parse ! avdec_h264 \
         ! videoconvert ! video/x-raw,format=GRAY8,width=320,height=90 \
         ! appsink name=sink sync=false",
        video.display()
    ));
    assert_eq!(frames.len(), 30, "1 s at 30 fps, side by side 320x90");
    // The right half (toonflow) differs from the left half (input).
    let f = &frames[15];
    let diff: f64 = (0..90)
        .flat_map(|y| (0..160).map(move |x| (y, x)))
        .map(|(y, x)| (f[y * 320 + x] as f64 - f[y * 320 + 160 + x] as f64).abs())
        .sum::<f64>()
        / (160.0 * 90.0);
    assert!(diff > 5.0, "the two halves are nearly equal ({diff:.2})");
    for i in 0..3 {
        let png = dir.path(&format!("demo-{i}.png"));
        let data = std::fs::read(&png).unwrap_or_else(|_| panic!("no still {}", png.display()));
        assert!(
            data.starts_with(b"\x89PNG"),
            "{} is not a PNG",
            png.display()
        );
    }
}

/// (name, type, range, default, changes while playing, description) of each property the
/// element itself defines, as README.md's table shows them.
fn property_rows() -> Vec<[String; 6]> {
    init();
    let element = gst::ElementFactory::make("toonflow").build().unwrap();
    let mut rows = Vec::new();
    for pspec in element.list_properties() {
        if pspec.owner_type() != element.type_() {
            continue;
        }
        let (ty, range, default) = if let Some(p) = pspec.downcast_ref::<glib::ParamSpecBoolean>() {
            ("bool".into(), "".into(), p.default_value().to_string())
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecUInt>() {
            (
                "uint".into(),
                format!("{} – {}", p.minimum(), p.maximum()),
                p.default_value().to_string(),
            )
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecUInt64>() {
            (
                "uint64".into(),
                format!("{} – {}", p.minimum(), p.maximum()),
                p.default_value().to_string(),
            )
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecInt>() {
            (
                "int".into(),
                format!("{} – {}", p.minimum(), p.maximum()),
                p.default_value().to_string(),
            )
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecFloat>() {
            (
                "float".into(),
                format!("{} – {}", p.minimum(), p.maximum()),
                p.default_value().to_string(),
            )
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecDouble>() {
            (
                "double".into(),
                format!("{} – {}", p.minimum(), p.maximum()),
                p.default_value().to_string(),
            )
        } else if let Some(p) = pspec.downcast_ref::<glib::ParamSpecEnum>() {
            let class = p.enum_class();
            let nicks: Vec<&str> = class.values().iter().map(|v| v.nick()).collect();
            let default = class
                .value(p.default_value_as_i32())
                .map(|v| v.nick())
                .unwrap_or("?");
            ("enum".into(), nicks.join(", "), default.to_string())
        } else if pspec.value_type() == gst::Structure::static_type() {
            ("GstStructure".into(), "".into(), "".into())
        } else {
            (pspec.value_type().name().to_string(), "".into(), "".into())
        };
        let flags = pspec.flags();
        let live = if !flags.contains(glib::ParamFlags::WRITABLE) {
            "read-only"
        } else if flags.contains(gst::PARAM_FLAG_MUTABLE_PLAYING) {
            "yes"
        } else {
            "no (set before start)"
        };
        rows.push([
            pspec.name().to_string(),
            ty,
            range,
            default,
            live.to_string(),
            pspec.blurb().unwrap_or("").to_string(),
        ]);
    }
    rows
}

fn row_prefix(row: &[String; 6]) -> String {
    format!(
        "| `{}` | {} | {} | {} | {} |",
        row[0], row[1], row[2], row[3], row[4]
    )
}

/// Keeps README.md's property table in step with the element. `TOONFLOW_PRINT_PROPERTY_TABLE=1`
/// prints the table (descriptions from the element's blurbs) to paste into the README.
#[test]
fn readme_property_table_matches_the_element() {
    let rows = property_rows();
    assert!(rows.len() >= 20, "expected the element's ~23 properties");
    if std::env::var_os("TOONFLOW_PRINT_PROPERTY_TABLE").is_some() {
        println!("| Property | Type | Range | Default | Changes while playing | Description |");
        println!("| --- | --- | --- | --- | --- | --- |");
        for row in &rows {
            println!("{} {} |", row_prefix(row), row[5]);
        }
    }
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let mut wrong = Vec::new();
    for row in &rows {
        let name = format!("| `{}` |", row[0]);
        match readme.lines().find(|l| l.starts_with(&name)) {
            None => wrong.push(format!("missing: {}", row_prefix(row))),
            Some(line) if !line.starts_with(&row_prefix(row)) => wrong.push(format!(
                "differs: README has\n  {line}\nthe element says\n  {} {} |",
                row_prefix(row),
                row[5]
            )),
            Some(_) => {}
        }
    }
    // And no row for a property the element no longer has.
    let in_table = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| !rows.iter().any(|r| r[0] == *n))
        .filter(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .map(str::to_string)
        .collect::<Vec<_>>();
    for n in in_table {
        wrong.push(format!("README documents `{n}`, which the element lacks"));
    }
    assert!(
        wrong.is_empty(),
        "README.md's property table is out of step with the element \
         (TOONFLOW_PRINT_PROPERTY_TABLE=1 prints the table):\n{}",
        wrong.join("\n")
    );
}

/// Every `"TOONFLOW_..."` environment variable name in the sources, with the file naming it.
fn environment_variables_read(dir: &Path, found: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            environment_variables_read(&path, found);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (name, end) in variable_names_after(&text, '"') {
            if text[end..].starts_with('"') {
                found.push((name, path.display().to_string()));
            }
        }
    }
}

/// Every `TOONFLOW_...` name in `text` right after `quote`, with the index just past it.
fn variable_names_after(text: &str, quote: char) -> Vec<(String, usize)> {
    text.match_indices(&format!("{quote}TOONFLOW_"))
        .map(|(at, _)| {
            let start = at + quote.len_utf8();
            let name: String = text[start..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let end = start + name.len();
            (name, end)
        })
        .collect()
}

/// README.md's table of environment variables and the variables the plugin and toonflow-bench
/// read (`src/`) are the same set.
#[test]
fn readme_lists_every_environment_variable() {
    let root = repo_root();
    let mut read = Vec::new();
    environment_variables_read(&root.join("src"), &mut read);
    assert!(
        read.iter().any(|(n, _)| n == "TOONFLOW_KERNEL_CACHE") && read.len() >= 20,
        "the scan found too few variables: {read:?}"
    );
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme
        .split("### Environment variables")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("README.md has a section \"### Environment variables\"");
    // the table's first column, whole names only (`TOONFLOW_NEURAL_PIPELINE` must not pass
    // for being the start of `TOONFLOW_NEURAL_PIPELINE_CL`)
    let listed: Vec<String> = section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .flat_map(|l| variable_names_after(l.split(" | ").next().unwrap_or(""), '`'))
        .map(|(name, _)| name)
        .collect();
    let missing: Vec<_> = read
        .iter()
        .filter(|(name, _)| !listed.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "environment variables read but not in README.md's table: {missing:?}"
    );
    let stale: Vec<_> = listed
        .iter()
        .filter(|name| !read.iter().any(|(n, _)| n == *name))
        .collect();
    assert!(
        stale.is_empty(),
        "README.md's table lists variables nothing in src/ reads: {stale:?}"
    );
}
