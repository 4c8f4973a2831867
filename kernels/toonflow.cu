// toonflow kernels: the stylize pipeline of src/pipeline/cpu.rs on the GPU.
//
// Compiled at run time with NVRTC, once per storage precision:
//   -DTF_FP16=1  planes (features, ring, bilateral intermediates) stored as IEEE half
//   -DTF_FP16=0  planes stored as float
// Math is always fp32, in the CPU reference's order (the host compiles with --fmad=false); the
// bilateral taps alone use explicit FMAs and the hardware ex2 for their weights (see
// tf_tap_weight; TF_ACCURATE_EXP=1 restores the CPU's products), which tests/cuda_parity.rs
// bounds. The DoG intermediates are always float: they are differences of nearly equal values
// and half storage would move the lines.
//
// A frame is (launch order):
//   tf_unpack                 NV12 -> L, UV planes; thumbnail block sums; histogram (into
//                             statistics the previous frame's analysis left zero)
//   tf_analyze                scene score, cut decision, ring bookkeeping, auto-levels, the
//                             statistics back to zero (1 block; by default an extra block of the
//                             first tf_bilateral_x instead)
//   tf_bilateral_x / _y       edge_iteration iterations, luma and chroma in one launch each; the
//                             last y pass filters its output temporally and pushes the raw
//                             features into the ring (no filter when the ring has no slot)
//   tf_temporal               the same on its own, only when edge_iteration == 0
//   tf_bilateral_x / _y       the remaining iterations; the first x pass after the temporal
//                             filter also computes the DoG x pass of the filtered luma
//   tf_dog_x                  only when edge_iteration == bilateral_iterations
//   tf_final                  DoG y pass, levels, quantize, compose, pack NV12
// Nothing here depends on values the host reads back: ring slots and the cut decision live in
// TfState / TfFrame, so the whole sequence can be captured into a CUDA graph and replayed.

// The host prepends the ABI this file relies on, generated from Rust (src/cuda/abi.rs): the
// blocks ToonParams, TfControl, TfState and TfFrame, and the shared constants TF_MAX_RADIUS,
// TF_THUMB_W/H, TF_HIST_BINS, TF_MAX_HISTORY, TF_AUTO_LEVELS_CLIP, TF_AUTO_LEVELS_MIN_SPREAD and
// the launch block sizes TF_TILE_BX/BY, TF_BIL_BX/BY/COLS, TF_BILY_BX/BY/ROWS, TF_ANALYZE_THREADS.

// Range and motion weights exp(coeff * d2). By default one hardware ex2 (MUFU.EX2, ~2 ulp) of
// coeff * log2(e) * d2: the weights differ from the CPU's exp by a few parts in 10^7, far below
// what moves an output code (tests/cuda_parity.rs measures it). TF_ACCURATE_EXP=1 (the host's
// TOONFLOW_ACCURATE_EXP=1) builds the accurate expf instead, for comparison.
// Use: k = tf_range_scale(coeff) once, then tf_range_weight(k * d2) per tap.
#ifndef TF_ACCURATE_EXP
#define TF_ACCURATE_EXP 0
#endif
__device__ __forceinline__ float tf_range_scale(float coeff)
{
#if TF_ACCURATE_EXP
    return coeff;
#else
    return coeff * 1.44269504088896341f;
#endif
}
__device__ __forceinline__ float tf_range_weight(float scaled)
{
#if TF_ACCURATE_EXP
    return expf(scaled);
#else
    float w;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(w) : "f"(scaled));
    return w;
#endif
}

// Bilateral tap weight spatial[j] * exp(coeff * d^2) of a tap at range distance d. The bilateral
// tiles hold their values in range units (value * tf_range_unit(coeff)), so a tap's distance in
// units ds gives coeff * d^2 = -ds^2 (in the ex2 domain by default), with no multiply per tap.
// From a per-launch table t[j] = tf_tap_table(spatial[j]): by default the spatial weight rides
// in the exponent, one FMA and one ex2 per tap (2^(log2 spatial[j] - ds^2)); TF_ACCURATE_EXP=1
// takes spatial[j] * expf(-ds^2).
__device__ __forceinline__ float tf_tap_table(float spatial)
{
#if TF_ACCURATE_EXP
    return spatial;
#else
    return log2f(spatial);
#endif
}
__device__ __forceinline__ float tf_range_unit(float coeff) { return sqrtf(-tf_range_scale(coeff)); }
// Luma: one distance ds.
__device__ __forceinline__ float tf_tap_weight(float ds, float t)
{
#if TF_ACCURATE_EXP
    return t * expf(-(ds * ds));
#else
    return tf_range_weight(__fmaf_rn(-ds, ds, t));
#endif
}
// Chroma: the joint distance of (du, dv).
__device__ __forceinline__ float tf_tap_weight(float du, float dv, float t)
{
#if TF_ACCURATE_EXP
    return t * expf(-(du * du + dv * dv));
#else
    return tf_range_weight(__fmaf_rn(-dv, dv, __fmaf_rn(-du, du, t)));
#endif
}
// a / b for a normalisation (a weighted sum by its weights): by default the hardware reciprocal
// (2 ulp, no IEEE special-case branch); TF_ACCURATE_EXP=1 the IEEE division.
__device__ __forceinline__ float tf_div(float a, float b)
{
#if TF_ACCURATE_EXP
    return a / b;
#else
    return __fdividef(a, b);
#endif
}
// acc + w * v
__device__ __forceinline__ float tf_mad(float w, float v, float acc)
{
#if TF_ACCURATE_EXP
    return acc + w * v;
#else
    return __fmaf_rn(w, v, acc);
#endif
}
// tanh(x) for the edge factor and the soft quantizer. By default (1 - e) / (1 + e) with
// e = 2^(-2 log2(e) |x|) (one ex2 and one reciprocal, the sign put back; within ~2e-7 of tanhf,
// as the CPU fast path's tanh_fast), instead of tanhf's two branches of a dozen instructions
// each; TF_ACCURATE_EXP=1 builds tanhf.
__device__ __forceinline__ float tf_tanh(float x)
{
#if TF_ACCURATE_EXP
    return tanhf(x);
#else
    const float e = tf_range_weight(-2.88539008177792681f * fabsf(x));
    return copysignf(tf_div(1.0f - e, 1.0f + e), x);
#endif
}

#ifndef TF_FP16
#define TF_FP16 1
#endif

