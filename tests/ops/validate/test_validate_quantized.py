"""`validate --deep` on quantized checkpoints: block-FP8 HF folders, MXFP4 folders, DCPs with FP8 + scales.

Fixtures are written by ``safetensors.torch.save_file`` (the DeepSeek-V3 / gpt-oss conventions), by
``ckpttool export --quantize fp8-block`` and by torch's ``dcp.save`` of ``float8_e4m3fn`` tensors
with float32 scales (torchao float8 weights stored as plain tensors). Rules ``M021``-``M023``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.ops.test_import_quantized import _DS_CONFIG, _deepseek_tensors, _hostile, _mxfp4_tensors, _write_folder

runner = CliRunner()
#: The folders hold a few tensors under a whole model's config (its quantization_config): import compares
#: the tensors with the config's model class first (E605), which these tests are not about.
_PART = ("--allow-mismatch", "missing,shape")
CODES = ("M020", "M021", "M022", "M023", "D001")


def _findings(path: Path, *args: str) -> tuple[int, list[tuple[str, str]]]:
    res = runner.invoke(app, ["validate", str(path), "--deep", "--json", *args])
    assert "Traceback" not in res.stderr, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return res.exit_code, sorted((f["code"], f["message"]) for f in doc["findings"] if f["code"] in CODES)


def test_clean_deepseek_folder(tmp_path: Path) -> None:
    """A zero scale on an all-zero block is fine; nothing else to report."""
    src = _write_folder(tmp_path / "fp8", _deepseek_tensors(16), _DS_CONFIG)
    assert _findings(src, "--config", str(src / "config.json"))[1] == []
    # without --config the folder's own config.json gives the 16x16 blocks (it was 128: two false M020)
    assert _findings(src) == (0, [])
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps({"quantization_config": {"weight_block_size": [128, 128]}}))
    rc, found = _findings(src, "--config", str(cfg))  # --config still decides when given
    assert rc == 1 and [c for c, _ in found] == ["M020", "M020"], found


def test_own_config_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's own config.json is read once per validate, not once per scale tensor (a DeepSeek-V3
    folder has tens of thousands)."""
    import ckpttool.model.hfconfig as hfconfig

    src = _write_folder(tmp_path / "fp8", _deepseek_tensors(16), _DS_CONFIG)
    n_scales = sum(1 for k in _deepseek_tensors(16) if k.endswith("_scale_inv"))
    assert n_scales > 1
    real, reads = hfconfig.read_hf_config, []

    def counting(path: Any, **kw: Any) -> dict[str, Any]:
        reads.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(hfconfig, "read_hf_config", counting)
    assert _findings(src) == (0, [])
    assert reads == ["fp8"], reads  # the folder (its config.json resolved inside it), once


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("nan-scale", "D001 M021"),  # a NaN float32 scale is also a non-finite value (D001)
        ("zero-scale", "M021"),
        ("nan-bytes", "M022"),  # M022 instead of D001, not both
        ("e8m0", "M020"),
        ("shape", "M020"),
        ("missing-weight", "M020"),
    ],
)
def test_hostile_deepseek_folder(tmp_path: Path, name: str, code: str) -> None:
    t, _ = _hostile(name)
    src = _write_folder(tmp_path / "src", t, _DS_CONFIG)
    rc, found = _findings(src, "--config", str(src / "config.json"))
    assert rc == 1 and [c for c, _ in found] == code.split(), found


def test_unreadable_block_size_is_one_m020(tmp_path: Path) -> None:
    """--config whose weight_block_size is not two positive ints: one M020 naming it (no scale shape is judged
    against a default grid the quantizer never used); [True, True] was read as 1x1 blocks."""
    for wbs in ([16.0, 16.0], [True, True]):
        cfg = {"quantization_config": {"weight_block_size": wbs}}
        src = _write_folder(tmp_path / str(wbs), _deepseek_tensors(16), cfg)
        rc, found = _findings(src, "--config", str(src / "config.json"))
        assert rc == 1 and [c for c, _ in found] == ["M020"], found
        assert "weight_block_size is" in found[0][1] and "not two positive integers" in found[0][1], found


