// toonflow neural kernels: the lowered stages of a style network (src/neural/lower.rs) on the
// GPU, NCHW activations stored as float or IEEE half per buffer, arithmetic and statistics in
// float (statistics accumulate in double, as the CPU reference does).
//
// Every kernel takes one parameter block (src/cuda/neural/program.rs writes them once per shape
// into device memory; the structs come from kernel_abi, prepended by the build). Device
// addresses in the blocks are absolute.
//
// Kernels:
//   nn_conv_<in><out>  direct convolution on CUDA cores: Pad (reflect/edge/constant) and the
//                      convolution's zero padding folded into the index math, bias and the
//                      activation in the epilogue; NN_CONV_OCB output channels per thread
//   nn_conv_mma_<in><out>_<nt>[_cl]  the same on tensor cores (sm_80+, implicit GEMM, below),
//                      which can also fold the Resize or layout Transpose before it into its
//                      gather and the output Transpose after it into its epilogue; _cl gathers
//                      a channels-last (NHWC) fp16 input in 16-byte loads, _tp packs several
//                      horizontal taps of a few-channel input (the stem) into one K chunk
//   nn_moments         per-channel mean and variance (double sums; the last block of a channel
//                      finishes it) and the temporal statistics smoother
//   nn_moments_gram    the same for an fp16 tensor of <= 32 channels and for a 1x1 convolution
//                      of it that only its statistics read, from the channels' Gram matrix
//                      (tensor cores; the convolution is never run)
//   nn_gram_wide[_reduce|_finish]  the same for 64 to 256 channels in whole tiles (the kernels
//                      also take a part tile; the planner does not yet): partial sums of pairs of
//                      64-channel tiles over chunks of the pixels, their reduction, finishing
//   nn_norm_apply      InstanceNormalization's (x - mean) / sqrt(var + eps) * scale + bias, act
//   nn_eltwise         a fused chain of elementwise operators with broadcast operands
//   nn_copy            strided 4-D copy (Transpose, Concat, Reshape and friends) with conversion
//   nn_resize          separable resize of the last two axes from host-computed taps
//   nn_softmax         softmax over rows (one block per row)
//   (the element's NV12 conversions and output filter are in neural_frame.cu; the fp16
//   storage helpers in fp16.cuh, prepended by the host)

// The kernels compile as several programs, NVRTC on as many threads at once
// (src/cuda/neural/mod.rs, PARTS): part NN_PART defines the kernels between
// `#if NN_IN_PART(NN_PART)` and its `#endif`; without NN_PART (one program) every kernel is
// defined
#ifdef NN_PART
#define NN_IN_PART(n) (NN_PART == (n))
#else
#define NN_IN_PART(n) 1
#endif

#define NN_ACT_NONE 0
#define NN_ACT_RELU 1
#define NN_ACT_LEAKY 2
#define NN_ACT_SIGMOID 3
#define NN_ACT_TANH 4
#define NN_ACT_CLIP 5

// Loads element i of a buffer stored as half (is_half) or float.
__device__ __forceinline__ float nn_load(unsigned long long p, long long i, int is_half)
{
    if (is_half)
        return half_bits_to_float(__ldg((const unsigned short*)p + i));
    return __ldg((const float*)p + i);
}

// The same through L2 (ld.global.cg): for values this launch itself wrote, which the
// read-only path may not see.
__device__ __forceinline__ float nn_load_cg(unsigned long long p, long long i, int is_half)
{
    if (is_half)
        return half_bits_to_float(__ldcg((const unsigned short*)p + i));
    return __ldcg((const float*)p + i);
}

__device__ __forceinline__ void nn_store(unsigned long long p, long long i, int is_half, float v)
{
    if (is_half)
        ((unsigned short*)p)[i] = float_to_half_bits(v);
    else
        ((float*)p)[i] = v;
}

struct NnF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p, long long i) { return __ldg(p + i); }
    static __device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
};

struct NnF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const unsigned short* p, long long i)
    {
        return half_bits_to_float(__ldg(p + i));
    }
    static __device__ __forceinline__ void store(unsigned short* p, long long i, float v)
    {
        p[i] = float_to_half_bits(v);
    }
};

__device__ __forceinline__ float nn_activate(float x, int act, float a, float b)
{
    switch (act) {
    case NN_ACT_RELU:
        return x < 0.0f ? 0.0f : x;
    case NN_ACT_LEAKY:
        return x < 0.0f ? a * x : x;
    case NN_ACT_SIGMOID:
        return 1.0f / (1.0f + expf(-x));
    case NN_ACT_TANH:
        return tanhf(x);
    case NN_ACT_CLIP: {
        float y = x < a ? a : x;
        return y > b ? b : y;
    }
    default:
        return x;
    }
}

// nn_activate's curves out of line: a wide tensor-core epilogue activates each of its values on
// its own, and with sigmoid's and tanh's code inlined for each the eight-tile kernels' code was
// about 200 KiB, most of it never run, and their warps waited on instruction fetches.
__device__ __noinline__ float nn_activate_curve(float x, int act)
{
    return act == NN_ACT_SIGMOID ? 1.0f / (1.0f + expf(-x)) : tanhf(x);
}

// nn_activate, its piecewise-linear cases inline (a few selects a value) and its curves called.
// (nn_activate's cases written again on purpose: one template body for both, as a switch or as
// these selects, or the curve calling nn_activate, each changed the wide kernels' SASS (by up
// to +12 KB) or the narrow ones', and only this form was measured.)
__device__ __forceinline__ float nn_activate_lean(float x, int act, float a, float b)
{
    if (act == NN_ACT_SIGMOID || act == NN_ACT_TANH)
        return nn_activate_curve(x, act);
    float y = x;
    if (act == NN_ACT_RELU)
        y = x < 0.0f ? 0.0f : x;
    if (act == NN_ACT_LEAKY)
        y = x < 0.0f ? a * x : x;
    if (act == NN_ACT_CLIP) {
        y = x < a ? a : x;
        y = y > b ? b : y;
    }
    return y;
}

// The biases of output channels oc0 and oc0 + 1 (0 past cout or without a bias).
__device__ __forceinline__ float2 nn_bias_pair(const float* __restrict__ bias, int oc0, int cout)
{
    return make_float2(bias && oc0 < cout ? bias[oc0] : 0.0f, bias && oc0 + 1 < cout ? bias[oc0 + 1] : 0.0f);
}

// nn_activate over n values, the activation chosen once (the per-value switch of a tensor-core
// epilogue cost more instructions than the products).
template <int ACT, int N>
__device__ __forceinline__ void nn_activate_all(float* v, float a, float b)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        v[i] = nn_activate(v[i], ACT, a, b);
}

template <int N>
__device__ __forceinline__ void nn_activate_n(float* v, int act, float a, float b)
{
    switch (act) {
    case NN_ACT_RELU: nn_activate_all<NN_ACT_RELU, N>(v, a, b); break;
    case NN_ACT_LEAKY: nn_activate_all<NN_ACT_LEAKY, N>(v, a, b); break;
    case NN_ACT_SIGMOID: nn_activate_all<NN_ACT_SIGMOID, N>(v, a, b); break;
    case NN_ACT_TANH: nn_activate_all<NN_ACT_TANH, N>(v, a, b); break;
    case NN_ACT_CLIP: nn_activate_all<NN_ACT_CLIP, N>(v, a, b); break;
    default: break;
    }
}

// The source index along an axis of length n for padded coordinate i (already shifted by the
// begin pad): -1 for the Pad's constant fill. mode: 0 constant, 1 reflect, 2 edge.
__device__ __forceinline__ int nn_pad_index(int i, int n, int mode)
{
    if (i >= 0 && i < n)
        return i;
    if (mode == 0)
        return -1;
    if (mode == 2)
        return i < 0 ? 0 : n - 1;
    if (n == 1)
        return 0;
    int period = 2 * (n - 1);
    int m = i % period;
    if (m < 0)
        m += period;
    return m >= n ? period - m : m;
}

// The taps of one value of a separable 2-tap resize: rows ty and columns tx of the tables
// (int i0, int i1, float w0, float w1), as element offsets into a plane of width in_w.
struct NnBilinear {
    long long o00, o01, o10, o11;
    float wy0, wy1, wx0, wx1;
};

__device__ __forceinline__ NnBilinear nn_taps(const int* ty, const int* tx, int in_w)
{
    NnBilinear b;
    const long long r0 = (long long)ty[0] * in_w, r1 = (long long)ty[1] * in_w;
    b.o00 = r0 + tx[0];
    b.o01 = r0 + tx[1];
    b.o10 = r1 + tx[0];
    b.o11 = r1 + tx[1];
    b.wy0 = __int_as_float(ty[2]);
    b.wy1 = __int_as_float(ty[3]);
    b.wx0 = __int_as_float(tx[2]);
    b.wx1 = __int_as_float(tx[3]);
    return b;
}

// The blend of a resized value's four taps: along H first, then W, as the CPU reference does
// (the row-1 taps only count when wy1 is not 0).
__device__ __forceinline__ float nn_blend(float a0, float a1, float b0, float b1, const NnBilinear& b)
{
    if (b.wy1 != 0.0f) {
        a0 = b.wy0 * a0 + b.wy1 * b0;
        a1 = b.wy0 * a1 + b.wy1 * b1;
    }
    return b.wx1 != 0.0f ? b.wx0 * a0 + b.wx1 * a1 : a0;
}

// One resized value of the plane at base.
__device__ __forceinline__ float nn_resize_value(unsigned long long x, int half, long long base,
                                                 const NnBilinear& b)
{
    const float a0 = nn_load(x, base + b.o00, half);
    const float a1 = nn_load(x, base + b.o01, half);
    float b0 = 0.0f, b1 = 0.0f;
    if (b.wy1 != 0.0f) {
        b0 = nn_load(x, base + b.o10, half);
        b1 = nn_load(x, base + b.o11, half);
    }
    return nn_blend(a0, a1, b0, b1, b);
}

// ---------------------------------------------------------------------------------------------
// Convolution

// One thread: one output pixel, NN_CONV_OCB output channels. Weights are laid out by the host as
// [oc block][ic within the group][ky][kx][NN_CONV_OCB] (zero for channels past cout), so the
// NN_CONV_OCB weights of one tap are contiguous and the same for the whole block.
template <typename I, typename O>
__device__ __forceinline__ void nn_conv_body(const NnConv* __restrict__ p)
{
    const int ox = blockIdx.x * blockDim.x + threadIdx.x;
    const int oy = blockIdx.y * blockDim.y + threadIdx.y;
    const int ob = blockIdx.z;
    const int oc0 = ob * NN_CONV_OCB;
    if (ox >= p->ow || oy >= p->oh)
        return;
    const typename I::T* __restrict__ x = (const typename I::T*)p->x;
    const float* __restrict__ w = (const float*)p->w;
    const int cin_g = p->cin / p->groups;
    const int cout_g = p->cout / p->groups;
    const int kh = p->kh, kw = p->kw;
    const long long plane = (long long)p->h * p->w_in;
    float acc[NN_CONV_OCB];
#pragma unroll
    for (int j = 0; j < NN_CONV_OCB; j++) {
        int oc = oc0 + j;
        acc[j] = (p->b != 0ull && oc < p->cout) ? ((const float*)p->b)[oc] : 0.0f;
    }
    const float* wb = w + (long long)ob * cin_g * kh * kw * NN_CONV_OCB;
    // The group of each output channel (all the same when groups == 1).
    int group_of[NN_CONV_OCB];
    bool same_group = true;
#pragma unroll
    for (int j = 0; j < NN_CONV_OCB; j++) {
        int oc = min(oc0 + j, p->cout - 1);
        group_of[j] = oc / cout_g;
        same_group = same_group && group_of[j] == group_of[0];
    }
    for (int ky = 0; ky < kh; ky++) {
        // coordinate in the Pad's output, then in x (or the fill)
        int py = oy * p->sh - p->conv_pt + ky * p->dh;
        bool zero_y = py < 0 || py >= p->hp;
        int iy = nn_pad_index(py - p->pad_t, p->h, p->pad_mode);
        for (int kx = 0; kx < kw; kx++) {
            int px = ox * p->sw - p->conv_pl + kx * p->dw;
            bool zero = zero_y || px < 0 || px >= p->wp;
            int ix = nn_pad_index(px - p->pad_l, p->w_in, p->pad_mode);
            bool fill = !zero && (iy < 0 || ix < 0);
            float fill_value = zero ? 0.0f : p->pad_value;
            long long pix = (long long)iy * p->w_in + ix;
            const float* wt = wb + (ky * kw + kx) * NN_CONV_OCB;
            const int wstep = kh * kw * NN_CONV_OCB;
            if (same_group) {
                const long long base = (long long)group_of[0] * cin_g * plane + pix;
                for (int ic = 0; ic < cin_g; ic++) {
                    float v = (zero || fill) ? fill_value : I::load(x, base + ic * plane);
                    const float4 w0 = *(const float4*)(wt + ic * wstep);
                    const float4 w1 = *(const float4*)(wt + ic * wstep + 4);
                    acc[0] += v * w0.x;
                    acc[1] += v * w0.y;
                    acc[2] += v * w0.z;
                    acc[3] += v * w0.w;
                    acc[4] += v * w1.x;
                    acc[5] += v * w1.y;
                    acc[6] += v * w1.z;
                    acc[7] += v * w1.w;
                }
            } else {
#pragma unroll
                for (int j = 0; j < NN_CONV_OCB; j++) {
                    const long long base = (long long)group_of[j] * cin_g * plane + pix;
                    for (int ic = 0; ic < cin_g; ic++) {
                        float v = (zero || fill) ? fill_value : I::load(x, base + ic * plane);
                        acc[j] += v * wt[ic * wstep + j];
                    }
                }
            }
        }
    }
    typename O::T* __restrict__ y = (typename O::T*)p->y;
    const long long oplane = (long long)p->oh * p->ow;
    const long long opix = (long long)oy * p->ow + ox;
#pragma unroll
    for (int j = 0; j < NN_CONV_OCB; j++) {
        int oc = oc0 + j;
        if (oc < p->cout)
            O::store(y, oc * oplane + opix, nn_activate(acc[j], p->act, p->act_a, p->act_b));
    }
}

// Tensor-core convolution (sm_80+): implicit GEMM with mma.sync m16n8k16 (f16 x f16 -> f32).
// M = output pixels, N = output channels, K = taps x input channels in chunks of 16.
// One block: NN_TC_ROWS output rows x NN_TC_COLS pixels (one row per warp, two 16-pixel
// m-tiles) x NT*8 channels (NT = 1, 2, 4, 8: no accumulators for channels a layer lacks). Per
// 16-channel chunk the block gathers its input tile (with the halo the taps need) from the
// input (NCHW planes, any strides, or channels-last: GATHER below) into dynamic shared memory (sized by the host to the tile, so small tiles let more
// blocks share an SM) as [row][col][NN_TC_PIX halves]: the 16 channels of a pixel contiguous
// (padded to 48 bytes so the eight rows of an ldmatrix hit distinct banks). Where each tile
// pixel comes from (the Pad and the convolution's zero padding applied) is worked out once per
// block into a table after the tile, so the gather of every chunk is loads and stores only.
// Each tap's A fragment is then one ldmatrix.x4 (16 pixels x 16 channels at the tap's offset,
// any stride or dilation); B fragments are one coalesced 64-bit load per lane from weights the
// host laid out in fragment order [tap][chunk][n tile][lane][4 halves], the next tap's loaded
// while this tap's products run (the loop is latency-bound).
#define NN_TC_PIX 24

