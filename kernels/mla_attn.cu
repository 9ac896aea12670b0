// Causal MLA prefill attention in the expanded form (spec 3.5): per head, q = [q_nope | q_pe],
// k = [k_nope | k_pe] (k_pe shared by all heads, never rotated: NoPE), v; scale 1/sqrt(dqk).
// Two kernels: an f32 reference-precision one (check mode) and a bf16 tensor-core flash kernel.
// MLA_DQK / MLA_DV are set at compile time (defaults: K3's 192 / 128).
#ifndef MLA_DQK
#define MLA_DQK 192
#endif
#ifndef MLA_DV
#define MLA_DV 128
#endif

// ------------------------------------------------------------------------------------------
// f32: one block per (query row qi, head h); the query sits at absolute position pos0 + qi and sees
// keys 0 ..= pos0 + qi. q: [Tq][H][dn+dr] (row stride qs); kv: [Tk][H][dn+dv] (row stride kvs),
// k_pe: [Tk] rows of dr at stride kps; out: [Tq][H][dv] (row stride os).
extern "C" __global__ void mla_attn_f32(const float* __restrict__ q, i64 qs, const float* __restrict__ kv, i64 kvs,
        const float* __restrict__ kpe, i64 kps, float* __restrict__ out, i64 os, int pos0, int H, int dn, int dr, int dv,
        float scale) {
    extern __shared__ float sm[];
    float* qv = sm;             // [dn+dr]
    float* acc = qv + dn + dr;  // [dv]
    float* p = acc + dv;        // [blockDim]
    __shared__ float red[32];
    int qi = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    int t = pos0 + qi;  // absolute position: keys 0..t
    int dqk = dn + dr;
    for (int d = tid; d < dqk; d += nt) qv[d] = q[(i64)qi * qs + (i64)h * dqk + d];
    for (int d = tid; d < dv; d += nt) acc[d] = 0.0f;
    __syncthreads();
    float m = NEG_INF, l = 0.0f;
    for (int s0 = 0; s0 <= t; s0 += nt) {
        int s = s0 + tid;
        float sc = NEG_INF;
        if (s <= t) {
            const float* kr = kv + (i64)s * kvs + (i64)h * (dn + dv);
            const float* pr = kpe + (i64)s * kps;
            float a = 0.0f;
            for (int d = 0; d < dn; ++d) a += qv[d] * kr[d];
            for (int d = 0; d < dr; ++d) a += qv[dn + d] * pr[d];
            sc = a * scale;
        }
        float cm = block_max(sc, red);
        float nm = fmaxf(m, cm);
        float f = expf(m - nm);
        float pv = s <= t ? expf(sc - nm) : 0.0f;
        float ps = block_sum(pv, red);
        l = l * f + ps;
        p[tid] = pv;
        __syncthreads();
        int cnt = min(nt, t - s0 + 1);
        for (int d = tid; d < dv; d += nt) {
            float a = acc[d] * f;
            for (int i = 0; i < cnt; ++i) a += p[i] * kv[(i64)(s0 + i) * kvs + (i64)h * (dn + dv) + dn + d];
            acc[d] = a;
        }
        __syncthreads();
        m = nm;
    }
    for (int d = tid; d < dv; d += nt) out[(i64)qi * os + (i64)h * dv + d] = acc[d] / l;
}

