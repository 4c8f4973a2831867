//! Row kernels of the fast CPU path (src/pipeline/fast.rs).
//!
//! Each kernel computes a band of rows of one pass of the stylize pipeline with the same
//! expression, in the same order, as the CPU reference (src/pipeline/cpu.rs), with two changes:
//! `exp` and `tanh` are evaluated by [`exp_nonpositive`] and [`tanh_fast`] (a few ulp from the
//! library functions, and written in plain arithmetic so that they vectorise), and pixels are
//! computed [`LANES`] at a time in fixed-size arrays, which the compiler turns into SIMD
//! registers. Borders replicate the edge pixel through a padded copy of the row, so every pixel
//! of a row takes the vector path.
//!
//! Every kernel is compiled twice (see [`multiversion!`]): for the crate's baseline target and
//! with AVX2 and FMA, chosen at run time through [`Isa`]. Nothing here
//! allocates: padded rows live on the stack.

use super::params::MAX_RADIUS;

/// Pixels computed together: two AVX2 registers of f32.
pub const LANES: usize = 16;
/// Widest luma row (FrameGeometry::MAX_SIZE) plus the widest padding on both sides.
const MAX_PADDED: usize = 8192 + 2 * MAX_RADIUS;

/// The instruction set the kernels run with. Only [`Isa::detect`] can pick AVX2, and only on a
/// CPU that has it, which is what makes calling the AVX2 versions sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa(IsaKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IsaKind {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU runs, or the baseline when `TOONFLOW_CPU_ISA=baseline`
    /// (to measure what a CPU without AVX2 gets).
    pub fn detect() -> Isa {
        if std::env::var("TOONFLOW_CPU_ISA").as_deref() == Ok("baseline") {
            return Isa::baseline();
        }
        Isa::best()
    }

    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            // AVX-512 builds of these kernels measured slower than AVX2 on a Zen 4 (whose
            // 512-bit units are two 256-bit ones), so AVX2 is the top.
            if has!("avx2") && has!("fma") {
                return Isa(IsaKind::Avx2);
            }
        }
        Isa(IsaKind::Baseline)
    }

    /// The crate's baseline target only (the same results, slower; for tests).
    pub fn baseline() -> Isa {
        Isa(IsaKind::Baseline)
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            IsaKind::Baseline => "baseline",
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => "avx2",
        }
    }
}

/// Defines `pub fn $name(isa: Isa, args…)` that runs `$body` compiled for `isa`: one body,
/// generic over its multiply-add `M` ([`Arith`]), built once per instruction set.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        pub fn $name(isa: Isa, $($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments, clippy::extra_unused_type_parameters)]
            fn body<M: Arith>($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) {
                    body::<Fused>($($arg),*)
                }
                if isa.0 == IsaKind::Avx2 {
                    // SAFETY: `IsaKind::Avx2` is only chosen by `Isa::detect` on a CPU that
                    // reports AVX2 and FMA.
                    unsafe { avx2($($arg),*) };
                    return;
                }
            }
            let _ = isa;
            body::<Separate>($($arg),*)
        }
    };
}

/// `exp(x)` for `x ≤ 0`, within 2 ulp of `f32::exp` above `-86` (and a value below 1e-37
/// beneath it). Cephes' `expf`: `x = n·ln2 + r`, a degree-6 polynomial for `exp(r)`, `2ⁿ` put
/// into the exponent bits. Only float arithmetic and bit casts, so a loop of it vectorises.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    // Adding 1.5·2²³ rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -86.0 { -86.0 } else { x };
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut y = 1.987_569_1e-4f32;
    y = y * r + 1.398_199_9e-3;
    y = y * r + 8.333_452e-3;
    y = y * r + 4.166_579_6e-2;
    y = y * r + 1.666_666_5e-1;
    y = y * r + 0.5;
    y = y * (r * r) + r + 1.0;
    let exponent = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32) << 23;
    f32::from_bits((y.to_bits() as i32).wrapping_add(exponent) as u32)
}

