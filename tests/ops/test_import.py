"""`ckpttool import HF_DIR OUT`: HF safetensors -> DCP, loaded by torch's own `dcp.load` into real models.

References: `save_pretrained` directories of tiny transformers models; torch's `dcp.load`
(single process, and 2 gloo ranks into an FSDP2 model); torchtitan's own `_reverse_permute`
for the torchtitan schema; bitwise round trips through `ckpttool export`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.import_hf import torch_chunk_rows
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.export.test_export import read_export, torch_load

runner = CliRunner()


@pytest.fixture(scope="session")
def hf_dirs(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "import_hf_dirs", hf_models.build_hf_dirs)


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def cli(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_torch_chunk_rows_match_torch_chunk() -> None:
    for rows in (0, 1, 5, 7, 8, 96):
        for ws in (1, 2, 3, 4, 8):
            got = [n for _, n in torch_chunk_rows(rows, ws)]
            want = [c.shape[0] for c in torch.arange(rows).chunk(ws)]
            assert got[: len(want)] == want and sum(got) == rows


@pytest.mark.parametrize(
    "name,cls", [("llama", "LlamaForCausalLM"), ("llama_tied", "LlamaForCausalLM"), ("qwen_moe", "Qwen3MoeForCausalLM")]
)
def test_import_loads_into_the_model_with_identical_logits(hf_dirs: Path, tmp_path: Path, name: str, cls: str) -> None:
    import transformers

    src = hf_dirs / name
    doc = cli("import", str(src), str(tmp_path / "dcp"))
    assert doc["key_schema"] == "torch-native"
    model_cls = getattr(transformers, cls)
    hf_models.assert_dcp_logits(
        model_cls(transformers.AutoConfig.from_pretrained(src)), tmp_path / "dcp", src / "reference.pt"
    )


def test_hf_dcp_hf_round_trip_is_bitwise(hf_dirs: Path, tmp_path: Path) -> None:
    for name in ("llama", "qwen_moe"):
        src = hf_dirs / name
        cli("import", str(src), str(tmp_path / name / "dcp"), "--world-size", "3")
        experts = ("--experts", "per-expert") if name == "qwen_moe" else ()  # save_pretrained wrote per-expert keys
        cli("export", str(tmp_path / name / "dcp"), str(tmp_path / name / "hf"), "--model-assets", str(src), *experts)
        got, _ = read_export(tmp_path / name / "hf")
        want = hf_tensors(src)
        assert set(got) == set(want)
        assert all(bitwise(got[k], want[k]) for k in want)


def test_dcp_hf_dcp_round_trip_is_bitwise(fixture_root: Path, tmp_path: Path) -> None:
    src = cached_build(fixture_root, "export_llama", hf_models.build_llama)
    cli("export", str(src), str(tmp_path / "hf"), "--model-assets", str(src / "model_assets"))
    cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    a, b = torch_load(src), torch_load(tmp_path / "dcp")
    assert set(a) == set(b) and all(bitwise(a[k], b[k]) for k in a)


def test_torchtitan_schema_equals_torchtitans_reverse_permute(hf_dirs: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models.llama3.state_dict_adapter")
    from transformers import AutoConfig

    src = hf_dirs / "llama"
    doc = cli("import", str(src), str(tmp_path / "t"), "--schema", "torchtitan")
    assert doc["adapter"] == "torchtitan-llama3"
    want = hf_models.hf_to_titan_llama(hf_tensors(src), AutoConfig.from_pretrained(src))
    got = torch_load(tmp_path / "t")
    assert set(got) == set(want) and all(bitwise(got[k], want[k]) for k in want)
    # and back through the export adapter: HF -> torchtitan DCP -> HF is the identity
    cli("export", str(tmp_path / "t"), str(tmp_path / "hf"), "--model-assets", str(src))
    back, _ = read_export(tmp_path / "hf")
    orig = hf_tensors(src)
    assert set(back) == set(orig) and all(bitwise(back[k], orig[k]) for k in orig)


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_torchtitan_qwen_moe_import_splits_and_stacks_experts(hf_dirs: Path, tmp_path: Path, experts: str) -> None:
    from transformers import AutoConfig

    src = hf_dirs / "qwen_moe"  # save_pretrained writes per-expert keys
    hf = tmp_path / "hf"
    cli("import", str(src), str(tmp_path / "d0"))
    cli("export", str(tmp_path / "d0"), str(hf), "--experts", experts, "--model-assets", str(src))
    fused, _ = read_export(tmp_path / "hf") if experts == "fused" else (None, None)
    cli("import", str(hf), str(tmp_path / "t"), "--schema", "torchtitan")
    if fused is None:
        cli("export", str(tmp_path / "d0"), str(tmp_path / "f"), "--model-assets", str(src))
        fused, _ = read_export(tmp_path / "f")
    want = hf_models.hf_to_titan_qwen_moe(fused, AutoConfig.from_pretrained(src))
    want = {k: v for k, v in want.items() if "expert_bias" not in k}
    got = torch_load(tmp_path / "t")
    assert set(got) == set(want), set(got) ^ set(want)
    assert all(bitwise(got[k], want[k]) for k in want)


def _fsdp_rank(rank: int, world: int, src: str, ckpt: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(rank + 100)  # every rank starts from different random weights
    model = LlamaForCausalLM(AutoConfig.from_pretrained(src))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sd = get_model_state_dict(model)
    dcp.load({"model": sd}, checkpoint_id=ckpt)
    set_model_state_dict(model, sd)
    ref = hf_tensors(Path(src))
    for k, v in get_model_state_dict(model).items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert torch.equal(full, ref[k]), k


@pytest.mark.slow
@pytest.mark.heavy
def test_pre_sharded_import_loads_into_a_2_rank_fsdp2_model(hf_dirs: Path, tmp_path: Path) -> None:
    from tests.fixtures.distributed import run_ranks

    doc = cli("import", str(hf_dirs / "llama"), str(tmp_path / "d"), "--world-size", "2")
    assert sorted(f["name"] for f in doc["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    md = dcp.FileSystemReader(str(tmp_path / "d")).read_metadata()
    emb = md.state_dict_metadata["model.model.embed_tokens.weight"]
    assert [tuple(c.offsets) for c in emb.chunks] == [(0, 0), (48, 0)]  # Shard(0): 96 rows -> 48 + 48
    run_ranks(2, _fsdp_rank, str(hf_dirs / "llama"), str(tmp_path / "d"))


def test_missing_shard_is_refused(hf_dirs: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(hf_dirs / "llama", d)
    next(iter(sorted(d.glob("*.safetensors")))).unlink()
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and "index lists" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_a_folder_missing_a_layer_is_refused_before_dcp_load_would_fail(hf_dirs: Path, tmp_path: Path) -> None:
    """A single-file folder without layer 1 (no index to name it) imported "OK"; torch's own dcp.load into the
    model then failed on the missing keys. Import now compares the folder with the model class of its
    config.json first (E605, nothing written); `--allow-mismatch missing` imports it with a warning."""
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.api import CheckpointException

    d = tmp_path / "partial"
    d.mkdir()
    (d / "config.json").write_bytes((hf_dirs / "llama" / "config.json").read_bytes())
    full = hf_tensors(hf_dirs / "llama")
    save_file({k: v for k, v in full.items() if ".layers.1." not in k}, str(d / "model.safetensors"))
    n_missing = sum(".layers.1." in k for k in full)
    cli("import", str(d), str(tmp_path / "forced"), "--allow-mismatch", "missing")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d))
    with pytest.raises(CheckpointException) as raised:  # the reference: what the trainer's own load meets
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "forced"), no_dist=True)
    assert "Missing key in checkpoint state_dict: model.model.layers.1." in str(raised.value.failures)

    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    err = res.stderr.splitlines()
    assert err[0].startswith(
        f"error: [E605] the import does not fit LlamaForCausalLM built from config.json: missing {n_missing}: "
        "model.layers.1."
    ), err
    assert err[1].startswith("hint: dcp.load into this model would fail;") and "--allow-mismatch missing" in err[1]
    doc = cli("import", str(d), str(tmp_path / "o"), "--allow-mismatch", "missing")
    assert doc["model_check"]["model_class"] == "LlamaForCausalLM"
    assert len(doc["model_check"]["findings"]["missing"]) == n_missing
    assert doc["warnings"][0].startswith(f"{n_missing} missing key(s) against LlamaForCausalLM (allowed): ")
    doc = cli("import", str(hf_dirs / "qwen_moe"), str(tmp_path / "moe"))  # per-expert keys, fused in the model
    assert doc["model_check"] == {
        "checked": True, "model_class": "Qwen3MoeForCausalLM", "not_checked": None, "findings": {}
    } and doc["warnings"] == []  # fmt: skip


def _titan_load_rank(rank: int, world: int, root: str) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
    from transformers import AutoConfig

    from tests.fixtures.writers import _titan_llama

    r = Path(root)
    model = _titan_llama().build()
    model.init_states(buffer_device=torch.device("cpu"))
    optims = OptimizersContainer(default_adamw(lr=1e-3, implementation="for-loop"), model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optims, training_steps=10)
    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", initial_load_path=str(r / "imported"), initial_load_model_only=True
    )
    ckpt = CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optims,
        lr_schedulers=scheds,
        states={},
        sd_adapter=None,
        base_folder=str(r / "run"),
    )
    assert ckpt.load()
    ckpt.close()
    want = hf_models.hf_to_titan_llama(hf_tensors(r / "hf"), AutoConfig.from_pretrained(r / "hf"))
    got = model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
@pytest.mark.heavy
def test_torchtitan_checkpoint_manager_loads_the_imported_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.components.checkpoint")
    from torchtitan.models.common import compute_ffn_hidden_dim
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.distributed import run_ranks
    from tests.fixtures.writers import LLAMA_CFG

    c = LLAMA_CFG
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["dim"],
        intermediate_size=compute_ffn_hidden_dim(c["dim"], multiple_of=32),
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"],
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    cli("import", str(tmp_path / "hf"), str(tmp_path / "imported"), "--schema", "torchtitan")
    run_ranks(1, _titan_load_rank, str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "symlink_out", "offsets_past_end"])
def test_hostile_safetensors_are_refused_cleanly(hf_dirs: Path, tmp_path: Path, damage: str) -> None:
    import shutil
    import struct

    d = tmp_path / "h"
    shutil.copytree(hf_dirs / "llama", d)
    f = sorted(d.glob("*.safetensors"))[0]
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "symlink_out":
        (tmp_path / "outside.safetensors").write_bytes(f.read_bytes())
        f.unlink()
        f.symlink_to(tmp_path / "outside.safetensors")
    else:
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        k = next(k for k in header if k != "__metadata__")
        header[k]["data_offsets"] = [0, 10**12]
        text = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and not p.is_symlink()}
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-2].startswith("error: [E"), res.stderr
    assert not (tmp_path / "o").exists()
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and not p.is_symlink()} == before


@pytest.mark.parametrize("p, f", [(2, 2), (4, 2)])  # 8 experts: 2 per rank; 1 per rank over 8 ranks
def test_ep_pre_sharded_import_matches_reshard_and_round_trips(hf_dirs: Path, tmp_path: Path, p: int, f: int) -> None:
    """`--ep-size P --ep-fsdp-size F`: experts where a canonical (EP, EP-FSDP) mesh puts them.

    References: torch's own reader (`dcp.FileSystemReader` metadata, `dcp.load`), nested
    `torch.chunk` (DTensor `(Shard(0), Shard(0))` over the `(ep, ep_fsdp)` mesh, rank `e * F + f`),
    `ckpttool reshard` of the plain import to the same sizes, and the source safetensors bytes.
    """
    src = hf_dirs / "qwen_moe"  # save_pretrained: per-expert keys, fused on import
    ep = tmp_path / "ep"
    doc = cli("import", str(src), str(ep), "--ep-size", str(p), "--ep-fsdp-size", str(f))
    assert (doc["ep_size"], doc["ep_fsdp_size"], doc["world_size"]) == (p, f, p * f)
    assert doc["ep_tensors"] == 4  # gate_up_proj and down_proj of 2 layers
    assert sorted(x["name"] for x in doc["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(p * f)]
    res = runner.invoke(app, ["validate", "--strict", str(ep)])
    assert res.exit_code == 0, res.stdout
    layout = cli("inspect", str(ep))["layout"]
    assert (layout["version"], layout["parallel"]["ep_size"], layout["parallel"]["ep_fsdp_size"]) == (2, p, f)
    # placement: the expert chunks of each rank are torch.chunk(torch.chunk(E, P)[e], F)[f], rank e * F + f
    plain = tmp_path / "plain"
    cli("import", str(src), str(plain))
    full = torch_load(plain)
    md = dcp.FileSystemReader(str(ep)).read_metadata()
    key = "model.model.layers.0.mlp.experts.gate_up_proj"
    rows = torch.arange(full[key].shape[0])
    want = {e * f + j: c for e, group in enumerate(torch.chunk(rows, p)) for j, c in enumerate(torch.chunk(group, f))}
    seen = set()
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            chunk = next(c for c in md.state_dict_metadata[key].chunks if tuple(c.offsets) == tuple(idx.offset))
            rank = int(info.relative_path.split("_")[2])
            assert list(range(idx.offset[0], idx.offset[0] + chunk.sizes[0])) == want[rank].tolist()
            seen.add(rank)
    assert seen == set(want) == set(range(p * f))
    # the values: torch's dcp.load equals the plain import bitwise
    got = torch_load(ep)
    assert set(got) == set(full) and all(bitwise(got[k], full[k]) for k in full)
    # equal to ckpttool's own reshard of the plain import to the same sizes
    cli("reshard", str(plain), str(tmp_path / "rs"), "--no-ep", "--to", "canonical",
        "--target-ep-size", str(p), "--target-ep-fsdp-size", str(f))  # fmt: skip
    assert runner.invoke(app, ["diff", str(ep), str(tmp_path / "rs")]).exit_code == 0
    # and back to HF: bitwise the source
    cli("export", str(ep), str(tmp_path / "hf"), "--model-assets", str(src), "--experts", "per-expert")
    back, _ = read_export(tmp_path / "hf")
    orig = hf_tensors(src)
    assert set(back) == set(orig) and all(bitwise(back[k], orig[k]) for k in orig)


def test_bad_ep_sizes_are_refused(hf_dirs: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["import", str(hf_dirs / "qwen_moe"), str(tmp_path / "o"), "--ep-size", "2",
                              "--world-size", "3"])  # fmt: skip
    assert res.exit_code == 2 and "`world_size`" not in res.stderr and "--world-size" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()
    res = runner.invoke(app, ["import", str(hf_dirs / "qwen_moe"), str(tmp_path / "o"), "--ep-size", "3"])
    assert res.exit_code == 2 and "not divisible by --ep-size 3" in res.stderr
    res = runner.invoke(app, ["import", str(hf_dirs / "llama"), str(tmp_path / "o"), "--ep-size", "2"])
    assert res.exit_code == 2 and "no MoE expert tensor" in res.stderr and not (tmp_path / "o").exists()


def _ep_mesh_rank(rank: int, world: int, ckpt: str, plain: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_fsdp"))
    ref = torch_load(Path(plain))
    md = dcp.FileSystemReader(ckpt).read_metadata()
    keys = [k for k in ref if ".mlp.experts." in k]
    assert len(keys) == 4
    sd = {k: distribute_tensor(torch.zeros_like(ref[k]), mesh, [Shard(0), Shard(0)]) for k in keys}
    for k, dt in sd.items():
        # the chunk DTensor puts on this rank is the one import stored in this rank's file
        lo = dt.to_local()
        mine = [
            (tuple(idx.offset), info.relative_path)
            for idx, info in md.storage_data.items()
            if idx.fqn == k and info.relative_path == f"__{rank}_0.distcp"
        ]
        assert len(mine) == 1, (k, mine)
        start = mine[0][0][0]
        assert lo.shape[0] > 0
        # DTensor's own local-shard rule: compare the shapes and place the shard by its global offset
        shape, goff = compute_local_shape_and_global_offset(ref[k].shape, mesh, [Shard(0), Shard(0)])
        assert tuple(shape) == tuple(lo.shape) and goff[0] == start, (k, shape, goff, start)
    dcp.load(sd, checkpoint_id=ckpt)  # checkpoint keys at the top level (torch_load's names)
    for k, dt in sd.items():
        assert torch.equal(dt.full_tensor(), ref[k]), k


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_ep_import_chunks_are_the_dtensor_shards_of_a_2x2_ep_mesh(hf_dirs: Path, tmp_path: Path) -> None:
    """Each rank of a (ep=2, ep_fsdp=2) DeviceMesh finds its `(Shard(0), Shard(0))` expert shard in its own file."""
    from tests.fixtures.distributed import run_ranks

    cli("import", str(hf_dirs / "qwen_moe"), str(tmp_path / "ep"), "--ep-size", "2", "--ep-fsdp-size", "2")
    cli("import", str(hf_dirs / "qwen_moe"), str(tmp_path / "plain"))
    run_ranks(4, _ep_mesh_rank, str(tmp_path / "ep"), str(tmp_path / "plain"))


def _two_expert_moe(d: Path) -> Path:
    """A Qwen3-MoE with 2 experts (per-expert keys, save_pretrained): fewer experts than a 2 x 2 EP mesh has ranks."""
    from transformers import Qwen3MoeForCausalLM

    cfg = hf_models.qwen_moe_config()
    cfg.num_experts = 2
    cfg.num_experts_per_tok = 1
    torch.manual_seed(5)
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    return d


def _ep_dim1_rank(rank: int, world: int, ckpt: str, plain: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_fsdp"))
    place = [Shard(0), Shard(1)]  # torchtitan's placement when ep * efsdp > num_experts (distributed/fsdp.py)
    ref = torch_load(Path(plain))
    md = dcp.FileSystemReader(ckpt).read_metadata()
    keys = [k for k in ref if ".mlp.experts." in k]
    assert len(keys) == 4
    sd = {k: distribute_tensor(torch.zeros_like(ref[k]), mesh, place) for k in keys}
    for k, dt in sd.items():
        mine = [
            (tuple(idx.offset), md.state_dict_metadata[k].chunks)
            for idx, info in md.storage_data.items()
            if idx.fqn == k and info.relative_path == f"__{rank}_0.distcp"
        ]
        assert len(mine) == 1, (k, mine)
        offsets = mine[0][0]
        chunk = next(c for c in mine[0][1] if tuple(c.offsets) == offsets)
        shape, goff = compute_local_shape_and_global_offset(ref[k].shape, mesh, place)
        assert tuple(shape) == tuple(chunk.sizes) == tuple(dt.to_local().shape) and tuple(goff) == offsets, k
    dcp.load(sd, checkpoint_id=ckpt)
    for k, dt in sd.items():
        assert torch.equal(dt.full_tensor(), ref[k]), k


@pytest.mark.slow
@pytest.mark.heavy  # CI time: the 2x2 EP mesh import stays in CI
def test_ep_import_with_fewer_experts_than_ranks_shards_dim_1_as_torchtitan(tmp_path: Path) -> None:
    """2 experts on a (ep=2, ep_fsdp=2) mesh: each rank's file holds its `(Shard(0), Shard(1))` DTensor shard.

    References: DTensor's own local-shard rule and `dcp.load` on 4 gloo ranks, the plain import
    (torch's reader), `validate --strict`, and the bitwise export back to the source safetensors.
    """
    from tests.fixtures.distributed import run_ranks

    src = _two_expert_moe(tmp_path / "hf")
    doc = cli("import", str(src), str(tmp_path / "ep"), "--ep-size", "2", "--ep-fsdp-size", "2")
    assert (doc["world_size"], doc["ep_tensors"]) == (4, 4)
    cli("import", str(src), str(tmp_path / "plain"))
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "ep")])
    assert res.exit_code == 0, res.stdout
    run_ranks(4, _ep_dim1_rank, str(tmp_path / "ep"), str(tmp_path / "plain"))
    got, want = torch_load(tmp_path / "ep"), torch_load(tmp_path / "plain")
    assert set(got) == set(want) and all(bitwise(got[k], want[k]) for k in want)
    cli("export", str(tmp_path / "ep"), str(tmp_path / "back"), "--model-assets", str(src), "--experts", "per-expert")
    back, _ = read_export(tmp_path / "back")
    orig = hf_tensors(src)
    assert set(back) == set(orig) and all(bitwise(back[k], orig[k]) for k in orig)


def _titan_ep_rank(rank: int, world: int, root: str) -> None:
    """Load the imported checkpoint into torchtitan's own Qwen3-MoE, sharded as its EP x EP-FSDP training places it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.fixtures.writers import _titan_moe

    r = Path(root)
    model = _titan_moe().build()
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))  # experts: EP outer, EP-FSDP inner
    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))  # the rest: FSDP2 over the 4 ranks
    sd = {}
    for k, v in model.state_dict().items():
        if "expert_bias" in k:  # the load-balancing buffer: no HF counterpart, not imported (docs/import.md)
            continue
        expert = ".inner_experts." in k or ".experts." in k
        sd[k] = distribute_tensor(
            torch.zeros_like(v), ep_mesh if expert else dp_mesh, [Shard(0), Shard(0)] if expert else [Shard(0)]
        )
    dcp.load(sd, checkpoint_id=str(r / "imported"))  # every key of torchtitan's model must be in the checkpoint
    want = torch.load(r / "want.pt", weights_only=True)
    assert set(sd) == set(want), set(sd) ^ set(want)
    for k, dt in sd.items():
        assert bitwise(dt.full_tensor(), want[k]), k


