// Gather/scatter copy kernels of ferry's nvlink transport.
//
// Built to PTX for compute_80 by scripts/gen-ptx.py (the PTX is committed next to this file and
// loaded with cuModuleLoadData, so no CUDA toolkit is needed to build ferry). No includes: the
// source compiles with NVRTC alone.
//
// One warp copies one item at a time, walking the items grid-stride. Source and destination may
// be local memory or a peer GPU's memory mapped through P2P (IPC or VMM); the host checked every
// range against registered memory before the launch, so the kernels trust their arguments.

typedef unsigned long long u64;
typedef unsigned int u32;

// Sixteen bytes as the four words the shifting copy splices.
struct __attribute__((aligned(16))) Words {
    u32 x;
    u32 y;
    u32 z;
    u32 w;
};

// One entry of a copy list: `len` bytes from `src` to `dst`.
struct CopyEntry {
    u64 src;
    u64 dst;
    u64 len;
};

// Two builds of each kernel, which the host picks per launch. The plain ones keep 4 vectors
// in flight per lane (1 when shifting) within the 64 registers a thread may have when two
// blocks of 512 threads share a multiprocessor: deeper was no faster on aligned copies, and
// fewer resident warps made blocks of a few KiB slower. The `_shifted` ones, for copies whose
// source and destination disagree modulo 16, keep 8 (4 when shifting) in flight with one
// block per multiprocessor: a shifting copy one vector deep moved large blocks at 0.6-0.7 of
// the aligned speed on an H200.
#define THREADS 512

__device__ __forceinline__ Words from_lane_words(Words v, u32 lane) {
    Words out;
    out.x = __shfl_sync(0xffffffffu, v.x, lane);
    out.y = __shfl_sync(0xffffffffu, v.y, lane);
    out.z = __shfl_sync(0xffffffffu, v.z, lane);
    out.w = __shfl_sync(0xffffffffu, v.w, lane);
    return out;
}

__device__ __forceinline__ Words from_next_lane(Words v) {
    Words out;
    out.x = __shfl_down_sync(0xffffffffu, v.x, 1);
    out.y = __shfl_down_sync(0xffffffffu, v.y, 1);
    out.z = __shfl_down_sync(0xffffffffu, v.z, 1);
    out.w = __shfl_down_sync(0xffffffffu, v.w, 1);
    return out;
}

// The 16 bytes that start `Q * 4 + bits / 8` bytes into the 32 bytes `a` then `b`.
template <int Q>
__device__ __forceinline__ Words splice(Words a, Words b, u32 bits) {
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    Words out;
    out.x = __funnelshift_r(w[Q], w[Q + 1], bits);
    out.y = __funnelshift_r(w[Q + 1], w[Q + 2], bits);
    out.z = __funnelshift_r(w[Q + 2], w[Q + 3], bits);
    out.w = __funnelshift_r(w[Q + 3], w[Q + 4], bits);
    return out;
}

// Copies `count` 16-byte vectors from `src` to `dst`, both 16-byte aligned, DEPTH loads deep
// in every lane before the stores. Rounds count in 32-bit offsets from pointers that move on,
// which keeps the registers within the launch bounds.
template <u32 DEPTH>
__device__ __forceinline__ void warp_copy_vectors(const Words* src, Words* dst, u64 count,
                                                  u32 lane) {
    src += lane;
    dst += lane;
#pragma unroll 1
    while (count > 0) {
        const u32 round = count < 32 * DEPTH ? (u32)count : 32 * DEPTH;
        Words v[DEPTH];
#pragma unroll
        for (u32 u = 0; u < DEPTH; ++u) {
            if (u * 32 + lane < round) {
                v[u] = src[u * 32];
            }
        }
#pragma unroll
        for (u32 u = 0; u < DEPTH; ++u) {
            if (u * 32 + lane < round) {
                dst[u * 32] = v[u];
            }
        }
        src += 32 * DEPTH;
        dst += 32 * DEPTH;
        count -= round;
    }
}

