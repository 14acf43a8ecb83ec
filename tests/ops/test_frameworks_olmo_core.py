"""OLMo-core 3.0 checkpoints written by its own ``Checkpointer`` (tests/fixtures/olmo_core_writer.py).

References: the full state gathered in the saving job (``get_*_state_dict(full_state_dict=True)``)
and OLMo-core's own reader (``olmo_core.distributed.checkpoint.load_keys``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow  # a 2-rank gloo job of OLMo-core's trainer checkpointer

runner = CliRunner()


def _olmo_run(fixture_root: Path, name: str, builder: str) -> Path:
    """The cached run ``name`` that OLMo-core's own save code writes (``olmo_core_writer.<builder>``); skipped where
    OLMo-core is not installed."""
    from tests.fixtures import olmo_core_writer
    from tests.fixtures.writers import missing

    why = missing("olmo_core.train.checkpoint", "olmo_core.nn.transformer")
    if why:
        pytest.skip(why)
    return cached_build(fixture_root, name, getattr(olmo_core_writer, builder))


@pytest.fixture(scope="module")
def olmo_root(fixture_root: Path) -> Path:
    return _olmo_run(fixture_root, "writers_olmo_core", "build_olmo_core")


def cli(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (args, res.stdout, res.stderr)
    return res.stdout


def test_found_from_run_root_and_step_dir(olmo_root: Path) -> None:
    for given in (olmo_root / "run", olmo_root / "run" / "step2", olmo_root / "run" / "step2" / "model_and_optim"):
        doc = json.loads(cli("inspect", str(given), "--json"))
        assert doc["location"]["model"].endswith("step2/model_and_optim")
        ks = doc["key_schema"]
        assert ks["id"] == "olmo-core" and ks["optimizer_prefix"] == "optim." and ks["optimizer_keying"] == "fqn"
        assert any("under 'optim.', keyed by parameter fqn" in r for r in ks["reasons"])
        assert doc["summary"]["model_tensor_count"] == 21


def test_a_step_without_train_rank0_is_named(olmo_root: Path, tmp_path: Path) -> None:
    """OLMo-core's load reads train/rank{R}.pt, else train/rank0.pt, and without either restores no trainer state
    (a resume restarts at step 0 over the saved weights and moments); its latest_checkpoint skips such a
    directory. validate --strict --deep passed a step whose train/rank0.pt was lost; now K011 names it. A
    missing train/rank1.pt is what OLMo-core reads rank 0's file for (another world size): not reported."""
    import shutil

    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    (run / "step2" / "train" / "rank1.pt").unlink()
    doc = json.loads(cli("validate", "--strict", "--deep", str(run), "--json"))
    assert doc["ok"] and not doc["findings"], doc["findings"]
    shutil.copy(olmo_root / "run" / "step2" / "train" / "rank1.pt", run / "step2" / "train" / "rank1.pt")
    (run / "step2" / "train" / "rank0.pt").unlink()
    doc = json.loads(cli("validate", "--strict", "--deep", str(run), "--json", code=1))
    (k011,) = [f for f in doc["findings"] if f["code"] == "K011"]
    assert k011["message"].startswith(f"{run / 'step2'}: train/rank0.pt missing (train/ holds train/rank1.pt): ")
    assert "restores no trainer state" in k011["message"]
    shutil.rmtree(run / "step2" / "train")
    doc = json.loads(cli("validate", "--strict", str(run), "--json", code=1))
    assert [f["code"] for f in doc["findings"]] == ["K011"] and "(no train/rank*.pt)" in doc["findings"][0]["message"]


def test_latest_passes_over_a_step_without_train_rank0_as_olmo_core_does(fixture_root: Path, tmp_path: Path) -> None:
    """OLMo-core's ``Checkpointer.latest_checkpoint`` (what its trainer resumes from) lists a step directory only
    when it holds train/rank0.pt beside model_and_optim/ and .metadata.json: a run whose step2 lost that file (a
    copy of the weights only) resumes from step1. ``--step latest`` validated (and exported) step2, warning only
    K011 for the file. Now it chooses step1, as OLMo-core's own search does, and R001 names step2; ``--step 2``
    still opens step2 (K011)."""
    from olmo_core.train.checkpoint import Checkpointer

    steps = _olmo_run(fixture_root, "olmo_core_steps", "build_olmo_core_steps")
    run = shutil.copytree(steps / "run", tmp_path / "run")
    (run / "step2" / "train" / "rank0.pt").unlink()
    assert Checkpointer.latest_checkpoint(run) == str(run / "step1")  # the reference: OLMo-core's own choice
    doc = json.loads(cli("inspect", str(run), "--step", "latest", "--json"))
    assert doc["location"]["model"] == str(run / "step1" / "model_and_optim"), doc["location"]
    assert [i["step"] for i in doc["location"]["newer_incomplete"]] == [2]
    doc = json.loads(cli("validate", str(run), "--step", "latest", "--json"))
    assert doc["path"] == str(run / "step1" / "model_and_optim")
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert r001["message"].startswith(f"{run / 'step2'}: step 2 is newer than the checked step 1 but incomplete (")
    assert "no train/rank0.pt, which OLMo-core's latest_checkpoint requires" in r001["message"]
    cli("validate", "--strict", str(run), "--step", "latest", code=1)
    doc = json.loads(cli("validate", str(run), "--step", "2", "--json"))
    assert doc["path"] == str(run / "step2" / "model_and_optim")
    assert [f["code"] for f in doc["findings"] if f["severity"] != "info"] == ["K011"]


