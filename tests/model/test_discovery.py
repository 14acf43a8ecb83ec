"""Finding the checkpoint below a directory: torchtitan step roots, Accelerate pairs, ``latest`` files.

The directory trees are the real writers' (torchtitan's ``CheckpointManager`` writes
``checkpoint/step-N``; Accelerate writes ``checkpoint-N/pytorch_model_fsdp_0`` + ``optimizer_0``);
DeepSpeed-style names and ``latest`` files are laid out by copying a real checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import (
    AmbiguousCheckpointError,
    CkptError,
    MetadataError,
    PathEscapeError,
    SchemaError,
    StepNotFoundError,
    UsageError,
    shell_arg,
)
from ckpttool.model.checkpoint import open_checkpoint
from ckpttool.model.discovery import CheckpointSelection, compose_pair, locate, step_of
from tests.fixtures import damage
from tests.fixtures.special_files import run_bound_by_permissions

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers


@pytest.mark.parametrize(
    "name,step",
    [("step-100", 100), ("checkpoint-7", 7), ("global_step42", 42), ("global_step_42", 42), ("iter_0000300", 300)],
)
def test_step_names(name: str, step: int) -> None:
    assert step_of(name) == step
    assert step_of("model") is None and step_of("steps") is None


def test_torchtitan_root_lists_the_steps_and_the_command(titan_root: Path) -> None:
    root = titan_root / "llama3" / "checkpoint"
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(root)
    e = ei.value
    assert e.code == "E204" and "step-1; step-2; step-3" in e.message
    assert "`step` latest or `step` N (steps 1, 2, 3)" in e.hint and str(root / "step-3") in e.hint


def test_step_and_latest_pick_a_step_dir(titan_root: Path) -> None:
    root = titan_root / "llama3" / "checkpoint"
    assert locate(root, CheckpointSelection.from_options("2")).model == root / "step-2"
    loc = locate(root, CheckpointSelection.from_options("latest"))
    assert loc.model == root / "step-3" and loc.step == 3 and "highest step" in loc.how
    # the run's folder above checkpoint/ works too (depth 2)
    assert locate(titan_root / "llama3", CheckpointSelection(step=1)).model == root / "step-1"


def test_unknown_step_lists_the_steps(titan_root: Path) -> None:
    with pytest.raises(StepNotFoundError) as ei:
        locate(titan_root / "llama3" / "checkpoint", CheckpointSelection(step=9))
    assert ei.value.code == "E205" and "steps found: 1, 2, 3" in ei.value.message


def test_step_on_a_checkpoint_itself_is_a_usage_error(titan_root: Path) -> None:
    with pytest.raises(UsageError, match="is a checkpoint itself"):
        locate(titan_root / "llama3" / "checkpoint" / "step-1", CheckpointSelection(step=1))


def test_latest_file_wins(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3" / "checkpoint"
    for s in (1, 2):
        shutil.copytree(src / f"step-{s}", tmp_path / f"global_step{s}")
    (tmp_path / "latest").write_text("global_step1\n")
    loc = locate(tmp_path, CheckpointSelection(step="latest"))
    # the file names an older step than the newest complete one (a save whose pointer was never updated): the
    # trainer's resume loads the one named, and so does `step` latest, saying that a newer step is there (it was not)
    assert loc.model == tmp_path / "global_step1" and loc.how == (
        "`step` latest: step 1 (named by latest; step 2 below it is newer and complete, but latest names this one "
        "(a resume that follows latest loads it))"
    )
    # the file read is named as the trainer wrote it (was "the `latest` file" whatever its name)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    loc = locate(tmp_path, CheckpointSelection(step="latest"))
    assert loc.how == "`step` latest: step 2 (named by latest_checkpointed_iteration.txt)"
    # a tracker that names no step: Megatron's resume stops on it ("Invalid metadata file"), so does this
    # (it was passed over: the highest step chosen, "the highest step"); Megatron's "release" names <root>/release
    # a superscript is a digit to str.isdigit, not to int(): it was E999 'internal error: ValueError'
    for text, said in (("abc", "'abc'"), ("", "''"), ("9" * 100_000, "'100000 bytes'"), ("\u00b2", "'\u00b2'")):
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
        with pytest.raises(StepNotFoundError) as ei:
            locate(tmp_path, CheckpointSelection(step="latest"))
        assert ei.value.code == "E205" and f"holds {said}, which names no step" in ei.value.message
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("\uff12\n")  # fullwidth 2: Megatron's int() reads 2
    assert locate(tmp_path, CheckpointSelection(step="latest")).model == tmp_path / "global_step2"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(StepNotFoundError) as ei:  # no release/ checkpoint: Megatron's resume finds nothing there
        locate(tmp_path, CheckpointSelection(step="latest"))
    assert ei.value.code == "E205" and "names the release checkpoint" in ei.value.message


def test_latest_file_naming_a_missing_step_says_so(titan_root: Path, tmp_path: Path) -> None:
    """DeepSpeed's ``latest`` naming ``global_step30`` that is not there (a save cut before its directory, a copy
    without it): the error named the run directory and hinted ``step`` latest, the option just given."""
    src = titan_root / "llama3" / "checkpoint"
    for s in (1, 2):
        shutil.copytree(src / f"step-{s}", tmp_path / f"global_step{s}")
    (tmp_path / "latest").write_text("global_step30\n")
    with pytest.raises(StepNotFoundError) as ei:
        locate(tmp_path, CheckpointSelection(step="latest"))
    e = ei.value
    assert e.code == "E205" and e.path == str(tmp_path / "latest")
    assert e.message == f"{tmp_path / 'latest'}: names step 30, but no checkpoint of step 30 is below {tmp_path}; " + (
        "steps found: 1, 2"
    )
    assert e.hint is not None and "write an existing step into latest" in e.hint and "or pass `step` N" in e.hint


def test_single_checkpoint_below_is_used(titan_root: Path) -> None:
    loc = locate(titan_root / "moe")
    assert loc.model == titan_root / "moe" / "checkpoint" / "step-1" and loc.step == 1
    assert loc.how == "the only checkpoint below the directory given"


def test_accelerate_pair_opens_as_one_checkpoint(acc_root: Path) -> None:
    parent = acc_root / "accelerate" / "checkpoint-1"
    with open_checkpoint(parent) as ck:
        assert ck.located.model.name == "pytorch_model_fsdp_0" and ck.located.optimizer.name == "optimizer_0"
        cat = ck.catalog
        assert cat.schema.id == "torch-native" and len(cat.model) == 21 and len(cat.optimizer_state) == 21
        assert all(ps.in_model for ps in cat.optimizer_state.values())
        files = {f.relative_path for f in cat.data_files}
        assert files == {f"{p}/__{r}_0.distcp" for p in ("pytorch_model_fsdp_0", "optimizer_0") for r in (0, 1)}
        # bitwise: one optimizer tensor through the composed reader vs torch reading its own folder
        import torch.distributed.checkpoint as dcp

        key = "optimizer.state.model.embed_tokens.weight.exp_avg"
        want = {key: torch.empty(cat.optimizer_state["model.embed_tokens.weight"].fields["exp_avg"].shape)}
        dcp.load(want, checkpoint_id=str(parent / "optimizer_0"), no_dist=True)
        assert torch.equal(ck.reader.read_tensor(key), want[key])


def test_accelerate_root_with_two_steps_is_ambiguous(acc_root: Path) -> None:
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(acc_root / "accelerate")
    assert "checkpoint-0/pytorch_model_fsdp_0 + checkpoint-0/optimizer_0" in ei.value.message
    assert locate(acc_root / "accelerate", CheckpointSelection(step=0)).optimizer.name == "optimizer_0"


def test_optimizer_dir_given_separately(acc_root: Path) -> None:
    c1 = acc_root / "accelerate" / "checkpoint-1"
    sel = CheckpointSelection(optimizer_dir=c1 / "optimizer_0")
    with open_checkpoint(c1 / "pytorch_model_fsdp_0", selection=sel) as ck:
        assert len(ck.catalog.optimizer_state) == 21 and ck.path == c1
    with pytest.raises(UsageError, match="pairs pytorch_model_fsdp_0 with optimizer_0 already"):
        locate(c1, sel)
    with pytest.raises(UsageError, match="not a DCP checkpoint directory"):
        locate(c1 / "pytorch_model_fsdp_0", CheckpointSelection(optimizer_dir=acc_root))


def test_pair_with_shared_keys_is_refused(acc_root: Path) -> None:
    c1 = acc_root / "accelerate" / "checkpoint-1"
    from ckpttool.format import CheckpointReader

    with CheckpointReader(c1 / "pytorch_model_fsdp_0") as m, pytest.raises(SchemaError, match="both hold"):
        compose_pair(c1 / "pytorch_model_fsdp_0", m.metadata, acc_root / "app_state", m.metadata)


def test_a_part_cannot_reach_into_the_other_part(acc_root: Path, tmp_path: Path) -> None:
    pair = tmp_path / "checkpoint-1"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", pair)
    key = "optimizer.state.model.embed_tokens.weight.exp_avg"
    # The optimizer part names a file of the model part: inside the common parent, outside its own folder.
    damage.edit_storage(pair / "optimizer_0", key, relative_path="../pytorch_model_fsdp_0/__0_0.distcp")
    with open_checkpoint(pair) as ck:
        entry = ck.catalog.optimizer_state["model.embed_tokens.weight"].fields["exp_avg"]
        with pytest.raises(PathEscapeError):
            ck.reader.read_chunk(key, entry.chunks[0])


def test_symlinked_dirs_are_not_followed(titan_root: Path, tmp_path: Path) -> None:
    """A link not named as a step directory is not walked; one named as a step directory is (a trainer's resume
    lists it as any step: :func:`test_latest_follows_a_step_directory_symlinked_elsewhere`)."""
    os.symlink(titan_root / "moe" / "checkpoint" / "step-1", tmp_path / "best")
    with pytest.raises(MetadataError) as ei:
        locate(tmp_path)
    assert ei.value.code == "E200" and "no DCP checkpoint in the 3 directory levels below" in ei.value.message
    os.symlink(titan_root / "moe" / "checkpoint" / "step-1", tmp_path / "step-1")
    assert locate(tmp_path).model == tmp_path / "step-1"


def test_incomplete_save_is_still_e202(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    from ckpttool.errors import IncompleteCheckpointError

    with pytest.raises(IncompleteCheckpointError):
        open_checkpoint(tmp_path)


def test_step_folder_with_model_and_optimizer_folders(acc_root: Path, tmp_path: Path) -> None:
    src = acc_root / "accelerate" / "checkpoint-1"
    for step in (5, 6):
        shutil.copytree(src / "pytorch_model_fsdp_0", tmp_path / f"step-{step}" / "model")
        shutil.copytree(src / "optimizer_0", tmp_path / f"step-{step}" / "optimizer")
    loc = locate(tmp_path, CheckpointSelection(step="latest"))
    assert (loc.model, loc.optimizer, loc.step) == (tmp_path / "step-6" / "model", tmp_path / "step-6" / "optimizer", 6)
    with open_checkpoint(tmp_path / "step-5") as ck:
        assert ck.located.optimizer == tmp_path / "step-5" / "optimizer" and len(ck.catalog.optimizer_state) == 21


def test_latest_over_two_trainers_or_runs_is_ambiguous(titan_root: Path, acc_root: Path, tmp_path: Path) -> None:
    """A folder holding torchtitan's ``step-N`` and Accelerate's ``checkpoint-N`` (or two runs' ``checkpoint/``
    folders): `step` latest compared their numbers and opened the highest, another trainer's or run's save than
    the one the user meant, named "the highest step". Their numbers do not count the same training: E204 lists
    each series' newest step. A ``latest`` file the trainer wrote is still followed; `step` N still picks its step."""
    mix = tmp_path / "mix"
    for s in (1, 2, 3):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / f"step-{s}", mix / f"step-{s}")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", mix / "checkpoint-5")
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(mix, CheckpointSelection(step="latest"))
    e = ei.value
    assert e.code == "E204" and "of 2 series" in e.message, e.message
    assert "checkpoint-N (newest checkpoint-5); step-N (newest step-3)" in e.message
    assert e.hint is not None and "`step` N" in e.hint
    assert e.steps == ()  # no one run's steps (stats' hint would follow them in order)
    assert locate(mix, CheckpointSelection(step=2)).model == mix / "step-2"
    (mix / "latest").write_text("3\n")  # the trainer's own pointer: followed, as its resume does
    assert locate(mix, CheckpointSelection(step="latest")).model == mix / "step-3"
    # two runs of one trainer below one folder: the newest step of one is not the other's
    with pytest.raises(AmbiguousCheckpointError, match="of 4 series"):
        locate(titan_root, CheckpointSelection(step="latest"))
    assert locate(titan_root / "llama3", CheckpointSelection(step="latest")).model == (
        titan_root / "llama3" / "checkpoint" / "step-3"
    )


