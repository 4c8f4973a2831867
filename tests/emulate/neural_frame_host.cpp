// Host emulation of kernels/neural_frame.cu's per-thread kernels (the conversions and the
// output filter: no shared memory, no synchronisation), driven by tests/neural_frame_emulated.rs:
// the kernel file is compiled as C++ on the host after the generated ABI (abi.h) with the CUDA
// keywords defined away and fp16 conversions through _Float16, every launch run thread by thread,
// and the results compared with the CPU reference's (case files written by the test).
// Usage: neural_frame_host CASE.bin...   (exit 1 when a case differs)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
struct D3 { int x, y, z; };
struct uchar2 { unsigned char x, y; };
static D3 blockIdx, threadIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
// nf_thumb_sums and nf_scene (warp shuffles, barriers) compile but are not run here
template <class T> T __shfl_down_sync(unsigned, T v, int) { return v; }
static void __syncthreads() {}
static inline float half_bits_to_float(unsigned short h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline unsigned short float_to_half_bits(float v) { _Float16 f = (_Float16)v; unsigned short h; memcpy(&h, &f, 2); return h; }
// the separately rounded operations of kernels/nv12.cuh (the host build has no contraction)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
#include "abi.h"
#include "nv12.cuh"
#include "neural_frame.cu"

typedef void (*Kernel)(const NfFrame*);
static void launch(Kernel k, const NfFrame* p, int gx, int gy, int bx, int by) {
    blockDim = {bx, by, 1};
    for (int y = 0; y < gy; y++) for (int x = 0; x < gx; x++)
        for (int ty = 0; ty < by; ty++) for (int tx = 0; tx < bx; tx++) {
            blockIdx = {x, y, 0}; threadIdx = {tx, ty, 0}; k(p);
        }
}
struct Reader { std::vector<unsigned char> b; size_t at = 0;
    template <class T> void get(T* out, size_t n) { memcpy(out, &b[at], n * sizeof(T)); at += n * sizeof(T); } };

int main(int argc, char** argv) {
    int bad = 0;
    for (int ci = 1; ci < argc; ci++) {
        Reader r; FILE* f = fopen(argv[ci], "rb");
        if (!f) { fprintf(stderr, "cannot open %s\n", argv[ci]); return 2; }
        fseek(f, 0, SEEK_END); r.b.resize(ftell(f)); fseek(f, 0, SEEK_SET);
        fread(r.b.data(), 1, r.b.size(), f); fclose(f);
        NfFrame p; r.get(&p, 1);
        int ntaps; r.get(&ntaps, 1);
        const int w = p.width, h = p.height, sw = p.scaled_w, sh = p.scaled_h, nw = p.net_w, nh = p.net_h;
        const int nchw = p.nchw;
        std::vector<NfTaps> taps(ntaps); r.get(taps.data(), ntaps);
        size_t frame = (size_t)w * h * 3 / 2, tlen = (size_t)nw * nh * 3;
        std::vector<unsigned char> nv12(frame); r.get(nv12.data(), frame);
        std::vector<float> want_in(tlen); r.get(want_in.data(), tlen);
        std::vector<float> tin(tlen), tout(tlen), srgb(3 * (size_t)sw * sh);
        std::vector<unsigned short> tout16(tlen), tin16(tlen);
        std::vector<unsigned short> ring(2 * 3 * (size_t)sw * sh);
        std::vector<unsigned char> out(frame);
        NfControl ctl{}; NfState st{}; NnControl net{};
        p.nv12_in = (unsigned long long)nv12.data(); p.nv12_out = (unsigned long long)out.data();
        p.tensor_in = p.in_half ? (unsigned long long)tin16.data() : (unsigned long long)tin.data(); p.tensor_out = p.out_half ? (unsigned long long)tout16.data() : (unsigned long long)tout.data();
        p.ring = (unsigned long long)ring.data(); p.control = (unsigned long long)&ctl;
        p.state = (unsigned long long)&st; p.net_control = (unsigned long long)&net;
        p.scaled_rgb = (unsigned long long)srgb.data();
        bool scaled = sw != w || sh != h;
        if (scaled) {
            p.down_x = (unsigned long long)&taps[0]; p.down_y = (unsigned long long)&taps[sw];
            p.up_x = (unsigned long long)&taps[sw + sh]; p.up_y = (unsigned long long)&taps[sw + sh + w];
        }
        auto cdiv = [](int a, int b) { return (a + b - 1) / b; };
        launch(nf_nv12_to_tensor, &p, cdiv(nw, 16), cdiv(nh, 16), 16, 16);
        if (p.in_half) for (size_t i = 0; i < tlen; i++) tin[i] = half_bits_to_float(tin16[i]);
        float din = 0; for (size_t i = 0; i < tlen; i++) din = std::max(din, std::fabs(tin[i] - want_in[i]));
        int frames; r.get(&frames, 1);
        int worst = 0; size_t differing = 0;
        for (int k = 0; k < frames; k++) {
            r.get(ctl.recent, 8); int uw[2]; r.get(uw, 2); ctl.used = uw[0]; ctl.write_slot = uw[1];
            st.used = ctl.used; // nf_scene's trimmed count (not run here): no cut in these frames
            float sc[2]; r.get(sc, 2); ctl.strength = sc[0]; ctl.motion_coeff = sc[1];
            if (p.out_half) r.get(tout16.data(), tlen); else r.get(tout.data(), tlen);
            std::vector<unsigned char> want(frame); r.get(want.data(), frame);
            if (scaled) {
                launch(nf_filter_scaled, &p, cdiv(sw, 16), cdiv(sh, 16), 16, 16);
                launch(nf_upscale_to_nv12, &p, cdiv(w / 2, 16), cdiv(h / 2, 16), 16, 16);
            } else {
                launch(nf_tensor_to_nv12, &p, cdiv(w / 2, 16), cdiv(h / 2, 16), 16, 16);
            }
            for (size_t i = 0; i < frame; i++) { int d = abs(out[i] - want[i]); worst = std::max(worst, d); differing += d > 0; }
        }
        printf("%s: %dx%d -> %dx%d (net %dx%d, nchw %d, input and output fp%d): input max diff %.3g, NV12 worst %d codes, %zu of %zu bytes differ\n",
               argv[ci], w, h, sw, sh, nw, nh, nchw, p.out_half ? 16 : 32, din, worst, differing, frame * frames);
        if (din > 1e-4f || worst > 1) bad = 1;
    }
    return bad;
}
