// Grouped MXFP4 x activation GEMMs for the routed experts, dequantising in registers straight from
// the checkpoint's packed layout (spec 2.3: byte j of a row holds elements 2j (low nibble) and
// 2j+1 (high nibble); one E8M0 scale byte per 32 elements).
//
// Expert weights sit in an arena: expert e (e_lo <= e < e_hi) starts at wbase + (e - e_lo) * estride;
// inside it the matrix used here has its packed bytes at off_p and scales at off_s
// (rows of K/2 and K/32 bytes). The fused variant reads a second matrix (off_p2, off_s2) and writes
// situ(X W1^T, X W3^T); the plain one writes X W^T.
// Rows: the grouped activation rows of each expert, located through the tile table of moe_offsets.

__device__ __forceinline__ float situ_e(float g, float u, float b1, float b2) {
    float gate = b1 * tanhf(g / b1) * sigmoid_f(g);
    float up = b2 > 0.0f ? b2 * tanhf(u / b2) : u;
    return gate * up;
}

// ---------------------------------------------------------------------------------------------
// f32 variant (check mode): 32x32 tiles, 256 threads, 2x2 outputs per thread, FFMA only.
#define F_BM 32
#define F_BN 32
#define F_BK 32
extern "C" __global__ void expert_gemm_f32(const float* __restrict__ X, const int* __restrict__ tile_expert,
        const int* __restrict__ tile_row0, const int* __restrict__ tile_count, const int* __restrict__ offsets,
        const u8* __restrict__ wbase, i64 estride, i64 off_p, i64 off_s, i64 off_p2, i64 off_s2,
        int fused, int e_lo, int e_hi, int N, int K, float* __restrict__ out, float b1, float b2) {
    __shared__ float xs[F_BM][F_BK + 1];
    __shared__ float ws[F_BN][F_BK + 1];
    __shared__ float ws2[F_BN][F_BK + 1];
    int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    int e = tile_expert[tile];
    if (e < e_lo || e >= e_hi) return;
    int row0 = tile_row0[tile], rend = offsets[e + 1];
    int n0 = blockIdx.x * F_BN;
    const u8* eb = wbase + (i64)(e - e_lo) * estride;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[2][2] = {{0, 0}, {0, 0}}, acc2[2][2] = {{0, 0}, {0, 0}};
    for (int k0 = 0; k0 < K; k0 += F_BK) {
        for (int i = threadIdx.x; i < F_BM * F_BK; i += blockDim.x) {
            int r = i / F_BK, c = i % F_BK;
            xs[r][c] = (row0 + r < rend) ? X[(i64)(row0 + r) * K + k0 + c] : 0.0f;
        }
        for (int i = threadIdx.x; i < F_BN * F_BK; i += blockDim.x) {
            int r = i / F_BK, c = i % F_BK, n = n0 + r, kk = k0 + c;
            float v = 0.0f, v2 = 0.0f;
            if (n < N) {
                u8 byte = eb[off_p + (i64)n * (K / 2) + kk / 2];
                v = e2m1_f32((kk & 1) ? (byte >> 4) : (byte & 15)) * e8m0_scale(eb[off_s + (i64)n * (K / 32) + kk / 32]);
                if (fused) {
                    u8 b2y = eb[off_p2 + (i64)n * (K / 2) + kk / 2];
                    v2 = e2m1_f32((kk & 1) ? (b2y >> 4) : (b2y & 15)) * e8m0_scale(eb[off_s2 + (i64)n * (K / 32) + kk / 32]);
                }
            }
            ws[r][c] = v;
            ws2[r][c] = v2;
        }
        __syncthreads();
        for (int c = 0; c < F_BK; ++c) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    acc[i][j] += xs[ty + 16 * i][c] * ws[tx + 16 * j][c];
                    if (fused) acc2[i][j] += xs[ty + 16 * i][c] * ws2[tx + 16 * j][c];
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            int r = row0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (r < rend && n < N) out[(i64)r * N + n] = fused ? situ_e(acc[i][j], acc2[i][j], b1, b2) : acc[i][j];
        }
}

