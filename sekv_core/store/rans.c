/* The offload tier's entropy coder: a static rANS coder (32-bit states, 16-bit words) over
 * the bit fields of fixed-size records. Built with zoomstep.c into one library by
 * sekv_core/native.py, called through sekv_core/store/entropy.py.
 *
 * Records (L, H, S, B) uint8; each layer's record is cut into F fields of widths[l][f] bits
 * (0..8, lowest bits first, covering the record's 8 B bits; 0: none). A field's symbols over a
 * (layer, head)'s S rows form one *stream*, with its own frequency table (PROB_BITS-bit
 * probabilities, every symbol of its 2^width at least 1). Streams follow each other in
 * (layer, head, field) order, rows in order, under four coder states (row r by state r % 4:
 * the steps of a decode overlap); a field may be xored with flips[l][f] before it is coded
 * (an int8 field made to order as its values). */
#include <stdint.h>
#include <string.h>

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_LOW (1u << 16) /* a state lies in [2^16, 2^32): one word renormalises it */
#define TABLE 256 /* entries per stream's table (the widest field's symbols) */
#define STATES 4  /* interleaved coder states: row r is coded by state r % 4 */

static inline uint32_t field_get(const uint8_t *rec, int64_t B, int offset, int width) {
    int64_t byte = offset >> 3;
    uint32_t window = rec[byte];
    if (byte + 1 < B) window |= (uint32_t)rec[byte + 1] << 8;
    return (window >> (offset & 7)) & ((1u << width) - 1u);
}

static inline void field_put(uint8_t *rec, int64_t B, int offset, uint32_t symbol) {
    int64_t byte = offset >> 3;
    uint32_t placed = symbol << (offset & 7);
    rec[byte] |= (uint8_t)(placed & 255u);
    if ((placed >> 8) && byte + 1 < B) rec[byte + 1] |= (uint8_t)(placed >> 8);
}

static int offsets_of(const int64_t *widths, int64_t F, int64_t B, int *offsets) {
    int at = 0;
    for (int64_t f = 0; f < F; f++) {
        if (widths[f] < 0 || widths[f] > 8) return -1; /* 0: a field that holds nothing */
        offsets[f] = at;
        at += (int)widths[f];
    }
    return at == 8 * B ? 0 : -1;
}

/* A stream's table fr (2^width entries): each symbol's cumulative frequency in cum, and where
 * symbol_of is given, the symbol of each of the PROB_SCALE slots. 0, or -1 unless the entries
 * sum to PROB_SCALE. */
static int cumulate(const uint16_t *fr, int width, uint32_t *cum, uint8_t *symbol_of) {
    uint32_t sum = 0;
    for (int s = 0; s < (1 << width); s++) {
        cum[s] = sum;
        if (sum + fr[s] > PROB_SCALE) return -1;
        if (symbol_of) memset(symbol_of + sum, s, fr[s]);
        sum += fr[s];
    }
    return sum == PROB_SCALE ? 0 : -1;
}

/* counts (L * H * F, TABLE) int64: each stream's symbol histogram. 0, or -1 for bad fields. */
int sekv_rans_histogram(const uint8_t *records, int64_t L, int64_t H, int64_t S, int64_t B,
                        int64_t F, const int64_t *widths, const int64_t *flips, int64_t *counts) {
    int offsets[8 * 256];
    if (F > 8 * 256) return -1;
    memset(counts, 0, sizeof(int64_t) * (size_t)(L * H * F * TABLE));
    for (int64_t l = 0; l < L; l++) {
        if (offsets_of(widths + l * F, F, B, offsets)) return -1;
        for (int64_t h = 0; h < H; h++) {
            const uint8_t *block = records + (l * H + h) * S * B;
            for (int64_t f = 0; f < F; f++) {
                int64_t *count = counts + ((l * H + h) * F + f) * TABLE;
                int width = (int)widths[l * F + f];
                uint32_t flip = (uint32_t)flips[l * F + f];
                if (width == 0) continue;
                for (int64_t r = 0; r < S; r++)
                    count[field_get(block + r * B, B, offsets[f], width) ^ flip]++;
            }
        }
    }
    return 0;
}

/* Encodes the records with tables freq (L * H * F, TABLE) uint16 (a stream's entries past its
 * 2^width unused) into out[0, cap), written from its end: returns the coded length n (the
 * bytes are out[cap - n, cap)), -1 when they do not fit in cap, -2 for bad fields or a symbol
 * its table gives no probability. */
