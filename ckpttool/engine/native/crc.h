/* CRC-32 of zip's convention with the folding kernel of crc.c (see there). */
#ifndef CKPT_CRC_H
#define CKPT_CRC_H

#include <stdint.h>

typedef uint32_t (*ckpt_crc_fn)(uint32_t crc, const unsigned char *buf, uint64_t len);

/* fn(crc, buf, len), computed 256 bits at a time where the CPU has VPCLMULQDQ (fn finishes the fold). */
uint32_t ckpt_crc32(ckpt_crc_fn fn, uint32_t crc, const uint8_t *buf, uint64_t len);

#endif