// ---------------------------------------------------------------------------------------------
// bf16 tensor-core variant: mma.sync m16n8k16 (bf16 in, f32 accumulate). Block tile 128 rows x
// 128 B-rows x 32 k, 8 warps as 4 (rows) x 2 (B-rows). B-rows are W rows n0..n0+127 (plain) or
// W1 rows n0..n0+63 then W3 rows n0..n0+63 (fused, output width 64 per block).
#define M_BM 128
#define M_BK 32
#define M_LD 40   // smem row stride in bf16: 80 bytes keeps fragment loads conflict-free

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 8 MXFP4 codes (4 packed bytes) times a decoded scale, to 8 bf16 packed in 4 u32.
__device__ __forceinline__ void dequant8(u32 w, float sc, u32* o) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        u32 byte = (w >> (8 * b)) & 0xffu;
        float lo = e2m1_f32(byte & 15u) * sc, hi = e2m1_f32(byte >> 4) * sc;
        // exact in bf16: truncation keeps all bits
        o[b] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
    }
}

// 16 MXFP4 codes (8 packed bytes) times a scale, to 16 bf16 packed in 8 u32.
__device__ __forceinline__ void dequant16(uint2 p, u8 s, u32* o) {
    float sc = e8m0_scale(s);
    dequant8(p.x, sc, o);
    dequant8(p.y, sc, o + 4);
}

__device__ __forceinline__ u32 smem_addr_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr_u32(p)));
}

