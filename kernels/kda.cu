// Kimi Delta Attention prefill, chunked form (spec 3.3-3.4), all in IEEE fp32 (FFMA, no TF32).
// Layouts: q, k, v, g: [T][H][D] f32 (row stride H*D); beta: [T][H]; state S: [H][D(k)][D(v)].
// Chunk length 64. Per segment of chunks, kda_chunk_prep and kda_chunk_solve compute every chunk's
// state-independent products in parallel, then kda_chunk_scan walks the chunks of each head in order.
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

// ---- float4 forms of the elementwise kernels above and of kda_gated_norm (end of file) ------
// They need D (and the row strides) a multiple of 4 and 16-byte aligned pointers; the launchers
// check and otherwise run the scalar kernels. Same per-element arithmetic; the per-head sums of
// squares are added in another order (f32 rounding).

// l2_norm_heads: one warp per pair of adjacent (row, head) units, NV float4s per lane and unit
// (D <= 128 NV), both units' loads issued before the reductions.
template <int NV>
__device__ __forceinline__ void l2_norm4_body(float* __restrict__ x, i64 units, int D, float eps, float scale) {
    int lane = threadIdx.x & 31;
    i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 p = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); 2 * p < units; p += nw) {
        float4 a[2][NV];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                int d = (k * 32 + lane) * 4;
                bool ok = 2 * p + u < units && d < D;
                a[u][k] = ok ? *(const float4*)(x + (2 * p + u) * D + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) ss += a[u][k].x * a[u][k].x + a[u][k].y * a[u][k].y + a[u][k].z * a[u][k].z + a[u][k].w * a[u][k].w;
            ss = warp_sum(ss);
            float inv = scale / sqrtf(ss + eps);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                int d = (k * 32 + lane) * 4;
                if (2 * p + u < units && d < D)
                    *(float4*)(x + (2 * p + u) * D + d) = make_float4(a[u][k].x * inv, a[u][k].y * inv, a[u][k].z * inv, a[u][k].w * inv);
            }
        }
    }
}

// One entry point per NV (registers are allocated per entry point): l2_norm_heads4_v<NV>, NV = 1..4.
#define L2NORM4(NV)                                                                                             \
    extern "C" __global__ void l2_norm_heads4_v##NV(float* __restrict__ x, int rows, int H, int D, float eps,   \
                                                    float scale) {                                              \
        l2_norm4_body<NV>(x, (i64)rows * H, D, eps, scale);                                                     \
    }
L2NORM4(1)
L2NORM4(2)
L2NORM4(3)
L2NORM4(4)