#if TF_FP16
typedef unsigned short tf_store;
__device__ __forceinline__ float tf_ld(const tf_store* __restrict__ p, long i)
{
    unsigned short h = p[i];
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void tf_st(tf_store* __restrict__ p, long i, float v)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i] = h;
}
// Interleaved pair i (elements 2i and 2i+1, e.g. a (u, v) sample) in one 32-bit access.
__device__ __forceinline__ float2 tf_ld2(const tf_store* __restrict__ p, long i)
{
    const unsigned int b = reinterpret_cast<const unsigned int*>(p)[i];
    float2 f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f.x) : "h"((unsigned short)(b & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f.y) : "h"((unsigned short)(b >> 16)));
    return f;
}
__device__ __forceinline__ void tf_st2(tf_store* __restrict__ p, long i, float2 v)
{
    unsigned short lo, hi;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(lo) : "f"(v.x));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hi) : "f"(v.y));
    reinterpret_cast<unsigned int*>(p)[i] = (unsigned int)lo | ((unsigned int)hi << 16);
}
// Elements i .. i + 3 (i a multiple of 4) in one 8-byte store.
__device__ __forceinline__ void tf_st4(tf_store* __restrict__ p, long i, float a, float b, float c, float d)
{
    unsigned short h[4];
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h[0]) : "f"(a));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h[1]) : "f"(b));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h[2]) : "f"(c));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h[3]) : "f"(d));
    reinterpret_cast<uint2*>(p)[i / 4] = make_uint2((unsigned int)h[0] | ((unsigned int)h[1] << 16),
                                                    (unsigned int)h[2] | ((unsigned int)h[3] << 16));
}
#else
typedef float tf_store;
__device__ __forceinline__ void tf_st4(tf_store* __restrict__ p, long i, float a, float b, float c, float d)
{
    reinterpret_cast<float4*>(p)[i / 4] = make_float4(a, b, c, d);
}
__device__ __forceinline__ float tf_ld(const tf_store* __restrict__ p, long i) { return p[i]; }
__device__ __forceinline__ void tf_st(tf_store* __restrict__ p, long i, float v) { p[i] = v; }
__device__ __forceinline__ float2 tf_ld2(const tf_store* __restrict__ p, long i)
{
    return reinterpret_cast<const float2*>(p)[i];
}
__device__ __forceinline__ void tf_st2(tf_store* __restrict__ p, long i, float2 v) { reinterpret_cast<float2*>(p)[i] = v; }
#endif
// tf_ld2/tf_st2 need the pair aligned to its size, tf_st4 i a multiple of 4: the planned planes
// start on ALIGN.

#if TF_BIL_COLS != 4
#error "tf_st_cols stores the x pass's outputs in fours"
#endif
// A thread's 4 consecutive outputs v[0..4) of a plane row at elements idx.. (x: the first one's
// column, n: the row's length; the caller's x < n): one vector store when the row holds all four
// and idx is a multiple of 4 (the whole row's stores then coalesce), else one by one.
__device__ __forceinline__ void tf_st_cols(tf_store* __restrict__ p, long idx, int x, int n, const float v[4])
{
    if (x + 4 <= n && (idx & 3) == 0) {
        tf_st4(p, idx, v[0], v[1], v[2], v[3]);
    } else {
        for (int q = 0; q < 4 && x + q < n; ++q) tf_st(p, idx + q, v[q]);
    }
}
// The same for pairs (a chroma row, pair index idx).
__device__ __forceinline__ void tf_st_cols(tf_store* __restrict__ p, long idx, int x, int n, const float2 v[4])
{
    if (x + 4 <= n && (idx & 1) == 0) {
        tf_st4(p, 2 * idx, v[0].x, v[0].y, v[1].x, v[1].y);
        tf_st4(p, 2 * idx + 4, v[2].x, v[2].y, v[3].x, v[3].y);
    } else {
        for (int q = 0; q < 4 && x + q < n; ++q) tf_st2(p, idx + q, v[q]);
    }
}
// The same for a float plane (the DoG intermediates).
__device__ __forceinline__ void tf_st_cols_f32(float* __restrict__ p, long idx, int x, int n, const float v[4])
{
    if (x + 4 <= n && (idx & 3) == 0) {
        reinterpret_cast<float4*>(p)[idx / 4] = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        for (int q = 0; q < 4 && x + q < n; ++q) p[idx + q] = v[q];
    }
}

// TfControl (host -> device every frame), TfState (scene detector memory and ring cursor) and
// TfFrame (per-frame decisions, copied back to the host) come with the generated ABI.

__device__ __forceinline__ int tf_clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// First pixel of thumbnail block b (analysis.rs block_start). 32-bit: b * size < 2^31 for any
// frame the geometry accepts (blocks <= TF_THUMB_W).
__device__ __forceinline__ int tf_block_start(int b, int blocks, int size) { return (int)(((unsigned)b * (unsigned)size) / (unsigned)blocks); }

// Thumbnail block holding pixel x: the largest b with block_start(b) <= x.
__device__ __forceinline__ int tf_block_of(int x, int blocks, int size) { return (int)((((unsigned)x + 1u) * (unsigned)blocks - 1u) / (unsigned)size); }

__device__ __forceinline__ float tf_edge_factor(float g1, float g2, const ToonParams* __restrict__ p)
{
    float h = g1 - p->edge_tau * g2;
    float e;
    if (h > 0.0f) {
        e = 1.0f;
    } else {
        e = fminf(fmaxf(1.0f + tf_tanh(p->edge_sharpness * h), 0.0f), 1.0f);
    }
    return 1.0f - p->edge_strength * (1.0f - e);
}

// Soft quantization with bins of dq = 100 / levels (inv_dq = levels / 100, taken once per thread:
// a product where the CPU divides, which can move a value across a bin boundary only where the
// soft quantizer is continuous anyway).
__device__ __forceinline__ float tf_quantize(float l, float dq, float inv_dq, float sharpness)
{
    float q = dq * floorf(l * inv_dq + 0.5f);
    return q + (dq * 0.5f) * tf_tanh(sharpness * (l - q));
}

__device__ __forceinline__ unsigned char tf_pack_luma(float lq, float e)
{
    float v = roundf(255.0f * lq * e * 0.01f);
    v = fminf(fmaxf(v, 0.0f), 255.0f);
    return (unsigned char)v;
}

__device__ __forceinline__ unsigned char tf_pack_chroma(float c, float saturation, float e_half)
{
    float v = roundf(128.0f + 255.0f * saturation * c * e_half);
    v = fminf(fmaxf(v, 0.0f), 255.0f);
    return (unsigned char)v;
}

// ---------------------------------------------------------------------------------------------
// 1. Unpack and statistics. One thread per chroma sample: its 2x2 luma block and its (u, v)
// (frame sizes are even). Block TF_TILE_BX x TF_TILE_BY threads (the host launches exactly that:
// TF_TILE_BX = 32, so a warp is one row of threads) = a luma tile of twice that size; thumbnail
// sums and histogram gather in shared memory, the thumbnail blocks of the tile's columns and rows
// are looked up once per block, the byte-to-plane conversions come from a 256-entry table.
#define TF_TILE_TW (2 * TF_TILE_BX)
#define TF_TILE_TH (2 * TF_TILE_BY)

// Adds v to thumbnail cell (row, col) of the block's tile sthumb, for the whole warp (every lane
// calls it, v = 0 where a lane has nothing): col does not decrease along the lanes, so each run
// of equal cols sums its values (segmented reduction by shuffles) and its first lane adds them
// with one shared atomic, instead of up to 32 colliding ones.
__device__ __forceinline__ void tf_thumb_add(unsigned int* sthumb, int row, int col, unsigned int v)
{
    const int lane = threadIdx.x;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned int ov = __shfl_down_sync(0xffffffffu, v, off);
        const int oc = __shfl_down_sync(0xffffffffu, col, off);
        if (lane + off < 32 && oc == col) v += ov;
    }
    const int prev = __shfl_up_sync(0xffffffffu, col, 1);
    if ((lane == 0 || prev != col) && v != 0u) atomicAdd(&sthumb[row * TF_TILE_TW + col], v);
}

