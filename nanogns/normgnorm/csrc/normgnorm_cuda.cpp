// torch binding of the CUDA launchers in normgnorm_cuda.cu, built as a plain C++ extension and
// linked against that file's object and libcudart (normgnorm/cuda_ext.py does both). It needs
// no CUDA headers: the caller allocates every tensor (normgnorm/cuda_ext.py, with the plan of
// normgnorm/plan.py) and passes the current CUDA stream as an integer handle; this file checks
// the tensors and hands their pointers to the launchers. The functions are registered as torch
// ops in the namespace TORCH_EXTENSION_NAME (torch.ops.normgnorm_cuda_sm_XY.*) through torch's
// stable C++ API, whose headers compile in about a second (torch/extension.h takes a minute)
// and whose binary interface outlives torch versions.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <string>

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it
using torch::stable::Tensor;
using torch::headeronly::ScalarType;

extern "C" {
int64_t normgnorm_max_d(void);
int64_t normgnorm_column_block(void);
const char* normgnorm_error_string(int code);
int normgnorm_forward(int dtype, const void* x, void* y, const float* weight, const float* bias,
                      float* mean, float* rstd, int64_t N, int64_t D, float eps, cudaStream_t stream);
int normgnorm_backward(int dtype, const void* dy, const void* x, void* dx, const float* weight,
                       const float* mean, const float* rstd,
                       int64_t num_examples, int64_t T, int64_t D,
                       int64_t examples_per_block, int64_t n_chunks, int64_t rows_per_chunk, int64_t n_blocks,
                       int need_dw, int need_db,
                       float* part_w, float* part_b, float* ex_w, float* ex_b, float* sq_w, float* sq_b,
                       float* dw, float* db, float* weight_sq, float* bias_sq, float* count,
                       cudaStream_t stream);
}

static int dtype_code(const Tensor& t) {
    switch (t.scalar_type()) {
        case ScalarType::Float: return 0;
        case ScalarType::Half: return 1;
        case ScalarType::BFloat16: return 2;
        default: STD_TORCH_CHECK(false, "normgnorm: unsupported dtype (float32, float16 or bfloat16 only)");
    }
    return -1;
}

// A float32 CUDA tensor's pointer; an empty tensor stands for "not needed" (null).
static float* f32(const Tensor& t, const char* name) {
    if (t.numel() == 0) return nullptr;
    STD_TORCH_CHECK(t.is_cuda() && t.scalar_type() == ScalarType::Float && t.is_contiguous(),
                    "normgnorm: ", name, " must be a contiguous float32 CUDA tensor");
    return static_cast<float*>(t.data_ptr());
}

static bool same_shape(const Tensor& a, const Tensor& b) {
    return a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.size(1) == b.size(1);
}

static void check_rows(const Tensor& t, const char* name) {
    STD_TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), "normgnorm: ", name,
                " must be a contiguous 2-D CUDA tensor");
}

static void check_launch(int code) {
    STD_TORCH_CHECK(code == 0, "normgnorm CUDA launch failed: ", normgnorm_error_string(code));
}

void forward(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
             const Tensor& mean, const Tensor& rstd, double eps, int64_t stream) {
    check_rows(x, "x");
    check_rows(y, "y");
    STD_TORCH_CHECK(same_shape(y, x) && y.scalar_type() == x.scalar_type(), "normgnorm: y must match x");
    const int64_t N = x.size(0), D = x.size(1);
    // an empty mean: RMSNorm (no centring)
    STD_TORCH_CHECK(weight.numel() == D && (bias.numel() == 0 || bias.numel() == D) &&
                (mean.numel() == N || mean.numel() == 0) && rstd.numel() == N,
                "normgnorm: weight, bias, mean or rstd has the wrong size");
    check_launch(normgnorm_forward(dtype_code(x), x.data_ptr(), y.data_ptr(), f32(weight, "weight"), f32(bias, "bias"),
                                   f32(mean, "mean"), f32(rstd, "rstd"), N, D, (float)eps,
                                   reinterpret_cast<cudaStream_t>(stream)));
}