def test_training_state_beside_model_and_optim_is_named(olmo_root: Path, tmp_path: Path) -> None:
    """A pickle of training state saved into stepN/ beside model_and_optim/ and train/ (a callback's
    torch.save, a folder of per-rank data loader states) was passed over in silence: validate --strict OK
    from the run root, the step or model_and_optim/. K012 and inspect's unread_beside now name them;
    OLMo-core's own train/ (read) and .metadata.json are not named."""
    import torch

    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    torch.save({"tokens_seen": 7}, run / "step2" / "callback_state.pt")
    (run / "step2" / "loader").mkdir()
    torch.save({"position": 3}, run / "step2" / "loader" / "rank0.pt")
    for given, rel in ((run, "step2/"), (run / "step2", ""), (run / "step2" / "model_and_optim", f"{run / 'step2'}/")):
        doc = json.loads(cli("validate", "--strict", str(given), "--json", code=1))
        (k012,) = [f for f in doc["findings"] if f["code"] == "K012"]
        assert k012["message"].endswith(f"does not read: {rel}callback_state.pt, {rel}loader/"), k012
        doc = json.loads(cli("inspect", str(given), "--json"))
        assert doc["unread_beside"] == [f"{rel}callback_state.pt", f"{rel}loader/"]
    assert json.loads(cli("inspect", str(olmo_root / "run"), "--json"))["unread_beside"] == []


