// FlashAttention forward, the readable tiled kernel (notebook 06_cupy_kernel, "The tiled kernel").
//
// The algorithm of flashref.numpy_flash.flash_attention_forward (order "fa2"), in the paper's names:
// one thread block owns a query tile Q_i (BLOCK_M rows) of one (batch, head) and walks over the key
// and value tiles K_j, V_j (BLOCK_N rows each), keeping per row the running max m_i, the running sum
// l_i and the unnormalised output O_i. S_ij and P_ij exist only as one tile in shared memory.
//
// Threads cooperate on every tile: the block is a grid of (BLOCK_M / 4) x 16 threads; thread (ty, tx)
// owns rows 4*ty .. 4*ty+3 of the tile and the columns tx, tx + 16, tx + 32, ... of S_ij (and of
// O_i), so each value it loads from shared memory feeds four multiply-adds held in registers.
//
// Inputs fp32 or fp16 (ELEM_T), arithmetic in fp32. Compile-time constants, set with -D by the loader
// (flashref/cupy/__init__.py); the defaults below let `nvcc` compile the file on its own.
#include <cuda_fp16.h>

// [excerpt: constants]
#ifndef HEAD_DIM
#define HEAD_DIM 64          // d rounded up to a multiple of 16; columns >= d are zero-filled
#endif
#ifndef BLOCK_M
#define BLOCK_M 64           // rows of Q_i (queries) per thread block; a multiple of 4
#endif
#ifndef BLOCK_N
#define BLOCK_N 64           // rows of K_j, V_j (keys) per step; 16 threads x 4 columns
#endif
#ifndef ELEM_T
#define ELEM_T float         // float or __half
#endif

#define TX 16                                  // threads along a row of S_ij
#define TY (BLOCK_M / 4)                       // threads along the rows
#define NTHREADS (TX * TY)
#define COLS_S (BLOCK_N / TX)                  // S_ij columns per thread (4)
#define COLS_O (HEAD_DIM / TX)                 // O_i columns per thread
#define PAD_D (HEAD_DIM + 1)                   // +1 float: row r starts at bank r mod 32 (no conflicts)
#define PAD_N (BLOCK_N + 1)
#define NEG_INF (-__int_as_float(0x7f800000))   // -infinity (NVRTC has no math.h INFINITY)
// [/excerpt: constants]

static_assert(BLOCK_M % 4 == 0 && BLOCK_N == TX * COLS_S && HEAD_DIM % TX == 0, "tile shape");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }

// [excerpt: load-tile]
// Copy rows [row0, row0 + rows) of a (n, d) matrix into a shared tile of `rows` x HEAD_DIM floats
// with row stride `stride`; rows >= n and columns >= d become 0. Consecutive threads read consecutive
// addresses of global memory (coalesced) and write consecutive shared-memory banks.
__device__ __forceinline__ void load_tile(float* tile, const ELEM_T* __restrict__ x, int row0, int rows,
                                          int n, int d, int stride) {
    for (int e = threadIdx.x; e < rows * HEAD_DIM; e += NTHREADS) {
        int r = e / HEAD_DIM, c = e % HEAD_DIM;
        float value = 0.0f;
        if (row0 + r < n && c < d) value = to_float(x[(size_t)(row0 + r) * d + c]);
        tile[r * stride + c] = value;
    }
}
// [/excerpt: load-tile]

