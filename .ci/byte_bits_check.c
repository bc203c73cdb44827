/* The portable branch of fa_byte_bits (src_c/internal.h: 32 mask bytes to
 * bits by an 8-byte multiply), which CPUs other than x86-64 take and no x86-64
 * build compiles: built here with -DFA_PORTABLE_BYTE_BITS and checked against
 * the bit-by-bit rule (bit j = byte j != 0) on random rows and on every
 * single nonzero byte value in every position.  Exit status 1 on a mismatch.
 *   cc -O2 -DFA_PORTABLE_BYTE_BITS -Isrc_c .ci/byte_bits_check.c && ./a.out */
#include "internal.h"

#include <stdio.h>

#ifndef FA_PORTABLE_BYTE_BITS
#error "build with -DFA_PORTABLE_BYTE_BITS"
#endif

static uint32_t bit_by_bit(const uint8_t *row)
{
    uint32_t bits = 0;
    for (int j = 0; j < 32; j++) bits |= (uint32_t)(row[j] != 0) << j;
    return bits;
}

int main(void)
{
    uint64_t s = 88172645463325252ULL; /* xorshift64 */
    uint8_t row[32];
    long checked = 0, bad = 0;
    for (int t = 0; t < 200000; t++) {
        for (int j = 0; j < 32; j++) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            /* a quarter of the rows any bytes, the rest about half zeros */
            row[j] = (t % 4 == 0 || (s >> 40) & 1) ? (uint8_t)(s >> 8) : 0;
        }
        bad += fa_byte_bits(row, 1, 32) != bit_by_bit(row);
        checked++;
    }
    for (int pos = 0; pos < 32; pos++) {
        for (int value = 1; value < 256; value++) {
            memset(row, 0, sizeof row);
            row[pos] = (uint8_t)value;
            bad += fa_byte_bits(row, 1, 32) != (1u << pos);
            memset(row, 0xff, sizeof row);
            row[pos] = 0;
            bad += fa_byte_bits(row, 1, 32) != ~(1u << pos);
            checked += 2;
        }
    }
    printf("fa_byte_bits, portable branch: %ld rows checked, %ld wrong\n", checked, bad);
    return bad != 0;
}
