"""Wrapper segments (``module.``, ``_orig_mod.``, ...: ``ckpttool.model.wrappers``) in hostile numbers: a model key of
10^5 leading ``module.`` segments beside ``get_optimizer_state_dict``'s clean fqn, saved by torch's ``dcp.save``. Every
reading command ends in bounded memory (RLIMIT_AS 3 GiB), with no E999."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

SEGMENTS = 100_000


def _digest(ckpt: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(ckpt.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def deep_wrapped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``w`` stored as ``module.module....module.w`` (10^5 segments, a 0.7 MB key) and ``v`` plain, with AdamW
    state keyed by the clean fqns, as torch's ``get_optimizer_state_dict`` names parameters."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w, v], lr=1e-3)
    (w.sum() + v.pow(2).sum()).backward()
    opt.step()
    sd = opt.state_dict()
    state = {"w": sd["state"][0], "v": sd["state"][1]}
    groups = [{**g, "params": ["w", "v"]} for g in sd["param_groups"]]
    model = {".".join(["module"] * SEGMENTS) + ".w": w.detach(), "v": v.detach()}
    out = tmp_path_factory.mktemp("deep") / "ck"
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=str(out))
    return out


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize("command", [["inspect"], ["validate", "--strict", "--deep"], ["stats"]])
def test_ten_to_five_wrapper_segments_in_one_key_are_bounded(
    deep_wrapped: Path, tmp_path: Path, command: list[str]
) -> None:
    """Key-schema detection built every leading run of wrapper segments as a model prefix (10^5 strings of up to
    0.7 MB: ~35 GB), and each command ended in E999 MemoryError; the input is never changed."""
    before = _digest(deep_wrapped)
    p = subprocess.run(
        [sys.executable, "-m", "ckpttool", *command, str(deep_wrapped)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_cap,
        env={**os.environ, "CKPTTOOL_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "120"},
    )
    assert p.returncode in (0, 1), p.stderr[-2000:]
    assert "E999" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert _digest(deep_wrapped) == before
