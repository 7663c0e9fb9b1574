// FlashAttention forward on tensor cores through the CUDA C++ warp-matrix API, nvcuda::wmma
// (notebook 06_cupy_kernel, "A middle step: tensor cores through wmma").
//
// The step between flash_tiled.cu and flash_mma.cu. The two products S_ij = Q_i K_j^T and
// O_i += P_ij V_j run on tensor cores as 16x16x16 wmma tiles (fp16 inputs, fp32 accumulation; sm_70
// and newer, so a T4 too); everything else is ordinary threads working on shared memory, as in the
// tiled kernel. wmma hides which lane holds which element of a fragment, so a thread cannot find the
// scores of "its" row in registers: S_ij goes from the accumulator fragments to shared memory
// (store_matrix_sync), the online softmax reads it there and writes P_ij back as fp16, and the second
// product loads P_ij into fragments again. For the same reason O_i lives in shared memory (fp32): the
// softmax rescales its rows by alpha there, and the second product loads it into accumulator
// fragments, adds P_ij V_j and stores it back. flash_mma.cu removes both round trips by knowing the
// fragment layout.
//
// Split-Q, as in FlashAttention-2: warp w owns rows 16w .. 16w + 15 of Q_i, S_ij, P_ij and O_i, so
// between the two products a warp reads and writes only its own rows and waits only for itself
// (__syncwarp); the block waits for all its warps only around the loads of K_j and V_j, which they share.
//
// Where each tile lives:
//   Q_i         registers: wmma matrix_a fragments, loaded once through shared memory
//   K_j, V_j    shared memory, fp16, one buffer (K_j, then V_j), rows padded by 8 halves
//   S_ij        shared memory, fp32, BLOCK_M x (BLOCK_N + 4)
//   P_ij        shared memory, fp16, BLOCK_M x (BLOCK_N + 8)
//   O_i         shared memory, fp32, BLOCK_M x (HEAD_DIM + 4)
//   m_i, l_i    registers: lanes 2r and 2r + 1 of a warp both hold those of the warp's row r
//
// d must be a multiple of 8 (the wrapper pads q, k, v otherwise); HEAD_DIM is d rounded up to 16.
#include <cuda_fp16.h>
#include <mma.h>

using namespace nvcuda;

// [excerpt: constants]
#ifndef HEAD_DIM
#define HEAD_DIM 64          // d rounded up to a multiple of 16; columns >= d are zero-filled
#endif
#ifndef BLOCK_M
#define BLOCK_M 64           // query rows per thread block: 16 per warp
#endif
#ifndef BLOCK_N
#define BLOCK_N 64           // key rows per step; a multiple of 16
#endif

#define NWARPS (BLOCK_M / 16)
#define NTHREADS (NWARPS * 32)
#define LD_H (HEAD_DIM + 8)      // halves per row of Q_i, K_j, V_j (wmma wants a multiple of 8)
#define LD_S (BLOCK_N + 4)       // floats per row of S_ij (wmma wants a multiple of 4)
#define LD_P (BLOCK_N + 8)       // halves per row of P_ij
#define LD_O (HEAD_DIM + 4)      // floats per row of O_i
// Byte offsets in dynamic shared memory: O_i first (Q_i passes through that space on its way to
// registers), then S_ij, P_ij and the K_j/V_j buffer. Every offset is a multiple of 32 bytes, the
// alignment wmma's loads and stores need.
#define OFFSET_S (4 * BLOCK_M * LD_O)
#define OFFSET_P (OFFSET_S + 4 * BLOCK_M * LD_S)
#define OFFSET_KV (OFFSET_P + 2 * BLOCK_M * LD_P)
#define SMEM_BYTES (OFFSET_KV + 2 * BLOCK_N * LD_H)
#define NEG_INF (-__int_as_float(0x7f800000))   // -infinity (NVRTC has no math.h INFINITY)
// [/excerpt: constants]

static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");
static_assert(2 * BLOCK_M * LD_H <= OFFSET_S, "Q_i must fit where O_i will be");

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> FragA;       // Q_i, P_ij
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> FragBt;      // K_j^T
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> FragB;       // V_j
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;                       // S_ij, O_i

