"""A one-pass C AdamW step (bench only): the bound of a kernel that writes the parameter in the master's pass.

``bench_optim.py --onepass-bound`` compiles this with the system C compiler (``cc -O3
-march=native``) into a temporary directory and times it beside torch's ``_fused_adamw_`` on
the same tensors. It is not ckpttool's kernel and not bitwise equal to torch's (the op order
differs); it measures what a compiled single pass moves and costs: FP32 master, gradient and
moments read and written once, the parameter written once (FP32 or rounded to BF16, nearest
even), nothing re-read from a chunk buffer. ckpttool's own one-pass kernel
(``ckpttool/engine/native/adamw.c``) keeps torch's arithmetic (two divisions and a square root per
element) so that its bits are torch's; this one trades a division for a multiplication.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
static inline uint16_t f2bf(float f){uint32_t u;memcpy(&u,&f,4);u+=0x7fffu+((u>>16)&1u);return (uint16_t)(u>>16);}
static inline float bf2f(uint16_t h){uint32_t u=((uint32_t)h)<<16;float f;memcpy(&f,&u,4);return f;}
#define BODY(LOADG, STOREP) \
  float dec=1.f-lr*wd,ob1=1.f-b1,ob2=1.f-b2,ibc=1.f/bc2; \
  for(long i=0;i<n;i++){float gi=LOADG;float mi=m[i]+ob1*(gi-m[i]);float vi=v[i]*b2+ob2*gi*gi; \
    float wi=w[i]*dec+ss*mi/(sqrtf(vi)*ibc+eps);m[i]=mi;v[i]=vi;w[i]=wi;STOREP;}
void step_f32(float*restrict w,const float*restrict g,float*restrict m,float*restrict v,float*restrict p,long n,
  float lr,float b1,float b2,float eps,float wd,float ss,float bc2){BODY(g[i], p[i]=wi)}
void step_bf16(float*restrict w,const uint16_t*restrict g,float*restrict m,float*restrict v,uint16_t*restrict p,long n,
  float lr,float b1,float b2,float eps,float wd,float ss,float bc2){BODY(bf2f(g[i]), p[i]=f2bf(wi))}
"""


def build() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when no C compiler is on ``PATH``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="ckpttool-onepass-"))
    (out / "k.c").write_text(SOURCE)
    subprocess.run(
        [cc, "-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", str(out / "k.c"), "-o", str(out / "k.so")],
        check=True,
    )
    return ctypes.CDLL(str(out / "k.so"))


def onepass_optimizer(lib: ctypes.CDLL, params: list[torch.Tensor], hyper: dict) -> Callable[[], None]:
    """A ``step()`` over ``params`` (float32 or bfloat16, with ``.grad``) with FP32 master and moments."""
    masters = [p.detach().float().clone() for p in params]
    ms = [torch.zeros_like(w) for w in masters]
    vs = [torch.zeros_like(w) for w in masters]
    lr, (b1, b2), eps, wd = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    state = {"step": 0}
    f = ctypes.c_float

    def step() -> None:
        state["step"] += 1
        s = state["step"]
        consts = [f(lr), f(b1), f(b2), f(eps), f(wd), f(-lr / (1 - b1**s)), f((1 - b2**s) ** 0.5)]
        for p, w, m, v in zip(params, masters, ms, vs):
            fn = lib.step_f32 if p.dtype == torch.float32 else lib.step_bf16
            ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (w, p.grad, m, v, p)]
            fn(*ptrs, ctypes.c_long(w.numel()), *consts)

    return step
