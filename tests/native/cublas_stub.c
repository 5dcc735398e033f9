/* A libcublas with cuBLAS's C prototypes (cublas_api.h) for the four calls minisarathi/backends/cublas.py makes:
   float32 GEMM computed naively in column-major order, and the stream and workspace each call received kept
   for the test to read. It checks the ctypes side of the binding: every argument arrives with its C type. */
#include <stddef.h>
#include <stdint.h>

typedef void* cublasHandle_t;
typedef void* cudaStream_t;
enum { SUCCESS = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };

static int handle_storage;
static cudaStream_t bound_stream;
static void* bound_workspace;
static size_t bound_workspace_bytes;

int cublasCreate_v2(cublasHandle_t* handle) { *handle = &handle_storage; return SUCCESS; }

int cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    if (handle != &handle_storage) return NOT_INITIALIZED;
    bound_stream = stream;
    bound_workspace = NULL;   /* as cuBLAS: back to the default workspace pool */
    bound_workspace_bytes = 0;
    return SUCCESS;
}

int cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
    if (handle != &handle_storage) return NOT_INITIALIZED;
    bound_workspace = workspace;
    bound_workspace_bytes = bytes;
    return SUCCESS;
}

int cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const void* alpha,
                 const void* A, int Atype, int lda, const void* B, int Btype, int ldb, const void* beta, void* C,
                 int Ctype, int ldc, int computeType, int algo) {
    if (handle != &handle_storage) return NOT_INITIALIZED;
    if (Atype != 0 || Btype != 0 || Ctype != 0 || computeType != 68 || algo != -1) return NOT_SUPPORTED;
    if (transa < 0 || transa > 1 || transb < 0 || transb > 1) return INVALID_VALUE;
    const float *a = A, *b = B;
    float* c = C;
    const float al = *(const float*)alpha, be = *(const float*)beta;
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            float sum = 0.0f;
            for (int p = 0; p < k; ++p)
                sum += (transa ? a[p + (size_t)i * lda] : a[i + (size_t)p * lda]) *
                       (transb ? b[j + (size_t)p * ldb] : b[p + (size_t)j * ldb]);
            c[i + (size_t)j * ldc] = al * sum + (be != 0.0f ? be * c[i + (size_t)j * ldc] : 0.0f);
        }
    return SUCCESS;
}

uintptr_t stub_stream(void) { return (uintptr_t)bound_stream; }
uintptr_t stub_workspace(void) { return (uintptr_t)bound_workspace; }
size_t stub_workspace_bytes(void) { return bound_workspace_bytes; }
