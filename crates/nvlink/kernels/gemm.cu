// A bf16 GEMM on the tensor cores, the stand-in for a model's compute in `ferry bench --contend`:
// C = A * B for square row-major n x n matrices, A and B in bf16, C in fp32 (fp32 accumulate).
//
// Built to PTX for compute_80 by scripts/gen-ptx.py, as copy.cu is. It needs the CUDA headers
// mma.h (nvcuda::wmma) and cuda_bf16.h, which the script finds in pip's CUDA packages.
//
// Each block of 256 threads (8 warps, 2 x 4) computes a 128 x 128 tile of C, walking K in steps
// of 32: the next step's A and B tiles are copied into shared memory with cp.async while the
// warps multiply the current ones, each warp a 64 x 32 part of the tile as 4 x 2 accumulators of
// 16 x 16. n must be a multiple of 128 (the host checks it).

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

typedef unsigned int u32;

#define TILE 128
#define STEP 32
#define THREADS 256
// Padding of the shared tiles' rows (bf16 elements), against bank conflicts; rows stay 16-byte
// aligned for cp.async and fragment starts 32-byte aligned for wmma.
#define PAD_A 8
#define PAD_B 8
#define ROW_A (STEP + PAD_A)
#define ROW_B (TILE + PAD_B)

// Copies 16 bytes from global to shared memory without passing through registers.
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
    u32 address = (u32)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}

__device__ __forceinline__ void commit_async() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most `N` committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_async() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Queues the copies of the A tile (128 x 32) and the B tile (32 x 128) of step `k` into `as` and
// `bs`: 512 vectors of 8 elements each, two per thread.
__device__ __forceinline__ void load_step(const __nv_bfloat16* a, const __nv_bfloat16* b, u32 n,
                                          u32 row0, u32 col0, u32 k, __nv_bfloat16* as,
                                          __nv_bfloat16* bs) {
#pragma unroll
    for (int part = 0; part < 2; part++) {
        u32 vector = threadIdx.x + part * THREADS;
        u32 a_row = vector / (STEP / 8);
        u32 a_col = (vector % (STEP / 8)) * 8;
        copy_async(as + a_row * ROW_A + a_col, a + (size_t)(row0 + a_row) * n + k + a_col);
        u32 b_row = vector / (TILE / 8);
        u32 b_col = (vector % (TILE / 8)) * 8;
        copy_async(bs + b_row * ROW_B + b_col, b + (size_t)(k + b_row) * n + col0 + b_col);
    }
    commit_async();
}

extern "C" __global__ void __launch_bounds__(THREADS)
    ferry_gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, u32 n) {
    __shared__ __align__(128) __nv_bfloat16 as[2][TILE * ROW_A];
    __shared__ __align__(128) __nv_bfloat16 bs[2][STEP * ROW_B];

    u32 tiles = n / TILE;
    u32 row0 = (blockIdx.x / tiles) * TILE;
    u32 col0 = (blockIdx.x % tiles) * TILE;
    u32 warp = threadIdx.x / 32;
    u32 warp_row = (warp / 4) * 64;
    u32 warp_col = (warp % 4) * 32;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> sum[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::fill_fragment(sum[i][j], 0.0f);
        }
    }

    load_step(a, b, n, row0, col0, 0, as[0], bs[0]);
    u32 steps = n / STEP;
    for (u32 step = 0; step < steps; step++) {
        u32 current = step & 1;
        if (step + 1 < steps) {
            load_step(a, b, n, row0, col0, (step + 1) * STEP, as[current ^ 1], bs[current ^ 1]);
            wait_async<1>();
        } else {
            wait_async<0>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < STEP; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> left[4];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> right[2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wmma::load_matrix_sync(left[i], as[current] + (warp_row + i * 16) * ROW_A + kk,
                                       ROW_A);
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                wmma::load_matrix_sync(right[j], bs[current] + kk * ROW_B + warp_col + j * 16,
                                       ROW_B);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    wmma::mma_sync(sum[i][j], left[i], right[j], sum[i][j]);
                }
            }
        }
        // The next step's copies overwrite the buffer just read.
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float* out = c + (size_t)(row0 + warp_row + i * 16) * n + col0 + warp_col + j * 16;
            wmma::store_matrix_sync(out, sum[i][j], n, wmma::mem_row_major);
        }
    }
}