def test_optimizer_dir_of_another_step_is_refused(acc_root: Path, tmp_path: Path) -> None:
    """The model folder of ``checkpoint-1`` with ``--optimizer-dir checkpoint-0/optimizer_0`` opened as one
    checkpoint: step 0's moments and step counters beside step 1's weights, which no save wrote and no resume
    loads, and validate passed it (OK). Refused now, the hint naming the optimizer folder saved with the model."""
    run = tmp_path / "run"
    for s in (0, 1):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s}", run / f"checkpoint-{s}")
    model = run / "checkpoint-1" / "pytorch_model_fsdp_0"
    with pytest.raises(UsageError) as ei:
        locate(model, CheckpointSelection(optimizer_dir=run / "checkpoint-0" / "optimizer_0"))
    e = ei.value
    assert e.code == "E100" and "of step 0 (checkpoint-0)" in e.message and "of step 1 (checkpoint-1)" in e.message
    assert (
        e.hint == f"pass the optimizer folder saved with the model, {shell_arg(run / 'checkpoint-1' / 'optimizer_0')}"
    )
    res = CliRunner().invoke(
        app, ["validate", str(model), "--optimizer-dir", str(run / "checkpoint-0" / "optimizer_0")]
    )
    assert res.exit_code == 2 and "[E100]" in res.stderr and "another's weights" in res.stderr, res.output
    # the same step's folder (and a folder in no step directory) pairs as before
    loc = locate(model, CheckpointSelection(optimizer_dir=run / "checkpoint-1" / "optimizer_0"))
    assert loc.optimizer == run / "checkpoint-1" / "optimizer_0"
    shutil.copytree(run / "checkpoint-0" / "optimizer_0", tmp_path / "opt")
    assert locate(model, CheckpointSelection(optimizer_dir=tmp_path / "opt")).optimizer == tmp_path / "opt"


