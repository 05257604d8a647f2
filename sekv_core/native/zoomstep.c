/* The decode step on the CPU, one call per step where the tensor code takes dozens of small
 * ops: routing (the routers' sketch reads, select), the zoom pool's update, zoom-in reads
 * (records gathered and decoded, keys rotated), the memory entries attention reads, and the
 * trace. Built and loaded by sekv_core/native/build.py, called through sekv_core/native/kernels.py;
 * the same decisions and rows as the tensor code (ties in score: document order; the sketch
 * scores to float rounding). Arrays are C-contiguous; bool arrays are one byte per element. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bitfields.h"

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

/* ---- zoom pools (sekv_core/zoom/pools.py): the slot bookkeeping of one layer's update --- */

/* IEEE half precision from a float, rounded to nearest even */
static uint16_t half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (mag >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); /* 2^16 and up: infinity */
    if (mag < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24 */
        float v;
        memcpy(&v, &mag, sizeof v);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f));
    }
    uint32_t h = ((mag >> 23) - 112) << 10 | ((mag >> 13) & 0x3ffu), rest = mag & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry moves the exponent */
    return (uint16_t)(sign | h);
}

static float half_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    x = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* one row as int8 codes and an fp16 scale (sekv_core.kvquant.quantize_rows) */
static void encode_row(const float *x, int64_t D, int8_t *codes, uint16_t *scale) {
    uint32_t top = 0; /* the largest magnitude: the bits of non-negative floats order as they do */
    for (int64_t d = 0; d < D; d++) {
        uint32_t bits;
        memcpy(&bits, x + d, sizeof bits);
        bits &= 0x7fffffffu;
        top = bits > top ? bits : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    *scale = half_bits(amax / 127.0f);
    float step = half_value(*scale);
    step = step < 6.103515625e-05f ? 6.103515625e-05f : step; /* fp16's smallest normal */
    for (int64_t d = 0; d < D; d++) {
        float c = x[d] / step; /* a division, as torch's: not a product with 1 / step */
        c = c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c);
        /* to the nearest integer, ties to even (|c| < 2^22): adding 1.5 * 2^23 drops the
           fraction in the default rounding mode */
        codes[d] = (int8_t)((c + 12582912.0f) - 12582912.0f);
    }
}

/* The picked (span, head) pairs the pool does not hold, head-major: zoom & ~held. Writes heads
 * and spans (room for H * N) and *needed, the most slots one head needs (its held picked spans'
 * slots and the new pairs' tokens); returns the pairs' count. */
int64_t sekv_pairs(const uint8_t *zoom, const uint8_t *held, const int64_t *owner, int64_t H,
                   int64_t N, int64_t C, const int64_t *lengths, int64_t *heads, int64_t *spans,
                   int64_t *needed) {
    int64_t n = 0, most = 0;
    for (int64_t h = 0; h < H; h++) {
        int64_t slots = 0;
        for (int64_t s = 0; s < N; s++)
            if (zoom[h * N + s] && !held[h * N + s]) {
                heads[n] = h;
                spans[n++] = s;
                slots += lengths[s];
            }
        for (int64_t c = 0; c < C; c++) {
            int64_t o = owner[h * C + c];
            if (o >= 0 && zoom[h * N + o]) slots++;
        }
        if (slots > most) most = slots;
    }
    *needed = most;
    return n;
}

/* Put the new pairs' rows k, v (T, D; in pair order) in slots no picked span uses: free ones
 * first, then the least recently active (ties: slot order). The spans losing a slot are no
 * longer held and their other slots are freed. codes (2, H, C, D), scale (2, H, C): the pool's
 * 8-bit rows; owner, last, token (H, C); held (H, N); first_row (N,): each span's first row of
 * the sketch order; k, v hold T rows, the pairs' tokens. Returns 0, -1 when out of memory, or -2
 * (nothing changed) when T is not the pairs' tokens. */
