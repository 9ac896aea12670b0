// RMSNorm over rows: y = cast(x / sqrt(mean(x^2) + eps)) * w   (HF KimiRMSNorm order: normalise,
// cast to the activation dtype, scale). `bf16_cast` = 1 rounds the normalised value to bf16 (BF16
// mode); 0 keeps f32 (check mode). One block per row; x and y may alias.
extern "C" __global__ void rmsnorm_rows(const float* x, i64 xs, const float* __restrict__ w, float* y, i64 ys,
                                        int rows, int n, float eps, int bf16_cast) {
    __shared__ float red[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (i64)r * xs;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float v = xr[i]; acc += v * v; }
    float ss = block_sum(acc, red);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    float* yr = y + (i64)r * ys;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] * inv;
        if (bf16_cast) v = round_bf16(v);
        yr[i] = v * w[i];
    }
}

// MLA latent cache rows from kv = W_kva x ([rows][kv_lora + rope]): RMSNorm(first kv_lora; w, eps),
// the rope columns copied raw. One block per row.
extern "C" __global__ void mla_latent(const float* __restrict__ kv, const float* __restrict__ w, float* __restrict__ out,
                                      int rows, int kv_lora, int rope, float eps) {
    __shared__ float red[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    int W = kv_lora + rope;
    const float* xr = kv + (i64)r * W;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < kv_lora; i += blockDim.x) { float v = xr[i]; acc += v * v; }
    float ss = block_sum(acc, red);
    float inv = 1.0f / sqrtf(ss / (float)kv_lora + eps);
    float* yr = out + (i64)r * W;
    for (int i = threadIdx.x; i < W; i += blockDim.x) yr[i] = i < kv_lora ? xr[i] * inv * w[i] : xr[i];
}