__device__ __forceinline__ unsigned int nn_smem_addr(const void* p)
{
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ unsigned int nn_pack2(unsigned short lo, unsigned short hi)
{
    return (unsigned int)lo | ((unsigned int)hi << 16);
}

// Table entry of a tile pixel: (iy, ix) of its source value, or x = -1 for the convolution's
// zero padding and x = -2 for the Pad's constant fill.
__device__ __forceinline__ int2 nn_tc_source(const NnConv* __restrict__ p, int py, int px)
{
    if (py < 0 || py >= p->hp || px < 0 || px >= p->wp)
        return make_int2(-1, 0);
    const int iy = nn_pad_index(py - p->pad_t, p->h, p->pad_mode);
    const int ix = nn_pad_index(px - p->pad_l, p->w_in, p->pad_mode);
    return (iy >= 0 && ix >= 0) ? make_int2(iy, ix) : make_int2(-2, 0);
}

// One axis of nn_tc_source: the source index of padded-input coordinate i (the convolution's
// padded extent n_conv, the Pad's begin pad and the input's extent n), -1 outside n_conv (the
// convolution's zero padding), -2 for the Pad's constant fill.
__device__ __forceinline__ int nn_tc_axis_source(int i, int n_conv, int pad, int n, int mode)
{
    if (i < 0 || i >= n_conv)
        return -1;
    const int s = nn_pad_index(i - pad, n, mode);
    return s >= 0 ? s : -2;
}

// A tile pixel's table entry (as nn_tc_source) from its row's and its column's axis sources.
__device__ __forceinline__ int2 nn_tc_combine(int iy, int ix)
{
    if (iy == -1 || ix == -1)
        return make_int2(-1, 0);
    return (iy < 0 || ix < 0) ? make_int2(-2, 0) : make_int2(iy, ix);
}

// Eight fp16 values (one 16-byte load) as floats.
__device__ __forceinline__ void nn_unpack8(uint4 q, float f[8])
{
    const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = half_bits_to_float((unsigned short)(w[i] & 0xffffu));
        f[2 * i + 1] = half_bits_to_float((unsigned short)(w[i] >> 16));
    }
}

// Eight floats rounded to fp16 for one 16-byte store (nn_unpack8's inverse).
__device__ __forceinline__ uint4 nn_pack8(const float f[8])
{
    uint4 q;
    q.x = nn_pack2(float_to_half_bits(f[0]), float_to_half_bits(f[1]));
    q.y = nn_pack2(float_to_half_bits(f[2]), float_to_half_bits(f[3]));
    q.z = nn_pack2(float_to_half_bits(f[4]), float_to_half_bits(f[5]));
    q.w = nn_pack2(float_to_half_bits(f[6]), float_to_half_bits(f[7]));
    return q;
}

// A resized pixel's 16 channels (chunk) from its four taps' 32-byte source pixels, packed in
// pairs and rounded to fp16 as the Resize's own output would be: load(o, half8) gives the 8
// channels half8 of the source pixel at pixel offset o (the row-1 taps only when wy1 != 0).
template <typename Load>
__device__ __forceinline__ void nn_blend_pixel(const NnBilinear& tp, unsigned int v[8], Load load)
{
#pragma unroll
    for (int half8 = 0; half8 < 2; half8++) {
        float a0[8], a1[8], b0[8], b1[8];
        nn_unpack8(load(tp.o00, half8), a0);
        nn_unpack8(load(tp.o01, half8), a1);
        if (tp.wy1 != 0.0f) {
            nn_unpack8(load(tp.o10, half8), b0);
            nn_unpack8(load(tp.o11, half8), b1);
        } else {
#pragma unroll
            for (int c = 0; c < 8; c++)
                b0[c] = b1[c] = 0.0f;
        }
#pragma unroll
        for (int c2 = 0; c2 < 4; c2++) {
            const int c = 2 * c2;
            v[half8 * 4 + c2] = nn_pack2(float_to_half_bits(nn_blend(a0[c], a1[c], b0[c], b1[c], tp)),
                                         float_to_half_bits(nn_blend(a0[c + 1], a1[c + 1], b0[c + 1], b1[c + 1], tp)));
        }
    }
}

// Channels-last fp16 input (the producer was a tensor-core convolution; the host makes a value
// channels-last only with a multiple of 16 channels): a chunk of 16 channels of one pixel is
// 32 contiguous, aligned bytes, two 16-byte loads (direct) or two per tap (a folded Resize).
// A folded Resize's taps for the pixel are its row's (ty) and column's (tx) entries of the tap
// tables (4 ints each, as nn_taps reads them), loaded by the caller as one 16-byte value each
// (from global memory, or a fixed shape's copy in shared memory).
__device__ __forceinline__ void nn_tc_fetch_nhwc(const NnConv* __restrict__ p, int kc, int2 at,
                                                 unsigned int v[8], int4 ty, int4 tx)
{
    const unsigned short* __restrict__ x = (const unsigned short*)p->x + kc * 16;
    if (!p->rs_taps) {
        const uint4* src = (const uint4*)(x + (long long)at.x * p->x_rs + (long long)at.y * p->x_ps);
        const uint4 q0 = __ldg(src), q1 = __ldg(src + 1);
        v[0] = q0.x; v[1] = q0.y; v[2] = q0.z; v[3] = q0.w;
        v[4] = q1.x; v[5] = q1.y; v[6] = q1.z; v[7] = q1.w;
        return;
    }
    // the tap tables hold element offsets of a plane of rs_w; here they are pixel offsets
    const int tyv[4] = {ty.x, ty.y, ty.z, ty.w}, txv[4] = {tx.x, tx.y, tx.z, tx.w};
    const long long ps = p->x_ps;
    nn_blend_pixel(nn_taps(tyv, txv, p->rs_w), v,
                   [&](long long o, int half8) { return __ldg((const uint4*)(x + o * ps) + half8); });
}

// The same from a block's staged patch of the Resize's input (`nn_tc_stage_patch`): pw pixels
// a row from source row r0 and column c0, 32 bytes (the chunk's 16 channels) a pixel.
__device__ __forceinline__ void nn_tc_fetch_patch(const uint4* patch, int pw, int r0, int c0,
                                                  unsigned int v[8], int4 ty, int4 tx)
{
    const int tyv[4] = {ty.x - r0, ty.y - r0, ty.z, ty.w}, txv[4] = {tx.x - c0, tx.y - c0, tx.z, tx.w};
    nn_blend_pixel(nn_taps(tyv, txv, pw), v, [&](long long o, int half8) { return patch[2 * o + half8]; });
}

// The 16 channels of chunk kc of one tile pixel (source `at`, inside the input), packed in
// pairs: read through a folded Resize's taps (rounded to fp16 as the Resize's own output
// would be), from the fp32 input (its layout Transpose folded; rounded to fp16 as the
// Transpose's output would be) or from the fp16 input.
// `lo`: an fp32 input split in two (x_f32 == 2) gives its low half, x - fp16(x) in fp16, for
// the second pass over the chunks; otherwise the value rounded to fp16
__device__ __forceinline__ void nn_tc_fetch(const NnConv* __restrict__ p, int kc, int2 at,
                                            unsigned int v[8], bool lo = false)
{
    const int cin = p->cin;
    unsigned short h[16];
    if (p->rs_taps) {
        // (element offsets of a plane of rs_w: pixel offsets, scaled by x_ps when channels-last)
        NnBilinear tp = nn_taps((const int*)p->rs_taps + 4 * at.x,
                                (const int*)p->rs_taps + 4 * (p->h + at.y), p->rs_w);
        tp.o00 *= p->x_ps;
        tp.o01 *= p->x_ps;
        tp.o10 *= p->x_ps;
        tp.o11 *= p->x_ps;
#pragma unroll 4
        for (int c = 0; c < 16; c++) {
            const int ic = kc * 16 + c;
            h[c] = ic < cin ? float_to_half_bits(nn_resize_value(p->x, 1, (long long)ic * p->x_cs, tp)) : (unsigned short)0;
        }
    } else {
        const long long off = (long long)at.x * p->x_rs + (long long)at.y * p->x_ps;
        if (p->x_f32) {
            const float* __restrict__ xf = (const float*)p->x + off;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                const int ic = kc * 16 + c;
                const float f = ic < cin ? __ldg(xf + (long long)ic * p->x_cs) : 0.0f;
                const unsigned short hi = float_to_half_bits(f);
                h[c] = lo ? float_to_half_bits(f - half_bits_to_float(hi)) : hi;
            }
        } else {
            const unsigned short* __restrict__ x = (const unsigned short*)p->x + off;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                const int ic = kc * 16 + c;
                h[c] = ic < cin ? __ldg(x + (long long)ic * p->x_cs) : (unsigned short)0;
            }
        }
    }
#pragma unroll
    for (int c2 = 0; c2 < 8; c2++)
        v[c2] = nn_pack2(h[2 * c2], h[2 * c2 + 1]);
}

// Tap-packed gather (a layer of few input channels, e.g. the 3-channel stem; one K chunk): tile
// pixel t holds `pack` horizontal taps side by side, each in a slot of 4 or 8 halves (its cin
// channels, then zeros; program::tap_slot): the table's pixel t + j * dw in slot j, the slots
// past pack zero. First each table pixel is read once and staged as one slot word (8 or 16
// bytes), then each tile pixel assembles its chunk from pack staged words: two 16-byte stores
// a tile pixel, no scattered 2-byte ones.
// A staged table pixel's NC channel values (cin of them, then zeros) as fp16 bits: read from
// the input at `at` (fp32 or fp16), or the zero padding (x -1) or the Pad's fill (x -2).
template <int NC>
__device__ __forceinline__ void nn_tc_stage_values(const void* __restrict__ x, bool x_f32, long long off,
                                                   long long x_cs, int2 at, int cin, unsigned short fill_bits,
                                                   unsigned short (&h)[NC])
{
    if (at.x >= 0) {
        // every channel's load issued before any is used
#pragma unroll
        for (int c = 0; c < NC; c++)
            h[c] = c >= cin  ? (unsigned short)0
                   : x_f32 ? float_to_half_bits(__ldg((const float*)x + off + c * x_cs))
                           : __ldg((const unsigned short*)x + off + c * x_cs);
    } else {
        const unsigned short v = at.x == -1 ? (unsigned short)0 : fill_bits;
#pragma unroll
        for (int c = 0; c < NC; c++)
            h[c] = c < cin ? v : (unsigned short)0;
    }
}

__device__ __forceinline__ void nn_tc_gather_packed(const NnConv* __restrict__ p, const int2* source,
                                                    const int* axis_source, unsigned short* tile,
                                                    int rows, int cols, int scols,
                                                    unsigned short fill_bits)
{
    const int cin = p->cin, pack = p->pack;
    const bool wide = cin > 4; // slots of 8 halves, else 4
    // the staging after the table, 16-byte aligned
    unsigned short* staged = (unsigned short*)(source + ((rows * scols + 1) & ~1));
    // the input's layout read once (the loop below would otherwise read it again a channel)
    const void* __restrict__ x = (const void*)p->x;
    const bool x_f32 = p->x_f32;
    const long long x_rs = p->x_rs, x_ps = p->x_ps, x_cs = p->x_cs;
    // the network's input straight from the frame's NV12 planes (NnConv::frame; 3 channels,
    // so the narrow slots): the value nf_nv12_to_tensor would have stored in fp16
    const NfFrame* __restrict__ frame = (const NfFrame*)p->frame;
    NfRgbConstants k = {};
    int scaled_w = 0, scaled_h = 0;
    if (frame) {
        k = nf_rgb_constants(frame);
        scaled_w = frame->scaled_w;
        scaled_h = frame->scaled_h;
    }
    for (int se = threadIdx.x; se < rows * scols; se += blockDim.x) {
        // a fixed shape's separable table (nn_tc_axis_source), else the full one
        const int2 at = axis_source ? nn_tc_combine(axis_source[se / scols], axis_source[rows + se % scols])
                                    : source[se];
        const long long off = (long long)at.x * x_rs + (long long)at.y * x_ps;
        if (frame) {
            unsigned short h[4] = {0, 0, 0, 0};
            if (at.x >= 0) {
                // the input's reflect padding to the network's size, as the conversion pads
                float rgb[3];
                nf_pixel_rgb(k, nf_reflect(at.y, scaled_w), nf_reflect(at.x, scaled_h), rgb);
#pragma unroll
                for (int c = 0; c < 3; c++)
                    h[c] = float_to_half_bits(nf_input_value(k, rgb[c]));
            } else if (at.x != -1) { // the Pad's fill (-1: zero padding)
                h[0] = h[1] = h[2] = fill_bits;
            }
            *(uint2*)(staged + se * 4) = make_uint2(nn_pack2(h[0], h[1]), nn_pack2(h[2], h[3]));
        } else if (wide) {
            unsigned short h[8];
            nn_tc_stage_values<8>(x, x_f32, off, x_cs, at, cin, fill_bits, h);
            *(uint4*)(staged + se * 8) = make_uint4(nn_pack2(h[0], h[1]), nn_pack2(h[2], h[3]),
                                                    nn_pack2(h[4], h[5]), nn_pack2(h[6], h[7]));
        } else {
            unsigned short h[4];
            nn_tc_stage_values<4>(x, x_f32, off, x_cs, at, cin, fill_bits, h);
            *(uint2*)(staged + se * 4) = make_uint2(nn_pack2(h[0], h[1]), nn_pack2(h[2], h[3]));
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
        const int r = e / cols, tc = e - r * cols;
        const int base = r * scols + tc;
        unsigned int v[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (wide) {
#pragma unroll
            for (int j = 0; j < 2; j++)
                if (j < pack) {
                    const uint4 q = *(const uint4*)(staged + (base + j * p->dw) * 8);
                    v[4 * j] = q.x;
                    v[4 * j + 1] = q.y;
                    v[4 * j + 2] = q.z;
                    v[4 * j + 3] = q.w;
                }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j < pack) {
                    const uint2 q = *(const uint2*)(staged + (base + j * p->dw) * 4);
                    v[2 * j] = q.x;
                    v[2 * j + 1] = q.y;
                }
        }
        uint4* dst = (uint4*)(tile + e * NN_TC_PIX);
        dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
        dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
    }
}

#define NN_GATHER_PLANAR 0
#define NN_GATHER_CHANNELS_LAST 1
#define NN_GATHER_TAP_PACKED 2
// Channels-last, with the horizontal taps paired in N (a 7x7 layer of stride 1 and at most 4
// output channels, e.g. the 16 -> 3 output convolution; NnFixedShape below): virtual tap g of
// row ky multiplies the pixel at p + 2g by w[ky][2g] in columns 0-3 (toward output p) and by
// w[ky][2g + 1] in columns 4-7
// (toward output p - 1), so output q = E[q] + O[q + 1] from half the A fragments. A warp's 32
// A rows then give 31 outputs (NN_TC_COLS - 1 a block row).
#define NN_GATHER_CL_PAIRED 3
// Channels-last, a 3x3 convolution of stride 1 and dilation 1 (most of these networks' layers):
// the tile's shape is known at compile time, the tap loop unrolls with every shared-memory offset
// an immediate, and a chunk's B fragments for the block's channel tiles are staged in shared
// memory once (after the source table) instead of each warp reading them through 64-bit
// address arithmetic a tap.
#define NN_GATHER_CL_3X3 4
// Tap-packed, a 7x7 convolution of stride 1 and dilation 1 over at most 4 channels (the stem):
// 4 taps a virtual tap in slots of 4 halves, so 2 virtual taps a row, 4 pixels apart; the shape
// compiled in as for NN_GATHER_CL_3X3.
#define NN_GATHER_TP_7X7 5
// Channels-last, a 3x3 convolution of stride 2 and dilation 1 (the downsampling layers), fixed
// as NN_GATHER_CL_3X3.
#define NN_GATHER_CL_3X3_S2 6
// NN_GATHER_CL_3X3 through a folded Resize whose source patch the block stages a chunk at a
// time (NnConv::rs_patch): a separate kernel, so that the 3x3 layers without a Resize keep
// their registers.
#define NN_GATHER_CL_3X3_RS 7
// A stride-1 1x1 over a channels-last input, double-buffered (NnConv::stages == 2): the fixed
// shapes' staging, so that each chunk's B fragments arrive with its tile by cp.async instead of
// one exposed global load a chunk (the general gather's single tap has nothing to overlap it)
#define NN_GATHER_CL_1X1 8

// The affine part of an elementwise chain (defined with nn_eltwise below): a folded prologue
// chain (NnConv::pre) takes each gathered value through it.
__device__ __forceinline__ void nn_affine_coefficients(const NnEltwise& s, int i0, int i1, int i2,
                                                       int i3, float& ca_out, float& cb_out);

// One value through a folded chain: its affine part, then its tail, which the host allows to be
// nothing, Relu or LeakyRelu: a slope for negative values (1, 0 or alpha; Relu gives +0).
__device__ __forceinline__ float nn_pre_value(float ca, float cb, float slope, float x)
{
    const float v = ca * x + cb;
    return v < 0.0f ? (slope == 0.0f ? 0.0f : slope * v) : v;
}

// A gathered chunk (16 fp16 channels of one pixel, packed in pairs) through the folded chain:
// channel c's coefficients at coef[c] and coef[NN_PRE_MAX + c], rounded to fp16 after, as the
// chain's own fp16 output would be.
__device__ __forceinline__ void nn_tc_pre_apply(const float* coef, float slope, unsigned int v[8])
{
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float lo = nn_pre_value(coef[2 * k], coef[NN_PRE_MAX + 2 * k], slope,
                                      half_bits_to_float((unsigned short)(v[k] & 0xffffu)));
        const float hi = nn_pre_value(coef[2 * k + 1], coef[NN_PRE_MAX + 2 * k + 1], slope,
                                      half_bits_to_float((unsigned short)(v[k] >> 16)));
        v[k] = nn_pack2(float_to_half_bits(lo), float_to_half_bits(hi));
    }
}