def test_mxfp4_folder(tmp_path: Path) -> None:
    t = _mxfp4_tensors()
    assert _findings(_write_folder(tmp_path / "ok", t, {"model_type": "gpt_oss"}))[1] == []
    t["model.layers.0.mlp.experts.gate_up_proj_scales"][0, 0, 0] = 0xFF
    rc, found = _findings(_write_folder(tmp_path / "nan", t, {"model_type": "gpt_oss"}))
    assert rc == 1 and found == [
        ("M021", "model.layers.0.mlp.experts.gate_up_proj_scales: 1 E8M0 exponent(s) are 0xFF (NaN)")
    ]
    del t["model.layers.0.mlp.experts.gate_up_proj_scales"]
    rc, found = _findings(_write_folder(tmp_path / "lone", t, {"model_type": "gpt_oss"}))
    assert rc == 1 and [c for c, _ in found] == ["M023"] and "with no" in found[0][1]


def test_inspect_names_mxfp4_groups_not_fp8_blocks(tmp_path: Path) -> None:
    """inspect of an MXFP4-only (gpt-oss) folder said "(128x128 blocks for FP8)", and ``--json`` ``block``
    ``[128, 128]``: no FP8 weight is stored. Now the wording is the format present: MXFP4 groups of as many values as
    transformers' ``convert_moe_packed_tensors`` unpacks under one E8M0 scale (32), ``block`` null; beside block-FP8
    weights both are named."""
    import jsonschema
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ckpttool.commands.schema import load_schema

    t = _mxfp4_tensors()
    p = "model.layers.0.mlp.experts.gate_up_proj"
    ref = convert_moe_packed_tensors(t[p + "_blocks"], t[p + "_scales"], dtype=torch.float32)
    group = ref.shape[1] // t[p + "_scales"].shape[-1]  # values per scale: dims [E, G * group, N]
    src = _write_folder(tmp_path / "mx", t, {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})
    doc = json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)
    jsonschema.validate(doc, load_schema("inspect"))
    q = doc["quantized"]
    assert q["block"] is None and q["schemes"] == [f"MXFP4 groups of {group} values, one E8M0 scale each"], q
    assert q["pairs"][0]["dequantized_shape"] == list(ref.shape)
    text = runner.invoke(app, ["inspect", str(src)]).stdout
    assert f"quantized   1 mxfp4 weight(s) with scales (MXFP4 groups of {group} values, one E8M0 scale each)" in text
    assert "FP8" not in text
    both = {**t, **_deepseek_tensors(16)}
    src = _write_folder(tmp_path / "both", both, _DS_CONFIG)
    q = json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)["quantized"]
    assert q["block"] == [16, 16] and q["schemes"] == [
        "16x16 blocks for FP8",
        f"MXFP4 groups of {group} values, one E8M0 scale each",
    ]


def test_own_export_is_clean(tmp_path: Path, fixture_root: Path) -> None:
    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    master = cached_build(fixture_root, "export_master", hf_models.build_master)
    out = tmp_path / "fp8"
    args = ["--quantize", "fp8-block", "--quantize-block", "16", "--model-assets", str(master / "model_assets")]
    res = runner.invoke(app, ["export", str(master), str(out), *args])
    assert res.exit_code == 0, res.stderr
    assert _findings(out, "--config", str(out / "config.json"))[1] == []  # its quantization_config: 16x16 blocks


