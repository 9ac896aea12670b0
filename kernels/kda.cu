// Kimi Delta Attention prefill, chunked form (spec 3.3-3.4), all in IEEE fp32 (FFMA, no TF32).
// Layouts: q, k, v, g: [T][H][D] f32 (row stride H*D); beta: [T][H]; state S: [H][D(k)][D(v)].
// Chunk length 64. Per segment of chunks, kda_chunk_prep computes every chunk's state-independent
// products in parallel, then kda_chunk_scan walks the chunks of each head sequentially.
#define KC 64

// x <- scale * x / sqrt(sum x^2 + eps) per head of D columns. One warp per (row, head).
extern "C" __global__ void l2_norm_heads(float* __restrict__ x, int rows, int H, int D, float eps, float scale) {
    int lane = threadIdx.x & 31;
    i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 w = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); w < (i64)rows * H; w += nw) {
        float* xr = x + w * D;
        float ss = 0.0f;
        for (int d = lane; d < D; d += 32) { float a = xr[d]; ss += a * a; }
        ss = warp_sum(ss);
        float inv = scale / sqrtf(ss + eps);
        for (int d = lane; d < D; d += 32) xr[d] *= inv;
    }
}

// Decay gate in log space: u = z + dt_bias; bounded form (bounded = 1): g = lb * sigmoid(exp(A_log[h]) * u);
// Kimi-Linear form: g = -exp(A_log[h]) * softplus(u). z, g: [rows][H*D]; a_log: [H]; dt_bias: [H*D].
extern "C" __global__ void kda_gate(const float* __restrict__ z, const float* __restrict__ a_log,
        const float* __restrict__ dt_bias, float* __restrict__ g, int rows, int H, int D, int bounded, float lb) {
    i64 total = (i64)rows * H * D;
    int C = H * D;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        int c = (int)(i % C), h = c / D;
        float u = z[i] + dt_bias[c];
        float ea = expf(a_log[h]);
        float r;
        if (bounded) r = lb * sigmoid_f(ea * u);
        else { float sp = u > 20.0f ? u : log1pf(expf(u)); r = -ea * sp; }
        g[i] = r;
    }
}

extern "C" __global__ void sigmoid_f32(const float* __restrict__ x, float* __restrict__ y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = sigmoid_f(x[i]);
}

// Token-by-token recurrence (spec 3.3 step 7), for decode-length inputs. One block per head,
// one thread per value column c (blockDim = D); S[h] lives in shared memory as [k][v].
extern "C" __global__ void kda_recurrent(const float* __restrict__ q, const float* __restrict__ k,
        const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
        float* __restrict__ S, float* __restrict__ out, int T, int H, int D) {
    extern __shared__ float sm[];
    float* Ss = sm;            // [D][D]
    float* kq = Ss + D * D;    // k[D], q[D], a[D]
    int h = blockIdx.x, c = threadIdx.x;
    float* Sg = S + (i64)h * D * D;
    for (int d = 0; d < D; ++d) Ss[d * D + c] = Sg[d * D + c];
    for (int t = 0; t < T; ++t) {
        i64 base = (i64)t * H * D + (i64)h * D;
        __syncthreads();
        kq[c] = k[base + c];
        kq[D + c] = q[base + c];
        kq[2 * D + c] = expf(g[base + c]);
        __syncthreads();
        float b = beta[(i64)t * H + h];
        float kv = 0.0f;
        for (int d = 0; d < D; ++d) { float s = Ss[d * D + c] * kq[2 * D + d]; Ss[d * D + c] = s; kv += s * kq[d]; }
        float delta = b * (v[base + c] - kv);
        float o = 0.0f;
        for (int d = 0; d < D; ++d) { float s = Ss[d * D + c] + kq[d] * delta; Ss[d * D + c] = s; o += s * kq[D + d]; }
        out[base + c] = o;
    }
    for (int d = 0; d < D; ++d) Sg[d * D + c] = Ss[d * D + c];
}

// Workspace per (local chunk c, head h), f32, at ws + (c*H + h) * kda_ws_floats(D):
//   Wm[64][D] = Tw (e^G . K),  U[64][D] = Tw V,  Qg[64][D] = e^G . Q,  Kd[64][D] = e^(G_L - G) . K,
//   M[64][64] = (Q K^T . e^(G_i - G_j)) for j <= i, 0 above,  eGL[D] = e^(G_L)
// with (I + A) Tw = diag(beta), A[i][j] = beta_i sum_d k_i k_j e^(G_i - G_j) for j < i.
__device__ __forceinline__ i64 kda_ws_floats(int D) { return 4LL * KC * D + KC * KC + D; }

