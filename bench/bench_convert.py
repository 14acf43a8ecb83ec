"""Benchmark conversions: export through a model adapter (RoPE q/k permutation) and `ckpttool import`.

One run prints, side by side (warm page cache, each approach in its own process, wall seconds
including interpreter start-up and imports, peak RSS from GNU ``/usr/bin/time -f %M``):

- ``export, plain``: an HF-named (torch-native ``model.``) BF16 Llama-style checkpoint (vocab
  32000, hidden 2048, 16 heads / 8 KV heads, head_dim 128, MLP 5632, ``--layers`` layers),
  ``ckpttool export CKPT OUT --model-assets CFG`` (verbatim chunk copies);
- ``export, adapter``: the same tensors under torchtitan 0.3 names (``tok_embeddings``,
  ``layers.N.attention.qkv_linear.wq`` ...), detected ``torchtitan-llama3`` adapter: ``wq`` /
  ``wk`` written through the RoPE row permutation (whole heads per slab, one gather each), the rest verbatim;
- ``cp -r`` of the export's output (the same bytes, copied by the kernel);
- ``import``: ``ckpttool import HF OUT`` of the plain export's output, beside ``cp -r`` of that
  HF directory and of ``cp -r`` + ``sync`` of the copied files, ``import --world-size 4`` (4 files,
  dim-0 chunks) and ``import --no-fsync`` (``cp`` does not ``fsync``; the import does by default).

The exports with ``model_type`` in the config check the plan against ``LlamaForCausalLM`` built on
the meta device: "cache cold" with ``CKPTTOOL_NO_CACHE=1`` (torch + transformers imported and the
model built each time), "cache hit" with the model-shape cache entry of an earlier run (neither
imported); "no class check" with a config without ``model_type``. Targets: the adapter export within 2x the plain export's time;
import >= 50% of ``cp -r``'s throughput; peak RSS <= shard + largest tensor + 512 MiB.
GB/s = bytes written / seconds (10^9).

Usage::

    python bench/bench_convert.py [--root /tmp/ckpttool-bench-convert] [--layers 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_export import _output_bytes, _run, _warm

VOCAB, HIDDEN, HEADS, KV, HEAD_DIM, INTER = 32000, 2048, 16, 8, 128, 5632


def _config(layers: int) -> dict[str, object]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _build(root: Path, layers: int) -> tuple[Path, Path, Path]:
    import torch
    import torch.distributed.checkpoint as dcp

    plain, titan, cfg = root / f"plain-{layers}", root / f"titan-{layers}", root / "config"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "config.json").write_text(json.dumps(_config(layers)))
    nocheck = root / "config-no-model-type"  # the head counts only: no model-class check
    nocheck.mkdir(exist_ok=True)
    (nocheck / "config.json").write_text(json.dumps({k: v for k, v in _config(layers).items() if k != "model_type"}))
    if plain.is_dir() and titan.is_dir():
        return plain, titan, cfg
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t(VOCAB, HIDDEN)}
    tt: dict[str, torch.Tensor] = {"tok_embeddings.weight": hf["model.embed_tokens.weight"]}
    for n in range(layers):
        p, q = f"model.layers.{n}.", f"layers.{n}."
        for a, b, shape in (
            ("self_attn.q_proj", "attention.qkv_linear.wq", (HEADS * HEAD_DIM, HIDDEN)),
            ("self_attn.k_proj", "attention.qkv_linear.wk", (KV * HEAD_DIM, HIDDEN)),
            ("self_attn.v_proj", "attention.qkv_linear.wv", (KV * HEAD_DIM, HIDDEN)),
            ("self_attn.o_proj", "attention.wo", (HIDDEN, HEADS * HEAD_DIM)),
            ("mlp.gate_proj", "feed_forward.w1", (INTER, HIDDEN)),
            ("mlp.up_proj", "feed_forward.w3", (INTER, HIDDEN)),
            ("mlp.down_proj", "feed_forward.w2", (HIDDEN, INTER)),
            ("input_layernorm", "attention_norm", (HIDDEN,)),
            ("post_attention_layernorm", "ffn_norm", (HIDDEN,)),
        ):
            hf[p + a + ".weight"] = tt[q + b + ".weight"] = t(*shape)
    hf["model.norm.weight"] = tt["norm.weight"] = t(HIDDEN)
    hf["lm_head.weight"] = tt["lm_head.weight"] = t(VOCAB, HIDDEN)
    dcp.save({"model": hf}, checkpoint_id=str(plain))  # keys model.<hf key>, as dcp.save of model.state_dict()
    dcp.save(tt, checkpoint_id=str(titan))
    return plain, titan, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/ckpttool-bench-convert"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    plain, titan, cfg = _build(args.root, args.layers)
    cli = [sys.executable, "-m", "ckpttool"]
    rows: list[tuple[str, float, int, int, str]] = []

    def best(cmd: list[str], out: Path, src: Path) -> tuple[float, int]:
        res = []
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            _warm(src)
            s, rss, _ = _run(cmd)
            res.append((s, rss))
        return min(res)

    outs = args.root / "out"
    outs.mkdir(exist_ok=True)
    nocheck = args.root / "config-no-model-type"
    cold = ["env", "CKPTTOOL_NO_CACHE=1"]  # the model-class check without its cache: torch + transformers imported
    times: dict[str, float] = {}
    warm = outs / "warm-up"  # writes the model-shape cache entry the "cache hit" rows read
    shutil.rmtree(warm, ignore_errors=True)
    _run([*cli, "export", str(plain), str(warm), "--model-assets", str(cfg), "--shard-size", "1GB"])
    shutil.rmtree(warm, ignore_errors=True)
    for case, src, assets, env in (
        ("export, plain, class check, cache cold", plain, cfg, cold),
        ("export, adapter, class check, cache cold", titan, cfg, cold),
        ("export, plain, class check, cache hit", plain, cfg, []),
        ("export, adapter, class check, cache hit", titan, cfg, []),
        ("export, plain, no class check", plain, nocheck, []),
        ("export, adapter, no class check", titan, nocheck, []),
    ):
        out = outs / case.replace(",", "").replace(" ", "-")
        s, rss = best(
            [*env, *cli, "export", str(src), str(out), "--model-assets", str(assets), "--shard-size", "1GB"], out, src
        )
        nbytes = _output_bytes(out)
        rows.append((case, s, rss, nbytes, ""))
        times[case] = s
        if "plain" in case:
            c, crss = best(["cp", "-r", str(out), str(out) + ".cp"], Path(str(out) + ".cp"), out)
            rows.append(("  cp -r of its output", c, crss, nbytes, ""))
    hf = outs / "export-plain-class-check-cache-hit"
    for ws, extra in ((1, []), (4, []), (1, ["--no-fsync"]), (4, ["--no-fsync"])):
        out = outs / f"imported-{ws}{''.join(extra)}"
        s, rss = best([*cli, "import", str(hf), str(out), "--world-size", str(ws), *extra], out, hf)
        case = f"import --world-size {ws} {' '.join(extra)}".rstrip()
        rows.append((case, s, rss, _output_bytes(out), ""))
        times[case] = s
    cs, _ = best(["sh", "-c", f"cp -r {hf} {outs / 'hf.cps'} && sync {outs / 'hf.cps'}/*"], outs / "hf.cps", hf)
    rows.append(("  cp -r + sync (fsync) of its files", cs, 0, _output_bytes(hf), ""))
    c, crss = best(["cp", "-r", str(hf), str(outs / "hf.cp")], outs / "hf.cp", hf)
    rows.append(("  cp -r of the HF directory", c, crss, _output_bytes(hf), ""))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs; {args.layers} layers")
    print(f"{'case':42s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>10s}")
    for case, s, rss, nb, note in rows:
        print(f"{case:42s} {s:8.2f} {nb / s / 1e9:7.3f} {rss / 2**20:8.0f} MiB {note}")
    for what in ("class check, cache cold", "class check, cache hit", "no class check"):
        a, p = times[f"export, adapter, {what}"], times[f"export, plain, {what}"]
        print(f"adapter / plain export time, {what}: {a / p:.2f}x (target <= 2x)")
    for case in ("import --world-size 1", "import --world-size 1 --no-fsync", "import --world-size 4 --no-fsync"):
        print(
            f"{case}: {c / times[case]:.0%} of cp -r throughput (target >= 50%), {cs / times[case]:.0%} of cp -r + sync"
        )
    largest = HIDDEN * VOCAB * 2
    budget = _output_bytes(hf) + largest + (512 << 20)
    print(
        f"peak RSS budget (shard {_output_bytes(hf) / 2**20:.0f} MiB + largest tensor {largest / 2**20:.0f} MiB"
        f" + 512 MiB): {budget / 2**20:.0f} MiB; highest measured {max(r[2] for r in rows) / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