def test_latest_link_to_a_folder_of_no_step_is_e205(titan_root: Path, tmp_path: Path) -> None:
    """``run/latest -> final/`` (a link naming no step directory): `step` latest passed over it without a word and
    opened the highest step, "the highest step", while the ``latest`` file naming no step is E205. Now E205 too,
    the hint naming the linked directory; a link to a step directory is followed, as before."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / f"step-{s}", run / f"step-{s}")
    (run / "final").mkdir()
    (run / "latest").symlink_to("final")
    with pytest.raises(StepNotFoundError) as ei:
        locate(run, CheckpointSelection(step="latest"))
    e = ei.value
    assert e.code == "E205" and e.path == str(run / "latest") and "links to 'final', which names no step" in e.message
    assert e.hint is not None and "pass the directory latest links to itself" in e.hint
    (run / "latest").unlink()
    (run / "latest").symlink_to("step-1")
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.model == run / "step-1" and "named by latest; step 2 below it is newer and complete" in loc.how


def test_a_link_to_a_step_given_itself_names_the_step(titan_root: Path, tmp_path: Path) -> None:
    """``inspect run/latest`` (a link to ``step-2``) showed ``checkpoint run/latest`` and nothing of which step it
    opened; how it was chosen names the linked step now (inspect's ``opened`` line, ``location.how``)."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / f"step-{s}", run / f"step-{s}")
    (run / "latest").symlink_to("step-2")
    assert locate(run / "latest").how == "the directory given, a link to step-2 (step 2)"
    assert locate(run / "step-2").how == "the directory given"
    res = CliRunner().invoke(app, ["inspect", str(run / "latest")])
    assert res.exit_code == 0 and f"opened      {run / 'latest'} (the directory given, a link to step-2" in res.stdout


def test_run_root_without_step_lists_a_newer_unfinished_step(titan_root: Path, tmp_path: Path) -> None:
    """E204 of a run root listed its complete steps only (``steps 1, 2``) while step 3's save had not finished: a
    user reading it could not tell that the newest step is there and broken. It is listed, marked incomplete."""
    run = tmp_path / "run"
    for s in (1, 2, 3):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / f"step-{s}", run / f"step-{s}")
    (run / "step-3" / ".metadata").unlink()  # the data files of a save whose coordinator never wrote .metadata
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(run)
    e = ei.value
    assert e.hint is not None and "(steps 1, 2, 3 (incomplete))" in e.hint and str(run / "step-2") in e.hint, e.hint
    assert e.steps == ((1, str(run / "step-1")), (2, str(run / "step-2")))


def test_optimizer_dir_of_another_step_names_an_odd_folder_ready_to_paste(acc_root: Path, tmp_path: Path) -> None:
    """A run folder whose name holds a newline and a run of spaces: the message folded the given folder's name
    (``my run`` for ``my\\n  run``) and the hint named the model's own optimizer folder unquoted, folded too: another
    folder, several shell arguments. The message names it as given (escaped), the hint as one argument bash reads
    back as that folder."""

    run = tmp_path / "my\n  run"
    for s in (0, 1):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s}", run / f"checkpoint-{s}")
    model = run / "checkpoint-1" / "pytorch_model_fsdp_0"
    res = CliRunner().invoke(
        app, ["validate", str(model), "--optimizer-dir", str(run / "checkpoint-0" / "optimizer_0")]
    )
    assert res.exit_code == 2, res.output
    error, hint = res.stderr.splitlines()
    assert f"--optimizer-dir {tmp_path}/my\\x0a  run/checkpoint-0/optimizer_0 is of step 0" in error, error
    token = hint.rpartition("saved with the model, ")[2]
    pasted = subprocess.run(["bash", "-c", f"printf %s {token}"], capture_output=True, text=True, check=True).stdout
    assert pasted == str(run / "checkpoint-1" / "optimizer_0"), hint


