/* Mustafar's compression on the CPU (`kv_cache/compress/mustafar.py`; the format in
 * `kernels/reference/mustafar_encode.py`), on float16 bits:
 *
 * magnitude_prune_rows: each row of d values keeps its `keep` largest magnitudes (ties: the
 * lowest index), the rest become +0. The threshold magnitude is found by a binary search over
 * the 15 magnitude bits, counting in lanes; the row is then kept in one pass.
 *
 * mustafar_encode_tiles: 64-value tiles -> a bitmap (bit 63 - e set iff element e is non-zero),
 * the offset of the tile's first kept value (an exclusive prefix sum of the counts) and the kept
 * values in element order. Returns how many values were kept. */
#include <stdint.h>
#include <string.h>

static inline int count_at_least(const uint16_t *mag, int64_t d, uint16_t t) {
    int c = 0;
    for (int64_t i = 0; i < d; i++)
        c += mag[i] >= t;
    return c;
}

static void prune_row(const uint16_t *x, uint16_t *out, int64_t d, int64_t keep) {
    uint16_t mag[256];
    for (int64_t i = 0; i < d; i++)
        mag[i] = x[i] & 0x7fff;
    int lo = 0, hi = 0x8000;            /* count(lo) >= keep > count(hi) */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (count_at_least(mag, d, (uint16_t)mid) >= keep)
            lo = mid;
        else
            hi = mid;
    }
    int64_t ties = keep - (lo + 1 < 0x8000 ? count_at_least(mag, d, (uint16_t)(lo + 1)) : 0);
    for (int64_t i = 0; i < d; i++) {
        const int kept = mag[i] > lo || (mag[i] == lo && ties-- > 0);
        out[i] = kept ? x[i] : 0;
    }
}

/* rows of d <= 256 float16 values; keep < d */
void magnitude_prune_rows(const uint16_t *x, uint16_t *out, int64_t rows, int64_t d,
                          int64_t keep, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 256)
    for (int64_t r = 0; r < rows; r++)
        prune_row(x + r * d, out + r * d, d, keep);
}

/* tiles [n, 64] float16 -> bitmaps, offsets [n]; values (room for n * 64) */
int64_t mustafar_encode_tiles(const uint16_t *tiles, int64_t n, int64_t *bitmaps,
                              int64_t *offsets, uint16_t *values, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && n > 1024)
    for (int64_t i = 0; i < n; i++) {
        uint64_t bits = 0;
        int count = 0;
        for (int e = 0; e < 64; e++) {
            const uint64_t nz = (tiles[i * 64 + e] & 0x7fff) != 0;
            bits |= nz << (63 - e);
            count += (int)nz;
        }
        bitmaps[i] = (int64_t)bits;
        offsets[i] = count;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {            /* counts -> exclusive prefix sums */
        const int64_t c = offsets[i];
        offsets[i] = total;
        total += c;
    }
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && n > 1024)
    for (int64_t i = 0; i < n; i++) {
        uint16_t *v = values + offsets[i];
        for (int e = 0; e < 64; e++)
            if (tiles[i * 64 + e] & 0x7fff)
                *v++ = tiles[i * 64 + e];
    }
    return total;
}