// kda_gate: grid x covers the H*D/4 column quads, y walks the rows 4 at a time (grid-stride).
extern "C" __global__ void kda_gate4(const float* __restrict__ z, const float* __restrict__ a_log,
        const float* __restrict__ dt_bias, float* __restrict__ g, int rows, int H, int D, int bounded, float lb) {
    int C = H * D;
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= C) return;
    float ea = expf(a_log[c / D]);
    float4 bias = *(const float4*)(dt_bias + c);
    for (int r0 = blockIdx.y * 4; r0 < rows; r0 += gridDim.y * 4) {
        float4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (r0 + k < rows) v[k] = *(const float4*)(z + (i64)(r0 + k) * C + c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (r0 + k >= rows) break;
            float u[4] = {v[k].x + bias.x, v[k].y + bias.y, v[k].z + bias.z, v[k].w + bias.w};
            float r[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (bounded) r[e] = lb * sigmoid_f(ea * u[e]);
                else { float sp = u[e] > 20.0f ? u[e] : log1pf(expf(u[e])); r[e] = -ea * sp; }
            }
            *(float4*)(g + (i64)(r0 + k) * C + c) = make_float4(r[0], r[1], r[2], r[3]);
        }
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

// ---- chunked prefill (spec 3.4) ----------------------------------------------------------------
// Three kernels per segment of chunks. kda_chunk_prep and kda_chunk_solve compute every
// (chunk, head)'s state-independent products in parallel, one workspace record each;
// kda_chunk_scan then walks the chunks of each head in order, split over blocks of 32 value
// columns (the state update acts on each value column independently: the split changes no
// arithmetic).
//
// Workspace record per (local chunk c, head h), f32, at ws + (c*H + h) * kda_ws_floats(D):
//   [0, 128D)            D/32 slices s of 4096 floats: W^T[k][i] (k = 32s .. 32s+31, i < 64), then Qg^T[k][i]
//   [128D, 128D+4096)    M^T[j][i] = M[i][j]  (zero for j > i)
//   next 64D             Kd[j][k]
//   next 64D             U[i][c]
//   next D               eGL[k]
//   next 4096            A[i][j] (scratch between prep and solve; j < i read only)
// with G = cumulative log decay within the chunk, A[i][j] = beta_i sum_d k_i k_j e^(G_i - G_j) (j < i),
// (I + A) [W | U] = diag(beta) [e^G . K | V], Qg = e^G . Q, Kd = e^(G_L - G) . K, eGL = e^(G_L),
// M[i][j] = sum_d q_i k_j e^(G_i - G_j) (j <= i).
//
// Arithmetic order (fixed, IEEE fp32, every a*b+c contracted to one FFMA, no TF32):
//   G_i      = ((g_0 + g_1) + ...) + g_i                                    (per key channel)
//   A, M     for each d = 0, 1, .., D-1 in turn: x = k_j[d] * expf(G_i[d] - G_j[d]);
//            a += k_i[d] * x; m += q_i[d] * x (from 0); then A = beta_i * a
//   W, U     forward substitution, x_i = beta_i y_i, then x_i -= A[i][j] x_j for j = 0 .. i-1
//   per chunk, value column c, from the state S entering it:
//            Vt[i] = U[i] - (sum over k = 0 .. D-1 of W[i][k] S[k], from 0)
//            O[i]  = (sum over k of Qg[i][k] S[k], from 0), then += M[i][j] Vt[j] for j = 0 .. 63
//            S[k]  = eGL[k] * S[k] + (sum over j = 0 .. 63 of Kd[j][k] Vt[j], from 0)
// The scan's order is that of the earlier one-block-per-head kernel; the prep kernel sums A and M over
// d in sequence (it used to reduce across a warp).
__device__ __forceinline__ i64 kda_ws_floats(int D) { return 4LL * KC * D + 2 * KC * KC + D; }

#define KDA_PREP_THREADS 288
#define KDA_PAIR_ITEMS 272  // 4 (rows i) x 2 (columns j) tiles covering j <= i of the 64x64 pair matrix

__device__ __forceinline__ void kda_cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
// 16 bytes, or zeros when `bytes` is 0 (src is then not read)
__device__ __forceinline__ void kda_cp16z(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void kda_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kda_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Row-major [64][D] staging, the 4-float granules of row i XOR-swizzled by (i/2) % 8, so that
// column walks (one thread per column) and granule reads of 8 different even rows are both free of
// bank conflicts. kda_rg: granule of columns d0 .. d0+3 (d0 % 4 == 0); kda_rm: one element.
__device__ __forceinline__ int kda_rg(int i, int d0, int D) { return i * D + ((((d0 >> 2) ^ ((i >> 1) & 7))) << 2); }
__device__ __forceinline__ int kda_rm(int i, int d, int D) { return kda_rg(i, d & ~3, D) + (d & 3); }

// Forward substitution of one column held in registers: x (holds y on entry) <- (I + A)^-1 diag(beta) y.
__device__ __forceinline__ void kda_subst(float (&x)[KC], const float* As, const float* bs) {
#pragma unroll
    for (int i = 0; i < KC; ++i) {
        float a = bs[i] * x[i];
#pragma unroll
        for (int j = 0; j < i; ++j) a -= As[i * KC + j] * x[j];
        x[i] = a;
    }
}

// One block of 288 threads per (chunk c0 + blockIdx.x, head blockIdx.y). D % 32 == 0, D <= 128.
// Writes Qg^T, Kd, eGL, M^T of the record, e^G . K (transposed, into the W^T slots) and A (scratch);
// kda_chunk_solve finishes W and U. Shared memory: G, K, Q staged as [64][D] (98,560 bytes at
// D = 128: two blocks per SM).
extern "C" __global__ void __launch_bounds__(KDA_PREP_THREADS, 2) kda_chunk_prep(const float* __restrict__ q,
        const float* __restrict__ k, const float* __restrict__ g, const float* __restrict__ beta, int T, int H, int D,
        int c0, float* __restrict__ ws) {
    extern __shared__ float sm[];
    float* Gs = sm;            // [64][D] g, then G (running sum down each column)
    float* Ks = Gs + KC * D;
    float* Qs = Ks + KC * D;
    float* bs = Qs + KC * D;   // [64]
    int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    i64 t0 = (i64)(c0 + c) * KC;
    i64 rs = (i64)H * D;
    float* rec = ws + (i64)(c * H + h) * kda_ws_floats(D);
    float* WQ = rec;
    float* MT = rec + 128 * D;
    float* KD = MT + KC * KC;
    float* EG = KD + 2 * KC * D;
    float* AG = EG + D;
    // rows of g, k, q straight into shared memory (rows past T read as zero)
    int gpr = D >> 2, pieces = KC * gpr;
    for (int e = tid; e < 3 * pieces; e += nt) {
        int kind = e / pieces, r = e - kind * pieces, i = r / gpr, d0 = (r - i * gpr) << 2;
        const float* base = kind == 0 ? g : kind == 1 ? k : q;
        float* dst = (kind == 0 ? Gs : kind == 1 ? Ks : Qs) + kda_rg(i, d0, D);
        bool ok = t0 + i < T;
        kda_cp16z(dst, ok ? (const void*)(base + (t0 + i) * rs + (i64)h * D + d0) : (const void*)base, ok ? 16 : 0);
    }
    kda_cp_commit();
    // M^T above the computed tiles is zero
    for (int e = tid; e < KC * KC; e += nt) {
        int j = e >> 6, i = e & 63;
        if ((j >> 1) > 2 * (i >> 2) + 1) MT[e] = 0.0f;
    }
    if (tid < KC) bs[tid] = (t0 + tid < T) ? beta[(t0 + tid) * H + h] : 0.0f;
    kda_cp_wait<0>();
    __syncthreads();
    if (tid < D) {
        float run = 0.0f;
        for (int i = 0; i < KC; ++i) {
            float* p = Gs + kda_rm(i, tid, D);
            run += *p;
            *p = run;
        }
    }
    __syncthreads();
    // per key column: eGL, Qg^T, Kd and e^G . k (two threads per column, 32 rows each)
    if (tid < 2 * D) {
        int col = tid < D ? tid : tid - D, ib = tid < D ? 0 : KC / 2;
        float GL = Gs[kda_rm(KC - 1, col, D)];
        if (tid < D) EG[col] = expf(GL);
        float* YT = WQ + (col >> 5) * 4096 + (col & 31) * KC;
        float* QgT = YT + 2048;
#pragma unroll 2
        for (int i0 = ib; i0 < ib + KC / 2; i0 += 4) {
            float qg[4], y[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int i = i0 + r, o = kda_rm(i, col, D);
                float G = Gs[o], kv = Ks[o];
                float eg = expf(G);
                qg[r] = eg * Qs[o];
                KD[i * D + col] = expf(GL - G) * kv;
                y[r] = eg * kv;
            }
            *(float4*)(QgT + i0) = make_float4(qg[0], qg[1], qg[2], qg[3]);
            *(float4*)(YT + i0) = make_float4(y[0], y[1], y[2], y[3]);
        }
    }
    // A and M: tile p covers rows 4rt .. 4rt+3 and columns 2ct, 2ct+1 (ct <= 2rt+1)
    if (tid < KDA_PAIR_ITEMS) {
        int p = tid;
        int rt = (int)((sqrtf(4.0f * p + 1.0f) - 1.0f) * 0.5f);
        while (rt * (rt + 1) > p) --rt;
        while ((rt + 1) * (rt + 2) <= p) ++rt;
        int ct = p - rt * (rt + 1);
        int i0 = 4 * rt, j0 = 2 * ct;
        float sa[4][2], sq[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) { sa[r][cc] = 0.0f; sq[r][cc] = 0.0f; }
#pragma unroll 2
        for (int d0 = 0; d0 < D; d0 += 4) {
            float GI[4][4], KI[4][4], QI[4][4], GJ[2][4], KJ[2][4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int o = kda_rg(i0 + r, d0, D);
                float4 a = *(const float4*)(Gs + o), b = *(const float4*)(Ks + o), e = *(const float4*)(Qs + o);
                GI[r][0] = a.x; GI[r][1] = a.y; GI[r][2] = a.z; GI[r][3] = a.w;
                KI[r][0] = b.x; KI[r][1] = b.y; KI[r][2] = b.z; KI[r][3] = b.w;
                QI[r][0] = e.x; QI[r][1] = e.y; QI[r][2] = e.z; QI[r][3] = e.w;
            }
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                int o = kda_rg(j0 + cc, d0, D);
                float4 a = *(const float4*)(Gs + o), b = *(const float4*)(Ks + o);
                GJ[cc][0] = a.x; GJ[cc][1] = a.y; GJ[cc][2] = a.z; GJ[cc][3] = a.w;
                KJ[cc][0] = b.x; KJ[cc][1] = b.y; KJ[cc][2] = b.z; KJ[cc][3] = b.w;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int cc = 0; cc < 2; ++cc) {
                        float x = KJ[cc][u] * expf(GI[r][u] - GJ[cc][u]);
                        sa[r][cc] += KI[r][u] * x;
                        sq[r][cc] += QI[r][u] * x;
                    }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            int i = i0 + r;
            float a0 = (j0 < i) ? bs[i] * sa[r][0] : 0.0f, a1 = (j0 + 1 < i) ? bs[i] * sa[r][1] : 0.0f;
            *(float2*)(AG + i * KC + j0) = make_float2(a0, a1);
        }
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
            int j = j0 + cc;
            float m[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) m[r] = (j <= i0 + r) ? sq[r][cc] : 0.0f;
            *(float4*)(MT + j * KC + i0) = make_float4(m[0], m[1], m[2], m[3]);
        }
    }
}

