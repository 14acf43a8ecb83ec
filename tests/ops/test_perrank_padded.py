"""verl FSDP2 rank files whose shards are padded (3 gloo ranks; tests/fixtures/perrank.py ``build_verl_uneven``).

FSDP2 pads each rank's shard storage to ``ceil(rows / 3)`` rows; the last rank's local tensor is a
view of part of the storage ``torch.save`` writes, so its chunk's window is part of its record. The
tensors are checked against what torch gathers from the live model (``DTensor.full_tensor``), and
a changed byte inside such a record (in the window or in the padding) is a CRC-32 error (E308) for
every command that reads it, as it is for a whole record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.checkpoint import open_checkpoint
from tests.fixtures.cache import cached_build

runner = CliRunner()

# verl's own save on 3 gloo ranks (~1 min on a 2-core machine): the full run covers it (README)
pytestmark = pytest.mark.heavy

EMBED = "model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def uneven(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None:
        pytest.skip("verl is not installed (.ci/run installs it)")
    return cached_build(fixture_root, "perrank_verl_uneven", perrank.build_verl_uneven)


def _actor(root: Path) -> Path:
    return root / "w3" / "global_step_2" / "actor"


def _partial_window(actor: Path) -> tuple[str, int, int, int]:
    """``(rank file, window offset, window length, record length)`` of the embedding's padded chunk."""
    with open_checkpoint(actor) as ck:
        reader = ck.reader
        for chunk in ck.metadata.entries[EMBED].chunks:
            info = reader.metadata.storage[(EMBED, chunk.offsets)]
            member = reader.assembled.members[(info.relative_path, info.offset)]
            if member.size != info.length:
                return info.relative_path, info.offset, info.length, member.size
    raise AssertionError("no padded chunk: the premise of these tests")


def test_padded_shards_assemble_to_the_gathered_tensors(uneven: Path) -> None:
    import torch

    ref = torch.load(uneven / "w3" / "reference.pt", weights_only=False)
    actor = _actor(uneven)
    rel, offset, length, record = _partial_window(actor)
    assert rel == "model_world_size_3_rank_2.pt" and (length, record) == (20 * 16 * 4, 22 * 16 * 4)
    with open_checkpoint(actor) as ck:
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(actor)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"] is True


@pytest.mark.parametrize("where", ["window", "padding"])
def test_a_changed_byte_in_a_padded_record_is_e308(uneven: Path, tmp_path: Path, where: str) -> None:
    actor = shutil.copytree(_actor(uneven), tmp_path / "actor")
    rel, offset, length, record = _partial_window(actor)
    data = bytearray((actor / rel).read_bytes())
    data[offset + 100 if where == "window" else offset + length + 10] ^= 0x40
    (actor / rel).write_bytes(data)
    line = f"error: [E308] {actor / rel}: storage record data/"
    for cmd in (["stats"], ["export", str(tmp_path / "out")], ["replay-step", "--device", "cpu"]):
        res = runner.invoke(app, [cmd[0], str(actor), *cmd[1:]])
        assert res.exit_code == 2, (cmd, res.output)
        assert res.stderr.startswith(line) and f"(of '{EMBED}') fails its CRC-32 check" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    res = runner.invoke(app, ["validate", "--deep", "--json", str(actor)])
    assert res.exit_code == 1
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"]
    assert found == [("S014", EMBED)], found
    assert (actor / rel).read_bytes() == data  # the source is never modified