extern "C" __global__ void __launch_bounds__(256) kda_chunk_prep(const float* __restrict__ q,
        const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
        const float* __restrict__ beta, int T, int H, int D, int c0, float* __restrict__ ws) {
    extern __shared__ float sm[];
    float* Ks = sm;              // [64][D]
    float* Qs = Ks + KC * D;     // [64][D]
    float* Vs = Qs + KC * D;     // [64][D]
    float* Gs = Vs + KC * D;     // [64][D] cumulative log decay
    float* As = Gs + KC * D;     // [64][64]
    float* bs = As + KC * KC;    // [64]
    int c = blockIdx.x, h = blockIdx.y;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarp = blockDim.x >> 5;
    i64 t0 = (i64)(c0 + c) * KC;
    i64 rs = (i64)H * D;
    for (int e = tid; e < KC * D; e += blockDim.x) {
        int i = e / D, d = e % D;
        i64 t = t0 + i;
        bool ok = t < T;
        i64 o = t * rs + (i64)h * D + d;
        Ks[e] = ok ? k[o] : 0.0f;
        Qs[e] = ok ? q[o] : 0.0f;
        Vs[e] = ok ? v[o] : 0.0f;
        Gs[e] = ok ? g[o] : 0.0f;
    }
    for (int i = tid; i < KC; i += blockDim.x) bs[i] = (t0 + i < T) ? beta[(t0 + i) * H + h] : 0.0f;
    __syncthreads();
    for (int d = tid; d < D; d += blockDim.x) {
        float run = 0.0f;
        for (int i = 0; i < KC; ++i) { run += Gs[i * D + d]; Gs[i * D + d] = run; }
    }
    __syncthreads();
    float* W = ws + (i64)(c * H + h) * kda_ws_floats(D);
    float* Wm = W;
    float* U = Wm + KC * D;
    float* Qg = U + KC * D;
    float* Kd = Qg + KC * D;
    float* M = Kd + KC * D;
    float* eGL = M + KC * KC;
    // pairs (i, j), j <= i: one warp per pair, lanes over d
    const int npairs = KC * (KC + 1) / 2;
    for (int p = warp; p < npairs; p += nwarp) {
        int i = (int)((sqrtf(8.0f * p + 1.0f) - 1.0f) * 0.5f);
        while (i * (i + 1) / 2 > p) --i;
        while ((i + 1) * (i + 2) / 2 <= p) ++i;
        int j = p - i * (i + 1) / 2;
        float sa = 0.0f, sq = 0.0f;
        for (int d = lane; d < D; d += 32) {
            float ex = expf(Gs[i * D + d] - Gs[j * D + d]);
            float kj = Ks[j * D + d] * ex;
            sa += Ks[i * D + d] * kj;
            sq += Qs[i * D + d] * kj;
        }
        sa = warp_sum(sa); sq = warp_sum(sq);
        if (lane == 0) {
            M[i * KC + j] = sq;
            As[i * KC + j] = (j < i) ? bs[i] * sa : 0.0f;
        }
    }
    for (int p = tid; p < KC * KC; p += blockDim.x) {
        int i = p / KC, j = p % KC;
        if (j > i) M[p] = 0.0f;
    }
    __syncthreads();
    for (int e = tid; e < KC * D; e += blockDim.x) {
        int d = e % D;
        float G = Gs[e], GL = Gs[(KC - 1) * D + d];
        Qg[e] = expf(G) * Qs[e];
        Kd[e] = expf(GL - G) * Ks[e];
        Ks[e] = expf(G) * Ks[e];
    }
    for (int d = tid; d < D; d += blockDim.x) eGL[d] = expf(Gs[(KC - 1) * D + d]);
    __syncthreads();
    // forward substitution, one thread per column of [e^G.K | V]
    for (int col = tid; col < 2 * D; col += blockDim.x) {
        float* Y = col < D ? Ks + col : Vs + (col - D);
        for (int i = 0; i < KC; ++i) {
            float x = bs[i] * Y[i * D];
            for (int j = 0; j < i; ++j) x -= As[i * KC + j] * Y[j * D];
            Y[i * D] = x;
        }
    }
    __syncthreads();
    for (int e = tid; e < KC * D; e += blockDim.x) { Wm[e] = Ks[e]; U[e] = Vs[e]; }
}