def test_a_step_without_its_metadata_json_is_not_latest(olmo_root: Path, tmp_path: Path) -> None:
    """OLMo-core's Checkpointer writes stepN/.metadata.json last (after train/ and model_and_optim/) and its
    find_checkpoints skips a step directory without it. A newer step whose save stopped before it was
    `--step latest` (validated OK, exported) although the trainer resumes from the step before; now it is
    skipped and named, `--step 3` is E202, and a run root holding only such a step is E202."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(olmo_root / "run", run)
    shutil.copytree(run / "step2", run / "step3")
    (run / "step3" / ".metadata.json").unlink()
    doc = json.loads(cli("inspect", str(run), "--step", "latest", "--json"))
    assert doc["location"]["model"] == str(run / "step2" / "model_and_optim")
    assert "step 3 is incomplete: model_and_optim/, train/ but no .metadata.json" in doc["location"]["how"]
    doc = json.loads(cli("validate", "--strict", str(run), "--step", "latest", "--json", code=1))
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]  # the newer step is named, never passed over
    assert doc["path"] == str(run / "step2" / "model_and_optim") and "no .metadata.json" in r001["message"]
    res = runner.invoke(app, ["export", str(run), str(tmp_path / "hf"), "--step", "3"])
    assert res.exit_code == 2 and "[E202]" in res.stderr and "no .metadata.json" in res.stderr
    assert not (tmp_path / "hf").exists()
    shutil.rmtree(run / "step2")
    res = runner.invoke(app, ["validate", "--strict", str(run)])
    assert res.exit_code != 0 and "no .metadata.json" in res.output, res.output
    doc = json.loads(cli("inspect", str(run / "step3" / "model_and_optim"), "--json"))  # named: its data is complete
    assert doc["summary"]["model_tensor_count"] == 21


def test_a_step_holding_only_train_is_named_incomplete(olmo_root: Path, tmp_path: Path) -> None:
    """OLMo-core's async save writes ``stepN/train/rankR.pt`` first, then ``model_and_optim/``, then
    ``.metadata.json``. A newest step holding only ``train/`` was passed over silently by ``--step latest``
    (``validate --strict`` exit 0, no R001) and ``--step 3`` said "no checkpoint of step 3" (E205). Now it is
    named like the other unpublished steps: R001 (``--strict`` fails), ``--step 3`` and ``step3/`` are E202."""
    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    (run / "step3").mkdir()
    shutil.copytree(run / "step2" / "train", run / "step3" / "train")
    doc = json.loads(cli("validate", "--strict", str(run), "--step", "latest", "--json", code=1))
    assert doc["path"] == str(run / "step2" / "model_and_optim")
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert [f["code"] for f in doc["findings"]] == ["R001"]
    assert "step 3 is newer than the checked step 2 but incomplete (train/ but no .metadata.json" in r001["message"]
    doc = json.loads(cli("inspect", str(run), "--step", "latest", "--json"))
    assert doc["location"]["model"] == str(run / "step2" / "model_and_optim")
    assert "step 3 is incomplete: train/ but no .metadata.json" in doc["location"]["how"]
    for argv in (["export", str(run), str(tmp_path / "hf"), "--step", "3"], ["inspect", str(run / "step3")]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and "[E202]" in res.stderr and "train/ but no .metadata.json" in res.stderr, argv
    assert not (tmp_path / "hf").exists()


def test_an_unpublished_or_staged_step_opened_directly_is_not_ok(olmo_root: Path, tmp_path: Path) -> None:
    """A step directory without the .metadata.json OLMo-core writes last was E202 only with `--step N`: opened
    as `stepN/` (or its model_and_optim/) validate --strict said OK and export wrote it. OLMo-core's local save
    goes to `stepN-tmp/`, renamed to `stepN/` after every rank has written: opened directly it was OK too, and
    from the run root it was listed as a checkpoint (E204) or passed over unnamed. Now `stepN/` and `stepN-tmp/`
    are E202, `stepN/model_and_optim/` is read and named by K011, and the run root names step N incomplete."""
    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    shutil.copytree(run / "step2", run / "step3")
    (run / "step3" / ".metadata.json").unlink()
    res = runner.invoke(app, ["validate", "--strict", str(run / "step3")])
    assert res.exit_code == 2 and "no .metadata.json" in res.output, res.output
    res = runner.invoke(app, ["validate", "--strict", str(run / "step3" / "model_and_optim")])
    assert res.exit_code == 1, res.output  # K011 under --strict; its words (folded in a table cell): --json below
    res = runner.invoke(app, ["export", str(run / "step3"), str(tmp_path / "hf")])
    assert res.exit_code == 2 and "[E202]" in res.stderr and "no .metadata.json" in res.stderr
    assert not (tmp_path / "hf").exists()
    doc = json.loads(cli("validate", str(run / "step3" / "model_and_optim"), "--json"))
    (k011,) = doc["findings"]
    assert k011["code"] == "K011" and "no .metadata.json" in k011["message"]
    assert "a save not yet published" in k011["message"]
    shutil.rmtree(run / "step3")
    # a save cut while it wrote into step4-tmp/ (train/ first, then model_and_optim/; .metadata.json never there)
    shutil.copytree(run / "step2", run / "step4-tmp")
    (run / "step4-tmp" / ".metadata.json").unlink()
    for given in ("step4-tmp", "step4-tmp/model_and_optim"):
        for cmd in ("validate", "export"):
            argv = [cmd, str(run / given)] + (["--strict"] if cmd == "validate" else [str(tmp_path / "hf")])
            res = runner.invoke(app, argv)
            assert res.exit_code == 2 and "[E202]" in res.stderr, (given, cmd, res.output)
    assert not (tmp_path / "hf").exists()
    shutil.rmtree(run / "step4-tmp" / "model_and_optim")  # only train/ written yet
    res = runner.invoke(app, ["inspect", str(run / "step4-tmp")])
    assert res.exit_code == 2 and "staging directory of a save not yet renamed to step4" in res.stderr
    doc = json.loads(cli("validate", "--strict", str(run), "--json", code=1))
    assert doc["path"] == str(run / "step2" / "model_and_optim")
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert "step4-tmp" in r001["message"] and [f["code"] for f in doc["findings"]] == ["R001"]
    res = runner.invoke(app, ["validate", str(run), "--step", "4"])
    assert res.exit_code == 2 and "[E202]" in res.stderr and "not renamed to step4" in res.stderr


def test_trainer_state_is_read_and_checked(olmo_root: Path, tmp_path: Path) -> None:
    """train/rankR.pt is read (allow-list unpickler, OLMo-core never imported): inspect shows its counters,
    R002 compares global_step with the optimizer's step, K011 names a file that cannot be read."""
    import shutil

    import torch

    doc = json.loads(cli("inspect", str(olmo_root / "run"), "--json"))
    got = {t["file"]: t for t in doc["trainer_state"]}
    for r in (0, 1):  # the values OLMo-core saved (torch.load of the file is the reference)
        want = torch.load(olmo_root / "run" / "step2" / "train" / f"rank{r}.pt", weights_only=True)
        t = got[f"train/rank{r}.pt"]
        assert t["error"] is None and t["values"] == {"global_step": 2, "global_train_tokens_seen": 64}
        assert t["keys"] == list(want) and want["global_step"] == 2
    res = runner.invoke(app, ["validate", str(olmo_root / "run"), "--strict", "--deep", "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["ok"] and doc["findings"] == [], res.stdout
    assert next(r for r in doc["rules"] if r["code"] == "R002")["status"] == "passed"
    step = tmp_path / "step2"
    shutil.copytree(olmo_root / "run" / "step2", step)
    renamed = shutil.copytree(olmo_root / "run" / "step2", tmp_path / "run" / "step5")  # another step's directory
    res = runner.invoke(app, ["validate", str(renamed), "--deep", "--json"])
    found = [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "R002"]
    assert res.exit_code == 1 and found == ["train/rank0.pt:global_step = 2 but its directory is step5 (step 5)"]
    rank1 = step / "train" / "rank1.pt"
    state = torch.load(rank1, weights_only=True)
    state["global_step"] = 3  # a stale trainer state from another step
    torch.save(state, rank1)
    res = runner.invoke(app, ["validate", str(step), "--deep", "--json"])
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "R002"]
    assert res.exit_code == 1 and found and "train/rank1.pt:global_step = 3" in found[0]["message"]
    rank1.write_bytes(rank1.read_bytes()[:100])  # damaged: not read, named
    res = runner.invoke(app, ["validate", str(step), "--json"])
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K011"]
    assert len(found) == 1 and "train/rank1.pt" in found[0]["message"] and "rank0" not in found[0]["message"]
    assert runner.invoke(app, ["validate", str(step), "--strict"]).exit_code == 1


@pytest.mark.parametrize("link", ["train/rank1.pt", "train"])
def test_trainer_state_symlinked_out_of_the_step_is_not_read(olmo_root: Path, tmp_path: Path, link: str) -> None:
    """train/rank1.pt (or train/ itself) a symlink to a file outside the step directory: it was followed and read
    (its counters shown, R002 passed, validate --strict OK); now not read, named by K011 with E101."""
    import shutil

    step = tmp_path / "step2"
    shutil.copytree(olmo_root / "run" / "step2", step)
    outside = tmp_path / "elsewhere"
    shutil.move(step / link, outside)
    (step / link).symlink_to(outside)
    doc = json.loads(cli("inspect", str(step), "--json"))
    got = {t["file"]: t for t in doc["trainer_state"]}
    assert got["train/rank1.pt"]["values"] == {} and "[E101]" in got["train/rank1.pt"]["error"]
    res = runner.invoke(app, ["validate", str(step), "--strict", "--deep", "--json"])
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "K011"]
    assert res.exit_code == 1 and len(found) == 1, res.stdout
    assert "train/rank1.pt: [E101]" in found[0]["message"] and "resolves outside" in found[0]["message"]