def _fp8_dcp(path: Path, nan: bool = False) -> Path:
    """A DCP as a float8 trainer leaves it: FP8 weights as plain float8_e4m3fn tensors beside float32 block scales."""
    t = _deepseek_tensors(16)
    sd = {"model." + k: v for k, v in t.items()}
    if nan:
        w = sd["model.model.layers.0.mlp.up_proj.weight"].view(torch.uint8).clone()
        w[20, 3] = 0x7F
        sd["model.model.layers.0.mlp.up_proj.weight"] = w.view(torch.float8_e4m3fn)
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def test_dcp_with_fp8_and_scales(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_DS_CONFIG))  # 16 x 16 blocks
    ok = _fp8_dcp(tmp_path / "ok")
    assert _findings(ok, "--config", str(cfg))[1] == []
    assert [c for c, _ in _findings(ok)[1]] == ["M020", "M020"]  # 128 x 128 blocks: the scales do not fit
    res = runner.invoke(app, ["inspect", str(ok), "--json"])
    assert res.exit_code == 0, res.stderr
    q = json.loads(res.stdout)["quantized"]  # no config.json beside the DCP: 128 x 128, the scales do not pair
    assert q["block"] == [128, 128] and q["pairs"] == [] and len(q["problems"]) == 2
    (ok / "config.json").write_text(json.dumps(_DS_CONFIG))
    res = runner.invoke(app, ["inspect", str(ok), "--json"])
    q = json.loads(res.stdout)["quantized"]
    assert q["block"] == [16, 16] and q["problems"] == []
    assert [(p["kind"], p["weight"], p["dequantized_shape"]) for p in q["pairs"]] == [
        ("fp8-block", "model.model.layers.0.mlp.up_proj.weight", [70, 45]),
        ("fp8-block", "model.model.layers.0.self_attn.q_proj.weight", [32, 64]),
    ]
    assert "quantized   2 fp8-block weight(s)" in runner.invoke(app, ["inspect", str(ok)]).stdout
    rc, found = _findings(_fp8_dcp(tmp_path / "nan", nan=True), "--config", str(cfg))
    assert rc == 1 and found == [
        ("M022", "model.model.layers.0.mlp.up_proj.weight: 1 of 3150 float8_e4m3fn bytes are NaN (0x7F / 0xFF)")
    ]


def test_fp8_nan_count_matches_torch() -> None:
    """Every e4m3fn byte: the deep pass's NaN count equals torch's isnan of the float8 value."""
    import numpy as np

    from ckpttool.engine.kernels import e4m3fn_nan_count

    allb = torch.arange(256, dtype=torch.uint8)
    assert e4m3fn_nan_count(allb.numpy()) == int(torch.isnan(allb.view(torch.float8_e4m3fn).float()).sum()) == 2
    for b in range(256):
        one = np.array([b], dtype=np.uint8)
        assert e4m3fn_nan_count(one) == int(
            torch.isnan(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        )


def test_tensor_subclass_in_byte_item_named_not_loaded(tmp_path: Path) -> None:
    """A float8 training tensor subclass that dcp.save pickled into a byte item: S011/E304 names the class;
    its module is never imported (torch's weights_only unpickler refuses it by name, ckpttool reads opcodes)."""
    import sys
    import types

    mod = types.ModuleType("ckpttool_test_float8")

    class WeightWithDynamicFloat8CastTensor(torch.Tensor):
        def __reduce_ex__(self, proto: Any) -> Any:  # as a subclass pickles: its class by name
            return (WeightWithDynamicFloat8CastTensor, (torch.zeros(2, 2, dtype=torch.float8_e4m3fn),))

    WeightWithDynamicFloat8CastTensor.__module__ = mod.__name__
    WeightWithDynamicFloat8CastTensor.__qualname__ = "WeightWithDynamicFloat8CastTensor"
    mod.WeightWithDynamicFloat8CastTensor = WeightWithDynamicFloat8CastTensor  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        w = torch.Tensor._make_subclass(WeightWithDynamicFloat8CastTensor, torch.zeros(2, 2))
        sd = {"model": {"layers.0.w": torch.zeros(2, 2), "layers.0.f8": (w,)}}  # a tuple: pickled, a byte item
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    finally:
        del sys.modules[mod.__name__]
    res = runner.invoke(app, ["validate", str(tmp_path / "ck"), "--deep", "--json"])
    assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "S011"]
    assert len(found) == 1 and found[0]["key"] == "model.layers.0.f8", found
    assert found[0]["message"].endswith(
        "refuses: a tensor subclass ckpttool_test_float8.WeightWithDynamicFloat8CastTensor (not loaded)"
    ), found
    assert "ckpttool_test_float8" not in sys.modules