int sekv_place(int64_t H, int64_t N, int64_t C, int64_t D, const uint8_t *zoom, uint8_t *held,
               int64_t *owner, int64_t *last, int64_t *token, int64_t n_pairs,
               const int64_t *heads, const int64_t *spans, const int64_t *lengths,
               const int64_t *first_row, int64_t T, const float *k, const float *v,
               int8_t *codes, uint16_t *scale) {
    int64_t total = 0;
    for (int64_t i = 0; i < n_pairs; i++) total += lengths[spans[i]];
    if (total != T) return -2;
    size_t room = C > 0 ? (size_t)C : 1;
    uint64_t *keys = malloc(2 * room * sizeof *keys);
    if (!keys) return -1;
    uint64_t *tmp = keys + room;
    int64_t pair = 0, row = 0;
    for (int64_t h = 0; h < H; h++) {
        int64_t m = 0; /* this head's slots not kept, least recently active first */
        for (int64_t c = 0; c < C; c++) {
            int64_t o = owner[h * C + c];
            if (o >= 0 && zoom[h * N + o]) continue;
            keys[m++] = ((uint64_t)(last[h * C + c] + 1) << 32) | (uint64_t)c;
        }
        radix_sort(keys, tmp, m);
        int64_t next = 0;
        for (; pair < n_pairs && heads[pair] == h; pair++) {
            int64_t s = spans[pair];
            for (int64_t along = 0; along < lengths[s]; along++, row++, next++) {
                int64_t c = (int64_t)(keys[next] & 0xffffffffu), at = h * C + c;
                if (owner[at] >= 0) held[h * N + owner[at]] = 0; /* evicted */
                owner[at] = s;
                token[at] = first_row[s] + along;
                encode_row(k + row * D, D, codes + at * D, scale + at);
                encode_row(v + row * D, D, codes + (H * C + at) * D, scale + H * C + at);
            }
            held[h * N + s] = 1;
        }
    }
    for (int64_t h = 0; h < H; h++) /* what is left of evicted spans: free */
        for (int64_t c = 0; c < C; c++) {
            int64_t o = owner[h * C + c];
            if (o >= 0 && !held[h * N + o]) owner[h * C + c] = last[h * C + c] = -1;
        }
    free(keys);
    return 0;
}

/* The slots of picked spans: active (H, C) out, their last use set to `update`, and bias (H, C)
 * 0 there and `hidden` elsewhere (attention's additive bias). */
void sekv_activate(const uint8_t *zoom, const int64_t *owner, int64_t H, int64_t N, int64_t C,
                   int64_t update, int64_t *last, uint8_t *active, float *bias, float hidden) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c < C; c++) {
            int64_t o = owner[h * C + c];
            uint8_t on = o >= 0 && zoom[h * N + o];
            active[h * C + c] = on;
            bias[h * C + c] = on ? 0.0f : hidden;
            if (on) last[h * C + c] = update;
        }
}

/* ---- zoom-in (sekv_core/zoom/reconstruct.py): the records of (span, head) pairs --------- */

/* Copy the records of n (span, head) pairs of `layer` (heads ascending) from the offload
 * tier's flat buffers of keys' and values' records (k_count, v_count records of kB, vB bytes)
 * into kout (T, kB) and vout (T, vB), pair after pair: a span's records of (layer, head) start
 * at record0[span] + (layer * H + head) * stride[span]. pos (T,): each row's context position
 * (starts[span] + its place in the span, at most context_len - 1); head_rows (H,): the rows of
 * each head. Returns T, -1 when the heads are not ascending, -2 when a record is out of range
 * (kout, vout, pos: room for the pairs' total length). */
int64_t sekv_gather(int64_t n, const int64_t *spans, const int64_t *heads, int64_t layer,
                    int64_t H, const int64_t *record0, const int64_t *stride,
                    const int64_t *lengths, const int64_t *starts, int64_t context_len,
                    const uint8_t *kbuf, int64_t k_count, int64_t kB, const uint8_t *vbuf,
                    int64_t v_count, int64_t vB, uint8_t *kout, uint8_t *vout, int64_t *pos,
                    int64_t *head_rows) {
    int64_t row = 0;
    memset(head_rows, 0, (size_t)H * sizeof *head_rows);
    for (int64_t i = 0; i < n; i++) {
        int64_t s = spans[i], h = heads[i], len = lengths[s];
        if (h < 0 || h >= H || (i && h < heads[i - 1])) return -1;
        int64_t first = record0[s] + (layer * H + h) * stride[s];
        if (first < 0 || len < 0 || first + len > k_count || first + len > v_count) return -2;
        memcpy(kout + row * kB, kbuf + first * kB, (size_t)(len * kB));
        memcpy(vout + row * vB, vbuf + first * vB, (size_t)(len * vB));
        for (int64_t a = 0; a < len; a++) {
            int64_t p = starts[s] + a;
            pos[row + a] = p < context_len - 1 ? p : context_len - 1;
        }
        head_rows[h] += len;
        row += len;
    }
    return row;
}

