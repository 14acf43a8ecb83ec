"""Megatron-core saves with its less-used options (``tests/fixtures/megatron.py``, each built and saved by
megatron-core's own code on gloo ranks): pipeline parallel 2, ``fully_parallel_save``, MoE with grouped GEMM
(``GroupedMLP``), ``singleton_local_shards`` (every layer and expert its own key), and the ``DistributedOptimizer``
of an MoE model (a ``ChainedOptimizer``) saved with Megatron-LM's metadata.

References: megatron's own forward of the saved weights (``model.json``) for the exports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.megatron import megatron_run

pytestmark = pytest.mark.heavy  # megatron-core's training and save on 2 gloo ranks: 30-50 s a run

runner = CliRunner()


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def _export_logits(run: Path, tmp_path: Path, moe: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the HF model ``export`` wrote, megatron's own logits of the saved weights)."""
    from transformers import AutoModelForCausalLM

    from tests.ops.test_megatron_export import _assets

    doc = json.loads((run / "model.json").read_text())
    out = tmp_path / "hf"
    cli("export", str(run), str(out), "--model-assets", str(_assets(tmp_path, moe, doc)))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(doc["input_ids"])).logits.float()
    return logits, torch.tensor(doc["logits"])


@pytest.mark.parametrize(
    ("name", "moe", "atol"),
    [
        ("dense_pp2", False, 1e-5),
        ("moe_gg", True, 1e-2),
        ("moe_tp2_ep2", True, 1e-5),
        ("dense_tp2_fp32", False, 1e-5),
        ("moe_pp2", True, 1e-5),
        ("moe_ep2_async", True, 1e-5),
    ],
)
def test_pipeline_and_grouped_gemm_saves_read_validate_export(
    name: str, moe: bool, atol: float, tmp_path: Path
) -> None:
    """PP 2 (each stage saves its layers at their global index; embedding on stage 0, output layer on stage 1),
    grouped GEMM experts (saved in SequentialMLP's layout), MoE with TP 2 beside EP 2 (expert tensor parallel 1: the
    dense layers split by TP, the experts by EP), fp32 TP 2 (FP32Optimizer), MoE with PP 2 and MoE saved with
    ``async_sharded_save`` (Megatron-LM's --async-save): validate --strict --deep passes,
    replay-step matches torch's AdamW, the export gives megatron's logits."""
    run = megatron_run(f"megatron-{name}", name)
    doc = json.loads(cli("validate", str(run), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["warning"] == 0, doc["findings"]
    doc = json.loads(cli("replay-step", str(run), "--device", "cpu", "--json"))
    assert doc["ok"] and doc["params"], doc
    logits, ref = _export_logits(run, tmp_path, moe)
    assert torch.allclose(logits, ref, atol=atol, rtol=0), (logits - ref).abs().max()


def test_singleton_local_shards_export_gives_megatrons_logits(tmp_path: Path) -> None:
    """Saved with ``singleton_local_shards`` (Megatron-LM 0.14's ``--dist-ckpt-save-pre-mcore-014``): every layer its own
    key (``decoder.layers.<i>.``) and every expert too, its ``linear_fc1`` as ``weight_w`` (gate) and ``weight_v``
    (up). Before: export refused it, E605 'missing 18: model.layers.0.self_attn.q_proj.weight' (the adapter mapped
    stacked keys only); now each key goes to its layer's HF tensors, the experts into Mixtral's fused tensors."""
    run = megatron_run("megatron-moe-singleton", "moe_singleton")
    logits, ref = _export_logits(run, tmp_path, True)
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0), (logits - ref).abs().max()
    # a part of a fused expert tensor left out: refused, never a tensor with unwritten elements
    res = runner.invoke(
        app,
        ["export", str(run), str(tmp_path / "part"), "--model-assets", str(tmp_path / "assets"),
         "--filter", "decoder.layers.0.mlp.experts.experts.[0-2].*"],
    )  # fmt: skip
    assert res.exit_code == 2 and "fill 9216 of its 12288 elements" in res.stderr, res.stderr
    assert not (tmp_path / "part").exists()


def test_chained_dp_reshardable_buckets_are_not_model_tensors() -> None:
    """An MoE model's DistributedOptimizer (a ChainedOptimizer: dense, expert) saved ``dp_reshardable``, Megatron-LM's
    default: its buckets are ``chained_N.optimizer.distributed.*``. Before: they were catalogued as model tensors
    (inspect: '19 tensors (19 model'), and validate --deep read their unwritten padding as uninitialised weights
    (D013 'chained_0.optimizer.distributed...exp_avg: 29 with |x| > 10000'); now they are the optimizer's
    buffers not mapped to parameters, K002 as in a dense model's save."""
    run = megatron_run("megatron-moe-distopt-dp", "moe_ep2_distopt_dp")
    doc = json.loads(cli("inspect", str(run), "--json"))
    assert [t["key"] for t in doc["model"] if t["key"].startswith("chained_")] == []
    assert doc["summary"]["model_tensor_count"] == 10, doc["summary"]
    res = runner.invoke(app, ["validate", str(run), "--deep", "--json"])
    found = json.loads(res.stdout)["findings"]
    assert res.exit_code == 0 and sorted({f["code"] for f in found}) == ["K002"], found
    assert "9 tensor(s) outside the megatron key schema: 'chained_0.optimizer.distributed." in found[0]["message"]


def test_unprefixed_chained_optimizer_groups_hold_the_expert_parameters() -> None:
    """Megatron-LM's save metadata sets ``chained_optim_avoid_prefix``: a ``fully_reshardable`` DistributedOptimizer
    of an MoE model (dense + expert ChainedOptimizer) saves its state without ``chained_N.``. Before: every parameter
    was counted in the dense optimizer's groups (group 0: 7 parameters) and the expert optimizer's group was reported
    with 0 parameters and 'no state (never stepped)'; now the expert parameters are its group's, as megatron's
    ``get_megatron_optimizer`` chains them (dense first, then expert-parallel)."""
    run = megatron_run("megatron-moe-distopt", "moe_ep2_distopt")
    groups = json.loads(cli("inspect", str(run), "--json"))["optimizer"]["param_groups"]
    assert [(g["params"], g["has_state"]) for g in groups] == [(5, True), (3, True), (2, True)], groups
    assert sorted(groups[2]["example_params"]) == [
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc2.weight",
    ]
    doc = json.loads(cli("validate", str(run), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["warning"] == 0, doc["findings"]
    doc = json.loads(cli("replay-step", str(run), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 10, doc


def test_model_only_save_is_read_as_weights_only() -> None:
    """Megatron-LM's ``--no-save-optim``: ``dist_checkpointing.save`` of the model alone (``common.pt`` without an
    optimizer). validate passes and says the optimizer rules were skipped for want of state; replay-step refuses
    (E514), never a replay over state that is not there."""
    run = megatron_run("megatron-dense1-noopt", "dense1_noopt")
    doc = json.loads(cli("validate", str(run), "--strict", "--deep", "--json"))
    assert doc["ok"] and not doc["findings"], doc["findings"]
    res = runner.invoke(app, ["replay-step", str(run), "--device", "cpu"])
    assert res.exit_code == 2 and "[E514]" in res.stderr and "no optimizer param groups" in res.stderr, res.output