// Byte value -> luma in L units and -> chroma, the CPU's expressions (src/pipeline/cpu.rs),
// folded by the compiler (IEEE division of exact operands, so the same bits): tf_unpack copies
// them into shared memory instead of dividing 512 times per block.
#define TF_BYTES4(f, i) f(i), f(i + 1), f(i + 2), f(i + 3)
#define TF_BYTES16(f, i) TF_BYTES4(f, i), TF_BYTES4(f, i + 4), TF_BYTES4(f, i + 8), TF_BYTES4(f, i + 12)
#define TF_BYTES64(f, i) TF_BYTES16(f, i), TF_BYTES16(f, i + 16), TF_BYTES16(f, i + 32), TF_BYTES16(f, i + 48)
#define TF_BYTES256(f) TF_BYTES64(f, 0), TF_BYTES64(f, 64), TF_BYTES64(f, 128), TF_BYTES64(f, 192)
#define TF_LUMA_OF(i) (100.0f * (float)(i) / 255.0f)
#define TF_CHROMA_OF(i) (((float)(i) - 128.0f) / 255.0f)
__device__ const float tf_luma_of_byte[256] = {TF_BYTES256(TF_LUMA_OF)};
__device__ const float tf_chroma_of_byte[256] = {TF_BYTES256(TF_CHROMA_OF)};