def test_latest_follows_a_step_directory_symlinked_elsewhere(acc_root: Path, tmp_path: Path) -> None:
    """HF Trainer's output_dir whose newest ``checkpoint-2`` is a link to another disk (moved off a full one):
    ``get_last_checkpoint`` lists it as any step (``os.path.isdir`` follows links) and resumes it; `step` latest
    passed over the link and opened ``checkpoint-1`` as "the highest step". A link not named as a step
    (``best -> checkpoint-1``) is still not walked: it is no second checkpoint."""
    from transformers.trainer_utils import get_last_checkpoint

    run, other = tmp_path / "run", tmp_path / "scratch"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-0", run / "checkpoint-1")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", other / "checkpoint-2")
    (run / "checkpoint-2").symlink_to(other / "checkpoint-2", target_is_directory=True)
    (run / "best").symlink_to("checkpoint-1", target_is_directory=True)
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-2")
    loc = locate(run, CheckpointSelection(step="latest"))
    assert (loc.model, loc.optimizer, loc.step) == (
        run / "checkpoint-2" / "pytorch_model_fsdp_0",
        run / "checkpoint-2" / "optimizer_0",
        2,
    )
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(run)
    assert ei.value.steps == (
        (1, str(run / "checkpoint-1")),
        (2, str(run / "checkpoint-2")),
    ), ei.value.message
    with open_checkpoint(run, selection=CheckpointSelection(step="latest")) as ck:
        assert ck.located.step == 2 and len(ck.catalog.optimizer_state) > 0


def test_a_step_link_to_the_run_itself_is_no_series_of_its_own(acc_root: Path, tmp_path: Path) -> None:
    """``run/checkpoint-1 -> .`` (a link looping back to the folder holding it): the walk followed it and found
    the run again below it, then refused `step` latest as E204 "2 series: checkpoint-N; checkpoint-1/checkpoint-N"
    and the run root listed ``checkpoint-1/checkpoint-2`` as a second checkpoint. HF's ``get_last_checkpoint``
    resumes ``checkpoint-2``; a link to the folder holding it, or one above, is not walked."""
    from transformers.trainer_utils import get_last_checkpoint

    run = tmp_path / "run"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / "checkpoint-2")
    (run / "checkpoint-1").symlink_to(".", target_is_directory=True)
    (run / "checkpoint-2" / "checkpoint-3").symlink_to("..", target_is_directory=True)
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-2")
    loc = locate(run, CheckpointSelection(step="latest"))
    assert (loc.model, loc.step) == (run / "checkpoint-2" / "pytorch_model_fsdp_0", 2)
    assert locate(run).model == run / "checkpoint-2" / "pytorch_model_fsdp_0"
    res = CliRunner().invoke(app, ["validate", str(run), "--step", "latest"])
    assert res.exit_code == 0, res.output


def test_more_step_directories_than_the_walk_visits_is_no_silent_older_step(acc_root: Path, tmp_path: Path) -> None:
    """A run folder of 10,001 step directories (``checkpoint-10000`` .. ``checkpoint-20000``, a save every step kept):
    the walk stopped at 10,000 directories, sorted by name, and `step` latest opened ``checkpoint-19999`` as "the
    highest step" where HF's ``get_last_checkpoint`` resumes ``checkpoint-20000``. A walk cut short picks nothing: E204
    naming the limit, the hint the step directory to pass."""
    from transformers.trainer_utils import get_last_checkpoint

    run, model = tmp_path / "run", acc_root / "accelerate" / "checkpoint-1" / "pytorch_model_fsdp_0"
    metadata = (model / ".metadata").read_bytes()
    for s in range(10_000, 20_000):  # each a model folder saved flat in its step directory (its .metadata: fast)
        (run / f"checkpoint-{s}").mkdir(parents=True)
        (run / f"checkpoint-{s}" / ".metadata").write_bytes(metadata)
    shutil.copytree(model, run / "checkpoint-20000")
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-20000")
    with pytest.raises(AmbiguousCheckpointError, match="more than 10,000 directories") as ei:
        locate(run, CheckpointSelection(step="latest"))
    assert "DIR/checkpoint-N" in ei.value.hint
    assert locate(run / "checkpoint-20000").model == run / "checkpoint-20000"


def test_optimizer_dir_under_a_step_named_folder_of_both(acc_root: Path, tmp_path: Path) -> None:
    """A run kept below a folder named like a step (``/data/ckpt_1/run/``): the model opened through the run's
    ``latest`` link, or exported beside the run, has no step directory of its own, and the check of
    ``--optimizer-dir`` took ``ckpt_1`` for its step: E100 "the model ... of step 1 (ckpt_1)" for the model's own
    optimizer folder. A folder holding both is no step of either's; another step's folder is still refused."""
    run = tmp_path / "ckpt_1" / "run"
    for s in (2, 3):
        shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / f"checkpoint-{s}")
    (run / "latest").symlink_to("checkpoint-2", target_is_directory=True)
    shutil.copytree(run / "checkpoint-2" / "pytorch_model_fsdp_0", run / "exported" / "model")
    opt = run / "checkpoint-2" / "optimizer_0"
    for model in (run / "latest" / "pytorch_model_fsdp_0", run / "exported" / "model"):
        assert locate(model, CheckpointSelection(optimizer_dir=opt)).optimizer == opt
    res = CliRunner().invoke(
        app, ["validate", str(run / "latest" / "pytorch_model_fsdp_0"), "--optimizer-dir", str(opt)]
    )
    assert res.exit_code == 0, res.output
    with pytest.raises(UsageError) as ei:
        locate(
            run / "latest" / "pytorch_model_fsdp_0",
            CheckpointSelection(optimizer_dir=run / "checkpoint-3" / "optimizer_0"),
        )
    assert "of step 3 (checkpoint-3)" in ei.value.message and "of step 2 (checkpoint-2)" in ei.value.message


def test_newer_incomplete_note_of_a_checkpoint_in_no_step_directory(acc_root: Path, tmp_path: Path) -> None:
    """HF Trainer's ``output_dir/final/`` (``save_model``) beside a ``checkpoint-3`` whose save did not finish: the
    R001 note of manifest / stats / export said "newer than the digested step None"; it names the folder chosen."""
    run = tmp_path / "run"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1" / "pytorch_model_fsdp_0", run / "final")
    (run / "checkpoint-3" / "pytorch_model_fsdp_0").mkdir(parents=True)
    shutil.copy(run / "final" / "__0_0.distcp", run / "checkpoint-3" / "pytorch_model_fsdp_0")
    loc = locate(run)
    assert loc.model == run / "final" and loc.step is None and [i.step for i in loc.newer_incomplete] == [3]
    res = CliRunner().invoke(app, ["manifest", str(run)])
    assert res.exit_code == 0, res.output
    assert f"newer than the digested checkpoint {run / 'final'} (in no step directory)" in res.stderr, res.stderr
    assert "step None" not in res.output


