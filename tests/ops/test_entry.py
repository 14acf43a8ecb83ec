"""ckpttool.ops.entry: the GC policy of a run (paused from the open until the result is printed,
restored after) and what about a result becomes a warning or an error."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from ckpttool.errors import ReplayMismatchError, UsageError
from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.entry import (
    data_file_warnings,
    deliver,
    replay_mismatch,
    run_inspect,
    run_validate,
    split_param_group_items,
    validation_error,
)
from ckpttool.ops.inspect import InspectOptions
from ckpttool.ops.validate import ValidateOptions


@pytest.fixture
def gc_enabled() -> object:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_inspect_reports_with_the_gc_paused_and_restores_it(dense_ckpt: Path, gc_enabled: object) -> None:
    seen: list[bool] = []
    run_inspect(
        dense_ckpt,
        InspectOptions(),
        report=lambda result: seen.append(gc.isenabled()),
        opening=OpenOptions(declaration=None, trust_pickle=False, selection=None),
    )
    assert seen == [False]
    assert gc.isenabled()


def test_validate_reports_with_the_gc_paused_and_returns_the_result(dense_ckpt: Path, gc_enabled: object) -> None:
    seen: list[bool] = []
    res = run_validate(
        dense_ckpt,
        ValidateOptions(),
        progress=None,
        report=lambda r: seen.append(gc.isenabled()),
        opening=OpenOptions(declaration=None, trust_pickle=False, selection=None),
    )
    assert seen == [False]
    assert gc.isenabled()
    assert res.fatal is None and validation_error(res) is None


def test_validate_fatal_finding_is_its_error(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"garbage")
    res = run_validate(
        tmp_path,
        ValidateOptions(),
        progress=None,
        report=print,
        opening=OpenOptions(declaration=None, trust_pickle=False, selection=None),
    )
    err = validation_error(res)
    assert res.exit_code == 2 and err is not None
    assert err.code == res.fatal.error_code
    assert "is not a readable pickle" in err.message


def test_deliver_pauses_and_restores(gc_enabled: object) -> None:
    seen: list[bool] = []
    deliver(1, lambda _: seen.append(gc.isenabled()))
    assert seen == [False] and gc.isenabled()


def test_gc_held_pauses_freezes_on_resume_and_restores(gc_enabled: object) -> None:
    from ckpttool.model.checkpoint import gc_held

    assert gc.get_freeze_count() == 0
    with gc_held() as resume:
        assert not gc.isenabled()
        with gc_held() as inner:  # nested (a command's hold around an operation's): resumes as the outer would
            assert not gc.isenabled()
            inner()
            assert gc.isenabled() and gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0  # what the inner hold froze is unfrozen when it ends
        resume()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # a caller's paused collector stays paused, even after resume()
    with gc_held() as resume:
        resume()
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
    gc.freeze()  # a caller's own freeze is left to it
    try:
        before = gc.get_freeze_count()
        with gc_held() as resume:
            resume()
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()
    with pytest.raises(KeyError), gc_held():
        raise KeyError("x")
    assert gc.isenabled()


def test_ops_take_an_opened_checkpoint_or_a_path(dense_ckpt: Path) -> None:
    from ckpttool.model.checkpoint import OpenOptions, open_checkpoint
    from ckpttool.ops.inspect import inspect
    from ckpttool.ops.validate import validate

    with open_checkpoint(dense_ckpt, record_problems=True) as ck:
        assert inspect(ck).to_dict() == inspect(dense_ckpt).to_dict()
        assert validate(ck).counts == validate(dense_ckpt, opening=OpenOptions()).counts
        with pytest.raises(UsageError, match="open already"):
            inspect(ck, opening=OpenOptions(trust_pickle=True))
        # the default OpenOptions() asks for nothing the open did not fix: taken with an opened checkpoint too
        assert inspect(ck, opening=OpenOptions()).to_dict() == inspect(dense_ckpt).to_dict()


def test_data_file_warnings(tmp_path: Path) -> None:
    """The warnings of a real ``dcp.save`` (one file per writer thread) whose files were damaged the ways users meet:
    one deleted, one cut short, two left over from another save (one empty); an intact save has none."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpttool.ops.inspect import inspect

    sd = {f"w{i}": torch.arange(64 * (i + 1), dtype=torch.float32) for i in range(4)}
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path), thread_count=4), no_dist=True)
    files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(files) == 4
    assert data_file_warnings(inspect(tmp_path)) == []
    (tmp_path / files[1]).unlink()
    size = (tmp_path / files[3]).stat().st_size
    with open(tmp_path / files[3], "r+b") as f:
        f.truncate(size - 4)
    (tmp_path / "__0_9.distcp").write_bytes(b"leftover")
    (tmp_path / "__1_0.distcp").write_bytes(b"")
    assert data_file_warnings(inspect(tmp_path)) == [
        f"data file {files[1]} is missing",
        f"data file {files[3]} is shorter than its records need ({size - 4} < {size} bytes; truncated?)",
        "data file __0_9.distcp is not referenced by .metadata",
        "run `ckpttool validate --strict` for the full list of problems",
    ]