/// `tanh(x)` as `(1 − e)/(1 + e)` with `e = exp(−2|x|)`, the sign put back; within 1e-7 of
/// `f32::tanh` everywhere.
#[inline(always)]
pub fn tanh_fast(x: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Copies `src` into `pad[..src.len() + 2r]` with `r` copies of the first and last value on
/// either side (the replicated border).
#[inline(always)]
fn pad_row(src: &[f32], r: usize, pad: &mut [f32]) {
    let w = src.len();
    pad[..r].fill(src[0]);
    pad[r..r + w].copy_from_slice(src);
    pad[r + w..w + 2 * r].fill(src[w - 1]);
}

/// Start of each [`LANES`]-wide chunk covering `0..w`; the last chunk is moved back to end at
/// `w` (it recomputes a few pixels, with the same result). `w ≥ LANES`.
#[inline(always)]
fn chunk_starts(w: usize) -> impl Iterator<Item = usize> {
    (0..w.div_ceil(LANES)).map(move |i| (i * LANES).min(w - LANES))
}

#[inline(always)]
fn lanes(s: &[f32], at: usize) -> &[f32; LANES] {
    s[at..at + LANES].try_into().unwrap()
}

/// Multiply-add as the build at hand does it best: fused where the kernels are compiled with
/// FMA, a multiply and an add otherwise (where `mul_add` would be a slow library call).
pub trait Arith {
    /// `a·b + c`.
    fn mad(a: f32, b: f32, c: f32) -> f32;
}

/// One rounding per multiply-add (the AVX2 build).
pub struct Fused;
/// A rounded product then a rounded sum (the baseline build).
pub struct Separate;

impl Arith for Fused {
    #[inline(always)]
    fn mad(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Arith for Separate {
    #[inline(always)]
    fn mad(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// `2^y` for `y ≤ 0` within 3e-7 relative (0 below 2⁻¹²⁶): the bilateral passes' range
/// weight `exp(coeff·d²)` as `2^(coeff·log₂e·d²)`. A degree-5 minimax polynomial for the
/// fraction and the integer put into the exponent bits; the weights only need ~1e-6 (each
/// enters a normalised sum whose centre weight is 1), which keeps the output within the
/// reference's rounding.
#[inline(always)]
fn exp2_nonpositive<M: Arith>(y: f32) -> f32 {
    // Adding 1.5·2²³ rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let y = if y < -125.0 { -125.0 } else { y };
    let t = y + ROUND;
    let n = t - ROUND;
    let f = y - n;
    let mut p = 1.327_647_2e-3f32;
    p = M::mad(p, f, 9.675_541e-3);
    p = M::mad(p, f, 5.550_713_3e-2);
    p = M::mad(p, f, 2.402_212e-1);
    p = M::mad(p, f, 0.693_146_97);
    p = M::mad(p, f, 1.0);
    let exponent = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32) << 23;
    f32::from_bits((p.to_bits() as i32).wrapping_add(exponent) as u32)
}

/// The range distance of two samples of `C` channels (luma: `C = 1`, scale 1; chroma: the
/// (u, v) pair, scale 100), squared, as the reference sums it.
#[inline(always)]
fn distance2<const C: usize>(scale: f32, a: [f32; C], b: [f32; C]) -> f32 {
    let mut s = 0.0f32;
    for c in 0..C {
        let d = scale * (b[c] - a[c]);
        s += d * d;
    }
    s
}

/// [`distance2`] of `LANES` samples at once: `a[c]` and `b[c]` are the channels' lanes.
#[inline(always)]
fn distance2_lanes<const C: usize>(
    scale: f32,
    a: [&[f32; LANES]; C],
    b: [&[f32; LANES]; C],
) -> [f32; LANES] {
    let mut out = [0.0f32; LANES];
    for c in 0..C {
        for k in 0..LANES {
            let d = scale * (b[c][k] - a[c][k]);
            out[k] += d * d;
        }
    }
    out
}

/// `spatial · 2^(k2·d²)` of `LANES` squared distances: the stored weights of pixel pairs.
#[inline(always)]
fn pair_weights<M: Arith>(spatial: f32, k2: f32, d2: [f32; LANES]) -> [f32; LANES] {
    // A loop, not `map`: a closure handed to a library function may not be inlined, and then
    // it is not compiled with the kernel's instruction set (no FMA).
    let mut out = [0.0f32; LANES];
    for k in 0..LANES {
        out[k] = spatial * exp2_nonpositive::<M>(k2 * d2[k]);
    }
    out
}

/// One tap of `LANES` pixels of `C` channels: weights `e`, neighbours `n`.
#[inline(always)]
fn accumulate<M: Arith, const C: usize>(
    acc: &mut [[f32; LANES]; C],
    wsum: &mut [f32; LANES],
    e: &[f32; LANES],
    n: [&[f32; LANES]; C],
) {
    for c in 0..C {
        for k in 0..LANES {
            acc[c][k] = M::mad(e[k], n[c][k], acc[c][k]);
        }
    }
    for k in 0..LANES {
        wsum[k] += e[k];
    }
}

/// The normalised sums of `LANES` pixels into the `C` output planes at `at`.
#[inline(always)]
fn store_normalised<const C: usize>(
    out: &mut [&mut [f32]; C],
    at: usize,
    acc: &[[f32; LANES]; C],
    wsum: &[f32; LANES],
) {
    for c in 0..C {
        let out = &mut out[c][at..][..LANES];
        for k in 0..LANES {
            out[k] = acc[c][k] / wsum[k];
        }
    }
}

/// A bilateral tap sum of one pixel of `C` channels, weights evaluated per tap (rows narrower
/// than [`LANES`] and the border rows of the vertical passes, where taps repeat a row).
#[inline(always)]
fn bilateral_one<M: Arith, const C: usize>(
    centre: [f32; C],
    r: usize,
    spatial: &[f32; MAX_RADIUS + 1],
    k2: f32,
    scale: f32,
    tap: impl Fn(usize) -> [f32; C],
) -> [f32; C] {
    let (mut acc, mut wsum) = ([0.0f32; C], 0.0f32);
    for t in 0..2 * r + 1 {
        let n = tap(t);
        let wgt = spatial[t.abs_diff(r)] * exp2_nonpositive::<M>(k2 * distance2(scale, centre, n));
        for c in 0..C {
            acc[c] = M::mad(wgt, n[c], acc[c]);
        }
        wsum += wgt;
    }
    acc.map(|a| a / wsum)
}

/// Pixels of a row whose pair weights are computed together in the horizontal passes (their
/// range weights stay in L1).
const SEGMENT: usize = 256;
/// Length of one offset's pair weights in a segment (the segment, the radius, chunk rounding).
const PAIR_LEN: usize = SEGMENT + MAX_RADIUS + LANES;

/// Segments `(start, len)` covering `0..w` (`w ≥ LANES`); a last segment shorter than a chunk
/// is moved back to be one chunk long.
#[inline(always)]
fn segments(w: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..w.div_ceil(SEGMENT)).map(move |i| {
        let s = i * SEGMENT;
        let len = SEGMENT.min(w - s);
        if len < LANES {
            (w - LANES, LANES)
        } else {
            (s, len)
        }
    })
}

/// Horizontal bilateral pass of `C` planes over rows `first..first + rows` (rows of `w`).
///
/// The range weight of the pair (x, x + j) serves both its pixels (tap +j of x and tap −j of
/// x + j: the distance only changes sign), so a pass evaluates r range weights per pixel instead
/// of 2r; they are stored times the spatial weight of offset j (the product the reference
/// forms per tap), for a segment of the row at a time, and every chunk of [`LANES`] pixels then
/// sums its 2r + 1 taps in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn bilateral_x<M: Arith, const C: usize>(
    src: [&[f32]; C],
    scale: f32,
    w: usize,
    first: usize,
    rows: usize,
    mut out: [&mut [f32]; C],
    spatial: &[f32; MAX_RADIUS + 1],
    r: usize,
    coeff: f32,
) {
    let k2 = coeff * std::f32::consts::LOG2_E;
    let mut pad = [[0.0f32; MAX_PADDED + PAIR_LEN]; C];
    // pairs[j][i]: spatial[j] × the range weight of the pair (x, x + j), x = start − r + i;
    // pairs[0] is the centre tap (range weight exp(0) = 1).
    let mut pairs = [[0.0f32; PAIR_LEN]; MAX_RADIUS + 1];
    pairs[0].fill(spatial[0]);
    for row in 0..rows {
        let y = first + row;
        for c in 0..C {
            pad_row(&src[c][y * w..][..w], r, &mut pad[c]);
        }
        let at = |x: usize| -> [f32; C] { std::array::from_fn(|c| pad[c][x]) };
        if w < LANES {
            for x in 0..w {
                let v = bilateral_one::<M, C>(at(x + r), r, spatial, k2, scale, |t| at(x + t));
                for c in 0..C {
                    out[c][row * w + x] = v[c];
                }
            }
            continue;
        }
        for (start, len) in segments(w) {
            // Pixel x sits at pad[x + r]; pair (x, x + j) for x = start − r + i starts at
            // pad[start + i].
            for (j, pair_row) in pairs.iter_mut().enumerate().take(r + 1).skip(1) {
                for i in (0..len + r).step_by(LANES) {
                    let a = std::array::from_fn(|c| lanes(&pad[c], start + i));
                    let b = std::array::from_fn(|c| lanes(&pad[c], start + i + j));
                    let d2 = distance2_lanes::<C>(scale, a, b);
                    pair_row[i..i + LANES].copy_from_slice(&pair_weights::<M>(spatial[j], k2, d2));
                }
            }
            for o in chunk_starts(len) {
                let (mut acc, mut wsum) = ([[0.0f32; LANES]; C], [0.0f32; LANES]);
                for t in 0..2 * r + 1 {
                    // Tap t − r of pixel start + o + k: the neighbour at pad[start + o + k + t],
                    // the weight of pair (x − m, x) or (x, x + m).
                    let e = lanes(&pairs[t.abs_diff(r)], t.min(r) + o);
                    let n = std::array::from_fn(|c| lanes(&pad[c], start + o + t));
                    accumulate::<M, C>(&mut acc, &mut wsum, e, n);
                }
                store_normalised::<C>(&mut out, row * w + start + o, &acc, &wsum);
            }
        }
    }
}

/// Floats of scratch a vertical bilateral pass needs per band: the pair weights of the last
/// `r + 1` rows, `r` offsets each, and a row of centre weights.
pub fn vertical_scratch_len(w: usize, r: usize) -> usize {
    ((r + 1) * r + 1) * w
}

/// Where the pair weight of rows (`y`, `y + j`) of the vertical passes lives in the scratch.
#[inline(always)]
fn pair_row_at(y: usize, j: usize, r: usize, w: usize) -> usize {
    ((y % (r + 1)) * r + (j - 1)) * w
}

/// The pair weights of row `y` with the rows below it, `spatial[j] · w(y, y + j)`, into the
/// scratch ring of [`bilateral_y`]. (A function, not a closure: closures are not compiled with
/// the kernel's instruction set.)
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn vertical_pairs<M: Arith, const C: usize>(
    src: &[&[f32]; C],
    scale: f32,
    w: usize,
    h: usize,
    y: usize,
    spatial: &[f32; MAX_RADIUS + 1],
    r: usize,
    k2: f32,
    pairs: &mut [f32],
) {
    let row = |c: usize, y: usize| &src[c][y * w..][..w];
    for j in 1..=r.min(h - 1 - y) {
        let pair_row = &mut pairs[pair_row_at(y, j, r, w)..][..w];
        if w < LANES {
            for (x, e) in pair_row.iter_mut().enumerate() {
                let a = std::array::from_fn(|c| row(c, y)[x]);
                let b = std::array::from_fn(|c| row(c, y + j)[x]);
                *e = spatial[j] * exp2_nonpositive::<M>(k2 * distance2::<C>(scale, a, b));
            }
            continue;
        }
        for x in chunk_starts(w) {
            let a = std::array::from_fn(|c| lanes(row(c, y), x));
            let b = std::array::from_fn(|c| lanes(row(c, y + j), x));
            let d2 = distance2_lanes::<C>(scale, a, b);
            pair_row[x..x + LANES].copy_from_slice(&pair_weights::<M>(spatial[j], k2, d2));
        }
    }
}

/// Vertical bilateral pass of `C` planes: output rows `first..first + rows` of `w`×`h` planes.
///
/// The range weight of each pair of rows (y, y + j) is evaluated once, for both rows, times the
/// spatial weight of offset j (`scratch`, at least [`vertical_scratch_len`] floats, holds those
/// of the last r + 1 rows). The r rows at the top and bottom of the plane, whose taps repeat the
/// border row at offsets other than their distance, evaluate their weights per tap.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn bilateral_y<M: Arith, const C: usize>(
    src: [&[f32]; C],
    scale: f32,
    w: usize,
    h: usize,
    first: usize,
    rows: usize,
    mut out: [&mut [f32]; C],
    spatial: &[f32; MAX_RADIUS + 1],
    r: usize,
    coeff: f32,
    scratch: &mut [f32],
) {
    let k2 = coeff * std::f32::consts::LOG2_E;
    let (centre, pairs) = scratch.split_at_mut(w);
    centre.fill(spatial[0]);
    let row = |c: usize, y: usize| &src[c][y * w..][..w];
    for y in first.saturating_sub(r)..first {
        vertical_pairs::<M, C>(&src, scale, w, h, y, spatial, r, k2, pairs);
    }
    for y in first..first + rows {
        vertical_pairs::<M, C>(&src, scale, w, h, y, spatial, r, k2, pairs);
        let o = (y - first) * w;
        let tap_row = |t: usize| (y + t).saturating_sub(r).min(h - 1);
        if w >= LANES && (y < r || y + r >= h) {
            for x in chunk_starts(w) {
                let centre = std::array::from_fn(|c| lanes(row(c, y), x));
                let (mut acc, mut wsum) = ([[0.0f32; LANES]; C], [0.0f32; LANES]);
                for t in 0..2 * r + 1 {
                    let n = std::array::from_fn(|c| lanes(row(c, tap_row(t)), x));
                    let d2 = distance2_lanes::<C>(scale, centre, n);
                    let e = pair_weights::<M>(spatial[t.abs_diff(r)], k2, d2);
                    accumulate::<M, C>(&mut acc, &mut wsum, &e, n);
                }
                store_normalised::<C>(&mut out, o + x, &acc, &wsum);
            }
            continue;
        }
        if w < LANES {
            for x in 0..w {
                let centre = std::array::from_fn(|c| row(c, y)[x]);
                let v = bilateral_one::<M, C>(centre, r, spatial, k2, scale, |t| {
                    std::array::from_fn(|c| row(c, tap_row(t))[x])
                });
                for c in 0..C {
                    out[c][o + x] = v[c];
                }
            }
            continue;
        }
        // The taps' weight rows: pair (y − m, y) for the rows above, (y, y + m) below.
        let mut weights: [&[f32]; 2 * MAX_RADIUS + 1] = [&[]; 2 * MAX_RADIUS + 1];
        for (t, wr) in weights.iter_mut().enumerate().take(2 * r + 1) {
            let yn = y + t - r;
            *wr = if t == r {
                centre
            } else {
                &pairs[pair_row_at(y.min(yn), t.abs_diff(r), r, w)..][..w]
            };
        }
        for x in chunk_starts(w) {
            let (mut acc, mut wsum) = ([[0.0f32; LANES]; C], [0.0f32; LANES]);
            for (t, wr) in weights.iter().enumerate().take(2 * r + 1) {
                let n = std::array::from_fn(|c| lanes(row(c, y + t - r), x));
                accumulate::<M, C>(&mut acc, &mut wsum, lanes(wr, x), n);
            }
            store_normalised::<C>(&mut out, o + x, &acc, &wsum);
        }
    }
}

multiversion! {
    /// Horizontal luma bilateral pass over rows `first..first + rows` of `src` (rows of `w`).
    pub fn bilateral_luma_x(
        src: &[f32],
        w: usize,
        first: usize,
        rows: usize,
        out: &mut [f32],
        spatial: &[f32; MAX_RADIUS + 1],
        r: usize,
        coeff: f32,
    ) {
        bilateral_x::<M, 1>([src], 1.0, w, first, rows, [out], spatial, r, coeff);
    }
}

multiversion! {
    /// Vertical luma bilateral pass: output rows `first..first + rows` of a `w`×`h` plane;
    /// `scratch` holds at least [`vertical_scratch_len`] floats.
    pub fn bilateral_luma_y(
        src: &[f32],
        w: usize,
        h: usize,
        first: usize,
        rows: usize,
        out: &mut [f32],
        spatial: &[f32; MAX_RADIUS + 1],
        r: usize,
        coeff: f32,
        scratch: &mut [f32],
    ) {
        bilateral_y::<M, 1>([src], 1.0, w, h, first, rows, [out], spatial, r, coeff, scratch);
    }
}

/// The chroma range distance is taken on 100·(u, v), the scale of L (as the reference does).
const CHROMA_SCALE: f32 = 100.0;

multiversion! {
    /// Horizontal chroma bilateral pass over planar u and v (rows of `w` chroma samples).
    pub fn bilateral_chroma_x(
        src_u: &[f32],
        src_v: &[f32],
        w: usize,
        first: usize,
        rows: usize,
        out_u: &mut [f32],
        out_v: &mut [f32],
        spatial: &[f32; MAX_RADIUS + 1],
        r: usize,
        coeff: f32,
    ) {
        bilateral_x::<M, 2>([src_u, src_v], CHROMA_SCALE, w, first, rows, [out_u, out_v], spatial, r, coeff);
    }
}

multiversion! {
    /// Vertical chroma bilateral pass over planar u and v (a `w`×`h` chroma plane).
    pub fn bilateral_chroma_y(
        src_u: &[f32],
        src_v: &[f32],
        w: usize,
        h: usize,
        first: usize,
        rows: usize,
        out_u: &mut [f32],
        out_v: &mut [f32],
        spatial: &[f32; MAX_RADIUS + 1],
        r: usize,
        coeff: f32,
        scratch: &mut [f32],
    ) {
        bilateral_y::<M, 2>([src_u, src_v], CHROMA_SCALE, w, h, first, rows, [out_u, out_v], spatial, r, coeff, scratch);
    }
}

/// The temporal filter's settings for one frame: the ring entries taking part, newest first.
pub struct TemporalInputs<'a> {
    pub history: &'a [&'a [f32]],
    pub strength: f32,
    pub coeff: f32,
}