// W and U of chunk c0 + blockIdx.x, head blockIdx.y by forward substitution: one thread per column
// of [e^G . K | V] (threads 0 .. 2D-1 of 256). Reads the A scratch and the e^G . K written by
// kda_chunk_prep. Shared memory: A [64][64], beta [64].
extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_solve(const float* __restrict__ v,
        const float* __restrict__ beta, int T, int H, int D, int c0, float* __restrict__ ws) {
    extern __shared__ float sm[];
    float* As = sm;
    float* bs = As + KC * KC;
    int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    i64 t0 = (i64)(c0 + c) * KC;
    i64 rs = (i64)H * D;
    float* rec = ws + (i64)(c * H + h) * kda_ws_floats(D);
    float* UU = rec + 128 * D + KC * KC + KC * D;
    const float* AG = UU + KC * D + D;
    for (int e = tid * 4; e < KC * KC; e += blockDim.x * 4) *(float4*)(As + e) = *(const float4*)(AG + e);
    if (tid < KC) bs[tid] = (t0 + tid < T) ? beta[(t0 + tid) * H + h] : 0.0f;
    float x[KC];
    float* WT = nullptr;
    if (tid < D) {
        WT = rec + (tid >> 5) * 4096 + (tid & 31) * KC;
#pragma unroll
        for (int i0 = 0; i0 < KC; i0 += 4) {
            float4 a = *(const float4*)(WT + i0);
            x[i0] = a.x; x[i0 + 1] = a.y; x[i0 + 2] = a.z; x[i0 + 3] = a.w;
        }
    } else if (tid < 2 * D) {
        const float* src = v + t0 * rs + (i64)h * D + (tid - D);
#pragma unroll
        for (int i = 0; i < KC; ++i) x[i] = (t0 + i < T) ? src[(i64)i * rs] : 0.0f;
    }
    __syncthreads();
    if (tid < D) {
        kda_subst(x, As, bs);
#pragma unroll
        for (int i0 = 0; i0 < KC; i0 += 4) *(float4*)(WT + i0) = make_float4(x[i0], x[i0 + 1], x[i0 + 2], x[i0 + 3]);
    } else if (tid < 2 * D) {
        kda_subst(x, As, bs);
#pragma unroll
        for (int i = 0; i < KC; ++i) UU[i * D + (tid - D)] = x[i];
    }
}