// Copies `count` 16-byte vectors to `dst` (16-byte aligned) from `src`, which sits
// `Q * 4 + bits / 8` bytes (1 to 15) past a 16-byte boundary: every lane loads aligned
// vectors, takes the next one from its neighbour (the last lane from the first lane's next
// vector), and stores the 16 bytes spliced from the pair. The aligned loads reach at most 15
// bytes before the range's first byte and past its last, always inside a 16-byte line that
// holds bytes of the range, which no allocation ends inside.
template <int Q, u32 SHIFTED_DEPTH>
__device__ __forceinline__ void warp_copy_shifted(const unsigned char* src, Words* dst,
                                                  u64 count, u32 bits, u32 lane) {
    const Words* s = (const Words*)((u64)src & ~(u64)15) + lane;
    dst += lane;
#pragma unroll 1
    while (count > 0) {
        const u32 round = count < 32 * SHIFTED_DEPTH ? (u32)count : 32 * SHIFTED_DEPTH;
        // One vector more than the round stores, loaded by the first lane only.
        Words v[SHIFTED_DEPTH + 1];
#pragma unroll
        for (u32 u = 0; u <= SHIFTED_DEPTH; ++u) {
            if (u * 32 + lane <= round && (u < SHIFTED_DEPTH || lane == 0)) {
                v[u] = s[u * 32];
            }
        }
#pragma unroll
        for (u32 u = 0; u < SHIFTED_DEPTH; ++u) {
            Words next = from_next_lane(v[u]);
            const Words wrapped = from_lane_words(v[u + 1], 0);
            if (lane == 31) {
                next = wrapped;
            }
            if (u * 32 + lane < round) {
                dst[u * 32] = splice<Q>(v[u], next, bits);
            }
        }
        s += 32 * SHIFTED_DEPTH;
        dst += 32 * SHIFTED_DEPTH;
        count -= round;
    }
}

// Copies `len` bytes with the 32 lanes of a warp: a byte head up to the destination's 16-byte
// alignment, a body of 16-byte vectors (aligned loads, or shifted ones where the source sits
// differently), then a byte tail. Odd sizes and odd addresses thus move 16 bytes a lane too.
template <u32 DEPTH, u32 SHIFTED_DEPTH>
__device__ __forceinline__ void warp_copy(u64 src_addr, u64 dst_addr, u64 len, u32 lane) {
    const unsigned char* src = (const unsigned char*)src_addr;
    unsigned char* dst = (unsigned char*)dst_addr;
    u64 head = (16 - (dst_addr & 15)) & 15;
    if (head > len) {
        head = len;
    }
    if (lane < head) {
        dst[lane] = src[lane];
    }
    src += head;
    dst += head;
    len -= head;
    const u64 count = len / 16;
    Words* d = (Words*)dst;
    const u32 skew = (u32)((u64)src & 15);
    const u32 bits = (skew & 3) * 8;
    switch (skew >> 2) {
    case 0:
        if (skew == 0) {
            warp_copy_vectors<DEPTH>((const Words*)src, d, count, lane);
        } else {
            warp_copy_shifted<0, SHIFTED_DEPTH>(src, d, count, bits, lane);
        }
        break;
    case 1:
        warp_copy_shifted<1, SHIFTED_DEPTH>(src, d, count, bits, lane);
        break;
    case 2:
        warp_copy_shifted<2, SHIFTED_DEPTH>(src, d, count, bits, lane);
        break;
    default:
        warp_copy_shifted<3, SHIFTED_DEPTH>(src, d, count, bits, lane);
        break;
    }
    const u64 done = count * 16;
    if (lane < len - done) {
        dst[done + lane] = src[done + lane];
    }
}

// Copies every entry of a list of `count` entries.
template <u32 DEPTH, u32 SHIFTED_DEPTH>
__device__ __forceinline__ void copy_list(const CopyEntry* entries, u64 count) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 item = warp; item < count; item += warps) {
        const CopyEntry entry = entries[item];
        warp_copy<DEPTH, SHIFTED_DEPTH>(entry.src, entry.dst, entry.len, lane);
    }
}

