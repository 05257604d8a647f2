/* The offload tier's entropy coder: a static rANS coder (32-bit states, 16-bit words) over
 * the bit fields of fixed-size records. Built with zoomstep.c into one library by
 * sekv_core/native/build.py, called through sekv_core/store/entropy.py.
 *
 * Records (L, H, S, B) uint8; each layer's record is cut into F fields of widths[l][f] bits
 * (0..8, laid out as bitfields.h says, covering the record's 8 B bits; 0: none). A field's
 * symbols over a (layer, head)'s S rows have one frequency table (PROB_BITS-bit probabilities,
 * every symbol of its 2^width at least 1). A (layer, head)'s rows are cut into blocks of `rows`
 * rows (the last may be shorter), each coded alone so that a read decodes only the blocks it
 * touches: a block's coding holds its fields one after another, rows in order, under four
 * coder states (row r of the block by state r % 4: the steps of a decode overlap). Blocks are
 * numbered (layer, head, block) in order and placed one after another. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bitfields.h"

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_LOW (1u << 16) /* a state lies in [2^16, 2^32): one word renormalises it */
#define TABLE 256 /* entries per stream's table (the widest field's symbols) */
#define STATES 4  /* interleaved coder states: row r is coded by state r % 4 */

/* Each field's place in a record of B bytes (its layer's widths; bitfields.h): 0, or -1 unless
 * the widths are 0..8 and cover the record's 8 B bits. */