@pytest.mark.slow
@pytest.mark.heavy
def test_torchtitan_schema_ep_import_loads_into_torchtitans_own_moe_model(tmp_path: Path) -> None:
    """`import --schema torchtitan --ep-size 2 --ep-fsdp-size 2`: torchtitan's Qwen3-MoE `state_dict()` keys, sharded
    as its EP (Shard(0) on ep) + EP-FSDP (Shard(0) on efsdp, 8 experts >= 4 ranks) training places them, load
    with `dcp.load` on 4 gloo ranks and equal the HF model's weights (reference: the test's own HF -> torchtitan
    renaming of the in-memory fused HF state dict)."""
    pytest.importorskip("torchtitan.models.qwen3")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.fixtures.distributed import run_ranks
    from tests.fixtures.writers import MOE_CFG

    c = MOE_CFG
    cfg = Qwen3MoeConfig(
        vocab_size=c["vocab"],
        hidden_size=c["dim"],
        intermediate_size=64,
        moe_intermediate_size=c["hidden"],
        num_hidden_layers=2,
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"],
        num_experts=c["experts"],
        num_experts_per_tok=c["top_k"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(9)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    want = hf_models.hf_to_titan_qwen_moe(dict(model.state_dict()), cfg)
    torch.save({k: v for k, v in want.items() if "expert_bias" not in k}, tmp_path / "want.pt")
    doc = cli(
        "import", str(tmp_path / "hf"), str(tmp_path / "imported"), "--schema", "torchtitan",
        "--ep-size", "2", "--ep-fsdp-size", "2",
    )  # fmt: skip
    assert (doc["adapter"], doc["world_size"], doc["ep_tensors"]) == ("torchtitan-qwen3", 4, 6)
    run_ranks(4, _titan_ep_rank, str(tmp_path))


@pytest.mark.parametrize("meta", [None, {"format": "pt"}])
def test_safetensors_without_tensors_are_refused(tmp_path: Path, meta: dict[str, str] | None) -> None:
    """A model folder whose safetensors files hold no tensor (a header only) is E601, with or without
    --dry-run: it was "imported 0 tensors", exit 0, an empty checkpoint that loads into no model."""
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({}, str(d / "model.safetensors"), metadata=meta)
    (d / "config.json").write_text('{"model_type": "llama"}')
    for extra in ([], ["--dry-run"]):
        res = runner.invoke(app, ["import", str(d), str(tmp_path / "o"), *extra])
        assert res.exit_code == 2 and "[E601]" in res.stderr and "hold no tensor" in res.stderr, res.stderr
        assert "model.safetensors" in res.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("ep", [[], ["--ep-size", "2"]])
def test_a_folder_without_safetensors_hints_an_hf_model_folder_not_metadata(tmp_path: Path, ep: list[str]) -> None:
    """A folder with no safetensors file hinted ``restore .metadata from a good copy``, a fix for a DCP
    checkpoint, not for the Hugging Face model import reads: the hint names the folder import wants, or, for
    a pickled ``pytorch_model.bin``, how to get safetensors from it."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o"), *ep])
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "o").exists()
    assert res.stderr.splitlines() == [
        f"error: [E200] {d}: no .metadata and no .safetensors files",
        "hint: pass the Hugging Face model directory, the one holding model*.safetensors and config.json",
    ]
    (d / "pytorch_model.bin").write_bytes(b"")
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o"), *ep])
    err, hint = res.stderr.splitlines()
    assert res.exit_code == 2 and err.startswith("error: [E200]")
    assert hint.startswith("hint: import reads safetensors files only (pytorch_model.bin is a torch.save file)")
    assert "save_pretrained" in hint and ".metadata" not in hint


def test_a_folder_whose_model_is_below_it_names_the_folder_to_pass(hf_dirs: Path, tmp_path: Path) -> None:
    """A folder holding the model one level down (torch's ``HuggingFaceStorageWriter(enable_consolidation=True)``
    without ``save_distributed`` writes its files to ``sharded/``; a Trainer run holds ``checkpoint-N/``) was
    refused with a hint to pass the folder holding model*.safetensors, without naming it."""
    import shutil

    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = load_file(str(next(iter(sorted((hf_dirs / "llama").glob("*.safetensors"))))))
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "w"), enable_consolidation=True), no_dist=True)
    run = tmp_path / "run"
    for step in (5, 10, 20, 40):
        shutil.copytree(hf_dirs / "llama", run / f"checkpoint-{step}")
    for src, hint in (
        (tmp_path / "w", f"hint: the safetensors files are in a folder below it: pass {tmp_path / 'w' / 'sharded'}"),
        (
            run,
            # newest step first, by number (by name checkpoint-5 came last, the newest left out behind '...')
            f"hint: 4 model folders are below it: pass one of them ({run / 'checkpoint-40'}, {run / 'checkpoint-20'}, "
            f"{run / 'checkpoint-10'}, ...)",
        ),
    ):
        res = runner.invoke(app, ["import", str(src), str(tmp_path / "o")])
        assert res.exit_code == 2 and res.stderr.splitlines()[1:] == [hint], res.stderr
        assert not (tmp_path / "o").exists()
    below = tmp_path / "w" / "sharded"
    assert runner.invoke(app, ["import", str(below), str(tmp_path / "o")]).exit_code == 0
    loaded = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "o"), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_the_library_names_a_dcp_checkpoint_given_as_the_hf_directory(sample_ckpt: Path, tmp_path: Path) -> None:
    """`import_hf` itself (not only the command) refuses a DCP checkpoint with E100 and points at export."""
    from ckpttool.errors import UsageError
    from ckpttool.ops.import_hf import import_hf

    with pytest.raises(UsageError) as info:
        import_hf(sample_ckpt, tmp_path / "out")
    assert info.value.code == "E100"
    assert f"] {sample_ckpt} is a DCP checkpoint (it holds .metadata)" in str(info.value)
    assert f"ckpttool export {sample_ckpt} OUT" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("adapter", ["megatron-gpt", "hf"])
def test_schema_torchtitan_with_an_adapter_of_another_naming_is_a_usage_error(
    hf_dirs: Path, tmp_path: Path, adapter: str
) -> None:
    """``--schema torchtitan --adapter megatron-gpt`` (or ``hf``) ran the import and failed on the first HF key
    with E601 'not a key of the ... adapter': the adapter names another schema's keys."""
    res = runner.invoke(
        app, ["import", str(hf_dirs / "llama"), str(tmp_path / "o"), "--schema", "torchtitan", "--adapter", adapter]
    )
    assert res.exit_code == 2 and res.stdout == "", res.output
    err, hint = res.stderr.splitlines()
    assert err == f"error: [E100] --schema torchtitan imports through a torchtitan adapter, not {adapter}", err
    assert hint == (
        "hint: pass --adapter torchtitan-llama3 or torchtitan-qwen3, or leave it out (the config's model_type)"
    ), hint
    assert not (tmp_path / "o").exists()


def test_import_offers_only_the_adapters_it_writes_through() -> None:
    """``import --help`` listed every registered adapter, ``torchtune-llama`` (export only: no import schema takes it)
    among them; it lists those whose registry entry names an import schema. Export's list is unchanged."""
    wide = {"COLUMNS": "400"}
    imp = runner.invoke(app, ["import", "--help"], env=wide)
    assert imp.exit_code == 0, imp.output
    assert "--adapter <torchtitan-llama3|torchtitan-qwen3|megatron-gpt>" in imp.stdout, imp.stdout
    assert "torchtune-llama" not in imp.stdout
    exp = runner.invoke(app, ["export", "--help"], env=wide)
    assert exp.exit_code == 0, exp.output
    assert (
        "--adapter <torchtitan-llama3|torchtitan-qwen3|megatron-gpt|torchtune-llama|olmo-core-llama|olmo-core-olmo2|hf>"
        in exp.stdout
    ), exp.stdout


@pytest.mark.parametrize("schema", ["torch-native", "torchtitan", "megatron"])
@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("torchtune-llama", "--adapter 'torchtune-llama' is export only; import writes through "),
        ("nope", "--adapter 'nope' is not one of "),
    ],
)
def test_import_refuses_an_adapter_it_does_not_write_through(
    hf_dirs: Path, tmp_path: Path, schema: str, adapter: str, message: str
) -> None:
    """``--adapter torchtune-llama`` (export only) or an unknown name: E100 naming import's own adapters
    (an unknown name under ``--schema torchtitan`` listed every registered adapter, torchtune-llama too)."""
    res = runner.invoke(
        app, ["import", str(hf_dirs / "llama"), str(tmp_path / "o"), "--schema", schema, "--adapter", adapter]
    )
    assert res.exit_code == 2 and res.stdout == "", res.output
    err = res.stderr.splitlines()[0]
    assert err == f"error: [E100] {message}torchtitan-llama3, torchtitan-qwen3, megatron-gpt", err
    assert not (tmp_path / "o").exists()