multiversion! {
    /// Temporal filter of `n` luma values starting at `offset` against the history planes.
    pub fn temporal_luma(cur: &[f32], offset: usize, out: &mut [f32], inputs: &TemporalInputs) {
        let n = out.len();
        let cur = &cur[offset..][..n];
        let one = |i: usize| {
            let f0 = cur[i];
            let (mut acc, mut wsum, mut sk) = (f0, 1.0f32, 1.0f32);
            for h in inputs.history {
                sk *= inputs.strength;
                let fk = h[offset + i];
                let d = fk - f0;
                let w = sk * exp_nonpositive(inputs.coeff * d * d);
                acc += w * fk;
                wsum += w;
            }
            acc / wsum
        };
        if n < LANES {
            for (i, o) in out.iter_mut().enumerate() {
                *o = one(i);
            }
            return;
        }
        for x in chunk_starts(n) {
            let f0 = lanes(cur, x);
            let (mut acc, mut wsum, mut sk) = (*f0, [1.0f32; LANES], 1.0f32);
            for h in inputs.history {
                sk *= inputs.strength;
                let fk = lanes(h, offset + x);
                for k in 0..LANES {
                    let d = fk[k] - f0[k];
                    let w = sk * exp_nonpositive(inputs.coeff * d * d);
                    acc[k] += w * fk[k];
                    wsum[k] += w;
                }
            }
            for k in 0..LANES {
                out[x + k] = acc[k] / wsum[k];
            }
        }
    }
}