extern "C" __global__ void tf_unpack(const ToonParams* __restrict__ p, const unsigned char* __restrict__ nv12,
                                     tf_store* __restrict__ L, tf_store* __restrict__ UV,
                                     unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist)
{
    __shared__ unsigned int shist[TF_HIST_BINS];
    __shared__ unsigned int sthumb[TF_TILE_TH * TF_TILE_TW];
    __shared__ int scol[TF_TILE_TW];
    __shared__ int srow[TF_TILE_TH];
    // tf_luma_of_byte and tf_chroma_of_byte.
    __shared__ float sluma[256], schroma[256];
    const int W = p->width, H = p->height;
    const int cw = p->chroma_width, ch = p->chroma_height;
    const int tw = p->thumb_w, th = p->thumb_h;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    // Only auto-levels reads the histogram: without it (the default) no thread touches it.
    const bool want_hist = p->auto_levels != 0;
    if (want_hist)
        for (int i = tid; i < TF_HIST_BINS; i += nthreads) shist[i] = 0u;
    for (int i = tid; i < TF_TILE_TH * TF_TILE_TW; i += nthreads) sthumb[i] = 0u;
    for (int i = tid; i < 256; i += nthreads) {
        sluma[i] = tf_luma_of_byte[i];
        schroma[i] = tf_chroma_of_byte[i];
    }
    const int tx0 = blockIdx.x * TF_TILE_TW;
    const int ty0 = blockIdx.y * TF_TILE_TH;
    const int bx0 = tf_block_of(tx0 < W ? tx0 : W - 1, tw, W);
    const int by0 = tf_block_of(ty0 < H ? ty0 : H - 1, th, H);
    for (int i = tid; i < TF_TILE_TW; i += nthreads) scol[i] = tf_block_of(min(tx0 + i, W - 1), tw, W) - bx0;
    for (int i = tid; i < TF_TILE_TH; i += nthreads) srow[i] = tf_block_of(min(ty0 + i, H - 1), th, H) - by0;
    __syncthreads();

    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    // cy is the warp's; lanes past the right edge take part in the thumbnail sums with zeros.
    if (cy < ch) {
        const int lx = 2 * threadIdx.x, ly = 2 * threadIdx.y;
        const int c0 = scol[lx], c1 = scol[lx + 1];
        const int r0 = srow[ly], r1 = srow[ly + 1];
        // Per luma row: the pixels in thumbnail column c0, and the right one when it is in c1.
        unsigned int left[2] = {0u, 0u}, right[2] = {0u, 0u};
        if (cx < cw) {
#pragma unroll
            for (int dy = 0; dy < 2; ++dy) {
                const long i = (long)(2 * cy + dy) * W + 2 * cx;
                // Two luma bytes in one 16-bit load and their planes in one store (even width, even x).
                const unsigned short two = *reinterpret_cast<const unsigned short*>(nv12 + i);
                const unsigned int v0 = two & 0xffu, v1 = two >> 8;
                tf_st2(L, i / 2, make_float2(sluma[v0], sluma[v1]));
                if (want_hist) {
                    atomicAdd(&shist[v0], 1u);
                    atomicAdd(&shist[v1], 1u);
                }
                left[dy] = c0 == c1 ? v0 + v1 : v0;
                right[dy] = c0 == c1 ? 0u : v1;
            }
            const unsigned short uv = *reinterpret_cast<const unsigned short*>(nv12 + (long)H * W + (long)cy * W + 2 * cx);
            tf_st2(UV, (long)cy * cw + cx, make_float2(schroma[uv & 0xffu], schroma[uv >> 8]));
        }
        if (r0 == r1) {
            tf_thumb_add(sthumb, r0, c0, left[0] + left[1]);
        } else {
            tf_thumb_add(sthumb, r0, c0, left[0]);
            tf_thumb_add(sthumb, r1, c0, left[1]);
        }
        // A 2x2 block split by a thumbnail column boundary (one lane per boundary at most).
        if (right[0] + right[1] != 0u) {
            atomicAdd(&sthumb[r0 * TF_TILE_TW + c1], right[0]);
            atomicAdd(&sthumb[r1 * TF_TILE_TW + c1], right[1]);
        }
    }
    __syncthreads();
    if (want_hist) {
        for (int i = tid; i < TF_HIST_BINS; i += nthreads) {
            if (shist[i] != 0u) atomicAdd(&hist[i], shist[i]);
        }
    }
    // Only the cells the tile reaches (its last row and column hold the largest offsets).
    const int rows = srow[TF_TILE_TH - 1] + 1, cols = scol[TF_TILE_TW - 1] + 1;
    for (int i = tid; i < rows * TF_TILE_TW; i += nthreads) {
        const int bx = i % TF_TILE_TW;
        const unsigned int s = bx < cols ? sthumb[i] : 0u;
        if (s != 0u) {
            const int by = by0 + i / TF_TILE_TW;
            if (by < th && bx0 + bx < tw) atomicAdd(&thumb_sums[by * TF_THUMB_W + bx0 + bx], s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Analysis: one block (a few thousand thumbnail blocks and 256 histogram bins: one block
// finishes in a few microseconds once the index math is 32-bit and the block sizes are looked up,
// not divided out per cell). It is latency, not work: by default an extra block of the first x
// pass runs it beside that pass's tiles (nothing before the temporal filter reads its results);
// tf_analyze runs it on its own when the temporal filter comes before the first iteration.
// Any block size that is a multiple of 32 (up to 1024).
// It is the statistics' only reader: it leaves them zero for the next frame's tf_unpack (the
// arena starts zeroed, the host clears them when a plan is installed), so a frame needs no memset.
__device__ __forceinline__ void tf_analysis(const ToonParams* __restrict__ p, const TfControl* __restrict__ ctl,
                                            unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist,
                                            TfState* __restrict__ st, TfFrame* __restrict__ fr, int capacity)
{
    __shared__ float spart[32];
    __shared__ unsigned int shist[TF_HIST_BINS];
    __shared__ int scols[TF_THUMB_W];
    __shared__ int srows[TF_THUMB_H];
    const int W = p->width, H = p->height;
    const int tw = p->thumb_w, th = p->thumb_h;
    const int n = tw * th;
    const int reset = ctl->reset;
    const int has_prev = (st->has_prev != 0) && (reset == 0);
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    for (int i = tid; i < tw; i += nthreads) scols[i] = tf_block_start(i + 1, tw, W) - tf_block_start(i, tw, W);
    for (int i = tid; i < th; i += nthreads) srows[i] = tf_block_start(i + 1, th, H) - tf_block_start(i, th, H);
    for (int i = tid; i < TF_HIST_BINS; i += nthreads) {
        shist[i] = hist[i];
        hist[i] = 0u;
    }
    __syncthreads();

    // Cells walked in the thumb_sums layout (TF_THUMB_W a compile-time constant: no division by
    // the runtime width); prev_thumb is packed by the thumbnail's width.
    float part = 0.0f;
    for (int i = tid; i < th * TF_THUMB_W; i += nthreads) {
        const int by = i / TF_THUMB_W, bx = i % TF_THUMB_W;
        if (bx >= tw) continue;
        const float count = (float)(srows[by] * scols[bx]);
        const float m = 100.0f * (float)thumb_sums[i] / (255.0f * count);
        thumb_sums[i] = 0u;
        const int cell = by * tw + bx;
        if (has_prev) part += fabsf(st->prev_thumb[cell] - m);
        st->prev_thumb[cell] = m;
    }
    // Block sum: each warp by shuffles, then the first warp over the warps' sums.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xffffffffu, part, off);
    if ((tid & 31) == 0) spart[tid / 32] = part;
    __syncthreads();
    if (tid >= 32) return;
    part = tid < nthreads / 32 ? spart[tid] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xffffffffu, part, off);
    if (tid != 0) return;
    spart[0] = part;

    const float score = has_prev ? spart[0] / (float)n : 0.0f;
    const int cut = score > p->scene_cut_threshold ? 1 : 0;
    int next = st->ring_next, len = st->ring_len;
    if (reset || cut) {
        next = 0;
        len = 0;
    }
    const int hist_lim = p->history < 0 ? 0 : p->history;
    const int used = len < hist_lim ? len : hist_lim;
    // Slot arithmetic without a division per slot: 0 <= next < capacity (one reduction in case
    // the ring shrank) and k < used <= capacity.
    if (capacity > 0 && next >= capacity) next %= capacity;
    for (int k = 0; k < TF_MAX_HISTORY; ++k) {
        int slot = next - (k + 1);
        if (slot < 0) slot += capacity;
        fr->recent_slot[k] = (k < used && capacity > 0) ? slot : 0;
    }
    fr->push_slot = capacity > 0 ? next : -1;
    if (capacity > 0) {
        next = next + 1 == capacity ? 0 : next + 1;
        len = len + 1 < capacity ? len + 1 : capacity;
    }
    st->ring_next = next;
    st->ring_len = len;
    st->has_prev = 1;
    fr->scene_cut = cut;
    fr->scene_score = score;
    fr->history_used = used;

    int valid = 0;
    float black = 0.0f, white = 100.0f;
    if (p->auto_levels) {
        unsigned long long total = 0ull;
        for (int b = 0; b < TF_HIST_BINS; ++b) total += shist[b];
        const unsigned long long clip = (unsigned long long)((double)TF_AUTO_LEVELS_CLIP * (double)total);
        unsigned long long acc = 0ull;
        int lo = 0;
        for (int b = 0; b < TF_HIST_BINS; ++b) {
            acc += shist[b];
            if (acc > clip) {
                lo = b;
                break;
            }
        }
        acc = 0ull;
        int hi = TF_HIST_BINS - 1;
        for (int b = TF_HIST_BINS - 1; b >= 0; --b) {
            acc += shist[b];
            if (acc > clip) {
                hi = b;
                break;
            }
        }
        if (hi > lo + TF_AUTO_LEVELS_MIN_SPREAD) {
            valid = 1;
            black = 100.0f * (float)lo / 255.0f;
            white = 100.0f * (float)hi / 255.0f;
        }
    }
    fr->levels_valid = valid;
    fr->black = black;
    fr->white = white;
    // tf_final's per-frame constants (its threads would each divide for them).
    fr->levels_stretch = valid ? 100.0f / (white - black) : 1.0f;
    fr->level_step = 100.0f / (float)p->levels;
    fr->level_inv_step = (float)p->levels / 100.0f;
    float n1 = 0.0f, n2 = 0.0f;
    for (int j = -p->edge_radius; j <= p->edge_radius; ++j) {
        n1 += p->edge_gauss1[j < 0 ? -j : j];
        n2 += p->edge_gauss2[j < 0 ? -j : j];
    }
    fr->edge_inv1 = 1.0f / n1;
    fr->edge_inv2 = 1.0f / n2;
}

extern "C" __global__ void tf_analyze(const ToonParams* __restrict__ p, const TfControl* __restrict__ ctl,
                                      unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist,
                                      TfState* __restrict__ st, TfFrame* __restrict__ fr, int capacity)
{
    tf_analysis(p, ctl, thumb_sums, hist, st, fr, capacity);
}

// ---------------------------------------------------------------------------------------------
// The temporal filter of one feature value against the ring (ToonParams' temporal_strength and
// motion_coeff; TfFrame's recent slots, newest first): f = sum w_k f_k / sum w_k, w_0 = 1,
// w_k = s^k exp(motion_coeff d_k^2). Used by the y pass that ends the edge iteration, as it writes
// its output, and by tf_temporal.
struct TfHistory {
    const tf_store* ring;
    long slot_elems;
    const int* recent; // TfFrame's recent_slot
    int used;
    float strength, mk;
    __device__ __forceinline__ const tf_store* slot(int k) const { return ring + (long)recent[k] * slot_elems; }
};

__device__ __forceinline__ TfHistory tf_history(const ToonParams* __restrict__ p, const TfFrame* __restrict__ fr,
                                                const tf_store* ring, long slot_elems)
{
    return {ring, slot_elems, fr->recent_slot, fr->history_used, p->temporal_strength, tf_range_scale(p->motion_coeff)};
}

// The ring slot this frame's raw features go to (nullptr: no ring).
__device__ __forceinline__ tf_store* tf_push_slot(const TfFrame* __restrict__ fr, tf_store* ring, long slot_elems)
{
    return fr->push_slot >= 0 ? ring + (long)fr->push_slot * slot_elems : nullptr;
}

// Luma value f0 at element idx of the luma plane.
__device__ __forceinline__ float tf_filter_luma(const TfHistory& h, float f0, long idx)
{
    float acc = f0, wsum = 1.0f, sk = 1.0f;
#pragma unroll
    for (int k = 0; k < TF_MAX_HISTORY; ++k) {
        if (k >= h.used) break;
        const float fk = tf_ld(h.slot(k), idx);
        sk *= h.strength;
        const float d = fk - f0;
        const float w = sk * tf_range_weight(h.mk * d * d);
        acc += w * fk;
        wsum += w;
    }
    return tf_div(acc, wsum);
}

// Chroma pair c at pair index cpair of the chroma plane (luma_elems past the slot's start), the
// distance taken jointly in L units.
__device__ __forceinline__ float2 tf_filter_chroma(const TfHistory& h, float2 c, long cpair, long luma_elems)
{
    float au = c.x, av = c.y, wsum = 1.0f, sk = 1.0f;
#pragma unroll
    for (int k = 0; k < TF_MAX_HISTORY; ++k) {
        if (k >= h.used) break;
        const float2 n = tf_ld2(h.slot(k) + luma_elems, cpair);
        sk *= h.strength;
        const float du = 100.0f * (n.x - c.x);
        const float dv = 100.0f * (n.y - c.y);
        const float w = sk * tf_range_weight(h.mk * (du * du + dv * dv));
        au += w * n.x;
        av += w * n.y;
        wsum += w;
    }
    return make_float2(tf_div(au, wsum), tf_div(av, wsum));
}

// One plane's values (float: luma, float2: a chroma pair) through the temporal filter, in place:
// the n elements first + q * step, each pushed as it was (pushed: the push slot's plane or
// nullptr) after the filter read its history. luma_elems: where a ring slot's chroma starts.
__device__ __forceinline__ float tf_filter_at(const TfHistory& h, float f, long i, long) { return tf_filter_luma(h, f, i); }
__device__ __forceinline__ float2 tf_filter_at(const TfHistory& h, float2 c, long i, long luma_elems)
{
    return tf_filter_chroma(h, c, i, luma_elems);
}
__device__ __forceinline__ void tf_ld_at(const tf_store* p, long i, float& v) { v = tf_ld(p, i); }
__device__ __forceinline__ void tf_ld_at(const tf_store* p, long i, float2& v) { v = tf_ld2(p, i); }
__device__ __forceinline__ void tf_st_at(tf_store* p, long i, float v) { tf_st(p, i, v); }
__device__ __forceinline__ void tf_st_at(tf_store* p, long i, float2 v) { tf_st2(p, i, v); }
template <typename T>
__device__ __forceinline__ void tf_filter_column(const TfHistory& h, tf_store* plane, tf_store* pushed, long first,
                                                 long step, int n, long luma_elems)
{
#pragma unroll 1
    for (int q = 0; q < n; ++q) {
        const long i = first + q * step;
        T raw;
        tf_ld_at(plane, i, raw);
        tf_st_at(plane, i, tf_filter_at(h, raw, i, luma_elems));
        if (pushed) tf_st_at(pushed, i, raw);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Bilateral passes and the DoG x pass, through shared-memory tiles.
//
// A block first copies its tile and the halo around it into shared memory (borders replicated,
// converted to float in range units once), so the taps read shared memory at fixed offsets: no
// clamps, index math or conversions in the tap loops. The loops are unrolled for the default
// radii (luma 6, chroma 3, DoG 4: spatial sigma 3, edge sigma 1) and stay loops for other radii;
// both sum in the CPU reference's order (j = -r .. r).
//
// x pass: block TF_BIL_BX x TF_BIL_BY, TF_BIL_COLS consecutive outputs per thread, a row tile
// per thread row; grid.y covers the luma rows (the first `luma_blocks_y` rows of blocks), then
// the chroma rows.
// y pass: block TF_BILY_BX x TF_BILY_BY, TF_BILY_ROWS outputs per thread down a column, a column
// tile of TF_BILY_BY * TF_BILY_ROWS rows plus the halo; grid.y as for the x pass.

#define TF_XT_COLS (TF_BIL_BX * TF_BIL_COLS)
#define TF_XT_W (TF_XT_COLS + 2 * TF_MAX_RADIUS)
#define TF_YT_ROWS (TF_BILY_BY * TF_BILY_ROWS)
#define TF_YT_H (TF_YT_ROWS + 2 * TF_MAX_RADIUS)

// The radii the tap loops are unrolled for (ToonParams' defaults).
#define TF_LUMA_R 6
#define TF_CHROMA_R 3
#define TF_EDGE_R 4

// Chroma is compared in L units: its range unit is 100 luma units.
#define TF_CHROMA_UNIT 100.0f

// The range weight of the tap nb of centre c (both in range units), spatial table entry t.
__device__ __forceinline__ float tf_pair_weight(float c, float nb, float t) { return tf_tap_weight(nb - c, t); }
__device__ __forceinline__ float tf_pair_weight(float2 c, float2 nb, float t)
{
    return tf_tap_weight(nb.x - c.x, nb.y - c.y, t);
}

// Weighted sums of a bilateral output: the values (one plane or the (u, v) pair) and the weights.
struct TfSum1 {
    float a, w;
};
struct TfSum2 {
    float u, v, w;
};
__device__ __forceinline__ TfSum1 tf_sum_zero(float) { return {0.0f, 0.0f}; }
__device__ __forceinline__ TfSum2 tf_sum_zero(float2) { return {0.0f, 0.0f, 0.0f}; }
__device__ __forceinline__ void tf_sum_add(TfSum1& s, float w, float nb)
{
    s.a = tf_mad(w, nb, s.a);
    s.w += w;
}
__device__ __forceinline__ void tf_sum_add(TfSum2& s, float w, float2 nb)
{
    s.u = tf_mad(w, nb.x, s.u);
    s.v = tf_mad(w, nb.y, s.v);
    s.w += w;
}
// The output back from range units (unit: the tile's).
__device__ __forceinline__ float tf_sum_value(const TfSum1& s, float unit) { return tf_div(s.a, s.w * unit); }
__device__ __forceinline__ float2 tf_sum_value(const TfSum2& s, float unit)
{
    const float n = s.w * unit;
    return make_float2(tf_div(s.u, n), tf_div(s.v, n));
}

// Bilateral sum over the taps s[j * stride], j = -R .. R (R = RF when RF >= 0, else r), in the
// CPU reference's order; the centre weight is the spatial weight w0 itself (exp(0) = 1, as on the
// CPU).
template <int RF, typename T>
__device__ __forceinline__ auto tf_bil(const T* s, int stride, const float* t, float w0, int r)
{
    const int R = RF >= 0 ? RF : r;
    const T c = s[0];
    auto sum = tf_sum_zero(c);
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        const T nb = s[j * stride];
        tf_sum_add(sum, j == 0 ? w0 : tf_pair_weight(c, nb, t[j < 0 ? -j : j]), nb);
    }
    return sum;
}

// A launch's tap tables: t[0][j] for luma, t[1][j] for chroma, filled by the block's first
// threads (the caller synchronises before use).
__device__ __forceinline__ void tf_fill_tap_tables(const ToonParams* __restrict__ p, float t[2][TF_MAX_RADIUS + 1])
{
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    if (tid <= TF_MAX_RADIUS) {
        t[0][tid] = tf_tap_table(p->luma_spatial[tid]);
        t[1][tid] = tf_tap_table(p->chroma_spatial[tid]);
    }
}

// The DoG x pass: both Gaussians of the luma taps s[j] (j = -R .. R, R = RF when RF >= 0, else
// r), each scaled by its inv (1 / (weight sum * the taps' unit)), into d1 and d2.
template <int RF>
__device__ __forceinline__ void tf_dog_x_sums(const float* s, const float* __restrict__ g1, const float* __restrict__ g2,
                                              float inv1, float inv2, int r, float& d1, float& d2)
{
    const int R = RF >= 0 ? RF : r;
    float a1 = 0.0f, a2 = 0.0f;
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        const int m = j < 0 ? -j : j;
        a1 = tf_mad(g1[m], s[j], a1);
        a2 = tf_mad(g2[m], s[j], a2);
    }
    d1 = a1 * inv1;
    d2 = a2 * inv2;
}

// A thread's TF_BIL_COLS DoG x outputs from the taps first[q + j] (j = -R .. R) into dog1/dog2 at
// idx.. (x, W as for tf_st_cols).
template <int RF>
__device__ __forceinline__ void tf_dog_x_cols(const float* first, const float* __restrict__ g1,
                                              const float* __restrict__ g2, float inv1, float inv2, int r, long idx,
                                              int x, int W, float* __restrict__ dog1, float* __restrict__ dog2)
{
    float d1[TF_BIL_COLS], d2[TF_BIL_COLS];
#pragma unroll
    for (int q = 0; q < TF_BIL_COLS; ++q) tf_dog_x_sums<RF>(first + q, g1, g2, inv1, inv2, r, d1[q], d2[q]);
    tf_st_cols_f32(dog1, idx, x, W, d1);
    tf_st_cols_f32(dog2, idx, x, W, d2);
}

// 1 / (sum of g over j = -r .. r, in the CPU's order) / unit.
__device__ __forceinline__ float tf_gauss_inv(const float* __restrict__ g, int r, float unit)
{
    float n = 0.0f;
    for (int j = -r; j <= r; ++j) n += g[j < 0 ? -j : j];
    return 1.0f / (n * unit);
}

// Row y of a luma plane, columns x0 - halo .. x0 + TF_XT_COLS + halo - 1 (replicated), times
// unit, into tile[0 ..]; the threads of one block row share the work.
__device__ __forceinline__ void tf_load_row(float* tile, const tf_store* __restrict__ plane, int y, int W, int x0,
                                            int halo, float unit)
{
    const tf_store* row = plane + (long)y * W;
    for (int i = threadIdx.x; i < TF_XT_COLS + 2 * halo; i += TF_BIL_BX)
        tile[i] = unit * tf_ld(row, tf_clampi(x0 - halo + i, 0, W - 1));
}

__device__ __forceinline__ void tf_load_row2(float2* tile, const tf_store* __restrict__ plane, int y, int cw, int x0,
                                             int halo, float unit)
{
    const tf_store* row = plane + 2L * (long)y * cw;
    for (int i = threadIdx.x; i < TF_XT_COLS + 2 * halo; i += TF_BIL_BX) {
        const float2 v = tf_ld2(row, tf_clampi(x0 - halo + i, 0, cw - 1));
        tile[i] = make_float2(unit * v.x, unit * v.y);
    }
}

// N consecutive outputs of one thread, whose taps lie at first[i * step], i = 0 .. N + 2R - 1 (in
// a shared tile: along a row for the x pass, down a column for the y pass, in range units
// `unit`); out(q, value, centre) takes output q with its taps centre[j * step]. With R known at
// compile time the taps are first copied into registers (each shared value read once for all N
// outputs; centre then points there, step 1); otherwise the taps read the tile.
template <int RF, int N, typename T, typename Out>
__device__ __forceinline__ void tf_strip(const T* first, int step, int r, const float* t, float w0, float unit, Out out)
{
    if (RF >= 0) {
        const int R = RF >= 0 ? RF : 0;
        T v[N + 2 * R];
#pragma unroll
        for (int i = 0; i < N + 2 * R; ++i) v[i] = first[i * step];
        float tr[R + 1];
#pragma unroll
        for (int j = 0; j <= R; ++j) tr[j] = t[j];
#pragma unroll
        for (int q = 0; q < N; ++q) out(q, tf_sum_value(tf_bil<RF>(&v[R + q], 1, tr, w0, r), unit), &v[R + q]);
    } else {
#pragma unroll
        for (int q = 0; q < N; ++q) {
            const T* centre = &first[(r + q) * step];
            out(q, tf_sum_value(tf_bil<-1>(centre, step, t, w0, r), unit), centre);
        }
    }
}

// Blocks per SM the bilateral passes are compiled for where the SM holds that many threads (sm_80
// and later): the register caps that allow them cost at most a few bytes of spill, less than the
// occupancy they buy.
#if __CUDA_ARCH__ >= 800
#define TF_BILX_MIN_BLOCKS 5
#define TF_BILY_MIN_BLOCKS 6
#else
#define TF_BILX_MIN_BLOCKS 1
#define TF_BILY_MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(TF_BIL_BX * TF_BIL_BY, TF_BILX_MIN_BLOCKS) tf_bilateral_x(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                          const tf_store* __restrict__ UV, tf_store* __restrict__ Lo,
                                          tf_store* __restrict__ UVo, float* __restrict__ dog1,
                                          float* __restrict__ dog2, int iter_index, int luma_blocks_y,
                                          int analysis, const TfControl* __restrict__ ctl,
                                          unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist,
                                          TfState* __restrict__ st, TfFrame* __restrict__ fr, int capacity)
{
    // With analysis, the grid has one more row of blocks, the first (dispatched first, so its
    // latency hides behind the tiles): its first block runs the frame's analysis (tf_analysis),
    // the others have nothing to do. block_y: the block row among the tiles'.
    const int block_y = (int)blockIdx.y - (analysis ? 1 : 0);
    if (block_y < 0) {
        if (blockIdx.x == 0) tf_analysis(p, ctl, thumb_sums, hist, st, fr, capacity);
        return;
    }
    // One buffer for both kinds of block: luma rows as float, chroma rows as float2.
    __shared__ float2 tile[TF_BIL_BY * TF_XT_W];
    __shared__ float tab[2][TF_MAX_RADIUS + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int x0 = blockIdx.x * TF_XT_COLS;
    // The thread's outputs: columns x .. x + TF_BIL_COLS - 1, tile columns c0 .. (+ halo).
    const int c0 = tx * TF_BIL_COLS;
    const int x = x0 + c0;
    const float unit = tf_range_unit(p->range_coeff);
    tf_fill_tap_tables(p, tab);
    if (block_y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int y = block_y * TF_BIL_BY + ty;
        const int r = p->luma_radius, er = p->edge_radius;
        const int dog = p->edge_iteration == iter_index;
        const int halo = dog && er > r ? er : r;
        float* row = reinterpret_cast<float*>(tile) + ty * TF_XT_W;
        if (y < H) tf_load_row(row, L, y, W, x0, halo, unit);
        __syncthreads();
        if (x >= W || y >= H) return;
        const long idx = (long)y * W + x;
        const float w0 = p->luma_spatial[0];
        const float* first = &row[c0 + halo - r];
        if (r == TF_LUMA_R && er == TF_EDGE_R) {
            // The DoG x pass (when this is the edge iteration) from the same register window.
            float g1[TF_EDGE_R + 1], g2[TF_EDGE_R + 1];
            float inv1 = 0.0f, inv2 = 0.0f;
            if (dog) {
#pragma unroll
                for (int j = 0; j <= TF_EDGE_R; ++j) {
                    g1[j] = p->edge_gauss1[j];
                    g2[j] = p->edge_gauss2[j];
                }
                inv1 = tf_gauss_inv(g1, TF_EDGE_R, unit);
                inv2 = tf_gauss_inv(g2, TF_EDGE_R, unit);
            }
            float lo[TF_BIL_COLS], d1[TF_BIL_COLS], d2[TF_BIL_COLS];
            tf_strip<TF_LUMA_R, TF_BIL_COLS>(first, 1, r, tab[0], w0, unit, [&](int q, float v, const float* c) {
                lo[q] = v;
                if (dog) tf_dog_x_sums<TF_EDGE_R>(c, g1, g2, inv1, inv2, er, d1[q], d2[q]);
            });
            tf_st_cols(Lo, idx, x, W, lo);
            if (dog) {
                tf_st_cols_f32(dog1, idx, x, W, d1);
                tf_st_cols_f32(dog2, idx, x, W, d2);
            }
        } else {
            float lo[TF_BIL_COLS];
            tf_strip<-1, TF_BIL_COLS>(first, 1, r, tab[0], w0, unit, [&](int q, float v, const float*) { lo[q] = v; });
            tf_st_cols(Lo, idx, x, W, lo);
            if (dog) {
                const float inv1 = tf_gauss_inv(p->edge_gauss1, er, unit);
                const float inv2 = tf_gauss_inv(p->edge_gauss2, er, unit);
                tf_dog_x_cols<-1>(&row[c0 + halo], p->edge_gauss1, p->edge_gauss2, inv1, inv2, er, idx, x, W, dog1,
                                  dog2);
            }
        }
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        if (x0 >= cw) return;
        const int y = (block_y - luma_blocks_y) * TF_BIL_BY + ty;
        const int r = p->chroma_radius;
        const float cunit = TF_CHROMA_UNIT * unit;
        float2* row = tile + ty * TF_XT_W;
        if (y < ch) tf_load_row2(row, UV, y, cw, x0, r, cunit);
        __syncthreads();
        if (x >= cw || y >= ch) return;
        const long idx = (long)y * cw + x;
        const float w0 = p->chroma_spatial[0];
        float2 uv[TF_BIL_COLS];
        const auto out = [&](int q, float2 v, const float2*) { uv[q] = v; };
        const float2* first = &row[c0];
        if (r == TF_CHROMA_R) {
            tf_strip<TF_CHROMA_R, TF_BIL_COLS>(first, 1, r, tab[1], w0, cunit, out);
        } else {
            tf_strip<-1, TF_BIL_COLS>(first, 1, r, tab[1], w0, cunit, out);
        }
        tf_st_cols(UVo, idx, x, cw, uv);
    }
}

extern "C" __global__ void __launch_bounds__(TF_BILY_BX * TF_BILY_BY, TF_BILY_MIN_BLOCKS) tf_bilateral_y(const ToonParams* __restrict__ p, const TfFrame* __restrict__ fr,
                                          const tf_store* __restrict__ L, const tf_store* __restrict__ UV,
                                          tf_store* __restrict__ Lo, tf_store* __restrict__ UVo,
                                          tf_store* __restrict__ ring, long slot_elems, long slot_luma_elems,
                                          int temporal, int luma_blocks_y)
{
    // With temporal (the y pass that ends the edge iteration), its outputs are the frame's raw
    // features: each thread then filters its own against the ring in place and pushes the raw
    // value (after the filter read the pixel's history, as in tf_temporal).
    // (The history and the push slot are looked up there, so they hold no registers meanwhile.)
    // One buffer for both kinds of block: luma blocks use it as float, chroma blocks as float2.
    __shared__ float2 tile[TF_YT_H * TF_BILY_BX];
    __shared__ float tab[2][TF_MAX_RADIUS + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int x = blockIdx.x * TF_BILY_BX + tx;
    // The thread's output rows: row0 .. row0 + TF_BILY_ROWS - 1 of the block's TF_YT_ROWS.
    const int row0 = ty * TF_BILY_ROWS;
    const float unit = tf_range_unit(p->range_coeff);
    tf_fill_tap_tables(p, tab);
    if ((int)blockIdx.y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int y0 = blockIdx.y * TF_YT_ROWS;
        const int r = p->luma_radius;
        float* t = reinterpret_cast<float*>(tile);
        if (x < W) {
            for (int i = ty; i < TF_YT_ROWS + 2 * r; i += TF_BILY_BY)
                t[i * TF_BILY_BX + tx] = unit * tf_ld(L, (long)tf_clampi(y0 - r + i, 0, H - 1) * W + x);
        }
        __syncthreads();
        if (x >= W) return;
        const float w0 = p->luma_spatial[0];
        const auto out = [&](int q, float v, const float*) {
            const int y = y0 + row0 + q;
            if (y < H) tf_st(Lo, (long)y * W + x, v);
        };
        const float* col = &t[row0 * TF_BILY_BX + tx];
        if (r == TF_LUMA_R) {
            tf_strip<TF_LUMA_R, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[0], w0, unit, out);
        } else {
            tf_strip<-1, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[0], w0, unit, out);
        }
        // After the outputs: the filter's registers do not add to the strip's.
        if (temporal)
            tf_filter_column<float>(tf_history(p, fr, ring, slot_elems), Lo, tf_push_slot(fr, ring, slot_elems),
                                    (long)(y0 + row0) * W + x, W, min(TF_BILY_ROWS, H - y0 - row0), 0);
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        if ((int)(blockIdx.x * TF_BILY_BX) >= cw) return;
        const int y0 = (blockIdx.y - luma_blocks_y) * TF_YT_ROWS;
        const int r = p->chroma_radius;
        const float cunit = TF_CHROMA_UNIT * unit;
        if (x < cw) {
            for (int i = ty; i < TF_YT_ROWS + 2 * r; i += TF_BILY_BY) {
                const float2 v = tf_ld2(UV, (long)tf_clampi(y0 - r + i, 0, ch - 1) * cw + x);
                tile[i * TF_BILY_BX + tx] = make_float2(cunit * v.x, cunit * v.y);
            }
        }
        __syncthreads();
        if (x >= cw) return;
        const float w0 = p->chroma_spatial[0];
        const auto out = [&](int q, float2 v, const float2*) {
            const int y = y0 + row0 + q;
            if (y < ch) tf_st2(UVo, (long)y * cw + x, v);
        };
        const float2* col = &tile[row0 * TF_BILY_BX + tx];
        if (r == TF_CHROMA_R) {
            tf_strip<TF_CHROMA_R, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[1], w0, cunit, out);
        } else {
            tf_strip<-1, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[1], w0, cunit, out);
        }
        if (temporal) {
            tf_store* pushed = tf_push_slot(fr, ring, slot_elems);
            tf_filter_column<float2>(tf_history(p, fr, ring, slot_elems), UVo, pushed ? pushed + slot_luma_elems : nullptr,
                                     (long)(y0 + row0) * cw + x, cw, min(TF_BILY_ROWS, ch - y0 - row0), slot_luma_elems);
        }
    }
}

// DoG x pass on its own (only when the edges come from the last bilateral iteration). Block and
// grid as the luma part of tf_bilateral_x.
extern "C" __global__ void tf_dog_x(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                    float* __restrict__ dog1, float* __restrict__ dog2)
{
    __shared__ float sl[TF_BIL_BY][TF_XT_W];
    const int W = p->width, H = p->height;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int x0 = blockIdx.x * TF_XT_COLS;
    const int c0 = tx * TF_BIL_COLS;
    const int x = x0 + c0;
    const int y = blockIdx.y * TF_BIL_BY + ty;
    const int er = p->edge_radius;
    if (y < H) tf_load_row(sl[ty], L, y, W, x0, er, 1.0f);
    __syncthreads();
    if (x >= W || y >= H) return;
    const float inv1 = tf_gauss_inv(p->edge_gauss1, er, 1.0f);
    const float inv2 = tf_gauss_inv(p->edge_gauss2, er, 1.0f);
    tf_dog_x_cols<-1>(&sl[ty][c0 + er], p->edge_gauss1, p->edge_gauss2, inv1, inv2, er, (long)y * W + x, x, W, dog1,
                      dog2);
}

// ---------------------------------------------------------------------------------------------
// 3b. Temporal filter of the features, in place, and the ring push of the raw features, on its own:
// only when the temporal point comes before any bilateral iteration (edge_iteration 0; otherwise
// the y pass that ends the edge iteration filters and pushes as it writes). One thread per chroma
// sample (its 2x2 luma block), block TF_TILE_BX x TF_TILE_BY. Each thread reads a pixel's history
// before it overwrites that pixel's push slot, so the oldest entry can be reused in the same
// launch.
extern "C" __global__ void tf_temporal(const ToonParams* __restrict__ p, const TfFrame* __restrict__ fr,
                                       tf_store* __restrict__ L, tf_store* __restrict__ UV,
                                       tf_store* __restrict__ ring, long slot_elems, long slot_luma_elems)
{
    const int W = p->width;
    const int cw = p->chroma_width, ch = p->chroma_height;
    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx >= cw || cy >= ch) return;
    const TfHistory h = tf_history(p, fr, ring, slot_elems);
    tf_store* pushed = tf_push_slot(fr, ring, slot_elems);
    // Luma: the two pixels of each row of the 2x2 block as one pair (even width, even x).
#pragma unroll
    for (int dy = 0; dy < 2; ++dy) {
        const long pair = ((long)(2 * cy + dy) * W + 2 * cx) / 2;
        const float2 f0 = tf_ld2(L, pair);
        const float2 f = make_float2(tf_filter_luma(h, f0.x, 2 * pair), tf_filter_luma(h, f0.y, 2 * pair + 1));
        if (pushed) tf_st2(pushed, pair, f0);
        tf_st2(L, pair, f);
    }
    const long cpair = (long)cy * cw + cx;
    const float2 c = tf_ld2(UV, cpair);
    const float2 f = tf_filter_chroma(h, c, cpair, slot_luma_elems);
    if (pushed) tf_st2(pushed + slot_luma_elems, cpair, c);
    tf_st2(UV, cpair, f);
}

