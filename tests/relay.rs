//! End-to-end RTMP relay: a private nginx (libnginx-mod-rtmp) on 127.0.0.1, a GStreamer publisher
//! (H.264 + AAC in FLV, rtmp2sink) to app/in, `pipelines/rtmp-relay.sh` from app/in to app/out,
//! and a GStreamer reader of app/out. Checks that the relayed frames are stylized (close to the same
//! test pattern run through toonflow here, far from the unstylized pattern), that the audio is
//! there, and that no more than a few frames were lost.
//!
//! Needs nginx and libnginx-mod-rtmp (`scripts/install-deps.sh`); without them the test fails,
//! unless TOONFLOW_SKIP_RELAY=1 is set, when it says that it was skipped.

mod common;

use common::{TempDir, app_sink, plugin_dir, repo_root};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;

const RTMP_MODULE: &str = "/usr/lib/nginx/modules/ngx_rtmp_module.so";
const WIDTH: usize = 320;
const HEIGHT: usize = 240;
const FPS: u64 = 30;
/// Frames published (3 s at 30 fps).
const FRAMES: u64 = 90;
/// Frames the relayed stream may lack or have in excess.
const FRAME_TOLERANCE: u64 = 2;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A private nginx with the RTMP module: its own prefix, config and logs in a temp dir, one
/// process (master_process off) stopped on drop, also when the test fails.
struct Nginx {
    child: Child,
    rtmp_port: u16,
    http_port: u16,
    dir: TempDir,
}

impl Nginx {
    fn start() -> Nginx {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or_else(|| {
                panic!(
                    "nginx is not installed: the RTMP relay test needs nginx and libnginx-mod-rtmp \
                     (sudo ./scripts/install-deps.sh), or set TOONFLOW_SKIP_RELAY=1 to skip it"
                )
            });
        assert!(
            Path::new(RTMP_MODULE).exists(),
            "{RTMP_MODULE} is missing: install libnginx-mod-rtmp (sudo ./scripts/install-deps.sh), \
             or set TOONFLOW_SKIP_RELAY=1 to skip the RTMP relay test"
        );
        let dir = TempDir::new("nginx");
        let (rtmp_port, http_port) = (free_port(), free_port());
        let p = dir.0.display();
        let conf = format!(
            "load_module {RTMP_MODULE};\n\
             daemon off;\n\
             master_process off;\n\
             pid {p}/nginx.pid;\n\
             error_log {p}/error.log info;\n\
             events {{ worker_connections 64; }}\n\
             rtmp {{\n\
               server {{\n\
                 listen 127.0.0.1:{rtmp_port};\n\
                 application app {{ live on; }}\n\
               }}\n\
             }}\n\
             http {{\n\
               access_log off;\n\
               client_body_temp_path {p}/body; proxy_temp_path {p}/proxy;\n\
               fastcgi_temp_path {p}/fastcgi; uwsgi_temp_path {p}/uwsgi; scgi_temp_path {p}/scgi;\n\
               server {{ listen 127.0.0.1:{http_port}; location /stat {{ rtmp_stat all; }} }}\n\
             }}\n"
        );
        let conf_path = dir.0.join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let log = std::fs::File::create(dir.0.join("stderr.log")).unwrap();
        let child = Command::new(nginx)
            .arg("-p")
            .arg(&dir.0)
            .arg("-c")
            .arg(&conf_path)
            .args(["-e", "stderr"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn nginx");
        let mut server = Nginx {
            child,
            rtmp_port,
            http_port,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!(
                    "nginx exited ({status}) at start:\n{}{}",
                    read_log(&server.dir.0.join("stderr.log")),
                    read_log(&server.dir.0.join("error.log"))
                );
            }
            if TcpStream::connect(("127.0.0.1", rtmp_port)).is_ok()
                && TcpStream::connect(("127.0.0.1", http_port)).is_ok()
            {
                break;
            }
            assert!(Instant::now() < deadline, "nginx did not listen in 10 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("nginx: rtmp on 127.0.0.1:{rtmp_port}, stats on :{http_port}");
        server
    }

    fn url(&self, stream: &str) -> String {
        format!("rtmp://127.0.0.1:{}/app/{stream}", self.rtmp_port)
    }

    /// nginx-rtmp's XML statistics page.
    fn stat(&self) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.http_port)).expect("stat connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /stat HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body
    }

    /// Clients (players and publisher) of a stream of app, from the statistics page.
    fn clients(&self, stream: &str) -> u32 {
        let xml = self.stat();
        xml.split("<stream>")
            .skip(1)
            .find(|block| block.contains(&format!("<name>{stream}</name>")))
            .and_then(|block| {
                let start = block.find("<nclients>")? + "<nclients>".len();
                let end = block[start..].find('<')? + start;
                block[start..end].parse().ok()
            })
            .unwrap_or(0)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- nginx log ---\n{}{}",
                read_log(&self.dir.0.join("stderr.log")),
                read_log(&self.dir.0.join("error.log"))
            );
        }
    }
}

