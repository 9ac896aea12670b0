// Causal MLA prefill attention for Hopper (sm_90a): warpgroup MMA (wgmma) flash attention.
// Same function as mla_attn_bf16 in mla_attn.cu (which stays the kernel of every other architecture):
// out[i][h][:] = softmax_{j <= pos0+i}(q_i . k_j * scale) . v_j, bf16 operands, f32 accumulation and softmax.
//
// CTA: NWG warpgroups (consumers, 64 query rows each) of one head. Per key tile of BK keys:
// S = Q.K^T by wgmma with both operands in shared memory (descriptors), online softmax on the S
// registers, P converted in registers to bf16 and used as the A operand of O += P.V with V^T from
// shared memory. Tiles are loaded by all threads with cp.async, NSTG stages deep.
//
// Shared memory, all operands K-major with the 128-byte swizzle: a matrix of R rows and C = 64*n bf16
// columns is stored as n panels of [R][64] (128-byte rows, panel after panel); inside a panel, the
// 16-byte chunk c of row r sits at chunk c ^ (r % 8). The descriptor of such a panel has stride byte
// offset 1024 (8 rows) and leading byte offset unused; a k16 step is +32 bytes of the start address
// (the hardware applies the XOR to the final address, so panels must start 1024-byte aligned).
//
// Inputs (packed by mla_attn.cu: mla_pack_q, mla_pack_kv for K, mla_pack_vt for V^T):
//   Qb [H][Tq][DQK], Kb [H][kld][DQK], Vt [H][DV][vt_ld] with vt_ld a multiple of 128 (>= nk) and
//   zeros in the columns nk..vt_ld: the keys kbase .. kbase + nk of the T = pos0 + Tq positions.
//
// Key blocks: one call may see a block of the keys only (kbase a multiple of 128; the blocks of one
// attention come in order and the last ends at T). A row whose own key lies past the block ends the
// call unnormalised, its running sums in st ([Tq][H][8] f32: the four column threads' partial
// denominators, then the row maximum) and its accumulator in out; the next block's call resumes
// from there. Each key tile sees the same operations in the same order as in one call over every
// key, so the result is bit for bit the one-call result. st is unused when one call holds every key.
//
// Entry points (launcher: cuda-prefiller/src/cuda/kernels.rs, mla_attn_sm90):
//   mla_attn_sm90_m192    3 warpgroups (192 rows), 64-key tiles, 2 stages (fewer K/V bytes per FLOP;
//                         the default: 441 TFLOP/s at 32k tokens on the H200)
//   mla_attn_sm90         2 warpgroups (128 rows), 128-key tiles, 2 stages (419)
//   mla_attn_sm90_m192s3  3 warpgroups, 64-key tiles, 3 stages (433)
#ifndef MLA_DQK
#define MLA_DQK 192
#endif
#ifndef MLA_DV
#define MLA_DV 128
#endif
#if MLA_DQK % 64 != 0 || MLA_DV != 128
#error "mla_attn_sm90 needs MLA_DQK a multiple of 64 and MLA_DV = 128"
#endif

#define W_QP (MLA_DQK / 64)  // 64-column panels of Q and K

__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Offset of the 16-byte chunk `ch` (0..7) of row `r` inside a 128B-swizzled panel.
__device__ __forceinline__ u32 swz(int r, int ch) { return (u32)(r * 128 + ((ch ^ (r & 7)) << 4)); }