// ---------------------------------------------------------------------------------------------
// 4-6. DoG y pass + edge factor, auto-levels, quantize, compose and pack. One thread per chroma
// sample (its 2x2 luma block), block TF_TILE_BX x TF_TILE_BY.

// DoG y pass of the 2x2 luma block at (x0, y0): both Gaussians over rows y0 - R .. y0 + 1 + R,
// each row read once (a float2 per plane: x0 and the width are even) for both output rows. Each
// output's sums still run over j = -R .. R in order, as on the CPU. Out: g1[dy], g2[dy] (x: the
// left pixel, y: the right one), normalised by inv1 / inv2 (TfFrame's edge_inv1/2).
template <int RF>
__device__ __forceinline__ void tf_dog_y_block(const ToonParams* __restrict__ p, const float* __restrict__ dog1,
                                               const float* __restrict__ dog2, int x0, int y0, int W, int H, int r,
                                               float inv1, float inv2, float2 g1[2], float2 g2[2])
{
    const int R = RF >= 0 ? RF : r;
    const float* __restrict__ ga = p->edge_gauss1;
    const float* __restrict__ gb = p->edge_gauss2;
    float2 s1[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    float2 s2[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
#pragma unroll
    for (int i = -R; i <= R + 1; ++i) {
        // 32-bit: a plane's element count fits (the geometry caps frames far below 2^31 pixels).
        const int o = tf_clampi(y0 + i, 0, H - 1) * W + x0;
        const float2 a = *reinterpret_cast<const float2*>(dog1 + o);
        const float2 b = *reinterpret_cast<const float2*>(dog2 + o);
#pragma unroll
        for (int dy = 0; dy < 2; ++dy) {
            const int j = i - dy; // this row is tap j of output row y0 + dy
            if (j < -R || j > R) continue;
            const float wa = ga[j < 0 ? -j : j], wb = gb[j < 0 ? -j : j];
            s1[dy].x = tf_mad(wa, a.x, s1[dy].x);
            s1[dy].y = tf_mad(wa, a.y, s1[dy].y);
            s2[dy].x = tf_mad(wb, b.x, s2[dy].x);
            s2[dy].y = tf_mad(wb, b.y, s2[dy].y);
        }
    }
#pragma unroll
    for (int dy = 0; dy < 2; ++dy) {
        g1[dy] = make_float2(s1[dy].x * inv1, s1[dy].y * inv1);
        g2[dy] = make_float2(s2[dy].x * inv2, s2[dy].y * inv2);
    }
}

extern "C" __global__ void tf_final(const ToonParams* __restrict__ p, const TfFrame* __restrict__ fr,
                                    const tf_store* __restrict__ L, const tf_store* __restrict__ UV,
                                    const float* __restrict__ dog1, const float* __restrict__ dog2,
                                    unsigned char* __restrict__ out)
{
    const int W = p->width, H = p->height;
    const int cw = p->chroma_width, ch = p->chroma_height;
    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx >= cw || cy >= ch) return;
    const int use_levels = (p->auto_levels != 0) && (fr->levels_valid != 0);
    const float black = fr->black, stretch = fr->levels_stretch;
    const float dq = fr->level_step, inv_dq = fr->level_inv_step;
    const int er = p->edge_radius;

    float2 g1[2], g2[2];
    if (er == TF_EDGE_R) {
        tf_dog_y_block<TF_EDGE_R>(p, dog1, dog2, 2 * cx, 2 * cy, W, H, er, fr->edge_inv1, fr->edge_inv2, g1, g2);
    } else {
        tf_dog_y_block<-1>(p, dog1, dog2, 2 * cx, 2 * cy, W, H, er, fr->edge_inv1, fr->edge_inv2, g1, g2);
    }
    float emin = 0.0f;
#pragma unroll
    for (int dy = 0; dy < 2; ++dy) {
        const long idx = (long)(2 * cy + dy) * W + 2 * cx;
        unsigned char px[2];
#pragma unroll
        for (int dx = 0; dx < 2; ++dx) {
            const float e = tf_edge_factor(dx ? g1[dy].y : g1[dy].x, dx ? g2[dy].y : g2[dy].x, p);
            emin = (dx == 0 && dy == 0) ? e : fminf(emin, e);
            float l = tf_ld(L, idx + dx);
            if (use_levels) l = fminf(fmaxf((l - black) * stretch, 0.0f), 100.0f);
            const float lq = tf_quantize(l, dq, inv_dq, p->level_sharpness);
            px[dx] = tf_pack_luma(lq, e);
        }
        // Both bytes in one 16-bit store (even width, even x).
        *reinterpret_cast<unsigned short*>(out + idx) = (unsigned short)(px[0] | (px[1] << 8));
    }

    const float2 c = tf_ld2(UV, (long)cy * cw + cx);
    const float sat = p->saturation;
    // Both bytes in one 16-bit store (the row offset W and 2 * cx are even).
    *reinterpret_cast<unsigned short*>(out + (long)H * W + (long)cy * W + 2 * cx) =
        (unsigned short)(tf_pack_chroma(c.x, sat, emin) | (tf_pack_chroma(c.y, sat, emin) << 8));
}