// ---- the scan ----
// Grid (H, D/32): block (h, y) owns value columns 32y .. 32y+31 of head h's state, kept in shared
// memory as [D][32], and walks chunks c0 .. c0+nch-1. 128 threads: thread (rg = tid/8, cg = tid%8)
// holds rows 4rg .. 4rg+3 x columns 4cg .. 4cg+3 of Vt and O, and state rows rg*D/16 .. +D/16-1 x the
// same 4 columns. The record's tiles (D/32 slices of W^T|Qg^T, M^T, two halves of Kd) stream through a
// 3-stage cp.async ring of 16 KB; U and eGL go straight to registers.
#define KDA_SCAN_THREADS 128
#define KDA_NSTAGE 3
#define KDA_TILE 4096

// Issues the copy of tile `gi` (chunk gi / NT, tile gi % NT) into its ring slot; always commits a group.
__device__ __forceinline__ void kda_scan_issue(const float* ws, i64 wsz, int H, int h, int D, int NT, int total, int gi, float* ring) {
    if (gi < total) {
        int c = gi / NT, t = gi - c * NT, ns = D >> 5;
        const float* src = ws + (i64)(c * H + h) * wsz;
        int n;
        if (t <= ns) { src += t * KDA_TILE; n = KDA_TILE; }                     // W^T|Qg^T slice t, or M^T (t == ns)
        else { src += (ns + 1) * KDA_TILE + (t - ns - 1) * 32 * D; n = 32 * D; }  // Kd rows 32(t-ns-1) ..
        float* dst = ring + (gi % KDA_NSTAGE) * KDA_TILE;
        for (int e = threadIdx.x * 4; e < n; e += KDA_SCAN_THREADS * 4) kda_cp16(dst + e, src + e);
    }
    kda_cp_commit();
}