multiversion! {
    /// Temporal filter of `n` (u, v) samples at `offset` of planar u and v; each history entry
    /// is its u plane followed by its v plane (`v_at` further on).
    pub fn temporal_chroma(
        cur_u: &[f32],
        cur_v: &[f32],
        offset: usize,
        v_at: usize,
        out_u: &mut [f32],
        out_v: &mut [f32],
        inputs: &TemporalInputs,
    ) {
        let n = out_u.len();
        let (cu, cv) = (&cur_u[offset..][..n], &cur_v[offset..][..n]);
        if n < LANES {
            for i in 0..n {
                let (mut au, mut av, mut wsum, mut sk) = (cu[i], cv[i], 1.0f32, 1.0f32);
                for h in inputs.history {
                    sk *= inputs.strength;
                    let (u, v) = (h[offset + i], h[v_at + offset + i]);
                    let du = 100.0 * (u - cu[i]);
                    let dv = 100.0 * (v - cv[i]);
                    let w = sk * exp_nonpositive(inputs.coeff * (du * du + dv * dv));
                    au += w * u;
                    av += w * v;
                    wsum += w;
                }
                out_u[i] = au / wsum;
                out_v[i] = av / wsum;
            }
            return;
        }
        for x in chunk_starts(n) {
            let (u0, v0) = (lanes(cu, x), lanes(cv, x));
            let (mut au, mut av, mut wsum, mut sk) = (*u0, *v0, [1.0f32; LANES], 1.0f32);
            for h in inputs.history {
                sk *= inputs.strength;
                let (u, v) = (lanes(h, offset + x), lanes(h, v_at + offset + x));
                for k in 0..LANES {
                    let du = 100.0 * (u[k] - u0[k]);
                    let dv = 100.0 * (v[k] - v0[k]);
                    let w = sk * exp_nonpositive(inputs.coeff * (du * du + dv * dv));
                    au[k] += w * u[k];
                    av[k] += w * v[k];
                    wsum[k] += w;
                }
            }
            for k in 0..LANES {
                out_u[x + k] = au[k] / wsum[k];
                out_v[x + k] = av[k] / wsum[k];
            }
        }
    }
}