#: the families whose `save_pretrained` writes Mixtral's legacy expert names (transformers' "mixtral" and
#: "phimoe" conversions), by config class
MIXTRAL_FORMS = ["MixtralConfig", "MiniMaxConfig", "MiniMaxM2Config", "PhimoeConfig"]


def _mixtral(d: Path, config: str = "MixtralConfig") -> tuple[Any, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A tiny Mixtral-style model saved with transformers' own `save_pretrained` (which writes the legacy
    `block_sparse_moe.experts.{j}.w1/w2/w3.weight` names); its config, state_dict, input ids and logits."""
    import transformers

    cfg = getattr(transformers, config)(
        vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(d)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        logits = model(ids).logits
    return cfg, {k: v.clone() for k, v in model.state_dict().items()}, ids, logits


@pytest.mark.parametrize("config", MIXTRAL_FORMS)
def test_mixtral_legacy_per_expert_names_import_as_the_models_own_fused_keys(tmp_path: Path, config: str) -> None:
    """transformers 5 saves Mixtral's experts as `block_sparse_moe.experts.{j}.w1/w2/w3.weight`; the import wrote
    those names ("imported 41 tensors", exit 0) and `dcp.load` into the model's `state_dict()` (fused
    `mlp.experts.gate_up_proj` / `down_proj`, `mlp.gate.weight`) failed. Now: the model's own keys, each tensor
    bitwise what the model held (transformers' conversion: w1 gate then w3 up along dim 1), identical logits."""
    from transformers import AutoModelForCausalLM

    cfg, want, ids, logits = _mixtral(tmp_path / "hf", config)
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in hf_tensors(tmp_path / "hf"))
    doc = cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert doc["tensors"] == len(want)
    fresh = AutoModelForCausalLM.from_config(cfg)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # every key of the model must be there
    assert set(torch_load(tmp_path / "dcp")) == {f"model.{k}" for k in want}
    assert all(bitwise(sd["model"][k], want[k]) for k in want)
    fresh.load_state_dict(sd["model"])
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, logits)
    # and back: the export loads with transformers' own from_pretrained, identical logits
    cli("export", str(tmp_path / "dcp"), str(tmp_path / "back"), "--model-assets", str(tmp_path / "hf"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert all(bitwise(back.state_dict()[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)


def test_mixtral_per_expert_names_without_the_mixtral_config_are_refused(tmp_path: Path) -> None:
    """Without a config saying `mixtral` the legacy names cannot be mapped: E601 naming the key, no output."""
    _mixtral(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()
    res = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "o")])
    assert res.exit_code == 2 and "[E601]" in res.stderr, res.stderr
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in res.stderr and "mixtral" in res.stderr
    assert "no config.json gives its model_type" in res.stderr and "--config" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()


def test_every_registered_expert_form_has_its_row_in_docs_import() -> None:
    from ckpttool.model.hf_forms import FORMS

    doc = (Path(__file__).parents[2] / "docs" / "import.md").read_text()
    for name, form in FORMS.items():
        assert f"| `{name}` | {', '.join(f'`{t}`' for t in form.model_types) if form.model_types else 'any'} |" in doc


@pytest.mark.parametrize("config", ["MixtralConfig", "PhimoeConfig"])
def test_diff_of_an_imported_mixtral_against_its_hf_folder_compares_every_tensor(tmp_path: Path, config: str) -> None:
    """`diff DCP HF` of a Mixtral imported from transformers' own `save_pretrained` folder reported the folder's
    `block_sparse_moe.*` tensors as only in B (the DCP side was named `mlp.experts.{j}.gate_proj...`, the router
    `mlp.gate.weight`). Now the family's names: every tensor compared and equal, in both directions."""
    _, want, _, _ = _mixtral(tmp_path / "hf", config)
    cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    n = len(hf_tensors(tmp_path / "hf"))
    for a, b in (("dcp", "hf"), ("hf", "dcp")):
        doc = cli("diff", str(tmp_path / a), str(tmp_path / b))
        assert doc["equal"] is True and doc["differences"] == [], doc["differences"][:3]
        assert doc["counts"]["compared"] == doc["counts"]["equal"] == n


@pytest.mark.parametrize("config", MIXTRAL_FORMS)
def test_mixtral_per_expert_export_loads_into_mixtral_with_identical_logits(tmp_path: Path, config: str) -> None:
    """`export --experts per-expert` of a Mixtral wrote Qwen's `experts.{j}.gate_proj/up_proj/down_proj.weight`:
    transformers' Mixtral loader converts only `w1`/`w3`/`w2`, so `from_pretrained` left the experts randomly
    initialised (4 missing, 24 unexpected keys) after an export that reported success. Then it wrote the w1/w3/w2
    names under the model's `mlp.` (`mlp.experts.{j}.w1.weight`, `mlp.gate.weight`): transformers renamed them
    back, but vLLM's Mixtral loader looks for `block_sparse_moe.`. Now the names `save_pretrained` writes, every
    one (the family's renames reversed, `ckpttool.model.hf_forms`): every tensor bitwise, identical logits."""
    from transformers import AutoModelForCausalLM

    _, want, ids, logits = _mixtral(tmp_path / "hf", config)
    cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    out = tmp_path / "pe"
    cli("export", str(tmp_path / "dcp"), str(out), "--model-assets", str(tmp_path / "hf"), "--experts", "per-expert")
    got, _ = read_export(out)
    saved = hf_tensors(tmp_path / "hf")  # what transformers' own save_pretrained wrote
    assert set(got) == set(saved)
    assert all(bitwise(got[k], saved[k]) for k in saved)
    back, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert all(bitwise(back.state_dict()[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, logits)


def _trainer_run(out: Path, **config: Any) -> Any:
    """transformers' own ``Trainer`` after one step of a tiny ``LlamaForCausalLM`` (``config`` over its fields) on the
    CPU, saved at that step (``out/checkpoint-1/``: model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
    trainer_state.json, training_args.bin)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    fields = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    torch.manual_seed(0)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(2)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=LlamaForCausalLM(LlamaConfig(**{**fields, **config})), args=args, train_dataset=data)
    trainer.train()
    return trainer


def test_a_trainer_checkpoint_folder_imports_its_weights_and_names_the_training_state_left_out(tmp_path: Path) -> None:
    """A Hugging Face ``Trainer`` ``checkpoint-N/`` (written by transformers' own ``Trainer``: model.safetensors beside
    optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, training_args.bin): the import wrote the weights
    and said nothing of the optimizer state it left behind; it now names those files in a warning."""
    trainer = _trainer_run(tmp_path / "run", num_key_value_heads=1)
    trainer.save_model(str(tmp_path / "final"))  # weights, config.json, training_args.bin: no state to warn of
    assert (tmp_path / "final" / "training_args.bin").is_file()
    assert not [
        w for w in cli("import", str(tmp_path / "final"), str(tmp_path / "f"))["warnings"] if "not imported" in w
    ]
    step = tmp_path / "run" / "checkpoint-1"
    assert (step / "optimizer.pt").is_file() and (step / "model.safetensors").is_file()
    doc = cli("import", str(step), str(tmp_path / "out"))
    left = [w for w in doc["warnings"] if "not imported" in w]
    assert len(left) == 1, doc["warnings"]
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"):
        assert name in left[0], left[0]
    assert "model.safetensors" not in left[0] and "config.json" not in left[0]
    res = runner.invoke(app, ["import", str(step), str(tmp_path / "out2")])
    assert res.exit_code == 0 and "warning: " in res.stderr and "optimizer.pt" in res.stderr, res.stderr
    ref = hf_tensors(step)
    sd = {f"model.{k}": torch.empty_like(v) for k, v in ref.items()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "out"), no_dist=True)  # the weights themselves, bitwise
    assert all(bitwise(sd[f"model.{k}"], v) for k, v in ref.items())


def test_a_config_without_heads_is_named_by_imports_own_flag(hf_dirs: Path, tmp_path: Path) -> None:
    """``--schema torchtitan`` with a config.json that lacks the heads the RoPE permutation needs: the hint said
    "pass the model's config.json with `model_assets`", a parameter import does not have; it names --config."""
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(hf_dirs / "llama", d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_attention_heads"], cfg["num_key_value_heads"]
    (d / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "o"), "--schema", "torchtitan"])
    err = res.stderr.splitlines()
    assert res.exit_code == 2 and len(err) == 2 and err[0].startswith("error: [E601] "), res.stderr
    assert err[1] == "hint: pass the model's config.json with --config", err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (["--world-size", "100000000"], "--world-size 100000000 is 100,000,000 "),
        (["--ep-size", "8", "--ep-fsdp-size", "100000000"], "--ep-size 8 x --ep-fsdp-size 100000000 is 800,000,000 "),
    ],
)
def test_a_mesh_of_millions_of_ranks_is_refused_before_planning(
    hf_dirs: Path, tmp_path: Path, flags: list[str], shown: str
) -> None:
    """``--world-size 100000000`` (a mistyped 8): the plan of a row block per rank of every tensor ran until the
    process ran out of memory (E999 MemoryError, or the OOM killer); it is E100 naming the flag, before planning.
    Run with a 3 GiB address-space cap, so that the unfixed plan ends in MemoryError instead of exhausting the host."""
    import resource
    import subprocess
    import sys

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    out = tmp_path / "o"
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", "import", str(hf_dirs / "qwen_moe"), str(out), *flags],
        capture_output=True, text=True, timeout=300, preexec_fn=cap,
    )  # fmt: skip
    err = res.stderr.splitlines()
    assert res.returncode == 2 and len(err) == 2, res.stderr
    assert err[0].startswith(f"error: [E100] {shown}") and "131,072" in err[0], err
    assert not out.exists()


def test_the_warning_on_keys_the_model_lacks_names_them_all_or_counts_the_rest(hf_dirs: Path, tmp_path: Path) -> None:
    """Keys the model class lacks are imported with a warning; it said "5 unexpected key(s) ...: <the first>" and
    nothing of the other four; it names the first 3 and "(+2 more)", as the refusal of missing keys does."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "llama"
    shutil.copytree(hf_dirs / "llama", d)
    extra = {f"model.extra{i}.weight": torch.full((2, 2), float(i)) for i in range(5)}
    save_file(extra, str(d / "model-extra.safetensors"), metadata={"format": "pt"})
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    doc = cli("import", str(d), str(tmp_path / "o"))
    (w,) = [w for w in doc["warnings"] if "unexpected" in w]
    assert w == (
        "5 unexpected key(s) against LlamaForCausalLM (dcp.load into the model leaves them unread): "
        "model.extra0.weight [2, 2]; model.extra1.weight [2, 2]; model.extra2.weight [2, 2] (+2 more)"
    ), w
    assert len(doc["model_check"]["findings"]["unexpected"]) == 5


def test_mistrals_consolidated_file_beside_the_indexed_shards_is_left_out_as_transformers_does(
    hf_dirs: Path, tmp_path: Path
) -> None:
    """Mistral's Hugging Face repositories ship ``consolidated.safetensors`` (Mistral's own names) beside the
    ``save_pretrained`` shards and their index; transformers reads the index's files. import refused such a folder
    (E200 "1 shard(s) on disk are not in the index ... do not load it"); it imports the index's model, bitwise, and
    names the file it left out. Without an index, such a file is the folder's model as before."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "mistral"
    shutil.copytree(hf_dirs / "llama", d)
    native = {"tok_embeddings.weight": torch.ones(64, 32), "layers.0.attention.wq.weight": torch.ones(32, 32)}
    save_file(native, str(d / "consolidated.safetensors"))
    doc = cli("import", str(d), str(tmp_path / "o"))
    assert any(w.startswith("consolidated.safetensors (Mistral's own format") for w in doc["warnings"]), doc
    ref = hf_tensors(hf_dirs / "llama")
    sd = {f"model.{k}": torch.empty_like(v) for k, v in ref.items()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "o"), no_dist=True)
    assert all(bitwise(sd[f"model.{k}"], v) for k, v in ref.items())
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(tmp_path / "o")).read_metadata().state_dict_metadata)
    assert keys == {f"model.{k}" for k in ref}
    alone = tmp_path / "alone"
    alone.mkdir()
    save_file(native, str(alone / "consolidated.safetensors"))
    res = runner.invoke(app, ["import", str(alone), str(tmp_path / "o2"), "--allow-mismatch", "missing"])
    assert res.exit_code == 0, res.stderr
    keys = set(FileSystemReader(str(tmp_path / "o2")).read_metadata().state_dict_metadata)
    assert keys == {f"model.{k}" for k in native}


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_a_tied_lm_head_is_written_from_the_embedding_the_model_class_ties_it_to(tmp_path: Path, family: str) -> None:
    """GPT-2 ties lm_head.weight to transformer.wte.weight, OPT to model.decoder.embed_tokens.weight
    (`_tied_weights_keys`); save_pretrained leaves lm_head out. Before, the import wrote it only beside
    model.embed_tokens.weight, so `dcp.load` into the model's own state_dict() failed (missing model.lm_head.weight);
    now it is written from the class's embedding and every tensor loads bitwise."""
    torch.manual_seed(61)
    model = hf_models.tiny_tied_model(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in hf_tensors(tmp_path / "hf")
    doc = cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert any("tied lm_head.weight written from" in w for w in doc["warnings"]), doc["warnings"]
    want = model.state_dict()
    sd = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(bitwise(sd["model"][k], v) for k, v in want.items())


def test_a_folder_of_model_safetensors_beside_a_sharded_index_is_refused_naming_both(tmp_path: Path) -> None:
    """save_pretrained's shards and their index, and another save's model.safetensors in the same folder:
    transformers' from_pretrained loads model.safetensors alone (the index and its shards never read). Before, import
    said E200 "'transformer.h.0.attn.c_attn.bias' is stored in two files", naming a tensor, not the two saves. Now
    one line names model.safetensors and the index, says what from_pretrained would load and the fix; nothing is
    written. An index that lists model.safetensors alone (export's) is that one save and imports."""
    import transformers

    hf_models._quiet()
    torch.manual_seed(1)
    sharded = hf_models.tiny_tied_model("gpt2")
    sharded.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    single = hf_models.tiny_tied_model("gpt2")
    single.save_pretrained(tmp_path / "single")
    (tmp_path / "hf/model.safetensors").write_bytes((tmp_path / "single/model.safetensors").read_bytes())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert torch.equal(loaded.transformer.wte.weight, single.transformer.wte.weight)  # the single file, alone
    assert not torch.equal(loaded.transformer.wte.weight, sharded.transformer.wte.weight)

    res = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "out")])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    err = res.stderr.splitlines()
    assert err[0].startswith("error: [E200]") and "model.safetensors and model.safetensors.index.json" in err[0], err
    assert "from_pretrained would load model.safetensors alone" in err[0] and err[1].startswith("hint: keep the save")
    assert not (tmp_path / "out").exists()

    one = tmp_path / "one"
    one.mkdir()
    (one / "model.safetensors").write_bytes((tmp_path / "single/model.safetensors").read_bytes())
    (one / "config.json").write_bytes((tmp_path / "single/config.json").read_bytes())
    with safe_open(str(one / "model.safetensors"), "pt") as f:
        index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    (one / "model.safetensors.index.json").write_text(json.dumps(index))
    res = runner.invoke(app, ["import", str(one), str(tmp_path / "out1")])
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("full", ["data file", ".metadata"])
def test_a_write_that_finds_no_room_names_the_output_file(hf_dirs: Path, tmp_path: Path, full: str) -> None:
    """Over the file-size limit (as on a full disk): the error named only OUT ("write failed (File too large)"),
    as closing the other data files failed again and hid the first error; a too-large .metadata was named by
    the temporary directory (``.out.ckpttool-tmp-*/.metadata``) with a hint to pass --overwrite."""
    import re

    from tests.fixtures.file_size_limit import run_capped

    args = ["import", str(hf_dirs / "llama"), "--world-size", "64"]
    assert runner.invoke(app, [*args[:2], str(tmp_path / "ref"), *args[2:]]).exit_code == 0
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "ref").iterdir()}
    data = [v for k, v in sizes.items() if k.endswith(".distcp")]
    limit = max(data) // 2 if full == "data file" else max(data) + 1
    assert limit < sizes[".metadata"]

    out = tmp_path / "out"
    res = run_capped([*args[:2], str(out), *args[2:]], limit)
    assert res.returncode == 2, res.stderr
    first, hint = res.stderr.splitlines()
    name = r"__\d+_0\.distcp: cannot write '[^']+'" if full == "data file" else r"\.metadata: cannot write"
    assert re.fullmatch(rf"error: \[E600\] {re.escape(str(out))}/{name} \(File too large\)", first), first
    assert hint.startswith("hint: free space on the output's filesystem"), hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref"]