def test_latest_naming_a_folder_inside_a_step_directory(acc_root: Path, tmp_path: Path) -> None:
    """``run/latest -> checkpoint-1/pytorch_model_fsdp_0`` (a link to the model folder of a step, as tools that
    load one folder want it): `step` latest was E205 "names no step directory"; the step directory holding the
    folder is its step, as for a ``latest`` file holding that path. A link out of the run naming none is E205."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", run / f"checkpoint-{s}")
    (run / "latest").symlink_to(Path("checkpoint-1") / "pytorch_model_fsdp_0", target_is_directory=True)
    loc = locate(run, CheckpointSelection(step="latest"))
    assert (loc.model, loc.optimizer, loc.step) == (
        run / "checkpoint-1" / "pytorch_model_fsdp_0",
        run / "checkpoint-1" / "optimizer_0",
        1,
    )
    assert "named by latest" in loc.how
    assert locate(run / "latest").how.endswith("(step 1)")
    (run / "latest").unlink()
    (run / "latest").write_text("checkpoint-2/optimizer_0\n")
    assert locate(run, CheckpointSelection(step="latest")).step == 2
    (run / "latest").unlink()
    (tmp_path / "other" / "checkpoint-9").mkdir(parents=True)
    (run / "latest").symlink_to(Path("..") / "other" / "checkpoint-9" / "model")  # another run's step: not this one's
    with pytest.raises(StepNotFoundError, match="names no step directory"):
        locate(run, CheckpointSelection(step="latest"))


def test_latest_link_to_another_runs_step_directory(acc_root: Path, tmp_path: Path) -> None:
    """``run/latest -> ../other/checkpoint-1`` (another run's step directory): `step` latest opened this run's own
    ``checkpoint-1`` as "named by latest ... a resume that follows latest loads it", but a resume following the link
    loads ``other/checkpoint-1``, another save. It is E205 as a link naming no step of the run; a link to this run's
    step by an absolute path through another name of the run's folder is still followed."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", run / f"checkpoint-{s}")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", tmp_path / "other" / "checkpoint-1")
    (run / "latest").symlink_to(Path("..") / "other" / "checkpoint-1", target_is_directory=True)
    assert Path(os.path.realpath(run / "latest")) == tmp_path / "other" / "checkpoint-1"
    with pytest.raises(StepNotFoundError, match="names no step directory below"):
        locate(run, CheckpointSelection(step="latest"))
    (run / "latest").unlink()
    (tmp_path / "alias").symlink_to(run, target_is_directory=True)
    (run / "latest").symlink_to(tmp_path / "alias" / "checkpoint-1", target_is_directory=True)
    loc = locate(run, CheckpointSelection(step="latest"))
    assert (loc.model, loc.step) == (run / "checkpoint-1" / "pytorch_model_fsdp_0", 1)


def test_step_names_take_ascii_digits_to_the_end_only(acc_root: Path, tmp_path: Path) -> None:
    """``checkpoint-１００`` (full-width digits) was step 100 and won `step` latest over the real newest step, and
    ``checkpoint-2\\n`` was step 2 (``$`` matches before a trailing newline); HF Trainer's ``get_last_checkpoint``
    and the other trainers name steps with ASCII digits: those two are no step directories."""
    assert step_of("checkpoint-\uff11\uff10\uff10") is None and step_of("global_step\u0663") is None
    assert step_of("checkpoint-2\n") is None and step_of("epoch_0_step_5\n") is None
    assert step_of("epoch_0_step_5") == 5
    run = tmp_path / "run"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-0", run / "checkpoint-1")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / "checkpoint-\uff11\uff10\uff10" / "x")
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.step == 1 and loc.model == run / "checkpoint-1" / "pytorch_model_fsdp_0"


def test_hf_trainer_staging_directory_is_an_unfinished_step(acc_root: Path, tmp_path: Path) -> None:
    """HF Trainer (transformers 4.36-4.38) saved into ``tmp-checkpoint-N/`` and renamed it to ``checkpoint-N/`` when
    done: a ``tmp-checkpoint-2`` left by a cut save was listed as a checkpoint of a run root and passed over by
    `step` latest with no word. It is step 2's unfinished save (E202 / the R001 note), as OLMo-core's ``stepN-tmp``."""
    run = tmp_path / "run"
    shutil.copytree(acc_root / "accelerate" / "checkpoint-0", run / "checkpoint-1")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / "tmp-checkpoint-2")
    loc = locate(run)
    assert loc.model == run / "checkpoint-1" / "pytorch_model_fsdp_0" and loc.step == 1
    assert [(i.step, i.path) for i in loc.newer_incomplete] == [(2, run / "tmp-checkpoint-2")]
    assert "not renamed to checkpoint-2" in loc.newer_incomplete[0].reason
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.step == 1 and [i.step for i in loc.newer_incomplete] == [2]
    with pytest.raises(MetadataError) as ei:
        locate(run, CheckpointSelection(step=2))
    assert ei.value.code == "E202" and str(run / "tmp-checkpoint-2") in ei.value.message
    for given in (run / "tmp-checkpoint-2", run / "tmp-checkpoint-2" / "pytorch_model_fsdp_0"):
        with pytest.raises(MetadataError) as ei:
            locate(given)
        assert ei.value.code == "E202" and "not yet renamed to checkpoint-2" in ei.value.message, ei.value.message
    # a leftover beside the step it was renamed to (a rank that wrote after the rename): get_last_checkpoint
    # resumes checkpoint-2, and so does `step` latest
    from transformers.trainer_utils import get_last_checkpoint

    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / "checkpoint-2")
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-2")
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.model == run / "checkpoint-2" / "pytorch_model_fsdp_0" and not loc.newer_incomplete
    assert locate(run, CheckpointSelection(step=2)).model == run / "checkpoint-2" / "pytorch_model_fsdp_0"
    shutil.rmtree(run / "checkpoint-2")
    shutil.rmtree(run / "tmp-checkpoint-2")  # the prefix is HF Trainer's, of its checkpoint-N only
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", run / "tmp-global_step2")
    with pytest.raises(AmbiguousCheckpointError) as ei:
        locate(run)
    assert "tmp-global_step2/pytorch_model_fsdp_0" in ei.value.message


