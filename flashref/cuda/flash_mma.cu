// FlashAttention forward on tensor cores (notebook 06_cupy_kernel, "The tensor-core kernel").
//
// Same algorithm as flash_tiled.cu, but the two matrix products S_ij = Q_i K_j^T and O_i += P_ij V_j
// run on tensor cores through the warp-wide instruction mma.sync (m16n8k16 on sm_80 and newer, two
// m16n8k8 on sm_75), fp16 inputs with fp32 accumulation. Each warp owns 16 rows of Q_i; its
// fragments of Q_i stay in registers for the whole kernel, and the online softmax (m_i, l_i) is
// applied to the accumulator fragments directly: in the m16n8 accumulator layout, lane
// 4*g + t holds rows g and g + 8, columns 2t and 2t + 1, so a row's max and sum need only the
// 4 lanes of a quad. The accumulator fragment of S_ij, rounded to fp16, is exactly the A operand
// fragment of P_ij V_j: P never leaves registers.
//
// Shared memory holds K_j and V_j (rows padded by 16 bytes so that ldmatrix reads 8 rows from 8
// different bank groups). On sm_80 and newer they arrive by cp.async: V_j is fetched while S_ij is
// computed and K_{j+1} while O_i += P_ij V_j is, so loads overlap the tensor-core work. On sm_75
// the loads are plain.
//
// d must be a multiple of 8 (the wrapper pads q, k, v otherwise); HEAD_DIM is d rounded up to 16.
#include <cuda_fp16.h>

// [excerpt: constants]
#ifndef HEAD_DIM
#define HEAD_DIM 64          // multiple of 16; columns >= d are zero-filled
#endif
#ifndef BLOCK_M              // query rows per thread block: 16 per warp
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define BLOCK_M 64           // Turing: 4 warps (8 would spill registers)
#else
#define BLOCK_M 128          // 8 warps
#endif
#endif
#ifndef BLOCK_N
#define BLOCK_N 64           // key rows per step; a multiple of 16
#endif
#ifndef USE_CP_ASYNC
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define USE_CP_ASYNC 1
#else
#define USE_CP_ASYNC 0
#endif
#endif
#ifndef MMA_K8               // 1: m16n8k8 (sm_75), 0: m16n8k16 (sm_80 and newer)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MMA_K8 1
#else
#define MMA_K8 0
#endif
#endif

#define NWARPS (BLOCK_M / 16)
#define NTHREADS (NWARPS * 32)
#define STRIDE (HEAD_DIM + 8)                     // halves per shared row: +16 bytes against bank conflicts
#define KSTEPS (HEAD_DIM / 16)                    // k-steps of Q_i K_j^T
#define NT_S (BLOCK_N / 8)                        // n8 tiles of S_ij per warp
#define NT_O (HEAD_DIM / 8)                       // n8 tiles of O_i per warp
#define SMEM_ROWS (BLOCK_M > 2 * BLOCK_N ? BLOCK_M : 2 * BLOCK_N)   // Q_i first, then K_j and V_j
#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
// [/excerpt: constants]

static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");

