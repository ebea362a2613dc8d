// CUDA kernels for LayerNorm with per-example dγ, dβ squared norms (normgnorm/__init__.py has
// the maths, normgnorm/plan.py the way rows are shared among blocks). No torch headers: the
// launchers below take raw pointers, sizes, a dtype code and a stream, and return a
// cudaError_t as int; normgnorm_cuda.cpp binds them to torch.
//
// Rows are x2d [N = B*T, D], example b owning rows b*T .. b*T+T-1. One block handles a row at a
// time, thread k holding columns k, k + blockDim.x, ... (ITEMS of them, in registers), so
// D <= 32 * 1024. Blocks have up to 1024 threads, so every row kernel is compiled for
// __launch_bounds__(1024) (at most 64 registers a thread: the launch can never fail for lack of
// registers; ITEMS = 32 spills some). x, y, dy, dx are float32 / float16 / bfloat16; weight,
// bias, statistics, partial sums and the buffers are float32, and so is all arithmetic.
// RMSNorm runs the same kernels with a null mean: no centring (mean taken as 0), no bias, and
// dx without the mean's term (RMSNorm, Zhang & Sennrich 2019).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define NORMGNORM_MAX_ITEMS 32
#define NORMGNORM_MAX_THREADS 1024
#define NORMGNORM_COLUMN_BLOCK 32  // columns per block in the reduction kernels (one warp wide)
#define NORMGNORM_ROW_LANES 8      // warps per block in the reduction kernels

enum { DTYPE_FLOAT32 = 0, DTYPE_FLOAT16 = 1, DTYPE_BFLOAT16 = 2 };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Sums a and b over all threads of the block (any multiple of 32 threads, up to 1024); every
// thread gets the result. `shared` holds 64 floats; it may be reused right after the call.
__device__ float2 block_sum2(float a, float b, float* shared) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, offset);
        b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
    const int n_threads = blockDim.x * blockDim.y;
    if (n_threads > 32) {
        const int tid = threadIdx.x + threadIdx.y * blockDim.x;
        const int lane = tid % 32, warp = tid / 32;
        if (lane == 0) {
            shared[warp] = a;
            shared[32 + warp] = b;
        }
        __syncthreads();
        a = lane < n_threads / 32 ? shared[lane] : 0.f;
        b = lane < n_threads / 32 ? shared[32 + lane] : 0.f;
        for (int offset = 16; offset > 0; offset >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, offset);
            b += __shfl_xor_sync(0xffffffffu, b, offset);
        }
        __syncthreads();
    }
    return make_float2(a, b);
}