/* The codes (T, D) as floats of an even code's records (T, B) (sekv_core.store.codes): the
 * d-th code has bits[d] bits, laid out as bitfields.h says. At most 256 directions (the caller
 * checks). */
void sekv_field_codes(const uint8_t *records, int64_t T, int64_t B, int64_t D,
                      const int64_t *bits, float *out) {
    BitField fields[256]; /* each direction's place once; then record by record */
    if (D > 256) return;
    for (int64_t d = 0, start = 0; d < D; start += bits[d], d++)
        fields[d] = bitfield_at(start, bits[d], B);
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *r = records + t * B;
        float *o = out + t * D;
        for (int64_t d = 0; d < D; d++) o[d] = (float)bitfield_get(r, B, fields[d]);
    }
}

/* The coefficients (T, D) of a tier code's records (T, B) (sekv_core.store.codes): 16 bits:
 * D fp16 values; 4 bits: D codes (bitfields.h), less 7, times the fp16 scale after them. At
 * most 256 directions (the caller checks). */
void sekv_tier_coefficients(const uint8_t *records, int64_t T, int64_t B, int64_t D,
                            int64_t bits, float *out) {
    BitField fields[256];
    if (D > 256) return;
    for (int64_t d = 0; d < D; d++) fields[d] = bitfield_at(4 * d, 4, B);
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *r = records + t * B;
        float *o = out + t * D;
        if (bits == 16) {
            for (int64_t d = 0; d < D; d++) o[d] = half_value((uint16_t)(r[2 * d] | r[2 * d + 1] << 8));
            continue;
        }
        const uint8_t *sb = r + D / 2;
        float scale = half_value((uint16_t)(sb[0] | sb[1] << 8));
        for (int64_t d = 0; d < D; d++)
            o[d] = ((float)bitfield_get(r, B, fields[d]) - 7.0f) * scale;
    }
}

/* ---- routing (sekv_core/zoom/router.py): what the routers read of the sketch ------------ */

/* The estimated logits acc (M, S) of one KV head's M queries qs (M, R) in the sketch's scale:
 * base (M,) plus the products with the 4-bit sketch codes packed two per byte, each direction
 * pair's byte column contiguous over the S rows (R / 2, S; the low nibble multiplies the even
 * direction). */
static void sketch_logits(const float *qs, const float *base, const uint8_t *packed, int64_t M,
                          int64_t R, int64_t S, float *acc) {
    int64_t cols = R / 2;
    for (int64_t m = 0; m < M; m++) {
        float b = base[m], *a = acc + m * S;
        for (int64_t s = 0; s < S; s++) a[s] = b;
    }
    for (int64_t j = 0; j < cols; j++) {
        const uint8_t *col = packed + j * S;
        for (int64_t m = 0; m < M; m++) {
            float even = qs[m * R + 2 * j], odd = qs[m * R + 2 * j + 1];
            float *a = acc + m * S;
            for (int64_t s = 0; s < S; s++)
                a[s] += even * (float)(col[s] & 15) + odd * (float)(col[s] >> 4);
        }
    }
}

static int spans_inside(int64_t N, const int64_t *first_row, const int64_t *lengths, int64_t S) {
    for (int64_t n = 0; n < N; n++)
        if (first_row[n] < 0 || lengths[n] < 0 || first_row[n] + lengths[n] > S) return 0;
    return 1;
}

/* One KV head's M queries q (M, D) in its sketch's scale: qs (M, R) = q proj (D, R) times
 * scale (R,), and base (M,) = q . mean (D,) less 8 x the sum of qs (codes are levels + 8): the
 * constants sketch_logits adds. */
