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

// rmsnorm_rows with the row held in registers: NQ float4s per thread (blockDim.x threads, n/4
// quads: quad k * blockDim.x + tid), so x is read once; one block per row (grid-stride). Needs n
// and both row strides a multiple of 4, 16-byte aligned pointers and n / 4 <= NQ * blockDim.x (the
// launcher picks NQ, else runs rmsnorm_rows). Same per-element arithmetic as rmsnorm_rows; the
// sum of squares is added in another order (f32 rounding).
template <int NQ>
__device__ __forceinline__ void rmsnorm4_body(const float* x, i64 xs, const float* __restrict__ w, float* y, i64 ys,
                                              int rows, int n, float eps, int bf16_cast) {
    __shared__ float red[32];
    int n4 = n >> 2;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float4* xr = (const float4*)(x + (i64)r * xs);
        float4 v[NQ];
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < NQ; ++k) {
            int i = k * blockDim.x + threadIdx.x;
            v[k] = i < n4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < NQ; ++k) acc += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        float ss = block_sum(acc, red);
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        float4* yr = (float4*)(y + (i64)r * ys);
#pragma unroll
        for (int k = 0; k < NQ; ++k) {
            int i = k * blockDim.x + threadIdx.x;
            if (i < n4) {
                float4 a = make_float4(v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv);
                if (bf16_cast) { a.x = round_bf16(a.x); a.y = round_bf16(a.y); a.z = round_bf16(a.z); a.w = round_bf16(a.w); }
                float4 wq = ((const float4*)w)[i];
                yr[i] = make_float4(a.x * wq.x, a.y * wq.y, a.z * wq.z, a.w * wq.w);
            }
        }
    }
}

// One entry point per NQ (registers are allocated per entry point): rmsnorm_rows4_q<NQ>, NQ = 1..8.
#define RMSNORM4(NQ)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows4_q##NQ(const float* x, i64 xs,              \
            const float* __restrict__ w, float* y, i64 ys, int rows, int n, float eps, int bf16_cast) {         \
        rmsnorm4_body<NQ>(x, xs, w, y, ys, rows, n, eps, bf16_cast);                                            \
    }
RMSNORM4(1)
RMSNORM4(2)
RMSNORM4(3)
RMSNORM4(4)
RMSNORM4(5)
RMSNORM4(6)
RMSNORM4(7)
RMSNORM4(8)

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