// y = (x - mean) * rstd * weight + bias, one block per row; also stores mean and rstd.
// mean_out null: RMSNorm, y = x * rstd * weight.
template <typename T, int ITEMS>
__global__ void __launch_bounds__(NORMGNORM_MAX_THREADS) forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                               const float* __restrict__ weight, const float* __restrict__ bias,
                               float* __restrict__ mean_out, float* __restrict__ rstd_out,
                               int D, float eps) {
    __shared__ float shared[64];
    const int64_t row = blockIdx.x;
    const T* xr = x + row * D;
    T* yr = y + row * D;
    float v[ITEMS];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < D ? to_float(xr[j]) : 0.f;
        sum += v[i];
    }
    const bool centred = mean_out != nullptr;
    const float mean = centred ? block_sum2(sum, 0.f, shared).x / D : 0.f;
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        const float c = j < D ? v[i] - mean : 0.f;
        sum_sq += c * c;
    }
    const float rstd = rsqrtf(block_sum2(sum_sq, 0.f, shared).x / D + eps);
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < D) {
            float out = (v[i] - mean) * rstd * weight[j];
            if (bias != nullptr) out += bias[j];
            yr[j] = from_float<T>(out);
        }
    }
    if (threadIdx.x == 0) {
        if (centred) mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

// dx for a run of rows, and their sums of dy ⊙ x̂ and dy in one float32 partial row per block.
// Block p takes chunk p % n_chunks (rows t_begin..t_end of each example) of examples
// (p / n_chunks) * examples_per_block ... In "whole" mode (n_chunks == 1) the block has every
// row of its examples, so it also writes Σ_b ||dγ_b||², Σ_b ||dβ_b||² over them to sq_w, sq_b[p].
// Up to ITEMS = 8 a thread keeps its x̂ and dy in registers between the two row reductions;
// wider rows read them again (from L1, the row was just read). mean null: RMSNorm.
template <typename T, int ITEMS>
__global__ void __launch_bounds__(NORMGNORM_MAX_THREADS)
backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                const float* __restrict__ weight,
                const float* __restrict__ mean, const float* __restrict__ rstd,
                float* __restrict__ part_w, float* __restrict__ part_b,
                float* __restrict__ sq_w, float* __restrict__ sq_b,
                int64_t num_examples, int64_t T_, int D,
                int64_t examples_per_block, int64_t n_chunks, int64_t rows_per_chunk,
                int need_dw, int need_db) {
    constexpr bool KEEP = ITEMS <= 8;
    constexpr int KEPT = KEEP ? ITEMS : 1;
    __shared__ float shared[64];
    const int64_t p = blockIdx.x;
    const int64_t first_example = (p / n_chunks) * examples_per_block;
    const int64_t end_example = min(first_example + examples_per_block, num_examples);
    const int64_t t_begin = (p % n_chunks) * rows_per_chunk;
    const int64_t t_end = min(t_begin + rows_per_chunk, T_);
    float* part_row_w = part_w + p * D;
    float* part_row_b = part_b + p * D;
    float square_w = 0.f, square_b = 0.f;  // this thread's columns' share of the squared norms
    const bool centred = mean != nullptr;

    for (int64_t example = first_example; example < end_example; example++) {
        float acc_w[ITEMS], acc_b[ITEMS];
#pragma unroll
        for (int i = 0; i < ITEMS; i++) acc_w[i] = acc_b[i] = 0.f;
        for (int64_t t = t_begin; t < t_end; t++) {
            const int64_t row = example * T_ + t;
            const T* dyr = dy + row * D;
            const T* xr = x + row * D;
            T* dxr = dx + row * D;
            const float m = centred ? mean[row] : 0.f, r = rstd[row];
            float kept_g[KEPT], kept_xhat[KEPT];
            float s1 = 0.f, s2 = 0.f;
#pragma unroll
            for (int i = 0; i < ITEMS; i++) {
                const int j = threadIdx.x + i * blockDim.x;
                float g = 0.f, xhat = 0.f;
                if (j < D) {
                    g = to_float(dyr[j]);
                    xhat = (to_float(xr[j]) - m) * r;
                    const float wdy = g * weight[j];
                    s1 += xhat * wdy;
                    s2 += wdy;
                }
                if (KEEP) {
                    kept_g[KEEP ? i : 0] = g;
                    kept_xhat[KEEP ? i : 0] = xhat;
                }
            }
            const float2 s = block_sum2(s1, s2, shared);
            const float c1 = s.x / D, c2 = centred ? s.y / D : 0.f;
#pragma unroll
            for (int i = 0; i < ITEMS; i++) {
                const int j = threadIdx.x + i * blockDim.x;
                if (j < D) {
                    const float g = KEEP ? kept_g[KEEP ? i : 0] : to_float(dyr[j]);
                    const float xhat = KEEP ? kept_xhat[KEEP ? i : 0] : (to_float(xr[j]) - m) * r;
                    dxr[j] = from_float<T>((g * weight[j] - (xhat * c1 + c2)) * r);
                    acc_w[i] += g * xhat;
                    acc_b[i] += g;
                }
            }
        }
        // fold this example's sums into the block's partial row (held in global memory, so
        // several examples cost no registers) and, whole mode, its squared norms
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int j = threadIdx.x + i * blockDim.x;
            if (j < D) {
                const bool first = example == first_example;
                if (need_dw) part_row_w[j] = (first ? 0.f : part_row_w[j]) + acc_w[i];
                if (need_db) part_row_b[j] = (first ? 0.f : part_row_b[j]) + acc_b[i];
            }
            square_w += acc_w[i] * acc_w[i];
            square_b += acc_b[i] * acc_b[i];
        }
    }
    if (n_chunks == 1) {
        const float2 s = block_sum2(square_w, square_b, shared);
        if (threadIdx.x == 0) {
            if (need_dw) sq_w[p] = s.x;
            if (need_db) sq_b[p] = s.y;
        }
    }
}