static int fields_of(const int64_t *widths, int64_t F, int64_t B, BitField *fields) {
    int64_t at = 0;
    for (int64_t f = 0; f < F; f++) {
        if (widths[f] < 0 || widths[f] > 8) return -1; /* 0: a field that holds nothing */
        fields[f] = bitfield_at(at, widths[f], B);
        at += widths[f];
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
                        int64_t F, const int64_t *widths, int64_t *counts) {
    BitField fields[8 * 256];
    if (F > 8 * 256) return -1;
    memset(counts, 0, sizeof(int64_t) * (size_t)(L * H * F * TABLE));
    for (int64_t l = 0; l < L; l++) {
        if (fields_of(widths + l * F, F, B, fields)) return -1;
        for (int64_t h = 0; h < H; h++) {
            const uint8_t *block = records + (l * H + h) * S * B;
            for (int64_t f = 0; f < F; f++) {
                int64_t *count = counts + ((l * H + h) * F + f) * TABLE;
                if (widths[l * F + f] == 0) continue;
                for (int64_t r = 0; r < S; r++) count[bitfield_get(block + r * B, B, fields[f])]++;
            }
        }
    }
    return 0;
}

/* Encodes one block's n records (B bytes each, its layer's `fields` and widths) with its
 * (layer, head)'s tables freq (F, TABLE) and their cumulative frequencies cums (F, TABLE)
 * into out[0, cap), written from its end: returns the coded length g (the bytes are
 * out[cap - g, cap)), -1 when they do not fit in cap, -2 for a symbol its table gives no
 * probability. */
static int64_t encode_block(const uint8_t *rec, int64_t n, int64_t B, int64_t F,
                            const BitField *fields, const int64_t *widths, const uint16_t *freq,
                            const uint32_t *cums, uint8_t *out, int64_t cap) {
    uint8_t *p = out + cap;
    uint32_t xs[STATES];
    for (int k = 0; k < STATES; k++) xs[k] = RANS_LOW;
    for (int64_t f = F - 1; f >= 0; f--) {
        const uint16_t *fr = freq + f * TABLE;
        const uint32_t *cum = cums + f * TABLE;
        if (widths[f] == 0) continue;
        for (int64_t r = n - 1; r >= 0; r--) {
            uint32_t s = bitfield_get(rec + r * B, B, fields[f]);
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
    if (p - out < 4 * STATES) return -1;
    for (int k = STATES - 1; k >= 0; k--) /* read back: state 0 first, each high byte first */
        for (int i = 0; i < 4; i++) *--p = (uint8_t)(xs[k] >> (8 * i));
    return (int64_t)(out + cap - p);
}

/* Encodes every block of the records (L, H, S, B) alone, with tables freq (L * H * F, TABLE)
 * uint16 (a stream's entries past its 2^width unused), into out[0, cap) one after another;
 * lengths (L * H * ceil(S / rows)) each block's bytes. Returns the total, -1 when it does not
 * fit in cap (or a block would code to over twice its records), -2 for bad fields or a symbol
 * its table gives no probability, -3 when memory runs out. */
int64_t sekv_rans_encode_blocks(const uint8_t *records, int64_t L, int64_t H, int64_t S,
                                int64_t B, int64_t F, const int64_t *widths, const uint16_t *freq,
                                int64_t rows, uint8_t *out, int64_t cap, int64_t *lengths) {
    BitField fields[8 * 256];
    int64_t nb = (S + rows - 1) / rows, at = 0, scap = 2 * rows * B + 4 * STATES;
    if (rows < 1 || F > 8 * 256) return -2;
    uint32_t *cums = malloc(sizeof(uint32_t) * (size_t)(F * TABLE));
    uint8_t *scratch = malloc((size_t)scap);
    int64_t rc = 0;
    if (!cums || !scratch) rc = -3;
    for (int64_t lh = 0; lh < L * H && !rc; lh++) {
        int64_t l = lh / H;
        const uint16_t *fr = freq + lh * F * TABLE;
        if (fields_of(widths + l * F, F, B, fields)) rc = -2;
        for (int64_t f = 0; f < F && !rc; f++) /* each field's table cumulated once */
            if (widths[l * F + f] && cumulate(fr + f * TABLE, (int)widths[l * F + f],
                                              cums + f * TABLE, NULL))
                rc = -2;
        for (int64_t j = 0; j < nb && !rc; j++) {
            int64_t n = S - j * rows < rows ? S - j * rows : rows;
            int64_t got = encode_block(records + (lh * S + j * rows) * B, n, B, F, fields,
                                       widths + l * F, fr, cums, scratch, scap);
            if (got < 0 || at + got > cap) {
                rc = got < 0 ? got : -1;
                break;
            }
            memcpy(out + at, scratch + scap - got, (size_t)got);
            lengths[lh * nb + j] = got;
            at += got;
        }
    }
    free(cums);
    free(scratch);
    return rc ? rc : at;
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
        bitfield_put(rec + (row) * B, B, at, s);                                              \
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
        bitfield_put(rec + (row) * B, B, at, s);                                              \
    }

/* A block being decoded: its states, where its bytes are read, its rows (n of them). */
typedef struct {
    uint32_t x[STATES];
    const uint8_t *p, *end;
    uint8_t *rows;
    int64_t n;
} Block;

/* The block's next field (at `at`, table fr) decoded into its rows: 0, or -1 when its bytes
 * run out. Rows four at a time, one per state: the four steps overlap. */
static int decode_field(Block *k, int64_t B, const uint16_t *fr, const uint32_t *cum,
                        const uint8_t *symbol_of, BitField at) {
    const uint8_t *p = k->p, *end = k->end;
    uint8_t *rec = k->rows;
    uint32_t x0 = k->x[0], x1 = k->x[1], x2 = k->x[2], x3 = k->x[3];
    int64_t r = 0;
    for (; r + STATES <= k->n && end - p >= 2 * STATES; r += STATES) {
        DECODE_ROW(x0, r)
        DECODE_ROW(x1, r + 1)
        DECODE_ROW(x2, r + 2)
        DECODE_ROW(x3, r + 3)
    }
    for (; r < k->n; r++) { /* the last bytes, or the block's last rows */
        if (r % STATES == 0) DECODE_LAST(x0, r)
        else if (r % STATES == 1) DECODE_LAST(x1, r)
        else if (r % STATES == 2) DECODE_LAST(x2, r)
        else DECODE_LAST(x3, r)
    }
    k->x[0] = x0, k->x[1] = x1, k->x[2] = x2, k->x[3] = x3, k->p = p;
    return 0;
}

/* Decodes the m blocks `blocks` (ascending numbers) of a coding into their rows of records
 * (L, H, S, B), zeroed here; block b's bytes are coded[starts[b], starts[b + 1]). A (layer,
 * head)'s blocks are decoded field by field, each field's table built once. 0, or -1 when a
 * block's bytes are not such a coding (run out, left over, or a state the encoder does not end
 * in) or a number is out of order, -2 when memory runs out. */
int sekv_rans_decode_blocks(const uint8_t *coded, const int64_t *starts, int64_t L, int64_t H,
                            int64_t S, int64_t B, int64_t F, const int64_t *widths,
                            const uint16_t *freq, int64_t rows, const int64_t *blocks, int64_t m,
                            uint8_t *records) {
    BitField fields[8 * 256];
    uint32_t cum[TABLE];
    uint8_t symbol_of[PROB_SCALE];
    if (F > 8 * 256 || rows < 1) return -1;
    int64_t nb = (S + rows - 1) / rows, total = L * H * nb;
    Block *ks = malloc(sizeof(Block) * (size_t)(m > 0 ? m : 1));
    if (!ks) return -2;
    int rc = 0;
    for (int64_t g = 0, e = 0; g < m && !rc; g = e) {
        int64_t lh = blocks[g] / nb;
        for (e = g; e < m && blocks[e] / nb == lh; e++) {
            int64_t b = blocks[e], j = b % nb;
            Block *k = ks + e;
            if (b < 0 || b >= total || (e > 0 && b <= blocks[e - 1])) { rc = -1; break; }
            k->n = S - j * rows < rows ? S - j * rows : rows;
            k->rows = records + (lh * S + j * rows) * B;
            k->p = coded + starts[b];
            k->end = coded + starts[b + 1];
            if (k->end - k->p < 4 * STATES) { rc = -1; break; }
            for (int s = 0; s < STATES; s++) {
                k->x[s] = 0;
                for (int i = 0; i < 4; i++) k->x[s] = (k->x[s] << 8) | *k->p++;
            }
            memset(k->rows, 0, (size_t)(k->n * B));
        }
        int64_t l = lh / H;
        if (rc || fields_of(widths + l * F, F, B, fields)) { rc = -1; break; }
        for (int64_t f = 0; f < F && !rc; f++) {
            const uint16_t *fr = freq + (lh * F + f) * TABLE;
            int width = (int)widths[l * F + f];
            if (width == 0) continue;
            if (cumulate(fr, width, cum, symbol_of)) { rc = -1; break; }
            for (int64_t i = g; i < e && !rc; i++)
                rc = decode_field(ks + i, B, fr, cum, symbol_of, fields[f]);
        }
        for (int64_t i = g; i < e && !rc; i++) {
            Block *k = ks + i;
            if (k->p != k->end) rc = -1;
            for (int s = 0; s < STATES; s++)
                if (k->x[s] != RANS_LOW) rc = -1;
        }
    }
    free(ks);
    return rc;
}