// Rows [row0, row0 + rows) of a (n, d) fp16 matrix into a shared tile with rows of LD_H halves,
// 16 bytes per thread per step; rows >= n and columns >= d become 0. Consecutive threads take
// consecutive 16-byte chunks of a row (coalesced).
__device__ __forceinline__ void load_tile(__half* tile, const __half* __restrict__ x, int row0, int rows,
                                          int n, int d) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    for (int e = threadIdx.x; e < rows * CHUNKS; e += NTHREADS) {
        const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (row0 + r < n && c < d) chunk = *reinterpret_cast<const uint4*>(x + (size_t)(row0 + r) * d + c);
        *reinterpret_cast<uint4*>(tile + r * LD_H + c) = chunk;
    }
}

// Grid: (ceil(N_q / BLOCK_M), B * H), NTHREADS threads, SMEM_BYTES of dynamic shared memory (the
// loader computes the same number). q, o: (B*H, N_q, d); k, v: (B*H, N_k, d); lse: (B*H, N_q) fp32,
// natural log. The second bound (at least 1 block per SM) keeps ptxas from squeezing registers for an
// occupancy that shared memory does not allow anyway: without it, it spills.
// [excerpt: kernel-start]
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
flash_wmma_forward(const __half* __restrict__ q, const __half* __restrict__ k, const __half* __restrict__ v,
                   __half* __restrict__ o, float* __restrict__ lse,
                   int N_q, int N_k, int d, float sm_scale, int causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    float* O_i = reinterpret_cast<float*>(smem);
    float* S_ij = reinterpret_cast<float*>(smem + OFFSET_S);
    __half* P_ij = reinterpret_cast<__half*>(smem + OFFSET_P);
    __half* KV_j = reinterpret_cast<__half*>(smem + OFFSET_KV);   // K_j, then V_j in the same place

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i_tile = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;   // longest tiles first
    const int i0 = i_tile * BLOCK_M;
    const size_t bh = blockIdx.y;
    q += bh * N_q * d;  o += bh * N_q * d;  lse += bh * N_q;
    k += bh * N_k * d;  v += bh * N_k * d;
    // This warp's 16 rows of each tile.
    float* O_w = O_i + warp * 16 * LD_O;
    float* S_w = S_ij + warp * 16 * LD_S;
    __half* P_w = P_ij + warp * 16 * LD_P;
    // In the softmax, lanes 2r and 2r + 1 share row r of the warp's 16 (query i), taking every other key.
    const int r = lane / 2, h = lane % 2;
    const int i = i0 + warp * 16 + r;

    // Q_i: through shared memory (the space O_i takes later) into fragments, where it stays.
    __half* Q_stage = reinterpret_cast<__half*>(smem);
    load_tile(Q_stage, q, i0, BLOCK_M, N_q, d);
    __syncthreads();                            // Q_i is in shared memory
    FragA Q_frag[HEAD_DIM / 16];
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        wmma::load_matrix_sync(Q_frag[ks], Q_stage + warp * 16 * LD_H + ks * 16, LD_H);
    __syncthreads();                            // every warp has its fragments: the space becomes O_i
    for (int e = lane; e < 16 * LD_O; e += 32) O_w[e] = 0.0f;
    float m_i = NEG_INF, l_i = 0.0f;            // running max and sum of row r

    // Causal (top-left): query i sees keys j <= i, so tiles starting after the last row are skipped.
    const int j_end = causal ? min(N_k, i0 + BLOCK_M) : N_k;
    for (int j0 = 0; j0 < j_end; j0 += BLOCK_N) {
        __syncthreads();                        // every warp is done with V_j of the last step
        load_tile(KV_j, k, j0, BLOCK_N, N_k, d);
        __syncthreads();                        // K_j is in shared memory
        // [/excerpt: kernel-start]

        // [excerpt: scores]
        // S_ij = Q_i K_j^T for this warp's 16 rows: BLOCK_N / 16 accumulator tiles of 16 x 16, each
        // the sum of HEAD_DIM / 16 tensor-core products, then stored to shared memory as fp32.
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 16; ++nt) {
            FragC acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                FragBt K_frag;   // column n of K_j^T is row n of K_j: K_j read column-major is K_j^T
                wmma::load_matrix_sync(K_frag, KV_j + nt * 16 * LD_H + ks * 16, LD_H);
                wmma::mma_sync(acc, Q_frag[ks], K_frag, acc);
            }
            wmma::store_matrix_sync(S_w + nt * 16, acc, LD_S, wmma::mem_row_major);
        }
        __syncwarp();                           // the scores other lanes stored are visible to this one
        // [/excerpt: scores]

        // [excerpt: online-softmax]
        // Online softmax of row r by its two lanes, on the fp32 scores in shared memory, as in
        // flash_tiled.cu: masked entries (keys past N_k, or j > i when causal) become -inf. Each lane
        // scales and masks its own entries in place, then exponentiates them: no other lane reads them.
        float* S_r = S_w + r * LD_S;
        float row_max = NEG_INF;