def test_latest_file_naming_a_missing_step_hint_claims_no_trainer_failure(titan_root: Path, tmp_path: Path) -> None:
    """verl's ``latest_checkpointed_iteration.txt`` naming a step that is not there: verl's ``find_latest_ckpt_path``
    returns None and the run starts from scratch, so the hint "the trainer's resume fails on it too" was wrong."""
    src = titan_root / "llama3" / "checkpoint"
    for s in (1, 2):
        shutil.copytree(src / f"step-{s}", tmp_path / f"global_step_{s}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    assert find_latest_ckpt_path(str(tmp_path)) is None  # verl's resume: no checkpoint, a fresh start
    with pytest.raises(StepNotFoundError) as ei:
        locate(tmp_path, CheckpointSelection(step="latest"))
    e = ei.value
    assert e.code == "E205" and e.hint is not None and "fails on it too" not in e.hint
    assert e.hint.startswith("a resume that follows latest_checkpointed_iteration.txt does not load step 30 either")


def test_a_step_directory_staged_under_a_suffix_is_an_unfinished_step(tmp_path: Path) -> None:
    """A run root with `step-1`, `step-2` and `step-3.tmp` (data files, no .metadata: a save staged under a suffixed
    name and cut): `--step latest` chose step 2 without a word, though `step-3` without .metadata is the R001 note
    and torchtitan's resume (`re.search("step-(\\d+)")`, .metadata required) counts the folder as step 3. It is now
    step 3's unfinished save, as OLMo-core's `stepN-tmp`; beside a `step-3` it is a leftover, not a step."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import CheckpointManager

    run = tmp_path / "run"
    for step in (1, 2):
        dcp.save({"model": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(run / f"step-{step}"), no_dist=True)
    staged = run / "step-3.tmp"
    staged.mkdir()
    for f in (run / "step-2").glob("*.distcp"):
        shutil.copy(f, staged / f.name)
    assert CheckpointManager._find_load_step(None, str(run)) == 2  # type: ignore[arg-type]  # torchtitan's resume
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.step == 2 and [(i.step, i.path) for i in loc.newer_incomplete] == [(3, staged)]
    assert loc.newer_incomplete[0].reason == "1 data file(s), no .metadata, not renamed to step-3"
    res = CliRunner().invoke(app, ["validate", "--json", "--step", "latest", str(run)])
    assert res.exit_code == 0 and "R001" in res.stdout and "step-3.tmp" in res.stdout, res.output
    with pytest.raises(MetadataError) as ei:
        locate(run, CheckpointSelection(step=3))
    assert ei.value.code == "E202" and str(staged) in ei.value.message
    shutil.copytree(run / "step-2", run / "step-3")  # renamed into step-3: the suffixed folder is a leftover
    assert CheckpointManager._find_load_step(None, str(run)) == 3  # type: ignore[arg-type]
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.model == run / "step-3" and not loc.newer_incomplete
    # its save finished under the staging name: torchtitan's resume takes step 3 from that name and fails, as it loads
    # step-3 (it was said to load the folder as step 3, and validate passed): `step` latest keeps step 2, R001 names it
    shutil.rmtree(run / "step-3")
    shutil.copy(run / "step-2" / ".metadata", staged / ".metadata")
    assert CheckpointManager._find_load_step(None, str(run)) == 3  # type: ignore[arg-type]
    assert CheckpointManager._create_checkpoint_id(None, 3, str(run)) == str(run / "step-3")  # type: ignore[arg-type]
    loc = locate(run, CheckpointSelection(step="latest"))
    why = (
        "a finished save under the name step-3.tmp, not step-3: torchtitan's resume, which matches step-N anywhere in "
        "a folder's name, takes step 3 from it and fails (it loads step-3, which is not there)"
    )
    assert loc.model == run / "step-2" and [(i.step, i.path, i.reason) for i in loc.newer_incomplete] == [
        (3, staged, why)
    ]
    assert "loads it as step 3" not in loc.how and f"step 3 is incomplete: {why}" in loc.how, loc.how
    res = CliRunner().invoke(app, ["validate", "--strict", "--json", "--step", "latest", str(run)])
    assert res.exit_code == 1 and [f["code"] for f in json.loads(res.stdout)["findings"]] == ["R001"], res.output


def test_latest_file_naming_another_runs_step_directory(acc_root: Path, tmp_path: Path) -> None:
    """A ``latest`` file holding ``../other/checkpoint-1`` or ``/elsewhere/checkpoint-1`` (DeepSpeed joins its tag to
    the run's folder, so its resume loads that other save): `step` latest opened this run's own ``checkpoint-1`` as
    "named by latest". It is E205 as a latest link leading out of the run is; a path to the run's own step is read."""
    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", run / f"checkpoint-{s}")
    shutil.copytree(acc_root / "accelerate" / "checkpoint-1", tmp_path / "other" / "checkpoint-1")
    for text in (
        "../other/checkpoint-1\n",
        f"{tmp_path / 'other' / 'checkpoint-1'}\n",
        "checkpoint-2/../../other/checkpoint-1",
    ):
        (run / "latest").write_text(text)
        with pytest.raises(StepNotFoundError, match="names no step directory below") as ei:
            locate(run, CheckpointSelection(step="latest"))
        assert ei.value.code == "E205" and str(run / "latest") in ei.value.message
    res = CliRunner().invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E205]") and "Traceback" not in res.output
    assert len(res.stderr.splitlines()) == 2, res.stderr
    for text, step in ((f"{run / 'checkpoint-1'}\n", 1), ("./checkpoint-1/../checkpoint-2", 2)):
        (run / "latest").write_text(text)
        assert locate(run, CheckpointSelection(step="latest")).step == step


def test_latest_file_that_is_a_fifo_or_socket_is_e102(acc_root: Path, tmp_path: Path) -> None:
    """A ``latest`` that is a FIFO or a socket (what a trainer's resume reading it blocks on or fails on): `step`
    latest passed it over and opened the highest step as if there were no ``latest``. It is E102 naming it, without
    blocking; a folder named ``latest`` (a copy of a step) is still no pointer."""
    import socket

    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", run / f"checkpoint-{s}")
    os.mkfifo(run / "latest")
    with pytest.raises(CkptError) as ei:
        locate(run, CheckpointSelection(step="latest"))
    assert ei.value.code == "E102" and str(run / "latest") in ei.value.message
    res = CliRunner().invoke(app, ["inspect", str(run), "--step", "latest"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E102]") and len(res.stderr.splitlines()) == 2
    (run / "latest").unlink()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(run / "latest"))
        with pytest.raises(CkptError) as ei:
            locate(run, CheckpointSelection(step="latest"))
        assert ei.value.code == "E102"
    finally:
        sock.close()
    (run / "latest").unlink()
    (run / "latest").mkdir()
    assert locate(run, CheckpointSelection(step="latest")).step == 2


def test_latest_file_that_cannot_be_read_is_e205(acc_root: Path, tmp_path: Path) -> None:
    """A ``latest`` file the process cannot open (mode 000: a trainer's resume reading it fails): `step` latest passed
    it over and opened the highest step as if there were none, though it may name an older one. It is E205 naming
    it (root runs the command without the capabilities that read past file modes)."""

    run = tmp_path / "run"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", run / f"checkpoint-{s}")
    (run / "latest").write_text("checkpoint-1\n")
    (run / "latest").chmod(0)
    cmd = [sys.executable, "-m", "ckpttool", "inspect", str(run), "--step", "latest"]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE")
        cmd = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.startswith("error: [E205]"), res.stderr
    assert f"{run / 'latest'}: cannot be read" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 2 and not res.stdout, res.stderr
    (run / "latest").chmod(0o644)
    assert locate(run, CheckpointSelection(step="latest")).step == 1


def test_latest_file_that_is_a_symlink_to_a_file_is_read(acc_root: Path, tmp_path: Path) -> None:
    """A ``latest`` that is a symlink to a regular file (a Hugging Face hub snapshot's files link to its blobs; a
    ``latest -> latest.real``) holds the step as the trainer's ``open(latest)`` reads it: it was taken for a link to
    a step directory and refused (E205, 'names no step directory'). A link to a file outside the run is E101."""
    snap = tmp_path / "models--org--run" / "snapshots" / "abc123"
    for s in (1, 2):
        shutil.copytree(acc_root / "accelerate" / f"checkpoint-{s - 1}", snap / f"checkpoint-{s}")
    blob = tmp_path / "models--org--run" / "blobs" / "e3b0c442"
    blob.parent.mkdir()
    blob.write_text("checkpoint-1\n")
    (snap / "latest").symlink_to(Path("..", "..", "blobs", blob.name))
    assert locate(snap, CheckpointSelection(step="latest")).step == 1
    (snap / "latest").unlink()
    (snap / "latest.real").write_text("checkpoint-1\n")
    (snap / "latest").symlink_to("latest.real")
    assert locate(snap, CheckpointSelection(step="latest")).step == 1
    (snap / "latest").unlink()
    (tmp_path / "elsewhere").write_text("checkpoint-1\n")
    (snap / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PathEscapeError) as got:
        locate(snap, CheckpointSelection(step="latest"))
    assert got.value.param == "step" and "pass `step` N" in got.value.hint, got.value.hint  # a step of this run


def test_a_folder_inside_a_checkpoint_names_the_checkpoint_ready_to_paste(titan_root: Path, tmp_path: Path) -> None:
    """``inspect CKPT/model_assets`` (a folder inside the checkpoint): the hint's checkpoint directory to pass is one
    shell argument; it was unquoted, its run of spaces and its newline folded into 'ck x $y', another folder."""
    ck = tmp_path / "ck  x\n$y"
    shutil.copytree(titan_root / "llama3" / "checkpoint" / "step-1", ck)
    (ck / "model_assets").mkdir()
    res = CliRunner().invoke(app, ["inspect", str(ck / "model_assets")])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E200]"), res.stderr
    hint = res.stderr.splitlines()[1]
    assert f"pass the checkpoint directory {shell_arg(ck)} (model_assets/ is a folder inside it)" in hint, hint