def test_split_param_group_items() -> None:
    items = [("optim.param_groups.0.lr", 8), ("param_groups.1.eps", 8), ("extra", 3), ("x.param_groups", 4)]
    assert split_param_group_items(items) == (
        [("optim.param_groups.0.lr", 8), ("param_groups.1.eps", 8)],
        [("extra", 3), ("x.param_groups", 4)],
    )


def test_replay_mismatch_names_the_worst() -> None:
    class P:
        fqn = "w"
        problems = ["exp_avg beyond tolerance"]

    class R:
        ok = False
        failed = [P()]
        params = [P(), P()]

    err = replay_mismatch(R())  # type: ignore[arg-type]
    assert isinstance(err, ReplayMismatchError)
    assert err.message == ("1 of 2 parameter(s) do not reproduce the reference step; worst w: exp_avg beyond tolerance")
    R.ok = True
    assert replay_mismatch(R()) is None  # type: ignore[arg-type]


def test_a_wrong_source_options_or_opening_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """A path where the options go, a dict of options, an int source: E100 naming the parameter, before anything
    is opened or written (these were AttributeError / TypeError from deep inside); an opened checkpoint given
    an `opening` is refused by every operation alike (validate ignored it)."""
    import ckpttool
    from ckpttool.model.checkpoint import open_checkpoint

    out = tmp_path / "out"
    ops = {
        "inspect": lambda src, o, op: ckpttool.inspect(src, o, opening=op),
        "validate": lambda src, o, op: ckpttool.validate(src, o, opening=op),
        "export": lambda src, o, op: ckpttool.export_checkpoint(src, out, o, opening=op),
        "reshard": lambda src, o, op: ckpttool.reshard(src, out, o, opening=op),
        "manifest": lambda src, o, op: ckpttool.write_manifest(src, o, opening=op),
        "replay": lambda src, o, op: ckpttool.replay_step(src, o, opening=op),
        "stamp": lambda src, o, op: ckpttool.stamp(src, o, opening=op),
        "diff": lambda src, o, op: ckpttool.diff_checkpoints(src, dense_ckpt, o, opening_a=op),
    }
    for name, op in ops.items():
        for src, o, opening, param in (
            (dense_ckpt, str(tmp_path / "m.json"), None, "`options` must be a "),
            (dense_ckpt, {"strict": True}, None, "`options` must be a "),
            (5, None, None, "`source` must be an opened Checkpoint, a path or a URL, got int 5"),
            (dense_ckpt, None, {"trust_pickle": True}, "`opening` must be an OpenOptions, got dict"),
        ):
            with pytest.raises(UsageError, match=param) as e:
                op(src, o, opening)
            assert e.value.code == "E100", name
        with open_checkpoint(dense_ckpt) as ck, pytest.raises(UsageError, match="open already"):
            op(ck, None, OpenOptions(trust_pickle=True))
    assert not out.exists() and sorted(p.name for p in dense_ckpt.iterdir() if p.name == "m.json") == []


