// toonflow neural frame kernels: the conversions around the style network on the device
// (src/cuda/neural_frame.rs builds and launches them; the structs and the NF_CODE_VALUE table
// come from kernel_abi, prepended by the build). The CPU reference is src/neural/frame.rs
// (NV12 <-> RGB, reflect padding, value range, layout) and src/neural/temporal.rs (the output
// filter, the scene-cut gate); the arithmetic follows it operation by operation (compiled
// without FMA contraction), so the device and the reference differ by float rounding only.
//
// Kernels, in frame order (all captured in the network's CUDA graph):
//   nf_thumb_sums      luma sums of the 64x36 thumbnail blocks (integer, exact)
//   nf_scene           the scene-cut score against the previous thumbnail; a cut clears the
//                      output ring for this frame and sets the network's statistics reset
//   nf_nv12_to_tensor  NV12 -> the network's input, fp32 or fp16 (centred chroma with the block
//                      correction, the caps' matrix and range, below model-scale 1 the area
//                      average, reflect padding, value range, NHWC or NCHW)
//   nf_tensor_to_nv12  model-scale 1: the network's output (fp32 or fp16) -> the temporal
//                      output filter against the ring of recent raw outputs (8-bit) -> NV12,
//                      one thread per 2x2 block
//   nf_filter_scaled   below model-scale 1: the output filter at the network's content size
//   nf_upscale_to_nv12 then the bilinear upscale to the frame -> NV12, one thread per 2x2 block

#define NF_BLOCK 256

// Sum of a block's values in thread 0 (blockDim.x == NF_BLOCK).
__device__ __forceinline__ float nf_block_sum(float v, float* shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.x == 0)
        for (int i = 0; i < NF_BLOCK / 32; i++)
            total += shared[i];
    return total;
}

// First pixel of thumbnail block b of `blocks` over `size` (src/pipeline/analysis.rs). In 32
// bits: b <= blocks <= 64 and size <= 8192 (FrameGeometry::MAX_SIZE) keep the product far
// below 2^32, and a 64-bit division costs nf_scene's single block several times its loop.
__device__ __forceinline__ int nf_block_start(int b, int blocks, int size)
{
    return (int)((unsigned)b * (unsigned)size / (unsigned)blocks);
}

// grid (thumb_w, thumb_h), NF_BLOCK threads.
extern "C" __global__ void nf_thumb_sums(const NfFrame* p)
{
    __shared__ unsigned int partial[NF_BLOCK / 32];
    const int bx = blockIdx.x, by = blockIdx.y;
    const int x0 = nf_block_start(bx, p->thumb_w, p->width);
    const int x1 = nf_block_start(bx + 1, p->thumb_w, p->width);
    const int y0 = nf_block_start(by, p->thumb_h, p->height);
    const int y1 = nf_block_start(by + 1, p->thumb_h, p->height);
    const int cols = x1 - x0, n = cols * (y1 - y0);
    const unsigned char* luma = (const unsigned char*)p->nv12_in;
    unsigned int sum = 0;
    for (int i = threadIdx.x; i < n; i += NF_BLOCK) {
        const int r = i / cols, c = i - r * cols;
        sum += luma[(long long)(y0 + r) * p->width + x0 + c];
    }
    for (int o = 16; o > 0; o >>= 1)
        sum += __shfl_down_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0)
        partial[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int total = 0;
        for (int i = 0; i < NF_BLOCK / 32; i++)
            total += partial[i];
        ((unsigned int*)p->thumb_sums)[by * NF_THUMB_STRIDE + bx] = total;
    }
}