/// The DoG's two Gaussians over `edge_radius` and their weight sums (summed in tap order, as
/// the reference sums them per pixel, so the normalisation is bit for bit the same).
pub struct DogWeights {
    pub g1: [f32; 2 * MAX_RADIUS + 1],
    pub g2: [f32; 2 * MAX_RADIUS + 1],
    pub n1: f32,
    pub n2: f32,
    pub r: usize,
}

impl DogWeights {
    pub fn new(p: &super::params::ToonParams) -> DogWeights {
        let r = p.edge_radius.max(0) as usize;
        let mut d = DogWeights {
            g1: [0.0; 2 * MAX_RADIUS + 1],
            g2: [0.0; 2 * MAX_RADIUS + 1],
            n1: 0.0,
            n2: 0.0,
            r,
        };
        for t in 0..2 * r + 1 {
            d.g1[t] = p.edge_gauss1[t.abs_diff(r)];
            d.g2[t] = p.edge_gauss2[t.abs_diff(r)];
            d.n1 += d.g1[t];
            d.n2 += d.g2[t];
        }
        d
    }
}

multiversion! {
    /// Horizontal pass of both DoG Gaussians over luma rows `first..first + rows`.
    pub fn dog_x(
        src: &[f32],
        w: usize,
        first: usize,
        rows: usize,
        out1: &mut [f32],
        out2: &mut [f32],
        dog: &DogWeights,
    ) {
        let r = dog.r;
        let mut pad = [0.0f32; MAX_PADDED];
        for row in 0..rows {
            pad_row(&src[(first + row) * w..][..w], r, &mut pad);
            let o1 = &mut out1[row * w..][..w];
            let o2 = &mut out2[row * w..][..w];
            if w >= LANES {
                for x in chunk_starts(w) {
                    let (mut s1, mut s2) = ([0.0f32; LANES], [0.0f32; LANES]);
                    for t in 0..2 * r + 1 {
                        let v = lanes(&pad, x + t);
                        let (a, b) = (dog.g1[t], dog.g2[t]);
                        for k in 0..LANES {
                            s1[k] += a * v[k];
                            s2[k] += b * v[k];
                        }
                    }
                    for k in 0..LANES {
                        o1[x + k] = s1[k] / dog.n1;
                        o2[x + k] = s2[k] / dog.n2;
                    }
                }
            } else {
                for x in 0..w {
                    let (mut s1, mut s2) = (0.0f32, 0.0f32);
                    for t in 0..2 * r + 1 {
                        s1 += dog.g1[t] * pad[x + t];
                        s2 += dog.g2[t] * pad[x + t];
                    }
                    o1[x] = s1 / dog.n1;
                    o2[x] = s2 / dog.n2;
                }
            }
        }
    }
}