def test_a_misspelt_keyword_is_a_type_error_before_anything_is_opened(tmp_path: Path) -> None:
    """The operations taking ``**hooks: Unpack[Hooks]`` refuse a keyword that is not one of ``Hooks`` as a
    function with named keywords would (a misspelt ``progress`` is not passed over in silence)."""
    import ckpttool

    missing, out = tmp_path / "missing", tmp_path / "out"
    for name, op in (
        ("validate", lambda: ckpttool.validate(missing, progres=print)),
        ("write_manifest", lambda: ckpttool.write_manifest(missing, phases=print)),
        ("export_checkpoint", lambda: ckpttool.export_checkpoint(missing, out, openning=None)),
        ("reshard", lambda: ckpttool.reshard(missing, out, progres=print)),
    ):
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument '\w+'$"):
            op()
    assert not out.exists()


def test_a_closed_checkpoint_is_a_usage_error_for_every_operation_and_read(dense_ckpt: Path, tmp_path: Path) -> None:
    """After close() a read reopened the data files (descriptors nobody closed) and validate reported every
    chunk's file as a finding (S011, exit 1): an operation given a closed checkpoint, or a read, is E100."""
    import ckpttool
    from ckpttool.model.checkpoint import open_checkpoint

    with open_checkpoint(dense_ckpt, record_problems=True) as ck:
        key = next(k for k in ck.catalog.model)
        assert not ck.closed
    assert ck.closed
    out = tmp_path / "out"
    for op in (
        lambda: ckpttool.inspect(ck),
        lambda: ckpttool.validate(ck),
        lambda: ckpttool.export_checkpoint(ck, out),
        lambda: ckpttool.write_manifest(ck, ckpttool.ManifestOptions(out=str(tmp_path / "m.json"))),
        lambda: ckpttool.replay_step(ck),
        lambda: ckpttool.diff_checkpoints(dense_ckpt, ck),
    ):
        with pytest.raises(UsageError, match=f"^\\[E100\\] {dense_ckpt}: the checkpoint was closed$") as e:
            op()
        assert e.value.code == "E100"
    with pytest.raises(UsageError, match="the checkpoint was closed; cannot read"):
        ck.reader.read_tensor(key)
    assert ck.reader._fds == {} and not out.exists() and not (tmp_path / "m.json").exists()


def test_every_bool_and_int_option_of_the_wrong_type_is_a_usage_error_naming_it(
    dense_ckpt: Path, tmp_path: Path
) -> None:
    """Only `trust_pickle` was type-checked: `ValidateOptions(strict="no")` ran a strict validation ("no" is
    truthy), `InspectOptions(depth="2")` ended in a TypeError. Every bool field of every options class must be
    True/False and every int field an int (not a bool): E100 naming the field, before anything is read or written."""
    import dataclasses

    import ckpttool
    from ckpttool.ops.stats import StatsOptions, collect_stats

    out = tmp_path / "out"
    ops: dict[type, object] = {
        ckpttool.InspectOptions: lambda o: ckpttool.inspect(dense_ckpt, o),
        ckpttool.ValidateOptions: lambda o: ckpttool.validate(dense_ckpt, o),
        ckpttool.ExportOptions: lambda o: ckpttool.export_checkpoint(dense_ckpt, out, o),
        ckpttool.ReshardOptions: lambda o: ckpttool.reshard(dense_ckpt, out, o),
        ckpttool.ReplayOptions: lambda o: ckpttool.replay_step(dense_ckpt, o),
        ckpttool.DiffOptions: lambda o: ckpttool.diff_checkpoints(dense_ckpt, dense_ckpt, o),
        ckpttool.ImportOptions: lambda o: ckpttool.import_hf(tmp_path / "hf", out, o),
        ckpttool.SampleOptions: lambda o: ckpttool.write_sample(out, o),
        StatsOptions: lambda o: collect_stats(dense_ckpt, o),
        ckpttool.OpenOptions: lambda o: ckpttool.inspect(dense_ckpt, opening=o),
    }
    checked = []
    for cls, op in ops.items():
        for f in dataclasses.fields(cls):
            bad: tuple[object, ...] = {
                "bool": ("no", 0, None),
                "int": ("2", True, 2.0),
                "int | None": ("2", False),
            }.get(str(f.type), ())
            for value in bad:
                with pytest.raises(UsageError) as e:
                    op(cls(**{f.name: value}))  # type: ignore[operator]
                kind = "True or False" if f.type == "bool" else "an integer"
                assert (e.value.code, e.value.param) == ("E100", f.name)
                assert e.value.message == f"`{f.name}` must be {kind}, got {type(value).__name__} {value!r}", cls
                checked.append(f"{cls.__name__}.{f.name}")
    assert len(set(checked)) == 39  # every bool and int field of the options classes above
    assert not out.exists()
    ok = ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(strict=True, workers=None))
    assert ok.strict is True


