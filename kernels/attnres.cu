// Attention Residuals (spec 3.2): per token, a softmax over depth of the bank entries and the
// current partial sum P. Candidates V_0..V_{n-1} = bank[i] rows, V_n = P row.
//   s_i = sum_d (V_i[d] / sqrt(mean(V_i^2) + eps)) * score_w[d]   (score_w = res_norm.w * res_proj.w)
//   out = sum_i softmax(s)_i * V_i   (raw V)
// The bank entries are separate [T][H] buffers passed by pointer (at most ATTNRES_MAX - 1).
// score_w = norm_w * proj_w elementwise. One block per token.
#define ATTNRES_MAX 32
struct BankPtrs { const float* p[ATTNRES_MAX]; };
extern "C" __global__ void attnres_mix(BankPtrs bank, int nbank, const float* P, const float* __restrict__ norm_w,
                                       const float* __restrict__ proj_w, float* out, int T, int H, float eps,
                                       int bf16_out) {
    __shared__ float red[32];
    __shared__ float s[ATTNRES_MAX];
    int t = blockIdx.x;
    if (t >= T) return;
    int nc = nbank + 1;
    for (int c = 0; c < nc; ++c) {
        const float* v = (c < nbank ? bank.p[c] : P) + (i64)t * H;
        float sq = 0.0f, dot = 0.0f;
        for (int i = threadIdx.x; i < H; i += blockDim.x) { float x = v[i]; sq += x * x; dot += x * norm_w[i] * proj_w[i]; }
        sq = block_sum(sq, red);
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) s[c] = dot / sqrtf(sq / (float)H + eps);
    }
    __syncthreads();
    float m = NEG_INF;
    for (int c = 0; c < nc; ++c) m = fmaxf(m, s[c]);
    float z = 0.0f;
    for (int c = 0; c < nc; ++c) z += expf(s[c] - m);
    // out may alias P: every thread reads its own elements of all candidates before writing them.
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < nc; ++c) {
            const float* v = (c < nbank ? bank.p[c] : P) + (i64)t * H;
            acc += (expf(s[c] - m) / z) * v[i];
        }
        out[(i64)t * H + i] = bf16_out ? round_bf16(acc) : acc;
    }
}

// Two block-wide sums at once; `red` is shared scratch of >= 64 floats.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) { red[warp] = a; red[32 + warp] = b; }
    __syncthreads();
    float x = lane < nw ? red[lane] : 0.0f, y = lane < nw ? red[32 + lane] : 0.0f;
    return make_float2(warp_sum(x), warp_sum(y));
}

