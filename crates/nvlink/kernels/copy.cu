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

struct __attribute__((aligned(16))) Vec16 {
    u64 lo;
    u64 hi;
};

// One entry of a copy list: `len` bytes from `src` to `dst`.
struct CopyEntry {
    u64 src;
    u64 dst;
    u64 len;
};

// Copies `len` bytes with the 32 lanes of a warp in vectors of T, where `src` and `dst` agree
// modulo sizeof(T): a byte head up to T's alignment, the vector body unrolled four deep so each
// lane keeps several loads in flight across the link, then a byte tail.
template <typename T>
__device__ __forceinline__ void warp_copy_as(const unsigned char* src, unsigned char* dst,
                                             u64 len, u32 lane) {
    const u64 align = sizeof(T);
    u64 head = (align - ((u64)dst & (align - 1))) & (align - 1);
    if (head > len) {
        head = len;
    }
    if (lane < head) {
        dst[lane] = src[lane];
    }
    src += head;
    dst += head;
    len -= head;
    const u64 count = len / align;
    const T* s = (const T*)src;
    T* d = (T*)dst;
    u64 i = lane;
    for (; i + 96 < count; i += 128) {
        T a = s[i];
        T b = s[i + 32];
        T c = s[i + 64];
        T e = s[i + 96];
        d[i] = a;
        d[i + 32] = b;
        d[i + 64] = c;
        d[i + 96] = e;
    }
    for (; i < count; i += 32) {
        d[i] = s[i];
    }
    const u64 done = count * align;
    const u64 tail = len - done;
    if (lane < tail) {
        dst[done + lane] = src[done + lane];
    }
}

// Picks the widest vector both addresses allow.
__device__ __forceinline__ void warp_copy(u64 src, u64 dst, u64 len, u32 lane) {
    const unsigned char* s = (const unsigned char*)src;
    unsigned char* d = (unsigned char*)dst;
    const u64 skew = src ^ dst;
    if ((skew & 15) == 0) {
        warp_copy_as<Vec16>(s, d, len, lane);
    } else if ((skew & 7) == 0) {
        warp_copy_as<u64>(s, d, len, lane);
    } else if ((skew & 3) == 0) {
        warp_copy_as<u32>(s, d, len, lane);
    } else {
        warp_copy_as<unsigned char>(s, d, len, lane);
    }
}

// Copies every entry of a list of `count` entries.
extern "C" __global__ void ferry_copy_list(const CopyEntry* entries, u64 count) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 item = warp; item < count; item += warps) {
        const CopyEntry entry = entries[item];
        warp_copy(entry.src, entry.dst, entry.len, lane);
    }
}

// Copies paged-KV blocks: for every pool p and every index b below `blocks`,
// `len` bytes from src_bases[p] + src_ids[b] * src_stride + src_offset
// to dst_bases[p] + dst_ids[b] * dst_stride + dst_offset.
// Blocks longer than `chunk` bytes are shared out in pieces of `chunk`, so a few large blocks
// still keep every warp busy.
extern "C" __global__ void ferry_copy_paged(const u64* src_bases, const u64* dst_bases, u32 pools,
                                            const u32* src_ids, const u32* dst_ids, u32 blocks,
                                            u64 src_stride, u64 dst_stride, u64 src_offset,
                                            u64 dst_offset, u64 len, u64 chunk) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 pieces = (len + chunk - 1) / chunk;
    const u64 items = (u64)pools * blocks * pieces;
    for (u64 item = warp; item < items; item += warps) {
        const u64 pair = item / pieces;
        const u64 piece = item - pair * pieces;
        const u64 pool = pair / blocks;
        const u64 block = pair - pool * blocks;
        const u64 skip = piece * chunk;
        const u64 bytes = len - skip < chunk ? len - skip : chunk;
        const u64 src = src_bases[pool] + (u64)src_ids[block] * src_stride + src_offset + skip;
        const u64 dst = dst_bases[pool] + (u64)dst_ids[block] * dst_stride + dst_offset + skip;
        warp_copy(src, dst, bytes, lane);
    }
}