// Split mode: block (column block c, example b) sums example b's n_chunks partial rows over
// 32 columns into dγ_b, dβ_b (ex_w, ex_b [B, D]) and writes their squares' sum to sq[b, c].
// Block shape (32, NORMGNORM_ROW_LANES); the sums run in a fixed order (deterministic).
__global__ void reduce_examples_kernel(const float* __restrict__ part_w, const float* __restrict__ part_b,
                                       float* __restrict__ ex_w, float* __restrict__ ex_b,
                                       float* __restrict__ sq_w, float* __restrict__ sq_b,
                                       int64_t n_chunks, int64_t D, int64_t n_column_blocks,
                                       int need_dw, int need_db) {
    __shared__ float lanes_w[NORMGNORM_ROW_LANES][NORMGNORM_COLUMN_BLOCK + 1];
    __shared__ float lanes_b[NORMGNORM_ROW_LANES][NORMGNORM_COLUMN_BLOCK + 1];
    const int64_t col = (int64_t)blockIdx.x * NORMGNORM_COLUMN_BLOCK + threadIdx.x;
    const int64_t example = blockIdx.y;
    float a_w = 0.f, a_b = 0.f;
    if (col < D) {
        for (int64_t c = threadIdx.y; c < n_chunks; c += NORMGNORM_ROW_LANES) {
            const int64_t offset = (example * n_chunks + c) * D + col;
            if (need_dw) a_w += part_w[offset];
            if (need_db) a_b += part_b[offset];
        }
    }
    lanes_w[threadIdx.y][threadIdx.x] = a_w;
    lanes_b[threadIdx.y][threadIdx.x] = a_b;
    __syncthreads();
    if (threadIdx.y == 0) {
        float g_w = 0.f, g_b = 0.f;
        for (int k = 0; k < NORMGNORM_ROW_LANES; k++) {
            g_w += lanes_w[k][threadIdx.x];
            g_b += lanes_b[k][threadIdx.x];
        }
        if (col < D) {
            if (need_dw) ex_w[example * D + col] = g_w;
            if (need_db) ex_b[example * D + col] = g_b;
        }
        float q_w = g_w * g_w, q_b = g_b * g_b;  // zero past D
        for (int offset = 16; offset > 0; offset >>= 1) {
            q_w += __shfl_xor_sync(0xffffffffu, q_w, offset);
            q_b += __shfl_xor_sync(0xffffffffu, q_b, offset);
        }
        if (threadIdx.x == 0) {
            if (need_dw) sq_w[example * n_column_blocks + blockIdx.x] = q_w;
            if (need_db) sq_b[example * n_column_blocks + blockIdx.x] = q_b;
        }
    }
}

// Every block: dw, db over its 32 columns = the sum of the n_parts partial rows.
// Block 0 also: weight_sq += Σ sq_w, bias_sq += Σ sq_b, count += num_examples.
__global__ void finish_kernel(const float* __restrict__ part_w, const float* __restrict__ part_b,
                              float* __restrict__ dw, float* __restrict__ db,
                              const float* __restrict__ sq_w, const float* __restrict__ sq_b,
                              float* __restrict__ weight_sq, float* __restrict__ bias_sq, float* __restrict__ count,
                              int64_t n_parts, int64_t D, int64_t n_sq, int64_t num_examples,
                              int need_dw, int need_db) {
    __shared__ float lanes_w[NORMGNORM_ROW_LANES][NORMGNORM_COLUMN_BLOCK + 1];
    __shared__ float lanes_b[NORMGNORM_ROW_LANES][NORMGNORM_COLUMN_BLOCK + 1];
    __shared__ float shared[64];
    const int64_t col = (int64_t)blockIdx.x * NORMGNORM_COLUMN_BLOCK + threadIdx.x;
    float a_w = 0.f, a_b = 0.f;
    if (col < D) {
        for (int64_t k = threadIdx.y; k < n_parts; k += NORMGNORM_ROW_LANES) {
            if (need_dw) a_w += part_w[k * D + col];
            if (need_db) a_b += part_b[k * D + col];
        }
    }
    lanes_w[threadIdx.y][threadIdx.x] = a_w;
    lanes_b[threadIdx.y][threadIdx.x] = a_b;
    __syncthreads();
    if (threadIdx.y == 0 && col < D) {
        float g_w = 0.f, g_b = 0.f;
        for (int k = 0; k < NORMGNORM_ROW_LANES; k++) {
            g_w += lanes_w[k][threadIdx.x];
            g_b += lanes_b[k][threadIdx.x];
        }
        if (need_dw) dw[col] = g_w;
        if (need_db) db[col] = g_b;
    }
    if (blockIdx.x == 0) {  // whole block takes part (block_sum2 synchronises)
        const int tid = threadIdx.x + threadIdx.y * blockDim.x;
        const int n_threads = blockDim.x * blockDim.y;
        float q_w = 0.f, q_b = 0.f;
        for (int64_t k = tid; k < n_sq; k += n_threads) {
            if (need_dw) q_w += sq_w[k];
            if (need_db) q_b += sq_b[k];
        }
        const float2 s = block_sum2(q_w, q_b, shared);
        if (tid == 0) {
            if (need_dw) weight_sq[0] += s.x;
            if (need_db) bias_sq[0] += s.y;
            count[0] += (float)num_examples;
        }
    }
}