// The shape a kernel has compiled in (the host launches it only for that shape): kernel rows,
// virtual taps a row, their spacing in pixels, taps packed a virtual tap, the stride (both
// axes); kh 0: read from p.
// A fixed-shape block stages its chunk's B fragments in shared memory before the tile, reads
// them with immediate offsets from an unrolled tap loop, and builds a separable source table.
template <int KH, int KW_V, int DW_V, int PACK, int S>
struct NnShape {
    static constexpr int kh = KH, kw_v = KW_V, dw_v = DW_V, pack = PACK, s = S;
};
template <int GATHER>
struct NnFixedShape : NnShape<0, 0, 0, 0, 0> {};
template <>
struct NnFixedShape<NN_GATHER_CL_3X3> : NnShape<3, 3, 1, 1, 1> {};
template <>
struct NnFixedShape<NN_GATHER_CL_3X3_S2> : NnShape<3, 3, 1, 1, 2> {};
template <>
struct NnFixedShape<NN_GATHER_CL_3X3_RS> : NnShape<3, 3, 1, 1, 1> {};
template <>
struct NnFixedShape<NN_GATHER_CL_1X1> : NnShape<1, 1, 1, 1, 1> {};
// the paired output convolution is 7x7: 4 virtual taps a row, 2 pixels apart
template <>
struct NnFixedShape<NN_GATHER_CL_PAIRED> : NnShape<7, 4, 2, 1, 1> {};
template <>
struct NnFixedShape<NN_GATHER_TP_7X7> : NnShape<7, 2, 4, 4, 1> {};

// Registers per thread: the one- and two-tile variants (the full-resolution 16-channel layers,
// latency-bound on their gathers) are held to 64 so that eight blocks share a multiprocessor.
#define NN_TC_BOUNDS(NT) __launch_bounds__(32 * NN_TC_ROWS, (NT) <= 2 ? 8 : 1)
// The 7x7 kernels run NN_TC_ROWS or NN_TC_TALL_ROWS warps a block, held to the same registers.
#define NN_TC_TALL_BOUNDS(NT) __launch_bounds__(32 * NN_TC_TALL_ROWS, (NT) <= 2 ? 8 * NN_TC_ROWS / NN_TC_TALL_ROWS : 1)
// The stem's warps hold NN_TC_STEM_ROWS rows of accumulators: at one or two tiles three blocks
// a multiprocessor (at two its tile's shared memory allows no more), 85 registers, no spills; at four
// two blocks (ptxas, sm_90: 128 registers and 24 bytes of spill; unbounded, 148 registers left
// one block a multiprocessor, and hayao_class ran 5 % slower at 1080p on an H100)
#define NN_TC_STEM_BOUNDS(NT) __launch_bounds__(32 * NN_TC_TALL_ROWS, (NT) <= 2 ? 3 : 2)

// One 16-byte cp.async (global -> shared, cached in L2 only: a tile pixel is read again by the
// neighbouring blocks, not by this one).
__device__ __forceinline__ void nn_cp_async16(void* dst, const void* src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(nn_smem_addr(dst)), "l"(src) : "memory");
}

// A double-buffered block's copies of chunk kc (NnConv::stages): its tile pixels (source_of(e):
// tile pixel e's table entry) from the channels-last input (two 16-byte copies a pixel; the
// Pad's fill and the zero padding stored directly), then, for a fixed shape, its B fragments
// as the single-buffered path stages them; one cp.async group.
template <typename F, int NT, typename Source>
__device__ __forceinline__ void nn_tc_issue_chunk(const NnConv* __restrict__ p, int kc, unsigned short* b_stage,
                                                  unsigned short* tile, Source source_of, int npx, int ntn,
                                                  int nt0, int chunks)
{
    const unsigned short* __restrict__ x = (const unsigned short*)p->x + kc * 16;
    const unsigned short fill_bits = float_to_half_bits(p->pad_value);
    for (int e = threadIdx.x; e < npx; e += blockDim.x) {
        const int2 at = source_of(e);
        uint4* dst = (uint4*)(tile + e * NN_TC_PIX);
        if (at.x >= 0) {
            const uint4* src = (const uint4*)(x + (long long)at.x * p->x_rs + (long long)at.y * p->x_ps);
            nn_cp_async16(dst, src);
            nn_cp_async16(dst + 1, src + 1);
        } else {
            // (channels-last inputs have a multiple of 16 channels: every channel is real)
            const unsigned int f = at.x == -1 ? 0u : nn_pack2(fill_bits, fill_bits);
            dst[0] = dst[1] = make_uint4(f, f, f, f);
        }
    }
    const uint2* __restrict__ wf = (const uint2*)p->wh;
    uint4* staged_b = (uint4*)b_stage;
    for (int i = threadIdx.x; i < F::kh * F::kw_v * NT * 16; i += blockDim.x) {
        const int tap = i / (NT * 16), w = i % (NT * 16);
        const uint4* run = (const uint4*)(wf + ((long long)(tap * chunks + kc) * p->n_tiles + nt0) * 32);
        if (w < ntn * 16)
            nn_cp_async16(staged_b + i, run + w);
        else
            staged_b[i] = make_uint4(0, 0, 0, 0);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// A fixed-shape block's products for one chunk: the unrolled tap loop over its tile (this
// lane's ldmatrix address lane_addr) and its staged B fragments (this lane's at staged_b), for
// a warp of RPW consecutive output rows (more than one: stride 1 only). Each tile row's A
// fragments are loaded once and multiplied into every output row it reaches (tile row r
// feeds row w through kernel row r - w); a row's products run in tap order whatever RPW is,
// so its sums are the same.
template <typename F, int NT, int RPW>
__device__ __forceinline__ void nn_tc_taps_rows(unsigned int lane_addr, int cols, const uint2* staged_b,
                                                float (&acc)[RPW][2][NT][4])
{
    static_assert(RPW == 1 || F::s == 1, "rows of a stride-1 shape");
#pragma unroll
    for (int r = 0; r < F::kh + RPW - 1; r++) {
#pragma unroll
        for (int kx = 0; kx < F::kw_v; kx++) {
            const unsigned int addr = lane_addr + (r * cols + kx * F::dw_v) * NN_TC_PIX * 2;
            unsigned int a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++)
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a[m][0]), "=r"(a[m][1]), "=r"(a[m][2]), "=r"(a[m][3])
                             : "r"(addr + m * 16 * F::s * NN_TC_PIX * 2));
#pragma unroll
            for (int w = 0; w < RPW; w++) {
                const int ky = r - w;
                if (ky < 0 || ky >= F::kh)
                    continue;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    const uint2 b = staged_b[((ky * F::kw_v + kx) * NT + n) * 32];
#pragma unroll
                    for (int m = 0; m < 2; m++)
                        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                            : "+f"(acc[w][m][n][0]), "+f"(acc[w][m][n][1]), "+f"(acc[w][m][n][2]),
                              "+f"(acc[w][m][n][3])
                            : "r"(a[m][0]), "r"(a[m][1]), "r"(a[m][2]), "r"(a[m][3]), "r"(b.x), "r"(b.y));
                }
            }
        }
    }
}

// The general gather's products for one chunk: the taps in one flat loop over the tile (this
// lane's ldmatrix address addr), the next tap's B fragments (this lane's from wt, tap_step
// apart) loaded while this tap's A fragments and products are in flight (the loop is
// latency-bound).
template <int NT>
__device__ __forceinline__ void nn_tc_taps_general(unsigned int addr, const uint2* __restrict__ wt, int taps,
                                                   int kw_v, unsigned int m_step, unsigned int kx_step,
                                                   unsigned int ky_step, long long tap_step, int ntn,
                                                   float (&acc)[2][NT][4])
{
    uint2 b[NT];
#pragma unroll
    for (int n = 0; n < NT; n++)
        b[n] = n < ntn ? __ldg(wt + n * 32) : make_uint2(0, 0);
    unsigned int row_addr = addr;
    for (int tap = 0, kx = 0; tap < taps; tap++) {
        unsigned int a[2][4];
#pragma unroll
        for (int m = 0; m < 2; m++)
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(a[m][0]), "=r"(a[m][1]), "=r"(a[m][2]), "=r"(a[m][3])
                         : "r"(addr + m * m_step));
        uint2 next[NT];
        wt += tap_step;
#pragma unroll
        for (int n = 0; n < NT; n++)
            next[n] = (n < ntn && tap + 1 < taps) ? __ldg(wt + n * 32) : make_uint2(0, 0);
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
                if (n < ntn)
                    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(acc[m][n][0]), "+f"(acc[m][n][1]), "+f"(acc[m][n][2]), "+f"(acc[m][n][3])
                        : "r"(a[m][0]), "r"(a[m][1]), "r"(a[m][2]), "r"(a[m][3]), "r"(b[n].x), "r"(b[n].y));
#pragma unroll
        for (int n = 0; n < NT; n++)
            b[n] = next[n];
        if (++kx == kw_v) {
            kx = 0;
            row_addr += ky_step;
            addr = row_addr;
        } else {
            addr += kx_step;
        }
    }
}