// attnres_mix reading every candidate once: the candidates of a token are taken in order, each
// row held in registers (NQ float4s per thread: quad k * blockDim.x + tid) while its score is
// reduced, and folded into the output by an online softmax (running max m, running sum z; the
// accumulator is rescaled by exp(m_old - m_new) when the max grows), out = acc / z at the end.
// With PF = 1 the next candidate's loads are issued before the current one's reduction (a third
// set of NQ float4s in registers; PF = 0 leaves latency hiding to the other blocks). Same scores and
// weights as attnres_mix up to f32 rounding (the weights are applied as e^(s_i - m) and one
// division by z instead of (e^(s_i - m) / z) each). Needs H a multiple of 4, 16-byte aligned
// rows and H / 4 <= NQ * blockDim.x (the launcher picks NQ, else runs attnres_mix). One block
// per token (grid-stride); out may alias P (each thread reads its elements of P before writing).
template <int NQ, int PF>
__device__ __forceinline__ void attnres4_body(const BankPtrs& bank, int nbank, const float* P, const float* __restrict__ norm_w,
                                              const float* __restrict__ proj_w, float* out, int T, int H, float eps,
                                              int bf16_out) {
    __shared__ float red[64];
    int h4 = H >> 2, nc = nbank + 1;
    const float4* nw = (const float4*)norm_w;
    const float4* pw = (const float4*)proj_w;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        float4 cur[NQ], acc[NQ];
        {
            const float4* v = (const float4*)((nbank > 0 ? bank.p[0] : P) + (i64)t * H);
#pragma unroll
            for (int k = 0; k < NQ; ++k) {
                int i = k * blockDim.x + threadIdx.x;
                cur[k] = i < h4 ? v[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        float m = NEG_INF, z = 0.0f;
        for (int c = 0; c < nc; ++c) {
            float sq = 0.0f, dot = 0.0f;
#pragma unroll
            for (int k = 0; k < NQ; ++k) {
                int i = k * blockDim.x + threadIdx.x;
                if (i < h4) {
                    float4 x = cur[k], a = nw[i], b = pw[i];
                    sq += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
                    dot += x.x * a.x * b.x + x.y * a.y * b.y + x.z * a.z * b.z + x.w * a.w * b.w;
                }
            }
            float4 nxt[PF ? NQ : 1];
            if (PF && c + 1 < nc) {
                const float4* v = (const float4*)((c + 1 < nbank ? bank.p[c + 1] : P) + (i64)t * H);
#pragma unroll
                for (int k = 0; k < NQ; ++k) {
                    int i = k * blockDim.x + threadIdx.x;
                    nxt[PF ? k : 0] = i < h4 ? v[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            float2 r = block_sum2(sq, dot, red);
            float s = r.y / sqrtf(r.x / (float)H + eps);
            float mn = fmaxf(m, s);
            float scale = expf(m - mn);  // 0 for the first candidate (m = -inf)
            float e = expf(s - mn);
            z = z * scale + e;
            m = mn;
#pragma unroll
            for (int k = 0; k < NQ; ++k) {
                acc[k].x = acc[k].x * scale + e * cur[k].x;
                acc[k].y = acc[k].y * scale + e * cur[k].y;
                acc[k].z = acc[k].z * scale + e * cur[k].z;
                acc[k].w = acc[k].w * scale + e * cur[k].w;
            }
            if (c + 1 < nc) {
                const float4* v = (const float4*)((c + 1 < nbank ? bank.p[c + 1] : P) + (i64)t * H);
#pragma unroll
                for (int k = 0; k < NQ; ++k) {
                    int i = k * blockDim.x + threadIdx.x;
                    cur[k] = PF ? nxt[PF ? k : 0] : (i < h4 ? v[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f));
                }
            }
        }
        float4* o = (float4*)(out + (i64)t * H);
#pragma unroll
        for (int k = 0; k < NQ; ++k) {
            int i = k * blockDim.x + threadIdx.x;
            if (i < h4) {
                float4 a = make_float4(acc[k].x / z, acc[k].y / z, acc[k].z / z, acc[k].w / z);
                if (bf16_out) { a.x = round_bf16(a.x); a.y = round_bf16(a.y); a.z = round_bf16(a.z); a.w = round_bf16(a.w); }
                o[i] = a;
            }
        }
    }
}

// One entry point per NQ and PF (registers are allocated per entry point): attnres_mix4_q<NQ>
// (prefetch) and attnres_mix4np_q<NQ>, NQ = 1..8.
#define ATTNRES4(NQ)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 2) attnres_mix4_q##NQ(BankPtrs bank, int nbank,          \
            const float* P, const float* __restrict__ norm_w, const float* __restrict__ proj_w, float* out,      \
            int T, int H, float eps, int bf16_out) {                                                            \
        attnres4_body<NQ, 1>(bank, nbank, P, norm_w, proj_w, out, T, H, eps, bf16_out);                         \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) attnres_mix4np_q##NQ(BankPtrs bank, int nbank,           \
            const float* P, const float* __restrict__ norm_w, const float* __restrict__ proj_w, float* out,      \
            int T, int H, float eps, int bf16_out) {                                                            \
        attnres4_body<NQ, 0>(bank, nbank, P, norm_w, proj_w, out, T, H, eps, bf16_out);                         \
    }
ATTNRES4(1)
ATTNRES4(2)
ATTNRES4(3)
ATTNRES4(4)
ATTNRES4(5)
ATTNRES4(6)
ATTNRES4(7)
ATTNRES4(8)