#pragma unroll 8
        for (int c = h; c < BLOCK_N; c += 2) {
            const int j = j0 + c;
            const bool masked = j >= N_k || (causal && j > i);
            const float s = masked ? NEG_INF : S_r[c] * sm_scale;
            S_r[c] = s;
            row_max = fmaxf(row_max, s);
        }
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));   // the other lane of the row
        const float m_new = fmaxf(m_i, row_max);
        // A row that has seen only masked keys so far keeps m = -inf; subtract 0 then, not -inf.
        const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
        float row_sum = 0.0f;
#pragma unroll 8
        for (int c = h; c < BLOCK_N; c += 2) {
            const float p = __expf(S_r[c] - m_safe);               // P_ij, unnormalised
            row_sum += p;
            P_w[r * LD_P + c] = __float2half_rn(p);               // fp16: the A operand of P_ij V_j
        }
        row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
        const float alpha = __expf(m_i - m_safe);                  // rescales what O_i and l_i hold
        l_i = alpha * l_i + row_sum;
        m_i = m_new;
        for (int c = h; c < HEAD_DIM; c += 2) O_w[r * LD_O + c] *= alpha;
        // [/excerpt: online-softmax]

        // [excerpt: output-update]
        __syncthreads();                        // every warp is done with K_j (and wrote P_ij, rescaled O_i)
        load_tile(KV_j, v, j0, BLOCK_N, N_k, d);
        __syncthreads();                        // V_j is in shared memory

        // O_i += P_ij V_j: each 16 x 16 tile of O_i goes from shared memory into an accumulator
        // fragment, takes BLOCK_N / 16 tensor-core products and goes back.
        FragA P_frag[BLOCK_N / 16];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            wmma::load_matrix_sync(P_frag[kk], P_w + kk * 16, LD_P);
#pragma unroll 2
        for (int nt = 0; nt < HEAD_DIM / 16; ++nt) {
            FragC acc;
            wmma::load_matrix_sync(acc, O_w + nt * 16, LD_O, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                FragB V_frag;
                wmma::load_matrix_sync(V_frag, KV_j + kk * 16 * LD_H + nt * 16, LD_H);
                wmma::mma_sync(acc, P_frag[kk], V_frag, acc);
            }
            wmma::store_matrix_sync(O_w + nt * 16, acc, LD_O, wmma::mem_row_major);
        }
    }
    // [/excerpt: output-update]

    // [excerpt: epilogue]
    // O_i / l_i and lse_i = m_i + log(l_i), for the rows and columns that exist. The warp writes one
    // row at a time, consecutive lanes consecutive columns (coalesced); row rr's 1 / l comes from lane 2rr.
    __syncwarp();                               // O_i as the other lanes stored it
    if (h == 0 && i < N_q) lse[i] = m_i + logf(l_i);
    const float inv_l = 1.0f / l_i;
    for (int rr = 0; rr < 16; ++rr) {
        const float inv = __shfl_sync(0xffffffffu, inv_l, 2 * rr);
        const int row = i0 + warp * 16 + rr;    // the same for every lane: the warp leaves together
        if (row >= N_q) break;
        for (int c = lane; c < d; c += 32)
            o[(size_t)row * d + c] = __float2half_rn(O_w[rr * LD_O + c] * inv);
    }
}
// [/excerpt: epilogue]