// RES_PAIRS: the host launches it only with a folded fp16 residual Add into a channels-last
// fp16 output of even channels, whose epilogue reads and writes channel pairs (a kernel of its
// own: the branch in the shared epilogue cost the other layers 10-20 %)
template <typename O, int NT, int GATHER, bool RES_PAIRS = false>
__device__ __forceinline__ void nn_conv_mma_body(const NnConv* __restrict__ p)
{
#if __CUDA_ARCH__ >= 800
    typedef NnFixedShape<GATHER> F;
    constexpr bool fixed = F::kh > 0;
    constexpr bool packed = GATHER == NN_GATHER_TAP_PACKED || GATHER == NN_GATHER_TP_7X7;
    // the 7x7 kernels take their block's output rows from the launch (a warp a row: the host's
    // tall blocks, NN_TC_TALL_ROWS, share each tile row's gather among more outputs); the
    // others compile NN_TC_ROWS in
    // (and the eight-tile fixed 3x3, which the host's Fusions::tall_3x3 launches with
    // NN_TC_TALL_ROWS warps, so that a chunk's B fragments and the tile's two halo rows serve eight
    // rows, not four; the narrower 3x3 kernels keep their rows compiled in: the real tiny's
    // layers, which a runtime row count might slow)
    constexpr bool tall = GATHER == NN_GATHER_TP_7X7 || GATHER == NN_GATHER_CL_PAIRED ||
                          (GATHER == NN_GATHER_CL_3X3 && NT == 8);
    // output rows a warp: the paired output convolution's warps take NN_TC_PAIRED_ROWS
    // consecutive rows and the stem's NN_TC_STEM_ROWS, so that each tile row's A fragments
    // serve all of them (nn_tc_taps_rows); the host launches (rows / RPW) warps
    constexpr int RPW = GATHER == NN_GATHER_CL_PAIRED ? NN_TC_PAIRED_ROWS
                        : GATHER == NN_GATHER_TP_7X7  ? NN_TC_STEM_ROWS
                                                      : 1;
    const int block_rows = (tall ? (int)(blockDim.x >> 5) : NN_TC_ROWS) * RPW;
    // the gathers that read channels-last inputs (nn_tc_fetch_nhwc)
    constexpr bool cl_gather = GATHER == NN_GATHER_CHANNELS_LAST || (fixed && !packed);
    constexpr bool staged_resize = GATHER == NN_GATHER_CL_3X3_RS;
    // a double-buffered block (NnConv::stages, the host sets it only for a direct channels-last
    // gather, fixed 3x3, fixed 1x1 or general): chunk kc + 1's tile (and a fixed shape's B
    // fragments) are copied with cp.async while chunk kc's products run; [B 0][B 1][tile 0]
    // [tile 1], then the table
    const bool piped =
        (GATHER == NN_GATHER_CL_3X3 || GATHER == NN_GATHER_CL_1X1 || GATHER == NN_GATHER_CHANNELS_LAST) && p->stages == 2;
    // a staged Resize patch double-buffered (NnConv::stages): chunk kc + 1's patch and B
    // fragments copied while chunk kc is blended into the (single) tile and multiplied;
    // [B 0][B 1][tile], the table, then [patch 0][patch 1]
    const bool two_b = (GATHER == NN_GATHER_CL_3X3 || GATHER == NN_GATHER_CL_1X1 || staged_resize) && p->stages == 2;
    // fixed shape: [tap][n][lane] B fragments (256 bytes a tap and tile), then the tile
    constexpr int b_halves = fixed ? F::kh * F::kw_v * NT * 128 : 0;
    extern __shared__ __align__(16) unsigned short smem[];
    unsigned short* tile = smem + (two_b ? 2 : 1) * b_halves;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const bool paired = GATHER == NN_GATHER_CL_PAIRED;
    const int oy0 = p->row0 + blockIdx.y * block_rows;
    const int ox0 = blockIdx.x * (paired ? NN_TC_COLS - 1 : NN_TC_COLS);
    const int nt0 = blockIdx.z * NT;
    const int ntn = min(NT, p->n_tiles - nt0);
    const int cin = p->cin, chunks = p->cin_pad >> 4;
    // the tile: the padded-input rows and columns the block's outputs read
    // tap-packed: kw_v virtual taps of `pack` real ones each, dw_v apart; the table reaches
    // pack - 1 taps further right than the tile
    // paired: kw_v virtual taps two real ones apart; the table is the tile
    const int pack = fixed ? F::pack : GATHER == NN_GATHER_TAP_PACKED ? p->pack : 1;
    const int kw_v = fixed ? F::kw_v : (p->kw + pack - 1) / pack;
    const int dw_v = fixed ? F::dw_v : p->dw * pack;
    const int rows = fixed ? (block_rows - 1) * F::s + F::kh : (block_rows - 1) * p->sh + (p->kh - 1) * p->dh + 1;
    const int cols = fixed ? (NN_TC_COLS - 1) * F::s + (F::kw_v - 1) * F::dw_v + 1
                           : (NN_TC_COLS - 1) * p->sw + (kw_v - 1) * dw_v + 1;
    const int scols = paired ? cols : cols + (pack - 1) * (fixed ? 1 : p->dw);
    const int npx = rows * cols;
    const int py0 = oy0 * p->sh - p->conv_pt, px0 = ox0 * p->sw - p->conv_pl;
    const uint2* __restrict__ wf = (const uint2*)p->wh;
    const unsigned short fill_bits = float_to_half_bits(p->pad_value);
    // the pixel table (rows x scols) sits after the tile (npx * 48 bytes, a multiple of 16)
    int2* source = (int2*)(tile + (piped ? 2 : 1) * npx * NN_TC_PIX);
    // fixed shape: a tile pixel's source is its row's and its column's (nn_tc_axis_source), so
    // the table holds rows + scols entries, not rows x scols
    // and, with a folded Resize, each entry's 4 ints of the tap tables after them (16-byte
    // aligned), so that a tile pixel reads its taps from shared memory
    int* axis_source = (int*)source;
    int4* axis_taps = (int4*)source + (rows + scols + 3) / 4;
    const int* rs_taps = (const int*)p->rs_taps;
    for (int e = threadIdx.x; fixed && e < rows + scols; e += blockDim.x) {
        const int a = e < rows ? nn_tc_axis_source(py0 + e, p->hp, p->pad_t, p->h, p->pad_mode)
                               : nn_tc_axis_source(px0 + e - rows, p->wp, p->pad_l, p->w_in, p->pad_mode);
        axis_source[e] = a;
        if (rs_taps && a >= 0)
            axis_taps[e] = *(const int4*)(rs_taps + 4 * (e < rows ? a : p->h + a));
    }
    for (int e = threadIdx.x; !fixed && e < rows * scols; e += blockDim.x) {
        const int r = e / scols;
        source[e] = nn_tc_source(p, py0 + r, px0 + (e - r * scols));
    }
    // a folded prologue chain (channels-last gathers, cin <= NN_PRE_MAX): every channel's
    // coefficients once a block, after the table (its full or separable size)
    // (never with a staged Resize patch: the patch takes the coefficients' place)
    const NnEltwise* __restrict__ pre = cl_gather && !staged_resize ? (const NnEltwise*)p->pre : nullptr;
    float* pre_coef = (float*)source + (fixed ? 4 * ((rows + scols + 3) / 4 + rows + scols) : 2 * rows * scols);
    float pre_slope = 1.0f;
    if (cl_gather && pre) {
        for (int k = threadIdx.x; k < cin; k += blockDim.x)
            nn_affine_coefficients(*pre, 0, 0, 0, k, pre_coef[k], pre_coef[NN_PRE_MAX + k]);
        const int tail = pre->n_ops > pre->affine_ops ? pre->op_code[pre->affine_ops] : 0;
        pre_slope = tail == NN_EW_RELU ? 0.0f : tail == NN_EW_LEAKY ? pre->op_p0[pre->affine_ops] : 1.0f;
    }
    // a folded Resize's patch (fixed shapes, p->rs_patch pixels reserved after the table, where
    // a prologue chain's coefficients would be: the host folds one or the other): the source
    // rows and columns this block's taps reach, worked out alike by every warp from the axis
    // tables, staged a chunk at a time so that each source pixel is loaded once a chunk, not
    // once for each tile pixel it feeds; a block whose patch does not fit reads through the taps
    uint4* patch = (uint4*)pre_coef;
    int patch_r0 = 0, patch_c0 = 0, patch_w = 0, patch_px = 0;
    if (staged_resize && rs_taps && p->rs_patch > 0) {
        __syncthreads(); // the axis tables are written
        int lo_r = 0x7fffffff, hi_r = -1, lo_c = 0x7fffffff, hi_c = -1;
        for (int e = lane; e < rows + scols; e += 32) {
            if (axis_source[e] < 0)
                continue;
            const int4 tp = axis_taps[e];
            const int lo = min(tp.x, tp.y), hi = max(tp.x, tp.y);
            if (e < rows) {
                lo_r = min(lo_r, lo);
                hi_r = max(hi_r, hi);
            } else {
                lo_c = min(lo_c, lo);
                hi_c = max(hi_c, hi);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            lo_r = min(lo_r, __shfl_xor_sync(0xffffffffu, lo_r, o));
            hi_r = max(hi_r, __shfl_xor_sync(0xffffffffu, hi_r, o));
            lo_c = min(lo_c, __shfl_xor_sync(0xffffffffu, lo_c, o));
            hi_c = max(hi_c, __shfl_xor_sync(0xffffffffu, hi_c, o));
        }
        if (hi_r >= lo_r && hi_c >= lo_c && (hi_r - lo_r + 1) * (hi_c - lo_c + 1) <= p->rs_patch) {
            patch_r0 = lo_r;
            patch_c0 = lo_c;
            patch_w = hi_c - lo_c + 1;
            patch_px = (hi_r - lo_r + 1) * patch_w;
        }
    }
    // acc[r]: the warp's output row r (of RPW)
    float acc[RPW][2][NT][4];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
                acc[r][m][n][0] = acc[r][m][n][1] = acc[r][m][n][2] = acc[r][m][n][3] = 0.0f;
    // this lane's ldmatrix row: pixel (lane & 15) of an m-tile, channels 0-7 or 8-15; the
    // byte steps between taps and m-tiles
    const unsigned int lane_addr =
        nn_smem_addr(tile) +
        (unsigned int)(((warp * RPW * (fixed ? F::s : p->sh) * cols + (lane & 15) * (fixed ? F::s : p->sw)) * NN_TC_PIX + (lane >> 4) * 8) * 2);
    const unsigned int m_step = 16 * p->sw * NN_TC_PIX * 2;
    const unsigned int kx_step = dw_v * NN_TC_PIX * 2;
    const unsigned int ky_step = p->dh * cols * NN_TC_PIX * 2;
    const long long tap_step = (long long)chunks * p->n_tiles * 32;
    const int taps = p->kh * kw_v;
    // tile pixel e's table entry (separable for a fixed shape)
    const auto source_of = [&](int e) {
        return fixed ? nn_tc_combine(axis_source[e / cols], axis_source[rows + e % cols]) : source[e];
    };
    if (piped) {
        __syncthreads(); // the table and the prologue's coefficients are written
        nn_tc_issue_chunk<F, NT>(p, 0, smem, tile, source_of, npx, ntn, nt0, chunks);
    }
    // (every block of a launch agrees on whether its patch fits: patch_px is per block, but a
    // block without one takes the single-buffered path on its own)
    const bool piped_patch = staged_resize && p->stages == 2 && patch_px > 0;
    // chunk kc's patch pixels (two 16-byte copies each) into patch buffer b, then its B
    // fragments into B buffer b, one cp.async group
    const auto issue_patch = [&](int kc, int b) {
        const unsigned short* __restrict__ xs = (const unsigned short*)p->x + kc * 16;
        uint4* dst = patch + b * 2 * p->rs_patch;
        for (int i = threadIdx.x; i < 2 * patch_px; i += blockDim.x) {
            const int px = i >> 1, r = px / patch_w, c = px - r * patch_w;
            const long long pixel = (long long)(patch_r0 + r) * p->rs_w + patch_c0 + c;
            nn_cp_async16(dst + i, (const uint4*)(xs + pixel * p->x_ps) + (i & 1));
        }
        nn_tc_issue_chunk<F, NT>(p, kc, smem + b * b_halves, tile, source_of, 0, ntn, nt0, chunks);
    };
    if (piped_patch)
        issue_patch(0, 0);
    // an fp32 input that fits fp16's range, split in two (NnConv::x_f32 == 2, planar gather
    // only): a second pass over the chunks multiplies each value's low half, x - fp16(x), by
    // the same weights, so the products see x to 22 bits instead of 11
    const int passes = GATHER == NN_GATHER_PLANAR && p->x_f32 == 2 ? 2 : 1;
    // one loop for both ways of filling the tile, so that the tap loops are inlined once
    for (int pc = 0; pc < chunks * passes; pc++) {
        const bool lo = GATHER == NN_GATHER_PLANAR && pc >= chunks;
        const int kc = lo ? pc - chunks : pc;
        const int buf = piped || piped_patch ? kc & 1 : 0;
        if (piped) {
            if (kc + 1 < chunks) {
                __syncthreads(); // chunk kc - 1's products (buffer buf ^ 1) are done
                nn_tc_issue_chunk<F, NT>(p, kc + 1, smem + (buf ^ 1) * b_halves,
                                         tile + (buf ^ 1) * npx * NN_TC_PIX, source_of, npx, ntn, nt0,
                                         chunks);
                asm volatile("cp.async.wait_group 1;\n" ::: "memory");
            } else {
                asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            }
            if (pre) {
                // this thread's own copies have landed: take them through the chain in place
                unsigned short* t = tile + buf * npx * NN_TC_PIX;
                for (int e = threadIdx.x; e < npx; e += blockDim.x) {
                    if (source_of(e).x < 0)
                        continue;
                    uint4* px = (uint4*)(t + e * NN_TC_PIX);
                    const uint4 q0 = px[0], q1 = px[1];
                    unsigned int v[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
                    nn_tc_pre_apply(pre_coef + kc * 16, pre_slope, v);
                    px[0] = make_uint4(v[0], v[1], v[2], v[3]);
                    px[1] = make_uint4(v[4], v[5], v[6], v[7]);
                }
            }
        } else {
            __syncthreads(); // the previous chunk's reads (and the table's writes) are done
            if (packed)
                nn_tc_gather_packed(p, source, fixed ? axis_source : nullptr, tile, rows, cols, scols, fill_bits);
            if (piped_patch) {
                if (kc + 1 < chunks) {
                    issue_patch(kc + 1, buf ^ 1);
                    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
                } else {
                    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
                }
                __syncthreads(); // every thread's copies of chunk kc have landed
            } else if (staged_resize && patch_px) {
                // this chunk's 16 channels of the patch's pixels, two 16-byte loads a pixel
                const unsigned short* __restrict__ xs = (const unsigned short*)p->x + kc * 16;
                for (int i = threadIdx.x; i < 2 * patch_px; i += blockDim.x) {
                    const int px = i >> 1, r = px / patch_w, c = px - r * patch_w;
                    const long long pixel = (long long)(patch_r0 + r) * p->rs_w + patch_c0 + c;
                    patch[i] = __ldg((const uint4*)(xs + pixel * p->x_ps) + (i & 1));
                }
                __syncthreads();
            }
            for (int e = threadIdx.x; !packed && e < npx; e += blockDim.x) {
                unsigned int v[8];
                const int r = fixed ? e / cols : 0, c = fixed ? e % cols : 0;
                const int2 at = fixed ? nn_tc_combine(axis_source[r], axis_source[rows + c]) : source[e];
                if (at.x >= 0) {
                    int4 ty = make_int4(0, 0, 0, 0), tx = ty;
                    if (cl_gather && rs_taps) {
                        ty = fixed ? axis_taps[r] : __ldg((const int4*)rs_taps + at.x);
                        tx = fixed ? axis_taps[rows + c] : __ldg((const int4*)rs_taps + p->h + at.y);
                    }
                    if (cl_gather) {
                        if (staged_resize && patch_px)
                            nn_tc_fetch_patch(patch + buf * 2 * p->rs_patch, patch_w, patch_r0, patch_c0, v,
                                              ty, tx);
                        else
                            nn_tc_fetch_nhwc(p, kc, at, v, ty, tx);
                        if (pre)
                            nn_tc_pre_apply(pre_coef + kc * 16, pre_slope, v);
                    } else
                        nn_tc_fetch(p, kc, at, v, lo);
                } else {
                    const unsigned short fill =
                        at.x == -1 ? (unsigned short)0
                        : lo       ? float_to_half_bits(p->pad_value - half_bits_to_float(fill_bits))
                                   : fill_bits;
#pragma unroll
                    for (int c2 = 0; c2 < 8; c2++) {
                        const int ic = kc * 16 + 2 * c2;
                        v[c2] = nn_pack2(ic < cin ? fill : (unsigned short)0,
                                         ic + 1 < cin ? fill : (unsigned short)0);
                    }
                }
                uint4* dst = (uint4*)(tile + e * NN_TC_PIX);
                dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
                dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
            }
            if (fixed && !piped_patch) {
                // this chunk's B fragments of the block's channel tiles, [tap][n][lane]: per tap
                // one contiguous run of NT x 256 bytes (the weights are 256-byte aligned), copied
                // 16 bytes a thread
                uint4* staged_b = (uint4*)smem;
                for (int i = threadIdx.x; i < F::kh * F::kw_v * NT * 16; i += blockDim.x) {
                    const int tap = i / (NT * 16), w = i % (NT * 16);
                    const uint4* run = (const uint4*)(wf + ((long long)(tap * chunks + kc) * p->n_tiles + nt0) * 32);
                    staged_b[i] = w < ntn * 16 ? __ldg(run + w) : make_uint4(0, 0, 0, 0);
                }
            }
        }
        __syncthreads();
        const unsigned int addr = lane_addr + (piped ? buf : 0) * npx * NN_TC_PIX * 2;
        if (fixed)
            nn_tc_taps_rows<F, NT, RPW>(addr, cols, (const uint2*)(smem + buf * b_halves) + lane, acc);
        else
            nn_tc_taps_general<NT>(addr, wf + ((long long)kc * p->n_tiles + nt0) * 32 + lane, taps, kw_v,
                                   m_step, kx_step, ky_step, tap_step, ntn, acc[0]);
    }
    typename O::T* __restrict__ y = (typename O::T*)p->y;
    const int oy = oy0 + warp * RPW;
    if (oy >= p->oh)
        return;
    // the epilogue's parameters, read once (stores through y would otherwise make the
    // compiler read them again for every value)
    const int cout = p->cout, ow = p->ow, act = p->act, y_round = p->y_round;
    const float act_a = p->act_a, act_b = p->act_b;
    const long long y_cs = p->y_cs, y_ps = p->y_ps;
    const float* __restrict__ bias_of = (const float*)p->b;
    const unsigned long long res = p->res;
    const int res_half = p->res_half;
    // the activation that ends a folded residual Add's stage, applied to the sum
    const int res_act = p->res_act;
    const float res_act_a = p->res_act_a, res_act_b = p->res_act_b;
    // channels-last fp16 output with an even channel count: a lane's two channels of a pixel
    // are adjacent, one 4-byte store
    if (paired) {
        // output q = E[q] (this lane's columns 0-3) + O[q + 1] (columns 4-7 of row q + 1: lane
        // g + 1's, or for row 8 lane 0's upper half, for row 16 the next m-tile's lane 0)
        const int src = (((g + 1) & 7) << 2) | (t | 2);
        const int oc0 = 2 * t;
        const float2 bias = nn_bias_pair(bias_of, oc0, cout);
#pragma unroll
        for (int w = 0; w < RPW; w++) {
            if (oy + w >= p->oh) // (the same for the whole warp)
                return;
            const long long row_w = (long long)(oy + w) * p->y_rs;
            float o[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    o[m][k] = __shfl_sync(0xffffffffu, acc[w][m][0][k], src);
            if (t >= 2 || oc0 >= cout)
                continue;
            float vals[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int r = k >> 1, j = k & 1;
                    const float on = g < 7 ? o[m][k] : r == 0 ? o[m][2 + j] : o[1][j];
                    vals[m][k] = acc[w][m][0][k] + on + (j ? bias.y : bias.x);
                }
            nn_activate_n<8>(&vals[0][0], act, act_a, act_b);
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int q = m * 16 + g + 8 * r;
                    const int ox = ox0 + q;
                    if (q == 31 || ox >= ow) // row 31's O is the next block's
                        continue;
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        if (oc0 + j >= cout)
                            continue;
                        float v = vals[m][2 * r + j];
                        if (y_round)
                            v = half_bits_to_float(float_to_half_bits(v));
                        O::store(y, (long long)(oc0 + j) * y_cs + row_w + (long long)ox * y_ps, v);
                    }
                }
        }
        return;
    }
    const bool pairs = RES_PAIRS || (sizeof(typename O::T) == 2 && y_cs == 1 && !res && (cout & 1) == 0);
#pragma unroll
    for (int w = 0; w < RPW; w++) {
    if (oy + w >= p->oh)
        return;
    const long long row = (long long)(oy + w) * p->y_rs;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        if (n >= ntn)
            continue;
        const int oc0 = (nt0 + n) * 8 + 2 * t;
        if (oc0 >= cout)
            continue;
        const float2 bias = nn_bias_pair(bias_of, oc0, cout);
        // this tile's eight values, activated under one switch (one and two tiles: with more,
        // the compiler keeps every tile's values live at once, 115 -> 145 registers)
        float vals[2][4];
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int k = 0; k < 4; k++)
                vals[m][k] = acc[w][m][n][k] + (k & 1 ? bias.y : bias.x);
        if (NT <= 2)
            nn_activate_n<8>(&vals[0][0], act, act_a, act_b);
#pragma unroll
        for (int m = 0; m < 2; m++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int ox = ox0 + m * 16 + g + 8 * r;
                if (ox >= ow)
                    continue;
                float v[2];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    v[j] = NT <= 2 ? vals[m][2 * r + j] : nn_activate_lean(vals[m][2 * r + j], act, act_a, act_b);
                    if (y_round) // a folded output Transpose or Add after an fp16-stored stage
                        v[j] = half_bits_to_float(float_to_half_bits(v[j]));
                }
                const long long at0 = (long long)oc0 * y_cs + row + (long long)ox * y_ps;
                if (pairs) {
                    if (RES_PAIRS) {
                        // the folded residual Add: this thread alone reads and writes the pair
                        const unsigned int r = __ldg((const unsigned int*)((const unsigned short*)res + at0));
                        v[0] += half_bits_to_float((unsigned short)(r & 0xffffu));
                        v[1] += half_bits_to_float((unsigned short)(r >> 16));
                        if (res_act) {
                            v[0] = nn_activate(v[0], res_act, res_act_a, res_act_b);
                            v[1] = nn_activate(v[1], res_act, res_act_a, res_act_b);
                        }
                    }
                    *(unsigned int*)(y + at0) = nn_pack2(float_to_half_bits(v[0]), float_to_half_bits(v[1]));
                    continue;
                }
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    if (oc0 + j >= cout)
                        continue;
                    const long long at = at0 + (long long)j * y_cs;
                    // a folded residual Add: this thread alone reads and writes `at`
                    const float sum = res ? v[j] + nn_load(res, at, res_half) : v[j];
                    // (one and two tiles: the call's saved registers spilled; their code is small)
                    const float out = !res_act ? sum
                                      : NT <= 2 ? nn_activate(sum, res_act, res_act_a, res_act_b)
                                                : nn_activate_lean(sum, res_act, res_act_a, res_act_b);
                    O::store(y, at, out);
                }
            }
        }
    }
    }
