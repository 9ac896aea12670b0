// SiTU-GLU: out = b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2)  (spec 3.6); b2 <= 0 means a linear up branch.
__device__ __forceinline__ float situ(float g, float u, float b1, float b2) {
    float gate = b1 * tanhf(g / b1) * sigmoid_f(g);
    float up = b2 > 0.0f ? b2 * tanhf(u / b2) : u;
    return gate * up;
}

// out[r, i] = situ(g[r*gs + i], u[r*us + i]) for i < n. `bf16_out` rounds the result to bf16.
extern "C" __global__ void situ_glu(const float* __restrict__ g, i64 gs, const float* __restrict__ u, i64 us,
                                    float* __restrict__ out, i64 os, int rows, int n, float b1, float b2,
                                    int bf16_out) {
    i64 total = (i64)rows * n;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / n; int c = (int)(i % n);
        float v = situ(g[r * gs + c], u[r * us + c], b1, b2);
        out[r * os + c] = bf16_out ? round_bf16(v) : v;
    }
}

// situ_glu on float4s. Grid: x covers the n / 4 column quads (blockDim.x threads), y walks the
// rows 4 at a time (grid-stride), the loads of the 4 rows issued first. Needs n and the three
// row strides a multiple of 4 and 16-byte aligned pointers (the launcher checks, else runs
// situ_glu). Same arithmetic per element as situ_glu.
extern "C" __global__ void situ_glu4(const float* __restrict__ g, i64 gs, const float* __restrict__ u, i64 us,
                                     float* __restrict__ out, i64 os, int rows, int n, float b1, float b2,
                                     int bf16_out) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= n) return;
    for (int r0 = blockIdx.y * 4; r0 < rows; r0 += gridDim.y * 4) {
        float4 vg[4], vu[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (r0 + k < rows) {
                vg[k] = *(const float4*)(g + (i64)(r0 + k) * gs + c);
                vu[k] = *(const float4*)(u + (i64)(r0 + k) * us + c);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (r0 + k < rows) {
                float4 v;
                v.x = situ(vg[k].x, vu[k].x, b1, b2);
                v.y = situ(vg[k].y, vu[k].y, b1, b2);
                v.z = situ(vg[k].z, vu[k].z, b1, b2);
                v.w = situ(vg[k].w, vu[k].w, b1, b2);
                if (bf16_out) { v.x = round_bf16(v.x); v.y = round_bf16(v.y); v.z = round_bf16(v.z); v.w = round_bf16(v.w); }
                *(float4*)(out + (i64)(r0 + k) * os + c) = v;
            }
        }
    }
}