// Columns per thread (4, 8, 16 or 32: the fewest that need at most 1024 threads) and threads
// per row (a multiple of 32).
static void row_layout(int64_t D, int* threads, int* items) {
    int i = 4;
    while (i < NORMGNORM_MAX_ITEMS && (int64_t)i * NORMGNORM_MAX_THREADS < D) i *= 2;
    int64_t t = ((D + i - 1) / i + 31) / 32 * 32;
    *threads = (int)t;
    *items = i;
}

template <typename T>
static void launch_forward(const void* x, void* y, const float* weight, const float* bias, float* mean, float* rstd,
                           int64_t N, int64_t D, float eps, cudaStream_t stream) {
    int threads, items;
    row_layout(D, &threads, &items);
    const T* xt = (const T*)x;
    T* yt = (T*)y;
#define NORMGNORM_FORWARD(I) forward_kernel<T, I><<<(unsigned)N, threads, 0, stream>>>(xt, yt, weight, bias, mean, rstd, (int)D, eps)
    switch (items) {
        case 4: NORMGNORM_FORWARD(4); break;
        case 8: NORMGNORM_FORWARD(8); break;
        case 16: NORMGNORM_FORWARD(16); break;
        default: NORMGNORM_FORWARD(32); break;
    }
#undef NORMGNORM_FORWARD
}

template <typename T>
static void launch_backward(const void* dy, const void* x, void* dx, const float* weight, const float* mean,
                            const float* rstd, float* part_w, float* part_b, float* sq_w, float* sq_b,
                            int64_t num_examples, int64_t T_, int64_t D, int64_t examples_per_block,
                            int64_t n_chunks, int64_t rows_per_chunk, int64_t n_blocks,
                            int need_dw, int need_db, cudaStream_t stream) {
    int threads, items;
    row_layout(D, &threads, &items);
    const T* dyt = (const T*)dy;
    const T* xt = (const T*)x;
    T* dxt = (T*)dx;
#define NORMGNORM_BACKWARD(I)                                                                      \
    backward_kernel<T, I><<<(unsigned)n_blocks, threads, 0, stream>>>(                             \
        dyt, xt, dxt, weight, mean, rstd, part_w, part_b, sq_w, sq_b, num_examples, T_, (int)D,    \
        examples_per_block, n_chunks, rows_per_chunk, need_dw, need_db)
    switch (items) {
        case 4: NORMGNORM_BACKWARD(4); break;
        case 8: NORMGNORM_BACKWARD(8); break;
        case 16: NORMGNORM_BACKWARD(16); break;
        default: NORMGNORM_BACKWARD(32); break;
    }
#undef NORMGNORM_BACKWARD
}

