/* ABI version of the native kernels: ckpttool/engine/native.py refuses a stale build. */
#include <stdint.h>

int32_t ckpt_native_abi(void) { return 11; }