// Grid: (ceil(N_q / BLOCK_M), B * H). Dynamic shared memory: (BLOCK_M + BLOCK_N) * PAD_D
// + BLOCK_M * PAD_N floats (the loader computes the same number). q, o: (B*H, N_q, d);
// k, v: (B*H, N_k, d); lse: (B*H, N_q), natural log.
// [excerpt: kernel-start]
extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_tiled_forward(const ELEM_T* __restrict__ q, const ELEM_T* __restrict__ k, const ELEM_T* __restrict__ v,
                    ELEM_T* __restrict__ o, float* __restrict__ lse,
                    int N_q, int N_k, int d, float sm_scale, int causal) {
    extern __shared__ float smem[];
    float* Q_i = smem;                          // BLOCK_M x PAD_D
    float* KV_j = Q_i + BLOCK_M * PAD_D;        // BLOCK_N x PAD_D: K_j, then V_j in the same place
    float* P_ij = KV_j + BLOCK_N * PAD_D;       // BLOCK_M x PAD_N

    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    // Causal: the last query tiles have the most keys to visit, so they are scheduled first.
    const int i_tile = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int i0 = i_tile * BLOCK_M;            // first query row of Q_i
    const size_t bh = blockIdx.y;               // which (batch, head)
    q += bh * N_q * d;  o += bh * N_q * d;  lse += bh * N_q;
    k += bh * N_k * d;  v += bh * N_k * d;

    float m_i[4], l_i[4], O_i[4][COLS_O];        // this thread's 4 rows: running max, sum, output
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        m_i[r] = NEG_INF;  l_i[r] = 0.0f;
        for (int c = 0; c < COLS_O; ++c) O_i[r][c] = 0.0f;
    }
    load_tile(Q_i, q, i0, BLOCK_M, N_q, d, PAD_D);

    // Causal (top-left): query i sees keys j <= i, so tiles starting after the last row are skipped.
    const int j_end = causal ? min(N_k, i0 + BLOCK_M) : N_k;
    for (int j0 = 0; j0 < j_end; j0 += BLOCK_N) {
        __syncthreads();                        // everyone is done with V_j of the last step (and Q_i is loaded)
        load_tile(KV_j, k, j0, BLOCK_N, N_k, d, PAD_D);
        __syncthreads();                        // K_j is in shared memory
        // [/excerpt: kernel-start]

        // [excerpt: scores]
        // S_ij = sm_scale * Q_i K_j^T: a 4 x COLS_S register tile per thread.
        float S_ij[4][COLS_S] = {};
#pragma unroll 8
        for (int x = 0; x < HEAD_DIM; ++x) {
            float q_r[4], k_c[COLS_S];
            for (int r = 0; r < 4; ++r) q_r[r] = Q_i[(4 * ty + r) * PAD_D + x];      // broadcast
            for (int c = 0; c < COLS_S; ++c) k_c[c] = KV_j[(tx + TX * c) * PAD_D + x]; // 16 banks
            for (int r = 0; r < 4; ++r)
                for (int c = 0; c < COLS_S; ++c) S_ij[r][c] += q_r[r] * k_c[c];
        }
        // [/excerpt: scores]

        // [excerpt: online-softmax]
        // Online softmax, row by row: the 16 threads of a row sit in one half-warp and combine their
        // maxima and sums with shuffles.
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = i0 + 4 * ty + r;
            float row_max = NEG_INF;
            for (int c = 0; c < COLS_S; ++c) {
                const int j = j0 + tx + TX * c;
                const bool masked = j >= N_k || (causal && j > i);
                S_ij[r][c] = masked ? NEG_INF : S_ij[r][c] * sm_scale;
                row_max = fmaxf(row_max, S_ij[r][c]);
            }
            for (int off = TX / 2; off > 0; off /= 2)
                row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, off));
            const float m_new = fmaxf(m_i[r], row_max);
            // A row that has seen only masked keys so far keeps m = -inf; subtract 0 then, not -inf.
            const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
            float row_sum = 0.0f;
            for (int c = 0; c < COLS_S; ++c) {
                const float p = __expf(S_ij[r][c] - m_safe);   // P_ij, unnormalised
                row_sum += p;
                P_ij[(4 * ty + r) * PAD_N + tx + TX * c] = p;
            }
            for (int off = TX / 2; off > 0; off /= 2)
                row_sum += __shfl_xor_sync(0xffffffffu, row_sum, off);
            const float alpha = __expf(m_i[r] - m_safe);         // rescales what O_i and l_i hold
            l_i[r] = alpha * l_i[r] + row_sum;
            m_i[r] = m_new;
            for (int c = 0; c < COLS_O; ++c) O_i[r][c] *= alpha;
        }
        // [/excerpt: online-softmax]
        // [excerpt: output-update]
        __syncthreads();                        // everyone is done with K_j (and P_ij is written)
        load_tile(KV_j, v, j0, BLOCK_N, N_k, d, PAD_D);
        __syncthreads();                        // V_j is in shared memory

        // O_i += P_ij V_j
#pragma unroll 8
        for (int x = 0; x < BLOCK_N; ++x) {
            float p_r[4], v_c[COLS_O];
            for (int r = 0; r < 4; ++r) p_r[r] = P_ij[(4 * ty + r) * PAD_N + x];       // broadcast
            for (int c = 0; c < COLS_O; ++c) v_c[c] = KV_j[x * PAD_D + tx + TX * c];     // consecutive
            for (int r = 0; r < 4; ++r)
                for (int c = 0; c < COLS_O; ++c) O_i[r][c] += p_r[r] * v_c[c];
        }
    }
    // [/excerpt: output-update]

    // [excerpt: epilogue]
    // O_i / l_i and lse_i = m_i + log(l_i), for the rows and columns that exist.
    for (int r = 0; r < 4; ++r) {
        const int i = i0 + 4 * ty + r;
        if (i >= N_q) continue;
        const float inv_l = 1.0f / l_i[r];
        for (int c = 0; c < COLS_O; ++c) {
            const int col = tx + TX * c;
            if (col < d) store(&o[(size_t)i * d + col], O_i[r][c] * inv_l);
        }
        if (tx == 0) lse[i] = m_i[r] + logf(l_i[r]);
    }
}
// [/excerpt: epilogue]