#endif
}

#if NN_IN_PART(1) // the planar gathers
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hf_1(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 1, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hf_2(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 2, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hf_4(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 4, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(8) nn_conv_mma_hf_8(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 8, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hh_1(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hh_4(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_PLANAR>(p); }
extern "C" __global__ void NN_TC_BOUNDS(8) nn_conv_mma_hh_8(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_PLANAR>(p); }
#endif // NN_IN_PART(1)
#if NN_IN_PART(2) // the general channels-last and tap-packed gathers
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hf_1_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 1, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hf_2_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 2, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hf_4_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 4, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(8) nn_conv_mma_hf_8_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 8, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hh_1_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hh_4_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_CHANNELS_LAST>(p); }
// (eight tiles at 128 registers, 4 blocks a multiprocessor instead of 3: no spills, 148 unbounded)
extern "C" __global__ void __launch_bounds__(32 * NN_TC_ROWS, 4) nn_conv_mma_hh_8_cl(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_CHANNELS_LAST>(p); }
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hh_1_tp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_TAP_PACKED>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2_tp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_TAP_PACKED>(p); }
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hh_4_tp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_TAP_PACKED>(p); }
extern "C" __global__ void NN_TC_BOUNDS(8) nn_conv_mma_hh_8_tp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_TAP_PACKED>(p); }
#endif // NN_IN_PART(2)
#if NN_IN_PART(3) // the fixed 3x3 and 1x1 shapes
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hh_1_c3(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_CL_3X3>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2_c3(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_CL_3X3>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2_c3p(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_CL_3X3, true>(p); }
extern "C" __global__ void __launch_bounds__(32 * NN_TC_ROWS, 4) nn_conv_mma_hh_8_c1(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_CL_1X1>(p); }
// (four tiles: launched double-buffered only, NnConv::stages)
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hh_4_c3(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_CL_3X3>(p); }
// (eight tiles at 128 registers, 4 blocks a multiprocessor: it fits without spills, 142 unbounded)
// (NN_TC_ROWS or, the host's tall 3x3 blocks, NN_TC_TALL_ROWS warps a block: held to the 128
// registers of four blocks of NN_TC_ROWS warps either way)
extern "C" __global__ void __launch_bounds__(32 * NN_TC_TALL_ROWS, 4 * NN_TC_ROWS / NN_TC_TALL_ROWS) nn_conv_mma_hh_8_c3(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_CL_3X3>(p); }
#endif // NN_IN_PART(3)
#if NN_IN_PART(4) // the fixed shapes through a Resize, of stride 2, 7x7
extern "C" __global__ void __launch_bounds__(32 * NN_TC_ROWS, 4) nn_conv_mma_hh_8_c3r(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 8, NN_GATHER_CL_3X3_RS>(p); }
// the staged Resize patch at four tiles: launched double-buffered only (program.rs,
// fixed_shape_matches)
extern "C" __global__ void NN_TC_BOUNDS(4) nn_conv_mma_hh_4_c3r(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_CL_3X3_RS>(p); }
extern "C" __global__ void NN_TC_BOUNDS(1) nn_conv_mma_hh_1_c3s2(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_CL_3X3_S2>(p); }
extern "C" __global__ void NN_TC_BOUNDS(2) nn_conv_mma_hh_2_c3s2(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_CL_3X3_S2>(p); }
extern "C" __global__ void NN_TC_STEM_BOUNDS(1) nn_conv_mma_hh_1_t7(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_TP_7X7>(p); }
extern "C" __global__ void NN_TC_STEM_BOUNDS(2) nn_conv_mma_hh_2_t7(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 2, NN_GATHER_TP_7X7>(p); }
extern "C" __global__ void NN_TC_STEM_BOUNDS(4) nn_conv_mma_hh_4_t7(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 4, NN_GATHER_TP_7X7>(p); }
extern "C" __global__ void NN_TC_TALL_BOUNDS(1) nn_conv_mma_hf_1_cp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32, 1, NN_GATHER_CL_PAIRED>(p); }
extern "C" __global__ void NN_TC_TALL_BOUNDS(1) nn_conv_mma_hh_1_cp(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16, 1, NN_GATHER_CL_PAIRED>(p); }
#endif // NN_IN_PART(4)

#if NN_IN_PART(0) // the CUDA-core convolutions and (each in its own #if) every kernel below
extern "C" __global__ void nn_conv_ff(const NnConv* __restrict__ p) { nn_conv_body<NnF32, NnF32>(p); }
extern "C" __global__ void nn_conv_fh(const NnConv* __restrict__ p) { nn_conv_body<NnF32, NnF16>(p); }
extern "C" __global__ void nn_conv_hf(const NnConv* __restrict__ p) { nn_conv_body<NnF16, NnF32>(p); }
extern "C" __global__ void nn_conv_hh(const NnConv* __restrict__ p) { nn_conv_body<NnF16, NnF16>(p); }
#endif // NN_IN_PART(0)

// ---------------------------------------------------------------------------------------------
// Normalization statistics

__device__ __forceinline__ double nn_block_sum(double v, double* shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (int k = 0; k < (int)(blockDim.x >> 5); k++)
            s += shared[k];
    return s; // valid in thread 0
}

// Channel c's mean and variance (double, a negative variance clamped to 0) through the
// statistics smoother, written as float:
//   smoothing a = 0: the frame's own statistics (state untouched);
//   first frame (state not primed, or control->reset): the frame's own, stored;
//   else, per channel with finite statistics: state = a*state + (1-a)*frame, used.
__device__ void nn_smooth_store(int c, double mean, double var, unsigned long long control,
                                unsigned long long state_mean, unsigned long long state_var,
                                unsigned long long state_primed, unsigned long long mean_out,
                                unsigned long long var_out)
{
    if (var < 0.0)
        var = 0.0;
    float m = (float)mean, v = (float)var;
    const NnControl* ctl = (const NnControl*)control;
    const float a = ctl->smoothing;
    if (a > 0.0f) {
        float* sm = (float*)state_mean;
        float* sv = (float*)state_var;
        int* primed = (int*)state_primed;
        if (!primed[c] || ctl->reset) {
            sm[c] = m;
            sv[c] = v;
            primed[c] = 1;
        } else if (isfinite(m) && isfinite(v)) {
            const float b = 1.0f - a;
            sm[c] = a * sm[c] + b * m;
            sv[c] = a * sv[c] + b * v;
            m = sm[c];
            v = sv[c];
        }
    }
    ((float*)mean_out)[c] = m;
    ((float*)var_out)[c] = v;
}

// The statistics of a channels-last fp16 tensor of x_cl channels: grid (blocks, x_cl / 8), each
// block sums its share of the pixels for 8 channels (one 16-byte load a pixel), in double;
// the last block of the 8 (counted on the first one's counter) finishes them as nn_moments.
__device__ __forceinline__ void nn_moments_cl(const NnMoments* __restrict__ p)
{
    __shared__ double shared[32];
    __shared__ int last;
    const int c0 = blockIdx.y * 8;
    const long long hw = p->hw, stride = p->x_cl;
    const long long chunk = (hw + gridDim.x - 1) / gridDim.x;
    const long long begin = blockIdx.x * chunk;
    const long long end = min(hw, begin + chunk);
    const unsigned short* __restrict__ x = (const unsigned short*)p->x + c0;
    double s[8], ss[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        s[j] = ss[j] = 0.0;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const uint4 q = __ldg((const uint4*)(x + i * stride));
        const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const double lo = half_bits_to_float((unsigned short)(w[k] & 0xffffu));
            const double hi = half_bits_to_float((unsigned short)(w[k] >> 16));
            s[2 * k] += lo;
            ss[2 * k] += lo * lo;
            s[2 * k + 1] += hi;
            ss[2 * k + 1] += hi * hi;
        }
    }
    double* partial = (double*)p->partial;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const double bs = nn_block_sum(s[j], shared);
        const double bss = nn_block_sum(ss[j], shared);
        if (threadIdx.x == 0) {
            partial[2 * ((long long)(c0 + j) * gridDim.x + blockIdx.x)] = bs;
            partial[2 * ((long long)(c0 + j) * gridDim.x + blockIdx.x) + 1] = bss;
        }
    }
    unsigned int* counter = (unsigned int*)p->counter;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter + c0, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 8)
        return;
    __threadfence();
    const int c = c0 + threadIdx.x;
    double ts = 0.0, tss = 0.0;
    const volatile double* vp = partial;
    for (int b = 0; b < (int)gridDim.x; b++) {
        ts += vp[2 * ((long long)c * gridDim.x + b)];
        tss += vp[2 * ((long long)c * gridDim.x + b) + 1];
    }
    if (threadIdx.x == 0)
        counter[c0] = 0u;
    const double mean = ts / (double)hw;
    nn_smooth_store(c, mean, tss / (double)hw - mean * mean, p->control, p->state_mean,
                    p->state_var, p->state_primed, p->mean, p->var);
}

// grid (blocks per channel, channels), NN_MOMENTS_THREADS threads. Each block sums its share of
// a channel's plane (sum and sum of squares, double); the last block of the channel (counted
// with an atomic, reset by that block) adds the partials in a fixed order, writes mean and
// variance through the smoother (nn_smooth_store).
#if NN_IN_PART(0)
extern "C" __global__ void nn_moments(const NnMoments* __restrict__ p)
{
    if (p->x_cl) {
        nn_moments_cl(p);
        return;
    }
    __shared__ double shared[32];
    __shared__ int last;
    const int c = blockIdx.y;
    const long long hw = p->hw;
    const long long base = (long long)c * hw;
    double s = 0.0, ss = 0.0;
    if (p->x_half && (hw & 7) == 0) {
        // fp16 planes of a multiple of 8 values (16-byte aligned: the arena's buffers are):
        // one 16-byte load per 8 values, their sums in float (the squares of halves are exact
        // in float), then in double
        const long long n8 = hw >> 3;
        const long long chunk = (n8 + gridDim.x - 1) / gridDim.x;
        const long long begin = blockIdx.x * chunk;
        const long long end = min(n8, begin + chunk);
        const uint4* __restrict__ x8 = (const uint4*)((const unsigned short*)p->x + base);
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const uint4 q = __ldg(x8 + i);
            const unsigned int w[4] = {q.x, q.y, q.z, q.w};
            float fs = 0.0f, fss = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float lo = half_bits_to_float((unsigned short)(w[k] & 0xffffu));
                const float hi = half_bits_to_float((unsigned short)(w[k] >> 16));
                fs += lo + hi;
                fss += lo * lo + hi * hi;
            }
            s += fs;
            ss += fss;
        }
    } else {
        const long long chunk = (hw + gridDim.x - 1) / gridDim.x;
        const long long begin = blockIdx.x * chunk;
        const long long end = min(hw, begin + chunk);
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
            double v = nn_load(p->x, base + i, p->x_half);
            s += v;
            ss += v * v;
        }
    }
    double bs = nn_block_sum(s, shared);
    double bss = nn_block_sum(ss, shared);
    double* partial = (double*)p->partial;
    unsigned int* counter = (unsigned int*)p->counter;
    if (threadIdx.x == 0) {
        partial[2 * ((long long)c * gridDim.x + blockIdx.x)] = bs;
        partial[2 * ((long long)c * gridDim.x + blockIdx.x) + 1] = bss;
        __threadfence();
        unsigned int done = atomicAdd(counter + c, 1u);
        last = done == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0)
        return;
    __threadfence();
    double ts = 0.0, tss = 0.0;
    const volatile double* vp = partial;
    for (int b = 0; b < (int)gridDim.x; b++) {
        ts += vp[2 * ((long long)c * gridDim.x + b)];
        tss += vp[2 * ((long long)c * gridDim.x + b) + 1];
    }
    counter[c] = 0u;
    double mean = ts / (double)hw;
    double var = tss / (double)hw - mean * mean;
    nn_smooth_store(c, mean, var, p->control, p->state_mean, p->state_var, p->state_primed,
                    p->mean, p->var);
}
#endif

