// FP32-grade GEMMs on the BF16 tensor cores (the router in BF16 mode, spec: router math FP32 or
// better). An f32 value is split into three bf16 parts, x = x0 + x1 + x2, each part the bf16
// rounding of what the earlier parts left: 3 x 8 significant bits cover f32's 24. A product
// x.w then equals the sum of the six part products x_i.w_j with i + j <= 2 up to the dropped
// terms (i + j >= 3, below 2^-24 relative); every part product is exact in f32 and the tensor
// cores accumulate in f32.
//
// split_bf16x3: in [rows, cols] (row stride ld) -> parts [rows, cols] each, dense. One block per
// row, so no 64-bit division per element.
extern "C" __global__ void split_bf16x3(const float* __restrict__ in, i64 ld, bf16_t* __restrict__ p0,
                                        bf16_t* __restrict__ p1, bf16_t* __restrict__ p2, int rows, int cols) {
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = in + (i64)r * ld;
    i64 o = (i64)r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = x[c];
        bf16_t a = f32_to_bf16(v);
        float rest = v - bf16_to_f32(a);  // exact (Sterbenz / same exponent range)
        bf16_t b = f32_to_bf16(rest);
        float rest2 = rest - bf16_to_f32(b);
        p0[o + c] = a;
        p1[o + c] = b;
        p2[o + c] = f32_to_bf16(rest2);
    }
}
