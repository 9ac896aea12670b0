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
