"""Output formats as registered plug-ins: the CLI, the JSON schema and the docs follow the registry, and a
format registered from outside the package exports through the same engine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from ckpttool.model.adapters import ADAPTERS, detect_adapter
from ckpttool.ops.export import ExportOptions, export_checkpoint
from ckpttool.ops.export.formats import ModelFormat
from ckpttool.ops.export.outputs import OUTPUT_FORMATS, OutputFormat, register_format, unregister_format

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[3] / "docs" / "export.md"


def test_the_schema_enum_is_the_registry() -> None:
    assert load_schema("export")["properties"]["format"]["enum"] == list(OUTPUT_FORMATS)


def test_the_docs_table_is_the_registry() -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("## Formats (`--format`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \|$", section, flags=re.M)
    assert rows == [(f.name, f.help) for f in OUTPUT_FORMATS.values()]


def test_the_cli_choices_and_help_are_the_registry() -> None:
    res = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.stderr
    assert f"--format <{'|'.join(OUTPUT_FORMATS)}>" in res.stdout
    help_line = "; ".join(f"{f.name}: {f.help}" for f in OUTPUT_FORMATS.values()) + "."
    assert help_line in " ".join(res.stdout.split())
    assert f"--adapter <{'|'.join(ADAPTERS)}>" in res.stdout


#: an OLMo-core Transformer's fqns (``TransformerConfig.llama_like``)
_OLMO_CORE = ["embeddings.weight", "blocks.0.attention.w_q.weight", "lm_head.norm.weight", "lm_head.w_out.weight"]


def test_adapters_detect_themselves() -> None:
    # one predicate per adapter module, no chain: each case is claimed by at most one adapter
    cases: list[tuple[str, list[str], dict[str, Any] | None, str | None]] = [
        ("hf", ["model.layers.0.mlp.up_proj.weight"], None, "hf"),
        ("unknown", ["x"], None, None),
        ("torchtitan", ["layers.0.attention.wq.weight"], None, "torchtitan-llama3"),
        ("torchtitan", ["layers.0.moe.experts.w1"], None, "torchtitan-qwen3"),
        ("torchtitan", ["layers.0.attention.q_norm.weight"], {"model_type": "llama"}, None),
        ("torchtitan", ["layers.0.attention.wq.weight"], {"model_type": "qwen3_moe"}, "torchtitan-qwen3"),
        ("torchtitan", ["layers.0.attention.wq.weight"], {"model_type": "mistral"}, None),
        ("torchtune", ["layers.0.attn.q_proj.weight"], None, "torchtune-llama"),
        ("torchtune", ["layers.0.attn.q_proj.weight"], {"model_type": "llama"}, "torchtune-llama"),
        ("torchtune", ["layers.0.attn.q_norm.weight"], None, None),
        ("torchtune", ["layers.0.attn.q_proj.weight"], {"model_type": "qwen3"}, None),
        ("megatron", ["decoder.layers.self_attention.linear_qkv.weight"], None, "megatron-gpt"),
        # OLMo-core: the keys do not say where the norms sit (llama_like or OLMo-2's reordered_norm): a config does
        ("unknown", _OLMO_CORE, {"model_type": "llama"}, "olmo-core-llama"),
        ("unknown", _OLMO_CORE, None, None),
        ("unknown", _OLMO_CORE, {"model_type": "gemma3_text"}, None),
        ("unknown", [*_OLMO_CORE, "blocks.0.attention.q_norm.weight"], {"model_type": "llama"}, None),
        ("unknown", [*_OLMO_CORE, "blocks.0.feed_forward_moe.router.weight"], {"model_type": "llama"}, None),
        ("unknown", ["x.weight"], {"model_type": "llama"}, None),
        ("unknown", [*_OLMO_CORE, "blocks.0.attention.q_norm.weight"], {"model_type": "olmo2"}, "olmo-core-olmo2"),
        ("unknown", _OLMO_CORE, {"model_type": "olmo2"}, None),
        ("unknown", [*_OLMO_CORE, "blocks.0.attention.q_norm.weight"], None, None),
        # OLMo-3 (sliding windows, config only) has OLMo-2's tensors: OLMo-core converts both with one map
        ("unknown", [*_OLMO_CORE, "blocks.0.attention.q_norm.weight"], {"model_type": "olmo3"}, "olmo-core-olmo2"),
        ("unknown", _OLMO_CORE, {"model_type": "olmo3"}, None),
        (
            "unknown",
            [*_OLMO_CORE, "blocks.0.attention.q_norm.weight", "blocks.0.feed_forward_moe.router.weight"],
            {"model_type": "olmo2"},
            None,
        ),
    ]
    for naming, fqns, config, want in cases:
        got = detect_adapter(naming, fqns, config)
        assert (got.name if got is not None else None) == want, (naming, fqns, config)


class OnePerTensor(ModelFormat):
    """A throwaway format: every source tensor in a safetensors file of its own, and a JSON list of them."""

    name = "one-per-tensor"
    help = "each tensor in its own safetensors file"

    def starts_file(self, packed: int, nbytes: int, shard_size: int) -> bool:
        return True

    def file_names(self, n: int) -> list[str]:
        return [f"tensor-{k:05d}.safetensors" for k in range(n)]

    def documents(self, plan: Any, prepared: dict[str, Any] | None) -> dict[str, bytes]:
        return {"tensors.json": json.dumps(plan.weight_map(), indent=1).encode()}

    def edited_assets(self, model_config: dict[str, Any] | None) -> dict[str, bytes]:
        # where an FP8 writer puts its quantization_config
        if model_config is None:
            return {}
        return {"config.json": json.dumps({**model_config, "quantization_config": {"one": "per-tensor"}}).encode()}


@pytest.fixture
def one_per_tensor() -> Iterator[OutputFormat]:
    fmt = register_format(OnePerTensor())
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)


def test_a_format_registered_outside_the_package_exports(
    one_per_tensor: OutputFormat, sample_ckpt: Path, tmp_path: Path
) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text('{"architectures": ["Sample"]}')
    (assets / "tokenizer.json").write_text('{"tokens": []}')
    ref = export_checkpoint(sample_ckpt, tmp_path / "hf", ExportOptions())
    res = export_checkpoint(sample_ckpt, tmp_path / "one", ExportOptions(fmt=one_per_tensor.name, model_assets=assets))
    assert res.format == "one-per-tensor" and res.tensors == ref.tensors and res.bytes == ref.bytes
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    files = [f"tensor-{k:05d}.safetensors" for k in range(res.tensors)]
    assert names == sorted([*files, "tensors.json", "config.json", "tokenizer.json", ".ckpttool-output.json"])
    assert json.loads((tmp_path / "one" / "config.json").read_text()) == {
        "architectures": ["Sample"],
        "quantization_config": {"one": "per-tensor"},
    }
    assert (tmp_path / "one" / "tokenizer.json").read_bytes() == (assets / "tokenizer.json").read_bytes()
    where = json.loads((tmp_path / "one" / "tensors.json").read_text())
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(where) == sorted(index) and sorted(where.values()) == files
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as whole:
        for key, name in where.items():
            with safe_open(str(tmp_path / "one" / name), "pt") as f:
                assert list(f.keys()) == [key]
                got, want = f.get_tensor(key), whole.get_tensor(key)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(
                    got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
                )


def test_an_unregistered_format_is_a_usage_error(sample_ckpt: Path, tmp_path: Path) -> None:
    from ckpttool.errors import UsageError

    with pytest.raises(UsageError, match=r"`fmt` 'fp8' is not one of hf, lora, hf-merged"):
        export_checkpoint(sample_ckpt, tmp_path / "o", ExportOptions(fmt="fp8"))


def test_olmo_core_llama_refuses_what_llama_has_no_place_for() -> None:
    """An OLMo-core tensor LlamaForCausalLM lacks (q/k norm, MoE, a bias) is refused by name, never dropped."""
    from ckpttool.errors import ExportError
    from ckpttool.model.adapters import AdapterConfig, HFTensor, get_adapter

    ad = get_adapter("olmo-core-llama")
    got = ad.to_hf("blocks.1.attention_norm.weight", (64,), AdapterConfig())
    assert isinstance(got, HFTensor) and got.key == "model.layers.1.input_layernorm.weight"
    for fqn in (
        "blocks.0.attention.q_norm.weight",
        "blocks.0.feed_forward_moe.router.weight",
        "blocks.0.attention.w_q.bias",
    ):
        with pytest.raises(
            ExportError, match=f"{re.escape(fqn)}: OLMo-core tensor with no place in HF LlamaForCausalLM"
        ):
            ad.to_hf(fqn, (64,), AdapterConfig())


def test_olmo_core_olmo2_refuses_a_head_wise_qk_norm() -> None:
    """Olmo2's q/k norms span all heads; OLMo-core's head-wise one (use_head_qk_norm, [head_dim]) is refused."""
    from ckpttool.errors import ExportError
    from ckpttool.model.adapters import AdapterConfig, HFTensor, get_adapter

    ad = get_adapter("olmo-core-olmo2")
    cfg = AdapterConfig.from_hf_config({"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64})
    got = ad.to_hf("blocks.0.attention.k_norm.weight", (32,), cfg)
    assert isinstance(got, HFTensor) and got.key == "model.layers.0.self_attn.k_norm.weight"
    with pytest.raises(
        ExportError, match=r"blocks\.0\.attention\.q_norm\.weight: shape \[16\] is not Olmo2's q/k norm"
    ):
        ad.to_hf("blocks.0.attention.q_norm.weight", (16,), cfg)
    with pytest.raises(ExportError, match="no place in HF Olmo2ForCausalLM"):
        ad.to_hf("blocks.0.feed_forward_moe.router.weight", (8, 64), cfg)
