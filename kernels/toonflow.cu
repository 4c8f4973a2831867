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
//   memset(stats)             thumbnail block sums + histogram to zero (a memset node, no kernel)
//   tf_unpack                 NV12 -> L, UV planes; thumbnail block sums; histogram
//   tf_analyze                scene score, cut decision, ring bookkeeping, auto-levels (1 block)
//   tf_bilateral_x / _y       edge_iteration iterations, luma and chroma in one launch each
//   tf_temporal               temporal filter of the features in place, ring push (skipped
//                             when the ring has no slot)
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

// Bilateral tap weight spatial[j] * exp(coeff * a * b), from a per-launch table t[j] =
// tf_tap_table(spatial[j]) and k = tf_range_scale(coeff): by default the spatial weight rides in
// the exponent, one FMA and one ex2 per tap (2^(k*a*b + log2 spatial[j])), and the sums use FMAs;
// TF_ACCURATE_EXP=1 keeps the CPU's products (spatial[j] * expf(coeff*a*b), no FMA).
__device__ __forceinline__ float tf_tap_table(float spatial)
{
#if TF_ACCURATE_EXP
    return spatial;
#else
    return log2f(spatial);
#endif
}
__device__ __forceinline__ float tf_tap_weight(float ka, float b, float t)
{
#if TF_ACCURATE_EXP
    return t * expf(ka * b);
#else
    return tf_range_weight(__fmaf_rn(ka, b, t));
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
#else
typedef float tf_store;
__device__ __forceinline__ float tf_ld(const tf_store* __restrict__ p, long i) { return p[i]; }
__device__ __forceinline__ void tf_st(tf_store* __restrict__ p, long i, float v) { p[i] = v; }
__device__ __forceinline__ float2 tf_ld2(const tf_store* __restrict__ p, long i)
{
    return reinterpret_cast<const float2*>(p)[i];
}
__device__ __forceinline__ void tf_st2(tf_store* __restrict__ p, long i, float2 v) { reinterpret_cast<float2*>(p)[i] = v; }
#endif
// tf_ld2/tf_st2 need the pair aligned to its size: the planned chroma planes start on ALIGN.

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
        e = fminf(fmaxf(1.0f + tanhf(p->edge_sharpness * h), 0.0f), 1.0f);
    }
    return 1.0f - p->edge_strength * (1.0f - e);
}

__device__ __forceinline__ float tf_quantize(float l, int levels, float sharpness)
{
    float dq = 100.0f / (float)levels;
    float q = dq * floorf(l / dq + 0.5f);
    return q + (dq * 0.5f) * tanhf(sharpness * (l - q));
}