@pytest.mark.slow
def test_per_rank_hf_storage_shards_are_refused_with_a_hint_that_works(acc_root: Path, tmp_path: Path) -> None:
    """torch's HuggingFaceStorageWriter(save_distributed=True) without consolidation: each rank's file holds its
    shard of every tensor. import reads whole tensors and refuses them (E601); the hint's `ckpttool export` writes the
    assembled tensors, whose import holds what the shards hold."""
    src = acc_root / "hf_sharded"
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "d")])
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    err, hint = res.stderr.strip().splitlines()[-2:]
    assert err.startswith("error: [E601]") and "per-rank shards" in err, err
    assert "ckpttool export" in hint, hint
    assert not (tmp_path / "d").exists()
    cli("export", str(src), str(tmp_path / "hf"))
    cli("import", str(tmp_path / "hf"), str(tmp_path / "d"))
    assert cli("diff", str(src), str(tmp_path / "d"))["equal"]


@pytest.mark.slow
def test_per_rank_hf_storage_shards_hint_pastes_as_is_for_a_path_with_a_space(acc_root: Path, tmp_path: Path) -> None:
    """The E601 hint's `ckpttool export DIR OUT` names a folder with a space as one shell argument: pasted as printed
    (OUT filled in), it writes the assembled tensors, which import reads."""
    import shlex
    import shutil

    src = tmp_path / "my ckpt"
    shutil.copytree(acc_root / "hf_sharded", src)
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "d")])
    assert res.exit_code == 2 and res.stdout == "", res.stderr
    hint = res.stderr.strip().splitlines()[-1]
    argv = shlex.split(hint.split("`")[1].replace("OUT", shlex.quote(str(tmp_path / "hf"))))
    assert argv[:3] == ["ckpttool", "export", str(src)], argv
    cli(*argv[1:])
    cli("import", str(tmp_path / "hf"), str(tmp_path / "d"))
    assert cli("diff", str(src), str(tmp_path / "d"))["equal"]


