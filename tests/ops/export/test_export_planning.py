"""Export planning's fast paths give exactly what the per-key code gives (10^6-entry work, docs/performance.md).

The chunk checks of an export reuse the de-duplication and tiling of a ``TensorMeta`` shared by
many entries and skip the per-chunk ``check_allocation`` call when the records plainly fit; the
key rules run as one mapper; the plan records its file sizes while packing. Each is compared
here with the per-key reference it replaces, on a real ``dcp.save`` checkpoint, including the
error raised for forged records.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.errors import CkptError
from ckpttool.format import CheckpointReader
from ckpttool.format.metadata import StorageInfo
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.ops.export.execute import _checked_chunks, _dedup_chunks
from ckpttool.ops.export.plan import build_plan, select_sources
from ckpttool.ops.export.rules import KeyRule, load_rules

KEYS = [f"model.model.layers.{i}.w" for i in range(6)]


@pytest.fixture()
def same_layout_ckpt(tmp_path: Path) -> Path:
    """Six [4, 3] float32 tensors of one layout (one chunk each) and one of another shape."""
    sd = {k: torch.arange(12, dtype=torch.float32).reshape(4, 3) + i for i, k in enumerate(KEYS)}
    sd["model.model.norm.weight"] = torch.ones(5)
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck"


def _share_meta(r: CheckpointReader) -> None:
    # as the metadata cache decodes them: entries of one layout share one TensorMeta object
    shared = r.metadata.entries[KEYS[0]]
    for k in KEYS[1:]:
        assert r.metadata.entries[k] == shared
        r.metadata.entries[k] = shared


def _outcome(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except CkptError as e:
        return (type(e), str(e))


def test_checked_chunks_equal_the_per_key_checks(same_layout_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [*KEYS, "model.model.norm.weight"]
    with CheckpointReader(same_layout_ckpt) as r:
        _share_meta(r)
        ref = [_dedup_chunks(r, k) for k in keys]
        calls: list[str] = []
        real = r.check_allocation
        monkeypatch.setattr(r, "check_allocation", lambda k, m: (calls.append(k), real(k, m))[1])
        assert _checked_chunks(r, keys) == ref
        # the files are sized now: only the first key of each layout takes the full check
        assert calls == [KEYS[0], "model.model.norm.weight"]

        storage = dict(r.metadata.storage)  # a plain mapping to forge records in (the parsed table is read-only)
        object.__setattr__(r.metadata, "storage", storage)
        victim = (KEYS[3], (0, 0))
        good = storage[victim]
        size = (same_layout_ckpt / good.relative_path).stat().st_size
        forged = [
            good._replace(length=good.length - 1),  # a record shorter than 48 bytes of float32
            good._replace(length=47),
            good._replace(offset=size - good.length + 1),  # past the end of its file
            good._replace(transform_descriptors=("zstd",)),  # compressed: may be small, passes
            StorageInfo("missing.distcp", 0, good.length),  # no such file
        ]
        for bad in forged:
            storage[victim] = bad
            expected = _outcome(lambda: [_dedup_chunks(r, k) for k in keys])
            assert _outcome(lambda: _checked_chunks(r, keys)) == expected, bad
        storage[victim] = good
        del storage[victim]
        expected = _outcome(lambda: [_dedup_chunks(r, k) for k in keys])
        assert isinstance(expected, tuple)  # no record: an error that names the key
        assert _outcome(lambda: _checked_chunks(r, keys)) == expected


def test_key_mapper_is_map_key() -> None:
    base = load_rules(None)
    rules = replace(
        base,
        keys=(
            KeyRule(re.compile(r"^model\.skip\.(.+)$"), None),
            KeyRule(re.compile(r"^model\.(?P<a>x)(?P<b>y)?\.(.*)$"), r"\g<a>-\g<b>-\g<3>-\3", warn=True),
            KeyRule(re.compile(r"^model\.(a)(b)$"), r"\2\1\\n"),
            *base.keys,
        ),
    )
    mapped = rules.key_mapper()
    for key in ["model.model.layers.0.w", "model.lm_head.weight", "model.skip.w", "model.x.z", "model.xy.z",
                "model.ab", "model.free", "other.w", "model.model.a\nb"]:  # fmt: skip
        assert mapped(key) == rules.map_key(key), key


def test_plan_file_bytes_are_the_tasks_bytes(same_layout_ckpt: Path) -> None:
    with open_checkpoint(same_layout_ckpt) as ck:
        rules = load_rules(None)
        selected = select_sources(ck.catalog, rules)[0]
        for shard_size, dtype in ((100, "preserve"), (10**9, "bfloat16"), (1, "float16")):
            plan = build_plan(selected, rules, shard_size=shard_size, save_dtype=dtype)
            per_file = [0] * len(plan.files)
            for t in plan.tasks:
                per_file[t.shard] += t.out_nbytes
            assert plan.file_bytes() == per_file
            assert plan.total_bytes == sum(per_file)
            plan.tasks = plan.tasks[:2]  # replaced: computed again from the tasks
            assert sum(plan.file_bytes()) == sum(t.out_nbytes for t in plan.tasks)


def test_plain_entries_index_and_accounting_equal_the_per_key_code(same_layout_ckpt: Path) -> None:
    # the comprehension path of the header entries, the index's sorted pairs and the set difference of
    # the unaccounted tensors against the per-key loops they replace, over one and several files
    from ckpttool.format.safetensors import HeaderEntry
    from ckpttool.ops.export.plan import _header_entries, unaccounted_tensors

    with open_checkpoint(same_layout_ckpt) as ck:
        rules = load_rules(None)
        selected = select_sources(ck.catalog, rules)[0]
        for shard_size in (10**9, 100):
            plan = build_plan(selected, rules, shard_size=shard_size)
            want: list[list[HeaderEntry]] = [[] for _ in plan.files]
            for t in plan.tasks:
                want[t.shard] += [HeaderEntry(p.name, p.dtype, p.shape) for p in t.pieces]
            assert plan.entries == want and (len(plan.files) == 1) == (shard_size > 100)
            wm = {e.name: f for f, ents in zip(plan.files, plan.entries) for e in ents}
            assert plan.weight_map() == dict(sorted(wm.items()))
            assert unaccounted_tensors(ck.catalog, plan, set()) == []
            gone = [KEYS[4], KEYS[1]]
            plan.tasks = [t for t in plan.tasks if t.selected.model_key not in gone]
            assert unaccounted_tensors(ck.catalog, plan, {KEYS[4]}) == [KEYS[1]]
            plan.skipped = {"why": [KEYS[1]]}
            assert unaccounted_tensors(ck.catalog, plan, set()) == [KEYS[4]]
        # a name twice, or not ASCII: the loop names the error (or keeps a UTF-8 name), as before
        plan = build_plan(selected, rules)
        twice = [replace(t, pieces=(replace(t.pieces[0], name="x"),)) for t in plan.tasks[:2]]
        with pytest.raises(CkptError, match="produced twice"):
            _header_entries(twice, 1)
        utf8 = [replace(plan.tasks[0], pieces=(replace(plan.tasks[0].pieces[0], name="ünï"),))]
        assert [e.name for e in _header_entries(utf8, 1)[0]] == ["ünï"]


def test_export_leaves_the_gc_as_it_found_it(same_layout_ckpt: Path, tmp_path: Path) -> None:
    # the open's and the plan's objects are frozen (gc.freeze) for the writes, and unfrozen afterwards;
    # a caller's own freeze is not undone
    import gc

    from typer.testing import CliRunner

    from ckpttool.cli.app import app
    from ckpttool.ops.export import export_checkpoint

    assert gc.isenabled() and gc.get_freeze_count() == 0
    export_checkpoint(same_layout_ckpt, tmp_path / "lib")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    res = CliRunner().invoke(app, ["export", str(same_layout_ckpt), str(tmp_path / "cli")])
    assert res.exit_code == 0, res.output
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        res = CliRunner().invoke(app, ["export", str(same_layout_ckpt), str(tmp_path / "cli2")])
        assert res.exit_code == 0, res.output
        assert gc.isenabled() and gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()
    # the three exports are the same bytes
    assert (tmp_path / "lib" / "model.safetensors").is_file()
    for name in ("model.safetensors", "model.safetensors.index.json"):
        ref = (tmp_path / "lib" / name).read_bytes() if (tmp_path / "lib" / name).exists() else None
        for d in ("cli", "cli2"):
            got = (tmp_path / d / name).read_bytes() if (tmp_path / d / name).exists() else None
            assert got == ref, (d, name)