extern "C" {

// Widest row the kernels take (32 float registers per thread, 1024 threads).
int64_t normgnorm_max_d(void) { return (int64_t)NORMGNORM_MAX_ITEMS * NORMGNORM_MAX_THREADS; }

// Columns per block of the reduction kernels: the caller sizes sq_w, sq_b by it in split mode.
int64_t normgnorm_column_block(void) { return NORMGNORM_COLUMN_BLOCK; }

const char* normgnorm_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// Forward over x [N, D] (dtype code 0/1/2 = float32/float16/bfloat16): y [N, D] of the same
// dtype, float32 mean, rstd [N]. bias may be null.
int normgnorm_forward(int dtype, const void* x, void* y, const float* weight, const float* bias,
                      float* mean, float* rstd, int64_t N, int64_t D, float eps, cudaStream_t stream) {
    if (N <= 0 || N > 2147483647LL || D <= 0 || D > normgnorm_max_d()) return (int)cudaErrorInvalidValue;
    switch (dtype) {
        case DTYPE_FLOAT32: launch_forward<float>(x, y, weight, bias, mean, rstd, N, D, eps, stream); break;
        case DTYPE_FLOAT16: launch_forward<__half>(x, y, weight, bias, mean, rstd, N, D, eps, stream); break;
        case DTYPE_BFLOAT16: launch_forward<__nv_bfloat16>(x, y, weight, bias, mean, rstd, N, D, eps, stream); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

// Backward over dy, x [N = num_examples * T, D] with the forward's mean, rstd, and the plan of
// normgnorm/plan.py (examples_per_block, n_chunks, rows_per_chunk, n_blocks). Writes dx, and
// for each needed parameter its gradient (float32 [D]) and adds Σ_b ||dγ_b||², Σ_b ||dβ_b||² to
// weight_sq, bias_sq; adds num_examples to count. Scratch (float32): part_w, part_b
// [n_blocks, D]; split mode (n_chunks > 1) also ex_w, ex_b [num_examples, D] and sq_w, sq_b
// [num_examples * ceil(D / column_block)]; whole mode sq_w, sq_b [n_blocks]. Pointers for a
// parameter that is not needed may be null.
int normgnorm_backward(int dtype, const void* dy, const void* x, void* dx, const float* weight,
                       const float* mean, const float* rstd,
                       int64_t num_examples, int64_t T, int64_t D,
                       int64_t examples_per_block, int64_t n_chunks, int64_t rows_per_chunk, int64_t n_blocks,
                       int need_dw, int need_db,
                       float* part_w, float* part_b, float* ex_w, float* ex_b, float* sq_w, float* sq_b,
                       float* dw, float* db, float* weight_sq, float* bias_sq, float* count,
                       cudaStream_t stream) {
    if (num_examples <= 0 || T <= 0 || D <= 0 || D > normgnorm_max_d() || n_blocks <= 0 ||
        n_blocks > 2147483647LL || n_chunks <= 0 || (n_chunks > 1 && num_examples > 65535))
        return (int)cudaErrorInvalidValue;
    switch (dtype) {
        case DTYPE_FLOAT32:
            launch_backward<float>(dy, x, dx, weight, mean, rstd, part_w, part_b, sq_w, sq_b, num_examples, T, D,
                                   examples_per_block, n_chunks, rows_per_chunk, n_blocks, need_dw, need_db, stream);
            break;
        case DTYPE_FLOAT16:
            launch_backward<__half>(dy, x, dx, weight, mean, rstd, part_w, part_b, sq_w, sq_b, num_examples, T, D,
                                    examples_per_block, n_chunks, rows_per_chunk, n_blocks, need_dw, need_db, stream);
            break;
        case DTYPE_BFLOAT16:
            launch_backward<__nv_bfloat16>(dy, x, dx, weight, mean, rstd, part_w, part_b, sq_w, sq_b, num_examples, T,
                                           D, examples_per_block, n_chunks, rows_per_chunk, n_blocks, need_dw, need_db,
                                           stream);
            break;
        default: return (int)cudaErrorInvalidValue;
    }
    const int64_t n_column_blocks = (D + NORMGNORM_COLUMN_BLOCK - 1) / NORMGNORM_COLUMN_BLOCK;
    const dim3 lanes(NORMGNORM_COLUMN_BLOCK, NORMGNORM_ROW_LANES);
    int64_t n_parts = n_blocks, n_sq = n_blocks;
    if (n_chunks > 1 && (need_dw || need_db)) {
        reduce_examples_kernel<<<dim3((unsigned)n_column_blocks, (unsigned)num_examples), lanes, 0, stream>>>(
            part_w, part_b, ex_w, ex_b, sq_w, sq_b, n_chunks, D, n_column_blocks, need_dw, need_db);
        part_w = ex_w;
        part_b = ex_b;
        n_parts = num_examples;
        n_sq = num_examples * n_column_blocks;
    }
    finish_kernel<<<(unsigned)n_column_blocks, lanes, 0, stream>>>(
        part_w, part_b, dw, db, sq_w, sq_b, weight_sq, bias_sq, count, n_parts, D, n_sq, num_examples,
        need_dw, need_db);
    return (int)cudaGetLastError();
}

}  // extern "C"