def test_a_stored_head_that_differs_from_the_embedding_it_is_tied_to_is_refused(hf_dirs: Path, tmp_path: Path) -> None:
    """An untied model's folder (save_pretrained stores lm_head.weight) imported with the tied config of its base
    model (`--config`): transformers' from_pretrained sees both stored with different values and leaves them untied,
    but the model that config builds holds one tensor for both, so `dcp.load` of the import gave that tensor the
    head's values (the embedding's lost; logits unlike from_pretrained's). Before, the import said OK; now E601
    names both keys, nothing is written, and with the untied config the import loads with from_pretrained's logits."""
    import transformers

    src, tied_cfg = hf_dirs / "llama", hf_dirs / "llama_tied" / "config.json"
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "dcp"), "--config", str(tied_cfg)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("error: [E601] ") and "lm_head.weight differs from model.embed_tokens.weight" in lines[0]
    assert "in 3,072 of 3,072 elements" in lines[0] and str(tied_cfg) in lines[0], lines
    assert lines[1].startswith("hint: ") and "tie_word_embeddings false" in lines[1] and len(lines) == 2, lines
    assert not (tmp_path / "dcp").exists() and [p.name for p in tmp_path.iterdir()] == []
    # what from_pretrained builds from the folder and that config: untied, the stored head kept
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, config=transformers.AutoConfig.from_pretrained(tied_cfg)
    )
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    cli("import", str(src), str(tmp_path / "dcp"))  # the folder's own (untied) config: that very model
    mine = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src))
    sd = {"model": mine.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    mine.load_state_dict(sd["model"])
    ref = torch.load(src / "reference.pt", weights_only=True)
    model.eval(), mine.eval()
    with torch.no_grad():
        torch.testing.assert_close(mine(ref["ids"]).logits, model(ref["ids"]).logits, rtol=0, atol=0)


@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_differing_in_a_few_elements_is_counted_across_slabs(
    hf_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emb_dtype: torch.dtype
) -> None:
    """The head is compared with the embedding on the byte engine slab by slab (made 1 KiB here, so the 3,072
    elements span many): a head equal to the embedding but in 5 elements scattered over several slabs, and NaN on
    both sides in one more, is E601 counting exactly those 5, as torch counts them; a float32 head beside a
    bfloat16 embedding is compared in float64 (the embedding's values widened exactly)."""
    from safetensors.torch import load_file, save_file

    import ckpttool.ops.import_hf as import_hf

    monkeypatch.setattr(import_hf, "_TIE_BLOCK", 1024)
    src = tmp_path / "src"
    src.mkdir()
    for f in (hf_dirs / "llama_tied").iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in sorted((hf_dirs / "llama_tied").glob("*.safetensors")):
        tensors.update(load_file(f))
    emb = tensors["model.embed_tokens.weight"].to(emb_dtype).clone()
    emb.view(-1)[7] = float("nan")
    tensors["model.embed_tokens.weight"] = emb
    head = emb.to(torch.float32).clone()
    flat = head.view(-1)
    for i in (0, 300, 301, 1500, flat.numel() - 1):
        flat[i] = flat[i] + 1
    tensors["lm_head.weight"] = head
    save_file(tensors, src / "model.safetensors")
    want = int((head.to(torch.float64) != emb.to(torch.float64)).sum()) - 1  # the NaN in both is alike
    assert want == 5
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "dcp")])
    assert res.exit_code == 2, res.output
    assert f"in {want} of {flat.numel():,} elements" in res.stderr, res.stderr
    assert not (tmp_path / "dcp").exists()