def test_export_and_reference(olmo_root: Path, tmp_path: Path) -> None:
    import torch
    from olmo_core.distributed.checkpoint import load_keys
    from safetensors.torch import load_file

    cli("export", str(olmo_root / "run"), str(tmp_path / "hf"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = torch.load(olmo_root / "expected.pt", weights_only=True)
    assert sorted(got) == sorted(want["model"])
    assert all(got[k].equal(v) for k, v in want["model"].items())
    # OLMo-core's own reader of its checkpoints agrees with the optimizer state ckpttool reads
    some = "blocks.0.attention.w_q.weight"
    (exp_avg,) = load_keys(olmo_root / "run" / "step2" / "model_and_optim", [f"optim.state.{some}.exp_avg"])
    assert exp_avg.equal(want["optim"][f"state.{some}.exp_avg"])


def test_replay_diff_manifest(olmo_root: Path, tmp_path: Path) -> None:
    doc = json.loads(cli("replay-step", str(olmo_root / "run" / "step2"), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21 and all(p["step_before"] == 2 for p in doc["params"])
    doc = json.loads(cli("diff", str(olmo_root / "run"), str(olmo_root / "run" / "step2"), "--what", "all", "--json"))
    assert doc["equal"] and doc["counts"]["compared"] == doc["counts"]["equal"] > 84
    cli("manifest", str(olmo_root / "run"), "-o", str(tmp_path / "m.json"))
    cli("manifest", str(olmo_root / "run"), "--verify", "--output", str(tmp_path / "m.json"))


def test_olmo_storage_info_is_never_imported(olmo_root: Path) -> None:
    """The .metadata pickles OLMo-core's _StorageInfo; the allow-list reads it by field, importing nothing."""
    import subprocess
    import sys

    md = olmo_root / "run" / "step2" / "model_and_optim" / ".metadata"
    assert b"olmo_core.distributed.checkpoint.filesystem" in md.read_bytes()
    code = (
        "import sys; from ckpttool.format.unpickler import load_metadata; "
        f"m = load_metadata({str(md)!r}); "
        "assert not any(k.startswith('olmo_core') for k in sys.modules), 'imported'; print(len(m.entries))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 84


def test_olmo_cores_own_writer_names_the_schema(olmo_root: Path, tmp_path: Path) -> None:
    """``olmo-core`` was claimed by the key prefixes ``model.``/``optim.`` alone, which a plain ``dcp.save`` of any
    loop writes too (tests/model/test_schema.py). Every OLMo-core save goes through its ``RemoteFileSystemWriter``,
    whose ``.metadata`` pickles OLMo-core's ``_StorageInfo``: that is what names the schema now, read alike by the
    column reader, the unpickler and the parsed-metadata cache. The same keys and values saved by torch's
    ``dcp.save`` (the job's own full state, ``expected.pt``) are torch-native."""
    import hashlib

    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.format.mdcache import decode, encode
    from ckpttool.format.mdscan import scan_metadata
    from ckpttool.format.unpickler import _convert, _unpickle

    data = (olmo_root / "run" / "step2" / "model_and_optim" / ".metadata").read_bytes()
    obj, writer = _unpickle(data, ".metadata")
    ref = _convert(obj, ".metadata", writer)
    assert ref.writer == "olmo-core"
    cols = scan_metadata(data, ".metadata")
    assert cols is None or cols == ref  # the native column reader, where built, gives the same (writer included)
    digest = hashlib.sha256(data).hexdigest()
    assert decode(encode(ref, digest, len(data)), digest, len(data)).writer == "olmo-core"
    for given in (olmo_root / "run", olmo_root / "run" / "step2" / "model_and_optim"):
        assert json.loads(cli("inspect", str(given), "--json"))["key_schema"]["id"] == "olmo-core"

    full = torch.load(olmo_root / "expected.pt", weights_only=True)
    dcp.save({"model": full["model"], "optim": full["optim"]}, checkpoint_id=str(tmp_path / "plain"))
    doc = json.loads(cli("inspect", str(tmp_path / "plain"), "--json"))
    ks = doc["key_schema"]
    assert (ks["id"], ks["model_prefix"], ks["optimizer_prefix"]) == ("torch-native", "model.", "optim.")
    assert doc["summary"]["model_tensor_count"] == 21


def test_a_model_only_save_by_olmo_cores_writer_is_olmo_core(olmo_root: Path, tmp_path: Path) -> None:
    """OLMo-core saves model-only checkpoints too (``save_model_and_optim_state`` without an optimizer: its HF
    conversion scripts; a train module without one): they were torch-native, and export's warning advised --rules
    for OLMo-core's names instead of the adapters that map them. Written by OLMo-core's own writer they are
    olmo-core now; the same state saved by torch's dcp.save stays torch-native."""
    import torch
    import torch.distributed.checkpoint as dcp
    from olmo_core.distributed.checkpoint import save_state_dict

    model = torch.load(olmo_root / "expected.pt", weights_only=True)["model"]
    save_state_dict(tmp_path / "olmo", {"model": model})
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    for name, schema in (("olmo", "olmo-core"), ("torch", "torch-native")):
        ks = json.loads(cli("inspect", str(tmp_path / name), "--json"))["key_schema"]
        assert (ks["id"], ks["model_prefix"], ks["optimizer_prefix"]) == (schema, "model.", None)
    res = runner.invoke(app, ["export", str(tmp_path / "olmo"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert "written under OLMo-core's own names" in res.stderr and "olmo-core-llama" in res.stderr, res.stderr


def test_export_of_non_hf_names_says_what_serving_needs(olmo_root: Path, tmp_path: Path) -> None:
    """Without a config the keys do not say which adapter fits (where the norms sit): the export writes OLMo-core
    names as they are. The warning counted 19 "keys outside the HF naming" (lm_head.w_out.weight and
    lm_head.norm.weight, which a default rule passes, are no HF names either) and named both adapters only in a
    parenthesis; now it says plainly that no adapter was applied and every tensor has OLMo-core's name."""
    res = runner.invoke(app, ["export", str(olmo_root / "run"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.stderr
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("warning: "))
    assert line == (
        "warning: no model adapter: 21 model tensor(s) were written under OLMo-core's own names, not HF's "
        "(embeddings.weight, blocks.0.attention.w_q.weight, blocks.0.attention.w_k.weight (+18 more)): transformers "
        "and vLLM do not load them; export again with --model-assets DIR holding the model's HF config.json "
        "(model_type llama picks adapter olmo-core-llama, olmo2 or olmo3 picks olmo-core-olmo2), or --adapter "
        "olmo-core-llama|olmo-core-olmo2"
    ), line
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "lm_head.w_out.weight" in f.keys() and len(list(f.keys())) == 21
    doc = json.loads(cli("export", str(olmo_root / "run"), str(tmp_path / "hf2"), "--json"))
    assert doc["model_adapter"] is None and doc["warnings"][0].startswith("no model adapter: 21 model tensor(s)")


def test_inspect_names_the_adapter_a_config_picks(olmo_root: Path, olmo2_root: Path) -> None:
    """inspect said nothing of an adapter (``model_adapter`` null: the names alone pick none), so nothing told the
    user that export needs a config or ``--adapter``; now it names the adapter that fits and how it is chosen."""
    for root, adapter, model_types in (
        (olmo_root, "olmo-core-llama", ("llama",)),
        (olmo2_root, "olmo-core-olmo2", ("olmo2", "olmo3")),  # OLMo-3's tensors are OLMo-2's
    ):
        doc = json.loads(cli("inspect", str(root / "run"), "--json"))
        assert doc["model_adapter"] is None
        assert doc["adapter_choices"] == [{"adapter": adapter, "model_type": t} for t in model_types]
        text = cli("inspect", str(root / "run"))
        line = next(ln for ln in text.splitlines() if ln.startswith("adapter "))
        picks = " or ".join(f"{adapter} (model_type {t})" for t in model_types)
        assert " ".join(line.split()) == (
            f"adapter none from the names alone: export applies {picks} where the "
            "config.json of --model-assets DIR has that model_type, or named with --adapter; without either it "
            "writes the names as stored, which transformers does not load"
        ), line


def test_manifest_covers_the_trainer_state_of_every_rank(olmo_root: Path, tmp_path: Path) -> None:
    """``train/rankR.pt`` (each rank's step, tokens seen, RNG and data loader, what OLMo-core's load restores)
    lies beside ``model_and_optim/``: the manifest written there did not list it, and a rank file changed,
    deleted or added passed ``manifest --verify`` and ``validate --manifest``. Now each is digested."""
    import torch

    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    cli("manifest", str(run))
    doc = json.loads((run / "step2" / "model_and_optim" / "manifest.json").read_text())
    assert [f["file"] for f in doc["training_state"]] == ["train/rank0.pt", "train/rank1.pt", ".metadata.json"]
    cli("manifest", str(run), "--verify")
    train = run / "step2" / "train"
    state = torch.load(train / "rank1.pt", weights_only=False)
    state["global_train_tokens_seen"] += 1
    torch.save(state, train / "rank1.pt")
    shutil.copy(train / "rank0.pt", train / "rank2.pt")
    out = cli("manifest", str(run), "--verify", code=1)
    assert "changed  train/rank1.pt: differs from the manifest" in out
    assert "extra    train/rank2.pt: a file the manifest does not list (added)" in out
    (train / "rank0.pt").unlink()
    doc = json.loads(cli("validate", str(run), "--manifest", "--json", code=1))
    s015 = sorted((f["key"], f["message"].split(":")[0]) for f in doc["findings"] if f["code"] == "S015")
    assert s015 == [("train/rank0.pt", "missing"), ("train/rank1.pt", "changed"), ("train/rank2.pt", "extra")]


def test_manifest_without_training_state_says_what_it_left_unchecked(olmo_root: Path, tmp_path: Path) -> None:
    """A manifest whose ``training_state`` list is gone (an older ckpttool's, or edited) verified OLMo-core's
    ``train/rankR.pt`` files as nothing at all, exit 0 without a word: it now warns, naming them."""
    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    cli("manifest", str(run))
    path = run / "step2" / "model_and_optim" / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["training_state"]
    path.write_text(json.dumps(doc))
    res = runner.invoke(app, ["manifest", str(run), "--verify", "--json"])
    assert res.exit_code == 0, res.stderr
    warnings = json.loads(res.stdout)["warnings"]
    assert len(warnings) == 1 and "lists no training_state (the trainer's files beside the checkpoint)" in warnings[0]
    assert "3 files there not checked (train/rank0.pt, train/rank1.pt, .metadata.json)" in warnings[0], warnings
    doc = json.loads(cli("validate", str(run), "--manifest", "--json"))  # S016: a warning, as for sidecars
    s016 = [f["message"] for f in doc["findings"] if f["code"] == "S016"]
    assert s016 == [
        f"{path}: lists no training_state; 3 there not checked: train/rank0.pt, train/rank1.pt, .metadata.json"
    ]


def test_manifest_covers_olmo_cores_metadata_json(olmo_root: Path, tmp_path: Path) -> None:
    """``stepN/.metadata.json`` (OLMo-core's ``CheckpointMetadata``: its version, and ``ephemeral``, which makes
    its checkpointer remove the step once a later one is saved) lies beside ``model_and_optim/``: no manifest
    listed it, and a changed one passed ``manifest --verify``. Now it is digested with the trainer state."""
    run = shutil.copytree(olmo_root / "run", tmp_path / "run")
    meta = run / "step2" / ".metadata.json"
    assert json.loads(meta.read_text())["ephemeral"] is False  # as OLMo-core wrote it
    cli("manifest", str(run))
    doc = json.loads((run / "step2" / "model_and_optim" / "manifest.json").read_text())
    listed = {f["file"]: f for f in doc["training_state"]}
    assert listed[".metadata.json"]["size"] == meta.stat().st_size
    cli("manifest", str(run), "--verify")
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "ephemeral": True}))
    out = cli("manifest", str(run), "--verify", code=1)
    assert "changed  .metadata.json: differs from the manifest" in out
    doc = json.loads(cli("validate", str(run), "--manifest", "--json", code=1))
    assert [(f["key"], f["message"].split(":")[0]) for f in doc["findings"] if f["code"] == "S015"] == [
        (".metadata.json", "changed")
    ]


def _olmo_core_model(config: object, state: dict) -> object:
    """OLMo-core's own model of ``config`` (a ``TransformerConfig``) holding ``state``, for its forward."""
    model = config.build(init_device="cpu")  # type: ignore[attr-defined]
    model.load_state_dict(state)
    return model.eval()


def _check_against_olmo_core(
    out: Path, hf_config: object, olmo_config: object, state: dict, model_class: type, *, atol: float
) -> None:
    """The export in ``out`` holds what OLMo-core's own ``convert_state_to_hf`` makes of ``state`` (names and
    bytes), and ``model_class`` loaded from it gives OLMo-core's logits (fp32, within ``atol``)."""
    import torch
    from olmo_core.nn.hf.convert import convert_state_to_hf
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    want = convert_state_to_hf(hf_config, state)  # type: ignore[arg-type]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].equal(v), k
    hf = model_class.from_pretrained(out, torch_dtype=torch.float32).eval()  # type: ignore[attr-defined]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _olmo_core_model(olmo_config, state)(ids).float()  # type: ignore[operator]
        logits = hf(ids).logits.float()
    assert ref.shape == logits.shape == (2, 16, 128)
    assert (logits - ref).abs().max().item() <= atol, (logits - ref).abs().max().item()


def _export_and_check(
    root: Path, tmp_path: Path, hf_config: Any, olmo_config: object, model_class: type, adapter: str
) -> None:
    """``export root/run tmp_path/hf --model-assets`` (``hf_config`` saved there) picks ``adapter`` without a warning,
    and the export is what OLMo-core's converter makes of the saved state, logits included
    (:func:`_check_against_olmo_core`)."""
    import torch

    assets = tmp_path / "assets"
    hf_config.save_pretrained(assets)
    state = torch.load(root / "expected.pt", weights_only=True)["model"]
    res = runner.invoke(app, ["export", str(root / "run"), str(tmp_path / "hf"), "--model-assets", str(assets)])
    assert res.exit_code == 0, res.stderr
    assert "warning" not in res.stderr and adapter in res.stdout
    _check_against_olmo_core(tmp_path / "hf", hf_config, olmo_config, state, model_class, atol=1e-5)


def test_export_as_llama_matches_olmo_core_converter_and_logits(olmo_root: Path, tmp_path: Path) -> None:
    """The export of a llama_like OLMo-core model wrote its OLMo-core names (blocks.0.attention.w_q.weight, ...)
    with a warning, which transformers cannot load. Given the model's Llama config.json (`--model-assets`) the
    olmo-core-llama adapter is detected (or named with --adapter): the tensors are those of OLMo-core's own
    convert_state_to_hf for model_type llama, bit for bit, and LlamaForCausalLM gives OLMo-core's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.olmo_core_writer import model_config

    olmo_config = model_config("llama")
    block = olmo_config.build(init_device="cpu").blocks["0"]  # type: ignore[attr-defined]
    hf_config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=block.feed_forward.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=block.attention.n_heads,
        num_key_value_heads=block.attention.n_kv_heads,
        rope_theta=block.attention.rope.theta,
        rms_norm_eps=block.feed_forward_norm.eps,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    _export_and_check(olmo_root, tmp_path, hf_config, olmo_config, LlamaForCausalLM, "olmo-core-llama")
    cli("export", str(olmo_root / "run"), str(tmp_path / "named"), "--adapter", "olmo-core-llama")
    from safetensors.torch import load_file

    assert (
        load_file(tmp_path / "named" / "model.safetensors").keys()
        == load_file(tmp_path / "hf" / "model.safetensors").keys()
    )


@pytest.fixture(scope="module")
def olmo2_root(fixture_root: Path) -> Path:
    return _olmo_run(fixture_root, "writers_olmo_core_olmo2", "build_olmo_core_olmo2")


def test_export_as_olmo2_matches_olmo_core_converter_and_logits(olmo2_root: Path, tmp_path: Path) -> None:
    """An OLMo-2 model (reordered_norm block: post-norms, q/k norm) saved by OLMo-core's Checkpointer was exported
    under its OLMo-core names. With the config.json OLMo-core's own get_hf_config writes for it (Olmo2Config), the
    olmo-core-olmo2 adapter is detected: attention_norm -> post_attention_layernorm, feed_forward_norm ->
    post_feedforward_layernorm, q/k norms kept; the tensors are OLMo-core's convert_state_to_hf's bit for bit and
    Olmo2ForCausalLM gives OLMo-core's logits. The Llama adapter, named on it, refuses its q_norm (E601)."""
    from olmo_core.nn.hf.config import get_hf_config
    from transformers import Olmo2ForCausalLM

    from tests.fixtures.olmo_core_writer import model_config

    olmo_config = model_config("olmo2")
    hf_config = get_hf_config(olmo_config.build(init_device="cpu"))  # type: ignore[attr-defined]
    assert hf_config.model_type == "olmo2"
    hf_config.max_position_embeddings = 64  # get_hf_config's -1: unbounded
    _export_and_check(olmo2_root, tmp_path, hf_config, olmo_config, Olmo2ForCausalLM, "olmo-core-olmo2")
    # the keys alone do not say where the norms sit: no config, raw names and the warning (as before)
    res = runner.invoke(app, ["export", str(olmo2_root / "run"), str(tmp_path / "raw")])
    assert res.exit_code == 0 and "no model adapter: 25 model tensor(s) were written under OLMo-core's" in res.stderr
    res = runner.invoke(app, ["export", str(olmo2_root / "run"), str(tmp_path / "l"), "--adapter", "olmo-core-llama"])
    assert res.exit_code == 2, res.output
    err = res.stderr.splitlines()[0]
    assert err.startswith("error: [E601] blocks.0.attention.q_norm.weight: OLMo-core tensor with no place in HF ")
    assert not (tmp_path / "l").exists()


def test_export_as_olmo3_matches_olmo_core_converter_and_logits(fixture_root: Path, tmp_path: Path) -> None:
    """An OLMo-3 model (OLMo-2's block with sliding-window attention) saved by OLMo-core's Checkpointer, exported
    with the config.json OLMo-core's own get_hf_config writes for it (Olmo3Config: model_type olmo3), was refused
    (E605: the OLMo-core names did not fit Olmo3ForCausalLM, no adapter picked). OLMo-3's tensors are OLMo-2's (the
    windows are config only; OLMo-core converts both with one map): the olmo-core-olmo2 adapter is detected, the
    tensors are OLMo-core's convert_state_to_hf's bit for bit and Olmo3ForCausalLM gives OLMo-core's logits over a
    sequence longer than the window; inspect names model_type olmo3 among the configs that pick the adapter."""
    from olmo_core.nn.hf.config import get_hf_config
    from transformers import Olmo3ForCausalLM

    from tests.fixtures.olmo_core_writer import model_config

    root = _olmo_run(fixture_root, "writers_olmo_core_olmo3", "build_olmo_core_olmo3")
    olmo_config = model_config("olmo3")
    hf_config = get_hf_config(olmo_config.build(init_device="cpu"))  # type: ignore[attr-defined]
    assert hf_config.model_type == "olmo3" and hf_config.sliding_window == 8
    hf_config.max_position_embeddings = 64  # get_hf_config's -1: unbounded
    _export_and_check(root, tmp_path, hf_config, olmo_config, Olmo3ForCausalLM, "olmo-core-olmo2")
    doc = json.loads(cli("inspect", str(root / "run"), "--json"))
    assert {"adapter": "olmo-core-olmo2", "model_type": "olmo3"} in doc["adapter_choices"]


def test_olmo2_adapter_named_on_a_llama_like_model_is_refused(olmo_root: Path, tmp_path: Path) -> None:
    """`--adapter olmo-core-olmo2` on a llama_like model (no q/k norm) renamed every tensor into Olmo2's names
    (its pre-norms as post-norms), exit 0: Olmo2ForCausalLM loads it with q/k norms of ones and other logits.
    It is refused (E601) naming the missing q/k norm, nothing written."""
    res = runner.invoke(app, ["export", str(olmo_root / "run"), str(tmp_path / "o"), "--adapter", "olmo-core-olmo2"])
    assert res.exit_code == 2, res.output
    err = res.stderr.splitlines()[0]
    assert err.startswith("error: [E601] ") and ": adapter olmo-core-olmo2 does not fit: no OLMo-core q/k norm" in err
    assert not (tmp_path / "o").exists()


def test_olmo_core_adapter_named_on_other_names_is_refused(tmp_path: Path) -> None:
    """`--adapter olmo-core-llama` on a checkpoint of other names (HF's) said 'model.embed_tokens.weight: OLMo-core
    tensor with no place in HF LlamaForCausalLM ... this OLMo-core model is another variant'; it says the tensors
    are not an OLMo-core Transformer's (E601), nothing written."""
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2)}, hf / "model.safetensors"
    )
    for adapter in ("olmo-core-llama", "olmo-core-olmo2"):
        res = runner.invoke(app, ["export", str(hf), str(tmp_path / "o"), "--adapter", adapter])
        assert res.exit_code == 2, res.output
        err = res.stderr.splitlines()[0]
        assert err == (
            f"error: [E601] {hf}: adapter {adapter} does not fit: the model tensors are not an OLMo-core "
            "Transformer's (no blocks.N.attention.w_q.weight and lm_head.w_out.weight)"
        ), err
        assert not (tmp_path / "o").exists()


@pytest.mark.heavy  # a third 2-rank gloo job of OLMo-core's checkpointer on first use (cached after)
def test_optimizer_saved_nested_reads_as_the_flattened_default(fixture_root: Path, tmp_path: Path) -> None:
    """``state_dict_save_opts`` with ``flatten_optimizer_state_dict=False`` saves the optimizer nested
    (``param_groups`` a list): the same schema, weights and moments as OLMo-core's own storage reader gives
    (its ``load_keys`` finds no nested keys)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from olmo_core.distributed.checkpoint.filesystem import RemoteFileSystemReader
    from safetensors.torch import load_file

    root = _olmo_run(fixture_root, "writers_olmo_core_nested", "build_olmo_core_nested")
    doc = json.loads(cli("inspect", str(root / "run"), "--json"))
    assert doc["key_schema"]["id"] == "olmo-core" and doc["key_schema"]["optimizer_keying"] == "fqn"
    assert doc["summary"]["model_tensor_count"] == 21 and doc["optimizer"]["flavor"] == "nested"
    doc = json.loads(cli("validate", str(root / "run"), "--strict", "--deep", "--json"))
    assert doc["ok"] and doc["counts"]["error"] == doc["counts"]["warning"] == 0
    cli("export", str(root / "run"), str(tmp_path / "hf"))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = torch.load(root / "expected.pt", weights_only=True)
    assert sorted(got) == sorted(want["model"]) and all(got[k].equal(v) for k, v in want["model"].items())
    some = "blocks.1.feed_forward.w2.weight"
    ref = want["optim"][f"state.{some}.exp_avg"]
    nested = {"optim": {"state": {some: {"exp_avg": torch.zeros_like(ref)}}}}
    dcp.load(nested, storage_reader=RemoteFileSystemReader(str(root / "run" / "step2" / "model_and_optim")))
    assert nested["optim"]["state"][some]["exp_avg"].equal(ref) and ref.abs().sum() > 0
    doc = json.loads(cli("replay-step", str(root / "run" / "step2"), "--device", "cpu", "--json"))
    assert doc["ok"] and len(doc["params"]) == 21 and all(p["step_before"] == 2 for p in doc["params"])