def test_numpy_bool_and_integer_options_are_taken_as_their_plain_values(dense_ckpt: Path) -> None:
    """`ValidateOptions(workers=np.int64(2))`, `InspectOptions(depth=np.int64(1))`, `strict=np.True_` ran
    before the one type check of the options classes, which refused them as no int / no bool: a NumPy
    integer or bool is its plain value (results and JSON hold Python ints/bools); a NumPy float or a NumPy
    bool for an int field is still E100."""
    import json

    import numpy as np

    import ckpttool
    from ckpttool.ops.stats import StatsOptions, collect_stats

    res = ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(strict=np.True_, workers=np.int64(2)))
    assert res.strict is True and res.fatal is None
    json.dumps(res.to_dict())
    info = ckpttool.inspect(dense_ckpt, ckpttool.InspectOptions(depth=np.int64(1)))
    json.dumps(info.to_dict())
    stats = collect_stats(dense_ckpt, StatsOptions(workers=np.int32(1), optimizer=np.False_))
    json.dumps(stats.to_dict())
    opened = ckpttool.inspect(dense_ckpt, opening=ckpttool.OpenOptions(trust_pickle=np.False_))
    json.dumps(opened.to_dict())
    for bad, name in ((np.float64(2.0), "workers"), (np.True_, "workers")):
        with pytest.raises(UsageError) as e:
            ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(**{name: bad}))
        assert (e.value.code, e.value.param) == ("E100", name)
        assert e.value.message.startswith("`workers` must be an integer, got ")


def test_a_path_option_given_as_a_string_is_taken_as_its_path(sample_ckpt: Path, tmp_path: Path) -> None:
    """`ExportOptions(model_assets="/ckpt/model_assets")`, a string as every other path option takes, ended in
    `AttributeError: 'str' object has no attribute 'is_dir'`: a `Path` field given a string or another
    `os.PathLike` is that path (the export equals the one given a `Path`); a value that is no path is E100 naming
    the field, before anything is written."""
    import ckpttool

    assets = sample_ckpt / "model_assets"
    as_path = ckpttool.export_checkpoint(sample_ckpt, tmp_path / "a", ckpttool.ExportOptions(model_assets=assets))
    as_str = ckpttool.export_checkpoint(sample_ckpt, tmp_path / "b", ckpttool.ExportOptions(model_assets=str(assets)))
    assert as_str.assets == as_path.assets and "config.json" in as_str.assets
    assert (tmp_path / "b" / "config.json").read_bytes() == (assets / "config.json").read_bytes()
    missing = str(tmp_path / "missing")
    with pytest.raises(UsageError, match="`model_assets` .*missing: no such directory") as e:
        ckpttool.export_checkpoint(sample_ckpt, tmp_path / "c", ckpttool.ExportOptions(model_assets=missing))
    assert e.value.code == "E100"
    for name in ("model_assets", "rules", "adapter_config"):
        with pytest.raises(UsageError) as e:
            ckpttool.export_checkpoint(sample_ckpt, tmp_path / "c", ckpttool.ExportOptions(**{name: 42}))
        assert (e.value.code, e.value.param) == ("E100", name)
        assert e.value.message.startswith(f"`{name}` must be a path, got int 42")
    assert not (tmp_path / "c").exists()