@pytest.mark.parametrize("name", ["checkpoint-3.tmp", "global_step3.tmp", "iter_0000003.tmp", "epoch_0_step_3.tmp"])
def test_a_finished_save_under_a_suffix_is_no_torchtitan_step_unless_named_step_n(tmp_path: Path, name: str) -> None:
    """A finished save under ``<step directory>.tmp`` where the step directory is not named ``step-N``: torchtitan's
    resume (``re.search("step-(\\d+)")``) does not list it, so ``how`` does not say that it loads it as step 3."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import CheckpointManager

    run = tmp_path / "run"
    for step in (1, 2):
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(run / name.replace("3.tmp", str(step))))
    dcp.save({"w": torch.full((4,), 3.0)}, checkpoint_id=str(run / name))
    assert CheckpointManager._find_load_step(None, str(run)) == -1  # type: ignore[arg-type]  # no step-N: none listed
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.step == 2 and f"{name} holds a finished save of step 3 under a staging name" in loc.how, loc.how
    assert "torchtitan" not in loc.how, loc.how


def test_a_staged_save_beside_its_step_under_another_spelling_is_a_leftover(tmp_path: Path) -> None:
    """``step-3`` complete beside ``step-03.tmp`` (data files, no .metadata): step 3 has a finished save, which
    torchtitan's resume loads; the staged folder is a leftover, not an unfinished step 3 (E202 on ``--step 3``)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import CheckpointManager

    run = tmp_path / "run"
    for step in (2, 3):
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(run / f"step-{step}"))
    staged = run / "step-03.tmp"
    staged.mkdir()
    for f in (run / "step-3").glob("*.distcp"):
        shutil.copy(f, staged / f.name)
    assert CheckpointManager._find_load_step(None, str(run)) == 3  # type: ignore[arg-type]
    loc = locate(run, CheckpointSelection(step="latest"))
    assert loc.model == run / "step-3" and not loc.newer_incomplete, loc
    assert locate(run, CheckpointSelection(step=3)).model == run / "step-3"