void backward(const Tensor& dy, const Tensor& x, const Tensor& dx, const Tensor& weight,
              const Tensor& mean, const Tensor& rstd, int64_t num_examples,
              int64_t examples_per_block, int64_t n_chunks, int64_t rows_per_chunk, int64_t n_blocks,
              bool need_dw, bool need_db,
              const Tensor& part_w, const Tensor& part_b, const Tensor& ex_w, const Tensor& ex_b,
              const Tensor& sq_w, const Tensor& sq_b, const Tensor& dw, const Tensor& db,
              const Tensor& weight_sq, const Tensor& bias_sq, const Tensor& count, int64_t stream) {
    check_rows(dy, "dy");
    check_rows(x, "x");
    check_rows(dx, "dx");
    STD_TORCH_CHECK(same_shape(dy, x) && same_shape(dx, x) && dy.scalar_type() == x.scalar_type() &&
                    dx.scalar_type() == x.scalar_type(), "normgnorm: dy, x, dx must have the same shape and dtype");
    const int64_t N = x.size(0), D = x.size(1);
    STD_TORCH_CHECK(num_examples > 0 && N % num_examples == 0, "normgnorm: rows must split evenly into examples");
    STD_TORCH_CHECK(weight.numel() == D && (mean.numel() == N || mean.numel() == 0) && rstd.numel() == N,
                "normgnorm: weight, mean or rstd has the wrong size");
    const int64_t split_rows = n_chunks > 1 ? num_examples : 0;
    const int64_t n_column_blocks = (D + normgnorm_column_block() - 1) / normgnorm_column_block();
    const int64_t n_sq = n_chunks > 1 ? num_examples * n_column_blocks : n_blocks;
    if (need_dw)
        STD_TORCH_CHECK(part_w.numel() == n_blocks * D && ex_w.numel() == split_rows * D && sq_w.numel() == n_sq &&
                    dw.numel() == D && weight_sq.numel() == 1, "normgnorm: weight scratch has the wrong size");
    if (need_db)
        STD_TORCH_CHECK(part_b.numel() == n_blocks * D && ex_b.numel() == split_rows * D && sq_b.numel() == n_sq &&
                    db.numel() == D && bias_sq.numel() == 1, "normgnorm: bias scratch has the wrong size");
    STD_TORCH_CHECK(count.numel() == 1, "normgnorm: count must hold one number");
    check_launch(normgnorm_backward(
        dtype_code(x), dy.data_ptr(), x.data_ptr(), dx.data_ptr(), f32(weight, "weight"), f32(mean, "mean"),
        f32(rstd, "rstd"), num_examples, N / num_examples, D, examples_per_block, n_chunks, rows_per_chunk, n_blocks,
        need_dw, need_db, f32(part_w, "part_w"), f32(part_b, "part_b"), f32(ex_w, "ex_w"), f32(ex_b, "ex_b"),
        f32(sq_w, "sq_w"), f32(sq_b, "sq_b"), f32(dw, "dw"), f32(db, "db"), f32(weight_sq, "weight_sq"),
        f32(bias_sq, "bias_sq"), f32(count, "count"), reinterpret_cast<cudaStream_t>(stream)));
}

int64_t max_d() { return normgnorm_max_d(); }
int64_t column_block() { return normgnorm_column_block(); }

STABLE_TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
    // LayerNorm forward into preallocated y, mean, rstd; RMSNorm with an empty mean (and bias)
    m.def("forward(Tensor x, Tensor(a!) y, Tensor weight, Tensor bias, Tensor(b!) mean, Tensor(c!) rstd, "
          "float eps, int stream) -> ()");
    // LayerNorm backward with per-example dγ, dβ squared norms, into preallocated tensors;
    // RMSNorm with an empty mean (and no dβ)
    m.def("backward(Tensor dy, Tensor x, Tensor(a!) dx, Tensor weight, Tensor mean, Tensor rstd, "
          "int num_examples, int examples_per_block, int n_chunks, int rows_per_chunk, int n_blocks, "
          "bool need_dw, bool need_db, Tensor(b!) part_w, Tensor(c!) part_b, Tensor(d!) ex_w, Tensor(e!) ex_b, "
          "Tensor(f!) sq_w, Tensor(g!) sq_b, Tensor(h!) dw, Tensor(i!) db, Tensor(j!) weight_sq, "
          "Tensor(k!) bias_sq, Tensor(l!) count, int stream) -> ()");
    m.def("max_d() -> int");         // widest row the kernels take
    m.def("column_block() -> int");  // columns per block of the reductions
}

STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CompositeExplicitAutograd, m) {
    m.impl("forward", TORCH_BOX(&forward));
    m.impl("backward", TORCH_BOX(&backward));
    m.impl("max_d", TORCH_BOX(&max_d));
    m.impl("column_block", TORCH_BOX(&column_block));
}