def test_a_path_or_config_option_that_is_no_path_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """`ValidateOptions(config=[...])` ended in `TypeError: expected str, bytes or os.PathLike object, not list`
    after the checkpoint was opened, as did the other `str | os.PathLike` options given another type: E100 naming
    the option, before anything is read or written; a dict is still a config, a str or Path a path."""
    import ckpttool

    m = tmp_path / "m.json"
    for op, name in (
        (lambda: ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(config=[1, 2])), "config"),  # type: ignore[arg-type]
        (lambda: ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(against=3)), "against"),  # type: ignore[arg-type]
        (lambda: ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(manifest=True)), "manifest"),  # type: ignore[arg-type]
        (lambda: ckpttool.replay_step(dense_ckpt, ckpttool.ReplayOptions(grads=1)), "grads"),  # type: ignore[arg-type]
        (lambda: ckpttool.write_manifest(dense_ckpt, ckpttool.ManifestOptions(out=5)), "out"),  # type: ignore[arg-type]
        (lambda: ckpttool.diff_checkpoints(dense_ckpt, dense_ckpt, ckpttool.DiffOptions(map_rules=[])), "map_rules"),  # type: ignore[arg-type]
    ):
        with pytest.raises(UsageError) as e:
            op()
        assert (e.value.code, e.value.param) == ("E100", name)
        assert e.value.message.startswith(f"`{name}` must be a path")
    assert not m.exists() and not (dense_ckpt / "manifest.json").exists()
    cfg = {"model_type": "llama"}
    assert ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(config=cfg, select=("K",))).fatal is None


