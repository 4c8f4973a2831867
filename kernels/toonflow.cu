// toonflow kernels: the stylize pipeline of src/pipeline/cpu.rs on the GPU.
//
// Compiled at run time with NVRTC, once per storage precision:
//   -DTF_FP16=1  planes (features, ring, bilateral intermediates) stored as IEEE half
//   -DTF_FP16=0  planes stored as float
// Math is always fp32, evaluated in the CPU reference's order (no fast math, no FMA contraction:
// the host compiles with --fmad=false). The DoG intermediates are always float: they are
// differences of nearly equal values and half storage would move the lines.
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
// the launch block sizes TF_TILE_BX/BY, TF_BIL_BX/BY, TF_ANALYZE_THREADS.

// Range and motion weights: the accurate expf, or __expf (the hardware ex2 with one multiply)
// when the host builds with TOONFLOW_FAST_MATH=1; the parity tests bound the difference.
#ifndef TF_FAST_EXP
#define TF_FAST_EXP 0
#endif
#if TF_FAST_EXP
#define tf_exp(x) __expf(x)
#else
#define tf_exp(x) expf(x)
#endif

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
#else
typedef float tf_store;
__device__ __forceinline__ float tf_ld(const tf_store* __restrict__ p, long i) { return p[i]; }
__device__ __forceinline__ void tf_st(tf_store* __restrict__ p, long i, float v) { p[i] = v; }
#endif

// TfControl (host -> device every frame), TfState (scene detector memory and ring cursor) and
// TfFrame (per-frame decisions, copied back to the host) come with the generated ABI.

__device__ __forceinline__ int tf_clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// First pixel of thumbnail block b (analysis.rs block_start).
__device__ __forceinline__ int tf_block_start(int b, int blocks, int size) { return (int)(((long)b * size) / blocks); }

// Thumbnail block holding pixel x: the largest b with block_start(b) <= x.
__device__ __forceinline__ int tf_block_of(int x, int blocks, int size) { return (int)((((long)x + 1) * blocks - 1) / size); }

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
// 1. Unpack and statistics. One thread per chroma sample: its 2x2 luma block and its (u, v).
// Block TF_TILE_BX x TF_TILE_BY threads (the host launches exactly that) = a luma tile of twice
// that size; thumbnail sums and histogram gather in shared memory.
#define TF_TILE_TW (2 * TF_TILE_BX)
#define TF_TILE_TH (2 * TF_TILE_BY)

