"""D017 (validate --deep, duplicated-chunks) over a crafted ``.metadata`` that tiles one trained weight into many
1-row chunks, every one of them the same stored archive (a rank file copied over all the others, taken to the
extreme). The finding named four chunks and said nothing of the other hundreds: as if four were copies. It counts
them now. (Its cost stays linear: 50,000 such chunks take the time of the deep pass that reads them.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hostile import fast_metadata_pickle, metadata_specs
from tests.fixtures.metadata_edit import append_bytes, load_md, torch_save_archive

runner = CliRunner()
ROWS, WIDTH = 300, 64


def _trained_save(root: Path) -> torch.Tensor:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, ROWS, bias=False))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(2):
        net(torch.randn(2, WIDTH)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(root), no_dist=True)
    return msd["0.weight"].detach()


def test_every_chunk_one_archive_is_counted_in_d017(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    weight = _trained_save(root)
    md = load_md(root)
    key = "model.0.weight"
    rel = next(s.relative_path for i, s in md.storage_data.items() if i.fqn == key)
    tensors, byte_items, planner = metadata_specs(md)
    one = (rel, *append_bytes(root, rel, torch_save_archive(weight[5:6].clone())))
    tensors = [
        (k, dt, size, [((i, 0), (1, WIDTH), one) for i in range(ROWS)] if k == key else chunks)
        for k, dt, size, chunks in tensors
    ]
    (root / ".metadata").write_bytes(fast_metadata_pickle(tensors, byte_items, planner))
    r = runner.invoke(app, ["validate", "--json", "--deep", "--select", "D017", str(root)])
    doc = json.loads(r.stdout)
    assert [f["message"] for f in doc["findings"] if f["code"] == "D017"] == [
        f"{key}: chunks at (0, 0) and (1, 0) and (2, 0) and (3, 0) and {ROWS - 4} more hold bitwise identical "
        f"values ({WIDTH} float32 each): one shard's bytes stored in another's place"
    ], doc["findings"]
