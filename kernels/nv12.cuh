// NV12 -> the network's input values, shared by the frame path's conversion
// (neural_frame.cu: nf_nv12_to_tensor) and the stem's NV12 gather (neural.cu: the tap-packed
// staging), which must give the same bits. The host prepends this file to both translation
// units, after the ABI (NfFrame) and the fp16 helpers (src/cuda/kernels.rs). The arithmetic
// follows the CPU reference (src/neural/frame.rs, nv12_to_rgb) operation by operation; every
// operation is rounded on its own (_rn intrinsics), so that neural.cu, which NVRTC compiles with
// FMA contraction, computes what neural_frame.cu computes without it.
#pragma once

// Index of padded index i on an axis of n samples under ONNX reflect padding.
__device__ __forceinline__ int nf_reflect(int i, int n)
{
    if (i < n) // inside (the padding is at the end): no division
        return i;
    if (n <= 1)
        return 0;
    const int period = 2 * (n - 1);
    const int j = i % period;
    return j < n ? j : period - j;
}

// The chroma neighbour bilinear upsampling reads for luma index i (n chroma samples).
__device__ __forceinline__ int nf_chroma_neighbour(int i, int n)
{
    const int c = i / 2;
    return (i & 1) == 0 ? max(c - 1, 0) : min(c + 1, n - 1);
}

// a*wa + b*wb + c*wc in the reference's order.
__device__ __forceinline__ float nf_taps3(float a, float b, float c, float wa, float wb, float wc)
{
    return __fadd_rn(__fadd_rn(__fmul_rn(a, wa), __fmul_rn(b, wb)), __fmul_rn(c, wc));
}

// 0.75 a + 0.25 b (the bilinear pair), then minus `centre`.
__device__ __forceinline__ float nf_near(float a, float b, float centre)
{
    return __fsub_rn(__fadd_rn(__fmul_rn(0.75f, a), __fmul_rn(0.25f, b)), centre);
}

// Chroma of pixel (x, y) in codes minus 128, Cb and Cr together (they are interleaved, so
// each read is one 2-byte load), as nv12_to_rgb makes them: centred bilinear plus the block
// correction of its 2x2 block; each channel's arithmetic in the reference's order.
__device__ void nf_chroma(int w, int h, const unsigned char* uv, int x, int y, float out[2])
{
    const int cw = w / 2, ch = h / 2;
    const int cy = y / 2, c = x / 2, nb = nf_chroma_neighbour(x, cw);
    const uchar2* here = (const uchar2*)(uv + (long long)cy * w);
    const uchar2* above = (const uchar2*)(uv + (long long)max(cy - 1, 0) * w);
    const uchar2* below = (const uchar2*)(uv + (long long)min(cy + 1, ch - 1) * w);
    const uchar2* far = (const uchar2*)(uv + (long long)nf_chroma_neighbour(y, ch) * w);
    const int left = max(c - 1, 0), right = min(c + 1, cw - 1);
    const uchar2 a[3] = {above[left], above[c], above[right]};
    const uchar2 m[3] = {here[left], here[c], here[right]};
    const uchar2 b[3] = {below[left], below[c], below[right]};
    const uchar2 fc = far[c], hn = here[nb], fn = far[nb];
    // per channel: the vertical blur at three chroma columns, then across them
    const float bl0 = nf_taps3(a[0].x, m[0].x, b[0].x, 0.125f, 0.75f, 0.125f);
    const float bc0 = nf_taps3(a[1].x, m[1].x, b[1].x, 0.125f, 0.75f, 0.125f);
    const float br0 = nf_taps3(a[2].x, m[2].x, b[2].x, 0.125f, 0.75f, 0.125f);
    const float bl1 = nf_taps3(a[0].y, m[0].y, b[0].y, 0.125f, 0.75f, 0.125f);
    const float bc1 = nf_taps3(a[1].y, m[1].y, b[1].y, 0.125f, 0.75f, 0.125f);
    const float br1 = nf_taps3(a[2].y, m[2].y, b[2].y, 0.125f, 0.75f, 0.125f);
    const float res0 = __fsub_rn((float)m[1].x, nf_taps3(bl0, bc0, br0, 0.125f, 0.75f, 0.125f));
    const float res1 = __fsub_rn((float)m[1].y, nf_taps3(bl1, bc1, br1, 0.125f, 0.75f, 0.125f));
    const float near_c0 = nf_near((float)m[1].x, (float)fc.x, 128.0f);
    const float near_n0 = nf_near((float)hn.x, (float)fn.x, 128.0f);
    const float near_c1 = nf_near((float)m[1].y, (float)fc.y, 128.0f);
    const float near_n1 = nf_near((float)hn.y, (float)fn.y, 128.0f);
    out[0] = __fadd_rn(nf_near(near_c0, near_n0, 0.0f), res0);
    out[1] = __fadd_rn(nf_near(near_c1, near_n1, 0.0f), res1);
}

// What nf_pixel_rgb and nf_input_value take from the frame's block, its reciprocals and
// coefficients worked out once (the stem's gather converts hundreds of pixels a block, and
// each of those divisions is an IEEE one); the same operations, so the same bits.
struct NfRgbConstants {
    const unsigned char* luma;
    const unsigned char* uv;
    int width, height;
    float y_offset, y_inv, c_inv, kr, kb, kg, r_of_pr, b_of_pb, v_scale, v_offset;
};

__device__ __forceinline__ NfRgbConstants nf_rgb_constants(const NfFrame* p)
{
    NfRgbConstants k;
    k.luma = (const unsigned char*)p->nv12_in;
    k.uv = k.luma + (long long)p->width * p->height;
    k.width = p->width;
    k.height = p->height;
    k.y_offset = p->y_offset;
    k.y_inv = __fdiv_rn(1.0f, p->y_scale);
    k.c_inv = __fdiv_rn(1.0f, p->c_scale);
    k.kr = p->kr;
    k.kb = p->kb;
    k.kg = __fsub_rn(__fsub_rn(1.0f, k.kr), k.kb);
    k.r_of_pr = __fmul_rn(2.0f, __fsub_rn(1.0f, k.kr));
    k.b_of_pb = __fmul_rn(2.0f, __fsub_rn(1.0f, k.kb));
    k.v_scale = p->v_scale;
    k.v_offset = p->v_offset;
    return k;
}

// Nominal RGB of frame pixel (x, y), as nv12_to_rgb makes it (not clamped).
__device__ __forceinline__ void nf_pixel_rgb(const NfRgbConstants& k, int x, int y, float rgb[3])
{
    const float yn = __fmul_rn(__fsub_rn((float)k.luma[(long long)y * k.width + x], k.y_offset), k.y_inv);
    float cbcr[2];
    nf_chroma(k.width, k.height, k.uv, x, y, cbcr);
    const float pb = __fmul_rn(cbcr[0], k.c_inv);
    const float pr = __fmul_rn(cbcr[1], k.c_inv);
    rgb[0] = __fadd_rn(yn, __fmul_rn(k.r_of_pr, pr));
    rgb[2] = __fadd_rn(yn, __fmul_rn(k.b_of_pb, pb));
    rgb[1] = __fdiv_rn(__fsub_rn(__fsub_rn(yn, __fmul_rn(k.kr, rgb[0])), __fmul_rn(k.kb, rgb[2])), k.kg);
}

// The network's input value of nominal value x: x v_scale + v_offset.
__device__ __forceinline__ float nf_input_value(const NfRgbConstants& k, float x)
{
    return __fadd_rn(__fmul_rn(x, k.v_scale), k.v_offset);
}