// LDSM = true loads the fragments with ldmatrix (4x fewer shared-memory instructions).
template <bool FUSED, bool LDSM>
__device__ __forceinline__ void expert_gemm_mma(const bf16_t* __restrict__ X, const int* __restrict__ tile_expert,
        const int* __restrict__ tile_row0, const int* __restrict__ tile_count, const int* __restrict__ offsets,
        const u8* __restrict__ wbase, i64 estride, i64 off_p, i64 off_s, i64 off_p2, i64 off_s2,
        int e_lo, int e_hi, int N, int K, void* __restrict__ outp, float b1, float b2) {
    __shared__ __align__(16) bf16_t As[M_BM * M_LD];
    __shared__ __align__(16) bf16_t Bs[128 * M_LD];
    int tile = blockIdx.y;
    if (tile >= tile_count[0]) return;
    int e = tile_expert[tile];
    if (e < e_lo || e >= e_hi) return;
    int row0 = tile_row0[tile], rend = offsets[e + 1];
    const int BNO = FUSED ? 64 : 128;  // output columns per block
    int n0 = blockIdx.x * BNO;
    if (n0 >= N) return;
    const u8* eb = wbase + (i64)(e - e_lo) * estride;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp & 3, wn = warp >> 2;
    int g = lane >> 2, t4 = lane & 3;

    // loader roles: row lr = tid/2, half lh = tid%2
    int lr = tid >> 1, lh = tid & 1;
    bool a_ok = row0 + lr < rend;
    const bf16_t* a_src = X + (i64)(row0 + lr) * K + lh * 16;
    int brow_n; const u8* bp; const u8* bs;
    if (FUSED) {
        brow_n = n0 + (lr & 63);
        bool up = lr >= 64;
        bp = eb + (up ? off_p2 : off_p) + (i64)brow_n * (K / 2) + lh * 8;
        bs = eb + (up ? off_s2 : off_s) + (i64)brow_n * (K / 32);
    } else {
        brow_n = n0 + lr;
        bp = eb + off_p + (i64)brow_n * (K / 2) + lh * 8;
        bs = eb + off_s + (i64)brow_n * (K / 32);
    }
    bool b_ok = brow_n < N;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

    int brow_base[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
        brow_base[j] = FUSED ? (j < 4 ? wn * 32 + 8 * j : 64 + wn * 32 + 8 * (j - 4)) : wn * 64 + 8 * j;

    uint4 ra0 = make_uint4(0, 0, 0, 0), ra1 = make_uint4(0, 0, 0, 0);
    uint2 rb = make_uint2(0, 0);
    u8 rs = 127;
    int nk = K / M_BK;
    // prefetch tile 0
    if (a_ok) { ra0 = *(const uint4*)(a_src); ra1 = *(const uint4*)(a_src + 8); }
    if (b_ok) { rb = *(const uint2*)(bp); rs = bs[0]; }
    for (int kt = 0; kt < nk; ++kt) {
        // stage registers -> smem
        *(uint4*)(&As[lr * M_LD + lh * 16]) = ra0;
        *(uint4*)(&As[lr * M_LD + lh * 16 + 8]) = ra1;
        u32 dq[8];
        dequant16(rb, rs, dq);
        *(uint4*)(&Bs[lr * M_LD + lh * 16]) = make_uint4(dq[0], dq[1], dq[2], dq[3]);
        *(uint4*)(&Bs[lr * M_LD + lh * 16 + 8]) = make_uint4(dq[4], dq[5], dq[6], dq[7]);
        __syncthreads();
        // prefetch next tile into registers while computing
        if (kt + 1 < nk) {
            if (a_ok) { ra0 = *(const uint4*)(a_src + (kt + 1) * M_BK); ra1 = *(const uint4*)(a_src + (kt + 1) * M_BK + 8); }
            if (b_ok) { rb = *(const uint2*)(bp + (kt + 1) * 16); rs = bs[kt + 1]; }
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            u32 af[2][4], bfr[8][2];
            if (LDSM) {
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    ldsm_x4(af[i], &As[(wm * 32 + 16 * i + (lane & 15)) * M_LD + kk * 16 + (lane >> 4) * 8]);
#pragma unroll
                for (int j = 0; j < 8; j += 2) {
                    int mi = lane >> 3;
                    u32 r4[4];
                    int jj = j + (mi >> 1);
                    int rb = FUSED ? (jj < 4 ? wn * 32 + 8 * jj : 64 + wn * 32 + 8 * (jj - 4)) : wn * 64 + 8 * jj;
                    ldsm_x4(r4, &Bs[(rb + (lane & 7)) * M_LD + kk * 16 + (mi & 1) * 8]);
                    bfr[j][0] = r4[0]; bfr[j][1] = r4[1]; bfr[j + 1][0] = r4[2]; bfr[j + 1][1] = r4[3];
                }
            } else {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    int r = wm * 32 + 16 * i + g;
                    const bf16_t* p = &As[r * M_LD + kk * 16 + 2 * t4];
                    af[i][0] = *(const u32*)(p);
                    af[i][1] = *(const u32*)(p + 8 * M_LD);
                    af[i][2] = *(const u32*)(p + 8);
                    af[i][3] = *(const u32*)(p + 8 * M_LD + 8);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const bf16_t* p = &Bs[(brow_base[j] + g) * M_LD + kk * 16 + 2 * t4];
                    bfr[j][0] = *(const u32*)(p);
                    bfr[j][1] = *(const u32*)(p + 8);
                }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) mma_bf16(acc[i][j], af[i], bfr[j]);
        }
        __syncthreads();
    }
    // epilogue
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = row0 + wm * 32 + 16 * i + g + 8 * h;
            if (r >= rend) continue;
            if (FUSED) {
                bf16_t* out = (bf16_t*)outp;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int c = n0 + wn * 32 + 8 * j + 2 * t4;
                    float v0 = situ_e(acc[i][j][2 * h], acc[i][j + 4][2 * h], b1, b2);
                    float v1 = situ_e(acc[i][j][2 * h + 1], acc[i][j + 4][2 * h + 1], b1, b2);
                    if (c + 1 < N) *(u32*)(&out[(i64)r * N + c]) = pack_bf16x2(v0, v1);
                    else if (c < N) out[(i64)r * N + c] = f32_to_bf16(v0);
                }
            } else {
                float* out = (float*)outp;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    int c = n0 + wn * 64 + 8 * j + 2 * t4;
                    if (c + 1 < N) *(float2*)(&out[(i64)r * N + c]) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                    else if (c < N) out[(i64)r * N + c] = acc[i][j][2 * h];
                }
            }
        }
}