// Gram moments (sm_80+) of an fp16 tensor x of C <= NN_GRAM_CHANNELS channels (NCHW, or
// channels-last: `cl`, below): its per-channel sums and the C x C sums of products x x^T over
// all pixels, from which it finishes x's own mean and
// variance (when `mean` is set) and those of y = W x + b, a 1x1 convolution whose output only
// its statistics read: mean_y = W mean_x + b, var_y[o] = w_o^T cov_x w_o. The convolution and
// the pass over its output are never run.
//
// The channels come in tiles of 16 (the mma's rows); blockIdx.y picks a pair of tiles (a, b),
// a <= b, whose 16x16 block of products the block sums: (0, 0) for up to 16 channels, then
// (0, 1) and (1, 1) for up to 32. A diagonal pair also sums its tile's channels.
//
// One step of a warp: 32 pixels. Lane (g, q) = (lane / 4, lane % 4) loads 8 halves of channel
// g and of channel g + 8 at pixels 8q..8q+7 (16 bytes each) and feeds them as both A (channels
// x pixels) and B (pixels x channels) fragments of two m16n8k16 mma per 16 pixels: a pixel's
// place in K is any bijection, as long as A and B share it. An off-diagonal pair loads tile b's
// channels g and g + 8 too, as the B fragments, in the load slots of half the pixel steps. The
// products of halves are exact
// in the float accumulators; a block's warps add theirs in double (fixed order), then the last
// block adds the blocks' partials in fixed order and finishes (NN_GRAM_SUMS values a block).
__device__ __forceinline__ uint4 nn_gram_load(const unsigned short* __restrict__ plane,
                                              long long hw, long long p, bool whole)
{
    if (whole)
        return __ldg((const uint4*)(plane + p));
    unsigned short h[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        h[k] = p + k < hw ? __ldg(plane + p + k) : (unsigned short)0;
    return make_uint4(nn_pack2(h[0], h[1]), nn_pack2(h[2], h[3]), nn_pack2(h[4], h[5]),
                      nn_pack2(h[6], h[7]));
}

__device__ __forceinline__ void nn_gram_mma(float (&d)[4], unsigned int a0, unsigned int a1,
                                            unsigned int a2, unsigned int a3, unsigned int b0,
                                            unsigned int b1)
{
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif // the host launches it on sm_80+ only
}

// The statistics chains of a Gram launch (NnMomentsGram::tail), run by its last block:
// defined with nn_eltwise below.
__device__ void nn_gram_tails(const NnMomentsGram* __restrict__ p);

__device__ __forceinline__ float nn_half_pair_sum(unsigned int w)
{
    return half_bits_to_float((unsigned short)(w & 0xffffu)) +
           half_bits_to_float((unsigned short)(w >> 16));
}

// The tiles (a, b) of pair `pair`: (0, 0), (0, 1), (1, 1).
__device__ __forceinline__ int nn_gram_tile_a(int pair) { return pair == 2 ? 1 : 0; }
__device__ __forceinline__ int nn_gram_tile_b(int pair) { return pair == 0 ? 0 : 1; }

#if NN_IN_PART(0)
extern "C" __global__ void __launch_bounds__(NN_GRAM_THREADS) nn_moments_gram(const NnMomentsGram* __restrict__ p)
{
    // the warps' sums after the loop; during it, the channels-last staging (NN_GRAM_UNROLL
    // slots of 16 pixels x 32 bytes a warp) in the same bytes
    __shared__ __align__(16) double warp_sums[NN_GRAM_THREADS / 32][NN_GRAM_SUMS];
    // the finished sums over all pairs: the C x C products (row stride NN_GRAM_CHANNELS), then
    // the C channel sums
    __shared__ double total[NN_GRAM_TOTAL];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int warps = NN_GRAM_THREADS / 32;
    const long long hw = p->hw;
    const int c = p->c;
    const int pair = blockIdx.y;
    const int ta = nn_gram_tile_a(pair), tb = nn_gram_tile_b(pair);
    const bool cross = ta != tb;
    // pixel steps a round: an off-diagonal pair spends half its load slots on tile b
    const int steps = cross ? NN_GRAM_UNROLL / 2 : NN_GRAM_UNROLL;
    const unsigned short* __restrict__ x = (const unsigned short*)p->x;
    // planar: slot u loads channels g and g + 8 of its tile
    const auto channel_on = [&](int tile, int k) { return 16 * tile + k < c; };
    const auto plane = [&](int tile, int k) {
        return x + (long long)(channel_on(tile, k) ? 16 * tile + k : 0) * hw;
    };
    // 16-byte loads when every plane starts 16-byte aligned (the arena's buffers are)
    const bool aligned = (hw & 7) == 0;
    // NN_GRAM_UNROLL slots' loads in flight, then their mma; each round's float sums (32
    // products an element a step) are added to double accumulators, so the float part never
    // sums more than a round
    double g0[4] = {0.0, 0.0, 0.0, 0.0}, g1[4] = {0.0, 0.0, 0.0, 0.0};
    double t_lo = 0.0, t_hi = 0.0;
    const long long step = (long long)gridDim.x * warps * 32;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (long long p0 = ((long long)blockIdx.x * warps + warp) * 32; !p->cl && p0 < hw;
         p0 += steps * step) {
        uint4 lo[NN_GRAM_UNROLL], hi[NN_GRAM_UNROLL];
#pragma unroll
        for (int u = 0; u < NN_GRAM_UNROLL; u++) {
            const int tile = u < steps ? ta : tb;
            const long long px = p0 + (u < steps ? u : u - steps) * step + 8 * q;
            const bool whole = aligned && px + 8 <= hw;
            lo[u] = channel_on(tile, g) && px < hw ? nn_gram_load(plane(tile, g), hw, px, whole)
                                                   : zero;
            hi[u] = channel_on(tile, g + 8) && px < hw
                        ? nn_gram_load(plane(tile, g + 8), hw, px, whole)
                        : zero;
        }
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
        float s_lo = 0.f, s_hi = 0.f;
#pragma unroll
        for (int u = 0; u < NN_GRAM_UNROLL; u++) {
            if (u >= steps)
                break;
            const uint4 a = lo[u], b = hi[u];
            // tile b's channels g and g + 8 as the B fragments (the same as A's on the diagonal)
            const uint4 bl = cross ? lo[u + NN_GRAM_UNROLL / 2] : a;
            const uint4 bh = cross ? hi[u + NN_GRAM_UNROLL / 2] : b;
            // pixels 8q+0..3 (K = 2q, 2q+1, 2q+8, 2q+9), then 8q+4..7
            nn_gram_mma(d0, a.x, b.x, a.y, b.y, bl.x, bl.y);
            nn_gram_mma(d1, a.x, b.x, a.y, b.y, bh.x, bh.y);
            nn_gram_mma(d0, a.z, b.z, a.w, b.w, bl.z, bl.w);
            nn_gram_mma(d1, a.z, b.z, a.w, b.w, bh.z, bh.w);
            s_lo += (nn_half_pair_sum(a.x) + nn_half_pair_sum(a.y)) +
                    (nn_half_pair_sum(a.z) + nn_half_pair_sum(a.w));
            s_hi += (nn_half_pair_sum(b.x) + nn_half_pair_sum(b.y)) +
                    (nn_half_pair_sum(b.z) + nn_half_pair_sum(b.w));
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            g0[k] += d0[k];
            g1[k] += d1[k];
        }
        t_lo += s_lo;
        t_hi += s_hi;
    }
    if (p->cl) {
        // channels-last, C channels (C / 8 16-byte chunks a pixel, C a multiple of 16): a warp
        // step is 16 pixels, one 16-byte load a lane (tile t's chunks 2t and 2t + 1), staged in
        // shared memory; ldmatrix.trans then hands lane (g, q) channels g and g + 8 of pixels
        // 2q, 2q + 1 (a0, a1) and 2q + 8, 2q + 9 (a2, a3): the A fragment of channels x
        // pixels, and the B fragments of pixels x channels 0-7 (a0, a2) and 8-15 (a1, a3). A
        // pixel's two halves swap places every 4 pixels, so the 8 rows of one 8x8 matrix fall
        // in distinct banks.
        uint4* stage = (uint4*)&warp_sums[0][0] + warp * NN_GRAM_UNROLL * 32;
        const uint4* __restrict__ xv = (const uint4*)x;
        const long long chunks = c / 8;
        const long long step_cl = (long long)gridDim.x * warps * 16;
        const int st_px = lane >> 1, st_half = lane & 1;
        const int ld_px = ((lane >> 4) << 3) + (lane & 7), ld_half = (lane >> 3) & 1;
        const int st_slot = st_px * 2 + (st_half ^ ((st_px >> 2) & 1));
        const unsigned int ld_addr =
            nn_smem_addr(stage) + (unsigned int)((ld_px * 2 + (ld_half ^ ((ld_px >> 2) & 1))) * 16);
        // a round's loads are issued before the previous round's products, so that a warp's
        // loads are in flight while it multiplies (the registers are free once staged)
        const auto load_round = [&](uint4 (&v)[NN_GRAM_UNROLL], long long p0) {
#pragma unroll
            for (int u = 0; u < NN_GRAM_UNROLL; u++) {
                const int tile = u < steps ? ta : tb;
                const long long px = p0 + (u < steps ? u : u - steps) * step_cl + st_px;
                v[u] = px < hw ? __ldg(xv + chunks * px + 2 * tile + st_half) : zero;
            }
        };
        uint4 v[NN_GRAM_UNROLL];
        const long long first = ((long long)blockIdx.x * warps + warp) * 16;
        if (first < hw)
            load_round(v, first);
        for (long long p0 = first; p0 < hw; p0 += steps * step_cl) {
            __syncwarp(); // the previous round's ldmatrix are done
#pragma unroll
            for (int u = 0; u < NN_GRAM_UNROLL; u++)
                stage[u * 32 + st_slot] = v[u];
            __syncwarp();
            if (p0 + steps * step_cl < hw)
                load_round(v, p0 + steps * step_cl);
            float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
            float s_lo = 0.f, s_hi = 0.f;
#pragma unroll
            for (int u = 0; u < NN_GRAM_UNROLL; u++) {
                if (u >= steps)
                    break;
                unsigned int a0, a1, a2, a3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                             : "r"(ld_addr + u * 32 * 16));
                unsigned int b0 = a0, b1 = a1, b2 = a2, b3 = a3;
                if (cross)
                    asm volatile(
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                        : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                        : "r"(ld_addr + (u + NN_GRAM_UNROLL / 2) * 32 * 16));
                nn_gram_mma(d0, a0, a1, a2, a3, b0, b2);
                nn_gram_mma(d1, a0, a1, a2, a3, b1, b3);
                s_lo += nn_half_pair_sum(a0) + nn_half_pair_sum(a2);
                s_hi += nn_half_pair_sum(a1) + nn_half_pair_sum(a3);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                g0[k] += d0[k];
                g1[k] += d1[k];
            }
            t_lo += s_lo;
            t_hi += s_hi;
        }
        __syncthreads(); // the staging's bytes become the warps' sums
    }
    // the warp's sums: lanes of one g hold channel g's in four parts
    t_lo += __shfl_xor_sync(0xffffffffu, t_lo, 1);
    t_lo += __shfl_xor_sync(0xffffffffu, t_lo, 2);
    t_hi += __shfl_xor_sync(0xffffffffu, t_hi, 1);
    t_hi += __shfl_xor_sync(0xffffffffu, t_hi, 2);
    double* ws = warp_sums[warp];
    if (q == 0) {
        ws[256 + g] = t_lo;
        ws[256 + g + 8] = t_hi;
    }
    // accumulator (row, col) of the pair's 16x16 block: d0 cols 0..7, d1 cols 8..15
    ws[g * 16 + 2 * q] = g0[0];
    ws[g * 16 + 2 * q + 1] = g0[1];
    ws[(g + 8) * 16 + 2 * q] = g0[2];
    ws[(g + 8) * 16 + 2 * q + 1] = g0[3];
    ws[g * 16 + 8 + 2 * q] = g1[0];
    ws[g * 16 + 8 + 2 * q + 1] = g1[1];
    ws[(g + 8) * 16 + 8 + 2 * q] = g1[2];
    ws[(g + 8) * 16 + 8 + 2 * q + 1] = g1[3];
    __syncthreads();
    double* partial = (double*)p->partial;
    const long long block = (long long)pair * gridDim.x + blockIdx.x;
    for (int i = threadIdx.x; i < NN_GRAM_SUMS; i += NN_GRAM_THREADS) {
        double v = 0.0;
        for (int w = 0; w < warps; w++)
            v += warp_sums[w][i];
        partial[block * NN_GRAM_SUMS + i] = v;
    }
    __threadfence();
    __syncthreads();
    unsigned int* counter = (unsigned int*)p->counter;
    if (threadIdx.x == 0)
        last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    // each sum over the pixels divided by their count once, here, in parallel (the finishing
    // loops below would otherwise divide in double, one after another, C + 1 times a channel)
    const double n = (double)hw;
    for (int i = threadIdx.x; i < (int)gridDim.y * NN_GRAM_SUMS; i += NN_GRAM_THREADS) {
        const int pr = i / NN_GRAM_SUMS, k = i % NN_GRAM_SUMS;
        const int a = nn_gram_tile_a(pr), b = nn_gram_tile_b(pr);
        double v = 0.0;
#pragma unroll 16
        for (int bx = 0; bx < (int)gridDim.x; bx++)
            v += __ldcg(partial + ((long long)pr * gridDim.x + bx) * NN_GRAM_SUMS + k);
        v /= n;
        if (k < 256) {
            const int row = 16 * a + k / 16, col = 16 * b + k % 16;
            if (row < c && col < c) {
                total[row * NN_GRAM_CHANNELS + col] = v;
                total[col * NN_GRAM_CHANNELS + row] = v;
            }
        } else if (a == b && 16 * a + k - 256 < c) {
            total[NN_GRAM_CHANNELS * NN_GRAM_CHANNELS + 16 * a + k - 256] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0)
        *counter = 0u;
    const double* __restrict__ gram = total;
    const double* __restrict__ sums = total + NN_GRAM_CHANNELS * NN_GRAM_CHANNELS;
    // x's own statistics
    if (p->mean && threadIdx.x < c) {
        const int k = threadIdx.x;
        const double mean = sums[k];
        nn_smooth_store(k, mean, gram[k * NN_GRAM_CHANNELS + k] - mean * mean, p->control,
                        p->state_mean, p->state_var, p->state_primed, p->mean, p->var);
    }
    // the 1x1 convolution's: w_o^T (G / n - m m^T) w_o, in double
    const float* __restrict__ w = (const float*)p->w;
    for (int o = threadIdx.x; o < p->cout; o += NN_GRAM_THREADS) {
        const float* wo = w + (long long)o * c;
        double mean = p->b ? (double)((const float*)p->b)[o] : 0.0;
        double wm = 0.0, quad = 0.0;
        for (int i = 0; i < c; i++) {
            const double mi = sums[i];
            wm += (double)wo[i] * mi;
            double row = 0.0;
            for (int j = 0; j < c; j++)
                row += gram[i * NN_GRAM_CHANNELS + j] * (double)wo[j];
            quad += (double)wo[i] * row;
        }
        mean += wm;
        nn_smooth_store(o, mean, quad - wm * wm, p->control, p->y_state_mean, p->y_state_var,
                        p->y_state_primed, p->y_mean, p->y_var);
    }
    nn_gram_tails(p);
}
#endif

// Wide Gram moments (sm_80+): the same statistics as nn_moments_gram for an fp16 tensor x of
// NN_GRAM_CHANNELS < C <= NN_GRAM_WIDE_MAX channels (the planner asks for whole 64-channel
// tiles: gram_takes; NCHW with hw a multiple of 8, or
// channels-last), in three launches that share one parameter block:
//   nn_gram_wide         grid (chunks, pairs): block (chunk, pair) sums the 64x64 block of
//                        products of channel tiles (a, b), a <= b, of 64 channels, and (on the
//                        diagonal) tile a's channel sums, over its chunk of the pixels, into
//                        its NN_GRAM_WIDE_SUMS doubles of `partial`
//   nn_gram_wide_reduce  a lane an entry, the block's warps splitting the chunks: the chunks'
//                        partials in fixed order, divided by the pixel count, into `gram`
//                        (E[x x^T], C x C, then E[x])
//   nn_gram_wide_finish  NN_GRAM_WIDE_OUTS outputs of the 1x1 convolution a block: mean
//                        b + w.E[x], variance w^T cov w (cov = E[x x^T] - E[x] E[x]^T centred in
//                        double, the quadratic form in float), x's own statistics, and the last
//                        block runs the statistics chains (nn_gram_tails)
// The partials launch stages 64 pixels x 64 channels a tile (8 KB, rows of 128 bytes: a
// channel's 64 pixels NCHW, a pixel's 64 channels channels-last; the 16-byte chunks of row R
// at chunk J ^ (R & 7), so that ldmatrix's 8 rows fall in distinct banks) with cp.async, two
// steps in flight; ldmatrix (.trans for channels-last) hands out the A (channels x pixels) and
// B (pixels x channels) fragments of the same staged bytes. Warp w holds rows 16 (w & 3) and
// columns 32 (w >> 2) of the 64x64 block: per 16 pixels one A and two B ldmatrix.x4, four
// m16n8k16 mma, and one more against a B of ones for the rows' channel sums. The float
// accumulators hold one step (64 exact products an element) and are added to double ones.
__device__ __forceinline__ void nn_gram_wide_pair(int k, int tiles, int& a, int& b)
{
    a = 0;
    while (k >= tiles - a) {
        k -= tiles - a;
        a++;
    }
    b = a + k;
}

// A 16-byte cp.async that stores zeros instead when `valid` is false (no bytes read).
__device__ __forceinline__ void nn_cp_async16_or_zero(unsigned int dst, const void* src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void nn_ldmatrix_x4(unsigned int (&v)[4], unsigned int addr, bool trans)
{
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                     : "r"(addr));
}

#if NN_IN_PART(0)
extern "C" __global__ void __launch_bounds__(NN_GRAM_WIDE_THREADS, 2) nn_gram_wide(const NnMomentsGram* __restrict__ p)
{
#if __CUDA_ARCH__ >= 800 // cp.async; the host launches it on sm_80+ only
    // [step buffer][tile a, tile b][64 rows x 64 halves]
    __shared__ __align__(128) unsigned short stage[2][2][64 * 64];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const long long hw = p->hw;
    const int c = p->c;
    const bool cl = p->cl != 0;
    int ta, tb;
    nn_gram_wide_pair(blockIdx.y, (c + 63) / 64, ta, tb);
    const int ntiles = ta != tb ? 2 : 1;
    const unsigned short* __restrict__ x = (const unsigned short*)p->x;
    // this block's 64-pixel steps: the pixels split evenly over the chunks
    const long long steps = (hw + 63) / 64;
    const long long s0 = steps * blockIdx.x / gridDim.x, s1 = steps * (blockIdx.x + 1) / gridDim.x;
    const unsigned int base = nn_smem_addr(&stage[0][0][0]);
    const auto issue = [&](long long s, int buf) {
        const long long p0 = s * 64;
        for (int t = 0; t < ntiles; t++) {
            const int c0 = 64 * (t ? tb : ta);
#pragma unroll
            for (int k = 0; k < 4096 / 8 / NN_GRAM_WIDE_THREADS; k++) {
                const int u = threadIdx.x + k * NN_GRAM_WIDE_THREADS;
                const int row = u >> 3, chunk = u & 7;
                long long at;
                bool ok;
                if (cl) {
                    ok = p0 + row < hw && c0 + 8 * chunk < c;
                    at = (p0 + row) * c + c0 + 8 * chunk;
                } else {
                    ok = c0 + row < c && p0 + 8 * chunk < hw;
                    at = (long long)(c0 + row) * hw + p0 + 8 * chunk;
                }
                const unsigned int dst =
                    base + (unsigned int)(((buf * 2 + t) * 4096 + row * 64) * 2 + ((chunk ^ (row & 7)) * 16));
                nn_cp_async16_or_zero(dst, x + (ok ? at : 0), ok);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // lane's row address in the 8x8 block (channel group cg, pixel group pg) of a tile
    const int mi = lane >> 3, r = lane & 7;
    const auto frag = [&](unsigned int tile, int cg, int pg) {
        const int row = cl ? 8 * pg + r : 8 * cg + r;
        const int chunk = cl ? cg : pg;
        return tile + (unsigned int)(row * 128 + ((chunk ^ r) * 16));
    };
    const int wm = warp & 3, wn = warp >> 2;
    const unsigned int ones = 0x3c003c00u; // two halves of 1.0
    double acc[4][4], sum_lo = 0.0, sum_hi = 0.0;
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[n][e] = 0.0;
    if (s0 < s1)
        issue(s0, 0);
    for (long long s = s0; s < s1; s++) {
        const int buf = (int)((s - s0) & 1);
        if (s + 1 < s1) {
            issue(s + 1, buf ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads(); // step s is in shared memory for every warp
        const unsigned int tile_a = base + (unsigned int)(buf * 2 * 8192);
        const unsigned int tile_b = tile_a + (ntiles == 2 ? 8192u : 0u);
        float d[4][4], ds[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                d[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned int a[4];
            nn_ldmatrix_x4(a, frag(tile_a, 2 * wm + (mi & 1), 2 * kk + (mi >> 1)), cl);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                unsigned int b[4];
                nn_ldmatrix_x4(b, frag(tile_b, 4 * wn + 2 * h + (mi >> 1), 2 * kk + (mi & 1)), cl);
                nn_gram_mma(d[2 * h], a[0], a[1], a[2], a[3], b[0], b[1]);
                nn_gram_mma(d[2 * h + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
            // (the channel sums are taken from the diagonal pairs only)
            if (wn == 0 && ntiles == 1)
                nn_gram_mma(ds, a[0], a[1], a[2], a[3], ones, ones);
        }
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[n][e] += (double)d[n][e];
        sum_lo += (double)ds[0];
        sum_hi += (double)ds[2];
        __syncthreads(); // every warp is done with buffer buf before it is filled again
    }
    // accumulator (row, col): d[n] rows 16 wm + g (+8), columns 32 wn + 8 n + 2 q (+1)
    double* out = (double*)p->partial + ((long long)blockIdx.y * gridDim.x + blockIdx.x) * NN_GRAM_WIDE_SUMS;
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            out[(16 * wm + g + (e >> 1) * 8) * 64 + 32 * wn + 8 * n + 2 * q + (e & 1)] = acc[n][e];
    if (wn == 0 && q == 0) {
        out[4096 + 16 * wm + g] = sum_lo;
        out[4096 + 16 * wm + g + 8] = sum_hi;
    }
#endif
}

extern "C" __global__ void __launch_bounds__(NN_GRAM_WIDE_THREADS) nn_gram_wide_reduce(const NnMomentsGram* __restrict__ p)
{
    // a block for NN_GRAM_WIDE_REDUCE_ENTRIES consecutive entries (one warp's coalesced loads
    // a chunk), its warps each summing every (warps)th chunk from its own in order, then warp
    // 0 the warps' sums in order: a fixed order, so the statistics are the same bits every run,
    // and each thread waits on chunks / warps loads instead of all of them
    constexpr int warps = NN_GRAM_WIDE_THREADS / 32;
    __shared__ double sums[warps][NN_GRAM_WIDE_REDUCE_ENTRIES];
    const int c = p->c, tiles = (c + 63) / 64;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long i = (long long)blockIdx.x * NN_GRAM_WIDE_REDUCE_ENTRIES + lane;
    const bool inside = i < (long long)tiles * (tiles + 1) / 2 * NN_GRAM_WIDE_SUMS;
    const int pr = inside ? (int)(i / NN_GRAM_WIDE_SUMS) : 0;
    const int e = inside ? (int)(i % NN_GRAM_WIDE_SUMS) : 0;
    int a, b;
    nn_gram_wide_pair(pr, tiles, a, b);
    // a diagonal block holds each product twice: its upper triangle is taken
    const int row = 64 * a + e / 64, col = 64 * b + e % 64;
    const bool product = inside && e < 4096 && row < c && col < c && (a != b || row <= col);
    const bool sum = inside && e >= 4096 && a == b && 64 * a + e - 4096 < c;
    const int chunks = p->chunks;
    double v = 0.0;
    if (product || sum) {
        const double* __restrict__ part = (const double*)p->partial + (long long)pr * chunks * NN_GRAM_WIDE_SUMS + e;
#pragma unroll 4
        for (int k = warp; k < chunks; k += warps)
            v += part[(long long)k * NN_GRAM_WIDE_SUMS];
    }
    sums[warp][lane] = v;
    __syncthreads();
    if (warp != 0 || !(product || sum))
        return;
    v = 0.0;
#pragma unroll
    for (int k = 0; k < warps; k++)
        v += sums[k][lane];
    v /= (double)p->hw;
    double* gram = (double*)p->gram;
    if (product) {
        gram[(long long)row * c + col] = v;
        gram[(long long)col * c + row] = v;
    } else {
        gram[(long long)c * c + 64 * a + e - 4096] = v;
    }
}

extern "C" __global__ void __launch_bounds__(NN_GRAM_WIDE_THREADS) nn_gram_wide_finish(const NnMomentsGram* __restrict__ p)
{
    // the block's outputs' weights [input channel][output], x's mean, the warps' sums
    __shared__ __align__(16) float ws[NN_GRAM_WIDE_MAX][NN_GRAM_WIDE_OUTS];
    __shared__ double mean_x[NN_GRAM_WIDE_MAX];
    __shared__ double warp_quad[NN_GRAM_WIDE_THREADS / 32][NN_GRAM_WIDE_OUTS];
    __shared__ double warp_wm[NN_GRAM_WIDE_THREADS / 32][NN_GRAM_WIDE_OUTS];
    __shared__ int last;
    const int c = p->c, cout = p->cout, o0 = blockIdx.x * NN_GRAM_WIDE_OUTS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const double* __restrict__ gram = (const double*)p->gram;
    const float* __restrict__ w = (const float*)p->w;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        mean_x[j] = gram[(long long)c * c + j];
#pragma unroll
        for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++)
            ws[j][o] = o0 + o < cout ? w[(long long)(o0 + o) * c + j] : 0.f;
    }
    __syncthreads();
    // thread i: row i of cov (read down column i: E[x x^T] is symmetric, and the threads'
    // loads of one j are consecutive) against the outputs' weights
    double quad[NN_GRAM_WIDE_OUTS], wm[NN_GRAM_WIDE_OUTS];
#pragma unroll
    for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++)
        quad[o] = wm[o] = 0.0;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const double mi = mean_x[i];
        float row[NN_GRAM_WIDE_OUTS];
#pragma unroll
        for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++)
            row[o] = 0.f;
        // (unrolled: the loads of gram are independent, and one at a time left this launch
        // waiting on L2 for each)
#pragma unroll 8
        for (int j = 0; j < c; j++) {
            const float cov = (float)(gram[(long long)j * c + i] - mean_x[j] * mi);
#pragma unroll
            for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++)
                row[o] = fmaf(cov, ws[j][o], row[o]);
        }
#pragma unroll
        for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++) {
            quad[o] += (double)ws[i][o] * (double)row[o];
            wm[o] += (double)ws[i][o] * mi;
        }
    }
#pragma unroll
    for (int o = 0; o < NN_GRAM_WIDE_OUTS; o++) {
        for (int k = 16; k > 0; k >>= 1) {
            quad[o] += __shfl_xor_sync(0xffffffffu, quad[o], k);
            wm[o] += __shfl_xor_sync(0xffffffffu, wm[o], k);
        }
        if (lane == 0) {
            warp_quad[warp][o] = quad[o];
            warp_wm[warp][o] = wm[o];
        }
    }
    __syncthreads();
    if (threadIdx.x < NN_GRAM_WIDE_OUTS && o0 + (int)threadIdx.x < cout) {
        const int o = threadIdx.x;
        double qs = 0.0, ms = 0.0;
        for (int k = 0; k < NN_GRAM_WIDE_THREADS / 32; k++) {
            qs += warp_quad[k][o];
            ms += warp_wm[k][o];
        }
        const double mean = (p->b ? (double)((const float*)p->b)[o0 + o] : 0.0) + ms;
        nn_smooth_store(o0 + o, mean, qs, p->control, p->y_state_mean, p->y_state_var,
                        p->y_state_primed, p->y_mean, p->y_var);
    }
    // x's own statistics, spread over the blocks
    if (p->mean) {
        for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < c; k += gridDim.x * blockDim.x) {
            const double m = gram[(long long)c * c + k];
            nn_smooth_store(k, m, gram[(long long)k * c + k] - m * m, p->control, p->state_mean,
                            p->state_var, p->state_primed, p->mean, p->var);
        }
    }
    __threadfence();
    __syncthreads();
    unsigned int* counter = (unsigned int*)p->counter;
    if (threadIdx.x == 0)
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    if (threadIdx.x == 0)
        *counter = 0u;
    nn_gram_tails(p);
}
#endif

// y = (x - mean[c]) / sqrt(var[c] + eps) * scale[c] + bias[c], then the activation.
#if NN_IN_PART(0)
extern "C" __global__ void nn_norm_apply(const NnNormApply* __restrict__ p)
{
    const long long total = (long long)p->c * p->hw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        // the channel by a 32-bit division when the index allows (hw < 2^31 always); a
        // channels-last output runs over its own order and reads an NCHW x's planes across,
        // an NCHW output reads a channels-last x's pixels across
        int c;
        long long xi = i;
        if (p->y_cl) {
            c = (int)(i % p->y_cl);
            if (!p->x_cl)
                xi = (long long)c * p->hw + i / p->y_cl;
        } else {
            c = i < 2147483647ll ? (int)((unsigned int)i / (unsigned int)p->hw) : (int)(i / p->hw);
            if (p->x_cl)
                xi = (i - (long long)c * p->hw) * p->x_cl + c;
        }
        float m = ((const float*)p->mean)[c];
        float v = ((const float*)p->var)[c];
        float inv = 1.0f / sqrtf(v + p->eps);
        float s = p->scale ? ((const float*)p->scale)[c] : 1.0f;
        float b = p->bias ? ((const float*)p->bias)[c] : 0.0f;
        float x = nn_load(p->x, xi, p->x_half);
        float y = (x - m) * inv * s + b;
        nn_store(p->y, i, p->y_half, nn_activate(y, p->act, p->act_a, p->act_b));
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Elementwise chains

__device__ __forceinline__ float nn_binary(int op, float a, float b)
{
    switch (op) {
    case NN_EW_ADD:
        return a + b;
    case NN_EW_SUB:
        return a - b;
    case NN_EW_MUL:
        return a * b;
    case NN_EW_DIV:
        return a / b;
    case NN_EW_POW:
        return powf(a, b);
    case NN_EW_MIN:
        return (a != a || b != b) ? __int_as_float(0x7fc00000) : fminf(a, b);
    case NN_EW_MAX:
        return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
    case NN_EW_PRELU:
        return a < 0.0f ? a * b : a;
    default:
        return a;
    }
}

__device__ __forceinline__ float nn_unary(int op, float x, float p0, float p1)
{
    switch (op) {
    case NN_EW_RELU:
        return x < 0.0f ? 0.0f : x;
    case NN_EW_LEAKY:
        return x < 0.0f ? p0 * x : x;
    case NN_EW_SIGMOID:
        return 1.0f / (1.0f + expf(-x));
    case NN_EW_TANH:
        return tanhf(x);
    case NN_EW_SQRT:
        return sqrtf(x);
    case NN_EW_RECIP:
        return 1.0f / x;
    case NN_EW_NEG:
        return -x;
    case NN_EW_ABS:
        return fabsf(x);
    case NN_EW_EXP:
        return expf(x);
    case NN_EW_LOG:
        return logf(x);
    case NN_EW_FLOOR:
        return floorf(x);
    case NN_EW_CEIL:
        return ceilf(x);
    case NN_EW_CLIP: {
        float y = x < p0 ? p0 : x;
        return y > p1 ? p1 : y;
    }
    default:
        return x;
    }
}

// A chain that is affine in its one full-size operand X up to op affine_ops (Add, Sub, Mul and
// Div by values constant along the last axis, e.g. a normalization by per-channel statistics),
// then unary ops: the host checked it (program::affine_chain). The V values share their
// constants, so the thread folds the affine part into y = a * X + b once (from X = 1·X + 0 and
// each constant c = 0·X + c), then applies a and b and the trailing ops to its V values of X
// (contiguous, as the output: 16-byte loads and stores of halves).
// The affine part's coefficients at index (i0, i1, i2, i3): the chain is ca * X + cb there.
__device__ __forceinline__ void nn_affine_coefficients(const NnEltwise& s, int i0, int i1, int i2,
                                                       int i3, float& ca_out, float& cb_out)
{
    float ca = 0.0f, cb = 0.0f;
    for (int o = 0; o < s.affine_ops; o++) {
        const int code = s.op_code[o];
        float a[2], b[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int ref = k == 0 ? s.op_a[o] : s.op_b[o];
            if (ref < 0) {
                a[k] = ca;
                b[k] = cb;
            } else if (ref == s.affine_x) {
                a[k] = 1.0f;
                b[k] = 0.0f;
            } else {
                const int* st = s.strides + 4 * ref;
                const long long at = (long long)i0 * st[0] + (long long)i1 * st[1] +
                                     (long long)i2 * st[2] + (long long)i3 * st[3];
                a[k] = 0.0f;
                b[k] = nn_load(s.operand[ref], at, s.operand_half[ref]);
            }
        }
        if (code >= NN_EW_FIRST_UNARY) { // of a constant
            ca = 0.0f;
            cb = nn_unary(code, b[0], s.op_p0[o], s.op_p1[o]);
        } else if (code == NN_EW_ADD) {
            ca = a[0] + a[1];
            cb = b[0] + b[1];
        } else if (code == NN_EW_SUB) {
            ca = a[0] - a[1];
            cb = b[0] - b[1];
        } else if (code == NN_EW_MUL) { // one side constant (a[0] * a[1] == 0)
            ca = a[0] * b[1] + a[1] * b[0];
            cb = b[0] * b[1];
        } else { // NN_EW_DIV by a constant
            ca = a[0] / b[1];
            cb = b[0] / b[1];
        }
    }
    ca_out = ca;
    cb_out = cb;
}

// The chain's value from X through the coefficients, then the unary ops after the affine part.
__device__ __forceinline__ float nn_affine_apply(const NnEltwise& s, float ca, float cb, float x)
{
    float v = ca * x + cb;
    for (int o = s.affine_ops; o < s.n_ops; o++)
        v = nn_unary(s.op_code[o], v, s.op_p0[o], s.op_p1[o]);
    return v;
}

template <int V>
__device__ __forceinline__ void nn_eltwise_affine(const NnEltwise& s, long long i, int i0, int i1,
                                                  int i2, int i3)
{
    float ca, cb;
    nn_affine_coefficients(s, i0, i1, i2, i3, ca, cb);
    const unsigned long long xp = s.operand[s.affine_x];
    const bool xh = s.operand_half[s.affine_x];
    float v[V];
    if (xh && V % 8 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 8) {
            nn_unpack8(__ldg((const uint4*)((const unsigned short*)xp + i + j)), v + j);
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            v[j] = nn_load(xp, i + j, xh);
    }
#pragma unroll
    for (int j = 0; j < V; j++)
        v[j] = nn_affine_apply(s, ca, cb, v[j]);
    if (s.y_half && V % 8 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 8) {
            *(uint4*)((unsigned short*)s.y + i + j) = nn_pack8(v + j);
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            nn_store(s.y, i + j, s.y_half, v[j]);
    }
}

// The 4-D index (i0, i1, i2, i3) of linear index i over dims (., d1, d2, d3).
template <typename Idx>
__device__ __forceinline__ void nn_unravel(Idx i, Idx d1, Idx d2, Idx d3, int& i0, int& i1, int& i2,
                                           int& i3)
{
    i3 = (int)(i % d3);
    i /= d3;
    i2 = (int)(i % d2);
    i /= d2;
    i1 = (int)(i % d1);
    i0 = (int)(i / d1);
}

// The affine path over V consecutive elements a thread (grid-stride): the chain's coefficients
// are worked out once per V values (the longer V, the less that costs a value).
template <typename Idx, int V>
__device__ __forceinline__ void nn_eltwise_affine_body(const NnEltwise& s)
{
    const Idx d1 = s.dims[1], d2 = s.dims[2], d3 = s.dims[3];
    const Idx total = (Idx)s.dims[0] * d1 * d2 * d3 / V;
    for (Idx iv = blockIdx.x * (Idx)blockDim.x + threadIdx.x; iv < total;
         iv += (Idx)gridDim.x * blockDim.x) {
        int i0, i1, i2, i3;
        nn_unravel<Idx>(iv * V, d1, d2, d3, i0, i1, i2, i3);
        nn_eltwise_affine<V>(s, iv * V, i0, i1, i2, i3);
    }
}

// The op of a chain on V values at once: one dispatch for all of them (unrolled, each case's
// loop is the scalar op with its code known).
#define NN_EW_BINARY_CASE(c) \
    case c:                   \
        _Pragma("unroll") for (int j = 0; j < V; j++) a[j] = nn_binary(c, a[j], b[j]); \
        break;
template <int V>
__device__ __forceinline__ void nn_binary_n(int op, float (&a)[V], const float (&b)[V])
{
    switch (op) {
        NN_EW_BINARY_CASE(NN_EW_ADD)
        NN_EW_BINARY_CASE(NN_EW_SUB)
        NN_EW_BINARY_CASE(NN_EW_MUL)
        NN_EW_BINARY_CASE(NN_EW_DIV)
    default:
#pragma unroll
        for (int j = 0; j < V; j++)
            a[j] = nn_binary(op, a[j], b[j]);
    }
}
#undef NN_EW_BINARY_CASE

// V consecutive values of an operand contiguous along the last axis from index at: 16-byte
// loads where the address allows (CG: through L2, as nn_load_cg).
template <int V, bool CG>
__device__ __forceinline__ void nn_load_run(unsigned long long p, long long at, int is_half, float (&v)[V])
{
    const unsigned long long addr = p + (unsigned long long)at * (is_half ? 2 : 4);
    if (V % 8 == 0 && is_half && (addr & 15) == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 8) {
            nn_unpack8(CG ? __ldcg((const uint4*)addr + j / 8) : __ldg((const uint4*)addr + j / 8), v + j);
        }
    } else if (V % 4 == 0 && !is_half && (addr & 15) == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            const float4 q = CG ? __ldcg((const float4*)addr + j / 4) : __ldg((const float4*)addr + j / 4);
            v[j] = q.x;
            v[j + 1] = q.y;
            v[j + 2] = q.z;
            v[j + 3] = q.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            v[j] = CG ? nn_load_cg(p, at + j, is_half) : nn_load(p, at + j, is_half);
    }
}

// V consecutive output values from index i: 16-byte stores where the address allows.
template <int V>
__device__ __forceinline__ void nn_store_run(unsigned long long p, long long i, int is_half, const float (&v)[V])
{
    const unsigned long long addr = p + (unsigned long long)i * (is_half ? 2 : 4);
    if (V % 8 == 0 && is_half && (addr & 15) == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 8) {
            *((uint4*)addr + j / 8) = nn_pack8(v + j);
        }
    } else if (V % 4 == 0 && !is_half && (addr & 15) == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4)
            *((float4*)addr + j / 4) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            nn_store(p, i + j, is_half, v[j]);
    }
}