// One block (256 threads = 8 warps) per head walks chunks c0 .. c0+nch-1 sequentially.
// Thread tiles: rows r = warp + 8m (m < 8), value columns c = lane + 32q (q < D/32); D % 32 == 0, D <= 128.
extern "C" __global__ void __launch_bounds__(256) kda_chunk_scan(const float* __restrict__ ws, float* __restrict__ S,
        float* __restrict__ out, int T, int H, int D, int c0, int nch) {
    extern __shared__ float sm[];
    float* Ss = sm;               // [D][D] state (k rows, v columns)
    float* B1 = Ss + D * D;       // [64][D]  Wm, then Kd
    float* B2 = B1 + KC * D;      // [64][D]  Qg
    float* Ms = B2 + KC * D;      // [64][64]
    float* Vt = Ms + KC * KC;     // [64][D]  U, then corrected values
    float* eg = Vt + KC * D;      // [D]
    int h = blockIdx.x;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int CQ = D / 32;
    float* Sg = S + (i64)h * D * D;
    for (int e = tid; e < D * D; e += blockDim.x) Ss[e] = Sg[e];
    i64 wsz = kda_ws_floats(D);
    for (int c = 0; c < nch; ++c) {
        const float* W = ws + (i64)(c * H + h) * wsz;
        const float4* Wm4 = (const float4*)W;
        const float4* U4 = (const float4*)(W + KC * D);
        const float4* Qg4 = (const float4*)(W + 2 * KC * D);
        const float4* Kd4 = (const float4*)(W + 3 * KC * D);
        const float4* M4 = (const float4*)(W + 4 * KC * D);
        const float* eGL = W + 4 * KC * D + KC * KC;
        __syncthreads();
        for (int e = tid; e < KC * D / 4; e += blockDim.x) {
            ((float4*)B1)[e] = Wm4[e];
            ((float4*)B2)[e] = Qg4[e];
            ((float4*)Vt)[e] = U4[e];
        }
        for (int e = tid; e < KC * KC / 4; e += blockDim.x) ((float4*)Ms)[e] = M4[e];
        for (int d = tid; d < D; d += blockDim.x) eg[d] = eGL[d];
        __syncthreads();
        float vv[8][4], oo[8][4];
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) { vv[m][qq] = 0.0f; oo[m][qq] = 0.0f; }
        for (int d = 0; d < D; ++d) {
            float s[4];
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) s[qq] = qq < CQ ? Ss[d * D + lane + 32 * qq] : 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                int r = warp + 8 * m;
                float w = B1[r * D + d], qg = B2[r * D + d];
#pragma unroll
                for (int qq = 0; qq < 4; ++qq) { vv[m][qq] += w * s[qq]; oo[m][qq] += qg * s[qq]; }
            }
        }
        // corrected values (each thread owns its elements of Vt)
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq)
                if (qq < CQ) { int i = (warp + 8 * m) * D + lane + 32 * qq; Vt[i] = Vt[i] - vv[m][qq]; }
        __syncthreads();
        for (int e = tid; e < KC * D / 4; e += blockDim.x) ((float4*)B1)[e] = Kd4[e];
        for (int j = 0; j < KC; ++j) {
            float vj[4];
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) vj[qq] = qq < CQ ? Vt[j * D + lane + 32 * qq] : 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                float mm = Ms[(warp + 8 * m) * KC + j];
#pragma unroll
                for (int qq = 0; qq < 4; ++qq) oo[m][qq] += mm * vj[qq];
            }
        }
        i64 tbase = (i64)(c0 + c) * KC;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            i64 t = tbase + warp + 8 * m;
            if (t < T) {
#pragma unroll
                for (int qq = 0; qq < 4; ++qq)
                    if (qq < CQ) out[t * H * D + (i64)h * D + lane + 32 * qq] = oo[m][qq];
            }
        }
        __syncthreads();
        // state update: rows d = warp + 8*m2 (m2 < D/8), columns lane + 32q
        float sn[16][4];
#pragma unroll
        for (int m2 = 0; m2 < 16; ++m2)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) sn[m2][qq] = 0.0f;
        int RD = D / 8;
        for (int r = 0; r < KC; ++r) {
            float vr[4];
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) vr[qq] = qq < CQ ? Vt[r * D + lane + 32 * qq] : 0.0f;
#pragma unroll
            for (int m2 = 0; m2 < 16; ++m2) {
                if (m2 < RD) {
                    float kd = B1[r * D + warp + 8 * m2];
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) sn[m2][qq] += kd * vr[qq];
                }
            }
        }
#pragma unroll
        for (int m2 = 0; m2 < 16; ++m2)
            if (m2 < RD) {
                int d = warp + 8 * m2;
#pragma unroll
                for (int qq = 0; qq < 4; ++qq)
                    if (qq < CQ) { int i = d * D + lane + 32 * qq; Ss[i] = eg[d] * Ss[i] + sn[m2][qq]; }
            }
    }
    __syncthreads();
    for (int e = tid; e < D * D; e += blockDim.x) Sg[e] = Ss[e];
}

// o[t, h, :] = RMSNorm_D(o; w, eps) * sigmoid(r[t, h, :]) (fla FusedRMSNormGated, sigmoid).
// One warp per (t, h); out may alias o. `bf16_out` rounds to bf16.
extern "C" __global__ void kda_gated_norm(const float* o, const float* __restrict__ r, i64 r_stride,
        const float* __restrict__ w, float* out, int T, int H, int D, float eps, int bf16_out) {
    int lane = threadIdx.x & 31;
    i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 wi = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); wi < (i64)T * H; wi += nw) {
        int t = (int)(wi / H), h = (int)(wi % H);
        i64 base = (i64)t * H * D + (i64)h * D;
        float ss = 0.0f;
        for (int d = lane; d < D; d += 32) { float x = o[base + d]; ss += x * x; }
        ss = warp_sum(ss);
        float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int d = lane; d < D; d += 32) {
            float y = o[base + d] * inv * w[d] * sigmoid_f(r[(i64)t * r_stride + (i64)h * D + d]);
            out[base + d] = bf16_out ? round_bf16(y) : y;
        }
    }
}