static void sketch_queries(const float *q, int64_t M, int64_t D, const float *proj,
                           const float *scale, const float *mean, int64_t R, float *qs,
                           float *base) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = q + m * D;
        float off = 0.0f, total = 0.0f;
        for (int64_t d = 0; d < D; d++) off += x[d] * mean[d];
        for (int64_t r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int64_t d = 0; d < D; d++) sum += x[d] * proj[d * R + r];
            qs[m * R + r] = sum * scale[r];
            total += qs[m * R + r];
        }
        base[m] = total * -8.0f + off;
    }
}

/* Each span's best estimated logit per KV head (sekv_core.router.SketchRouter): the M queries
 * q (H, M, D) of each head in its sketch's scale (sketch_queries, with proj (H, D, R), scale
 * (H, R), mean (H, D)), their logits with its sketch (H, R / 2, S) as sketch_logits makes them,
 * the best query's, times scaling; the best row of each span (rows first_row[n] .. +
 * lengths[n]). out (H, N). Returns 0, -1 when out of memory, or -2 when a span's rows lie
 * outside the sketch. */
int sekv_sketch_scores(const float *q, int64_t H, int64_t M, int64_t D, const float *proj,
                       const float *scale, const float *mean, int64_t R, const uint8_t *packed,
                       int64_t S, float scaling, int64_t N, const int64_t *first_row,
                       const int64_t *lengths, float *out) {
    if (!spans_inside(N, first_row, lengths, S)) return -2;
    float *acc = malloc((size_t)(M * S + S + M * R + M) * sizeof *acc + 1);
    if (!acc) return -1;
    float *best = acc + M * S, *qs = best + S, *base = qs + M * R;
    for (int64_t h = 0; h < H; h++) {
        sketch_queries(q + h * M * D, M, D, proj + h * D * R, scale + h * R, mean + h * D, R, qs,
                       base);
        sketch_logits(qs, base, packed + h * (R / 2) * S, M, R, S, acc);
        memcpy(best, acc, (size_t)S * sizeof *best);
        for (int64_t m = 1; m < M; m++)
            for (int64_t s = 0; s < S; s++) best[s] = acc[m * S + s] > best[s] ? acc[m * S + s] : best[s];
        for (int64_t s = 0; s < S; s++) best[s] *= scaling;
        for (int64_t n = 0; n < N; n++) {
            float top = -INFINITY;
            for (int64_t s = first_row[n]; s < first_row[n] + lengths[n]; s++)
                top = best[s] > top ? best[s] : top;
            out[h * N + n] = top;
        }
    }
    free(acc);
    return 0;
}

/* exp(x) for x <= 0 to about 2e-7 relative (1 below -87), in operations a compiler vectorizes:
 * x = k ln 2 + r with |r| <= ln 2 / 2, exp(r) from its Taylor polynomial to r^6, times 2^k. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = x * 1.44269504f + 12582912.0f; /* rounded to the nearest integer by the add */
    k -= 12582912.0f;
    float r = (x - k * 0.693145752f) - k * 1.42860677e-6f; /* ln 2 in two parts */
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float two;
    memcpy(&two, &bits, sizeof two);
    return p * two;
}

/* Of the logits a (S,) of one query: each span's largest times scaling, peak (N,), and the
 * log-sum-exp of them, mass (N,); -inf both for a span without rows. shift, e: (S,) scratch. */
static void span_stats(float *a, int64_t S, float scaling, int64_t N, const int64_t *first_row,
                       const int64_t *lengths, float *shift, float *e, float *peak, float *mass) {
    for (int64_t s = 0; s < S; s++) a[s] *= scaling;
    for (int64_t n = 0; n < N; n++) {
        const float *x = a + first_row[n];
        float top = -INFINITY;
        for (int64_t s = 0; s < lengths[n]; s++) top = x[s] > top ? x[s] : top;
        for (int64_t s = 0; s < lengths[n]; s++) shift[first_row[n] + s] = top;
        peak[n] = top;
    }
    for (int64_t s = 0; s < S; s++) e[s] = exp_nonpositive(a[s] - shift[s]);
    for (int64_t n = 0; n < N; n++) {
        float sum = 0.0f;
        for (int64_t s = first_row[n]; s < first_row[n] + lengths[n]; s++) sum += e[s];
        mass[n] = lengths[n] ? peak[n] + logf(sum) : -INFINITY;
    }
}

