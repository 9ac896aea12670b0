// Grouping of routed (token, slot) pairs by expert, and the weighted combine back to tokens.
// A "tile table" lists, for a GEMM row-tile height BM, every (expert, first row) pair so that the
// grouped GEMM can be launched without a host round trip.

// counts[e] += 1 for every selection. counts must be zeroed first.
extern "C" __global__ void moe_count(const int* __restrict__ idx, int n, int* __restrict__ counts) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        atomicAdd(&counts[idx[i]], 1);
}

// Single thread: offsets[e] = sum of counts before e (offsets[E] = total); cursor zeroed;
// tile table for row-tile height bm: tile_expert[i], tile_row0[i] (absolute grouped row), tile_count[0].
extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int E, int bm, int* __restrict__ offsets,
                                       int* __restrict__ cursor, int* __restrict__ tile_expert,
                                       int* __restrict__ tile_row0, int* __restrict__ tile_count) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int off = 0, nt = 0;
    for (int e = 0; e < E; ++e) {
        offsets[e] = off;
        cursor[e] = 0;
        int c = counts[e];
        for (int r = 0; r < c; r += bm) { tile_expert[nt] = e; tile_row0[nt] = off + r; ++nt; }
        off += c;
    }
    offsets[E] = off;
    tile_count[0] = nt;
}

// slot_pos[t*k+j] = grouped row of that selection; row_token[grouped row] = t.
extern "C" __global__ void moe_scatter(const int* __restrict__ idx, int n, int k, const int* __restrict__ offsets,
                                       int* __restrict__ cursor, int* __restrict__ slot_pos, int* __restrict__ row_token) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int e = idx[i];
        int p = offsets[e] + atomicAdd(&cursor[e], 1);
        slot_pos[i] = p;
        row_token[p] = i / k;
    }
}

// Xg[p, :] = x[row_token[p], :] (f32 -> f32 or bf16).
extern "C" __global__ void moe_gather_f32(const float* __restrict__ x, const int* __restrict__ row_token, int rows,
                                          int K, float* __restrict__ xg) {
    int p = blockIdx.x;
    if (p >= rows) return;
    const float* src = x + (i64)row_token[p] * K;
    for (int i = threadIdx.x; i < K; i += blockDim.x) xg[(i64)p * K + i] = src[i];
}
extern "C" __global__ void moe_gather_bf16(const float* __restrict__ x, const int* __restrict__ row_token, int rows,
                                           int K, bf16_t* __restrict__ xg) {
    int p = blockIdx.x;
    if (p >= rows) return;
    const float* src = x + (i64)row_token[p] * K;
    for (int i = threadIdx.x; i < K; i += blockDim.x) xg[(i64)p * K + i] = f32_to_bf16(src[i]);
}

// out[t, n] = sum_j w[t*k+j] * yg[slot_pos[t*k+j], n], accumulated in f32 in slot order.
extern "C" __global__ void moe_combine(const float* __restrict__ yg, const int* __restrict__ slot_pos,
                                       const float* __restrict__ w, int T, int k, int N, float* __restrict__ out) {
    int t = blockIdx.x;
    if (t >= T) return;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) acc += w[(i64)t * k + j] * yg[(i64)slot_pos[(i64)t * k + j] * N + n];
        out[(i64)t * N + n] = acc;
    }
}