// V consecutive elements along the last axis per thread (NN_EW_VEC when that axis allows it): the
// index decomposition, operand offsets and the op dispatch are paid once per V values.
// (CG: the operands through L2, for values written earlier in the same launch; first and
// stride: the grid-stride loop's, in units of V values)
template <typename Idx, int V, bool CG = false>
__device__ __forceinline__ void nn_eltwise_body(const NnEltwise& s, Idx first, Idx stride)
{
    const Idx d1 = s.dims[1], d2 = s.dims[2], d3 = s.dims[3];
    const Idx total = (Idx)s.dims[0] * d1 * d2 * d3 / V;
    for (Idx iv = first; iv < total; iv += stride) {
        const Idx i = iv * V;
        int i0, i1, i2, i3;
        nn_unravel<Idx>(i, d1, d2, d3, i0, i1, i2, i3);
        if (V == NN_EW_VEC && s.affine_x >= 0) {
            nn_eltwise_affine<V>(s, i, i0, i1, i2, i3);
            continue;
        }
        float cur[V];
#pragma unroll
        for (int j = 0; j < V; j++)
            cur[j] = 0.0f;
        for (int o = 0; o < s.n_ops; o++) {
            const int code = s.op_code[o];
            const bool unary = code >= NN_EW_FIRST_UNARY;
            float v[2][V];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                if (k == 1 && unary)
                    break;
                const int ref = k == 0 ? s.op_a[o] : s.op_b[o];
                if (ref < 0) {
#pragma unroll
                    for (int j = 0; j < V; j++)
                        v[k][j] = cur[j];
                } else {
                    const int* st = s.strides + 4 * ref;
                    const long long at = (long long)i0 * st[0] + (long long)i1 * st[1] +
                                         (long long)i2 * st[2] + (long long)i3 * st[3];
                    if (st[3] == 0) {
                        // broadcast along the last axis (e.g. per channel): one load for all V
                        const float u = CG ? nn_load_cg(s.operand[ref], at, s.operand_half[ref])
                                           : nn_load(s.operand[ref], at, s.operand_half[ref]);
#pragma unroll
                        for (int j = 0; j < V; j++)
                            v[k][j] = u;
                    } else if (st[3] == 1) {
                        // contiguous along the last axis (a full-size operand, or per channel
                        // of a channels-last tensor): vector loads
                        nn_load_run<V, CG>(s.operand[ref], at, s.operand_half[ref], v[k]);
                    } else {
#pragma unroll
                        for (int j = 0; j < V; j++)
                            v[k][j] = CG ? nn_load_cg(s.operand[ref], at + (long long)j * st[3], s.operand_half[ref])
                                         : nn_load(s.operand[ref], at + (long long)j * st[3], s.operand_half[ref]);
                    }
                }
            }
            if (unary) {
#pragma unroll
                for (int j = 0; j < V; j++)
                    cur[j] = nn_unary(code, v[0][j], s.op_p0[o], s.op_p1[o]);
            } else {
                nn_binary_n<V>(code, v[0], v[1]);
#pragma unroll
                for (int j = 0; j < V; j++)
                    cur[j] = v[0][j];
            }
        }
        nn_store_run<V>(s.y, (long long)i, s.y_half, cur);
    }
}

