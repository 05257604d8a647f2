/* The bit layout of sekv's packed codes, as sekv_core/bitpack.py writes it down: a record's
 * codes one after another from its lowest bit, code j of w_j bits (0..8) at bit s_j = w_0 + ..
 * + w_{j-1}, lowest bit first, bit b in byte b / 8 at b % 8. A code lies in at most two
 * adjacent bytes, so it is read from the 16-bit window (little-endian) of those bytes. Shared
 * by zoomstep.c (the offload codes' decoders) and rans.c (the entropy coder's fields). */
#ifndef SEKV_BITFIELDS_H
#define SEKV_BITFIELDS_H
#include <stdint.h>

/* Where a code lies in a record of B bytes: the first byte of its window (the record's last two
 * bytes for a code in its last byte; byte 0 of a one-byte record), its first bit in the window
 * and its mask. */
typedef struct {
    int64_t byte;
    uint32_t shift, mask;
} BitField;

static inline BitField bitfield_at(int64_t start, int64_t width, int64_t B) {
    BitField f;
    int64_t last = B >= 2 ? B - 2 : 0;
    f.byte = start / 8 < last ? start / 8 : last;
    f.shift = (uint32_t)(start - 8 * f.byte);
    f.mask = (1u << width) - 1u;
    return f;
}

/* the code at f of the record rec (B bytes) */
static inline uint32_t bitfield_get(const uint8_t *rec, int64_t B, BitField f) {
    uint32_t window = rec[f.byte] | (B >= 2 ? (uint32_t)rec[f.byte + 1] << 8 : 0u);
    return (window >> f.shift) & f.mask;
}

/* code (below 2^width) or-ed in at f of the record rec (B bytes; its bits there still 0) */
static inline void bitfield_put(uint8_t *rec, int64_t B, BitField f, uint32_t code) {
    uint32_t placed = code << f.shift;
    rec[f.byte] |= (uint8_t)(placed & 255u);
    if (B >= 2) rec[f.byte + 1] |= (uint8_t)(placed >> 8);
}

#endif