/// The edge factor E' from the two Gaussians (the reference's `edge_factor` with `tanh_fast`).
#[inline(always)]
fn edge_factor(g1: f32, g2: f32, tau: f32, sharpness: f32, strength: f32) -> f32 {
    let h = g1 - tau * g2;
    let e = if h > 0.0 {
        1.0
    } else {
        let e = 1.0 + tanh_fast(sharpness * h);
        // tanh_fast stays within [−1, 1], so only the lower clamp can apply (as in clamp(0, 1)).
        if e < 0.0 { 0.0 } else { e }
    };
    1.0 - strength * (1.0 - e)
}

/// What the DoG's vertical pass needs besides the planes.
pub struct EdgeInputs<'a> {
    pub dog: &'a DogWeights,
    pub tau: f32,
    pub sharpness: f32,
    pub strength: f32,
}

multiversion! {
    /// Vertical pass of both Gaussians and the edge factor, output rows `first..first + rows`.
    pub fn dog_y_edges(
        d1: &[f32],
        d2: &[f32],
        w: usize,
        h: usize,
        first: usize,
        rows: usize,
        out: &mut [f32],
        e: &EdgeInputs,
    ) {
        let dog = e.dog;
        let r = dog.r;
        let at = |y: usize, t: usize| (y + t).saturating_sub(r).min(h - 1) * w;
        for row in 0..rows {
            let y = first + row;
            let out = &mut out[row * w..][..w];
            if w >= LANES {
                for x in chunk_starts(w) {
                    let (mut s1, mut s2) = ([0.0f32; LANES], [0.0f32; LANES]);
                    for t in 0..2 * r + 1 {
                        let (v1, v2) = (lanes(d1, at(y, t) + x), lanes(d2, at(y, t) + x));
                        let (a, b) = (dog.g1[t], dog.g2[t]);
                        for k in 0..LANES {
                            s1[k] += a * v1[k];
                            s2[k] += b * v2[k];
                        }
                    }
                    for k in 0..LANES {
                        out[x + k] = edge_factor(s1[k] / dog.n1, s2[k] / dog.n2, e.tau, e.sharpness, e.strength);
                    }
                }
            } else {
                for (x, o) in out.iter_mut().enumerate() {
                    let (mut s1, mut s2) = (0.0f32, 0.0f32);
                    for t in 0..2 * r + 1 {
                        s1 += dog.g1[t] * d1[at(y, t) + x];
                        s2 += dog.g2[t] * d2[at(y, t) + x];
                    }
                    *o = edge_factor(s1 / dog.n1, s2 / dog.n2, e.tau, e.sharpness, e.strength);
                }
            }
        }
    }
}