// The affine path when the constants vary along the last axis only (a per-channel chain over
// a channels-last tensor: dims N, H, W, C; fp16 X and output, C a multiple of 8 and at most
// NN_EW_LAST_MAX): the block works out each channel's coefficients once into shared memory,
// then each thread applies them to 8 values at a time (one 16-byte load and store).
template <typename Idx>
__device__ __forceinline__ void nn_eltwise_affine_last(const NnEltwise& s)
{
    __shared__ float coef[2][NN_EW_LAST_MAX];
    const int c = s.dims[3];
    for (int k = threadIdx.x; k < c; k += blockDim.x)
        nn_affine_coefficients(s, 0, 0, 0, k, coef[0][k], coef[1][k]);
    __syncthreads();
    const unsigned short* __restrict__ x = (const unsigned short*)s.operand[s.affine_x];
    unsigned short* __restrict__ y = (unsigned short*)s.y;
    const Idx total = (Idx)s.dims[0] * s.dims[1] * s.dims[2] * (Idx)c / 8;
    for (Idx iv = blockIdx.x * (Idx)blockDim.x + threadIdx.x; iv < total;
         iv += (Idx)gridDim.x * blockDim.x) {
        const Idx i = iv * 8;
        const int c0 = (int)(i % (Idx)c);
        const uint4 q = __ldg((const uint4*)(x + i));
        unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int ch = c0 + 2 * k;
            const float lo = nn_affine_apply(s, coef[0][ch], coef[1][ch],
                                             half_bits_to_float((unsigned short)(w[k] & 0xffffu)));
            const float hi = nn_affine_apply(s, coef[0][ch + 1], coef[1][ch + 1],
                                             half_bits_to_float((unsigned short)(w[k] >> 16)));
            w[k] = nn_pack2(float_to_half_bits(lo), float_to_half_bits(hi));
        }
        *(uint4*)(y + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// A fused chain of elementwise operators over a 4-D output (grid-stride). Operand k of op i:
// ref -1 = the chain's value so far, else operand table entry; each operand is broadcast to the
// output's 4-D shape by its strides (0 along broadcast axes). 32-bit index math when the tensor
// allows (the divisions dominate otherwise).
#if NN_IN_PART(0)
extern "C" __global__ void nn_eltwise(const NnEltwise* __restrict__ p)
{
    __shared__ NnEltwise s;
    for (int k = threadIdx.x; k < (int)(sizeof(NnEltwise) / 4); k += blockDim.x)
        ((int*)&s)[k] = ((const int*)p)[k];
    __syncthreads();
    const long long total = (long long)s.dims[0] * s.dims[1] * s.dims[2] * s.dims[3];
    const bool small = total + (long long)gridDim.x * blockDim.x < 2147483647ll;
    if (s.affine_x >= 0 && s.affine_last) {
        if (small)
            nn_eltwise_affine_last<unsigned int>(s);
        else
            nn_eltwise_affine_last<long long>(s);
    } else if (s.affine_x >= 0 && s.dims[3] % NN_EW_AFFINE_VEC == 0) {
        if (small)
            nn_eltwise_affine_body<unsigned int, NN_EW_AFFINE_VEC>(s);
        else
            nn_eltwise_affine_body<long long, NN_EW_AFFINE_VEC>(s);
    } else if (s.dims[3] % NN_EW_VEC == 0) {
        if (small)
            nn_eltwise_body<unsigned int, NN_EW_VEC>(s, blockIdx.x * blockDim.x + threadIdx.x,
                                                     gridDim.x * blockDim.x);
        else
            nn_eltwise_body<long long, NN_EW_VEC>(s, blockIdx.x * (long long)blockDim.x + threadIdx.x,
                                                  (long long)gridDim.x * blockDim.x);
    } else if (small) {
        nn_eltwise_body<unsigned int, 1>(s, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
    } else {
        nn_eltwise_body<long long, 1>(s, blockIdx.x * (long long)blockDim.x + threadIdx.x,
                                      (long long)gridDim.x * blockDim.x);
    }
}
#endif

// One value a thread of the block, one chain after the other: the statistics were stored by
// this block, hence the loads through L2. The host gives a tail only small chains over
// statistics and constants that the launched kernel would run through this same plain
// interpreter (program::stat_chains and its caller).
__device__ void nn_gram_tails(const NnMomentsGram* __restrict__ p)
{
    for (int k = 0; k < NN_GRAM_TAILS && p->tail[k]; k++) {
        __syncthreads(); // the statistics (or the previous chain's values) are stored
        nn_eltwise_body<unsigned int, 1, true>(*(const NnEltwise*)p->tail[k], threadIdx.x, blockDim.x);
    }
}

// ---------------------------------------------------------------------------------------------
// Data movement

template <typename Idx>
__device__ __forceinline__ void nn_copy_body(const NnCopy* __restrict__ p)
{
    const Idx d1 = p->dims[1], d2 = p->dims[2], d3 = p->dims[3];
    const Idx total = (Idx)p->dims[0] * d1 * d2 * d3;
    for (Idx i = blockIdx.x * (Idx)blockDim.x + threadIdx.x; i < total;
         i += (Idx)gridDim.x * blockDim.x) {
        Idx r = i;
        const Idx i3 = r % d3;
        r /= d3;
        const Idx i2 = r % d2;
        r /= d2;
        const Idx i1 = r % d1;
        const Idx i0 = r / d1;
        long long s = p->src_offset + (long long)i0 * p->src_strides[0] +
                      (long long)i1 * p->src_strides[1] + (long long)i2 * p->src_strides[2] +
                      (long long)i3 * p->src_strides[3];
        long long d = p->dst_offset + (long long)i0 * p->dst_strides[0] +
                      (long long)i1 * p->dst_strides[1] + (long long)i2 * p->dst_strides[2] +
                      (long long)i3 * p->dst_strides[3];
        nn_store(p->dst, d, p->dst_half, nn_load(p->src, s, p->src_half));
    }
}

// dst[dst_offset + sum(i_k * dst_strides[k])] = src[src_offset + sum(i_k * src_strides[k])]
// over the 4-D index space dims (32-bit index math when the tensors allow).
#if NN_IN_PART(0)
extern "C" __global__ void nn_copy(const NnCopy* __restrict__ p)
{
    const long long total = (long long)p->dims[0] * p->dims[1] * p->dims[2] * p->dims[3];
    if (total + (long long)gridDim.x * blockDim.x < 2147483647ll)
        nn_copy_body<unsigned int>(p);
    else
        nn_copy_body<long long>(p);
}
#endif

// Separable resize of the last two axes of [planes, in_h, in_w] to [planes, out_h, out_w]: each
// output row and column reads two source rows/columns with the weights of the taps tables
// (int i0, int i1, float w0, float w1 per entry, rows then columns), computed as the CPU
// reference does (resize along H first, then W).
template <typename Idx>
__device__ __forceinline__ void nn_resize_body(const NnResize* __restrict__ p)
{
    const Idx out_w = p->out_w, out_h = p->out_h;
    const Idx total = (Idx)p->planes * out_h * out_w;
    const int* taps = (const int*)p->taps;
    for (Idx i = blockIdx.x * (Idx)blockDim.x + threadIdx.x; i < total;
         i += (Idx)gridDim.x * blockDim.x) {
        const int ox = (int)(i % out_w);
        const Idx r = i / out_w;
        const int oy = (int)(r % out_h);
        const long long plane = (long long)(r / out_h);
        const long long base = plane * p->in_h * p->in_w;
        const float v = nn_resize_value(p->x, p->x_half, base,
                                        nn_taps(taps + 4 * oy, taps + 4 * (p->out_h + ox), p->in_w));
        nn_store(p->y, (long long)i, p->y_half, v);
    }
}

#if NN_IN_PART(0)
extern "C" __global__ void nn_resize(const NnResize* __restrict__ p)
{
    const long long total = (long long)p->planes * p->out_h * p->out_w;
    if (total + (long long)gridDim.x * blockDim.x < 2147483647ll)
        nn_resize_body<unsigned int>(p);
    else
        nn_resize_body<long long>(p);
}
#endif

// Softmax of each of `rows` rows of `len` values: one block per row, three passes.
#if NN_IN_PART(0)
// (launched with up to 1024 threads: softmax_threads)
extern "C" __global__ void __launch_bounds__(1024) nn_softmax(const NnSoftmax* __restrict__ p)
{
    __shared__ float fshared[32];
    __shared__ double dshared[32];
    __shared__ float row_max;
    __shared__ double row_sum;
    const long long base = (long long)blockIdx.x * p->len;
    float m = __int_as_float(0xff800000);
    for (long long i = threadIdx.x; i < p->len; i += blockDim.x)
        m = fmaxf(m, nn_load(p->x, base + i, p->x_half));
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0)
        fshared[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = __int_as_float(0xff800000);
        for (int k = 0; k < (int)(blockDim.x >> 5); k++)
            t = fmaxf(t, fshared[k]);
        row_max = t;
    }
    __syncthreads();
    const float mx = row_max;
    double s = 0.0;
    for (long long i = threadIdx.x; i < p->len; i += blockDim.x)
        s += (double)expf(nn_load(p->x, base + i, p->x_half) - mx);
    double total = nn_block_sum(s, dshared);
    if (threadIdx.x == 0)
        row_sum = total;
    __syncthreads();
    const float inv = (float)(1.0 / row_sum);
    for (long long i = threadIdx.x; i < p->len; i += blockDim.x)
        nn_store(p->y, base + i, p->y_half, expf(nn_load(p->x, base + i, p->x_half) - mx) * inv);
}
#endif

// atomicAdd on doubles: native from sm_60, a compare-and-swap loop before
__device__ __forceinline__ void nn_atomic_add_f64(double* a, double v)
{
#if __CUDA_ARCH__ >= 600
    atomicAdd(a, v);
#else
    unsigned long long* bits = (unsigned long long*)a;
    unsigned long long seen = *bits, assumed;
    do {
        assumed = seen;
        seen = atomicCAS(bits, assumed,
                         (unsigned long long)__double_as_longlong(__longlong_as_double((long long)assumed) + v));
    } while (assumed != seen);
#endif
}

// Calibration (not in a program): a stage output's finite values' sum of squares and largest
// magnitude, and how many values are not finite, added into the parameter block's result
// fields; the host reads the 40-byte block back, not the whole tensor. Each thread sums its
// values in double, as the host's record does.
#if NN_IN_PART(0)
extern "C" __global__ void nn_range(NnRange* __restrict__ p)
{
    const long long n = (long long)p->n;
    const bool half = p->half;
    float absmax = 0.0f;
    double sum_squares = 0.0;
    unsigned int non_finite = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = half ? half_bits_to_float(((const unsigned short*)p->x)[i]) : ((const float*)p->x)[i];
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
            non_finite++;
        } else {
            absmax = fmaxf(absmax, fabsf(v));
            sum_squares += (double)v * (double)v;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, o));
        sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, o);
        non_finite += __shfl_xor_sync(0xffffffffu, non_finite, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&p->absmax_bits, __float_as_uint(absmax));
        nn_atomic_add_f64(&p->sum_squares, sum_squares);
        if (non_finite)
            atomicAdd(&p->non_finite, non_finite);
    }
}
#endif