// Shared-memory matrix descriptor: start address, leading byte offset (unused for swizzled K-major:
// 1), stride byte offset 1024, 128-byte swizzle (mode 1 in bits 62..63).
__device__ __forceinline__ unsigned long long sw128_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// ---- wgmma wrappers (operand lists written out by a script; m64nNk16, bf16 in, f32 accumulate)
// D[64x128] (+)= A[64x16] (shared, descriptor) * B[16x128] (shared, descriptor); both K-major.
__device__ __forceinline__ void wg_mma_ss128(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

// D[64x64] (+)= A[64x16] (shared, descriptor) * B[16x64] (shared, descriptor); both K-major.
__device__ __forceinline__ void wg_mma_ss64(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}

// D[64x128] += A[64x16] (registers, in the mma.sync A-fragment order) * B[16x128] (shared, descriptor, K-major).
__device__ __forceinline__ void wg_mma_rs128(float* d, const u32* a, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Ties N accumulator registers to this point (the compiler may not move their uses across it).
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int BK>
__device__ __forceinline__ void wg_mma_s(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    if (BK == 128) wg_mma_ss128(d, da, db, accumulate);
    else wg_mma_ss64(d, da, db, accumulate);
}

// Shared memory of a configuration (Sm90Variant::smem in kernels.rs computes the same):
//   NWG*64 * DQK * 2 (Q) + NSTG * (BK * DQK * 2 + DV * BK * 2) (K, V^T stages) + 1024 (alignment).

template <int NWG, int BK, int NSTG>
__device__ __forceinline__ void mla_sm90_body(const bf16_t* __restrict__ Qb, const bf16_t* __restrict__ Kb,
        const bf16_t* __restrict__ Vt, i64 vt_ld, float* __restrict__ out, i64 os, int Tq, int pos0, int kbase, int nk,
        int kld, float* __restrict__ st, float scale, unsigned char* smraw) {
    constexpr int NT = NWG * 128;          // threads
    constexpr int BQ = NWG * 64;           // query rows per CTA
    constexpr int PQ = BQ * 128;           // bytes of one Q panel
    constexpr int PK = BK * 128;           // bytes of one K panel
    constexpr int PV = MLA_DV * 128;       // bytes of one V^T panel (64 keys)
    constexpr int STAGE = W_QP * PK + (BK / 64) * PV;
    constexpr int NS = BK / 2;             // S accumulators per thread
    const u32 sbase = (smem_u32(smraw) + 1023u) & ~1023u;
    const int qb = gridDim.x - 1 - blockIdx.x;  // heaviest query blocks of a head first
    const int h = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wl = warp & 3, g = lane >> 2, t4 = lane & 3;
    const int T = pos0 + Tq;
    const int kend = kbase + nk;  // keys of this call: kbase .. kend
    const bf16_t* Qh = Qb + (i64)h * Tq * MLA_DQK;
    const bf16_t* Kh = Kb + (i64)h * kld * MLA_DQK;
    const bf16_t* Vh = Vt + (i64)h * MLA_DV * vt_ld;
    const int row_base = pos0 + qb * BQ + wg * 64;  // absolute position of this warpgroup's first row
    const int rowA = row_base + wl * 16 + g, rowB = rowA + 8;
    const int last_row = min(pos0 + qb * BQ + BQ, T) - 1;
    if (last_row < kbase) return;  // every row of this CTA ended in an earlier block
    const int ntiles = (min(last_row + 1, kend) - kbase + BK - 1) / BK;
    const int wg_last = min(row_base + 63, T - 1);

    // Q block (rows past Tq read as zeros), committed with key tile 0
    for (int c = tid; c < BQ * (MLA_DQK / 8); c += NT) {
        int r = c / (MLA_DQK / 8), cc = c % (MLA_DQK / 8);
        int qi = qb * BQ + r;
        bool ok = qi < Tq;
        cp16(sbase + (cc >> 3) * PQ + swz(r, cc & 7), Qh + (i64)(ok ? qi : 0) * MLA_DQK + cc * 8, ok ? 16 : 0);
    }
    // tile j into stage j % NSTG; every call commits one cp.async group (empty past the last tile)
    auto load_tile = [&](int j) {
        if (j >= ntiles) {
            asm volatile("cp.async.commit_group;\n" ::);
            return;
        }
        const int k0 = j * BK;  // within the block
        const u32 kd = sbase + W_QP * PQ + (j % NSTG) * STAGE, vd = kd + W_QP * PK;
        for (int c = tid; c < BK * (MLA_DQK / 8); c += NT) {
            int r = c / (MLA_DQK / 8), cc = c % (MLA_DQK / 8);
            bool ok = k0 + r < nk;
            cp16(kd + (cc >> 3) * PK + swz(r, cc & 7), Kh + (i64)(ok ? k0 + r : 0) * MLA_DQK + cc * 8, ok ? 16 : 0);
        }
        for (int c = tid; c < MLA_DV * (BK / 8); c += NT) {
            int r = c / (BK / 8), cc = c % (BK / 8);
            cp16(vd + (cc >> 3) * PV + swz(r, cc & 7), Vh + (i64)r * vt_ld + k0 + cc * 8, 16);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int j = 0; j < NSTG - 1; ++j) load_tile(j);  // groups 0..NSTG-2 (Q with tile 0)

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    if (kbase > 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int row = r ? rowB : rowA;
            // rows that ended in an earlier block, and rows past Tq, run on finite zeros, never stored
            mrow[r] = 0.0f;
            if (row < kbase || row >= T) continue;
            const float* srow = st + ((i64)(row - pos0) * gridDim.y + blockIdx.y) * 8;
            lrow[r] = srow[t4];
            mrow[r] = srow[4];
            const float* orow = out + (i64)(row - pos0) * os + (i64)blockIdx.y * MLA_DV;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float2 v = *(const float2*)(orow + 8 * i + 2 * t4);
                o[4 * i + 2 * r] = v.x;
                o[4 * i + 2 * r + 1] = v.y;
            }
        }
    }
    const float sl2 = scale * 1.4426950408889634f;

    for (int j = 0; j < ntiles; ++j) {
        // groups 0..j+NSTG-2 are committed; tile j (group j) landed: make it visible to the tensor
        // cores and to all threads. The barrier also ends every use of stage (j-1) % NSTG in step j-1,
        // which the load of tile j+NSTG-1 below overwrites.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTG - 2) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        load_tile(j + NSTG - 1);
        const int k0 = kbase + j * BK;  // absolute
        if (k0 > wg_last) continue;  // every key of this tile is after every row of this warpgroup
        const u32 kt = sbase + W_QP * PQ + (j % NSTG) * STAGE, vt = kt + W_QP * PK;
        float s[NS];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < MLA_DQK / 16; ++kk) {
            unsigned long long da = sw128_desc(sbase + (kk >> 2) * PQ + wg * 64 * 128 + (kk & 3) * 32);
            unsigned long long db = sw128_desc(kt + (kk >> 2) * PK + (kk & 3) * 32);
            wg_mma_s<BK>(s, da, db, kk > 0);
        }
        wg_commit();
        wg_wait0();
        wg_fence_regs<NS>(s);

        // s[4i + e]: row rowA (e < 2) or rowB, key k0 + 8i + 2*t4 + (e & 1)
        if (k0 + BK - 1 > row_base || k0 + BK > kend) {
#pragma unroll
            for (int i = 0; i < BK / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int key = k0 + 8 * i + 2 * t4 + (e & 1);
                    int row = e < 2 ? rowA : rowB;
                    if (key > row || key >= kend) s[4 * i + e] = NEG_INF;
                }
        }
        float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
        float alpha[2], ms[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            // mx is finite: key 0 of tile 0 is visible to every row, tiles run in order, and a later
            // block starts from the row's maximum so far
            alpha[r] = ex2((mrow[r] - mx[r]) * sl2);
            mrow[r] = mx[r];
            ms[r] = mx[r] * sl2;
        }
        u32 pa[BK / 16][4];
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) {
            float p0 = ex2(fmaf(s[4 * i], sl2, -ms[0])), p1 = ex2(fmaf(s[4 * i + 1], sl2, -ms[0]));
            float p2 = ex2(fmaf(s[4 * i + 2], sl2, -ms[1])), p3 = ex2(fmaf(s[4 * i + 3], sl2, -ms[1]));
            ps[0] += p0 + p1;
            ps[1] += p2 + p3;
            pa[i >> 1][(i & 1) * 2 + 0] = bf16x2_rn(p0, p1);
            pa[i >> 1][(i & 1) * 2 + 1] = bf16x2_rn(p2, p3);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) lrow[r] = lrow[r] * alpha[r] + ps[r];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            o[4 * i] *= alpha[0];
            o[4 * i + 1] *= alpha[0];
            o[4 * i + 2] *= alpha[1];
            o[4 * i + 3] *= alpha[1];
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wg_mma_rs128(o, pa[kk], sw128_desc(vt + (kk >> 2) * PV + (kk & 3) * 32));
        wg_commit();
        wg_wait0();
        wg_fence_regs<64>(o);
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");

    float part[2] = {lrow[0], lrow[1]};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int row = r ? rowB : rowA;
        if (row >= T || row < kbase) continue;
        float* orow = out + (i64)(row - pos0) * os + (i64)blockIdx.y * MLA_DV;
        if (row >= kend) {  // the row's keys go on in the next block: its running sums
            float* srow = st + ((i64)(row - pos0) * gridDim.y + blockIdx.y) * 8;
            srow[t4] = part[r];
            if (t4 == 0) srow[4] = mrow[r];
#pragma unroll
            for (int i = 0; i < 16; ++i) *(float2*)(orow + 8 * i + 2 * t4) = make_float2(o[4 * i + 2 * r], o[4 * i + 2 * r + 1]);
            continue;
        }
        float inv = 1.0f / lrow[r];
#pragma unroll
        for (int i = 0; i < 16; ++i)
            *(float2*)(orow + 8 * i + 2 * t4) = make_float2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    }
}

#define MLA_SM90_ENTRY(NAME, NWG, BK, NSTG)                                                                              \
    extern "C" __global__ void __launch_bounds__(NWG * 128, 1) NAME(const bf16_t* __restrict__ Qb,                      \
            const bf16_t* __restrict__ Kb, const bf16_t* __restrict__ Vt, i64 vt_ld, float* __restrict__ out, i64 os,  \
            int Tq, int pos0, int H, int kbase, int nk, int kld, float* __restrict__ st, float scale) {                 \
        extern __shared__ __align__(1024) unsigned char smraw[];                                                         \
        mla_sm90_body<NWG, BK, NSTG>(Qb, Kb, Vt, vt_ld, out, os, Tq, pos0, kbase, nk, kld, st, scale, smraw);             \
    }
MLA_SM90_ENTRY(mla_attn_sm90, 2, 128, 2)
MLA_SM90_ENTRY(mla_attn_sm90_m192, 3, 64, 2)
MLA_SM90_ENTRY(mla_attn_sm90_m192s3, 3, 64, 3)
