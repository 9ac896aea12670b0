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