def test_step_n_of_a_finished_save_under_a_staging_name_names_that_folder(tmp_path: Path) -> None:
    """`--step latest` says that torchtitan's resume loads `step-3.tmp` (a finished save) as step 3; `--step 3` was
    E205 naming steps 1, 2 and no hint. The hint names the folder to pass."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import CheckpointManager

    run = tmp_path / "run"
    for name in ("step-1", "step-2", "step-3.tmp"):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(run / name))
    assert CheckpointManager._find_load_step(None, str(run)) == 3  # type: ignore[arg-type]
    with pytest.raises(StepNotFoundError) as ei:
        locate(run, CheckpointSelection(step=3))
    assert ei.value.hint is not None and str(run / "step-3.tmp") in ei.value.hint, ei.value.hint
    assert "staging name" in ei.value.hint
    res = CliRunner().invoke(app, ["inspect", str(run), "--step", "3"])
    assert res.exit_code == 2 and "step-3.tmp" in res.stderr and "Traceback" not in res.output, res.output


def test_a_newest_step_that_cannot_be_read_is_named_not_passed_over(dense_ckpt: Path, tmp_path: Path) -> None:
    """A run root whose newest step directory (step-3) this user may not list (chmod 000: another user's job, a
    restrictive umask): ``--step latest`` validated step-2, OK with no finding, as if step-3 were not there, and
    ``--step 3`` said 'no checkpoint of step 3 below it; steps found: 1, 2'. Now step-3 is a step not known to be
    complete: ``--step latest`` still checks step-2 and R001 names step-3 (``--strict`` fails), ``--step 3`` is
    E202 saying it cannot be read."""
    run = tmp_path / "run"
    for n in (1, 2, 3):
        shutil.copytree(dense_ckpt, run / f"step-{n}")
    (run / "step-3").chmod(0)
    try:
        r = run_bound_by_permissions("validate", "--json", str(run), "--step", "latest")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["path"] == str(run / "step-2")
        (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
        assert r001["message"] == (
            f"{run / 'step-3'}: step 3 is newer than the checked step 2 but incomplete (no listing this user may read "
            "(Permission denied), so whether its save finished is not known)"
        )
        assert run_bound_by_permissions("validate", "--strict", str(run), "--step", "latest").returncode == 1
        r = run_bound_by_permissions("inspect", str(run), "--step", "3")
        assert r.returncode == 2 and r.stderr.startswith(f"error: [E202] {run}: --step 3: step 3 is incomplete"), (
            r.stderr
        )
        assert f"{run / 'step-3'} has no listing this user may read (Permission denied)" in r.stderr
    finally:
        (run / "step-3").chmod(0o755)


def test_a_newest_step_linked_to_storage_that_is_gone_is_named(dense_ckpt: Path, tmp_path: Path) -> None:
    """A run root whose newest step directory is a link to storage that is gone or not mounted (step-3 ->
    /scratch/.../step-3): ``--step latest`` validated step-2 OK with no finding, as if step-3 had never been saved,
    and ``--step 3`` said 'no checkpoint of step 3 below it'. Now R001 names the link (``--strict`` fails) and
    ``--step 3`` is E202 naming its missing target."""
    run = tmp_path / "run"
    for n in (1, 2):
        shutil.copytree(dense_ckpt, run / f"step-{n}")
    gone = tmp_path / "scratch" / "step-3"
    (run / "step-3").symlink_to(gone)
    runner = CliRunner()
    r = runner.invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(run / "step-2")
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert r001["message"] == (
        f"{run / 'step-3'}: step 3 is newer than the checked step 2 but incomplete (no target: it links to "
        f"{str(gone)!r}, which does not exist (storage removed or not mounted), so whether its save finished is not "
        "known)"
    )
    assert runner.invoke(app, ["validate", "--strict", str(run), "--step", "latest"]).exit_code == 1
    r = runner.invoke(app, ["inspect", str(run), "--step", "3"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: [E202] {run}: --step 3: step 3 is incomplete"), r.output
    assert f"{run / 'step-3'} has no target: it links to {str(gone)!r}" in r.stderr


def test_a_finished_copy_named_step_n_something_is_the_step_torchtitan_fails_on(tmp_path: Path) -> None:
    """``step-1``, ``step-2`` and a finished save in ``step-5-backup`` (no ``step-5``): torchtitan's resume takes 5 from
    that name (``re.search("step-(\\d+)")``) and fails loading ``step-5``; ``--step latest`` checked step 2 and
    said OK in silence. Now R001 names the folder (``--strict`` fails); beside a real ``step-5`` it is a copy, and
    step 5 is chosen."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import CheckpointManager

    run = tmp_path / "run"
    for name in ("step-1", "step-2", "step-5-backup"):
        dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(run / name), no_dist=True)
    assert CheckpointManager._find_load_step(None, str(run)) == 5  # type: ignore[arg-type]
    assert not (run / "step-5").exists()  # what its resume loads: CheckpointManager._create_checkpoint_id(5)
    res = CliRunner().invoke(app, ["validate", "--json", "--step", "latest", str(run)])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["path"] == str(run / "step-2"), res.output
    (r001,) = [f for f in doc["findings"] if f["code"] == "R001"]
    assert r001["key"] == str(run / "step-5-backup") and "takes step 5 from it and fails" in r001["message"]
    shutil.copytree(run / "step-5-backup", run / "step-5")
    assert locate(run, CheckpointSelection(step="latest")).model == run / "step-5"


def test_r007_names_a_step_of_unknown_naming_beside_an_hf_named_step(tmp_path: Path) -> None:
    """A run root whose newest step is another run's plain ``nn.Linear`` save (torch's dcp.save, keys of no known
    naming) beside a step of the sample's HF-named MoE: ``validate --step latest`` said OK (0 warnings), R007 skipped
    the pair as 'one model under two namings'. Now R007 names the step and a key only in each of the two, as torch's
    own reader lists them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpttool.ops.sample import write_sample

    run = tmp_path / "run"
    write_sample(run / "step-10")
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(run / "step-20"))
    mine = set(FileSystemReader(str(run / "step-20")).read_metadata().state_dict_metadata)
    theirs = set(FileSystemReader(str(run / "step-10")).read_metadata().state_dict_metadata)
    r = CliRunner().invoke(app, ["validate", "--json", str(run), "--step", "latest"])
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "R007"]
    assert f["severity"] == "warning" and f["key"] == str(run / "step-20"), f
    assert f["message"].startswith(f"{run / 'step-20'}: step 20 holds another model than step 10 before it"), f
    new_key = f["message"].split("only in it (e.g. ", 1)[1].split(")", 1)[0]
    old_key = f["message"].split("only in step 10 (e.g. ", 1)[1].split(")", 1)[0]
    assert new_key in mine - theirs and old_key in theirs - mine, f["message"]


def test_one_step_in_two_directories_is_named_so(titan_root: Path, tmp_path: Path) -> None:
    """``step-10`` beside ``step-010`` (a step copied under a zero-padded name): `step` 10 or latest finds the one
    step number in two directories. E204 said "no .metadata; 2 checkpoints below it", as for a root given without
    `step`; it now says the step is saved in two directories, which `step` cannot tell apart."""
    run = tmp_path / "run"
    for name in ("step-10", "step-010"):
        shutil.copytree(titan_root / "llama3" / "checkpoint" / "step-3", run / name)
    for step in (10, "latest"):
        with pytest.raises(AmbiguousCheckpointError) as ei:
            locate(run, CheckpointSelection(step=step))
        assert ei.value.message == f"{run}: step 10 is saved in 2 directories below it: step-010; step-10"
    with pytest.raises(AmbiguousCheckpointError, match="no .metadata; 2 checkpoints below it"):
        locate(run)  # no step given: as for any two checkpoints
