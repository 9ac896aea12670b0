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

// y[i] = a[i] + b[i] (residual adds on the partial block sum). a, b and y may be the same buffer
// (add_assign passes y = a): each element is read before it is written, by the same thread.
extern "C" __global__ void add_f32(const float* a, const float* b, float* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

// add_f32 on float4s (n4 = n / 4; 16-byte aligned pointers), 4 float4s per thread in flight.
extern "C" __global__ void add_f32x4(const float4* a, const float4* b, float4* y, i64 n4) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i0 = blockIdx.x * (i64)blockDim.x + threadIdx.x; i0 < n4; i0 += 4 * stride) {
        float4 va[4], vb[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            i64 i = i0 + k * stride;
            if (i < n4) { va[k] = a[i]; vb[k] = b[i]; }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            i64 i = i0 + k * stride;
            if (i < n4) y[i] = make_float4(va[k].x + vb[k].x, va[k].y + vb[k].y, va[k].z + vb[k].z, va[k].w + vb[k].w);
        }
    }
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

// ---- float4 forms of the strided [rows, n] kernels ------------------------------------------
// Grid: x covers the n / 4 column quads of a row (blockDim.x threads), y walks the rows
// ROWS4 at a time (grid-stride), the ROWS4 loads issued before any use. They need n and every
// row stride a multiple of 4 and 16-byte aligned pointers (the launchers check, else they run
// the scalar kernels above). Same arithmetic per element as the scalar kernels.
#define ROWS4 4

// mul_sigmoid on float4s.
extern "C" __global__ void mul_sigmoid4(float* __restrict__ y, i64 ys, const float* __restrict__ g, i64 gs, int rows, int n) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= n) return;
    for (int r0 = blockIdx.y * ROWS4; r0 < rows; r0 += gridDim.y * ROWS4) {
        float4 vy[ROWS4], vg[ROWS4];
#pragma unroll
        for (int k = 0; k < ROWS4; ++k) {
            if (r0 + k < rows) {
                vy[k] = *(const float4*)(y + (i64)(r0 + k) * ys + c);
                vg[k] = *(const float4*)(g + (i64)(r0 + k) * gs + c);
            }
        }
#pragma unroll
        for (int k = 0; k < ROWS4; ++k) {
            if (r0 + k < rows) {
                float4 v = vy[k];
                v.x *= sigmoid_f(vg[k].x);
                v.y *= sigmoid_f(vg[k].y);
                v.z *= sigmoid_f(vg[k].z);
                v.w *= sigmoid_f(vg[k].w);
                *(float4*)(y + (i64)(r0 + k) * ys + c) = v;
            }
        }
    }
}

// f32_to_bf16_2d on float4s: 4 bf16 (8 bytes) written per float4 read.
extern "C" __global__ void f32_to_bf16_2d4(const float* __restrict__ in, i64 ins, bf16_t* __restrict__ out, int rows, int cols) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c >= cols) return;
    for (int r0 = blockIdx.y * ROWS4; r0 < rows; r0 += gridDim.y * ROWS4) {
        float4 v[ROWS4];
#pragma unroll
        for (int k = 0; k < ROWS4; ++k)
            if (r0 + k < rows) v[k] = *(const float4*)(in + (i64)(r0 + k) * ins + c);
#pragma unroll
        for (int k = 0; k < ROWS4; ++k)
            if (r0 + k < rows)
                *(uint2*)(out + (i64)(r0 + k) * cols + c) = make_uint2(pack_bf16x2(v[k].x, v[k].y), pack_bf16x2(v[k].z, v[k].w));
    }
}

// Copies n bytes from src to dst on the SMs. Either side may be mapped page-locked host memory:
// the compute stream's host <-> device transfers go this way, not through the copy engines, so
// they never queue behind the weight streamer's copies on the copy stream (docs/cuda.md). 16-byte
// units when both addresses allow, else 4-byte units, else bytes; then the tail.
extern "C" __global__ void copy_bytes(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, i64 n) {
    i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    unsigned long long a = (unsigned long long)src | (unsigned long long)dst;
    i64 done = 0;
    if ((a & 15) == 0) {
        i64 n16 = n / 16;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (i64 i = tid; i < n16; i += stride) d[i] = s[i];
        done = n16 * 16;
    } else if ((a & 3) == 0) {
        i64 n4 = n / 4;
        const unsigned int* s = (const unsigned int*)src;
        unsigned int* d = (unsigned int*)dst;
        for (i64 i = tid; i < n4; i += stride) d[i] = s[i];
        done = n4 * 4;
    }
    for (i64 i = done + tid; i < n; i += stride) dst[i] = src[i];
}