def test_a_path_argument_that_is_no_path_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """`open_checkpoint(b"ckpt")` and an output directory given as bytes, a number or None ended in `TypeError:
    cannot use a string pattern on a bytes-like object` (or `expected str, bytes or os.PathLike`) from deep inside,
    while the same value as an operation's source was E100: each path argument of the library gives E100 naming
    it, and nothing is written."""
    import ckpttool

    hf = tmp_path / "hf"
    ckpttool.export_checkpoint(dense_ckpt, hf, ckpttool.ExportOptions())
    before = sorted(p.name for p in tmp_path.iterdir())
    for bad in (bytes(dense_ckpt), 7, None):
        for op, name in (
            (lambda b: ckpttool.open_checkpoint(b), "path"),  # type: ignore[arg-type]
            (lambda b: ckpttool.export_checkpoint(dense_ckpt, b), "out"),  # type: ignore[arg-type]
            (lambda b: ckpttool.reshard(dense_ckpt, b), "out"),  # type: ignore[arg-type]
            (lambda b: ckpttool.import_hf(b, tmp_path / "dcp"), "hf_dir"),  # type: ignore[arg-type]
            (lambda b: ckpttool.import_hf(hf, b), "out"),  # type: ignore[arg-type]
            (lambda b: ckpttool.write_sample(b), "path"),  # type: ignore[arg-type]
        ):
            with pytest.raises(UsageError) as e:
                op(bad)
            assert (e.value.code, e.value.param) == ("E100", name), e.value
            assert e.value.message.startswith(f"`{name}` must be a path, got {type(bad).__name__}")
    with pytest.raises(UsageError) as e:
        ckpttool.check_against_manifest(dense_ckpt, b"manifest.json")  # type: ignore[arg-type]
    assert (e.value.code, e.value.param) == ("E100", "manifest_path")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_integer_option_below_its_bound_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """The CLI refuses `--workers 0`, `--depth -1`, `--train-steps -1` (Typer's `min=`); the library took them:
    `StatsOptions(workers=0)`, `ValidateOptions(workers=-1)`, `InspectOptions(depth=0)`, `SampleOptions(steps=-1)`
    and `DiffOptions(max_differences=-1)` returned results, `ReshardOptions(threads=0)` went on to plan. Each
    bounded field (`errors.at_least`) is E100 naming it, before anything is read or written."""
    import ckpttool

    hf, out = tmp_path / "hf", tmp_path / "out"
    ckpttool.export_checkpoint(dense_ckpt, hf, ckpttool.ExportOptions())
    c = ckpttool
    cases = (
        ("workers", 1, lambda v: c.collect_stats([dense_ckpt], c.StatsOptions(workers=v))),
        ("workers", 1, lambda v: c.validate(dense_ckpt, c.ValidateOptions(deep=True, workers=v))),
        ("workers", 1, lambda v: c.export_checkpoint(dense_ckpt, out, c.ExportOptions(workers=v))),
        ("quantize_block", 1, lambda v: c.export_checkpoint(dense_ckpt, out, c.ExportOptions(quantize_block=v))),
        ("depth", 1, lambda v: c.inspect(dense_ckpt, c.InspectOptions(depth=v))),
        ("threads", 1, lambda v: c.reshard(dense_ckpt, out, c.ReshardOptions(threads=v))),
        ("target_ep_size", 1, lambda v: c.reshard(dense_ckpt, out, c.ReshardOptions(target_ep_size=v))),
        ("world_size", 1, lambda v: c.import_hf(hf, out, c.ImportOptions(world_size=v))),
        ("ep_fsdp_size", 1, lambda v: c.import_hf(hf, out, c.ImportOptions(ep_size=1, ep_fsdp_size=v))),
        ("steps", 0, lambda v: c.write_sample(out, c.SampleOptions(steps=v))),
        ("max_differences", 0, lambda v: c.diff_checkpoints(dense_ckpt, dense_ckpt, c.DiffOptions(max_differences=v))),
    )
    for name, minimum, op in cases:
        for bad in (minimum - 1, -5):
            with pytest.raises(UsageError) as e:
                op(bad)
            assert (e.value.code, e.value.param) == ("E100", name), e.value
            assert e.value.message == f"`{name}` must be an integer >= {minimum}, got {bad}"
            assert e.value.hint is not None and e.value.hint.startswith(f"pass {name}={minimum} or more"), e.value
    assert not out.exists()
    assert c.diff_checkpoints(dense_ckpt, dense_ckpt, c.DiffOptions(max_differences=0)).equal


def test_a_list_for_a_one_string_option_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """`filter_glob=["*layers.0*"]` (as `StatsOptions`/`DiffOptions` take `filters`) ended in `TypeError:
    unhashable type: 'list'` from inspect, export and replay-step: a list, tuple or set for a field of one string is
    E100 naming it, before anything is read or written; the string itself still works."""
    import ckpttool

    out = tmp_path / "out"
    ops = (
        lambda o: ckpttool.inspect(dense_ckpt, ckpttool.InspectOptions(**o)),
        lambda o: ckpttool.export_checkpoint(dense_ckpt, out, ckpttool.ExportOptions(**o)),
        lambda o: ckpttool.replay_step(dense_ckpt, ckpttool.ReplayOptions(**o)),
    )
    for op in ops:
        for bad in (["*layers.0*"], ("*layers.0*",), {"*layers.0*"}):
            with pytest.raises(UsageError) as e:
                op({"filter_glob": bad})
            assert (e.value.code, e.value.param) == ("E100", "filter_glob")
            assert e.value.message.startswith(f"`filter_glob` must be one string, got {type(bad).__name__} ")
    assert not out.exists()
    with pytest.raises(UsageError) as e:
        ckpttool.diff_checkpoints(dense_ckpt, dense_ckpt, ckpttool.DiffOptions(what=["model"]))
    assert e.value.param == "what"
    assert ckpttool.inspect(dense_ckpt, ckpttool.InspectOptions(filter_glob="*")).to_dict()