template <int RPT>
__device__ __forceinline__ void kda_scan_body(float* sm, const float* __restrict__ ws, float* __restrict__ S,
        float* __restrict__ out, int T, int H, int c0, int nch) {
    constexpr int D = RPT * 16;
    constexpr int ns = D / 32, NT = ns + 3;
    float* ring = sm;                           // [3][4096]
    float* Ss = ring + KDA_NSTAGE * KDA_TILE;   // [D][32]
    float* Vt = Ss + D * 32;                    // [64][32]
    int h = blockIdx.x, cb = blockIdx.y * 32;
    int tid = threadIdx.x, rg = tid >> 3, cg = tid & 7;
    i64 wsz = kda_ws_floats(D);
    float* Sg = S + (i64)h * D * D + cb;
    for (int e = tid; e < D * 8; e += KDA_SCAN_THREADS) {
        int r = e >> 3, q4 = (e & 7) << 2;
        *(float4*)(Ss + r * 32 + q4) = *(const float4*)(Sg + (i64)r * D + q4);
    }
    int total = nch * NT;
#pragma unroll
    for (int s = 0; s < KDA_NSTAGE - 1; ++s) kda_scan_issue(ws, wsz, H, h, D, NT, total, s, ring);
    float vv[4][4], oo[4][4], sn[RPT][4], egl[RPT];
    float4 u4[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) u4[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int m = 0; m < RPT; ++m) egl[m] = 0.0f;
    for (int gi = 0; gi < total; ++gi) {
        kda_cp_wait<KDA_NSTAGE - 2>();
        __syncthreads();
        kda_scan_issue(ws, wsz, H, h, D, NT, total, gi + KDA_NSTAGE - 1, ring);
        const float* tile = ring + (gi % KDA_NSTAGE) * KDA_TILE;
        int c = gi / NT, t = gi - c * NT;
        if (t < ns) {
            // Vt -= W S, O = Qg S over keys 32t .. 32t+31
            if (t == 0) {
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) { vv[r][qq] = 0.0f; oo[r][qq] = 0.0f; }
                const float* U = ws + (i64)(c * H + h) * wsz + 128 * D + KC * KC + KC * D;
#pragma unroll
                for (int r = 0; r < 4; ++r) u4[r] = __ldg((const float4*)(U + (4 * rg + r) * D + cb + 4 * cg));
                const float* E = U + KC * D + rg * RPT;
#pragma unroll
                for (int m = 0; m < RPT; ++m) egl[m] = __ldg(E + m);
            }
            const float* Sk = Ss + t * 32 * 32 + 4 * cg;
#pragma unroll 8
            for (int kk = 0; kk < 32; ++kk) {
                float4 w = *(const float4*)(tile + kk * KC + 4 * rg);
                float4 qg = *(const float4*)(tile + 2048 + kk * KC + 4 * rg);
                float4 s = *(const float4*)(Sk + kk * 32);
                float W4[4] = {w.x, w.y, w.z, w.w}, Q4[4] = {qg.x, qg.y, qg.z, qg.w}, S4[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) { vv[r][qq] += W4[r] * S4[qq]; oo[r][qq] += Q4[r] * S4[qq]; }
            }
            if (t == ns - 1) {
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    *(float4*)(Vt + (4 * rg + r) * 32 + 4 * cg) =
                        make_float4(u4[r].x - vv[r][0], u4[r].y - vv[r][1], u4[r].z - vv[r][2], u4[r].w - vv[r][3]);
            }
        } else if (t == ns) {
            // O += M Vt, then out
#pragma unroll 8
            for (int j = 0; j < KC; ++j) {
                float4 m = *(const float4*)(tile + j * KC + 4 * rg);
                float4 vt = *(const float4*)(Vt + j * 32 + 4 * cg);
                float M4[4] = {m.x, m.y, m.z, m.w}, V4[4] = {vt.x, vt.y, vt.z, vt.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) oo[r][qq] += M4[r] * V4[qq];
            }
            i64 tb = (i64)(c0 + c) * KC + 4 * rg;
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (tb + r < T) *(float4*)(out + (tb + r) * H * D + (i64)h * D + cb + 4 * cg) = make_float4(oo[r][0], oo[r][1], oo[r][2], oo[r][3]);
        } else {
            // S = eGL . S + Kd^T Vt, Kd rows 32u .. 32u+31
            int u = t - ns - 1;
            if (u == 0) {
#pragma unroll
                for (int m = 0; m < RPT; ++m)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) sn[m][qq] = 0.0f;
            }
#pragma unroll 4
            for (int jj = 0; jj < 32; ++jj) {
                float4 vt = *(const float4*)(Vt + (32 * u + jj) * 32 + 4 * cg);
                float V4[4] = {vt.x, vt.y, vt.z, vt.w}, kd[RPT];
                const float* kr = tile + jj * D + rg * RPT;
                if constexpr (RPT % 4 == 0) {
#pragma unroll
                    for (int m = 0; m < RPT; m += 4) {
                        float4 a = *(const float4*)(kr + m);
                        kd[m] = a.x; kd[m + 1] = a.y; kd[m + 2] = a.z; kd[m + 3] = a.w;
                    }
                } else {
#pragma unroll
                    for (int m = 0; m < RPT; m += 2) {
                        float2 a = *(const float2*)(kr + m);
                        kd[m] = a.x; kd[m + 1] = a.y;
                    }
                }
#pragma unroll
                for (int m = 0; m < RPT; ++m)
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) sn[m][qq] += kd[m] * V4[qq];
            }
            if (u == 1) {
#pragma unroll
                for (int m = 0; m < RPT; ++m) {
                    float* sp = Ss + (rg * RPT + m) * 32 + 4 * cg;
                    float4 s = *(float4*)sp;
                    s.x = egl[m] * s.x + sn[m][0];
                    s.y = egl[m] * s.y + sn[m][1];
                    s.z = egl[m] * s.z + sn[m][2];
                    s.w = egl[m] * s.w + sn[m][3];
                    *(float4*)sp = s;
                }
            }
        }
    }
    kda_cp_wait<0>();
    __syncthreads();
    for (int e = tid; e < D * 8; e += KDA_SCAN_THREADS) {
        int r = e >> 3, q4 = (e & 7) << 2;
        *(float4*)(Sg + (i64)r * D + q4) = *(const float4*)(Ss + r * 32 + q4);
    }
}

