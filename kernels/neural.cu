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
//   nn_moments         per-channel mean and variance (double sums; the last block of a channel
//                      finishes it) and the temporal statistics smoother
//   nn_norm_apply      InstanceNormalization's (x - mean) / sqrt(var + eps) * scale + bias, act
//   nn_eltwise         a fused chain of elementwise operators with broadcast operands
//   nn_copy            strided 4-D copy (Transpose, Concat, Reshape and friends) with conversion
//   nn_resize          separable resize of the last two axes from host-computed taps
//   nn_softmax         softmax over rows (one block per row)
//   nn_nv12_to_tensor / nn_tensor_to_nv12: the frame conversions at model-scale 1

#define NN_ACT_NONE 0
#define NN_ACT_RELU 1
#define NN_ACT_LEAKY 2
#define NN_ACT_SIGMOID 3
#define NN_ACT_TANH 4
#define NN_ACT_CLIP 5

__device__ __forceinline__ float nn_h2f(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short nn_f2h(float v)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// Loads element i of a buffer stored as half (is_half) or float.
__device__ __forceinline__ float nn_load(unsigned long long p, long long i, int is_half)
{
    if (is_half)
        return nn_h2f(__ldg((const unsigned short*)p + i));
    return __ldg((const float*)p + i);
}

__device__ __forceinline__ void nn_store(unsigned long long p, long long i, int is_half, float v)
{
    if (is_half)
        ((unsigned short*)p)[i] = nn_f2h(v);
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
        return nn_h2f(__ldg(p + i));
    }
    static __device__ __forceinline__ void store(unsigned short* p, long long i, float v)
    {
        p[i] = nn_f2h(v);
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
// M = output pixels, N = output channels, K = taps x input channels (tap-major, 16 channels per
// step, zero beyond cin). Each warp computes 16 pixels x up to NN_MMA_NT*8 channels; A fragments
// are gathered straight from the fp16 NCHW input with the same padding index math as above, B
// fragments come from fp16 weights laid out [tap][n (n_tiles*8)][cin_pad] by the host. Groups 1.
template <typename O>
__device__ __forceinline__ void nn_conv_mma_body(const NnConv* __restrict__ p)
{
#if __CUDA_ARCH__ >= 800
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int M = p->oh * p->ow;
    const int mbase = (blockIdx.x * NN_MMA_WARPS + warp) * 16;
    if (mbase >= M)
        return;
    const int nt0 = blockIdx.y * NN_MMA_NT;
    const int ntn = min(NN_MMA_NT, p->n_tiles - nt0);
    const int npad = p->n_tiles * 8;
    const int cin = p->cin, cin_pad = p->cin_pad;
    const long long plane = (long long)p->h * p->w_in;
    const unsigned short* __restrict__ x = (const unsigned short*)p->x;
    const unsigned short* __restrict__ wh = (const unsigned short*)p->wh;
    int oy[2], ox[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int m = mbase + g + 8 * r;
        valid[r] = m < M;
        m = min(m, M - 1);
        oy[r] = m / p->ow;
        ox[r] = m - oy[r] * p->ow;
    }
    const unsigned short fill_bits = nn_f2h(p->pad_value);
    float acc[NN_MMA_NT][4];
#pragma unroll
    for (int n = 0; n < NN_MMA_NT; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (int ky = 0; ky < p->kh; ky++) {
        for (int kx = 0; kx < p->kw; kx++) {
            long long off[2];
            unsigned short fill[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int py = oy[r] * p->sh - p->conv_pt + ky * p->dh;
                int px = ox[r] * p->sw - p->conv_pl + kx * p->dw;
                bool zero = py < 0 || py >= p->hp || px < 0 || px >= p->wp;
                int iy = nn_pad_index(py - p->pad_t, p->h, p->pad_mode);
                int ix = nn_pad_index(px - p->pad_l, p->w_in, p->pad_mode);
                off[r] = (zero || iy < 0 || ix < 0) ? -1 : (long long)iy * p->w_in + ix;
                fill[r] = zero ? (unsigned short)0 : fill_bits;
            }
            const unsigned short* wt = wh + (long long)(ky * p->kw + kx) * npad * cin_pad;
            for (int icb = 0; icb < cin_pad; icb += 16) {
                unsigned int a[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int r = q & 1;
                    const int ic = icb + 2 * t + ((q >> 1) << 3);
                    unsigned short lo = 0, hi = 0;
                    if (off[r] < 0) {
                        lo = ic < cin ? fill[r] : (unsigned short)0;
                        hi = ic + 1 < cin ? fill[r] : (unsigned short)0;
                    } else {
                        if (ic < cin)
                            lo = __ldg(x + ic * plane + off[r]);
                        if (ic + 1 < cin)
                            hi = __ldg(x + (ic + 1) * plane + off[r]);
                    }
                    a[q] = (unsigned int)lo | ((unsigned int)hi << 16);
                }
#pragma unroll
                for (int n = 0; n < NN_MMA_NT; n++) {
                    if (n < ntn) {
                        const unsigned short* wn = wt + (long long)((nt0 + n) * 8 + g) * cin_pad + icb;
                        const unsigned int b0 = __ldg((const unsigned int*)(wn + 2 * t));
                        const unsigned int b1 = __ldg((const unsigned int*)(wn + 2 * t + 8));
                        asm volatile(
                            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                            : "+f"(acc[n][0]), "+f"(acc[n][1]), "+f"(acc[n][2]), "+f"(acc[n][3])
                            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
                    }
                }
            }
        }
    }
    typename O::T* __restrict__ y = (typename O::T*)p->y;
    const long long oplane = (long long)M;
#pragma unroll
    for (int n = 0; n < NN_MMA_NT; n++) {
        if (n >= ntn)
            continue;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = q >> 1;
            const int oc = (nt0 + n) * 8 + 2 * t + (q & 1);
            if (!valid[r] || oc >= p->cout)
                continue;
            float v = acc[n][q] + (p->b ? ((const float*)p->b)[oc] : 0.0f);
            const long long m = mbase + g + 8 * r;
            O::store(y, oc * oplane + m, nn_activate(v, p->act, p->act_a, p->act_b));
        }
    }
#endif
}

extern "C" __global__ void nn_conv_mma_hf(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF32>(p); }
extern "C" __global__ void nn_conv_mma_hh(const NnConv* __restrict__ p) { nn_conv_mma_body<NnF16>(p); }

extern "C" __global__ void nn_conv_ff(const NnConv* __restrict__ p) { nn_conv_body<NnF32, NnF32>(p); }
extern "C" __global__ void nn_conv_fh(const NnConv* __restrict__ p) { nn_conv_body<NnF32, NnF16>(p); }
extern "C" __global__ void nn_conv_hf(const NnConv* __restrict__ p) { nn_conv_body<NnF16, NnF32>(p); }
extern "C" __global__ void nn_conv_hh(const NnConv* __restrict__ p) { nn_conv_body<NnF16, NnF16>(p); }

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

// grid (blocks per channel, channels), NN_MOMENTS_THREADS threads. Each block sums its share of
// a channel's plane (sum and sum of squares, double); the last block of the channel (counted
// with an atomic, reset by that block) adds the partials in a fixed order, writes mean and
// variance, then applies the smoother:
//   smoothing a = 0: the frame's own statistics (state untouched);
//   first frame (state not primed, or control->reset): the frame's own, stored;
//   else, per channel with finite statistics: state = a*state + (1-a)*frame, used.
extern "C" __global__ void nn_moments(const NnMoments* __restrict__ p)
{
    __shared__ double shared[32];
    __shared__ int last;
    const int c = blockIdx.y;
    const long long hw = p->hw;
    const long long chunk = (hw + gridDim.x - 1) / gridDim.x;
    const long long begin = blockIdx.x * chunk;
    const long long end = min(hw, begin + chunk);
    const long long base = (long long)c * hw;
    double s = 0.0, ss = 0.0;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        double v = nn_load(p->x, base + i, p->x_half);
        s += v;
        ss += v * v;
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
    if (var < 0.0)
        var = 0.0;
    float m = (float)mean, v = (float)var;
    const NnControl* ctl = (const NnControl*)p->control;
    const float a = ctl->smoothing;
    if (a > 0.0f) {
        float* sm = (float*)p->state_mean;
        float* sv = (float*)p->state_var;
        int* primed = (int*)p->state_primed;
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
    ((float*)p->mean)[c] = m;
    ((float*)p->var)[c] = v;
}

// y = (x - mean[c]) / sqrt(var[c] + eps) * scale[c] + bias[c], then the activation.
extern "C" __global__ void nn_norm_apply(const NnNormApply* __restrict__ p)
{
    const long long total = (long long)p->c * p->hw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)(i / p->hw);
        float m = ((const float*)p->mean)[c];
        float v = ((const float*)p->var)[c];
        float inv = 1.0f / sqrtf(v + p->eps);
        float s = p->scale ? ((const float*)p->scale)[c] : 1.0f;
        float b = p->bias ? ((const float*)p->bias)[c] : 0.0f;
        float x = nn_load(p->x, i, p->x_half);
        float y = (x - m) * inv * s + b;
        nn_store(p->y, i, p->y_half, nn_activate(y, p->act, p->act_a, p->act_b));
    }
}

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

// One thread per output element (grid-stride). Operand k of op i: ref -1 = the chain's value so
// far, else operand table entry; each operand is broadcast to the output's 4-D shape by its
// strides (0 along broadcast axes).
extern "C" __global__ void nn_eltwise(const NnEltwise* __restrict__ p)
{
    __shared__ NnEltwise s;
    for (int k = threadIdx.x; k < (int)(sizeof(NnEltwise) / 4); k += blockDim.x)
        ((int*)&s)[k] = ((const int*)p)[k];
    __syncthreads();
    const long long d1 = s.dims[1], d2 = s.dims[2], d3 = s.dims[3];
    const long long total = (long long)s.dims[0] * d1 * d2 * d3;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        const int i3 = (int)(r % d3);
        r /= d3;
        const int i2 = (int)(r % d2);
        r /= d2;
        const int i1 = (int)(r % d1);
        const int i0 = (int)(r / d1);
        float cur = 0.0f;
        for (int o = 0; o < s.n_ops; o++) {
            float v[2];
            for (int k = 0; k < 2; k++) {
                int ref = k == 0 ? s.op_a[o] : s.op_b[o];
                if (ref < 0) {
                    v[k] = cur;
                } else {
                    const int* st = s.strides + 4 * ref;
                    long long at = (long long)i0 * st[0] + (long long)i1 * st[1] +
                                   (long long)i2 * st[2] + (long long)i3 * st[3];
                    v[k] = nn_load(s.operand[ref], at, s.operand_half[ref]);
                }
                if (s.op_code[o] >= NN_EW_FIRST_UNARY)
                    break;
            }
            cur = s.op_code[o] >= NN_EW_FIRST_UNARY
                      ? nn_unary(s.op_code[o], v[0], s.op_p0[o], s.op_p1[o])
                      : nn_binary(s.op_code[o], v[0], v[1]);
        }
        nn_store(s.y, i, s.y_half, cur);
    }
}

// ---------------------------------------------------------------------------------------------
// Data movement

// dst[dst_offset + sum(i_k * dst_strides[k])] = src[src_offset + sum(i_k * src_strides[k])]
// over the 4-D index space dims.
extern "C" __global__ void nn_copy(const NnCopy* __restrict__ p)
{
    const long long d1 = p->dims[1], d2 = p->dims[2], d3 = p->dims[3];
    const long long total = (long long)p->dims[0] * d1 * d2 * d3;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        const long long i3 = r % d3;
        r /= d3;
        const long long i2 = r % d2;
        r /= d2;
        const long long i1 = r % d1;
        const long long i0 = r / d1;
        long long s = p->src_offset + i0 * p->src_strides[0] + i1 * p->src_strides[1] +
                      i2 * p->src_strides[2] + i3 * p->src_strides[3];
        long long d = p->dst_offset + i0 * p->dst_strides[0] + i1 * p->dst_strides[1] +
                      i2 * p->dst_strides[2] + i3 * p->dst_strides[3];
        nn_store(p->dst, d, p->dst_half, nn_load(p->src, s, p->src_half));
    }
}