// One block of NF_BLOCK threads: thumbnail means in L units, the mean absolute change against
// the previous frame's, the cut decision; the means become the next frame's reference.
extern "C" __global__ void nf_scene(const NfFrame* p)
{
    __shared__ float partial[NF_BLOCK / 32];
    const NfControl* ctl = (const NfControl*)p->control;
    NfState* state = (NfState*)p->state;
    const unsigned int* sums = (const unsigned int*)p->thumb_sums;
    float* previous = (float*)p->thumb_previous;
    const int tw = p->thumb_w, th = p->thumb_h, n = tw * th;
    const int has_previous = state->has_previous && !ctl->reset;
    float change = 0.0f;
    for (int i = threadIdx.x; i < n; i += NF_BLOCK) {
        const int by = i / tw, bx = i - by * tw;
        const int rows = nf_block_start(by + 1, th, p->height) - nf_block_start(by, th, p->height);
        const int cols = nf_block_start(bx + 1, tw, p->width) - nf_block_start(bx, tw, p->width);
        const float mean =
            100.0f * (float)sums[by * NF_THUMB_STRIDE + bx] / (255.0f * (float)(rows * cols));
        change += fabsf(previous[i] - mean);
        previous[i] = mean;
    }
    const float total = nf_block_sum(change, partial);
    if (threadIdx.x == 0) {
        const float score = has_previous ? total / (float)n : 0.0f;
        const int cut = score > ctl->threshold;
        state->cut = cut;
        state->score = score;
        state->has_previous = 1;
        if (cut)
            ((NnControl*)p->net_control)->reset = 1;
        // The ring's entries since the last cut or reset: the host plans a frame's ring slots
        // before it has seen the verdicts of the frames still in flight, so the device trims
        // the plan to what is left after them.
        const int kept = (cut || ctl->reset) ? 0 : state->kept;
        state->used = min(ctl->used, kept);
        state->kept = min(kept + (ctl->write_slot >= 0 ? 1 : 0), NF_MAX_HISTORY);
    }
}

// nf_reflect, nf_chroma and nf_pixel_rgb (NV12 -> nominal RGB): kernels/nv12.cuh, shared with
// the stem's NV12 gather in neural.cu.

// Whether the network runs at another size than the frame (model-scale below 1).
__device__ __forceinline__ int nf_scaled(const NfFrame* p)
{
    return p->scaled_w != p->width || p->scaled_h != p->height;
}

// Sample (sx, sy) of a separable resampling, as resample_plane computes it: along x per
// source row (a sum from 0 in tap order), then along y over those row results.
// `value(x, y, rgb)` gives the source's three channels.
template <typename Source>
__device__ void nf_resample(const NfTaps* along_x, const NfTaps* along_y, int sx, int sy,
                            Source value, float out[3])
{
    const NfTaps tx = along_x[sx], ty = along_y[sy];
    float col[3] = {0.0f, 0.0f, 0.0f};
    for (int j = 0; j < ty.count; j++) {
        float row[3] = {0.0f, 0.0f, 0.0f};
        for (int i = 0; i < tx.count; i++) {
            float v[3];
            value(tx.first + i, ty.first + j, v);
            for (int c = 0; c < 3; c++)
                row[c] += tx.weights[i] * v[c];
        }
        for (int c = 0; c < 3; c++)
            col[c] += ty.weights[j] * row[c];
    }
    for (int c = 0; c < 3; c++)
        out[c] = col[c];
}

// grid over the padded network size, 16x16 threads: one input pixel each (at model-scale
// below 1 the exact area average of the frame's pixels it covers).
extern "C" __global__ void nf_nv12_to_tensor(const NfFrame* p)
{
    const int px = blockIdx.x * blockDim.x + threadIdx.x;
    const int py = blockIdx.y * blockDim.y + threadIdx.y;
    if (px >= p->net_w || py >= p->net_h)
        return;
    const int sx = nf_reflect(px, p->scaled_w), sy = nf_reflect(py, p->scaled_h);
    float rgb[3];
    const NfRgbConstants k = nf_rgb_constants(p);
    if (nf_scaled(p))
        nf_resample((const NfTaps*)p->down_x, (const NfTaps*)p->down_y, sx, sy,
                    [&k](int x, int y, float v[3]) { nf_pixel_rgb(k, x, y, v); }, rgb);
    else
        nf_pixel_rgb(k, sx, sy, rgb);
    const long long plane = (long long)p->net_w * p->net_h;
    const long long at = (long long)py * p->net_w + px;
    for (int c = 0; c < 3; c++) {
        const float v = nf_input_value(k, rgb[c]);
        const long long i = p->nchw ? c * plane + at : at * 3 + c;
        if (p->in_half) // rounded as the convolution that reads it would round it
            ((unsigned short*)p->tensor_in)[i] = float_to_half_bits(v);
        else
            ((float*)p->tensor_in)[i] = v;
    }
}