typedef unsigned int u32;

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// One 16-byte chunk global -> shared; zero-filled when `valid` is false (rows past N, columns past d).
__device__ __forceinline__ void copy16(__half* dst, const __half* src, bool valid) {
#if USE_CP_ASYNC
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
#else
    *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void copy_commit() {
#if USE_CP_ASYNC
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
__device__ __forceinline__ void copy_wait_all() {
#if USE_CP_ASYNC
    asm volatile("cp.async.wait_group 0;\n" ::);
#endif
}

// Rows [row0, row0 + ROWS) of a (n, d) fp16 matrix into shared memory, 16 bytes per thread per step:
// consecutive threads take consecutive chunks of a row (coalesced).
template <int ROWS>
__device__ __forceinline__ void load_tile(__half* tile, const __half* __restrict__ x, int row0, int n, int d) {
    constexpr int CHUNKS = HEAD_DIM / 8;
#pragma unroll
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += NTHREADS) {
        const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        const bool valid = row0 + r < n && c < d;
        copy16(tile + r * STRIDE + c, valid ? x + (size_t)(row0 + r) * d + c : x, valid);
    }
}

// Four 8x8 fp16 matrices from shared memory into fragments; lane l gives the address of row l % 8
// of matrix l / 8. The .trans form transposes each matrix on the way (for V_j, the B operand).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const __half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// [excerpt: mma]
// C (16x8 fp32) += A (16x16 fp16, row-major fragments a[4]) * B (16x8 fp16, fragments b0, b1).
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if MMA_K8
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// [/excerpt: mma]

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// Grid: (ceil(N_q / BLOCK_M), B * H), NTHREADS threads. q, o: (B*H, N_q, d); k, v: (B*H, N_k, d);
// lse: (B*H, N_q) fp32, natural log.
extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_mma_forward(const __half* __restrict__ q, const __half* __restrict__ k, const __half* __restrict__ v,
                  __half* __restrict__ o, float* __restrict__ lse,
                  int N_q, int N_k, int d, float sm_scale, int causal) {
    __shared__ __align__(16) __half smem[SMEM_ROWS * STRIDE];
    __half* K_j = smem;                        // BLOCK_N x STRIDE
    __half* V_j = smem + BLOCK_N * STRIDE;     // BLOCK_N x STRIDE

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;      // accumulator layout: rows g, g+8; columns 2t, 2t+1
    const int i_tile = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;   // longest tiles first
    const int i0 = i_tile * BLOCK_M;
    const size_t bh = blockIdx.y;
    q += bh * N_q * d;  o += bh * N_q * d;  lse += bh * N_q;
    k += bh * N_k * d;  v += bh * N_k * d;

    // Q_i: through shared memory into registers, where it stays.
    load_tile<BLOCK_M>(smem, q, i0, N_q, d);
    copy_commit();
    copy_wait_all();
    __syncthreads();
    u32 Q_frag[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
        ldmatrix_x4(Q_frag[ks], smem + (warp * 16 + lane % 16) * STRIDE + ks * 16 + 8 * (lane / 16));
    __syncthreads();                            // shared memory is free for K_j and V_j

    const float scale_log2 = sm_scale * LOG2E;  // exp(x) = exp2(x * log2 e): one multiply folded in
    const int row0 = i0 + warp * 16 + g;        // this lane's two rows: row0 and row0 + 8
    float O_acc[NT_O][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) O_acc[nt][0] = O_acc[nt][1] = O_acc[nt][2] = O_acc[nt][3] = 0.0f;
    float m_i[2] = {NEG_INF, NEG_INF};          // running max, in units of log2
    float l_i[2] = {0.0f, 0.0f};                // this lane's part of the running sum

    const int j_end = causal ? min(N_k, i0 + BLOCK_M) : N_k;
    load_tile<BLOCK_N>(K_j, k, 0, N_k, d);
    copy_commit();
    for (int j0 = 0; j0 < j_end; j0 += BLOCK_N) {
        copy_wait_all();
        __syncthreads();                        // K_j has arrived; every warp is done with V_{j-1}
        load_tile<BLOCK_N>(V_j, v, j0, N_k, d); // in flight while S_ij is computed
        copy_commit();

        // [excerpt: scores]
        // S_ij = Q_i K_j^T on tensor cores.
        float S[NT_S][4];
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < NT_S; nt += 2) {
                u32 b[4];   // K_j rows are the columns of B = K_j^T: no transpose needed
                ldmatrix_x4(b, K_j + (nt * 8 + lane % 8 + 8 * (lane / 16)) * STRIDE + ks * 16 + 8 * ((lane / 8) % 2));
                mma_16x8x16(S[nt], Q_frag[ks], b[0], b[1]);
                mma_16x8x16(S[nt + 1], Q_frag[ks], b[2], b[3]);
            }
        }
        // [/excerpt: scores]

        // Online softmax on the fragments. Masking only where a tile crosses N_k or the diagonal.
        const bool need_mask = j0 + BLOCK_N > N_k || (causal && j0 + BLOCK_N - 1 > i0);
        float row_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float s = S[nt][e] * scale_log2;
                if (need_mask) {
                    const int j = j0 + nt * 8 + 2 * t + (e & 1), i = row0 + 8 * (e / 2);
                    if (j >= N_k || (causal && j > i)) s = NEG_INF;
                }
                S[nt][e] = s;
                row_max[e / 2] = fmaxf(row_max[e / 2], s);
            }
        }
        // [excerpt: softmax-and-pv]
        float alpha[2], m_safe[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {           // the 4 lanes of a quad share a row
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
            row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
            const float m_new = fmaxf(m_i[h], row_max[h]);
            m_safe[h] = m_new == NEG_INF ? 0.0f : m_new;   // a row with no visible key yet
            alpha[h] = exp2f(m_i[h] - m_safe[h]);
            m_i[h] = m_new;
            l_i[h] *= alpha[h];
        }
        u32 P_frag[BLOCK_N / 16][4];            // P_ij in fp16, laid out as the A operand of P_ij V_j
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
            const float p0 = exp2f(S[nt][0] - m_safe[0]), p1 = exp2f(S[nt][1] - m_safe[0]);
            const float p2 = exp2f(S[nt][2] - m_safe[1]), p3 = exp2f(S[nt][3] - m_safe[1]);
            l_i[0] += p0 + p1;
            l_i[1] += p2 + p3;
            P_frag[nt / 2][(nt % 2) * 2 + 0] = pack_half2(p0, p1);   // row g
            P_frag[nt / 2][(nt % 2) * 2 + 1] = pack_half2(p2, p3);   // row g + 8
        }
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            O_acc[nt][0] *= alpha[0];  O_acc[nt][1] *= alpha[0];
            O_acc[nt][2] *= alpha[1];  O_acc[nt][3] *= alpha[1];
        }

        copy_wait_all();
        __syncthreads();                        // V_j has arrived; every warp is done with K_j
        if (j0 + BLOCK_N < j_end) {             // K_{j+1} flies in while O_i += P_ij V_j runs
            load_tile<BLOCK_N>(K_j, k, j0 + BLOCK_N, N_k, d);
            copy_commit();
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < NT_O; nt += 2) {
                u32 b[4];   // V_j is stored key-major; .trans gives the B fragments
                ldmatrix_x4_trans(b, V_j + (kk * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * STRIDE + nt * 8 + 8 * (lane / 16));
                mma_16x8x16(O_acc[nt], P_frag[kk], b[0], b[1]);
                mma_16x8x16(O_acc[nt + 1], P_frag[kk], b[2], b[3]);
            }
        }
    }
    // [/excerpt: softmax-and-pv]

    // O_i / l_i and lse_i = (m_i + log2 l_i) ln 2, for the rows and columns that exist.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 1);
        l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 2);
        const int i = row0 + 8 * h;
        if (i >= N_q) continue;
        const float inv_l = 1.0f / l_i[h];
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            const int col = nt * 8 + 2 * t;
            if (col < d)
                *reinterpret_cast<__half2*>(o + (size_t)i * d + col) =
                    __floats2half2_rn(O_acc[nt][2 * h] * inv_l, O_acc[nt][2 * h + 1] * inv_l);
        }
        if (t == 0) lse[i] = (m_i[h] + log2f(l_i[h])) * LN2;
    }
}
