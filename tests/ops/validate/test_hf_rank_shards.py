"""``HuggingFaceStorageWriter(save_distributed=True)`` folders with a rank's shard files deleted.

torch records no world size and no global shape in these folders (``hf_storage.py``: each rank writes
``shard-0000R-model-0000I-of-0000N.safetensors`` with ``DCP_SHARDING_INFO`` offsets; its reader takes each tensor's
size as the largest extent of the pieces it finds). Fixtures are torch's own writer on 2 and 3 gloo ranks
(tests/fixtures/hf_shards.py: ``Shard(0)``, ``Shard(1)`` and replicated DTensors of a transformers Llama). A rank
missing in the middle is a gap in the rank numbers (``E202``); a last rank missing leaves pieces that tile a
smaller model, so only a config's model class or torch's consolidated copy can prove the shapes: without them
validate warns (``S017``), ``--strict`` fails, and export / inspect / stats say so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.hf_storage import load_hf_storage_metadata

runner = CliRunner()


def validate(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def codes(doc: dict[str, Any]) -> set[str]:
    return {f["code"] for f in doc["findings"]}


def full_shapes() -> dict[str, tuple[int, ...]]:
    from tests.fixtures.writers import hf_llama

    return {k: tuple(v.shape) for k, v in hf_llama().state_dict().items()}


def without_rank(src: Path, dst: Path, rank: int) -> Path:
    """A copy of ``src`` with writing rank ``rank``'s files (``shard-0000{rank+1}-*``) deleted."""
    shutil.copytree(src, dst)
    gone = list(dst.glob(f"shard-{rank + 1:05d}-model-*.safetensors"))
    assert gone
    for p in gone:
        p.unlink()
    return dst


@pytest.mark.parametrize("world", [2, 3])
def test_intact_folder_without_evidence_is_not_called_complete(hf_shards_root: Path, world: int) -> None:
    src = hf_shards_root / f"w{world}" / "sharded"
    md = load_hf_storage_metadata(src)
    assert {k: e.size for k, e in md.entries.items()} == full_shapes()  # torch's own shapes
    assert md.shards is not None and md.shards.ranks == tuple(range(world)) and md.shards.verified_by is None
    rc, doc = validate(src)
    assert rc == 0 and codes(doc) == {"S017"}, doc["findings"]
    (f,) = doc["findings"]
    assert f["severity"] == "warning" and str(src) in f["message"] and f"{world} writing rank(s)" in f["message"]
    rc, doc = validate(src, "--strict")
    assert rc == 1 and codes(doc) == {"S017"}


@pytest.mark.parametrize("world", [2, 3])
def test_config_beside_or_given_proves_an_intact_folder(hf_shards_root: Path, world: int) -> None:
    rc, doc = validate(hf_shards_root / f"w{world}" / "with_config", "--strict")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    cfg = hf_shards_root / f"w{world}" / "with_config" / "config.json"
    rc, doc = validate(hf_shards_root / f"w{world}" / "sharded", "--strict", "--config", cfg)
    assert rc == 0 and doc["findings"] == [], doc["findings"]


