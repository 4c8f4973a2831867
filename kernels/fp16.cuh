// fp16 storage helpers shared by the neural kernels (neural.cu, neural_frame.cu): the host
// prepends this file to their translation units (src/cuda/kernels.rs, FP16_HELPERS). Raw
// conversions through PTX, so no CUDA header is needed.
#pragma once

__device__ __forceinline__ float half_bits_to_float(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, as the CPU reference's fp16 emulation does.
__device__ __forceinline__ unsigned short float_to_half_bits(float v)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