// ------------------------------------------------------------------------------------------
// Packing for the bf16 kernel (head-major bf16 copies):
//   mla_pack_q:  Qb[h][i][:] = q row i (Tq rows);  mla_pack_kv: Kb[h][s][:] = [k_nope | k_pe], Vb[h][s][:] = v (Tk rows;
//   Vb null: K only).
extern "C" __global__ void mla_pack_q(const float* __restrict__ q, i64 qs, bf16_t* __restrict__ Qb, int Tq, int H, int dqk) {
    int t = blockIdx.x, h = blockIdx.y;
    i64 o = ((i64)h * Tq + t);
    for (int d = threadIdx.x; d < dqk; d += blockDim.x) Qb[o * dqk + d] = f32_to_bf16(q[(i64)t * qs + (i64)h * dqk + d]);
}
extern "C" __global__ void mla_pack_kv(const float* __restrict__ kv, i64 kvs, const float* __restrict__ kpe, i64 kps,
        bf16_t* __restrict__ Kb, bf16_t* __restrict__ Vb, int Tk, int H, int dn, int dr, int dv) {
    int t = blockIdx.x, h = blockIdx.y;
    int dqk = dn + dr;
    i64 o = ((i64)h * Tk + t);
    for (int d = threadIdx.x; d < dqk; d += blockDim.x) {
        float kval = d < dn ? kv[(i64)t * kvs + (i64)h * (dn + dv) + d] : kpe[(i64)t * kps + d - dn];
        Kb[o * dqk + d] = f32_to_bf16(kval);
    }
    if (Vb == nullptr) return;  // K only
    for (int d = threadIdx.x; d < dv; d += blockDim.x)
        Vb[o * dv + d] = f32_to_bf16(kv[(i64)t * kvs + (i64)h * (dn + dv) + dn + d]);
}
// V transposed for the sm_90 kernel (mla_attn_sm90.cu): Vt[h][d][s] = v of key s, row stride ld
// (a multiple of 64, >= Tk), zeros in the columns Tk..ld. Block: 64 keys of one head, through shared
// memory so that both the reads and the writes are coalesced. Grid: (ld / 64, H).
extern "C" __global__ void mla_pack_vt(const float* __restrict__ kv, i64 kvs, bf16_t* __restrict__ Vt, i64 ld, int Tk,
        int H, int dn) {
    __shared__ float tile[64][MLA_DV + 1];
    int s0 = blockIdx.x * 64, h = blockIdx.y;
    for (int i = threadIdx.x; i < 64 * MLA_DV; i += blockDim.x) {
        int r = i / MLA_DV, d = i % MLA_DV;
        tile[r][d] = s0 + r < Tk ? kv[(i64)(s0 + r) * kvs + (i64)h * (dn + MLA_DV) + dn + d] : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * MLA_DV; i += blockDim.x) {
        int d = i / 64, r = i % 64;
        Vt[((i64)h * MLA_DV + d) * ld + s0 + r] = f32_to_bf16(tile[r][d]);
    }
}