def test_a_tied_head_stored_beside_its_embedding_with_equal_values_imports(hf_dirs: Path, tmp_path: Path) -> None:
    """torch's HuggingFaceStorageWriter saves a tied model's state_dict() with both lm_head.weight and the embedding
    (equal values): imported as they are, and `dcp.load` into the tied model gives transformers' logits."""
    import shutil
    import warnings

    import transformers
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    src = hf_dirs / "llama_tied"
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {k: v.clone() for k, v in model.state_dict().items()}  # the writer refuses shared storage
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=str(tmp_path / "hf")), no_dist=True)
    shutil.copy(src / "config.json", tmp_path / "hf")
    assert "lm_head.weight" in hf_tensors(tmp_path / "hf")
    cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    mine = transformers.AutoModelForCausalLM.from_config(model.config)
    hf_models.assert_dcp_logits(mine, tmp_path / "dcp", src / "reference.pt")


def test_a_folder_of_torch_save_files_is_refused_naming_the_weights_not_the_optimizer(tmp_path: Path) -> None:
    """No safetensors file, only torch.save files (never unpickled): the hint named the first in name order as the
    model to re-save with save_pretrained, which in a Trainer checkpoint is `optimizer.pt`. Now it names the weights
    (`pytorch_model.bin`, as transformers 4 saved them), a PEFT adapter saved with `safe_serialization=False` as an
    adapter to merge, and a folder of training state alone (a Trainer checkpoint-N without its model.safetensors)
    as holding no weights."""
    import shutil

    import peft

    model = _trainer_run(tmp_path / "run").model
    step = tmp_path / "run" / "checkpoint-1"
    state = tmp_path / "state"  # the training state, its weights left out (rsync --exclude '*.safetensors')
    shutil.copytree(step, state, ignore=shutil.ignore_patterns("*.safetensors"))
    assert (state / "optimizer.pt").is_file() and (state / "rng_state.pth").is_file()
    v4 = tmp_path / "v4"  # the same checkpoint as transformers 4 saved it (save_safetensors=False)
    shutil.copytree(state, v4)
    torch.save(model.state_dict(), v4 / "pytorch_model.bin")
    lora = tmp_path / "lora"
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        lora, safe_serialization=False
    )
    assert (lora / "adapter_model.bin").is_file()

    def refused(folder: Path) -> str:
        res = runner.invoke(app, ["import", str(folder), str(tmp_path / "out")])
        assert res.exit_code == 2, res.output
        lines = res.stderr.strip().splitlines()
        assert lines[0].startswith("error: [E200] ") and lines[1].startswith("hint: ") and len(lines) == 2, lines
        assert not (tmp_path / "out").exists()
        return lines[1]

    hint = refused(v4)
    assert "pytorch_model.bin is a torch.save file" in hint and "optimizer.pt" not in hint, hint
    hint = refused(lora)
    assert "adapter_model.bin is a PEFT adapter" in hint and "merge" in hint, hint
    hint = refused(state)
    assert "holds training state (optimizer.pt, " in hint and "no model weights" in hint, hint
    assert "save it again with save_pretrained" not in hint, hint