def _ct_folder(path: Path, scale: torch.Tensor, strategy: str = "block") -> Path:
    """A compressed-tensors FP8 folder (llm-compressor's float-quantized layout): ``l.weight`` [32, 32] + ``weight_scale``."""
    q = torch.randint(1, 0x70, (32, 32), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    scheme: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    if strategy == "block":
        scheme["block_structure"] = [16, 16]
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"weights": scheme}},
    }
    t = {
        "model.layers.0.mlp.up_proj.weight": q.view(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale": scale,
    }
    return _write_folder(path, t, {"model_type": "llama", "quantization_config": qc})


def test_compressed_tensors_scales_checked_as_import_checks_them(tmp_path: Path) -> None:
    """import refuses a compressed-tensors ``weight_scale`` that is negative, zero over non-zero codes or of the
    wrong shape (E612, its hint: 'check it with validate --deep'), but validate --deep passed them (exit 0; a NaN
    scale only as D001 'training diverged'): M021 / M020 now report them as for ``weight_scale_inv``."""
    good = torch.full((2, 2), 0.01)
    assert _findings(_ct_folder(tmp_path / "ok", good)) == (0, [])
    assert _findings(_ct_folder(tmp_path / "ch", torch.full((32, 1), 0.01), "channel")) == (0, [])
    key = "model.layers.0.mlp.up_proj.weight_scale"
    for name, value, want in (("neg", -1.0, "NaN, infinite or negative"), ("zero", 0.0, "scale 0 but non-zero")):
        s = good.clone()
        s[1, 0] = value
        rc, found = _findings(_ct_folder(tmp_path / name, s))
        assert rc == 1 and [c for c, _ in found] == ["M021"] and found[0][1].startswith(key) and want in found[0][1]
        err = runner.invoke(app, ["import", str(tmp_path / name), str(tmp_path / f"{name}-dcp"), *_PART]).stderr
        assert "[E612]" in err and want in err
    s = torch.full((32, 1), 0.01)
    s[3, 0] = -2.0
    rc, found = _findings(_ct_folder(tmp_path / "ch-neg", s, "channel"))
    assert rc == 1 and [c for c, _ in found] == ["M021"] and "(3, 0) = -2.0" in found[0][1], found
    rc, found = _findings(_ct_folder(tmp_path / "shape", torch.full((2, 3), 0.01)))
    assert rc == 1 and [c for c, _ in found] == ["M020"] and "16x16 block scheme needs float32 [2, 2]" in found[0][1]


def test_scale_whose_product_overflows_float32(tmp_path: Path) -> None:
    """A finite scale of 3e38 times the block's codes is infinity in float32 (what torch's reader loads; import
    refuses it, E612), but validate --deep passed it (exit 0, only D013 'uninitialised' as a warning). On an
    all-zero block the same scale is harmless (exact zeros)."""
    t = _deepseek_tensors(16)
    s = "model.layers.0.mlp.up_proj.weight_scale_inv"
    t[s][0, 0] = 3e38  # block (0, 0) is all zero
    assert _findings(_write_folder(tmp_path / "zero", t, _DS_CONFIG))[0] == 0
    t[s][2, 1] = 3e38
    rc, found = _findings(_write_folder(tmp_path / "over", t, _DS_CONFIG))
    assert rc == 1 and [c for c, _ in found] == ["M021"], found
    assert (
        found[0][1] == f"{s}: 1 block(s) whose values times the scale overflow float32 (torch's reader loads "
        "infinity there), e.g. block (2, 1) = " + repr(float(torch.tensor(3e38)))
    )
    err = runner.invoke(
        app, ["import", str(tmp_path / "over"), str(tmp_path / "dcp"), "--dtype", "float32", *_PART]
    ).stderr
    assert "[E612]" in err and "beyond the float32 range" in err, err


def test_mxfp4_exponent_whose_product_overflows_float32(tmp_path: Path) -> None:
    """E8M0 exponent 254 (2^127) under FP4 values of 2 or more is infinity in float32; import refuses it (E612),
    validate --deep passed it (exit 0). A group of exponent 254 holding only values below 2 stays clean."""
    t = _mxfp4_tensors()
    s, b = "model.layers.0.mlp.experts.gate_up_proj_scales", "model.layers.0.mlp.experts.gate_up_proj_blocks"
    t[b][1, 2, 0] = 0x11  # two FP4 values of 0.5: 0.5 * 2^127 is finite
    t[s][1, 2, 0] = 254
    assert _findings(_write_folder(tmp_path / "fine", t, {"model_type": "gpt_oss"})) == (0, [])
    t[b][0, 4, 1, 3] = 0x70  # 6.0 (high nibble 7) beside 0 in group (0, 4, 1)
    t[s][0, 4, 1] = 254
    rc, found = _findings(_write_folder(tmp_path / "over", t, {"model_type": "gpt_oss"}))
    assert rc == 1 and [c for c, _ in found] == ["M021"], found
    assert (
        found[0][1] == f"{s}: 1 group(s) whose FP4 values times 2^(e-127) overflow float32 (infinity), "
        "e.g. group (0, 4, 1) with exponent 254"
    )
    err = runner.invoke(app, ["import", str(tmp_path / "over"), str(tmp_path / "dcp"), *_PART]).stderr
    assert "[E612]" in err, err


def test_inspect_names_compressed_tensors_weights(tmp_path: Path) -> None:
    """inspect said nothing of a compressed-tensors FP8 folder (``quantized`` null): its FP8 weights looked like
    plain float8 tensors. Now its pairs are listed with the config's scheme, and its problems named."""
    import jsonschema

    from ckpttool.commands.schema import load_schema

    for name, scale, strategy, scheme in (
        ("blk", torch.full((2, 2), 0.01), "block", "block 16x16"),
        ("ch", torch.full((32, 1), 0.01), "channel", "channel"),
    ):
        src = _ct_folder(tmp_path / name, scale, strategy)
        doc = json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)
        jsonschema.validate(doc, load_schema("inspect"))
        q = doc["quantized"]
        assert q["compressed_tensors"] == scheme and q["problems"] == []
        assert [(p["kind"], p["weight"], p["scale"]) for p in q["pairs"]] == [
            (
                "fp8-compressed-tensors",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.up_proj.weight_scale",
            )
        ]
        text = runner.invoke(app, ["inspect", str(src)]).stdout
        assert f"quantized   1 fp8-compressed-tensors weight(s) with scales (compressed-tensors {scheme})" in text
    src = _ct_folder(tmp_path / "bad", torch.full((2, 3), 0.01))
    q = json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)["quantized"]
    assert q["pairs"] == [] and "needs float32 [2, 2]" in q["problems"][0]["message"]


