/* The one copy of a KV transfer into the cache: loads, then non-temporal stores.
 *
 * A KV transfer is tens of MB copied into cache blocks that the next decode steps read
 * from memory anyway (the cache is far larger than the CPU's caches). memcpy's ordinary
 * stores first read every destination line into the cache (read-for-ownership), then
 * write it back: three passes over memory. Streaming stores write whole lines straight to
 * memory: two passes. Measured here: 125 blocks of 737,280 bytes at 5.2-6.2 GB/s with
 * memcpy, 7.4-9.4 with this, on one thread.
 *
 * stream_copy(dst, src, n): copies n bytes; the bulk with 32-byte streaming stores when
 * AVX is there (dst aligned to 32 bytes by a short memcpy first), the tail with memcpy.
 * Returns 0.
 *
 * stream_copy_many(dst, src, count, nbytes, threads): ``count`` such copies of ``nbytes``
 * each (a transfer's blocks), handed out one block at a time to ``threads`` threads
 * (dynamic schedule: a thread that loses its core holds up one block, not a share of
 * them; the caller passes 1 when it runs pinned to one CPU).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

int stream_copy(void *dst, const void *src, int64_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    if (n <= 0)
        return 0;
#ifdef __AVX__
    int64_t head = (int64_t)((32 - ((uintptr_t)d & 31)) & 31);
    if (head > n)
        head = n;
    memcpy(d, s, (size_t)head);
    int64_t i = head;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    _mm_sfence(); /* the streamed lines are visible before anyone is told the copy ended */
    memcpy(d + i, s + i, (size_t)(n - i));
#else
    memcpy(d, s, (size_t)n);
#endif
    return 0;
}

int stream_copy_many(void **dst, const void **src, int64_t count, int64_t nbytes, int threads) {
    if (count <= 0)
        return 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (int64_t i = 0; i < count; i++)
        stream_copy(dst[i], src[i], nbytes);
    return 0;
}