/* The trained router's scores (sekv_core.router.TrainedRouter, gate of sekv_core.zoomnet): per
 * KV head h, for its M = G x Tq queries q (H, M, D) (query head g = m / Tq):
 *   the sketch's logits of each span row: the queries in the sketch's scale (sketch_queries,
 *   with proj (H, D, R), scale (H, R), mean (H, D)), their products with the 4-bit codes, as
 *   sketch_logits; of each span, their largest (peak) and log-sum-exp (mass),
 *   times scaling;
 *   z = w0 (peak - best peak) + w1 (mass - best mass) + w2 (q route . keys) scaling + w3 log_len
 *   - w4, with route (H, G, D, K) the query heads' routing maps, keys (H, G, N, K) the spans'
 *   mapped mean keys, coef (H, G, 5) the weights w and "best" the head's best over its queries
 *   and spans;
 * out (H, N): each span's largest z over the queries. Returns as sekv_sketch_scores. */
int sekv_gate_scores(const float *q, int64_t H, int64_t G, int64_t Tq, int64_t D,
                     const float *proj, const float *scale, const float *mean, int64_t R,
                     const uint8_t *packed, int64_t S, int64_t N, const int64_t *first_row,
                     const int64_t *lengths, const float *route, const float *keys, int64_t K,
                     const float *coef, const float *log_len, float scaling, float *out) {
    if (!spans_inside(N, first_row, lengths, S)) return -2;
    int64_t M = G * Tq;
    size_t floats = (size_t)(M * S + 2 * S + 2 * M * N + M * R + M + M * K);
    float *acc = malloc(floats * sizeof *acc + 1);
    if (!acc) return -1;
    float *shift = acc + M * S, *e = shift + S, *peak = e + S, *mass = peak + M * N;
    float *qs = mass + M * N, *base = qs + M * R, *qr = base + M;
    for (int64_t h = 0; h < H; h++) {
        sketch_queries(q + h * M * D, M, D, proj + h * D * R, scale + h * R, mean + h * D, R, qs,
                       base);
        for (int64_t m = 0; m < M; m++) {
            const float *x = q + (h * M + m) * D, *w = route + (h * G + m / Tq) * D * K;
            for (int64_t k = 0; k < K; k++) {
                float sum = 0.0f;
                for (int64_t d = 0; d < D; d++) sum += x[d] * w[d * K + k];
                qr[m * K + k] = sum;
            }
        }
        sketch_logits(qs, base, packed + h * (R / 2) * S, M, R, S, acc);
        float best_peak = -INFINITY, best_mass = -INFINITY;
        for (int64_t m = 0; m < M; m++) {
            float *p = peak + m * N, *w = mass + m * N;
            span_stats(acc + m * S, S, scaling, N, first_row, lengths, shift, e, p, w);
            for (int64_t n = 0; n < N; n++) {
                best_peak = p[n] > best_peak ? p[n] : best_peak;
                best_mass = w[n] > best_mass ? w[n] : best_mass;
            }
        }
        for (int64_t n = 0; n < N; n++) {
            float top = -INFINITY;
            for (int64_t m = 0; m < M; m++) {
                int64_t g = m / Tq;
                const float *c = coef + (h * G + g) * 5, *key = keys + ((h * G + g) * N + n) * K;
                float dot = 0.0f;
                for (int64_t k = 0; k < K; k++) dot += qr[m * K + k] * key[k];
                float z = c[0] * (peak[m * N + n] - best_peak) + c[1] * (mass[m * N + n] - best_mass);
                z = z + c[2] * (dot * scaling) + c[3] * log_len[n] - c[4];
                top = z > top ? z : top;
            }
            out[h * N + n] = top;
        }
    }
    free(acc);
    return 0;
}

/* ---- RoPE (sekv_core/rope.py): keys rotated to their positions -------------------------- */

/* out (T, D) = k cos + rotate_half(k) sin, cos | sin the row (2D) of each key's position in
 * table (n, 2D); rotate_half(k) = (-k[D/2:], k[:D/2]). Each product and sum rounded as torch
 * rounds them. Returns 0, or -1 for a position outside the table. */
