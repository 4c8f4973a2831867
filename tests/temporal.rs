//! The temporal filter through the element: noise is steadied, motion does not ghost, and a
//! scene cut empties the ring.

mod common;

use common::*;
use gst::prelude::*;

/// Mean absolute luma change between consecutive outputs of a static noisy scene.
fn flicker(history: u32) -> f64 {
    let base = photo("chelsea.png", 160, 120);
    let mut h = harness(160, 120, &[("temporal-history", &history)]);
    let outputs: Vec<Nv12> = (0..12)
        .map(|i| push_frame(&mut h, &base.with_noise(3.0, 100 + i)))
        .collect();
    // skip the first frames while the ring fills
    let diffs: Vec<f64> = outputs[5..]
        .windows(2)
        .map(|w| mean_abs_diff(w[0].y(), w[1].y()))
        .collect();
    diffs.iter().sum::<f64>() / diffs.len() as f64
}

#[test]
fn history_halves_the_flicker_of_a_static_noisy_scene() {
    let without = flicker(0);
    let with = flicker(4);
    println!("frame-to-frame change: history=0 {without:.3}, history=4 {with:.3}");
    assert!(
        without > 0.2,
        "the noise should make the unfiltered output flicker ({without})"
    );
    assert!(
        with <= 0.5 * without,
        "history=4 gives {with:.3}, history=0 {without:.3}"
    );
}

/// A bright square moving right over a dark, lightly textured background.
fn moving_square(frame: usize) -> Nv12 {
    let (w, h) = (128, 64);
    let mut f = Nv12::new(w, h);
    let x0 = 10 + 8 * frame;
    for y in 0..h {
        for x in 0..w {
            let inside = (x0..x0 + 24).contains(&x) && (20..44).contains(&y);
            f.data[y * w + x] = if inside {
                220
            } else {
                40 + ((x * 7 + y * 3) % 5) as u8
            };
        }
    }
    f.data[w * h..].fill(128);
    f
}

#[test]
fn a_moving_edge_leaves_no_ghost() {
    let mut with = harness(128, 64, &[("temporal-history", &4u32)]);
    let mut without = harness(128, 64, &[("temporal-history", &0u32)]);
    for frame in 0..8 {
        let input = moving_square(frame);
        let a = push_frame(&mut with, &input);
        let b = push_frame(&mut without, &input);
        // the area the square left: filtered output must match the single-frame output
        let x0 = 10 + 8 * frame;
        for y in 16..48 {
            for x in x0.saturating_sub(32)..x0.saturating_sub(4) {
                let (va, vb) = (a.luma(x, y) as i32, b.luma(x, y) as i32);
                assert!(
                    (va - vb).abs() <= 2,
                    "frame {frame}: ghost at ({x},{y}): {va} vs {vb}"
                );
            }
        }
    }
}

#[test]
fn a_scene_cut_empties_the_ring() {
    let a = photo("astronaut.png", 160, 120);
    let b = photo("coffee.png", 160, 120);
    let mut h = harness(160, 120, &[("temporal-history", &4u32)]);
    for i in 0..5 {
        push_frame(&mut h, &a.with_noise(3.0, i));
    }
    let after_cut = push_frame(&mut h, &b);
    let single = stylize(&b, &[("temporal-history", &4u32)]);
    assert_eq!(
        after_cut.data, single.data,
        "first frame after the cut equals the single-frame result"
    );
    let stats = h.element().unwrap().property::<gst::Structure>("stats");
    assert_eq!(stats.get::<u64>("scene-cuts").unwrap(), 1, "{stats}");
    // the next frame of the new scene is filtered again (ring holds the cut frame)
    let next = push_frame(&mut h, &b.with_noise(3.0, 99));
    let next_single = stylize(&b.with_noise(3.0, 99), &[("temporal-history", &0u32)]);
    assert_ne!(next.data, next_single.data);
}

#[test]
fn flush_and_discont_empty_the_ring() {
    let a = photo("astronaut.png", 96, 64);
    let noisy = a.with_noise(3.0, 5);
    let single = stylize(&noisy, &[]);
    for how in ["flush", "discont"] {
        let mut h = harness(96, 64, &[]);
        for i in 0..4 {
            push_frame(&mut h, &a.with_noise(3.0, 50 + i));
        }
        let mut buffer = noisy.to_buffer();
        if how == "flush" {
            assert!(h.push_event(gst::event::FlushStart::new()));
            assert!(h.push_event(gst::event::FlushStop::new(true)));
            h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
                gst::ClockTime,
            >::new()));
        } else {
            buffer.make_mut().set_flags(gst::BufferFlags::DISCONT);
        }
        let out = h.push_and_pull(buffer).unwrap();
        assert_eq!(
            out.map_readable().unwrap().as_slice(),
            single.data.as_slice(),
            "{how}"
        );
    }
}
