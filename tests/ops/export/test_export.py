"""`ckpttool export` on real DCP checkpoints: round trips, dtypes, masters, experts, sharding, rules, failures.

Consumers (transformers / PEFT loading the export) are in ``test_export_consumers.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointReader
from ckpttool.format.safetensors import is_narrowing
from ckpttool.model.checkpoint import Checkpoint
from ckpttool.ops.export import ExportOptions, export_checkpoint
from ckpttool.ops.export.plan import shard_file_names
from ckpttool.ui.options import parse_size
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build, copy_checkpoint
from tests.fixtures.special_files import SPECIAL_KINDS, fails_instead_of_hanging, make_special

runner = CliRunner()


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def master_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_master", hf_models.build_master)


@pytest.fixture(scope="session")
def mixed_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_mixed", hf_models.build_mixed_dtypes)


@pytest.fixture(scope="session")
def large_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_large", hf_models.build_large)


# ------------------------------------------------------------------------------------------ helpers


def torch_load(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint as torch's own ``dcp.load`` reads them (the independent reference)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size") and (keys is None or k in keys)
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def hf_key(key: str) -> str:
    """The default rules' output key of a model checkpoint key (``model.model.x`` -> ``model.x``, ...)."""
    assert key.startswith("model.")
    return key[len("model.") :]