// Shared memory: (3 * 4096 + 32 D + 64 * 32) floats (73,728 bytes at D = 128: three blocks per SM).
extern "C" __global__ void __launch_bounds__(KDA_SCAN_THREADS, 3) kda_chunk_scan(const float* __restrict__ ws,
        float* __restrict__ S, float* __restrict__ out, int T, int H, int D, int c0, int nch) {
    extern __shared__ float sm[];
    switch (D) {
        case 32: kda_scan_body<2>(sm, ws, S, out, T, H, c0, nch); break;
        case 64: kda_scan_body<4>(sm, ws, S, out, T, H, c0, nch); break;
        case 96: kda_scan_body<6>(sm, ws, S, out, T, H, c0, nch); break;
        case 128: kda_scan_body<8>(sm, ws, S, out, T, H, c0, nch); break;
        default: break;
    }
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

// kda_gated_norm: one warp per pair of adjacent (t, h) units, NV float4s of o and r per lane and
// unit (D <= 128 NV), the weight quads held in registers; out may alias o.
template <int NV>
__device__ __forceinline__ void gated_norm4_body(const float* o, const float* __restrict__ r, i64 r_stride,
        const float* __restrict__ w, float* out, int T, int H, int D, float eps, int bf16_out) {
    int lane = threadIdx.x & 31;
    i64 units = (i64)T * H;
    i64 nw = (i64)gridDim.x * (blockDim.x >> 5);
    float4 wq[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        int d = (k * 32 + lane) * 4;
        wq[k] = d < D ? *(const float4*)(w + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (i64 p = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); 2 * p < units; p += nw) {
        float4 a[2][NV], g[2][NV];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            i64 wi = 2 * p + u;
            int t = (int)(wi / H), h = (int)(wi - (i64)t * H);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                int d = (k * 32 + lane) * 4;
                bool ok = wi < units && d < D;
                a[u][k] = ok ? *(const float4*)(o + wi * D + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                g[u][k] = ok ? *(const float4*)(r + (i64)t * r_stride + (i64)h * D + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            i64 wi = 2 * p + u;
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) ss += a[u][k].x * a[u][k].x + a[u][k].y * a[u][k].y + a[u][k].z * a[u][k].z + a[u][k].w * a[u][k].w;
            ss = warp_sum(ss);
            float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                int d = (k * 32 + lane) * 4;
                if (wi < units && d < D) {
                    float4 y = make_float4(a[u][k].x * inv * wq[k].x * sigmoid_f(g[u][k].x), a[u][k].y * inv * wq[k].y * sigmoid_f(g[u][k].y),
                                           a[u][k].z * inv * wq[k].z * sigmoid_f(g[u][k].z), a[u][k].w * inv * wq[k].w * sigmoid_f(g[u][k].w));
                    if (bf16_out) { y.x = round_bf16(y.x); y.y = round_bf16(y.y); y.z = round_bf16(y.z); y.w = round_bf16(y.w); }
                    *(float4*)(out + wi * D + d) = y;
                }
            }
        }
    }
}

// One entry point per NV: kda_gated_norm4_v<NV>, NV = 1..4.
#define GATED_NORM4(NV)                                                                                         \
    extern "C" __global__ void kda_gated_norm4_v##NV(const float* o, const float* __restrict__ r, i64 r_stride, \
            const float* __restrict__ w, float* out, int T, int H, int D, float eps, int bf16_out) {            \
        gated_norm4_body<NV>(o, r, r_stride, w, out, T, H, D, eps, bf16_out);                                   \
    }
GATED_NORM4(1)
GATED_NORM4(2)
GATED_NORM4(3)
GATED_NORM4(4)