// Separable resize of the last two axes of [planes, in_h, in_w] to [planes, out_h, out_w]: each
// output row and column reads two source rows/columns with the weights of the taps tables
// (int i0, int i1, float w0, float w1 per entry, rows then columns), computed as the CPU
// reference does (resize along H first, then W).
extern "C" __global__ void nn_resize(const NnResize* __restrict__ p)
{
    const long long total = (long long)p->planes * p->out_h * p->out_w;
    const int* taps = (const int*)p->taps;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int ox = (int)(i % p->out_w);
        const long long r = i / p->out_w;
        const int oy = (int)(r % p->out_h);
        const long long plane = r / p->out_h;
        const int* ty = taps + 4 * oy;
        const int* tx = taps + 4 * (p->out_h + ox);
        const long long base = plane * p->in_h * p->in_w;
        float wy0 = __int_as_float(ty[2]), wy1 = __int_as_float(ty[3]);
        float wx0 = __int_as_float(tx[2]), wx1 = __int_as_float(tx[3]);
        // along H first (as the CPU reference), then along W
        float a0 = nn_load(p->x, base + (long long)ty[0] * p->in_w + tx[0], p->x_half);
        float a1 = nn_load(p->x, base + (long long)ty[0] * p->in_w + tx[1], p->x_half);
        float b0 = a0, b1 = a1;
        if (wy1 != 0.0f) {
            b0 = nn_load(p->x, base + (long long)ty[1] * p->in_w + tx[0], p->x_half);
            b1 = nn_load(p->x, base + (long long)ty[1] * p->in_w + tx[1], p->x_half);
            a0 = wy0 * a0 + wy1 * b0;
            a1 = wy0 * a1 + wy1 * b1;
        }
        float v = wx1 != 0.0f ? wx0 * a0 + wx1 * a1 : a0;
        nn_store(p->y, i, p->y_half, v);
    }
}

// Softmax of each of `rows` rows of `len` values: one block per row, three passes.
extern "C" __global__ void nn_softmax(const NnSoftmax* __restrict__ p)
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