@pytest.mark.parametrize("world", [2, 3])
def test_last_rank_deleted_is_not_ok(hf_shards_root: Path, tmp_path: Path, world: int) -> None:
    """The pieces left tile a smaller model (torch's own reader builds the same short shapes): never OK."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    cut = without_rank(hf_shards_root / f"w{world}" / "sharded", tmp_path / "cut", world - 1)
    before = sorted((p.name, p.stat().st_size) for p in cut.iterdir())
    torch_md = HuggingFaceStorageReader(str(cut)).read_metadata()
    ours = load_hf_storage_metadata(cut)
    assert {k: tuple(v.size) for k, v in torch_md.state_dict_metadata.items()} == {
        k: e.size for k, e in ours.entries.items()
    }
    assert ours.entries["model.embed_tokens.weight"].size != full_shapes()["model.embed_tokens.weight"]
    rc, doc = validate(cut, "--strict")
    assert rc == 1 and codes(doc) == {"S017"}, doc["findings"]
    res = runner.invoke(app, ["inspect", str(cut), "--json"])
    assert res.exit_code == 0 and str(cut) in json.loads(res.stdout)["unproven_shards"]
    res = runner.invoke(app, ["inspect", str(cut)])
    assert f"warning: {cut}: the shard files of {world - 1} writing rank(s)" in res.stderr
    res = runner.invoke(app, ["stats", str(cut)])
    assert res.exit_code == 0 and f"warning: {cut}: the shard files" in res.stderr
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.stderr
    (w,) = [w for w in json.loads(res.stdout)["warnings"] if "shard files" in w]
    assert str(cut) in w and "--model-assets" in w
    # with the model's config the shortfall is an error: validate M010, export E605
    cfg = hf_shards_root / f"w{world}" / "with_config" / "config.json"
    shutil.copy(cfg, cut / "config.json")
    rc, doc = validate(cut)
    assert rc == 1 and codes(doc) == {"M010"}, doc["findings"]
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "o2"), "--model-assets", str(cut)])
    assert res.exit_code != 0 and "[E605]" in res.stderr and not (tmp_path / "o2").exists()
    (cut / "config.json").unlink()
    assert sorted((p.name, p.stat().st_size) for p in cut.iterdir()) == before  # the source is never modified


@pytest.mark.parametrize(("world", "rank"), [(3, 1), (3, 0), (2, 0)])
def test_rank_gap_is_incomplete(hf_shards_root: Path, tmp_path: Path, world: int, rank: int) -> None:
    cut = without_rank(hf_shards_root / f"w{world}" / "sharded", tmp_path / "cut", rank)
    rc, doc = validate(cut)
    assert rc == 2 and "E202" in json.dumps(doc["findings"]), doc["findings"]
    assert f"no file of writing rank {rank} (shard-{rank + 1:05d}-model-*.safetensors)" in json.dumps(doc)
    for cmd in (["inspect", str(cut)], ["stats", str(cut)], ["export", str(cut), str(tmp_path / "out")]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and "[E202]" in res.stderr and "Traceback" not in res.stderr, (cmd, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 2  # error line + hint
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world", [2, 3])
def test_consolidated_copy_proves_or_refuses_the_shards(hf_shards_root: Path, tmp_path: Path, world: int) -> None:
    """torch's ``enable_consolidation`` writes the full tensors above ``sharded/``: the shards must equal them."""
    from safetensors import safe_open

    top = hf_shards_root / f"w{world}" / "consolidated"
    with safe_open(str(top / "model-00001-of-00001.safetensors"), framework="pt") as f:
        torch_full = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    md = load_hf_storage_metadata(top / "sharded")
    assert {k: e.size for k, e in md.entries.items()} == torch_full
    assert md.shards is not None and md.shards.verified_by == str(top)
    rc, doc = validate(top / "sharded", "--strict")
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    res = runner.invoke(app, ["inspect", str(top / "sharded"), "--json"])
    assert "unproven_shards" not in json.loads(res.stdout) and "warning" not in res.stderr
    rc, doc = validate(top, "--strict")  # the consolidated copy itself: unchanged
    assert rc == 0 and doc["findings"] == []
    copy = tmp_path / "c"
    shutil.copytree(top, copy)
    for p in (copy / "sharded").glob(f"shard-{world:05d}-*"):
        p.unlink()
    rc, doc = validate(copy / "sharded")
    assert rc == 2 and "E202" in json.dumps(doc["findings"]) and "consolidated copy" in json.dumps(doc)
    res = runner.invoke(app, ["export", str(copy / "sharded"), str(tmp_path / "out")])
    assert res.exit_code == 2 and "[E202]" in res.stderr and not (tmp_path / "out").exists()


def test_a_rank_without_one_of_the_files_the_others_wrote_is_named(hf_shards_root: Path, tmp_path: Path) -> None:
    """``fqn_to_index_mapping``: every rank writes ``model-00001`` and ``model-00002``; the last rank's second file
    deleted leaves pieces that tile (no rank number missing): the finding names the file index it lacks."""
    src = hf_shards_root / "w3" / "indexed"
    assert len(list(src.glob("shard-*"))) == 6
    rc, doc = validate(src)
    assert rc == 0 and codes(doc) == {"S017"} and "wrote no model-" not in doc["findings"][0]["message"]
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    (cut / "shard-00003-model-00002-of-00002.safetensors").unlink()
    md = load_hf_storage_metadata(cut)
    assert md.shards is not None and md.shards.ranks == (0, 1, 2) and md.shards.index_gaps == ((2, 2),)
    rc, doc = validate(cut, "--strict")
    assert rc == 1 and codes(doc) == {"S017"}, doc["findings"]
    assert "rank 2 wrote no model-00002 file while other ranks did" in doc["findings"][0]["message"]
    cfg = hf_shards_root / "w3" / "with_config" / "config.json"
    rc, doc = validate(cut, "--config", cfg)
    assert rc == 1 and codes(doc) == {"M010"}, doc["findings"]


def test_config_beside_is_named_where_inspect_cannot_check_it(hf_shards_root: Path, tmp_path: Path) -> None:
    """inspect reads no model class: with the config beside the shards, its warning names that config (what
    validate checks them against) and export's --model-assets, not "pass a config"."""
    src = hf_shards_root / "w3" / "with_config"
    res = runner.invoke(app, ["inspect", str(src), "--json"])
    note = json.loads(res.stdout)["unproven_shards"]
    assert f"check them against the model class of {src / 'config.json'} (`ckpttool validate` and `export` do)" in note


