/* The routing tail of a decode step on the CPU: widening, select and the trace's record, one
 * call each where the tensor code takes ~100 small ops per layer and step. Loaded by
 * sekv_core/native.py; the same decisions as sekv_core/router.py's tensor code (ties in score:
 * document order). Arrays are C-contiguous; bool arrays are one byte per element. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* a float's bits as an unsigned integer that orders as the float does */
static inline uint32_t ordered_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* keys ascending: least significant byte first, a pass skipped when its byte is the same in all */
static void radix_sort(uint64_t *keys, uint64_t *tmp, int64_t n) {
    size_t count[256];
    for (int shift = 0; shift < 64 && n > 1; shift += 8) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < n; i++) count[(keys[i] >> shift) & 255]++;
        if (count[(keys[0] >> shift) & 255] == (size_t)n) continue;
        size_t sum = 0;
        for (int d = 0; d < 256; d++) {
            size_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) tmp[count[(keys[i] >> shift) & 255]++] = keys[i];
        memcpy(keys, tmp, (size_t)n * sizeof *keys);
    }
}

/* out[h, n]: the largest of scores[h, n - width .. n + width] within the row (NaN wins) */
void sekv_widen(const float *scores, int64_t H, int64_t N, int64_t width, float *out) {
    for (int64_t h = 0; h < H; h++) {
        const float *s = scores + h * N;
        float *o = out + h * N;
        for (int64_t n = 0; n < N; n++) {
            int64_t a = n < width ? 0 : n - width, b = n + width >= N ? N - 1 : n + width;
            float m = s[a];
            for (int64_t j = a + 1; j <= b; j++)
                if (s[j] > m || isnan(s[j])) m = s[j];
            o[n] = m;
        }
    }
}

/* Per head: threshold = best score - margin (0 without a margin); the spans at or above it in
 * descending score (ties: document order) in `rounds` passes, each taking the longest prefix of
 * the undecided spans that fits in what is left, a span longer than what is left dropped for
 * good. zoom (H, N) and threshold (H,) out. Returns 0, or -1 when out of memory. */
int sekv_select(const float *scores, int64_t H, int64_t N, const int64_t *lengths,
                int64_t budget, int has_margin, float margin, int64_t rounds, uint8_t *zoom,
                float *threshold) {
    size_t room = N > 0 ? (size_t)N : 1;
    uint64_t *keys = malloc(2 * room * sizeof *keys);
    uint8_t *open = malloc(room);
    if (!keys || !open) {
        free(keys);
        free(open);
        return -1;
    }
    uint64_t *tmp = keys + room;
    memset(zoom, 0, (size_t)(H * N));
    for (int64_t h = 0; h < H; h++) {
        const float *s = scores + h * N;
        uint8_t *z = zoom + h * N;
        float thr = 0.0f;
        if (has_margin) {
            float best = -INFINITY;
            for (int64_t n = 0; n < N; n++)
                if (s[n] > best || isnan(s[n])) best = s[n];
            thr = best - margin;
        }
        threshold[h] = thr;
        int64_t k = 0; /* eligible spans: score first (descending), then the span's index */
        for (int64_t n = 0; n < N; n++)
            if (s[n] >= thr) keys[k++] = ((uint64_t)~ordered_bits(s[n]) << 32) | (uint64_t)n;
        radix_sort(keys, tmp, k);
        memset(open, 1, (size_t)k);
        int64_t left = budget;
        for (int64_t r = 0; r < rounds; r++) {
            int64_t used = 0, took = 0;
            for (int64_t i = 0; i < k; i++) {
                if (!open[i]) continue;
                int64_t span = (int64_t)(keys[i] & 0xffffffffu), len = lengths[span];
                if (len > left) {
                    open[i] = 0;
                    continue;
                }
                used += len;
                if (used <= left) {
                    open[i] = 0;
                    z[span] = 1;
                    took += len;
                }
            }
            left -= took;
        }
    }
    free(keys);
    free(open);
    return 0;
}

/* The trace's record of one routing (sekv_core.trace.ZoomTrace.record): zoomed (H, N) |= zoom;
 * per span the best margin over the heads that zoomed it (score - the head's threshold) and the
 * score there, where better than before; tokens_max: the most tokens one head zoomed. */
void sekv_record(const uint8_t *zoom, const float *scores, const float *threshold, int64_t H,
                 int64_t N, const int64_t *lengths, uint8_t *zoomed, float *best_margin,
                 float *best_score, int64_t *tokens_max) {
    for (int64_t n = 0; n < N; n++) {
        float best = -INFINITY;
        int64_t head = 0;
        for (int64_t h = 0; h < H; h++) {
            float m = zoom[h * N + n] ? scores[h * N + n] - threshold[h] : -INFINITY;
            if (m > best) {
                best = m;
                head = h;
            }
        }
        if (best > best_margin[n]) {
            best_margin[n] = best;
            best_score[n] = scores[head * N + n];
        }
    }
    for (int64_t h = 0; h < H; h++) {
        int64_t used = 0;
        for (int64_t n = 0; n < N; n++) {
            zoomed[h * N + n] |= zoom[h * N + n];
            if (zoom[h * N + n]) used += lengths[n];
        }
        if (used > *tokens_max) *tokens_max = used;
    }
}