def test_a_base_model_save_imports_under_the_prefix_from_pretrained_adds(tmp_path: Path) -> None:
    """A `GPT2Model` saved by save_pretrained (`wte.weight`, `h.0.attn.c_attn.weight`: the layout of the hub's
    openai-community/gpt2) is what AutoModelForCausalLM.from_pretrained loads into GPT2LMHeadModel, adding the
    `transformer.` prefix and tying lm_head to wte. The import refused it (E605, all 28 keys missing) and suggested
    `--allow-mismatch`, whose output loads nothing. Now the keys are written under `transformer.`, with a warning,
    and `dcp.load` into the causal LM gives from_pretrained's logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    lm = hf_models.tiny_tied_model("gpt2").eval()
    lm.transformer.save_pretrained(tmp_path / "hf")
    assert "wte.weight" in hf_tensors(tmp_path / "hf")
    doc = cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert any("28 stored key(s) of the base model" in w and "under transformer." in w for w in doc["warnings"])
    assert doc["model_check"]["checked"] and not doc["model_check"].get("findings"), doc["model_check"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    mine = AutoModelForCausalLM.from_config(ref.config)
    sd = {"model": mine.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    mine.load_state_dict(sd["model"])
    mine.eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(mine(ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(lm(ids).logits, want, rtol=0, atol=0)


def test_a_config_transformers_rejects_is_named_on_one_line(hf_dirs: Path, tmp_path: Path) -> None:
    """A config.json whose field transformers' config class rejects (`hidden_size` a string): the warning that the
    model class was not built carried transformers' multi-line message, printed with a literal `\\x0a` in it. Now
    its lines are joined by spaces."""
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_dirs / "llama", src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, hidden_size="big")))
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--no-cache"])
    assert res.exit_code == 0, res.output
    (line,) = [x for x in res.stderr.splitlines() if "cannot build a causal LM" in x]
    assert "\\x0a" not in line and "Validation error for field 'hidden_size': TypeError" in line, line


def test_per_expert_tensors_of_another_dtype_are_refused_naming_the_key(hf_dirs: Path, tmp_path: Path) -> None:
    """A Qwen3-MoE folder (save_pretrained: per-expert keys) in which one expert's gate_proj was re-saved in
    bfloat16: the parts cannot be fused into one tensor. The refusal said only `model.layers.0.mlp: per-expert
    gate_up_proj parts differ in shape or dtype` with export's hint (`see ckpttool export --help`); it now names the
    key, its dtype and shape against expert 0's, with a hint for import."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    shutil.copytree(hf_dirs / "qwen_moe", src)
    key = "model.layers.0.mlp.experts.3.gate_proj.weight"
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0] == (
        f"error: [E601] {key}: bfloat16 [16, 32], but model.layers.0.mlp.experts.0.gate_proj.weight is float32 "
        "[16, 32]: the per-expert tensors are fused into one model.layers.0.mlp.experts.gate_up_proj of one dtype "
        "and shape"
    ), lines
    assert lines[1].startswith("hint: every expert's tensors must share one dtype") and len(lines) == 2, lines
    assert not (tmp_path / "out").exists()
    # torchtitan stacks them into w1 [E, I, H]: the same refusal (was "per-expert HF tensors differ in shape or dtype")
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--schema", "torchtitan"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: [E601] {key}: bfloat16 [16, 32], but model.layers.0.mlp.experts.0."), lines
    assert lines[1].startswith("hint: every expert's tensors must share one dtype") and len(lines) == 2, lines
    assert not (tmp_path / "out").exists()