// Copies paged-KV blocks: for every pool p and every index b below `blocks`,
// `len` bytes from src_bases[p] + src_ids[b] * src_stride + src_offset
// to dst_bases[p] + dst_ids[b] * dst_stride + dst_offset.
// Blocks longer than `chunk` bytes are shared out in pieces of `chunk`, so a few large blocks
// still keep every warp busy.
template <u32 DEPTH, u32 SHIFTED_DEPTH>
__device__ __forceinline__ void copy_paged(const u64* src_bases, const u64* dst_bases, u32 pools,
                                           const u32* src_ids, const u32* dst_ids, u32 blocks,
                                           u64 src_stride, u64 dst_stride, u64 src_offset,
                                           u64 dst_offset, u64 len, u64 chunk) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 pieces = (len + chunk - 1) / chunk;
    const u64 items = (u64)pools * blocks * pieces;
    for (u64 item = warp; item < items; item += warps) {
        const u64 pair = pieces == 1 ? item : item / pieces;
        const u64 piece = item - pair * pieces;
        const u64 pool = pair / blocks;
        const u64 block = pair - pool * blocks;
        const u64 skip = piece * chunk;
        const u64 bytes = len - skip < chunk ? len - skip : chunk;
        const u64 src = src_bases[pool] + (u64)src_ids[block] * src_stride + src_offset + skip;
        const u64 dst = dst_bases[pool] + (u64)dst_ids[block] * dst_stride + dst_offset + skip;
        warp_copy<DEPTH, SHIFTED_DEPTH>(src, dst, bytes, lane);
    }
}

#define PAGED_PARAMS                                                                               \
    const u64 *src_bases, const u64 *dst_bases, u32 pools, const u32 *src_ids,                     \
        const u32 *dst_ids, u32 blocks, u64 src_stride, u64 dst_stride, u64 src_offset,            \
        u64 dst_offset, u64 len, u64 chunk
#define PAGED_ARGS                                                                                 \
    src_bases, dst_bases, pools, src_ids, dst_ids, blocks, src_stride, dst_stride, src_offset,     \
        dst_offset, len, chunk

extern "C" __global__ void __launch_bounds__(THREADS, 2)
ferry_copy_list(const CopyEntry* entries, u64 count) {
    copy_list<4, 1>(entries, count);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ferry_copy_list_shifted(const CopyEntry* entries, u64 count) {
    copy_list<8, 4>(entries, count);
}

// Bytes one warp of ferry_copy_publish copies at a time.
#define PUBLISH_PIECE 4096

// One copy of `len` bytes from `src` to `dst` by one block, its warps taking pieces of
// PUBLISH_PIECE bytes in turn; then `position` stored into the 64-bit word at `word` (a
// message ring's published position, in host memory mapped for this GPU) once every byte of
// the copy is visible to the whole system, so a process polling the word sees the
// notification only after its data. One launch instead of a copy and a stream write.
extern "C" __global__ void __launch_bounds__(THREADS, 2)
ferry_copy_publish(u64 src, u64 dst, u64 len, u64 word, u64 position) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = threadIdx.x >> 5;
    const u64 warps = blockDim.x >> 5;
    const u64 pieces = (len + PUBLISH_PIECE - 1) / PUBLISH_PIECE;
    for (u64 piece = warp; piece < pieces; piece += warps) {
        const u64 skip = piece * PUBLISH_PIECE;
        const u64 bytes = len - skip < PUBLISH_PIECE ? len - skip : PUBLISH_PIECE;
        warp_copy<4, 1>(src + skip, dst + skip, bytes, lane);
    }
    // Every warp's stores come before thread 0's system-wide fence (the barrier orders them
    // within the block), and the fence before the position.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        *(volatile u64*)word = position;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) ferry_copy_paged(PAGED_PARAMS) {
    copy_paged<4, 1>(PAGED_ARGS);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) ferry_copy_paged_shifted(PAGED_PARAMS) {
    copy_paged<8, 4>(PAGED_ARGS);
}