def read_export(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors of an HF export (via its index) and the index itself; checks file metadata."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), "pt") as f:
            meta = f.metadata()
            assert set(meta) == {"format", "ckpttool.source"} and meta["format"] == "pt"
            assert set(json.loads(meta["ckpttool.source"])) == {
                "algorithm",
                "metadata_digest",
                "metadata_size",
                "manifest_digest",
            }
            for k in f.keys():
                assert index["weight_map"][k] == name
                tensors[k] = f.get_tensor(k)
    assert set(tensors) == set(index["weight_map"]), "index must list exactly the keys written"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def export_cli(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["export", *args])


def assert_clean_failure(res, code: str, *needles: str) -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith(f"error: [{code}]"), res.stderr
    assert lines[-1].startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[-2], (n, lines[-2])


def no_leftovers(parent: Path, name: str) -> None:
    stray = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.ckpttool-")]
    assert not stray, stray


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("algorithm", [None, "blake2b-256"])
def test_source_identity_is_the_digest_of_the_metadata_file(
    dense_ckpt: Path, tmp_path: Path, algorithm: str | None
) -> None:
    """Every output file names its source by the digest of ``.metadata`` (xxhash / hashlib, independently).

    With the default algorithm the digest is the one taken as ``.metadata`` was read at open:
    export opens that file once.
    """
    import hashlib

    import xxhash

    from tests.fixtures.opens import run_cli_recording_opens

    out = tmp_path / "hf"
    argv = ["export", str(dense_ckpt), str(out), *(["--hash", algorithm] if algorithm else [])]
    res = run_cli_recording_opens(argv, tmp_path / "opens.log")
    assert res.returncode == 0, res.stderr
    data = (dense_ckpt / ".metadata").read_bytes()
    if algorithm is None:
        want = {"algorithm": "xxh3-128", "metadata_digest": xxhash.xxh3_128(data).hexdigest()}
        assert res.count(dense_ckpt / ".metadata") == 1, res.under(dense_ckpt)
    else:
        want = {"algorithm": algorithm, "metadata_digest": hashlib.blake2b(data, digest_size=32).hexdigest()}
    want["metadata_size"] = len(data)
    want["manifest_digest"] = None
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            assert json.loads(st.metadata()["ckpttool.source"]) == want, f.name


def test_source_identity_with_another_hash_refuses_a_metadata_changed_since_open(
    dense_ckpt: Path, tmp_path: Path
) -> None:
    """``--hash blake2b-256`` reads ``.metadata`` again: bytes other than those parsed are not named as the source."""
    import shutil

    from ckpttool.errors import DataFileError
    from ckpttool.format.directory import CheckpointDir
    from ckpttool.ops.manifest import source_identity

    ck = Path(shutil.copytree(dense_ckpt, tmp_path / "ck"))
    reader = CheckpointDir(ck)
    try:
        assert source_identity(reader, "blake2b-256")["metadata_size"] == (ck / ".metadata").stat().st_size
        with open(ck / ".metadata", "ab") as f:
            f.write(b"\0")  # another save's .metadata, written after this one was parsed
        with pytest.raises(DataFileError, match="changed since it was read at open"):
            source_identity(reader, "blake2b-256")
    finally:
        reader.close()


@pytest.mark.parametrize("name", ["dense_ckpt", "multi_optim_ckpt", "fsdp_ckpt", "sample_ckpt"])
def test_preserve_round_trip_is_bitwise(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(name)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    out = tmp_path / "hf"
    res = export_cli(str(src), str(out), "--json")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert "error" not in res.stderr
    ref = torch_load(src)
    model_keys = [k for k in ref if k.startswith("model.")]
    got, index = read_export(out)
    assert set(got) == {hf_key(k) for k in model_keys}
    for k in model_keys:
        assert bitwise_equal(got[hf_key(k)], ref[k]), k
    assert not any(k.startswith("optimizer") for k in got), "non-model keys are never exported"
    assert summary["tensors"] == len(model_keys) and summary["casts"] == {}
    assert summary["bytes_read"] == summary["bytes"]  # preserve: every stored byte read exactly once
    assert summary["bytes"] == index["metadata"]["total_size"]
    assert (out / "model.safetensors").is_file() and summary["files"][0]["name"] == "model.safetensors"
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before, "the source is never touched"
    no_leftovers(tmp_path, "hf")


def test_fsdp_chunks_are_each_read_once(fsdp_ckpt: Path, tmp_path: Path) -> None:
    class CountingReader(CheckpointReader):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.calls: dict[tuple[str, tuple[int, ...]], int] = {}

        def _count(self, fqn: str, chunk: Any) -> None:
            key = (fqn, chunk.offsets)
            self.calls[key] = self.calls.get(key, 0) + 1

        def read_chunk(self, fqn, chunk, out=None):  # type: ignore[no-untyped-def]
            self._count(fqn, chunk)
            return super().read_chunk(fqn, chunk, out=out)

        def copy_chunk_to_file(self, fqn, chunk, out_fd, out_offset, **kw):  # type: ignore[no-untyped-def]
            done = super().copy_chunk_to_file(fqn, chunk, out_fd, out_offset, **kw)
            if done:  # False: nothing read, the caller falls back to read_chunk
                self._count(fqn, chunk)
            return done

        def read_small_chunks(self, items, **kw):  # type: ignore[no-untyped-def]
            got = super().read_small_chunks(items, **kw)
            for (fqn, chunk), r in zip(items, got):
                if r is not None:  # None: not read here, the caller copies it one by one
                    self._count(fqn, chunk)
            return got

    reader = CountingReader(fsdp_ckpt)
    with Checkpoint(reader) as ckpt:
        export_checkpoint(ckpt, tmp_path / "o", ExportOptions(workers=3))
        export_checkpoint(ckpt, tmp_path / "o32", ExportOptions(workers=3, save_dtype="float32"))
    expected = {
        (k, c.offsets)
        for k, m in reader.metadata.entries.items()
        if k.startswith("model.") and hasattr(m, "chunks")
        for c in m.chunks
        if c.numel > 0
    }
    assert set(reader.calls) == expected
    assert set(reader.calls.values()) == {2}  # once per export: the direct (torch-free) and the cast path
    # the fixture does have uneven and zero-size chunks from several ranks
    odd = reader.metadata.entries["model.model.layers.0.odd"]
    assert any(c.numel == 0 for c in odd.chunks) and len({c.sizes for c in odd.chunks}) > 1


def test_sharded_output_and_index(dense_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = export_cli(str(dense_ckpt), str(out), "--shard-size", "4KiB", "--json")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    got, index = read_export(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == shard_file_names(n)
    assert not (out / "model.safetensors").exists()
    for f in summary["files"]:
        data = f["bytes"] - 8 - int.from_bytes((out / f["name"]).read_bytes()[:8], "little")
        assert data <= 4096 or f["tensors"] == 1, f
    ref = torch_load(dense_ckpt)
    for k, t in ref.items():
        if k.startswith("model."):
            assert bitwise_equal(got[hf_key(k)], t), k


# ------------------------------------------------------------------------------------------ dtypes


def test_cast_applies_to_floating_tensors_only_and_reports_narrowing(mixed_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    res = export_cli(str(mixed_ckpt), str(out), "--save-dtype", "bfloat16", "--json")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    ref = torch_load(mixed_ckpt)
    got, _ = read_export(out)
    for k, t in ref.items():
        g = got[hf_key(k)]
        if t.is_floating_point():
            assert g.dtype == torch.bfloat16 and torch.equal(g, t.to(torch.bfloat16)), k
        else:
            assert bitwise_equal(g, t), k  # int64 / bool untouched
    assert summary["casts"] == {"float32->bfloat16": 4}
    assert summary["narrowing_casts"] == {"float32->bfloat16": 4}
    # the key outside the HF schema is exported with a warning on stderr
    assert "extra_head.weight" in got
    assert "warning:" in res.stderr and "model.extra_head.weight -> extra_head.weight" in res.stderr

    res = export_cli(str(mixed_ckpt), str(tmp_path / "f32"), "--save-dtype", "float32")
    assert res.exit_code == 0, res.stderr
    assert "bfloat16->float32 x1" in res.stdout and "narrowing" not in res.stdout


def test_is_narrowing_table() -> None:
    assert is_narrowing("float32", "bfloat16") and is_narrowing("float32", "float16")
    assert is_narrowing("bfloat16", "float16") and is_narrowing("float16", "bfloat16")
    assert not is_narrowing("bfloat16", "float32") and not is_narrowing("float16", "float32")
    assert not is_narrowing("float32", "float32")


@pytest.mark.parametrize(
    "text,value",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("4096", 4096),
        ("1.5gb", 1_500_000_000),
        ("2G", 2 * 2**30),
        ("512M", 512 * 2**20),
        (" 8 kib ", 8192),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text, "--shard-size") == value


def test_bad_shard_size_is_a_usage_error(dense_ckpt: Path, tmp_path: Path) -> None:
    assert_clean_failure(export_cli(str(dense_ckpt), str(tmp_path / "o"), "--shard-size", "lots"), "E100", "lots")


# ------------------------------------------------------------------------------------------ master weights


def test_weights_master_exports_fp32_masters(master_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "master"
    res = export_cli(str(master_ckpt), str(out), "--weights", "master", "--json")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    ref = torch_load(master_ckpt)
    got, _ = read_export(out)
    n_master = 0
    for k in (k for k in ref if k.startswith("model.")):
        mkey = f"optimizer.state.{k[len('model.') :]}.master_weight"
        g = got[hf_key(k)]
        if mkey in ref:
            n_master += 1
            assert g.dtype == torch.float32 and bitwise_equal(g, ref[mkey]), k
            assert ref[k].dtype == torch.bfloat16 and torch.equal(ref[mkey].to(torch.bfloat16), ref[k])
        else:
            assert bitwise_equal(g, ref[k]), k  # no master: the stored parameter
    assert n_master > 10
    # the masters carry precision the BF16 parameters do not
    differs = [
        k
        for k in ref
        if k.startswith("model.")
        and f"optimizer.state.{k[6:]}.master_weight" in ref
        and not torch.equal(got[hf_key(k)], ref[k].float())
    ]
    assert len(differs) == n_master
    assert summary["origins"]["master"]["count"] == n_master
    assert summary["origins"]["params"]["keys"] == ["model.norm.weight"]

    human = export_cli(str(master_ckpt), str(tmp_path / "h"), "--weights", "master")
    assert (
        f"{n_master} from FP32 master_weight, 1 from stored parameters (no master): model.norm.weight" in human.stdout
    )


def _save_nested(flat: dict[str, torch.Tensor], out: Path) -> Path:
    """``dcp.save`` of ``{"model": {fqn: t}, "optimizer": {"state": {fqn: {field: t}}}}`` from torch_load's flat keys."""
    model = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith("optimizer.state."):
            fqn, _, field = k[len("optimizer.state.") :].rpartition(".")
            state.setdefault(fqn, {})[field] = v
    dcp.save({"model": model, "optimizer": {"state": state}}, checkpoint_id=str(out), no_dist=True)
    return out


@pytest.mark.parametrize("master_under", ["model.embed_tokens.weight", "lm_head.weight"])
def test_weights_master_of_tied_embeddings_writes_the_one_master(
    fixture_root: Path, tmp_path: Path, master_under: str
) -> None:
    """A tied parameter has one master, kept under one of its two fqns (get_state_dict: the embedding's): the
    embedding is written from it and the lm_head left out, not refused as 'lm_head differs from the master'
    (which made --weights master, and --quantize's default auto, fail on every tied model with masters)."""
    built = cached_build(fixture_root, "export_master_tied", hf_models.build_master_tied)
    assets = built / "model_assets"
    flat = torch_load(built)
    if master_under != "model.embed_tokens.weight":  # the same state, the master keyed by the lm_head's fqn
        flat = {
            k.replace("optimizer.state.model.embed_tokens.weight", f"optimizer.state.{master_under}"): v
            for k, v in flat.items()
        }
    src = _save_nested(flat, tmp_path / "ck")
    master = flat[f"optimizer.state.{master_under}.master_weight"]
    assert torch.equal(flat["model.lm_head.weight"], flat["model.model.embed_tokens.weight"])
    assert not torch.equal(master, flat["model.model.embed_tokens.weight"].float())  # the master is the finer one
    for args in (["--weights", "master"], ["--weights", "master", "--save-dtype", "bf16"]):
        out = tmp_path / f"out{len(args)}"
        res = export_cli(str(src), str(out), *args, "--model-assets", str(assets), "--json")
        assert res.exit_code == 0, res.stderr
        got, _ = read_export(out)
        assert "lm_head.weight" not in got and json.loads(res.stdout)["tied_embeddings"] == "omitted"
        want = master if len(args) == 2 else master.to(torch.bfloat16)
        assert bitwise_equal(got["model.embed_tokens.weight"], want)
    # a tied pair whose stored parameters differ is still refused, masters or not
    flat["model.lm_head.weight"] = flat["model.lm_head.weight"].clone()
    flat["model.lm_head.weight"][0, 0] += 1
    bad = _save_nested(flat, tmp_path / "bad")
    res = export_cli(str(bad), str(tmp_path / "refused"), "--weights", "master", "--model-assets", str(assets))
    assert_clean_failure(res, "E601", "model.lm_head.weight differs from model.model.embed_tokens.weight")
    assert not (tmp_path / "refused").exists()


def test_weights_master_without_masters_is_an_error(dense_ckpt: Path, tmp_path: Path) -> None:
    res = export_cli(str(dense_ckpt), str(tmp_path / "o"), "--weights", "master")
    assert_clean_failure(res, "E601", "master_weight")
    assert not (tmp_path / "o").exists()


def test_weights_master_with_a_filter_that_selects_no_master_says_so(fixture_root: Path, tmp_path: Path) -> None:
    """A checkpoint with FP32 masters, --filter selecting only tensors without one (the frozen norm; the tied
    lm_head, whose master is kept under the embedding's fqn): the error said the checkpoint keeps no masters
    ('e.g. torch AdamW'); it now names the filter and what it selected."""
    built = cached_build(fixture_root, "export_master_tied", hf_models.build_master_tied)
    for glob, key in (("lm_head*", "model.lm_head.weight"), ("model.norm*", "model.model.norm.weight")):
        res = export_cli(str(built), str(tmp_path / "o"), "--weights", "master", "--filter", glob)
        assert_clean_failure(res, "E601", f"none of the 1 tensor(s) --filter '{glob}' selects", key)
        assert "torch AdamW" not in res.stderr and "--weights params" in res.stderr
        assert not (tmp_path / "o").exists()
    no_leftovers(tmp_path, "o")


def test_weights_master_with_a_filter_that_matches_nothing_names_the_filter(fixture_root: Path, tmp_path: Path) -> None:
    """--weights master with a --filter that selects no tensor at all (the glob 'layers.0.*', which misses the HF
    names model.layers.0.*): the error said the checkpoint's optimizer keeps no FP32 masters ('e.g. torch AdamW'),
    though it keeps one for every trained parameter; it is now the "matched none" error of the filter."""
    built = cached_build(fixture_root, "export_master_tied", hf_models.build_master_tied)
    res = export_cli(str(built), str(tmp_path / "o"), "--weights", "master", "--filter", "layers.0.*")
    assert_clean_failure(res, "E601", "--filter 'layers.0.*' matched none")
    assert "torch AdamW" not in res.stderr and "master_weight" not in res.stderr
    assert not (tmp_path / "o").exists()
    res = export_cli(str(built), str(tmp_path / "o"), "--weights", "master", "--filter", "model.layers.0.*")
    assert res.exit_code == 0, res.stderr  # the glob with the HF prefix selects the layer, every tensor from its master


# ------------------------------------------------------------------------------------------ experts


def test_per_expert_split_matches_hand_built_layout(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "pe"
    res = export_cli(
        str(sample_ckpt),
        str(out),
        "--experts",
        "per-expert",
        "--model-assets",
        str(sample_ckpt / "model_assets"),
        "--json",
    )
    assert res.exit_code == 0, res.stderr
    cfg = json.loads((sample_ckpt / "model_assets" / "config.json").read_text())
    e, i, h = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    ref = torch_load(sample_ckpt)
    got, _ = read_export(out)
    expected: dict[str, torch.Tensor] = {}
    for k, t in ref.items():
        if not k.startswith("model."):
            continue
        if k.endswith(".experts.gate_up_proj"):
            assert t.shape == (e, 2 * i, h)
            base = hf_key(k)[: -len(".gate_up_proj")]
            for j in range(e):
                expected[f"{base}.{j}.gate_proj.weight"] = t[j, :i, :]
                expected[f"{base}.{j}.up_proj.weight"] = t[j, i:, :]
        elif k.endswith(".experts.down_proj"):
            assert t.shape == (e, h, i)
            base = hf_key(k)[: -len(".down_proj")]
            for j in range(e):
                expected[f"{base}.{j}.down_proj.weight"] = t[j]
        else:
            expected[hf_key(k)] = t
    assert set(got) == set(expected)
    for k, t in expected.items():
        assert bitwise_equal(got[k], t.contiguous()), k
    assert got["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (i, h)
    assert got["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (h, i)


def test_expert_count_must_match_model_config(sample_ckpt: Path, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    cfg = json.loads((sample_ckpt / "model_assets" / "config.json").read_text())
    cfg["n_routed_experts"] = cfg["n_routed_experts"] * 2
    (assets / "config.json").write_text(json.dumps(cfg))
    for mode in ("per-expert", "fused"):
        res = export_cli(str(sample_ckpt), str(tmp_path / "o"), "--experts", mode, "--model-assets", str(assets))
        assert_clean_failure(res, "E601", "experts.gate_up_proj", "num_experts")
    assert not (tmp_path / "o").exists()


def test_zero_expert_tensor_per_expert_is_refused_fused_exports_it(tmp_path: Path) -> None:
    # an [0, A, B] experts tensor has nothing to write per expert: a refusal naming it, never a traceback
    ck = tmp_path / "ck"
    sd = {
        "model": {
            "model.embed_tokens.weight": torch.ones(8, 4),
            "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(0, 8, 4),
            "model.layers.0.mlp.experts.down_proj": torch.zeros(0, 4, 4),
        }
    }
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    res = export_cli(str(ck), str(tmp_path / "o"), "--experts", "per-expert")
    assert_clean_failure(res, "E601", "experts.gate_up_proj", "0 experts")
    assert "--experts fused" in res.stderr
    assert not (tmp_path / "o").exists()
    no_leftovers(tmp_path, "o")
    res = export_cli(str(ck), str(tmp_path / "f"), "--experts", "fused")
    assert res.exit_code == 0, res.stderr
    got, _ = read_export(tmp_path / "f")
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (0, 8, 4)
    assert bitwise_equal(got["model.embed_tokens.weight"], torch.ones(8, 4))


def test_conflicting_layout_records_are_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    # the sample embeds a v2 record; a sidecar that says something else is a conflict
    md = CheckpointReader(ck)
    record = json.loads(md.read_object("layout"))
    md.close()
    for spec in record["extra_parallel"].values():
        spec["num_experts"] = 3
    (ck / "layout.json").write_text(json.dumps(record))
    res = export_cli(str(ck), str(tmp_path / "o"))
    assert_clean_failure(res, "E403")  # embedded and sidecar records disagree


# ------------------------------------------------------------------------------------------ output safety


def test_existing_output_is_refused_without_overwrite(dense_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert_clean_failure(export_cli(str(dense_ckpt), str(out)), "E600", "not empty")
    assert (out / "keep.txt").read_text() == "x"
    # --overwrite replaces only a previous output of ckpttool, never an unrelated directory (E606).
    assert_clean_failure(export_cli(str(dense_ckpt), str(out), "--overwrite"), "E606", "not an output of ckpttool")
    assert (out / "keep.txt").read_text() == "x"
    assert export_cli(str(dense_ckpt), str(tmp_path / "prev")).exit_code == 0
    res = export_cli(str(dense_ckpt), str(tmp_path / "prev"), "--overwrite")
    assert res.exit_code == 0, res.stderr
    (tmp_path / "prev" / "keep.txt").write_text("x")  # a file ckpttool did not write: no longer provably ours
    assert_clean_failure(export_cli(str(dense_ckpt), str(tmp_path / "prev"), "--overwrite"), "E606", "keep.txt")
    assert (tmp_path / "prev" / "keep.txt").read_text() == "x" and (tmp_path / "prev" / "model.safetensors").is_file()
    no_leftovers(tmp_path, "prev")


def test_output_inside_the_source_is_refused(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    assert_clean_failure(export_cli(str(ck), str(ck / "hf")), "E600", "overlaps the source")
    assert not (ck / "hf").exists()


def test_optimizer_dir_elsewhere_does_not_make_their_common_parent_the_source(tmp_path: Path) -> None:
    """A model checkpoint and an --optimizer-dir in two places (torch's own dcp.save of each): the output was
    refused 'overlaps the source checkpoint <their common parent>' anywhere below it (``/`` for two file systems:
    no output at all); only the two checkpoints themselves are the source."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd}, checkpoint_id=str(tmp_path / "run" / "model"))
    dcp.save({"optimizer": osd}, checkpoint_id=str(tmp_path / "elsewhere" / "optim"))
    src, opt = str(tmp_path / "run" / "model"), str(tmp_path / "elsewhere" / "optim")
    res = export_cli(src, str(tmp_path / "hf"), "--optimizer-dir", opt)
    assert res.exit_code == 0, res.stderr
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("0.weight"), msd["0.weight"])
    for inside in (tmp_path / "run" / "model" / "hf", tmp_path / "elsewhere" / "optim" / "hf"):
        assert_clean_failure(export_cli(src, str(inside), "--optimizer-dir", opt), "E600", "overlaps the source")
        assert not inside.exists()
    res = export_cli(src, str(tmp_path / "elsewhere"), "--optimizer-dir", opt, "--overwrite", "--dry-run")
    assert res.exit_code == 2 and "overlaps the source" in res.stderr


def test_truncated_data_file_fails_cleanly(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    data = sorted(ck.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(2048)  # cuts into the model chunks (saved first)
    res = export_cli(str(ck), str(tmp_path / "o"))
    assert_clean_failure(res, "E300", data.name)
    assert not (tmp_path / "o").exists()
    no_leftovers(tmp_path, "o")


# The CLI with a slow disk after the 8th chunk (64 MiB of the large fixture's 48 chunks): each later chunk takes
# 2 s more (80 s in all), so the export is still running when the test's signal lands after the first 64 MiB,
# however busy the machine (before, the rest took ~3 s: a test process held off the CPU that long found it done).
_SLOW_AFTER_64_MIB = """\
import time
from ckpttool.ops.export import execute

stream, done = execute._Executor._stream_chunk, [0]

def slow(self, *args, **kwargs):
    stream(self, *args, **kwargs)
    done[0] += 1
    if done[0] >= 8:
        time.sleep(2)

execute._Executor._stream_chunk = slow
from ckpttool.cli import main
main()
"""


def _wait_reading(proc: subprocess.Popen, tmp: Path, name: str, min_bytes: int) -> None:
    """Wait until the export has created its temporary dir and read ``min_bytes`` of data."""
    deadline = time.monotonic() + 300  # a hang guard, not a speed check
    while time.monotonic() < deadline:
        assert proc.poll() is None, "export finished before it could be interrupted"
        has_tmp = any(p.name.startswith(f".{name}.ckpttool-tmp-") for p in tmp.iterdir())
        io = Path(f"/proc/{proc.pid}/io").read_text()
        rchar = int(next(line.split()[1] for line in io.splitlines() if line.startswith("rchar")))
        if has_tmp and rchar >= min_bytes:
            return
        time.sleep(0.02)
    raise AssertionError("export did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_export_leaves_nothing(large_ckpt: Path, tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-c",
        _SLOW_AFTER_64_MIB,
        "export",
        str(large_ckpt),
        str(out),
        "--save-dtype",
        "float32",
        "--workers",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_reading(proc, tmp_path, "o", 64 << 20)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)  # a hang guard
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert "error: interrupted" in stderr and "Traceback" not in stderr
    assert stdout == ""
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_CTRL_C_WHILE_THE_OLD_OUTPUT_IS_DELETED = """
import os, shutil, signal, sys
from ckpttool.format import atomic

real_rmtree = shutil.rmtree

def rmtree(path, *args, **kwargs):
    if ".ckpttool-old-" in str(path):  # the new output is in place, the previous one renamed aside
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while it is deleted (a large one takes seconds)
    real_rmtree(path, *args, **kwargs)

atomic.shutil.rmtree = rmtree
sys.argv = ["ckpttool", *sys.argv[1:]]
from ckpttool.cli import entry
entry()
"""


def test_ctrl_c_after_an_overwrite_was_published_says_the_output_is_complete(sample_ckpt: Path, tmp_path: Path) -> None:
    """export --overwrite, Ctrl-C while the previous output (already replaced) is deleted: the signal waits for the
    deletion and the run ends with exit 130, as documented; its line said only 'error: interrupted', which
    docs/security.md gives to an overwrite that left the old output intact, while the new one is in place. The line
    now says the output was written and is complete; it is the export of the source, and nothing else is left."""
    from safetensors.torch import load_file

    out = tmp_path / "o"
    first = subprocess.run(
        [sys.executable, "-m", "ckpttool", "export", str(sample_ckpt), str(out), "--save-dtype", "bf16", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    cmd = [sys.executable, "-c", _CTRL_C_WHILE_THE_OLD_OUTPUT_IS_DELETED, "export", str(sample_ckpt), str(out)]
    proc = subprocess.run([*cmd, "--overwrite", "-q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: interrupted after {out} was written: it is complete", proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "ckpttool", "export", str(sample_ckpt), str(again), "-q"], check=True)
    new, want = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert new.keys() == want.keys() and all(torch.equal(new[k], want[k]) for k in want)  # float32, not the bf16


_CTRL_C_AS_THE_COMMAND_ENDS = """
import concurrent.futures, os, signal, sys, threading, time

when = sys.argv.pop(1)
if when == "pool":  # Ctrl-C while the CLI tells the pool's idle threads to end (the command has finished)
    real_shutdown = concurrent.futures.ThreadPoolExecutor.shutdown

    def shutdown(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        real_shutdown(self, *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.shutdown = shutdown
else:  # Ctrl-C while the CLI joins a thread still running after the command (a library's I/O thread)

    class Lingering(threading.Thread):
        def join(self, timeout=None):
            os.kill(os.getpid(), signal.SIGINT)
            return super().join(timeout)

    Lingering(target=time.sleep, args=(3,)).start()  # outlives the export
sys.argv = ["ckpttool", *sys.argv[1:]]
from ckpttool.cli import entry
entry()
"""


@pytest.mark.parametrize("when", ["pool", "join"])
def test_ctrl_c_as_the_command_ends_says_the_output_is_complete(sample_ckpt: Path, tmp_path: Path, when: str) -> None:
    """`timeout -s INT 1 ckpttool export ...` landing just after the export was written (while the CLI told its
    pool's threads to end, or joined the threads left running) printed a KeyboardInterrupt traceback. It is now
    the documented interrupt: exit 130, 'error: interrupted after OUT was written: it is complete', no traceback,
    and the output is the export of the source."""
    from safetensors.torch import load_file

    out = tmp_path / "o"
    cmd = [sys.executable, "-c", _CTRL_C_AS_THE_COMMAND_ENDS, when, "export", str(sample_ckpt), str(out), "-q"]
    proc = subprocess.run([*cmd, "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: interrupted after {out} was written: it is complete"
    assert proc.stderr.count("error: interrupted") == 1, proc.stderr
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "ckpttool", "export", str(sample_ckpt), str(again), "-q"], check=True)
    new, want = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert new.keys() == want.keys() and all(torch.equal(new[k], want[k]) for k in want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "o"]


def test_killed_export_leaves_no_stray_temp_after_next_run(large_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-c",
        _SLOW_AFTER_64_MIB,
        "export",
        str(large_ckpt),
        str(out),
        "--save-dtype",
        "float32",
        "--workers",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_reading(proc, tmp_path, "o", 64 << 20)
    proc.kill()
    proc.wait(timeout=300)
    assert not out.exists()
    assert any(p.name.startswith(".o.ckpttool-tmp-") for p in tmp_path.iterdir())  # SIGKILL cannot clean up
    res = export_cli(str(large_ckpt), str(out), "--filter", "model.layers.0.*")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


# ------------------------------------------------------------------------------------------ rules, filter, assets


def test_rules_file_renames_and_skips(dense_ckpt: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "keys:\n"
        "  - {match: '^model\\.model\\.rotary_emb\\..*$', to: null}\n"
        "  - {match: '^model\\.lm_head\\.weight$', to: 'output.weight'}\n"
    )
    res = export_cli(str(dense_ckpt), str(tmp_path / "o"), "--rules", str(rules), "--json")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    got, _ = read_export(tmp_path / "o")
    assert "output.weight" in got and "lm_head.weight" not in got
    assert "model.rotary_emb.inv_freq" not in got
    assert summary["skipped"]["skipped by a key rule"]["keys"] == ["model.model.rotary_emb.inv_freq"]
    assert "model.layers.0.self_attn.q_proj.weight" in got  # the defaults still apply after the user's rules


def test_packaged_default_rules_json_is_the_yaml_document() -> None:
    # export reads default_rules.json (no `import yaml` at start-up); the commented YAML is the one users read
    import yaml

    from ckpttool.ops.export import rules

    here = Path(rules.__file__).parent
    with open(here / "default_rules.yaml", encoding="utf-8") as f:
        want = yaml.safe_load(f)
    assert json.loads((here / "default_rules.json").read_text(encoding="utf-8")) == want


@pytest.mark.parametrize(
    "text,needle",
    [
        ("keys: [{match: '(', to: x}]", "invalid regular expression"),
        ("keys: [{match: 'a', to: '\\2'}]", "uses group 2"),
        ("bogus: 1", "unknown section"),
        ("keys: [: bad", "not valid YAML"),
        # a template Match.expand refuses (a trailing backslash, an unknown escape, a bad group name)
        ("keys: [{match: '^model\\.(.+)$', to: 'x\\'}]", "bad escape"),
        ("keys: [{match: '^model\\.(.+)$', to: '\\q\\1'}]", "bad escape"),
        ("keys: [{match: '^model\\.(.+)$', to: '\\g<1'}]", "unterminated name"),
        ("keys: [{match: '^model\\.(.+)$', to: '\\g<-1>'}]", "bad character in group name"),
        # a superscript is a digit to str.isdigit, not to int(): it was E999 'internal error: ValueError'
        ("keys: [{match: '^model\\.(.+)$', to: '\\g<\u00b2>'}]", "uses unknown group"),
        # a group number of 5,000 digits (more than int() reads): E999 'Exceeds the limit (4300 digits)'
        ("keys: [{match: '^model\\.(.+)$', to: '\\g<" + "9" * 5000 + ">'}]", "but 'match' has 1"),
        ("keys: [{match: '^model\\.(.+)$', to: '\\" + "9" * 5000 + "'}]", "but 'match' has 1"),
        ("1: x\nnull: y", "unknown section(s) ['1', 'None']"),
        # an expert part's format spec: a huge width (MemoryError before), a conversion, a broken brace
        ("experts: [{match: '^(?P<l>.+)\\.w$', parts: ['{l}.{j:>99999999999}']}]", "fields are plain"),
        ("experts: [{match: '^(?P<l>.+)\\.w$', parts: ['{l!r}.{j}']}]", "fields are plain"),
        ("experts: [{match: '^(?P<l>.+)\\.w$', parts: ['{l}.{j']}]", "invalid template"),
        # an index or attribute of a field: {j[0]} was E999 TypeError; {l.__class__} wrote "<class 'str'>" keys
        ("experts: [{match: '^(?P<l>.+)\\.w$', parts: ['{l}.{j[0]}']}]", "fields are plain"),
        ("experts: [{match: '^(?P<l>.+)\\.w$', parts: ['{l.__class__}.{j}']}]", "fields are plain"),
    ],
)
def test_bad_rules_file_is_a_usage_error(dense_ckpt: Path, tmp_path: Path, text: str, needle: str) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    assert_clean_failure(
        export_cli(str(dense_ckpt), str(tmp_path / "o"), "--rules", str(rules)), "E100", needle, "rules.yaml"
    )


@pytest.mark.parametrize("special", SPECIAL_KINDS)
def test_a_special_file_as_rules_is_refused_unread(dense_ckpt: Path, tmp_path: Path, special: str) -> None:
    # --rules is opened as the other input files are (regular, capped): a FIFO or /dev/zero never blocks
    rules = tmp_path / "rules.yaml"
    make_special(rules, special)
    with fails_instead_of_hanging():
        res = export_cli(str(dense_ckpt), str(tmp_path / "o"), "--rules", str(rules))
    assert_clean_failure(res, "E102", "rules.yaml", "not a regular file")
    assert len(res.stderr.strip().splitlines()) == 2  # the coded error line and its hint
    assert not (tmp_path / "o").exists()


def test_duplicate_output_keys_are_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("keys: [{match: '^model\\.model\\.layers\\.\\d+\\.input_layernorm\\.weight$', to: 'norm.weight'}]")
    assert_clean_failure(
        export_cli(str(dense_ckpt), str(tmp_path / "o"), "--rules", str(rules)), "E601", "'norm.weight'"
    )


def test_filter_and_model_assets(dense_ckpt: Path, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False})
    )
    (assets / "tokenizer.json").write_text("{}")
    (assets / "pytorch_model.bin").write_bytes(b"old weights")
    (assets / "sub").mkdir()
    res = export_cli(
        str(dense_ckpt), str(tmp_path / "o"), "--filter", "model.layers.0.*", "--model-assets", str(assets), "--json"
    )
    assert res.exit_code == 0, res.stderr
    got, _ = read_export(tmp_path / "o")
    assert got and all(k.startswith("model.layers.0.") for k in got)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        ".ckpttool-output.json",
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    res = export_cli(str(dense_ckpt), str(tmp_path / "none"), "--filter", "nothing.*")
    assert_clean_failure(res, "E601", "matched none")


def test_a_manifest_of_the_model_assets_folder_is_not_copied(dense_ckpt: Path, tmp_path: Path) -> None:
    # the assets folder's own manifest.json was copied: `manifest --verify OUT` then checked the
    # export against a manifest of other files (37 problems), and `assets` listed it as copied
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (assets / "manifest.json").write_text('{"format": "ckpttool.manifest", "version": 2}')
    res = export_cli(str(dense_ckpt), str(tmp_path / "o"), "--model-assets", str(assets), "--json")
    assert res.exit_code == 0, res.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()
    assert "manifest.json" not in json.loads(res.stdout)["assets"]
    res = export_cli(str(dense_ckpt), str(tmp_path / "m"), "--model-assets", str(assets), "--manifest")
    assert res.exit_code == 0, res.stderr
    assert "manifest.json" not in next(ln for ln in res.stdout.splitlines() if ln.startswith("assets"))
    check = runner.invoke(app, ["manifest", str(tmp_path / "m"), "--verify"])
    assert check.exit_code == 0, check.stdout


def test_json_output_is_alone_on_stdout(dense_ckpt: Path, tmp_path: Path) -> None:
    res = export_cli(str(dense_ckpt), str(tmp_path / "o"), "--json")
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert set(data) >= {"output", "files", "tensors", "bytes", "seconds", "gb_per_s", "casts", "origins"}
    assert res.stderr == ""


def test_library_api_without_typer(dense_ckpt: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    r = export_checkpoint(
        dense_ckpt,
        tmp_path / "o",
        ExportOptions(save_dtype="float32", workers=2),
        progress=lambda d, t: seen.append((d, t)),
    )
    assert r.casts == {"bfloat16->float32": r.tensors - 1}  # inv_freq is already float32
    assert not r.narrowing_casts
    assert seen and seen[-1][0] == seen[-1][1] == r.bytes
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_source_never_modified_on_failure(dense_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    snapshot = {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()}
    export_cli(str(ck), str(tmp_path / "o"), "--weights", "master")
    export_cli(str(ck), str(tmp_path / "o2"))
    assert {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()} == snapshot
    shutil.rmtree(tmp_path / "o2")
    assert os.listdir(tmp_path) == ["ck"]


@pytest.mark.parametrize(
    ("pattern", "to", "key"),
    [
        (r"^model\.model\.(.+)$", r"model.\1", "model.model.layers.0.w"),
        (r"^model\.(.+)$", r"\1", "model.x.y"),
        (r"^(?P<a>x)(?P<b>y)?(.*)$", r"\g<a>-\g<b>-\g<3>-\3", "xz"),
        (r"^(a)(b)$", r"\2\1\\n", "ab"),
        (r"^(a)(b)$", r"\g<0>!", "ab"),
        (r"^(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)(k)$", r"\10", "abcdefghijk"),
    ],
)
def test_key_rule_template_expands_as_match_expand(pattern: str, to: str, key: str) -> None:
    # KeyRule parses its template once; the output key must be exactly what Match.expand gives
    import re

    from ckpttool.ops.export.rules import KeyRule

    rx = re.compile(pattern)
    m = rx.fullmatch(key)
    assert m is not None
    assert KeyRule(rx, to).apply(key) == (True, m.expand(to))


def test_a_key_with_a_newline_is_exported_by_the_default_rules(tmp_path: Path) -> None:
    # `.` in the rules matches every character of a key: 'a\nb.weight' was "not exported: no key rule matches"
    import torch
    import torch.distributed.checkpoint as dcp

    w = torch.arange(4, dtype=torch.float32)
    dcp.save({"model": {"a\nb.weight": w, "c.weight": w + 1}}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    res = export_cli(str(tmp_path / "ck"), str(tmp_path / "o"), "--json")
    assert res.exit_code == 0, res.stderr
    got, _ = read_export(tmp_path / "o")
    assert sorted(got) == ["a\nb.weight", "c.weight"] and torch.equal(got["a\nb.weight"], w)
    assert json.loads(res.stdout)["skipped"] == {}


def test_an_asset_deleted_mid_run_is_named_not_an_internal_error(
    sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--model-assets` file deleted (or the folder moved) between the plan and its copy into the output:
    E999 FileNotFoundError. Now E300 naming the file, and no output."""
    from ckpttool.ops.export import execute

    assets = tmp_path / "assets"
    shutil.copytree(sample_ckpt / "model_assets", assets)
    (assets / "tokenizer.json").write_text("{}")
    real = execute._write_root_files

    def deleted_first(*args: Any, **kwargs: Any) -> Any:
        (assets / "tokenizer.json").unlink()  # another process removes it as the run reaches the assets
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "_write_root_files", deleted_first)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["export", str(sample_ckpt), str(out), "--model-assets", str(assets)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: [E300] {assets / 'tokenizer.json'}: cannot read"), res.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), res.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["assets"]


def test_a_dtype_safetensors_lacks_gets_a_hint_that_works(tmp_path: Path) -> None:
    """complex128 and float4_e2m1fn_x2 have no safetensors dtype and `--save-dtype` casts floating tensors only: the
    hint names `--filter`, not the cast that fails the same way; float8_e4m3fnuz (floating) is cast as hinted."""
    ck = tmp_path / "ck"
    sd = {
        "model": {
            "w": torch.randn(4, 2),
            "c": torch.randn(3, dtype=torch.complex128),
            "f4": torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
            "fnuz": torch.randn(4).to(torch.float8_e4m3fnuz),
        }
    }
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    for key in ("c", "f4"):
        for extra in ((), ("--save-dtype", "float32")):
            res = export_cli(str(ck), str(tmp_path / f"out-{key}"), "--filter", key, *extra)
            assert_clean_failure(res, "E601", f"{key}: dtype")
            hint = res.stderr.strip().splitlines()[-1]
            assert "--filter" in hint and "--rules" in hint and "--save-dtype float32" not in hint, hint
            assert not (tmp_path / f"out-{key}").exists()
    rules = tmp_path / "rules.yaml"  # the hint's rules entry, one per tensor: the others are exported
    rules.write_text("keys:\n  - {match: '^model\\.c$', to: null}\n  - {match: '^model\\.f4$', to: null}\n")
    res = export_cli(str(ck), str(tmp_path / "out-rules"), "--rules", str(rules), "--save-dtype", "float32")
    assert res.exit_code == 0, res.stderr
    keys = set()
    for f in (tmp_path / "out-rules").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            keys |= set(st.keys())
    assert keys == {"w", "fnuz"}, keys
    res = export_cli(str(ck), str(tmp_path / "out-fnuz"), "--filter", "fnuz")
    assert_clean_failure(res, "E601", "fnuz: dtype float8_e4m3fnuz")
    assert "--save-dtype float32" in res.stderr.strip().splitlines()[-1]
    assert export_cli(str(ck), str(tmp_path / "out-fnuz"), "--filter", "fnuz", "--save-dtype", "float32").exit_code == 0


def test_a_dtype_safetensors_lacks_is_named_by_the_checkpoint_key_the_rules_match(tmp_path: Path) -> None:
    """The E601 of a complex tensor whose output key differs from its checkpoint key (model.model.c -> model.c)
    names the checkpoint key its hint's `--rules` entry matches; that entry, written from the message, exports."""
    ck = tmp_path / "ck"
    sd = {"model": {"model.w": torch.randn(4, 2), "model.c": torch.randn(3, dtype=torch.complex128)}}
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    res = export_cli(str(ck), str(tmp_path / "out"))
    assert_clean_failure(
        res, "E601", "model.model.c: dtype complex128 cannot be stored in safetensors (its output key model.c)"
    )
    key = res.stderr.split("] ", 1)[1].split(": ", 1)[0]
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"keys:\n  - {{match: '^{re.escape(key)}$', to: null}}\n")
    res = export_cli(str(ck), str(tmp_path / "out"), "--rules", str(rules))
    assert res.exit_code == 0, res.stderr
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as st:
        assert set(st.keys()) == {"model.w"}