def test_torchtitan_schema_of_a_model_type_no_adapter_converts_names_it(tmp_path: Path) -> None:
    """``import --schema torchtitan`` of the sample's export (a dots1 model, which no torchtitan adapter converts) said
    only 'the config's model_type does not name a built-in one', hinting the llama3/qwen3 adapters as if any model
    took them. It now names the config.json, its model_type and which model_type each adapter converts; the hint
    gives those adapters for a model of that architecture only. Nothing is written, exit 2."""
    from ckpttool.ops.sample import write_sample

    write_sample(tmp_path / "ckpt")
    res = runner.invoke(
        app,
        [
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--model-assets",
            str(tmp_path / "ckpt" / "model_assets"),
        ],
    )
    assert res.exit_code == 0, res.output
    with (tmp_path / "hf" / "config.json").open() as f:
        model_type = json.load(f)["model_type"]
    res = runner.invoke(app, ["import", str(tmp_path / "hf"), str(tmp_path / "out"), "--schema", "torchtitan"])
    assert res.exit_code == 2 and not (tmp_path / "out").exists(), res.output
    err = res.stderr.splitlines()
    assert err[0] == (
        f"error: [E100] --schema torchtitan needs a model adapter: {tmp_path / 'hf' / 'config.json'} holds model_type "
        f"'{model_type}', which none of its adapters converts (torchtitan-qwen3 (qwen3*), torchtitan-llama3 (llama))"
    ), err
    assert err[1].endswith("only for a model of that architecture"), err


def _renamed_family(family: str) -> Any:
    import transformers

    dims = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 96}
    if family == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**dims, intermediate_size=48))
    if family == "granitemoe":
        cfg = transformers.GraniteMoeConfig(**dims, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        return transformers.GraniteMoeForCausalLM(cfg)
    if family == "qwen2_vl":
        text = {**dims, "num_key_value_heads": 2, "intermediate_size": 48}
        rope = {"rope_type": "default", "mrope_section": [1, 1, 2]}
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
        cfg = transformers.Qwen2VLConfig(text_config={**text, "rope_scaling": rope}, vision_config=vision)
        return transformers.Qwen2VLForConditionalGeneration(cfg)
    text = {**dims, "num_key_value_heads": 2, "intermediate_size": 48}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14}
    if family == "gemma3":
        cfg = transformers.Gemma3Config(
            text_config={**text, "head_dim": 8}, vision_config=vision, mm_tokens_per_image=4
        )
        return transformers.Gemma3ForConditionalGeneration(cfg)
    if family == "mistral3":
        cfg = transformers.Mistral3Config(
            text_config={"model_type": "mistral", **text},
            vision_config={"model_type": "pixtral", **vision, "head_dim": 8},
        )
        return transformers.Mistral3ForConditionalGeneration(cfg)
    assert family == "lfm2_moe", family
    cfg = transformers.Lfm2MoeConfig(
        **dims,
        num_key_value_heads=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=1,
        layer_types=["full_attention", "conv"],
    )
    return transformers.Lfm2MoeForCausalLM(cfg)


@pytest.mark.parametrize(
    "family,stored",
    [
        ("gpt_neox", "embed_out.weight"),
        ("granitemoe", "model.layers.1.block_sparse_moe.input_linear.weight"),
        ("lfm2_moe", "model.layers.1.feed_forward.experts.3.w3.weight"),
        ("qwen2_vl", "visual.patch_embed.proj.weight"),
        ("gemma3", "language_model.model.embed_tokens.weight"),
        ("mistral3", "multi_modal_projector.linear_1.weight"),
    ],
)
def test_keys_from_pretrained_renames_import_under_the_models_own_names(
    tmp_path: Path, family: str, stored: str
) -> None:
    """save_pretrained writes the names transformers' loader renames on load (conversion_mapping.py): GPT-NeoX's
    embed_out.weight (the model's lm_head.weight), Granite MoE's block_sparse_moe.input_linear / output_linear /
    router.layer (experts.gate_up_proj / down_proj, router), LFM2-MoE's per-expert feed_forward.experts.<j>.w1/w3/w2
    (fused experts), Qwen2-VL's model.layers.N / visual.* (model.language_model.layers.N / model.visual.*). Before,
    the import kept the stored names and refused the folder (E605: the model's keys missing; with --allow-mismatch
    dcp.load failed), or for Qwen2-VL (no causal LM to check against) wrote keys dcp.load could not load, as the Llava-style Gemma 3 / Mistral 3 folders (language_model.model.*, vision_tower.*,
    multi_modal_projector.*; Gemma 3 refused, E605); now the model dcp.load fills holds from_pretrained's tensors bit for bit
    and gives its logits."""
    import transformers

    hf_models._quiet()
    torch.manual_seed(67)
    _renamed_family(family).save_pretrained(tmp_path / "hf")
    assert stored in hf_tensors(tmp_path / "hf")
    cli("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(tmp_path / "hf").architectures[0])
    ref = cls.from_pretrained(tmp_path / "hf").eval()
    model = cls.from_pretrained(tmp_path / "hf").eval()
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(sd["model"])
    want = ref.state_dict()
    assert all(bitwise(model.state_dict()[k], v) for k, v in want.items())
    ids = torch.tensor([[3, 17, 42, 5, 88]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("planted", ["short", "long"])
def test_a_stored_key_beside_the_models_own_name_of_it_is_refused_in_one_short_line(
    tmp_path: Path, planted: str
) -> None:
    """Two stored tensors for one model key (GPT-NeoX's ``embed_out.weight`` beside a planted ``lm_head.weight``;
    a Qwen2-VL folder's ``visual.<k>`` beside ``model.visual.<k>``, ``<k>`` 10^6 characters with ANSI escapes) are
    refused, never one of them kept silently: E601 (exit 2) on one line naming both keys, no traceback, nothing
    written. Before, the 10^6-character key was printed whole, twice (a 2 MB line)."""
    from safetensors.torch import save_file

    hf_models._quiet()
    torch.manual_seed(3)
    src = tmp_path / "hf"
    if planted == "short":
        _renamed_family("gpt_neox").save_pretrained(src)
        sd = hf_tensors(src)
        sd["lm_head.weight"] = sd["embed_out.weight"] + 1
        save_file(sd, str(src / "model.safetensors"))
        first, second = "embed_out.weight", "'lm_head.weight'"
    else:
        key = "visual." + "blocks." * 150_000 + "\x1b[2J\x1b[31mproj.weight"
        src.mkdir()
        save_file({key: torch.zeros(2), "model." + key: torch.ones(2)}, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
        first, second = "visual.blocks.blocks.", "'model.visual.blocks."
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "out")])
    assert res.exit_code == 2 and "Traceback" not in res.stderr and "\x1b" not in res.stderr, res.stderr[:2000]
    err = res.stderr.splitlines()
    assert len(err) == 2 and err[0].startswith(f"error: [E601] {first}") and second in err[0], err[0][:2000]
    assert "stored beside another tensor of the model key" in err[0] and len(err[0]) < 1000, len(err[0])
    assert err[1].startswith("hint: ") and not (tmp_path / "out").exists()