#define EXPERT_KERNELS(SUFFIX, LDSM)                                                                          \
extern "C" __global__ void __launch_bounds__(256, 2) expert_gateup_bf16##SUFFIX(const bf16_t* __restrict__ X,        \
        const int* __restrict__ tile_expert, const int* __restrict__ tile_row0, const int* __restrict__ tile_count,  \
        const int* __restrict__ offsets, const u8* __restrict__ wbase, i64 estride, i64 off_p, i64 off_s,            \
        i64 off_p2, i64 off_s2, int e_lo, int e_hi, int N, int K, bf16_t* __restrict__ out, float b1, float b2) {    \
    expert_gemm_mma<true, LDSM>(X, tile_expert, tile_row0, tile_count, offsets, wbase, estride, off_p, off_s, off_p2, \
                                off_s2, e_lo, e_hi, N, K, out, b1, b2);                                              \
}                                                                                                                    \
extern "C" __global__ void __launch_bounds__(256, 2) expert_down_bf16##SUFFIX(const bf16_t* __restrict__ X,          \
        const int* __restrict__ tile_expert, const int* __restrict__ tile_row0, const int* __restrict__ tile_count,  \
        const int* __restrict__ offsets, const u8* __restrict__ wbase, i64 estride, i64 off_p, i64 off_s,            \
        int e_lo, int e_hi, int N, int K, float* __restrict__ out) {                                                 \
    expert_gemm_mma<false, LDSM>(X, tile_expert, tile_row0, tile_count, offsets, wbase, estride, off_p, off_s, 0, 0, \
                                 e_lo, e_hi, N, K, out, 0.0f, 0.0f);                                                 \
}

// Fused gate/up + SiTU: H[rows, N] (bf16) = situ(X W1^T, X W3^T), grid (ceil(N/64), max tiles);
// down projection: Y[rows, N] (f32) = X W2^T, grid (ceil(N/128), max tiles).
// Suffix-less kernels load fragments with ldmatrix; *_lds32 with 32-bit shared loads (first version).
EXPERT_KERNELS(, true)
EXPERT_KERNELS(_lds32, false)

// ---------------------------------------------------------------------------------------------
// Dense path for large row counts per expert: the MXFP4 weights of a group of experts are
// dequantised to BF16 once (exactly: dequant16 above, the same decode as the register path) into
// a scratch buffer, the per-expert GEMMs run on cuBLAS (bf16 in, f32 out), and SiTU-GLU turns the
// f32 gate|up product into the bf16 intermediate.

// Expert j of the launch (blockIdx.y) sits in arena slot s0 + j (at wbase + (s0 + j) * estride);
// its [rows, K] matrix at (off_p, off_s) is written, exactly, as bf16 to dst + j * dst_estride
// elements. `words` = rows * K / 8: each thread turns one packed u32 (8 codes; 4 words share an
// E8M0 scale) into 16 output bytes, so loads and stores of a warp are contiguous. With `offsets`
// non-null, an expert without routed rows (absolute id e0 + j) is skipped.
extern "C" __global__ void expert_dequant_bf16(const u8* __restrict__ wbase, i64 estride, int s0, i64 off_p,
        i64 off_s, i64 words, const int* __restrict__ offsets, int e0, bf16_t* __restrict__ dst, i64 dst_estride) {
    int j = blockIdx.y;
    if (offsets != 0 && offsets[e0 + j + 1] == offsets[e0 + j]) return;
    const u8* eb = wbase + (i64)(s0 + j) * estride;
    const u32* P = (const u32*)(eb + off_p);
    const u8* S = eb + off_s;
    uint4* D = (uint4*)(dst + (i64)j * dst_estride);
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < words; q += (i64)gridDim.x * blockDim.x) {
        u32 o[4];
        dequant8(P[q], e8m0_scale(S[q >> 2]), o);
        D[q] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// H[r, i] = bf16(situ(GU[r, i], GU[r, n + i])): GU is [rows, 2n] f32 (gate columns, then up
// columns), H is [rows, n] bf16; n a multiple of 4. Same SiTU and rounding as the fused kernel.
extern "C" __global__ void expert_situ_bf16(const float* __restrict__ gu, i64 rows, int n, bf16_t* __restrict__ h,
                                            float b1, float b2) {
    int n4 = n / 4;
    i64 total = rows * n4;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / n4;
        int c = (int)(i % n4) * 4;
        const float* g = gu + r * 2 * n;
        float4 a = *(const float4*)(g + c);
        float4 u = *(const float4*)(g + n + c);
        uint2 o = make_uint2(pack_bf16x2(situ_e(a.x, u.x, b1, b2), situ_e(a.y, u.y, b1, b2)),
                             pack_bf16x2(situ_e(a.z, u.z, b1, b2), situ_e(a.w, u.w, b1, b2)));
        *(uint2*)(h + r * n + c) = o;
    }
}