// 8-bit code: half away from zero, clamped.
__device__ __forceinline__ unsigned char nf_code(float v)
{
    return (unsigned char)fminf(fmaxf(roundf(v), 0.0f), 255.0f);
}

// A ring entry's code of a nominal value: [0, 1] in 255 steps, half away from zero
// (ring_code in src/neural/temporal.rs).
__device__ __forceinline__ unsigned char nf_ring_code(float v)
{
    return (unsigned char)roundf(fminf(fmaxf(v, 0.0f), 1.0f) * 255.0f);
}

// Value i of the network's output (fp32, or fp16 with out_half).
__device__ __forceinline__ float nf_output_value(const NfFrame* p, long long i)
{
    return p->out_half ? half_bits_to_float(((const unsigned short*)p->tensor_out)[i])
                       : ((const float*)p->tensor_out)[i];
}

// The temporal output filter at content pixel (x, y) of the network's output: the raw
// output against the `used` most recent ring entries (8-bit codes, three planes of
// scaled_w x scaled_h), the raw output into the ring's write slot; `rgb` gets the filtered
// nominal RGB.
__device__ void nf_filter(const NfFrame* p, int used, int x, int y, float rgb[3])
{
    const NfControl* ctl = (const NfControl*)p->control;
    const float kr = p->kr, kb = p->kb, kg = 1.0f - kr - kb;
    // the chroma distances' coefficients, as the CPU filter computes them (no division a
    // ring entry)
    const float cb_units = p->chroma_units / (2.0f * (1.0f - kb));
    const float cr_units = p->chroma_units / (2.0f * (1.0f - kr));
    const float inv = 1.0f / p->v_scale;
    unsigned char* ring = (unsigned char*)p->ring;
    const long long plane = (long long)p->scaled_w * p->scaled_h;
    const long long net_plane = (long long)p->net_w * p->net_h;
    const long long at = (long long)y * p->net_w + x, pixel = (long long)y * p->scaled_w + x;
    float f0[3];
    for (int c = 0; c < 3; c++)
        f0[c] = (nf_output_value(p, p->nchw ? c * net_plane + at : at * 3 + c) - p->v_offset) * inv;
    float acc[3] = {f0[0], f0[1], f0[2]};
    float wsum = 1.0f, sk = 1.0f;
    for (int k = 0; k < used; k++) {
        sk *= ctl->strength;
        const unsigned char* slot = ring + (long long)ctl->recent[k] * 3 * plane;
        float fk[3];
        for (int c = 0; c < 3; c++)
            fk[c] = NF_CODE_VALUE[slot[c * plane + pixel]]; // code / 255, as ring_value
        const float d0 = fk[0] - f0[0], d1 = fk[1] - f0[1], d2 = fk[2] - f0[2];
        const float dy = kr * d0 + kg * d1 + kb * d2;
        const float dl = p->luma_units * dy;
        const float dcb = cb_units * (d2 - dy);
        const float dcr = cr_units * (d0 - dy);
        const float wk = sk * expf(ctl->motion_coeff * (dl * dl + dcb * dcb + dcr * dcr));
        for (int c = 0; c < 3; c++)
            acc[c] += wk * fk[c];
        wsum += wk;
    }
    // the raw output joins the ring after the recent entries were read (its slot may be the
    // oldest of them)
    if (ctl->write_slot >= 0) {
        unsigned char* slot = ring + (long long)ctl->write_slot * 3 * plane;
        for (int c = 0; c < 3; c++)
            slot[c * plane + pixel] = nf_ring_code(f0[c]);
    }
    const float inv_wsum = 1.0f / wsum;
    for (int c = 0; c < 3; c++)
        rgb[c] = acc[c] * inv_wsum;
}

