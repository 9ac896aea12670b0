// Dtype conversions and the embedding gather.

extern "C" __global__ void bf16_to_f32(const bf16_t* __restrict__ in, float* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(in[i]);
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ in, bf16_t* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(in[i]);
}

// Rounds f32 values to the nearest bf16 in place (BF16 mode: where the reference casts).
extern "C" __global__ void round_bf16_inplace(float* __restrict__ x, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] = round_bf16(x[i]);
}

// out[t, :] = table[ids[t], :] widened to f32. Ids are checked against the vocab on the host.
extern "C" __global__ void embed_rows(const bf16_t* __restrict__ table, const int* __restrict__ ids,
                                      float* __restrict__ out, int T, int H) {
    int t = blockIdx.x;
    if (t >= T) return;
    const bf16_t* row = table + (i64)ids[t] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[(i64)t * H + i] = bf16_to_f32(row[i]);
}

// y[i] = a[i] + b[i] (residual adds on the partial block sum).
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

// y[i] *= sigmoid(g[i]) over a [rows, n] view with row strides (MLA output gate).
extern "C" __global__ void mul_sigmoid(float* __restrict__ y, i64 ys, const float* __restrict__ g, i64 gs,
                                       int rows, int n) {
    i64 total = (i64)rows * n;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / n; int c = (int)(i % n);
        y[r * ys + c] *= sigmoid_f(g[r * gs + c]);
    }
}

// out[r, c] = bf16(in[r * ins + c]) for a [rows, cols] view with row stride ins (dense output).
extern "C" __global__ void f32_to_bf16_2d(const float* __restrict__ in, i64 ins, bf16_t* __restrict__ out, int rows, int cols) {
    i64 total = (i64)rows * cols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / cols; int c = (int)(i % cols);
        out[i] = f32_to_bf16(in[r * ins + c]);
    }
}