@pytest.mark.parametrize("world", [2, 3])
def test_export_checks_the_shards_against_the_config_beside_them(
    hf_shards_root: Path, tmp_path: Path, world: int
) -> None:
    """export of a save_distributed folder whose last rank's files were deleted, with the model's config.json beside
    the shards (validate: M010), wrote a model of short shapes, exit 0, with a warning only. It now checks the shards
    against that config as validate does: E605 naming the config and the shortfall, nothing written; the intact
    folder exports with no warning, the tensors equal to torch's own reader's."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    src = hf_shards_root / f"w{world}" / "with_config"
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "ok"), "--json"])
    assert res.exit_code == 0, res.stderr
    assert not [w for w in json.loads(res.stdout)["warnings"] if "shard files" in w]
    got = {}
    for f in sorted((tmp_path / "ok").glob("*.safetensors")):
        got.update(load_file(f))
    assert {k: tuple(v.shape) for k, v in got.items()} == full_shapes()
    reader = HuggingFaceStorageReader(str(src))
    assert {k: tuple(v.size) for k, v in reader.read_metadata().state_dict_metadata.items()} == full_shapes()
    cut = without_rank(src, tmp_path / "cut", world - 1)
    before = sorted((p.name, p.stat().st_size) for p in cut.iterdir())
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "out")])
    assert res.exit_code == 2 and not (tmp_path / "out").exists(), res.stderr
    err = res.stderr.splitlines()
    assert err[0].startswith(f"error: [E605] the export does not fit LlamaForCausalLM built from {cut / 'config.json'}")
    assert "shape " in err[0] and err[1].startswith("hint: a rank's shard files are missing"), err
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "out"), "--allow-mismatch", "shape,missing"])
    assert res.exit_code == 0, res.stderr
    assert sorted((p.name, p.stat().st_size) for p in cut.iterdir()) == before  # the source is never modified


def test_files_that_disagree_on_the_number_of_model_files_are_two_saves(hf_shards_root: Path, tmp_path: Path) -> None:
    """torch's writer names every rank's files with the same ``of-0000N``: a file saying otherwise is another save's."""
    cut = tmp_path / "mixed"
    shutil.copytree(hf_shards_root / "w3" / "sharded", cut)
    (cut / "shard-00003-model-00001-of-00001.safetensors").rename(cut / "shard-00003-model-00001-of-00002.safetensors")
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "out")])
    assert res.exit_code == 2 and "[E200]" in res.stderr and "disagree on the number of model files" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["qwen_moe", "mixtral"])
def test_export_of_per_expert_shards_with_their_config_beside_is_not_a_shortfall(
    fixture_root: Path, tmp_path: Path, family: str
) -> None:
    """A MoE saved per expert (the names ``save_pretrained`` and the trainers' HF adapters write:
    ``mlp.experts.<j>.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.<j>.w1.weight``) by torch's
    ``HuggingFaceStorageWriter(save_distributed=True)``, its config.json beside: export refused it (E605, the fused
    ``experts.gate_up_proj`` of the transformers v5 model class 'missing') while validate --strict said OK. It
    exports as validate checks it (the experts folded as transformers loads them), the tensors those saved; a folder
    with one expert's files gone is still E605."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    src = cached_build(fixture_root, "moe_expert_forms", hf_models.build_moe_expert_forms) / family / "per_expert"
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(f))
    assert any(".experts.3." in k for k in sd)

    def save(state: dict[str, Any], out: Path) -> Path:
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
        shutil.copy(src / "config.json", out / "config.json")
        return out

    shards = save(sd, tmp_path / "shards")
    assert [p.name for p in shards.glob("*.safetensors")] == ["shard-00001-model-00001-of-00001.safetensors"]
    rc, doc = validate(shards, "--strict")
    assert rc == 0 and not codes(doc) & {"M010", "S017"}, doc
    res = runner.invoke(app, ["export", str(shards), str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.stderr
    assert not [w for w in json.loads(res.stdout)["warnings"] if "shard files" in w]
    got = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(f))
    assert got.keys() == sd.keys() and all(got[k].equal(v) for k, v in sd.items())

    # the model's config given (--model-assets): checked the same way (was E605 'missing experts.gate_up_proj'),
    # and the folder loads in transformers with the logits of the per-expert folder saved
    res = runner.invoke(app, ["export", str(shards), str(tmp_path / "given"), "--model-assets", str(src)])
    assert res.exit_code == 0, res.stderr
    import torch
    import transformers

    ids = torch.tensor([[1, 5, 9, 2, 7]])
    logits = []
    for folder in (src, tmp_path / "given"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])

    cut = save({k: v for k, v in sd.items() if ".experts.3." not in k}, tmp_path / "cut")
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "cut_out")])
    assert res.exit_code == 2 and not (tmp_path / "cut_out").exists(), res.stderr
    assert res.stderr.startswith("error: [E605] the export does not fit ") and "missing " in res.stderr, res.stderr
    res = runner.invoke(app, ["export", str(cut), str(tmp_path / "cut_given"), "--model-assets", str(src)])
    assert res.exit_code == 2 and "[E605]" in res.stderr and not (tmp_path / "cut_given").exists(), res.stderr