// ------------------------------------------------------------------------------------------
// bf16 flash attention, mma.sync m16n8k16, f32 accumulate and f32 online softmax (every architecture;
// on sm_90 the backend runs mla_attn_sm90.cu instead).
// Block: 128 query rows (8 warps x 16), key tiles of 64 double-buffered with cp.async; K and V
// fragments by ldmatrix; p = 2^(s*scale*log2e - m*scale*log2e) as one FFMA + one EX2.
// Queries are rows 0..Tq of Qb at absolute positions pos0..pos0+Tq; Kb/Vb ([H][kld][..]) hold the
// keys kbase .. kbase + nk of the T = pos0 + Tq positions: one call over every key, or key blocks in
// order (kbase a multiple of 64, the last ending at T) carried between calls through out
// (unnormalised) and st ([Tq][H][8] f32: the four column threads' partial denominators, the row
// maximum), bit for bit the one-call result (mla_attn_sm90.cu says how).
// Grid: (ceil(Tq/128), H).
#define FA_BQ 128
#define FA_BK 64
#define FA_KLD (MLA_DQK + 8)
#define FA_VLD (MLA_DV + 8)

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(256, 1) mla_attn_bf16(const bf16_t* __restrict__ Qb,
        const bf16_t* __restrict__ Kb, const bf16_t* __restrict__ Vb, float* __restrict__ out, i64 os,
        int Tq, int pos0, int H, int kbase, int nk, int kld, float* __restrict__ st, float scale) {
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16_t* Ks = (bf16_t*)smraw;                  // [2][FA_BK][FA_KLD]
    bf16_t* Vs = Ks + 2 * FA_BK * FA_KLD;         // [2][FA_BK][FA_VLD]
    int qb = gridDim.x - 1 - blockIdx.x;          // heaviest blocks first
    int h = blockIdx.y;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, t4 = lane & 3;
    const int T = pos0 + Tq;  // keys
    const int kend = kbase + nk;
    const bf16_t* Qh = Qb + (i64)h * Tq * MLA_DQK;
    const bf16_t* Kh = Kb + (i64)h * kld * MLA_DQK;
    const bf16_t* Vh = Vb + (i64)h * kld * MLA_DV;
    // query rows in absolute positions: row r of this warp = q0 + .., local index r - pos0
    int q0 = pos0 + qb * FA_BQ + warp * 16;
    int last_row = min(pos0 + qb * FA_BQ + FA_BQ, T) - 1;
    if (last_row < kbase) return;  // every row of this block ended in an earlier key block
    int ntiles = (min(last_row + 1, kend) - kbase + FA_BK - 1) / FA_BK;

    // Q fragments for the warp's 16 rows
    u32 qf[MLA_DQK / 16][4];
#pragma unroll
    for (int kk = 0; kk < MLA_DQK / 16; ++kk) {
        int r0 = q0 + g, r1 = q0 + g + 8, c = kk * 16 + 2 * t4;
        qf[kk][0] = r0 < T ? *(const u32*)(Qh + (i64)(r0 - pos0) * MLA_DQK + c) : 0u;
        qf[kk][1] = r1 < T ? *(const u32*)(Qh + (i64)(r1 - pos0) * MLA_DQK + c) : 0u;
        qf[kk][2] = r0 < T ? *(const u32*)(Qh + (i64)(r0 - pos0) * MLA_DQK + c + 8) : 0u;
        qf[kk][3] = r1 < T ? *(const u32*)(Qh + (i64)(r1 - pos0) * MLA_DQK + c + 8) : 0u;
    }
    float o[MLA_DV / 8][4];
#pragma unroll
    for (int j = 0; j < MLA_DV / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    if (kbase > 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int row = q0 + g + 8 * r;
            // rows that ended in an earlier block, and rows past Tq, run on finite zeros, never stored
            mrow[r] = 0.0f;
            if (row < kbase || row >= T) continue;
            const float* srow = st + ((i64)(row - pos0) * H + h) * 8;
            lrow[r] = srow[t4];
            mrow[r] = srow[4];
#pragma unroll
            for (int jn = 0; jn < MLA_DV / 8; ++jn) {
                float2 v = *(const float2*)(out + (i64)(row - pos0) * os + (i64)h * MLA_DV + jn * 8 + 2 * t4);
                o[jn][2 * r] = v.x;
                o[jn][2 * r + 1] = v.y;
            }
        }
    }
    const float sl2 = scale * 1.4426950408889634f;

    auto load_tile = [&](int j, int buf) {
        int k0 = j * FA_BK;  // within the block
        bf16_t* kd = Ks + buf * FA_BK * FA_KLD;
        bf16_t* vd = Vs + buf * FA_BK * FA_VLD;
        const int kchunks = FA_BK * MLA_DQK / 8, vchunks = FA_BK * MLA_DV / 8;
        for (int c = tid; c < kchunks; c += blockDim.x) {
            int r = c / (MLA_DQK / 8), cc = (c % (MLA_DQK / 8)) * 8;
            bool ok = k0 + r < nk;
            cp_async16(kd + r * FA_KLD + cc, ok ? (const void*)(Kh + (i64)(k0 + r) * MLA_DQK + cc) : (const void*)Kh, ok ? 16 : 0);
        }
        for (int c = tid; c < vchunks; c += blockDim.x) {
            int r = c / (MLA_DV / 8), cc = (c % (MLA_DV / 8)) * 8;
            bool ok = k0 + r < nk;
            cp_async16(vd + r * FA_VLD + cc, ok ? (const void*)(Vh + (i64)(k0 + r) * MLA_DV + cc) : (const void*)Vh, ok ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    load_tile(0, 0);
    for (int j = 0; j < ntiles; ++j) {
        if (j + 1 < ntiles) {
            load_tile(j + 1, (j + 1) & 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        int k0 = kbase + j * FA_BK;  // absolute
        if (k0 <= q0 + 15 && q0 < T) {
            const bf16_t* kt = Ks + (j & 1) * FA_BK * FA_KLD;
            const bf16_t* vt = Vs + (j & 1) * FA_BK * FA_VLD;
            float s[FA_BK / 8][4];
#pragma unroll
            for (int n = 0; n < FA_BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            // K fragments by ldmatrix.x4: matrices (keys n*8.., d lo), (n*8.., d hi), (n*8+8.., lo), (n*8+8.., hi)
            const u32 kaddr = smem_u32(kt) + (u32)((((lane >> 4) << 3) + (lane & 7)) * FA_KLD * 2 + ((lane >> 3) & 1) * 16);
#pragma unroll
            for (int kk = 0; kk < MLA_DQK / 16; ++kk) {
#pragma unroll
                for (int n = 0; n < FA_BK / 8; n += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kaddr + (u32)(n * 8 * FA_KLD * 2 + kk * 32), b0, b1, b2, b3);
                    mma16816(s[n], qf[kk], b0, b1);
                    mma16816(s[n + 1], qf[kk], b2, b3);
                }
            }
            // raw scores; masked ones -inf; p = 2^(s*scale*log2e - m*scale*log2e), one FFMA + one EX2 each
            bool need_mask = (k0 + FA_BK - 1 > q0) || (k0 + FA_BK > kend);
            if (need_mask) {
#pragma unroll
                for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int key = k0 + n * 8 + 2 * t4 + (e & 1);
                        int row = q0 + g + ((e >> 1) << 3);
                        if (key > row || key >= kend) s[n][e] = NEG_INF;
                    }
            }
            float tmax[2] = {mrow[0], mrow[1]};
#pragma unroll
            for (int n = 0; n < FA_BK / 8; ++n) {
                tmax[0] = fmaxf(tmax[0], fmaxf(s[n][0], s[n][1]));
                tmax[1] = fmaxf(tmax[1], fmaxf(s[n][2], s[n][3]));
            }
            float alpha[2], ms[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
                tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
                // finite: every row sees key 0 in tile 0, and tiles run in order
                alpha[r] = ex2((mrow[r] - tmax[r]) * sl2);
                mrow[r] = tmax[r];
                ms[r] = tmax[r] * sl2;
            }
            float psum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float pv = ex2(fmaf(s[n][e], sl2, -ms[e >> 1]));
                    s[n][e] = pv;
                    psum[e >> 1] += pv;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) lrow[r] = lrow[r] * alpha[r] + psum[r];
#pragma unroll
            for (int jn = 0; jn < MLA_DV / 8; ++jn) {
                o[jn][0] *= alpha[0]; o[jn][1] *= alpha[0];
                o[jn][2] *= alpha[1]; o[jn][3] *= alpha[1];
            }
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; ++kk) {
                u32 pa[4];
                pa[0] = bf16x2_rn(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = bf16x2_rn(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = bf16x2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = bf16x2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int jv = 0; jv < MLA_DV / 16; ++jv) {
                    int mi = lane >> 3, ri = lane & 7;
                    const bf16_t* p = vt + (kk * 16 + (mi & 1) * 8 + ri) * FA_VLD + jv * 16 + (mi >> 1) * 8;
                    u32 b0, b1, b2, b3;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(smem_u32(p)));
                    mma16816(o[2 * jv], pa, b0, b1);
                    mma16816(o[2 * jv + 1], pa, b2, b3);
                }
            }
        }
        __syncthreads();
    }
    float part[2] = {lrow[0], lrow[1]};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int row = q0 + g + 8 * r;
        if (row >= T || row < kbase) continue;
        if (row >= kend) {  // the row's keys go on in the next block: its running sums
            float* srow = st + ((i64)(row - pos0) * H + h) * 8;
            srow[t4] = part[r];
            if (t4 == 0) srow[4] = mrow[r];
#pragma unroll
            for (int jn = 0; jn < MLA_DV / 8; ++jn)
                *(float2*)(out + (i64)(row - pos0) * os + (i64)h * MLA_DV + jn * 8 + 2 * t4) = make_float2(o[jn][2 * r], o[jn][2 * r + 1]);
            continue;
        }
        float inv = 1.0f / lrow[r];
#pragma unroll
        for (int jn = 0; jn < MLA_DV / 8; ++jn) {
            int c = jn * 8 + 2 * t4;
            *(float2*)(out + (i64)(row - pos0) * os + (i64)h * MLA_DV + c) = make_float2(o[jn][2 * r] * inv, o[jn][2 * r + 1] * inv);
        }
    }
}