__device__ __forceinline__ unsigned char tf_pack_luma(float lq, float e)
{
    float v = roundf(255.0f * lq * e / 100.0f);
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
// (frame sizes are even). Block TF_TILE_BX x TF_TILE_BY threads (the host launches exactly that)
// = a luma tile of twice that size; thumbnail sums and histogram gather in shared memory, the
// thumbnail blocks of the tile's columns and rows are looked up once per block.
#define TF_TILE_TW (2 * TF_TILE_BX)
#define TF_TILE_TH (2 * TF_TILE_BY)

extern "C" __global__ void tf_unpack(const ToonParams* __restrict__ p, const unsigned char* __restrict__ nv12,
                                     tf_store* __restrict__ L, tf_store* __restrict__ UV,
                                     unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist)
{
    __shared__ unsigned int shist[TF_HIST_BINS];
    __shared__ unsigned int sthumb[TF_TILE_TH * TF_TILE_TW];
    __shared__ int scol[TF_TILE_TW];
    __shared__ int srow[TF_TILE_TH];
    const int W = p->width, H = p->height;
    const int cw = p->chroma_width, ch = p->chroma_height;
    const int tw = p->thumb_w, th = p->thumb_h;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    for (int i = tid; i < TF_HIST_BINS; i += nthreads) shist[i] = 0u;
    for (int i = tid; i < TF_TILE_TH * TF_TILE_TW; i += nthreads) sthumb[i] = 0u;
    const int tx0 = blockIdx.x * TF_TILE_TW;
    const int ty0 = blockIdx.y * TF_TILE_TH;
    const int bx0 = tf_block_of(tx0 < W ? tx0 : W - 1, tw, W);
    const int by0 = tf_block_of(ty0 < H ? ty0 : H - 1, th, H);
    for (int i = tid; i < TF_TILE_TW; i += nthreads) scol[i] = tf_block_of(min(tx0 + i, W - 1), tw, W) - bx0;
    for (int i = tid; i < TF_TILE_TH; i += nthreads) srow[i] = tf_block_of(min(ty0 + i, H - 1), th, H) - by0;
    __syncthreads();

    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx < cw && cy < ch) {
        const int lx = 2 * threadIdx.x, ly = 2 * threadIdx.y;
        const int c0 = scol[lx], c1 = scol[lx + 1];
        unsigned int sum[2][2] = {{0u, 0u}, {0u, 0u}};
        for (int dy = 0; dy < 2; ++dy) {
            const long i = (long)(2 * cy + dy) * W + 2 * cx;
            // Two luma bytes in one 16-bit load (even width, even x).
            const unsigned short two = *reinterpret_cast<const unsigned short*>(nv12 + i);
            const unsigned int v0 = two & 0xffu, v1 = two >> 8;
            tf_st(L, i, 100.0f * (float)v0 / 255.0f);
            tf_st(L, i + 1, 100.0f * (float)v1 / 255.0f);
            atomicAdd(&shist[v0], 1u);
            atomicAdd(&shist[v1], 1u);
            sum[dy][0] = v0;
            sum[dy][1] = v1;
        }
        // The 2x2 block's contributions, merged where they fall into the same thumbnail block.
        const int r0 = srow[ly], r1 = srow[ly + 1];
        if (c0 == c1 && r0 == r1) {
            atomicAdd(&sthumb[r0 * TF_TILE_TW + c0], sum[0][0] + sum[0][1] + sum[1][0] + sum[1][1]);
        } else {
            for (int dy = 0; dy < 2; ++dy) {
                const int r = dy == 0 ? r0 : r1;
                if (c0 == c1) {
                    atomicAdd(&sthumb[r * TF_TILE_TW + c0], sum[dy][0] + sum[dy][1]);
                } else {
                    atomicAdd(&sthumb[r * TF_TILE_TW + c0], sum[dy][0]);
                    atomicAdd(&sthumb[r * TF_TILE_TW + c1], sum[dy][1]);
                }
            }
        }
        const unsigned short uv = *reinterpret_cast<const unsigned short*>(nv12 + (long)H * W + (long)cy * W + 2 * cx);
        tf_st2(UV, (long)cy * cw + cx,
               make_float2(((float)(uv & 0xffu) - 128.0f) / 255.0f, ((float)(uv >> 8) - 128.0f) / 255.0f));
    }
    __syncthreads();
    for (int i = tid; i < TF_HIST_BINS; i += nthreads) {
        if (shist[i] != 0u) atomicAdd(&hist[i], shist[i]);
    }
    for (int i = tid; i < TF_TILE_TH * TF_TILE_TW; i += nthreads) {
        const unsigned int s = sthumb[i];
        if (s != 0u) {
            const int by = by0 + i / TF_TILE_TW;
            const int bx = bx0 + i % TF_TILE_TW;
            if (by < th && bx < tw) atomicAdd(&thumb_sums[by * TF_THUMB_W + bx], s);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Analysis: one block of TF_ANALYZE_THREADS threads (a few thousand thumbnail blocks and 256
// histogram bins: one block finishes in a few microseconds once the index math is 32-bit and the
// block sizes are looked up, not divided out per cell).

extern "C" __global__ void tf_analyze(const ToonParams* __restrict__ p, const TfControl* __restrict__ ctl,
                                      const unsigned int* __restrict__ thumb_sums,
                                      const unsigned int* __restrict__ hist, TfState* __restrict__ st,
                                      TfFrame* __restrict__ fr, int capacity)
{
    __shared__ float spart[TF_ANALYZE_THREADS];
    __shared__ unsigned int shist[TF_HIST_BINS];
    __shared__ int scols[TF_THUMB_W];
    __shared__ int srows[TF_THUMB_H];
    const int W = p->width, H = p->height;
    const int tw = p->thumb_w, th = p->thumb_h;
    const int n = tw * th;
    const int reset = ctl->reset;
    const int has_prev = (st->has_prev != 0) && (reset == 0);
    const int tid = threadIdx.x;
    for (int i = tid; i < tw; i += TF_ANALYZE_THREADS) scols[i] = tf_block_start(i + 1, tw, W) - tf_block_start(i, tw, W);
    for (int i = tid; i < th; i += TF_ANALYZE_THREADS) srows[i] = tf_block_start(i + 1, th, H) - tf_block_start(i, th, H);
    for (int i = tid; i < TF_HIST_BINS; i += TF_ANALYZE_THREADS) shist[i] = hist[i];
    __syncthreads();

    float part = 0.0f;
    for (int i = tid; i < n; i += TF_ANALYZE_THREADS) {
        const int by = i / tw, bx = i - by * tw;
        const float count = (float)(srows[by] * scols[bx]);
        const float m = 100.0f * (float)thumb_sums[by * TF_THUMB_W + bx] / (255.0f * count);
        if (has_prev) part += fabsf(st->prev_thumb[i] - m);
        st->prev_thumb[i] = m;
    }
    spart[tid] = part;
    __syncthreads();
    for (int s = TF_ANALYZE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) spart[tid] += spart[tid + s];
        __syncthreads();
    }
    if (tid != 0) return;

    const float score = has_prev ? spart[0] / (float)n : 0.0f;
    const int cut = score > p->scene_cut_threshold ? 1 : 0;
    int next = st->ring_next, len = st->ring_len;
    if (reset || cut) {
        next = 0;
        len = 0;
    }
    const int hist_lim = p->history < 0 ? 0 : p->history;
    const int used = len < hist_lim ? len : hist_lim;
    for (int k = 0; k < TF_MAX_HISTORY; ++k) {
        fr->recent_slot[k] = (k < used && capacity > 0) ? (next + capacity - (k + 1)) % capacity : 0;
    }
    fr->push_slot = capacity > 0 ? next : -1;
    if (capacity > 0) {
        next = (next + 1) % capacity;
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
}

// ---------------------------------------------------------------------------------------------
// 3. Bilateral passes and the DoG x pass, through shared-memory tiles.
//
// A block first copies its tile and the halo around it into shared memory (borders replicated,
// converted to float once), so the taps read shared memory at fixed offsets: no clamps, index
// math or conversions in the tap loops. The loops are unrolled for the default radii (luma 6,
// chroma 3, DoG 4: spatial sigma 3, edge sigma 1) and stay loops for other radii; both sum in
// the CPU reference's order (j = -r .. r), so the unrolled and the generic code agree bit for bit.
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

// Bilateral sum over luma taps s[j * stride], j = -R .. R (R = RF when RF >= 0, else r): tap
// weights from the table t (tf_tap_table of the spatial weights) and k = tf_range_scale(coeff);
// the centre weight is the spatial weight w0 itself (exp(0) = 1, as on the CPU).
template <int RF>
__device__ __forceinline__ float tf_bil(const float* s, int stride, const float* t, float w0, float k, int r)
{
    const int R = RF >= 0 ? RF : r;
    const float c = s[0];
    float acc = 0.0f, wsum = 0.0f;
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        const float nb = s[j * stride];
        const float d = nb - c;
        const float w = j == 0 ? w0 : tf_tap_weight(k * d, d, t[j < 0 ? -j : j]);
        acc = tf_mad(w, nb, acc);
        wsum += w;
    }
    return acc / wsum;
}

// The same over (u, v) taps, the range distance taken jointly in L units.
template <int RF>
__device__ __forceinline__ float2 tf_bil(const float2* s, int stride, const float* t, float w0, float k, int r)
{
    const int R = RF >= 0 ? RF : r;
    const float2 c = s[0];
    float au = 0.0f, av = 0.0f, wsum = 0.0f;
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        const float2 n = s[j * stride];
        const float du = 100.0f * (n.x - c.x);
        const float dv = 100.0f * (n.y - c.y);
        const float w = j == 0 ? w0 : tf_tap_weight(k, du * du + dv * dv, t[j < 0 ? -j : j]);
        au = tf_mad(w, n.x, au);
        av = tf_mad(w, n.y, av);
        wsum += w;
    }
    return make_float2(au / wsum, av / wsum);
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

// Normalised Gaussian over the taps at(j), j = -R .. R, with the weight table g (one of the DoG
// pair).
template <int RF, typename At>
__device__ __forceinline__ float tf_gauss(At at, const float* __restrict__ g, int r)
{
    const int R = RF >= 0 ? RF : r;
    float acc = 0.0f, n = 0.0f;
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        const float a = g[j < 0 ? -j : j];
        acc += a * at(j);
        n += a;
    }
    return acc / n;
}

__device__ __forceinline__ float tf_bil_luma_at(const float* s, int stride, const ToonParams* __restrict__ p,
                                                const float* t, float k)
{
    const int r = p->luma_radius;
    const float w0 = p->luma_spatial[0];
    return r == TF_LUMA_R ? tf_bil<TF_LUMA_R>(s, stride, t, w0, k, r) : tf_bil<-1>(s, stride, t, w0, k, r);
}

__device__ __forceinline__ float2 tf_bil_chroma_at(const float2* s, int stride, const ToonParams* __restrict__ p,
                                                   const float* t, float k)
{
    const int r = p->chroma_radius;
    const float w0 = p->chroma_spatial[0];
    return r == TF_CHROMA_R ? tf_bil<TF_CHROMA_R>(s, stride, t, w0, k, r) : tf_bil<-1>(s, stride, t, w0, k, r);
}

template <typename At>
__device__ __forceinline__ float tf_gauss_at(At at, const float* __restrict__ g, int r)
{
    return r == TF_EDGE_R ? tf_gauss<TF_EDGE_R>(at, g, r) : tf_gauss<-1>(at, g, r);
}

// Row y of a luma plane, columns x0 - halo .. x0 + TF_XT_COLS + halo - 1 (replicated), into
// tile[0 ..]; the threads of one block row share the work.
__device__ __forceinline__ void tf_load_row(float* tile, const tf_store* __restrict__ plane, int y, int W, int x0,
                                            int halo)
{
    const tf_store* row = plane + (long)y * W;
    for (int i = threadIdx.x; i < TF_XT_COLS + 2 * halo; i += TF_BIL_BX) tile[i] = tf_ld(row, tf_clampi(x0 - halo + i, 0, W - 1));
}

__device__ __forceinline__ void tf_load_row2(float2* tile, const tf_store* __restrict__ plane, int y, int cw, int x0,
                                             int halo)
{
    const tf_store* row = plane + 2L * (long)y * cw;
    for (int i = threadIdx.x; i < TF_XT_COLS + 2 * halo; i += TF_BIL_BX) tile[i] = tf_ld2(row, tf_clampi(x0 - halo + i, 0, cw - 1));
}

// The DoG x pass of luma row tile s (centre at s[0]) into dog1/dog2 at idx.
__device__ __forceinline__ void tf_dog_x_at(const ToonParams* __restrict__ p, const float* s, long idx,
                                            float* __restrict__ dog1, float* __restrict__ dog2)
{
    const int er = p->edge_radius;
    const auto at = [s](int j) { return s[j]; };
    dog1[idx] = tf_gauss_at(at, p->edge_gauss1, er);
    dog2[idx] = tf_gauss_at(at, p->edge_gauss2, er);
}

// N consecutive outputs of one thread, whose taps lie at first[i * step], i = 0 .. N + 2R - 1 (in
// a shared tile: along a row for the x pass, down a column for the y pass); store(q, value)
// writes output q. With R known at compile time the taps are first copied into registers (each
// shared value read once for all N outputs); otherwise the taps read the tile.
template <int RF, int N, typename T, typename Store>
__device__ __forceinline__ void tf_strip(const T* first, int step, int r, const float* t, float w0, float k, Store store)
{
    if (RF >= 0) {
        const int R = RF >= 0 ? RF : 0;
        T v[N + 2 * R];
#pragma unroll
        for (int i = 0; i < N + 2 * R; ++i) v[i] = first[i * step];
#pragma unroll
        for (int q = 0; q < N; ++q) store(q, tf_bil<RF>(&v[R + q], 1, t, w0, k, r));
    } else {
#pragma unroll
        for (int q = 0; q < N; ++q) store(q, tf_bil<-1>(&first[(r + q) * step], step, t, w0, k, r));
    }
}

extern "C" __global__ void tf_bilateral_x(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                          const tf_store* __restrict__ UV, tf_store* __restrict__ Lo,
                                          tf_store* __restrict__ UVo, float* __restrict__ dog1,
                                          float* __restrict__ dog2, int iter_index, int luma_blocks_y)
{
    __shared__ float sl[TF_BIL_BY][TF_XT_W];
    __shared__ float2 sc[TF_BIL_BY][TF_XT_W];
    __shared__ float tab[2][TF_MAX_RADIUS + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int x0 = blockIdx.x * TF_XT_COLS;
    // The thread's outputs: columns x .. x + TF_BIL_COLS - 1, tile columns c0 .. (+ halo).
    const int c0 = tx * TF_BIL_COLS;
    const int x = x0 + c0;
    const float k = tf_range_scale(p->range_coeff);
    tf_fill_tap_tables(p, tab);
    if ((int)blockIdx.y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int y = blockIdx.y * TF_BIL_BY + ty;
        const int r = p->luma_radius, er = p->edge_radius;
        const int dog = p->edge_iteration == iter_index;
        const int halo = dog && er > r ? er : r;
        if (y < H) tf_load_row(sl[ty], L, y, W, x0, halo);
        __syncthreads();
        if (x >= W || y >= H) return;
        const long idx = (long)y * W + x;
        const float w0 = p->luma_spatial[0];
        const auto store = [&](int q, float v) {
            if (x + q < W) tf_st(Lo, idx + q, v);
        };
        const float* first = &sl[ty][c0 + halo - r];
        if (r == TF_LUMA_R) {
            tf_strip<TF_LUMA_R, TF_BIL_COLS>(first, 1, r, tab[0], w0, k, store);
        } else {
            tf_strip<-1, TF_BIL_COLS>(first, 1, r, tab[0], w0, k, store);
        }
        if (dog) {
            for (int q = 0; q < TF_BIL_COLS && x + q < W; ++q) tf_dog_x_at(p, &sl[ty][c0 + q + halo], idx + q, dog1, dog2);
        }
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        if (x0 >= cw) return;
        const int y = (blockIdx.y - luma_blocks_y) * TF_BIL_BY + ty;
        const int r = p->chroma_radius;
        if (y < ch) tf_load_row2(sc[ty], UV, y, cw, x0, r);
        __syncthreads();
        if (x >= cw || y >= ch) return;
        const long idx = (long)y * cw + x;
        const float w0 = p->chroma_spatial[0];
        const auto store = [&](int q, float2 v) {
            if (x + q < cw) tf_st2(UVo, idx + q, v);
        };
        const float2* first = &sc[ty][c0];
        if (r == TF_CHROMA_R) {
            tf_strip<TF_CHROMA_R, TF_BIL_COLS>(first, 1, r, tab[1], w0, k, store);
        } else {
            tf_strip<-1, TF_BIL_COLS>(first, 1, r, tab[1], w0, k, store);
        }
    }
}

extern "C" __global__ void tf_bilateral_y(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                          const tf_store* __restrict__ UV, tf_store* __restrict__ Lo,
                                          tf_store* __restrict__ UVo, int luma_blocks_y)
{
    // One buffer for both kinds of block: luma blocks use it as float, chroma blocks as float2.
    __shared__ float2 tile[TF_YT_H * TF_BILY_BX];
    __shared__ float tab[2][TF_MAX_RADIUS + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int x = blockIdx.x * TF_BILY_BX + tx;
    // The thread's output rows: row0 .. row0 + TF_BILY_ROWS - 1 of the block's TF_YT_ROWS.
    const int row0 = ty * TF_BILY_ROWS;
    const float k = tf_range_scale(p->range_coeff);
    tf_fill_tap_tables(p, tab);
    if ((int)blockIdx.y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int y0 = blockIdx.y * TF_YT_ROWS;
        const int r = p->luma_radius;
        float* t = reinterpret_cast<float*>(tile);
        if (x < W) {
            for (int i = ty; i < TF_YT_ROWS + 2 * r; i += TF_BILY_BY)
                t[i * TF_BILY_BX + tx] = tf_ld(L, (long)tf_clampi(y0 - r + i, 0, H - 1) * W + x);
        }
        __syncthreads();
        if (x >= W) return;
        const float w0 = p->luma_spatial[0];
        const auto store = [&](int q, float v) {
            const int y = y0 + row0 + q;
            if (y < H) tf_st(Lo, (long)y * W + x, v);
        };
        const float* col = &t[row0 * TF_BILY_BX + tx];
        if (r == TF_LUMA_R) {
            tf_strip<TF_LUMA_R, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[0], w0, k, store);
        } else {
            tf_strip<-1, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[0], w0, k, store);
        }
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        if ((int)(blockIdx.x * TF_BILY_BX) >= cw) return;
        const int y0 = (blockIdx.y - luma_blocks_y) * TF_YT_ROWS;
        const int r = p->chroma_radius;
        if (x < cw) {
            for (int i = ty; i < TF_YT_ROWS + 2 * r; i += TF_BILY_BY)
                tile[i * TF_BILY_BX + tx] = tf_ld2(UV, (long)tf_clampi(y0 - r + i, 0, ch - 1) * cw + x);
        }
        __syncthreads();
        if (x >= cw) return;
        const float w0 = p->chroma_spatial[0];
        const auto store = [&](int q, float2 v) {
            const int y = y0 + row0 + q;
            if (y < ch) tf_st2(UVo, (long)y * cw + x, v);
        };
        const float2* col = &tile[row0 * TF_BILY_BX + tx];
        if (r == TF_CHROMA_R) {
            tf_strip<TF_CHROMA_R, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[1], w0, k, store);
        } else {
            tf_strip<-1, TF_BILY_ROWS>(col, TF_BILY_BX, r, tab[1], w0, k, store);
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
    if (y < H) tf_load_row(sl[ty], L, y, W, x0, er);
    __syncthreads();
    if (x >= W || y >= H) return;
    for (int q = 0; q < TF_BIL_COLS && x + q < W; ++q) tf_dog_x_at(p, &sl[ty][c0 + q + er], (long)y * W + x + q, dog1, dog2);
}

// ---------------------------------------------------------------------------------------------
// 3b. Temporal filter of the features, in place, and the ring push of the raw features. One thread
// per chroma sample (its 2x2 luma block), block TF_TILE_BX x TF_TILE_BY. Each thread reads a
// pixel's history before it overwrites that pixel's push slot, so the oldest entry can be reused
// in the same launch.
extern "C" __global__ void tf_temporal(const ToonParams* __restrict__ p, const TfFrame* __restrict__ fr,
                                       tf_store* __restrict__ L, tf_store* __restrict__ UV,
                                       tf_store* __restrict__ ring, long slot_elems, long slot_luma_elems)
{
    const int W = p->width, H = p->height;
    const int cw = p->chroma_width, ch = p->chroma_height;
    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx >= cw || cy >= ch) return;
    const int used = fr->history_used;
    const int push = fr->push_slot;
    const float ts = p->temporal_strength;
    const float mk = tf_range_scale(p->motion_coeff);

    for (int dy = 0; dy < 2; ++dy) {
        const int y = 2 * cy + dy;
        if (y >= H) break;
        for (int dx = 0; dx < 2; ++dx) {
            const int x = 2 * cx + dx;
            if (x >= W) break;
            const long idx = (long)y * W + x;
            const float f0 = tf_ld(L, idx);
            float acc = f0, wsum = 1.0f, sk = 1.0f;
            for (int k = 0; k < used; ++k) {
                const float fk = tf_ld(ring + (long)fr->recent_slot[k] * slot_elems, idx);
                sk *= ts;
                const float d = fk - f0;
                const float w = sk * tf_range_weight(mk * d * d);
                acc += w * fk;
                wsum += w;
            }
            if (push >= 0) tf_st(ring + (long)push * slot_elems, idx, f0);
            tf_st(L, idx, acc / wsum);
        }
    }

    const long c0 = 2L * ((long)cy * cw + cx);
    const float u0 = tf_ld(UV, c0), v0 = tf_ld(UV, c0 + 1);
    float au = u0, av = v0, wsum = 1.0f, sk = 1.0f;
    for (int k = 0; k < used; ++k) {
        const tf_store* slot = ring + (long)fr->recent_slot[k] * slot_elems + slot_luma_elems;
        const float u = tf_ld(slot, c0), v = tf_ld(slot, c0 + 1);
        sk *= ts;
        const float du = 100.0f * (u - u0);
        const float dv = 100.0f * (v - v0);
        const float w = sk * tf_range_weight(mk * (du * du + dv * dv));
        au += w * u;
        av += w * v;
        wsum += w;
    }
    if (push >= 0) {
        tf_store* slot = ring + (long)push * slot_elems + slot_luma_elems;
        tf_st(slot, c0, u0);
        tf_st(slot, c0 + 1, v0);
    }
    tf_st(UV, c0, au / wsum);
    tf_st(UV, c0 + 1, av / wsum);
}

// ---------------------------------------------------------------------------------------------
// 4-6. DoG y pass + edge factor, auto-levels, quantize, compose and pack. One thread per chroma
// sample (its 2x2 luma block), block TF_TILE_BX x TF_TILE_BY.

// DoG y pass of the 2x2 luma block at (x0, y0): both Gaussians over rows y0 - R .. y0 + 1 + R,
// each row read once (a float2 per plane: x0 and the width are even) for both output rows. Each
// output's sums still run over j = -R .. R in order, as on the CPU. Out: g1[dy], g2[dy] (x: the
// left pixel, y: the right one), normalised by their weight sums.
template <int RF>
__device__ __forceinline__ void tf_dog_y_block(const ToonParams* __restrict__ p, const float* __restrict__ dog1,
                                               const float* __restrict__ dog2, int x0, int y0, int W, int H, int r,
                                               float2 g1[2], float2 g2[2])
{
    const int R = RF >= 0 ? RF : r;
    const float* __restrict__ ga = p->edge_gauss1;
    const float* __restrict__ gb = p->edge_gauss2;
    float2 s1[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    float2 s2[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
#pragma unroll
    for (int i = -R; i <= R + 1; ++i) {
        const long o = (long)tf_clampi(y0 + i, 0, H - 1) * W + x0;
        const float2 a = *reinterpret_cast<const float2*>(dog1 + o);
        const float2 b = *reinterpret_cast<const float2*>(dog2 + o);
#pragma unroll
        for (int dy = 0; dy < 2; ++dy) {
            const int j = i - dy; // this row is tap j of output row y0 + dy
            if (j < -R || j > R) continue;
            const float wa = ga[j < 0 ? -j : j], wb = gb[j < 0 ? -j : j];
            s1[dy].x += wa * a.x;
            s1[dy].y += wa * a.y;
            s2[dy].x += wb * b.x;
            s2[dy].y += wb * b.y;
        }
    }
    float n1 = 0.0f, n2 = 0.0f;
#pragma unroll
    for (int j = -R; j <= R; ++j) {
        n1 += ga[j < 0 ? -j : j];
        n2 += gb[j < 0 ? -j : j];
    }
#pragma unroll
    for (int dy = 0; dy < 2; ++dy) {
        g1[dy] = make_float2(s1[dy].x / n1, s1[dy].y / n1);
        g2[dy] = make_float2(s2[dy].x / n2, s2[dy].y / n2);
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
    const float black = fr->black, white = fr->white;
    const int er = p->edge_radius;

    float2 g1[2], g2[2];
    if (er == TF_EDGE_R) {
        tf_dog_y_block<TF_EDGE_R>(p, dog1, dog2, 2 * cx, 2 * cy, W, H, er, g1, g2);
    } else {
        tf_dog_y_block<-1>(p, dog1, dog2, 2 * cx, 2 * cy, W, H, er, g1, g2);
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
            if (use_levels) l = fminf(fmaxf((l - black) * (100.0f / (white - black)), 0.0f), 100.0f);
            const float lq = tf_quantize(l, p->levels, p->level_sharpness);
            px[dx] = tf_pack_luma(lq, e);
        }
        // Both bytes in one 16-bit store (even width, even x).
        *reinterpret_cast<unsigned short*>(out + idx) = (unsigned short)(px[0] | (px[1] << 8));
    }

    const long c0 = 2L * ((long)cy * cw + cx);
    const float sat = p->saturation;
    unsigned char* uvo = out + (long)H * W + (long)cy * W + 2 * cx;
    uvo[0] = tf_pack_chroma(tf_ld(UV, c0), sat, emin);
    uvo[1] = tf_pack_chroma(tf_ld(UV, c0 + 1), sat, emin);
}