int64_t sekv_rans_encode(const uint8_t *records, int64_t L, int64_t H, int64_t S, int64_t B,
                         int64_t F, const int64_t *widths, const int64_t *flips,
                         const uint16_t *freq, uint8_t *out, int64_t cap) {
    int offsets[8 * 256];
    uint32_t cum[TABLE];
    uint8_t *p = out + cap;
    uint32_t xs[STATES];
    for (int k = 0; k < STATES; k++) xs[k] = RANS_LOW;
    if (F > 8 * 256) return -2;
    for (int64_t l = L - 1; l >= 0; l--) {
        if (offsets_of(widths + l * F, F, B, offsets)) return -2;
        for (int64_t h = H - 1; h >= 0; h--) {
            const uint8_t *block = records + (l * H + h) * S * B;
            for (int64_t f = F - 1; f >= 0; f--) {
                const uint16_t *fr = freq + ((l * H + h) * F + f) * TABLE;
                int width = (int)widths[l * F + f];
                uint32_t flip = (uint32_t)flips[l * F + f];
                if (width == 0) continue;
                if (cumulate(fr, width, cum, NULL)) return -2;
                for (int64_t r = S - 1; r >= 0; r--) {
                    uint32_t s = field_get(block + r * B, B, offsets[f], width) ^ flip;
                    uint32_t fs = fr[s], x = xs[r % STATES];
                    if (fs == 0) return -2;
                    if (x >= ((RANS_LOW >> PROB_BITS) << 16) * fs) { /* one word out */
                        if (p - out < 2) return -1;
                        *--p = (uint8_t)(x >> 8);
                        *--p = (uint8_t)(x & 255u); /* the word's low byte first */
                        x >>= 16;
                    }
                    xs[r % STATES] = ((x / fs) << PROB_BITS) + (x % fs) + cum[s];
                }
            }
        }
    }
    if (p - out < 4 * STATES) return -1;
    for (int k = STATES - 1; k >= 0; k--) /* read back: state 0 first, each high byte first */
        for (int i = 0; i < 4; i++) *--p = (uint8_t)(xs[k] >> (8 * i));
    return (int64_t)(out + cap - p);
}

/* One step of a decode: the next symbol s of state x put into row `row`'s field, then x
 * renormalised by at most one word from p without a branch (a renormalisation is about as
 * likely as not). Unchecked: the caller knows two bytes are left. A macro, so that each of the
 * four states stays in a register. */
#define DECODE_ROW(x, row)                                                                    \
    {                                                                                         \
        uint32_t slot = x & (PROB_SCALE - 1u), s = symbol_of[slot];                          \
        x = fr[s] * (x >> PROB_BITS) + slot - cum[s];                                         \
        uint32_t need = x < RANS_LOW;                                                         \
        x = need ? (x << 16) | p[0] | ((uint32_t)p[1] << 8) : x;                              \
        p += 2 * need;                                                                        \
        field_put(block + (row) * B, B, at, s ^ flip);                                        \
    }

/* DECODE_ROW where fewer than two bytes may be left: returns -1 from the caller if they run out. */
#define DECODE_LAST(x, row)                                                                   \
    {                                                                                         \
        uint32_t slot = x & (PROB_SCALE - 1u), s = symbol_of[slot];                          \
        x = fr[s] * (x >> PROB_BITS) + slot - cum[s];                                         \
        if (x < RANS_LOW) {                                                                   \
            if (end - p < 2) return -1;                                                       \
            x = (x << 16) | p[0] | ((uint32_t)p[1] << 8);                                     \
            p += 2;                                                                           \
        }                                                                                     \
        field_put(block + (row) * B, B, at, s ^ flip);                                        \
    }

/* Decodes coded[0, n) into records (zeroed here) with the encoder's tables: 0, or -1 when the
 * bytes are not such a coding (run out, left over, or a state the encoder does not end in).
 * Rows four at a time, one per state: the four steps overlap. */
int sekv_rans_decode(const uint8_t *coded, int64_t n, int64_t L, int64_t H, int64_t S, int64_t B,
                     int64_t F, const int64_t *widths, const int64_t *flips, const uint16_t *freq,
                     uint8_t *records) {
    int offsets[8 * 256];
    uint32_t cum[TABLE];
    uint8_t symbol_of[PROB_SCALE];
    const uint8_t *p = coded, *end = coded + n;
    if (F > 8 * 256 || n < 4 * STATES) return -1;
    uint32_t xs[STATES] = {0};
    for (int k = 0; k < STATES; k++)
        for (int i = 0; i < 4; i++) xs[k] = (xs[k] << 8) | *p++;
    uint32_t x0 = xs[0], x1 = xs[1], x2 = xs[2], x3 = xs[3];
    memset(records, 0, (size_t)(L * H * S * B));
    for (int64_t l = 0; l < L; l++) {
        if (offsets_of(widths + l * F, F, B, offsets)) return -1;
        for (int64_t h = 0; h < H; h++) {
            uint8_t *block = records + (l * H + h) * S * B;
            for (int64_t f = 0; f < F; f++) {
                const uint16_t *fr = freq + ((l * H + h) * F + f) * TABLE;
                int width = (int)widths[l * F + f], at = offsets[f];
                uint32_t flip = (uint32_t)flips[l * F + f];
                if (width == 0) continue;
                if (cumulate(fr, width, cum, symbol_of)) return -1;
                int64_t r = 0;
                for (; r + STATES <= S && end - p >= 2 * STATES; r += STATES) {
                    DECODE_ROW(x0, r)
                    DECODE_ROW(x1, r + 1)
                    DECODE_ROW(x2, r + 2)
                    DECODE_ROW(x3, r + 3)
                }
                for (; r < S; r++) { /* the last bytes, or the stream's last rows */
                    if (r % STATES == 0) DECODE_LAST(x0, r)
                    else if (r % STATES == 1) DECODE_LAST(x1, r)
                    else if (r % STATES == 2) DECODE_LAST(x2, r)
                    else DECODE_LAST(x3, r)
                }
            }
        }
    }
    if (x0 != RANS_LOW || x1 != RANS_LOW || x2 != RANS_LOW || x3 != RANS_LOW) return -1;
    return p == end ? 0 : -1;
}
