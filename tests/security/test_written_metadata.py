"""Every ``.metadata`` ckpttool writes loads with plain torch, without ckpttool installed, and with ckpttool.

``reshard`` copies ``planner_data`` from its source. A source whose ``planner_data`` holds
torch objects (a custom planner's dtypes, layouts, ``torch.Size``) is read by ckpttool's
allow-list unpickler into inert stand-ins; they must be written back as plain values, never
as ckpttool classes that only an installation of ckpttool could unpickle. The check runs in a
fresh interpreter in which importing ``ckpttool`` (or ``tests``) fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.directory import CheckpointDir
from tests.fixtures.hostile import NORM_KEY, CorpusEntry

runner = CliRunner()

_WITHOUT_CKPTTOOL = r"""
import importlib.abc, io, json, sys, warnings
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ckpttool", "tests"):
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, _Blocked())
sys.path = [p for p in sys.path if p not in ("", ".")]
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
md = FileSystemReader(sys.argv[1]).read_metadata()
sd = {}
for k, m in md.state_dict_metadata.items():
    sd[k] = io.BytesIO() if isinstance(m, BytesStorageMetadata) else torch.empty(m.size, dtype=m.properties.dtype)
dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)
print(json.dumps({"keys": len(sd), "planner": {k: repr(v) for k, v in (md.planner_data or {}).items()}}))
"""


def test_resharded_metadata_loads_without_ckpttool(corpus: dict[str, CorpusEntry], tmp_path: Path) -> None:
    src = corpus["planner_data_torch_objects"].ckpt
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", str(src), str(out), "--to", "canonical", "--with-optimizer"])
    assert res.exit_code == 0, res.stderr

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CKPTTOOL, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    with CheckpointDir(src) as source:
        assert report["keys"] == len(source.metadata.entries)
    # the custom planner's torch objects come back as plain values: names and int tuples
    assert report["planner"][NORM_KEY] == repr(("model", "model.norm.weight", "float32", "torch.strided", (32,)))

    with CheckpointDir(out) as again:  # and ckpttool reads its own output
        assert again.metadata.planner_data[NORM_KEY] == (
            "model",
            "model.norm.weight",
            "float32",
            "torch.strided",
            (32,),
        )
    res = runner.invoke(app, ["validate", str(out), "--strict", "--deep"])
    assert res.exit_code == 0, res.stdout + res.stderr


def test_the_blocker_really_hides_ckpttool(tmp_path: Path) -> None:
    """The subprocess above cannot import ckpttool: a .metadata naming one of its classes fails there."""
    import pickle

    from ckpttool.format.unpickler import _DTypeStandIn

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_DTypeStandIn("float32")))
    code = (
        _WITHOUT_CKPTTOOL.split("import torch\n")[0]
        + "import pickle; pickle.load(open(sys.argv[1] + '/.metadata', 'rb'))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ckpttool" in proc.stderr, proc.stderr[-2000:]