// Ring entries the filter reads this frame (nf_scene's count: none after a scene cut, which
// empties the ring).
__device__ __forceinline__ int nf_used(const NfFrame* p)
{
    return ((const NfState*)p->state)->used;
}

// Packs the 2x2 block (cx, cy) of nominal RGB `rgb[q]` (q = 2·dy + dx) as NV12 codes: Y per
// pixel, Cb/Cr the block's mean.
__device__ void nf_pack_block(const NfFrame* p, int cx, int cy, const float rgb[4][3])
{
    const int w = p->width;
    const float kr = p->kr, kb = p->kb, kg = 1.0f - kr - kb;
    const float pb_div = 2.0f * (1.0f - kb), pr_div = 2.0f * (1.0f - kr);
    unsigned char* luma = (unsigned char*)p->nv12_out;
    float pb_sum = 0.0f, pr_sum = 0.0f;
    for (int q = 0; q < 4; q++) {
        const int x = 2 * cx + (q & 1), y = 2 * cy + (q >> 1);
        const float r = rgb[q][0], g = rgb[q][1], b = rgb[q][2];
        const float yv = kr * r + kg * g + kb * b;
        luma[(long long)y * w + x] = nf_code(p->y_offset + p->y_scale * yv);
        pb_sum += (b - yv) / pb_div;
        pr_sum += (r - yv) / pr_div;
    }
    unsigned char* uv = luma + (long long)w * p->height + (long long)cy * w + 2 * cx;
    uv[0] = nf_code(128.0f + p->c_scale * 0.25f * pb_sum);
    uv[1] = nf_code(128.0f + p->c_scale * 0.25f * pr_sum);
}

// Model-scale 1. grid over the chroma blocks (width/2 x height/2), 16x16 threads: one 2x2
// block each, filtered and packed.
extern "C" __global__ void nf_tensor_to_nv12(const NfFrame* p)
{
    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx >= p->width / 2 || cy >= p->height / 2)
        return;
    const int used = nf_used(p);
    float rgb[4][3];
    for (int q = 0; q < 4; q++)
        nf_filter(p, used, 2 * cx + (q & 1), 2 * cy + (q >> 1), rgb[q]);
    nf_pack_block(p, cx, cy, rgb);
}

// Model-scale below 1, first half. grid over the content (scaled_w x scaled_h), 16x16
// threads: the output filter per pixel into scaled_rgb ([3][scaled_h][scaled_w], fp32).
extern "C" __global__ void nf_filter_scaled(const NfFrame* p)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= p->scaled_w || y >= p->scaled_h)
        return;
    float rgb[3];
    nf_filter(p, nf_used(p), x, y, rgb);
    float* out = (float*)p->scaled_rgb;
    const long long plane = (long long)p->scaled_w * p->scaled_h;
    for (int c = 0; c < 3; c++)
        out[c * plane + (long long)y * p->scaled_w + x] = rgb[c];
}

// Model-scale below 1, second half. grid over the chroma blocks, 16x16 threads: each pixel
// of a 2x2 block upscaled bilinearly from scaled_rgb, the block packed.
extern "C" __global__ void nf_upscale_to_nv12(const NfFrame* p)
{
    const int cx = blockIdx.x * blockDim.x + threadIdx.x;
    const int cy = blockIdx.y * blockDim.y + threadIdx.y;
    if (cx >= p->width / 2 || cy >= p->height / 2)
        return;
    const float* src = (const float*)p->scaled_rgb;
    const int sw = p->scaled_w;
    const long long plane = (long long)sw * p->scaled_h;
    const auto value = [src, sw, plane](int x, int y, float v[3]) {
        for (int c = 0; c < 3; c++)
            v[c] = src[c * plane + (long long)y * sw + x];
    };
    float rgb[4][3];
    for (int q = 0; q < 4; q++)
        nf_resample((const NfTaps*)p->up_x, (const NfTaps*)p->up_y, 2 * cx + (q & 1),
                    2 * cy + (q >> 1), value, rgb[q]);
    nf_pack_block(p, cx, cy, rgb);
}