def test_the_writing_operations_share_their_output_options(sample_ckpt: Path, tmp_path: Path) -> None:
    """export, reshard and import take ``overwrite``/``manifest``/``algorithm``/``dry_run`` from one base,
    with one meaning: a dry run writes nothing, ``overwrite`` never replaces a directory ckpttool did not
    write (E606), an unknown ``algorithm`` is E100; each class's own fields keep their positions."""
    from dataclasses import replace

    import ckpttool
    from ckpttool.errors import ForeignOutputError
    from ckpttool.ops.fields import OutputOptions

    hf = tmp_path / "hf"
    ckpttool.export_checkpoint(sample_ckpt, hf, ckpttool.ExportOptions())
    ops = {
        ckpttool.ExportOptions: lambda out, o: ckpttool.export_checkpoint(sample_ckpt, out, o),
        ckpttool.ReshardOptions: lambda out, o: ckpttool.reshard(sample_ckpt, out, replace(o, with_optimizer=True)),
        ckpttool.ImportOptions: lambda out, o: ckpttool.import_hf(hf, out, o),
    }
    own_first = {ckpttool.ExportOptions: ("fmt", "lora"), ckpttool.ReshardOptions: ("to", "legacy")}
    own_first[ckpttool.ImportOptions] = ("schema", "torchtitan")
    foreign = tmp_path / "training-run"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not ckpttool's")
    for cls, op in ops.items():
        assert issubclass(cls, OutputOptions)
        name, value = own_first[cls]
        assert getattr(cls(value), name) == value  # type: ignore[call-arg]
        planned = op(tmp_path / f"dry-{cls.__name__}", cls(dry_run=True, manifest=True))
        assert planned.dry_run is True and not (tmp_path / f"dry-{cls.__name__}").exists()
        with pytest.raises(ForeignOutputError) as e:
            op(foreign, cls(overwrite=True))
        assert e.value.code == "E606"
        with pytest.raises(UsageError) as u:
            op(tmp_path / "never", cls(manifest=True, algorithm="md5"))
        assert u.value.code == "E100" and "md5" in u.value.message
        assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_one_string_for_a_sequence_option_is_a_usage_error_naming_it(dense_ckpt: Path, tmp_path: Path) -> None:
    """`ValidateOptions(ignore="D001")` was read as the codes 'D', '0', '0', '1' (E100 "'0' matches no rule code",
    naming no value the caller gave), and `ExportOptions(quantize_skip="*norm*")` as one-character globs: one string
    for a field of several is E100 naming the field and the string; a list of it works."""
    import ckpttool

    out = tmp_path / "out"
    for op, name, value in (
        (lambda o: ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(**o)), "ignore", "D001"),
        (lambda o: ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(**o)), "select", "S"),
        (lambda o: ckpttool.export_checkpoint(dense_ckpt, out, ckpttool.ExportOptions(**o)), "quantize_skip", "*"),
        (lambda o: ckpttool.export_checkpoint(dense_ckpt, out, ckpttool.ExportOptions(**o)), "allow_mismatch", "x"),
        (lambda o: ckpttool.replay_step(dense_ckpt, ckpttool.ReplayOptions(**o)), "offload_patterns", "*"),
    ):
        with pytest.raises(UsageError) as e:
            op({name: value})
        assert (e.value.code, e.value.param) == ("E100", name), e.value
        assert e.value.message.startswith(f"`{name}` {value!r} is not a sequence of non-empty "), e.value
        assert e.value.hint == f"pass a list or tuple of them: {name}=[{value!r}]"
    assert not out.exists()
    assert ckpttool.validate(dense_ckpt, ckpttool.ValidateOptions(ignore=["D001"], select=["S"])).fatal is None
