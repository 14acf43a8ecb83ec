"""verl's ``lora_train_meta.json`` beside a LoRA checkpoint is read for a hint only (``export --format lora`` without
``--lora-alpha``): a file that is not JSON (empty or cut short by a killed save, a UTF-8 BOM, bytes not UTF-8) was
E999 'internal error: JSONDecodeError'. It is the usual E601 with the generic hint now, with nothing written."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="module")
def verl_lora_actor(fixture_root: Path) -> Path:
    from tests.fixtures import perrank

    if any(importlib.util.find_spec(m) is None for m in ("verl", "ray", "peft")):
        pytest.skip("verl (with ray) and peft are needed for verl's LoRA saves")
    return cached_build(fixture_root, "perrank_verl_lora", perrank.build_verl_lora) / "full" / "global_step_2" / "actor"


@pytest.mark.parametrize(
    "meta",
    [b"", b'{"r": 4, "lora', b'\xef\xbb\xbf{"r": 4, "lora_alpha": 8}', b"\xff\xfe{}", b"[" * 40000],
    ids=["empty", "cut-short", "bom", "not-utf8", "deep"],
)
def test_an_unreadable_lora_train_meta_is_no_internal_error(verl_lora_actor: Path, tmp_path: Path, meta: bytes) -> None:
    actor = tmp_path / "actor"
    shutil.copytree(verl_lora_actor, actor)
    (actor / "lora_train_meta.json").write_bytes(meta)
    before = {p.name: p.read_bytes() for p in actor.iterdir() if p.is_file()}
    out = tmp_path / "adapter"
    r = runner.invoke(app, ["export", str(actor), str(out), "--format", "lora"])
    assert r.exit_code == 2 and r.stdout == "" and not out.exists(), r.output
    assert r.stderr.splitlines() == [
        f"error: [E601] {actor}: lora_alpha cannot be inferred from the adapter weights",
        "hint: pass --lora-alpha A (the LoraConfig lora_alpha used in training) or --adapter-config FILE",
    ], r.stderr
    assert {p.name: p.read_bytes() for p in actor.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(("meta", "named"), [(None, True), (b"{", False)], ids=["verls", "not-json"])
def test_merge_lora_without_alpha_names_verls_lora_alpha(
    verl_lora_actor: Path, tmp_path: Path, meta: bytes | None, named: bool
) -> None:
    """`export --merge-lora` of the same save without --lora-alpha gave only the generic hint, though `--format lora`
    names the lora_alpha verl recorded; both name it now (and neither reads a broken file as one)."""
    actor = tmp_path / "actor"
    shutil.copytree(verl_lora_actor, actor)
    if meta is not None:
        (actor / "lora_train_meta.json").write_bytes(meta)
    out = tmp_path / "merged"
    r = runner.invoke(app, ["export", str(actor), str(out), "--merge-lora"])
    assert r.exit_code == 2 and r.stdout == "" and not out.exists(), r.output
    lines = r.stderr.splitlines()
    assert lines[0] == (
        "error: [E601] model.layers.0.self_attn.q_proj: lora_alpha is unknown, so the merge scale alpha / r cannot "
        "be computed"
    ), r.stderr
    assert lines[1] == (
        "hint: pass --lora-alpha 8 (verl's lora_train_meta.json beside the checkpoint records r 4, lora_alpha 8) or "
        "--adapter-config FILE"
        if named
        else "hint: pass --lora-alpha A (the LoraConfig lora_alpha used in training) or --adapter-config FILE"
    ), r.stderr