multiversion! {
    /// 8-bit luma to L (0–100), `n` values of a row.
    pub fn unpack_luma(src: &[u8], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(src) {
            *o = 100.0 * v as f32 / 255.0;
        }
    }
}

multiversion! {
    /// Interleaved 8-bit (u, v) to planar signed chroma.
    pub fn unpack_chroma(src: &[u8], out_u: &mut [f32], out_v: &mut [f32]) {
        for ((u, v), s) in out_u.iter_mut().zip(out_v.iter_mut()).zip(src.chunks_exact(2)) {
            *u = (s[0] as f32 - 128.0) / 255.0;
            *v = (s[1] as f32 - 128.0) / 255.0;
        }
    }
}

/// What the luma compose needs besides the planes.
pub struct ComposeInputs {
    /// Auto-levels black and white points, when they apply.
    pub levels: Option<(f32, f32)>,
    pub levels_count: i32,
    pub level_sharpness: f32,
    pub saturation: f32,
}

/// The reference's `pack` rounding: half away from zero, clamped to 0–255.
#[inline(always)]
fn to_code(v: f32) -> u8 {
    // The rounded, clamped value is a whole number in 0–255: adding 1.5·2²³ puts it in the low
    // mantissa bits exactly, where a bit cast reads it. (`as u8` on a float is a saturating
    // conversion that stays scalar; this vectorises.)
    let whole = v.round().clamp(0.0, 255.0);
    (whole + 12_582_912.0).to_bits() as u8
}