extern "C" __global__ void tf_unpack(const ToonParams* __restrict__ p, const unsigned char* __restrict__ nv12,
                                     tf_store* __restrict__ L, tf_store* __restrict__ UV,
                                     unsigned int* __restrict__ thumb_sums, unsigned int* __restrict__ hist)
{
    __shared__ unsigned int shist[TF_HIST_BINS];
    __shared__ unsigned int sthumb[TF_TILE_TH * TF_TILE_TW];
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
    __syncthreads();

    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx < cw && cy < ch) {
        for (int dy = 0; dy < 2; ++dy) {
            const int y = 2 * cy + dy;
            const int by = tf_block_of(y, th, H) - by0;
            for (int dx = 0; dx < 2; ++dx) {
                const int x = 2 * cx + dx;
                const unsigned int v = nv12[(long)y * W + x];
                tf_st(L, (long)y * W + x, 100.0f * (float)v / 255.0f);
                atomicAdd(&shist[v], 1u);
                const int bx = tf_block_of(x, tw, W) - bx0;
                atomicAdd(&sthumb[by * TF_TILE_TW + bx], v);
            }
        }
        const unsigned char* uv = nv12 + (long)H * W + (long)cy * W + 2 * cx;
        const long o = 2L * ((long)cy * cw + cx);
        tf_st(UV, o, ((float)uv[0] - 128.0f) / 255.0f);
        tf_st(UV, o + 1, ((float)uv[1] - 128.0f) / 255.0f);
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
// 2. Analysis: one block of TF_ANALYZE_THREADS threads.

extern "C" __global__ void tf_analyze(const ToonParams* __restrict__ p, const TfControl* __restrict__ ctl,
                                      const unsigned int* __restrict__ thumb_sums,
                                      const unsigned int* __restrict__ hist, TfState* __restrict__ st,
                                      TfFrame* __restrict__ fr, int capacity)
{
    __shared__ float spart[TF_ANALYZE_THREADS];
    __shared__ unsigned int shist[TF_HIST_BINS];
    const int W = p->width, H = p->height;
    const int tw = p->thumb_w, th = p->thumb_h;
    const int n = tw * th;
    const int reset = ctl->reset;
    const int has_prev = (st->has_prev != 0) && (reset == 0);
    const int tid = threadIdx.x;

    float part = 0.0f;
    for (int i = tid; i < n; i += TF_ANALYZE_THREADS) {
        const int by = i / tw, bx = i % tw;
        const int rows = tf_block_start(by + 1, th, H) - tf_block_start(by, th, H);
        const int cols = tf_block_start(bx + 1, tw, W) - tf_block_start(bx, tw, W);
        const float count = (float)(rows * cols);
        const float m = 100.0f * (float)thumb_sums[by * TF_THUMB_W + bx] / (255.0f * count);
        if (has_prev) part += fabsf(st->prev_thumb[i] - m);
        st->prev_thumb[i] = m;
    }
    spart[tid] = part;
    for (int i = tid; i < TF_HIST_BINS; i += TF_ANALYZE_THREADS) shist[i] = hist[i];
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
// 3. Bilateral passes. Block TF_BIL_BX x TF_BIL_BY; grid.y covers the luma rows (first
// `luma_blocks_y` rows of blocks) and then the chroma rows.

__device__ __forceinline__ void tf_dog_pair_row(const ToonParams* __restrict__ p, const tf_store* __restrict__ row,
                                                int x, int W, float* g1, float* g2)
{
    const int r = p->edge_radius;
    float s1 = 0.0f, n1 = 0.0f, s2 = 0.0f, n2 = 0.0f;
    for (int j = -r; j <= r; ++j) {
        const float v = tf_ld(row, tf_clampi(x + j, 0, W - 1));
        const int aj = j < 0 ? -j : j;
        const float a = p->edge_gauss1[aj];
        const float b = p->edge_gauss2[aj];
        s1 += a * v;
        n1 += a;
        s2 += b * v;
        n2 += b;
    }
    *g1 = s1 / n1;
    *g2 = s2 / n2;
}

extern "C" __global__ void tf_bilateral_x(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                          const tf_store* __restrict__ UV, tf_store* __restrict__ Lo,
                                          tf_store* __restrict__ UVo, float* __restrict__ dog1,
                                          float* __restrict__ dog2, int iter_index, int luma_blocks_y)
{
    if ((int)blockIdx.y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int x = blockIdx.x * blockDim.x + threadIdx.x;
        const int y = blockIdx.y * blockDim.y + threadIdx.y;
        if (x >= W || y >= H) return;
        const tf_store* row = L + (long)y * W;
        const float c = tf_ld(row, x);
        const int r = p->luma_radius;
        const float rc = p->range_coeff;
        float acc = 0.0f, wsum = 0.0f;
        for (int j = -r; j <= r; ++j) {
            const float nb = tf_ld(row, tf_clampi(x + j, 0, W - 1));
            const float d = nb - c;
            const float w = p->luma_spatial[j < 0 ? -j : j] * tf_exp(rc * d * d);
            acc += w * nb;
            wsum += w;
        }
        tf_st(Lo, (long)y * W + x, acc / wsum);
        if (p->edge_iteration == iter_index) {
            float g1, g2;
            tf_dog_pair_row(p, row, x, W, &g1, &g2);
            dog1[(long)y * W + x] = g1;
            dog2[(long)y * W + x] = g2;
        }
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        const int x = blockIdx.x * blockDim.x + threadIdx.x;
        const int y = (blockIdx.y - luma_blocks_y) * blockDim.y + threadIdx.y;
        if (x >= cw || y >= ch) return;
        const tf_store* row = UV + 2L * (long)y * cw;
        const float cu = tf_ld(row, 2 * x), cv = tf_ld(row, 2 * x + 1);
        const int r = p->chroma_radius;
        const float rc = p->range_coeff;
        float au = 0.0f, av = 0.0f, wsum = 0.0f;
        for (int j = -r; j <= r; ++j) {
            const int xx = tf_clampi(x + j, 0, cw - 1);
            const float u = tf_ld(row, 2 * xx), v = tf_ld(row, 2 * xx + 1);
            const float du = 100.0f * (u - cu);
            const float dv = 100.0f * (v - cv);
            const float w = p->chroma_spatial[j < 0 ? -j : j] * tf_exp(rc * (du * du + dv * dv));
            au += w * u;
            av += w * v;
            wsum += w;
        }
        const long o = 2L * ((long)y * cw + x);
        tf_st(UVo, o, au / wsum);
        tf_st(UVo, o + 1, av / wsum);
    }
}

extern "C" __global__ void tf_bilateral_y(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                          const tf_store* __restrict__ UV, tf_store* __restrict__ Lo,
                                          tf_store* __restrict__ UVo, int luma_blocks_y)
{
    if ((int)blockIdx.y < luma_blocks_y) {
        const int W = p->width, H = p->height;
        const int x = blockIdx.x * blockDim.x + threadIdx.x;
        const int y = blockIdx.y * blockDim.y + threadIdx.y;
        if (x >= W || y >= H) return;
        const float c = tf_ld(L, (long)y * W + x);
        const int r = p->luma_radius;
        const float rc = p->range_coeff;
        float acc = 0.0f, wsum = 0.0f;
        for (int j = -r; j <= r; ++j) {
            const float nb = tf_ld(L, (long)tf_clampi(y + j, 0, H - 1) * W + x);
            const float d = nb - c;
            const float w = p->luma_spatial[j < 0 ? -j : j] * tf_exp(rc * d * d);
            acc += w * nb;
            wsum += w;
        }
        tf_st(Lo, (long)y * W + x, acc / wsum);
    } else {
        const int cw = p->chroma_width, ch = p->chroma_height;
        const int x = blockIdx.x * blockDim.x + threadIdx.x;
        const int y = (blockIdx.y - luma_blocks_y) * blockDim.y + threadIdx.y;
        if (x >= cw || y >= ch) return;
        const long c0 = 2L * ((long)y * cw + x);
        const float cu = tf_ld(UV, c0), cv = tf_ld(UV, c0 + 1);
        const int r = p->chroma_radius;
        const float rc = p->range_coeff;
        float au = 0.0f, av = 0.0f, wsum = 0.0f;
        for (int j = -r; j <= r; ++j) {
            const long i = 2L * ((long)tf_clampi(y + j, 0, ch - 1) * cw + x);
            const float u = tf_ld(UV, i), v = tf_ld(UV, i + 1);
            const float du = 100.0f * (u - cu);
            const float dv = 100.0f * (v - cv);
            const float w = p->chroma_spatial[j < 0 ? -j : j] * tf_exp(rc * (du * du + dv * dv));
            au += w * u;
            av += w * v;
            wsum += w;
        }
        tf_st(UVo, c0, au / wsum);
        tf_st(UVo, c0 + 1, av / wsum);
    }
}

// DoG x pass on its own (only when the edges come from the last bilateral iteration).
extern "C" __global__ void tf_dog_x(const ToonParams* __restrict__ p, const tf_store* __restrict__ L,
                                    float* __restrict__ dog1, float* __restrict__ dog2)
{
    const int W = p->width, H = p->height;
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= W || y >= H) return;
    float g1, g2;
    tf_dog_pair_row(p, L + (long)y * W, x, W, &g1, &g2);
    dog1[(long)y * W + x] = g1;
    dog2[(long)y * W + x] = g2;
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
    const float mc = p->motion_coeff;

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
                const float w = sk * tf_exp(mc * d * d);
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
        const float w = sk * tf_exp(mc * (du * du + dv * dv));
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

    float emin = 0.0f;
    for (int dy = 0; dy < 2; ++dy) {
        const int y = 2 * cy + dy;
        for (int dx = 0; dx < 2; ++dx) {
            const int x = 2 * cx + dx;
            // DoG y pass: both Gaussians, each normalised by its own weight sum.
            float s1 = 0.0f, n1 = 0.0f, s2 = 0.0f, n2 = 0.0f;
            for (int j = -er; j <= er; ++j) {
                const long i = (long)tf_clampi(y + j, 0, H - 1) * W + x;
                const int aj = j < 0 ? -j : j;
                const float a = p->edge_gauss1[aj];
                const float b = p->edge_gauss2[aj];
                s1 += a * dog1[i];
                n1 += a;
                s2 += b * dog2[i];
                n2 += b;
            }
            const float e = tf_edge_factor(s1 / n1, s2 / n2, p);
            emin = (dx == 0 && dy == 0) ? e : fminf(emin, e);

            const long idx = (long)y * W + x;
            float l = tf_ld(L, idx);
            if (use_levels) l = fminf(fmaxf((l - black) * (100.0f / (white - black)), 0.0f), 100.0f);
            const float lq = tf_quantize(l, p->levels, p->level_sharpness);
            out[idx] = tf_pack_luma(lq, e);
        }
    }

    const long c0 = 2L * ((long)cy * cw + cx);
    const float sat = p->saturation;
    unsigned char* uvo = out + (long)H * W + (long)cy * W + 2 * cx;
    uvo[0] = tf_pack_chroma(tf_ld(UV, c0), sat, emin);
    uvo[1] = tf_pack_chroma(tf_ld(UV, c0 + 1), sat, emin);
}
