// KDA short causal depthwise convolution + SiLU (spec 3.3 step 2).
//   y_t[c] = SiLU( sum_{j<W} w[c, j] * x_{t-W+1+j}[c] ),  x_tau for tau < 0 read from `state`
// state: [W-1][C] previous pre-conv inputs, oldest first (null = zeros). x, y: [T][C] with row strides.
//
// short_conv_silu4_w<W> (the fast path): each thread owns 4 adjacent channels (float4) and a run
// of CONV_ROWS consecutive rows; it loads the run plus the W-1 rows before it once into registers
// (the halo rows were just read by the neighbouring run's block, so they come from L2), then
// writes CONV_ROWS outputs. A warp covers 128 contiguous channels of a row: coalesced 512-byte
// accesses. Needs C, both row strides a multiple of 4 and 16-byte aligned pointers (the launcher
// checks and falls back to short_conv_silu). Same arithmetic, in the same order, as the scalar
// kernel: identical results.
//
// short_conv_silu_l2norm: the same plus, when `l2` is set, the per-head L2 norm of the outputs
// (head_dim 128 = one warp's 128 channels): y <- scale * y / sqrt(sum_head y^2 + eps), as
// l2_norm_heads (kda.cu) applies it to the conv's output.
#define CONV_ROWS 16

__device__ __forceinline__ float silu_f(float a) { return a / (1.0f + expf(-a)); }

template <int W>
__device__ __forceinline__ void short_conv4_body(const float* __restrict__ x, i64 xs, const float* __restrict__ state,
                                                 const float* __restrict__ w, float* __restrict__ y, i64 ys,
                                                 int T, int C, int l2, float eps, float scale) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    bool live = q * 4 < C;  // dead lanes still join the warp reduction of the fused norm
    int c = live ? q * 4 : 0;
    // taps of the 4 channels: wt[j] = (w[c][j], w[c+1][j], w[c+2][j], w[c+3][j])
    float4 wt[W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
        wt[j].x = w[(i64)c * W + j];
        wt[j].y = w[(i64)(c + 1) * W + j];
        wt[j].z = w[(i64)(c + 2) * W + j];
        wt[j].w = w[(i64)(c + 3) * W + j];
    }
    for (int r0 = blockIdx.y * CONV_ROWS; r0 < T; r0 += gridDim.y * CONV_ROWS) {
        float4 v[CONV_ROWS + W - 1];
#pragma unroll
        for (int i = 0; i < CONV_ROWS + W - 1; ++i) {
            int tau = r0 - (W - 1) + i;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (live && tau < T) {
                if (tau >= 0) a = *(const float4*)(x + (i64)tau * xs + c);
                else if (state) a = *(const float4*)(state + (i64)(W - 1 + tau) * C + c);
            }
            v[i] = a;
        }
#pragma unroll
        for (int i = 0; i < CONV_ROWS; ++i) {
            int t = r0 + i;
            if (t >= T) break;  // uniform across the block
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int j = 0; j < W; ++j) {
                acc.x += wt[j].x * v[i + j].x;
                acc.y += wt[j].y * v[i + j].y;
                acc.z += wt[j].z * v[i + j].z;
                acc.w += wt[j].w * v[i + j].w;
            }
            acc.x = silu_f(acc.x);
            acc.y = silu_f(acc.y);
            acc.z = silu_f(acc.z);
            acc.w = silu_f(acc.w);
            if (l2) {
                float ss = acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
                ss = warp_sum(ss);
                float inv = scale / sqrtf(ss + eps);
                acc.x *= inv;
                acc.y *= inv;
                acc.z *= inv;
                acc.w *= inv;
            }
            if (live) *(float4*)(y + (i64)t * ys + c) = acc;
        }
    }
}

// Grid: x = ceil(C / 4 / blockDim.x), y = row runs (grid-stride). `l2` needs C a multiple of 128
// and blockDim.x a multiple of 32 (every warp one whole head). One entry point per window length
// W (registers are allocated per entry point): short_conv_silu4_w<W>, W = 2..8.
#define SHORT_CONV4(W)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) short_conv_silu4_w##W(const float* __restrict__ x,     \
            i64 xs, const float* __restrict__ state, const float* __restrict__ w, float* __restrict__ y, i64 ys, \
            int T, int C, int l2, float eps, float scale) {                                                     \
        short_conv4_body<W>(x, xs, state, w, y, ys, T, C, l2, eps, scale);                                      \
    }
SHORT_CONV4(2)
SHORT_CONV4(3)
SHORT_CONV4(4)
SHORT_CONV4(5)
SHORT_CONV4(6)
SHORT_CONV4(7)
SHORT_CONV4(8)

// Any shape (odd widths, strides, W up to anything): one thread per output, grid-stride.
extern "C" __global__ void short_conv_silu(const float* __restrict__ x, i64 xs, const float* __restrict__ state,
                                           const float* __restrict__ w, float* __restrict__ y, i64 ys,
                                           int T, int C, int W) {
    i64 total = (i64)T * C;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        int t = (int)(i / C), c = (int)(i % C);
        float acc = 0.0f;
        for (int j = 0; j < W; ++j) {
            int tau = t - (W - 1) + j;
            float v;
            if (tau >= 0) v = x[(i64)tau * xs + c];
            else v = state ? state[(i64)(W - 1 + tau) * C + c] : 0.0f;
            acc += w[(i64)c * W + j] * v;
        }
        y[(i64)t * ys + c] = silu_f(acc);
    }
}

// New conv window = the last W-1 rows of concat(state_in, x), oldest first. state_in may be null (zeros).
extern "C" __global__ void conv_window_update(const float* __restrict__ x, i64 xs, const float* __restrict__ state_in,
                                              float* __restrict__ state_out, int T, int C, int W) {
    int n = W - 1;
    i64 total = (i64)n * C;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        int r = (int)(i / C), c = (int)(i % C);
        int tau = T - n + r;  // index into x; negative reaches back into state_in
        float v;
        if (tau >= 0) v = x[(i64)tau * xs + c];
        else v = state_in ? state_in[(i64)(n + tau) * C + c] : 0.0f;
        state_out[(i64)r * C + c] = v;
    }
}