int sekv_rotate(const float *keys, const int64_t *pos, const float *table, int64_t T, int64_t D,
                int64_t n, float *out) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= n) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *k = keys + t * D, *cs = table + pos[t] * 2 * D, *sn = cs + D;
        float *o = out + t * D;
        for (int64_t d = 0; d < half; d++) o[d] = k[d] * cs[d] + (-k[d + half]) * sn[d];
        for (int64_t d = half; d < D; d++) o[d] = k[d] * cs[d] + k[d - half] * sn[d];
    }
    return 0;
}

/* ---- attention (sekv_core/zoom/attention.py): the memory entries of one call ------------ */

/* The entries attention reads from the memory, per KV head: the F sinks and anchors, then the
 * pool's C slots, dequantized (code x scale) into k (H, F + C, D) and v, and bias (H, F + C): 0
 * for the fixed rows, the pool's own bias for its slots. fixed: this layer's rows (H, F, D) and
 * scales (H, F); pool: rows (2, H, C, D) and scales (2, H, C), keys first. */
void sekv_entries(const int8_t *fk, const uint16_t *fks, const int8_t *fv, const uint16_t *fvs,
                  const int8_t *pool, const uint16_t *pool_scale, const float *pool_bias,
                  int64_t H, int64_t F, int64_t C, int64_t D, float *k, float *v, float *bias) {
    int64_t E = F + C;
    for (int64_t h = 0; h < H; h++) {
        for (int64_t e = 0; e < E; e++) {
            const int8_t *kc, *vc;
            float ks, vs;
            if (e < F) {
                kc = fk + (h * F + e) * D, vc = fv + (h * F + e) * D;
                ks = half_value(fks[h * F + e]), vs = half_value(fvs[h * F + e]);
                bias[h * E + e] = 0.0f;
            } else {
                int64_t c = h * C + e - F;
                kc = pool + c * D, vc = pool + (H * C + c) * D;
                ks = half_value(pool_scale[c]), vs = half_value(pool_scale[H * C + c]);
                bias[h * E + e] = pool_bias[c];
            }
            float *ko = k + (h * E + e) * D, *vo = v + (h * E + e) * D;
            for (int64_t d = 0; d < D; d++) {
                ko[d] = (float)kc[d] * ks;
                vo[d] = (float)vc[d] * vs;
            }
        }
    }
}

/* ---- the trace (sekv_core/zoom/trace.py): what one decoding step's attention paid ------- */

/* One query's attention mass (H, E) over the memory entries (F fixed rows, then C pool slots)
 * of a decoding step, summed over each KV head's query heads: each slot's share
 * (mass / q_heads) added to its span's in span_mass (N + 1; free slots: the last), in slot
 * order; and, with answer (H, T + 1), each entry's context token keeping the most any step
 * paid it (fixed rows: fixed_pos (H, F); slots: span_pos of their span token, a free slot's
 * -1 reading the last entry: T). Returns 0, or -1 for a position outside the answer. */
int sekv_attention_trace(const float *mass, int64_t H, int64_t F, int64_t C, int64_t q_heads,
                         const int64_t *owner, int64_t N, float *span_mass, const int64_t *token,
                         const int64_t *fixed_pos, const int64_t *span_pos, int64_t S,
                         int64_t T, float *answer) {
    int64_t E = F + C;
    for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c < C; c++) {
            int64_t o = owner[h * C + c];
            span_mass[o < 0 ? N : o] += mass[h * E + F + c] / (float)q_heads;
        }
    if (!answer) return 0;
    for (int64_t h = 0; h < H; h++) {
        float *row = answer + h * (T + 1);
        for (int64_t e = 0; e < E; e++) {
            int64_t p;
            if (e < F) {
                p = fixed_pos[h * F + e];
            } else {
                int64_t r = token[h * C + e - F];
                p = span_pos[r < 0 ? S : r];
            }
            if (p < 0 || p > T) return -1;
            float m = mass[h * E + e] / (float)q_heads;
            if (m > row[p]) row[p] = m;
        }
    }
    return 0;
}