/// The relay script as a child process; interrupted (SIGINT: gst-launch -e sends EOS) and reaped
/// on drop.
struct Relay {
    child: Child,
    log: PathBuf,
}

impl Relay {
    fn interrupt(&self) {
        // bash's builtin kill: a minimal system may lack /bin/kill (procps)
        let _ = Command::new("bash")
            .args(["-c", &format!("kill -INT {}", self.child.id())])
            .status();
    }

    fn wait_timeout(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.interrupt();
            if self.wait_timeout(Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        if std::thread::panicking() {
            eprintln!("--- relay log ---\n{}", read_log(&self.log));
        }
    }
}

/// Runs a pipeline to EOS, failing on an error or after `limit`.
fn run_to_eos(pipeline: &gst::Element, limit: Duration) {
    pipeline.set_state(gst::State::Playing).unwrap();
    let bus = pipeline.bus().unwrap();
    let msg = bus.timed_pop_filtered(
        gst::ClockTime::from_nseconds(limit.as_nanos() as u64),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    pipeline.set_state(gst::State::Null).unwrap();
    match msg.as_ref().map(|m| m.view()) {
        Some(gst::MessageView::Eos(_)) => {}
        Some(gst::MessageView::Error(e)) => panic!("{}: {:?}", e.error(), e.debug()),
        _ => panic!("no EOS within {limit:?}"),
    }
}

/// The luma plane of one frame of the relayed test pattern made here, with and without toonflow.
fn reference_luma(stylize: bool) -> Vec<u8> {
    let filter = if stylize {
        "toonflow backend=cpu !"
    } else {
        ""
    };
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc pattern=circular num-buffers=1 \
         ! video/x-raw,format=NV12,width={WIDTH},height={HEIGHT},framerate={FPS}/1 \
         ! {filter} appsink name=sink sync=false"
    ))
    .unwrap();
    let sink = app_sink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let sample = sink
        .pull_sample()
        .expect("reference frame (toonflow registered?)");
    pipeline.set_state(gst::State::Null).unwrap();
    let map = sample.buffer().unwrap().map_readable().unwrap();
    map[..WIDTH * HEIGHT].to_vec()
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .sum::<f64>()
        / a.len() as f64
}

/// An AAC encoder that is installed: avenc_aac (gstreamer1.0-libav) or voaacenc (-bad).
fn aac_encoder() -> &'static str {
    ["avenc_aac", "voaacenc"]
        .into_iter()
        .find(|name| gst::ElementFactory::find(name).is_some())
        .expect("no AAC encoder: install gstreamer1.0-libav (avenc_aac) or -plugins-bad (voaacenc)")
}

#[derive(Default)]
struct Received {
    /// Luma planes of the relayed frames.
    frames: Vec<Vec<u8>>,
    /// Their timestamps in ms, for the report.
    pts_ms: Vec<i64>,
    audio_buffers: u64,
    audio_samples: u64,
    audio_sum_sq: f64,
}

