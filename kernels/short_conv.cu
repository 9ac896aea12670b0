// KDA short causal depthwise convolution + SiLU (spec 3.3 step 2).
//   y_t[c] = SiLU( sum_{j<W} w[c, j] * x_{t-W+1+j}[c] ),  x_tau for tau < 0 read from `state`
// state: [W-1][C] previous pre-conv inputs, oldest first (null = zeros). x, y: [T][C] with row strides.
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
        y[(i64)t * ys + c] = acc / (1.0f + expf(-acc));
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
