// MoE router (spec 3.6): s = sigmoid(logit); select top-k of s + bias (bias for selection only,
// ties to the lower index); weights = s[sel] renormalised to sum 1, times `scale`.
// Also writes the selection margin gap[t] = k-th minus (k+1)-th biased score (golden moe.topk_gap).
// One block per token; dynamic shared memory = E floats.
extern "C" __global__ void router_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                       int T, int E, int k, int renorm, float scale,
                                       int* __restrict__ idx, float* __restrict__ wout, float* __restrict__ gap) {
    extern __shared__ float sc[];
    __shared__ float rv[32];
    __shared__ int ri[32];
    __shared__ float sel_s[64];
    __shared__ float kth[2];
    int t = blockIdx.x;
    if (t >= T) return;
    const float* lg = logits + (i64)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) sc[e] = sigmoid_f(lg[e]) + (bias ? bias[e] : 0.0f);
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int j = 0; j <= k && j < E; ++j) {
        float bv = NEG_INF; int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            float v = sc[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { rv[warp] = bv; ri[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = rv[0]; int b = ri[0];
            for (int w = 1; w < nw; ++w)
                if (rv[w] > v || (rv[w] == v && ri[w] < b)) { v = rv[w]; b = ri[w]; }
            if (j < k) {
                idx[(i64)t * k + j] = b;
                sel_s[j] = sigmoid_f(lg[b]);
                if (j == k - 1) kth[0] = v;
                sc[b] = NEG_INF;
            } else {
                kth[1] = v;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += sel_s[j];
        for (int j = 0; j < k; ++j) {
            float w = renorm ? sel_s[j] / (sum + 1e-20f) : sel_s[j];
            wout[(i64)t * k + j] = w * scale;
        }
        if (gap) gap[t] = k < E ? kth[0] - kth[1] : __int_as_float(0x7f800000);
    }
}
