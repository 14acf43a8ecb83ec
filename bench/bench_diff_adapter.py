"""Benchmark: ``ckpttool diff`` of a torchtitan-named checkpoint against its HF export (model adapter), in one run.

A torchtitan Llama 3 state dict (``tok_embeddings``, ``layers.N.attention.qkv_linear.wq`` ...,
GQA, random BF16 values; ``--gb`` sets its size) saved by one ``dcp.save``; its HF export by
``ckpttool export`` (the ``torchtitan-llama3`` adapter: q/k rows permuted per head). Measured,
each in a fresh process, warm page cache, peak RSS from GNU ``time``:

1. ``ckpttool diff CKPT HF`` (q/k assembled from the export plan's runs, the rest raw records);
2. the same files through ``cmp`` of the DCP data file with a byte copy of it plus ``cmp`` of the
   export with a copy (the read limit of reading both sides once);
3. the script users write: ``dcp.load`` of the whole checkpoint, ``safetensors.torch.load_file``
   of the export, the RoPE ``view/transpose`` permutation of ``wq``/``wk``, ``torch.equal`` per tensor.

The load average (``os.getloadavg``) is printed beside every figure: the machine is shared.

Usage: python bench/bench_diff_adapter.py [--gb 1] [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ckpttool.ops.export import ExportOptions

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_diff import load, run  # noqa: E402

PY = sys.executable
DIM, HEADS, KV, FFN, VOCAB = 2048, 16, 4, 5632, 32000

LOAD_AND_EQUAL = r"""
import json, sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from safetensors.torch import load_file
heads, kv, hd = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
md = FileSystemReader(sys.argv[1]).read_metadata()
sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
dcp.load(sd, storage_reader=FileSystemReader(sys.argv[1]), no_dist=True)
hf = load_file(sys.argv[2] + "/model.safetensors")
def perm(w, n):
    return w.view(n, hd // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
sub = {"attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
       "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
       "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
       "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
for k, v in sd.items():
    if k in names:
        h = names[k]
    else:
        _, n, rest = k.split(".", 2)
        mod = rest.rsplit(".", 1)[0]
        h = f"model.layers.{n}.{sub[mod]}.weight"
        if mod.endswith("wq"): v = perm(v, heads)
        if mod.endswith("wk"): v = perm(v, kv)
    assert torch.equal(v, hf[h]), k
"""


def build(workdir: Path, gb: float) -> tuple[Path, Path, Path]:
    import torch
    import torch.distributed.checkpoint as dcp

    per_layer = 2 * DIM * DIM + 2 * DIM * (DIM * KV // HEADS) + 3 * DIM * FFN + 2 * DIM
    layers = max(1, round((gb * 2**30 / 2 - 2 * VOCAB * DIM) / per_layer))
    src = workdir / f"titan-{gb:g}gb"
    assets = workdir / f"titan-{gb:g}gb-assets"
    hf = workdir / f"titan-{gb:g}gb-hf"
    if not (src / ".metadata").is_file():
        g = torch.Generator().manual_seed(0)
        hd = DIM // HEADS

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g).to(torch.bfloat16)

        sd = {"tok_embeddings.weight": w(VOCAB, DIM), "norm.weight": w(DIM), "output.weight": w(VOCAB, DIM)}
        for n in range(layers):
            p = f"layers.{n}."
            sd |= {
                p + "attention.qkv_linear.wq.weight": w(HEADS * hd, DIM),
                p + "attention.qkv_linear.wk.weight": w(KV * hd, DIM),
                p + "attention.qkv_linear.wv.weight": w(KV * hd, DIM),
                p + "attention.wo.weight": w(DIM, HEADS * hd),
                p + "feed_forward.w1.weight": w(FFN, DIM),
                p + "feed_forward.w3.weight": w(FFN, DIM),
                p + "feed_forward.w2.weight": w(DIM, FFN),
                p + "attention_norm.weight": w(DIM),
                p + "ffn_norm.weight": w(DIM),
            }
        tmp = src.with_name(src.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1), no_dist=True)
        os.rename(tmp, src)
    assets.mkdir(exist_ok=True)
    cfg = {
        "model_type": "llama",
        "hidden_size": DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "intermediate_size": FFN,
        "vocab_size": VOCAB,
        "num_hidden_layers": layers,
        "tie_word_embeddings": False,
    }
    (assets / "config.json").write_text(json.dumps(cfg))
    if not (hf / "model.safetensors").is_file():
        from ckpttool.ops.export.execute import export_checkpoint

        export_checkpoint(src, hf, ExportOptions(model_assets=assets, shard_size=1 << 40, overwrite=True))
    return src, hf, assets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src, hf, _ = build(args.workdir, args.gb)
    files = sorted(src.glob("*.distcp")) + [hf / "model.safetensors"]
    copies = []
    for f in files:
        c = args.workdir / (f.parent.name + "-" + f.name + ".copy")
        if not c.is_file():
            shutil.copyfile(f, c)
        copies.append(c)
    dcp_bytes = sum(f.stat().st_size for f in files[:-1])
    both = dcp_bytes + files[-1].stat().st_size
    for f in [*files, *copies]:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    hd = DIM // HEADS
    ck = shutil.which("ckpttool") or "ckpttool"
    print(
        f"checkpoint {src} ({dcp_bytes / 2**30:.2f} GiB) + export {hf} ({(both - dcp_bytes) / 2**30:.2f} GiB), {load()}"
    )
    rows = []
    cmp_s = 0.0
    for f, c in zip(files[:-1], copies):
        s, _ = run(["cmp", str(f), str(c)])
        cmp_s += s
    rows.append(("cmp of the DCP data file(s) with a copy", cmp_s, 0, 2 * dcp_bytes))
    s, rss = run([ck, "diff", str(src), str(hf)])
    rows.append(("ckpttool diff CKPT HF (adapter)", s, rss, both))
    s, rss = run([PY, "-c", LOAD_AND_EQUAL, str(src), str(hf), str(HEADS), str(KV), str(hd)])
    rows.append(("dcp.load + load_file + permute + torch.equal", s, rss, both))
    print("(GB/s: bytes read, both sides together, per second)")
    for name, sec, peak, nb in rows:
        print(f"{name:48s} {sec:7.2f} s  {nb / sec / 1e9:6.2f} GB/s  peak RSS {peak / 2**20:7.0f} MiB  ({load()})")


if __name__ == "__main__":
    main()