multiversion! {
    /// Auto-levels, soft quantization and the edges into 8-bit luma, one row.
    pub fn compose_luma(l: &[f32], edge: &[f32], out: &mut [u8], c: &ComposeInputs) {
        let dq = 100.0 / c.levels_count as f32;
        let (black, white, stretch) = match c.levels {
            Some((b, w)) => (b, w, true),
            None => (0.0, 100.0, false),
        };
        for ((o, &l), &e) in out.iter_mut().zip(l).zip(edge) {
            let l = if stretch {
                ((l - black) * (100.0 / (white - black))).clamp(0.0, 100.0)
            } else {
                l
            };
            let q = dq * (l / dq + 0.5).floor();
            let lq = q + (dq * 0.5) * tanh_fast(c.level_sharpness * (l - q));
            *o = to_code(255.0 * lq * e / 100.0);
        }
    }
}

multiversion! {
    /// Chroma with saturation and the 2×2 block's minimum edge factor, interleaved, one row.
    pub fn compose_chroma(
        u: &[f32],
        v: &[f32],
        edge0: &[f32],
        edge1: &[f32],
        out: &mut [u8],
        c: &ComposeInputs,
    ) {
        for (i, ((&u, &v), o)) in u.iter().zip(v).zip(out.chunks_exact_mut(2)).enumerate() {
            let e = edge0[2 * i]
                .min(edge0[2 * i + 1])
                .min(edge1[2 * i])
                .min(edge1[2 * i + 1]);
            o[0] = to_code(128.0 + 255.0 * c.saturation * u * e);
            o[1] = to_code(128.0 + 255.0 * c.saturation * v * e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i32 - b.to_bits() as i32).unsigned_abs()
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_library() {
        let mut worst = 0;
        let mut x = 0.0f32;
        while x > -86.0 {
            worst = worst.max(ulps(exp_nonpositive(x), x.exp()));
            x -= 0.000_37;
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1000.0) < 1e-37);
        assert!(exp_nonpositive(-1000.0) >= 0.0);
        assert!(exp_nonpositive(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn exp2_is_within_3e7_relative_in_both_builds() {
        let check = |exp2: fn(f32) -> f32| {
            let (mut worst, mut at) = (0.0f64, 0.0f32);
            let mut y = 0.0f32;
            while y > -125.0 {
                let exact = 2f64.powf(y as f64);
                let e = (exp2(y) as f64 - exact).abs() / exact;
                if e > worst {
                    (worst, at) = (e, y);
                }
                y -= 0.000_29;
            }
            assert!(worst < 3e-7, "worst relative error {worst} at {at}");
            assert!(exp2(-1000.0) < 1e-37 && exp2(-1000.0) >= 0.0);
            assert!(exp2(f32::NEG_INFINITY) < 1e-37);
        };
        check(exp2_nonpositive::<Separate>);
        check(exp2_nonpositive::<Fused>);
    }

    #[test]
    fn tanh_is_within_1e7_of_the_library() {
        let mut x = -12.0f32;
        let mut worst = 0.0f32;
        while x < 12.0 {
            worst = worst.max((tanh_fast(x) - x.tanh()).abs());
            x += 0.000_61;
        }
        assert!(worst < 1.5e-7, "worst {worst}");
        assert_eq!(tanh_fast(0.0), 0.0);
        assert_eq!(tanh_fast(50.0), 1.0);
        assert_eq!(tanh_fast(-50.0), -1.0);
    }

    #[test]
    fn chunks_cover_every_pixel_and_stay_inside() {
        for w in [LANES, LANES + 1, 2 * LANES, 100, 1280] {
            let mut hit = vec![false; w];
            for s in chunk_starts(w) {
                assert!(s + LANES <= w);
                hit[s..s + LANES].fill(true);
            }
            assert!(hit.iter().all(|&h| h), "width {w}");
        }
    }

    #[test]
    fn avx2_and_baseline_kernels_agree() {
        // Both builds evaluate the same expressions; the AVX2 one fuses its multiply-adds
        // (one rounding instead of two), so they agree to a few ulp, not bit for bit.
        let (w, h) = (37, 5);
        let src: Vec<f32> = (0..w * h)
            .map(|i| 50.0 + 40.0 * ((i * 7919 % 101) as f32 / 101.0 - 0.5))
            .collect();
        let p = crate::pipeline::ToonParams::new(&Default::default(), w as u32, h as u32);
        let r = p.luma_radius as usize;
        let run = |isa: Isa| {
            let mut x = vec![0.0; w * h];
            let mut y = vec![0.0; w * h];
            bilateral_luma_x(
                isa,
                &src,
                w,
                0,
                h,
                &mut x,
                &p.luma_spatial,
                r,
                p.range_coeff,
            );
            bilateral_luma_y(
                isa,
                &x,
                w,
                h,
                0,
                h,
                &mut y,
                &p.luma_spatial,
                r,
                p.range_coeff,
                &mut vec![0.0; vertical_scratch_len(w, r)],
            );
            y
        };
        let (a, b) = (run(Isa::detect()), run(Isa::baseline()));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-4, "the builds differ by {worst}");
        // Smoothing happened.
        assert!(a.iter().zip(&src).any(|(a, s)| (a - s).abs() > 0.1));
    }
}