@pytest.fixture(scope="module")
def own_fp8(fixture_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the FP32-master checkpoint, its ``export --quantize fp8-block --quantize-block 16`` with config.json)."""
    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    master = cached_build(fixture_root, "export_master", hf_models.build_master)
    out = tmp_path_factory.mktemp("own") / "fp8"
    args = ["--quantize", "fp8-block", "--quantize-block", "16", "--model-assets", str(master / "model_assets")]
    res = runner.invoke(app, ["export", str(master), str(out), *args])
    assert res.exit_code == 0, res.stderr
    return master, out


def test_own_fp8_export_fits_its_model_class(own_fp8: tuple[Path, Path]) -> None:
    """``validate --config`` of an FP8 export reported each ``weight_scale_inv`` as an ``unexpected`` key of the
    model class (M010, 14 errors, exit 1): the scales are the quantizer's, not the model's (export's own model
    check leaves them out). Now they are left out here too; the check still runs (M010 passes, not skipped)."""
    _, out = own_fp8
    res = runner.invoke(app, ["validate", str(out), "--json", "--config", str(out / "config.json")])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0, [f["message"] for f in doc["findings"]]
    assert not [f for f in doc["findings"] if f["code"] == "M010"]
    assert next(r for r in doc["rules"] if r["code"] == "M010")["status"] == "passed"


def test_a_config_without_quantization_config_keeps_the_folders_own(own_fp8: tuple[Path, Path], tmp_path: Path) -> None:
    """``--config`` of the base model (for coverage, the model check: no ``quantization_config``) replaced the FP8
    folder's own config.json whole, so its 16x16 scales were judged on the default 128 grid: validate failed M020
    14 times and import refused with E612 ("damaged"). A config that says nothing of the quantization now leaves
    the folder's own ``quantization_config`` in force; one that has one still decides."""
    master, out = own_fp8
    base = master / "model_assets" / "config.json"
    assert "quantization_config" not in json.loads(base.read_text())
    rc, found = _findings(out, "--config", str(base))
    assert (rc, found) == (0, [])
    res = runner.invoke(app, ["import", str(out), str(tmp_path / "dcp"), "--config", str(base), "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["dequantized"]["kinds"] == {"fp8-block": 14}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}))
    rc, found = _findings(out, "--config", str(other))
    assert rc == 1 and {c for c, _ in found} == {"M020"}
    res = runner.invoke(app, ["import", str(out), str(tmp_path / "dcp2"), "--config", str(other)])
    assert res.exit_code == 2 and "[E612]" in res.stderr and "in 32x32 blocks" in res.stderr


@pytest.mark.parametrize(
    ("field", "entries", "n"),
    [
        ("modules_to_not_convert", ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj"], 1),
        ("modules_to_not_convert", ["lm_head", "model.layers.1"], 7),  # a whole layer, up to a module boundary
        ("modules_to_not_convert", ["lm_head", "down_proj"], 2),  # a suffix: every layer's
        ("modules_to_not_convert", ["lm_head", "model.layers.0.self_attn.q"], 0),  # no boundary: q_proj converted
        ("ignored_layers", ["model.layers.0.mlp.up_proj"], 1),  # vLLM's own list
    ],
)
def test_fp8_weights_their_config_lists_unconverted(
    own_fp8: tuple[Path, Path], tmp_path: Path, field: str, entries: list[str], n: int
) -> None:
    """validate passed an FP8 folder whose ``modules_to_not_convert`` lists modules holding FP8 weights and scales:
    transformers' FineGrainedFP8 quantizer (and vLLM) builds them as plain ``nn.Linear``, whose BF16 weight takes the
    FP8 codes as values, the scale an unexpected key. Now M027 names each such weight: exactly the FP8 weights whose
    module transformers' own quantizer leaves unconverted (its meta model; vLLM's ``ignored_layers`` judged alike)."""
    import shutil

    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from tests.fixtures import hf_models

    _, fp8 = own_fp8
    out = tmp_path / "edited"
    shutil.copytree(fp8, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"][field] = entries
    (out / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["validate", str(out), "--json"])
    found = sorted(f["key"] for f in json.loads(res.stdout)["findings"] if f["code"] == "M027")
    as_transformers = dict(cfg["quantization_config"], modules_to_not_convert=entries)
    tf_cfg = AutoConfig.from_pretrained(str(out))
    tf_cfg.quantization_config = as_transformers
    model = hf_models.fp8_meta_model(tf_cfg)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        fp8_weights = {k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"}
    want = sorted(
        f"{name}.weight"
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and not isinstance(mod, FP8Linear) and f"{name}.weight" in fp8_weights
    )
    assert found == want and len(want) == n, (found, want)
    assert res.exit_code == (1 if want else 0), res.stdout


def test_per_expert_folders_fit_their_fused_model_class(fixture_root: Path, tmp_path: Path) -> None:
    """``validate --config`` of a per-expert MoE folder (``export --quantize``'s default layout, a BF16
    ``--experts per-expert`` export, Qwen3-MoE's own checkpoints) failed M010 52 times: every
    ``experts.<j>.*_proj.weight`` "unexpected", every fused ``experts.gate_up_proj`` "missing", though transformers
    fuses them on load (as ``import`` does). They are now compared as the fused tensors; a wrong expert size is
    still named on the fused key."""
    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    src = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    assets = ["--model-assets", str(src / "model_assets")]
    for name, args in (
        ("fp8", ["--quantize", "fp8-block", "--quantize-block", "16"]),
        ("bf16", ["--experts", "per-expert"]),
    ):
        out = tmp_path / name
        res = runner.invoke(app, ["export", str(src), str(out), *assets, *args])
        assert res.exit_code == 0, res.stderr
        res = runner.invoke(app, ["validate", str(out), "--json", "--config", str(out / "config.json")])
        doc = json.loads(res.stdout)
        assert res.exit_code == 0, (name, [f["message"] for f in doc["findings"]][:3])
        assert next(r for r in doc["rules"] if r["code"] == "M010")["status"] == "passed"
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    cfg["moe_intermediate_size"] *= 2
    (tmp_path / "wider.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["validate", str(tmp_path / "bf16"), "--json", "--config", str(tmp_path / "wider.json")])
    found = [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "M010"]
    assert res.exit_code == 1 and any("model.layers.0.mlp.experts.gate_up_proj" in m and "shape" in m for m in found), (
        found
    )


@pytest.mark.parametrize("lost", ["experts.0.gate_proj", "experts.3.down_proj"])
def test_per_expert_folder_missing_an_expert_fails_as_import_refuses_it(tmp_path: Path, lost: str) -> None:
    """A per-expert FP8 export (``export --quantize fp8-block`` of an MoE checkpoint) that lost one expert's weight
    and its scale: ``validate --deep`` said OK while ``import`` refused it (E601). Now M025 (E601) names the
    per-expert tensors and the expert missing; the complete folder still validates clean."""
    from safetensors.torch import load_file, save_file

    from tests.ops.export.test_export_quant_experts import _tiny_moe

    src = _tiny_moe(tmp_path / "ckpt")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"hidden_size": 20}))
    out = tmp_path / "q"
    res = runner.invoke(
        app,
        [
            "export",
            str(src),
            str(out),
            "--quantize",
            "fp8-block",
            "--quantize-block",
            "8",
            "--model-assets",
            str(assets),
        ],
    )
    assert res.exit_code == 0, res.stderr

    def findings() -> tuple[int, list[dict[str, Any]]]:
        res = runner.invoke(app, ["validate", str(out), "--deep", "--json"])
        assert "Traceback" not in res.stderr, res.stderr
        return res.exit_code, json.loads(res.stdout)["findings"]

    code, found = findings()
    assert code == 0 and not [f for f in found if f["severity"] != "info"], found
    p = "model.layers.0.mlp."
    tensors = load_file(str(out / "model.safetensors"))
    assert p + lost + ".weight_scale_inv" in tensors
    save_file({k: v for k, v in tensors.items() if lost not in k}, str(out / "model.safetensors"), {"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if lost not in k}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    res = runner.invoke(app, ["import", str(out), str(tmp_path / "imported")])
    assert res.exit_code == 2 and "[E601]" in res.stderr, res.stderr
    proj, j = lost.split(".")[2], lost.split(".")[1]
    code, found = findings()
    assert code == 1 and [f["code"] for f in found] == ["M025"], found
    f = found[0]
    assert f["key"] == f"{p}experts.*.{proj}.weight" and f["error_code"] == "E601", f
    assert f"experts.<j>.{proj}.weight" in f["message"] and f"but the model has 4: missing {j}" in f["message"], f


@pytest.mark.parametrize(
    ("tensors", "config", "why"),
    [
        ({"l.weight_scale_inv": torch.ones(2, 3)}, _DS_CONFIG, "a block scale for a missing weight 'l.weight'"),
        (
            {"l.weight": torch.ones(4, 4, dtype=torch.bfloat16), "l.weight_scale_inv": torch.ones(1, 1)},
            _DS_CONFIG,
            "its weight 'l.weight' is bfloat16, not float8_e4m3fn",
        ),
        (
            {"l.weight_scale": torch.ones(1)},
            {"quantization_config": {"quant_method": "fp8"}},
            "an FP8 weight scale for a missing weight 'l.weight'",
        ),
        (
            {"model.layers.0.mlp.experts.down_proj_scale_inv": torch.ones(2, 1, 1)},
            _DS_CONFIG,
            "fused expert scales for a missing weight",
        ),
    ],
)
def test_inspect_names_a_scale_with_no_float8_weight_as_validate_does(
    tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], why: str
) -> None:
    """A scale whose weight is missing or not float8, in a folder with no float8 tensor at all: validate (M020) and
    import (E612) refuse it; inspect skipped its quantized report on the dtypes alone (``quantized`` null, no line)."""
    tensors = {**tensors, "m.weight": torch.ones(2, 2)}
    src = _write_folder(tmp_path / "src", tensors, config)
    res = runner.invoke(app, ["validate", str(src), "--json"])
    scale = next(k for k in tensors if "scale" in k)
    findings = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"] if f["code"] == "M020"]
    assert res.exit_code == 1 and findings == [("M020", scale)], res.stdout
    res = runner.invoke(app, ["inspect", str(src), "--json"])
    assert res.exit_code == 0, res.stderr
    q = json.loads(res.stdout)["quantized"]
    assert q is not None and q["pairs"] == [] and [p["key"] for p in q["problems"]] == [scale], q
    assert why in q["problems"][0]["message"], q
    assert f"not pairing (validate M020/M023): {scale}: " in runner.invoke(app, ["inspect", str(src)]).stdout


def test_inspect_of_float_weights_with_scales_and_no_config_reports_nothing_quantized(tmp_path: Path) -> None:
    """A bfloat16 ``x.weight`` beside an ``x.weight_scale`` with no quantization_config: nothing says it is quantized
    (import reads both as stored), so inspect has no quantized report for it."""
    t = {"l.weight": torch.ones(4, 4, dtype=torch.bfloat16), "l.weight_scale": torch.ones(1)}
    src = _write_folder(tmp_path / "src", t, {"model_type": "llama"})
    assert json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)["quantized"] is None


def _tiny_llama_ct_folder(path: Path, ignore: list[str]) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A tiny Llama stored as compressed-tensors FP8 (channel scales) with every Linear quantized, ``lm_head``
    included; ``ignore`` written into its ``quantization_config``. Returns the folder, lm_head's codes and scale."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=40,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=20,
        vocab_size=6,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(5)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in LlamaForCausalLM(cfg).state_dict().items():
        if k.endswith("proj.weight") or k == "lm_head.weight":
            codes = torch.randint(0, 0x70, tuple(v.shape), generator=g, dtype=torch.uint8)
            tensors[k] = codes.view(torch.float8_e4m3fn)
            tensors[k + "_scale"] = torch.rand(v.shape[0], 1, generator=g) + 0.1
        else:
            tensors[k] = v.detach().clone().contiguous()
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ignore,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "float-quantized"}},
    }
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), "quantization_config": qc}))
    return path, tensors["lm_head.weight"], tensors["lm_head.weight_scale"]