#[test]
fn rtmp_relay_stylizes_video_and_passes_audio() {
    if std::env::var("TOONFLOW_SKIP_RELAY").as_deref() == Ok("1") {
        println!("skipped: TOONFLOW_SKIP_RELAY=1 (RTMP relay test not run)");
        return;
    }
    gst::init().unwrap();
    gsttoonflow::plugin_register_static().unwrap();
    let script = repo_root().join("pipelines/rtmp-relay.sh");
    let plugins = plugin_dir();
    let aac = aac_encoder();
    println!("AAC encoder for the published stream: {aac}");

    let server = Nginx::start();

    // 1. The reader of app/out, playing before anything is published so it sees every frame.
    let received = Arc::new(Mutex::new(Received::default()));
    let reader = gst::parse::launch(&format!(
        "rtmp2src location=\"{}\" ! flvdemux name=demux \
         demux.video ! queue ! h264parse ! avdec_h264 max-threads=1 ! videoconvert \
           ! video/x-raw,format=NV12,width={WIDTH},height={HEIGHT} ! appsink name=video sync=false \
         demux.audio ! queue ! aacparse ! decodebin ! audioconvert \
           ! audio/x-raw,format=F32LE,layout=interleaved ! appsink name=audio sync=false",
        server.url("out")
    ))
    .unwrap();
    let r = received.clone();
    app_sink(&reader, "video").set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let buffer = sample.buffer().unwrap();
                let map = buffer.map_readable().unwrap();
                let mut r = r.lock().unwrap();
                r.frames.push(map[..WIDTH * HEIGHT].to_vec());
                r.pts_ms
                    .push(buffer.pts().map_or(-1, |t| t.mseconds() as i64));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let r = received.clone();
    app_sink(&reader, "audio").set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let map = sample.buffer().unwrap().map_readable().unwrap();
                let mut r = r.lock().unwrap();
                r.audio_buffers += 1;
                for s in map.chunks_exact(4) {
                    let v = f32::from_le_bytes(s.try_into().unwrap()) as f64;
                    r.audio_samples += 1;
                    r.audio_sum_sq += v * v;
                }
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    reader.set_state(gst::State::Playing).unwrap();

    // A second reader counts the H.264 frames that reach app/in, to tell where losses happen.
    let seen_in = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let in_reader = gst::parse::launch(&format!(
        "rtmp2src location=\"{}\" ! flvdemux name=demux \
         demux.video ! queue ! h264parse ! appsink name=video sync=false \
         demux.audio ! queue ! fakesink",
        server.url("in")
    ))
    .unwrap();
    let count = seen_in.clone();
    app_sink(&in_reader, "video").set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    in_reader.set_state(gst::State::Playing).unwrap();

    // 2. The relay script from app/in to app/out.
    let log = server.dir.0.join("relay.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let child = Command::new("bash")
        .arg(&script)
        .arg(server.url("in"))
        .arg(server.url("out"))
        .env("GST_PLUGIN_PATH", &plugins)
        .env("WIDTH", WIDTH.to_string())
        .env("HEIGHT", HEIGHT.to_string())
        .env("KEYINT", FPS.to_string())
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("run pipelines/rtmp-relay.sh");
    let mut relay = Relay { child, log };

    // Both the relay (player of in) and the reader (player of out) are connected.
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.clients("in") < 2 || server.clients("out") < 1 {
        if let Some(status) = relay.child.try_wait().unwrap() {
            panic!("the relay exited early ({status})");
        }
        assert!(
            Instant::now() < deadline,
            "relay/reader did not connect in 20 s:\n{}",
            server.stat()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // 3. Publish 3 s of live test pattern and sine tone, H.264 + AAC in FLV, to app/in.
    let publisher = gst::parse::launch(&format!(
        "videotestsrc is-live=true pattern=circular num-buffers={FRAMES} \
           ! video/x-raw,width={WIDTH},height={HEIGHT},framerate={FPS}/1 \
           ! x264enc tune=zerolatency key-int-max={FPS} ! h264parse ! queue ! mux. \
         audiotestsrc is-live=true wave=sine freq=440 volume=0.5 num-buffers={FRAMES} \
           samplesperbuffer={} ! audio/x-raw,rate=44100,channels=2 ! audioconvert \
           ! {aac} ! aacparse ! queue ! mux. \
         flvmux name=mux streamable=true ! rtmp2sink location=\"{}\"",
        44100 / FPS,
        server.url("in")
    ))
    .unwrap();
    let started = Instant::now();
    run_to_eos(&publisher, Duration::from_secs(60));
    println!(
        "published {FRAMES} frames in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // 4. The relay ends by itself when the publisher stops (rtmp2src gives EOS), and its
    // rtmp2sink ends app/out, so the reader gets EOS too.
    let status = relay
        .wait_timeout(Duration::from_secs(60))
        .expect("the relay did not end within 60 s of the end of the published stream");
    let relay_log = read_log(&relay.log);
    assert!(status.success(), "relay exited with {status}:\n{relay_log}");
    assert!(
        !relay_log.contains("ERROR"),
        "relay reported an error:\n{relay_log}"
    );
    for (name, pipeline) in [("app/out reader", &reader), ("app/in reader", &in_reader)] {
        let msg = pipeline.bus().unwrap().timed_pop_filtered(
            gst::ClockTime::from_seconds(30),
            &[gst::MessageType::Eos, gst::MessageType::Error],
        );
        pipeline.set_state(gst::State::Null).unwrap();
        match msg.as_ref().map(|m| m.view()) {
            Some(gst::MessageView::Eos(_)) => {}
            Some(gst::MessageView::Error(e)) => {
                panic!("{name}: {} {:?}", e.error(), e.debug())
            }
            _ => panic!("{name}: no EOS within 30 s of the relay's end"),
        }
    }

    // 5. Checks.
    let r = received.lock().unwrap();
    let n = r.frames.len() as u64;
    println!(
        "relayed frame timestamps: {} ms to {} ms",
        r.pts_ms.first().unwrap_or(&-1),
        r.pts_ms.last().unwrap_or(&-1)
    );
    println!(
        "frames on app/in: {} of {FRAMES}",
        seen_in.load(std::sync::atomic::Ordering::SeqCst)
    );
    println!(
        "relayed: {n} of {FRAMES} frames, {} audio buffers ({:.2} s)",
        r.audio_buffers,
        r.audio_samples as f64 / 2.0 / 44100.0
    );
    assert!(
        n + FRAME_TOLERANCE >= FRAMES && n <= FRAMES + FRAME_TOLERANCE,
        "relayed {n} frames of {FRAMES} published (tolerance {FRAME_TOLERANCE})"
    );

    let plain = reference_luma(false);
    let styled = reference_luma(true);
    let gap = mean_abs_diff(&plain, &styled);
    assert!(gap > 10.0, "toonflow barely changes the pattern ({gap:.2})");
    let (mut to_styled, mut to_plain) = (0.0, 0.0);
    let tail = &r.frames[r.frames.len() / 2..];
    for f in tail {
        to_styled += mean_abs_diff(f, &styled);
        to_plain += mean_abs_diff(f, &plain);
    }
    to_styled /= tail.len() as f64;
    to_plain /= tail.len() as f64;
    println!(
        "mean |luma difference| of the relayed frames: to the stylized pattern {to_styled:.2}, \
         to the input pattern {to_plain:.2} (the two references differ by {gap:.2})"
    );
    assert!(
        to_styled < 0.35 * to_plain,
        "relayed frames are not stylized: {to_styled:.2} from the stylized reference, \
         {to_plain:.2} from the input"
    );

    // Audio: about as long as published and a real tone (RMS of a 0.5 sine is 0.35).
    let seconds = r.audio_samples as f64 / 2.0 / 44100.0;
    let published = FRAMES as f64 / FPS as f64;
    assert!(r.audio_buffers > 0, "no audio in the relayed stream");
    assert!(
        (seconds - published).abs() < 0.5,
        "relayed audio lasts {seconds:.2} s, published {published:.2} s"
    );
    let rms = (r.audio_sum_sq / r.audio_samples as f64).sqrt();
    assert!(rms > 0.2, "relayed audio is (nearly) silent: RMS {rms:.3}");
    println!("audio RMS {rms:.3}");
}