@pytest.mark.parametrize("ignore", [["lm_head"], []])
def test_compressed_tensors_ignore_listing_an_fp8_module(tmp_path: Path, ignore: list[str]) -> None:
    """compressed-tensors applies no scheme to a module its ``ignore`` names: transformers' default load builds that
    module unquantized and loads its FP8 codes as its values, the scale unread (its load report: UNEXPECTED
    ``lm_head.weight_scale``), while ``dequantize=True`` and ``ckpttool import`` scale them. validate said OK; now
    M027 names it, as under ``quant_method: fp8``. Off the list, both loads scale lm_head and nothing is reported."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src, codes, scale = _tiny_llama_ct_folder(tmp_path / "ct", ignore)
    dequantized = codes.float() * scale
    deq = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    )
    assert torch.equal(deq.lm_head.weight.detach(), dequantized)
    head = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).lm_head
    res = runner.invoke(app, ["validate", str(src), "--json"])
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"] if f["code"].startswith("M")]
    if ignore:
        assert torch.equal(head.weight.detach(), codes.float())  # the codes as values
        assert res.exit_code == 1 and found == [("M027", "lm_head.weight")], res.stdout
    else:
        assert head.weight.dtype == torch.float8_e4m3fn and torch.equal(head.weight_scale.detach(), scale)
        assert res.exit_code == 0 and found == [], res.stdout


@pytest.mark.parametrize("top", ["mixed-precision", None])
def test_compressed_tensors_format_given_by_its_config_group(tmp_path: Path, top: str | None) -> None:
    """compressed-tensors compresses each module by its config group's ``format``; the top-level ``format`` is a
    summary (``mixed-precision`` where groups differ) or absent. Every group ``float-quantized`` under such a top level:
    transformers' ``dequantize=True`` load scales the FP8 weights (``q * scale``), while import refused the folder
    (E612 "format 'mixed-precision', not float-quantized") and validate reported M020. Now both read it: the import
    equals transformers' dequantization bit for bit."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src, _, _ = _tiny_llama_ct_folder(tmp_path / "ct", [])
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].pop("format")
    if top is not None:
        cfg["quantization_config"]["format"] = top
    (src / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).state_dict()
    res = runner.invoke(app, ["validate", str(src), "--deep", "--json"])
    assert res.exit_code == 0 and [f for f in json.loads(res.stdout)["findings"] if f["code"][0] == "M"] == []
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "dcp"), "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["dequantized"]["kinds"] == {"fp8-compressed-tensors": 8}
    md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    ours = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(ours, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    quantized = [k for k in ref if k.endswith("proj.weight") or k == "lm_head.weight"]
    assert len(quantized) == 8
    for k in quantized:
        assert torch.equal(ours["model." + k], ref[k].float()), k
