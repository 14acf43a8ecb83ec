"""Training state a trainer saves beside the DCP checkpoint that was opened.

OLMo-core's ``Checkpointer`` (``olmo_core/train/checkpoint.py``) writes ``stepN/model_and_optim/``
(the DCP checkpoint) and, beside it, ``stepN/train/rank{R}.pt`` (``torch.save`` of the trainer's
``state_dict()`` on each rank: ``global_step``, ``global_train_tokens_seen``, RNG, data loader) and
``stepN/.metadata.json``. :func:`read_training_state_beside` reads the rank files with ckpttool's
safe loader (the zip checked, the pickle by the allow-list unpickler, tensors described, never
loaded; OLMo-core never imported): ``inspect`` shows their counters, rule ``R002`` compares
``global_step`` with the optimizer's step, rule ``K011`` names a file that could not be read.
Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import shell_arg
from ckpttool.format.jsonview import json_fields, json_number

__all__ = [
    "NEMO_STEP_SCHEDULER",
    "OLMO_CORE_METADATA",
    "files_beside",
    "TRAINER_STEP_KEY",
    "TrainerState",
    "hf_config_beside",
    "is_training_state_file",
    "read_training_state_beside",
    "trainer_state_missing",
    "training_state_beside",
    "unpaired_optimizer",
    "unread_beside",
    "unread_in_listing",
]

_RANK_PT = re.compile(r"^rank(\d+)\.pt$")
#: NeMo Automodel's recipes ``torch.save`` their ``StepScheduler`` state, ``{"step", "epoch"}``, into the step
#: directory beside ``model/`` and ``optim/`` (``recipes/base_recipe.py`` ``save_checkpoint``); its ``step``
#: counts the optimizer steps taken (``state_dict``: the yielded step + 1).
NEMO_STEP_SCHEDULER = "step_scheduler.pt"
#: OLMo-core's own metadata of a step (``{"version", "ephemeral"}``, a ``CheckpointMetadata``), written last
#: beside ``model_and_optim/`` and ``train/``: its presence publishes the save; ``ephemeral`` marks it for removal.
OLMO_CORE_METADATA = ".metadata.json"
#: The trainer's step in each kind of file :func:`training_state_beside` lists (OLMo-core's rank files:
#: ``global_step``).
TRAINER_STEP_KEY = {NEMO_STEP_SCHEDULER: "step"}

#: Files of training state that trainers save beside the weights and ckpttool does not read:
#: Hugging Face ``Trainer`` (``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state[_R].pth``,
#: ``trainer_state.json``, ``training_args.bin``; ``trainer/trainer.py`` ``_save_checkpoint``), Accelerate
#: (``optimizer[_N].bin``, ``scheduler[_N].bin``, ``scaler.pt``, ``sampler[_N].bin``,
#: ``random_states_R.pkl``; ``accelerate/checkpointing.py``).
#: And the rank files of the per-rank formats, left beside a checkpoint of another format (two trainers'
#: saves in one folder): verl's ``(model|optim|extra_state)_world_size_W_rank_R.pt``, torch-checkpointing's
#: ``metadata.pkl`` and ``model_R.pt`` / ``lr_scheduler_R.pt`` items. The same names of training state in other
#: encodings are named too: an ``optimizer.safetensors`` of moments, a ``train_state.json`` of counters.
_UNREAD_FILE = re.compile(
    r"^(?:(?:optimizer|scheduler|scaler|sampler)(?:_\d+)?\.(?:pt|bin|pth|safetensors)"
    r"|rng_state(?:_\d+)?\.pth|random_states_\d+\.pkl|(?:trainer|train)_state\.json|training_args\.bin"
    r"|(?:model|optim|extra_state)_world_size_\d+_rank_\d+\.pt|metadata\.pkl|(?:model|lr_scheduler)_\d+\.pt)$"
)
#: DeepSpeed's engine state (ZeRO optimizer partitions, ``mp_rank_*_model_states.pt``) in ``global_stepN/``
_UNREAD_DIR = re.compile(r"^global_step\d+$")
#: Any other pickle beside the weights (``torch.save``/``pickle.dump`` suffixes: a trainer's own
#: ``trainer_state.pt``, Accelerate's ``dl_state_dict.bin`` and ``custom_checkpoint_N.pkl``): ckpttool reads
#: none of them, so it is named too, unless it is a file ckpttool reads (:data:`_READ_BESIDE`).
_PICKLE_FILE = re.compile(r"\.(?:pt|pth|bin|pkl|pickle|ckpt)$")
#: A folder of the checkpoint holding this file is a DCP checkpoint of its own (optimizer state saved into a
#: subfolder, another save): not read with the one opened (``--optimizer-dir`` refuses a folder inside it).
_DCP_METADATA = ".metadata"
#: Pickles beside a checkpoint that ckpttool reads: NeMo Automodel's ``step_scheduler.pt`` (beside ``model/``).
#: Megatron's ``common.pt`` is read with its key schema: the checkpoint passes it in ``read``.
_READ_BESIDE = frozenset({NEMO_STEP_SCHEDULER})


def is_training_state_file(name: str) -> bool:
    """Whether a file named ``name`` is one of the trainers' own training-state files (``optimizer.pt``,
    ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``, ...: :data:`_UNREAD_FILE`), not model weights."""
    return bool(_UNREAD_FILE.match(name))


def _unread_file(name: str, any_pickle: bool = True) -> bool:
    """A file named ``name`` beside the checkpoint is training state ckpttool does not read (the one
    test :func:`unread_beside` and :func:`unread_in_listing` share); with ``any_pickle=False`` only the
    trainers' own training-state names (:data:`_UNREAD_FILE`), not any other pickle."""
    return bool(_UNREAD_FILE.match(name) or (any_pickle and _PICKLE_FILE.search(name) and name not in _READ_BESIDE))


def _unread_folder(name: str, holds_metadata: bool) -> bool:
    """A folder named ``name`` beside the checkpoint is one ckpttool does not read: DeepSpeed's
    ``global_stepN/``, or a DCP checkpoint of its own (``holds_metadata``: a ``.metadata`` at its top)."""
    return bool(_UNREAD_DIR.match(name)) or holds_metadata


def unread_beside(
    model_dir: Path, given: Path, read: Collection[Path] = (), *, any_pickle: bool = True
) -> tuple[str, ...]:
    """Training-state files and folders saved beside the checkpoint that ckpttool does not read.

    Looked for in ``model_dir`` and, where it is the model folder of a model/optimizer pair
    (``pytorch_model_fsdp_0``, ``model``: the schemas' folder pairs), in the step directory above it;
    a file in ``read`` (the checkpoint's own data files, resolved: a per-rank format's
    ``optimizer_R.pt``) is not one; the checkpoint folder of a step directory (the schemas' ``step_folders``:
    OLMo-core's ``model_and_optim``, verl's ``actor``) is looked beside too, the names the trainer saves
    beside it that are read left out; a folder of ``model_dir`` holding a ``.metadata`` (a DCP
    checkpoint of its own) is one, and so is a folder of the step directory holding a pickle (NeMo
    Automodel's ``rng/``, ``dataloader/``) or one of ``model_dir`` holding a pickle (a loop's ``rng/rank0.pt``;
    not ``extra_state/``, which is read, nor the model's assets: :data:`_OWN_FOLDERS`). Names are relative to
    ``given`` (the directory the user passed) where they lie below it; a folder ends in ``/``. ``()`` when there
    are none or a directory cannot be listed. ``any_pickle=False``: of the files, only those the trainers name as
    training state (``optimizer.pt``, ``rng_state.pth``, ...), not any other pickle, and no folder of ``model_dir``
    for its pickles (``import``: a ``pytorch_model.bin`` copy of the weights beside their safetensors, Meta's
    ``original/consolidated.00.pth``, are not training state).
    """
    own = {p.resolve() for p in read}
    from ckpttool.model.schemas import registry

    dirs = [model_dir]
    known: set[str] = set()  # names of the step directory read with the checkpoint or opened on their own
    if any(pair.model.match(model_dir.name) for pair in registry.derived().discovery.folder_pairs):
        dirs.append(model_dir.parent)
    for folder, beside in registry.derived().discovery.step_folders:
        if model_dir.name == folder:  # the checkpoint folder of a step directory (verl's actor/)
            dirs.append(model_dir.parent)
            known.update((folder, *beside))
            break
    out: list[str] = []
    for d in dirs:
        try:
            with os.scandir(d) as it:
                entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
        except OSError:
            continue
        for name, is_dir in entries:
            if d != model_dir and name in known:
                continue
            unread = (
                _unread_folder(name, d == model_dir and os.path.lexists(d / name / _DCP_METADATA))
                or ((d != model_dir or (any_pickle and name not in _OWN_FOLDERS)) and _holds_pickles(d / name))
                if is_dir
                else _unread_file(name, any_pickle)
            )
            if unread and (d / name).resolve() not in own:
                rel = os.path.relpath(d / name, given) if (d / name).is_relative_to(given) else str(d / name)
                out.append(rel + ("/" if is_dir else ""))
    return tuple(out)


def unpaired_optimizer(model_dir: Path, given: Path) -> str | None:
    """The optimizer folder saved beside ``model_dir`` when ``model_dir`` is the model folder of a model/optimizer
    pair (NeMo Automodel's ``model/`` + ``optim/``, Accelerate's ``pytorch_model_fsdp_0/`` + ``optimizer_0/``: the
    schemas' folder pairs) opened alone: a DCP checkpoint (``.metadata``) the opened one does not read. Named
    relative to ``given`` where it lies below it (as :func:`unread_beside` names), with a trailing ``/``;
    ``None`` when there is none."""
    from ckpttool.model.schemas import registry

    for pair in registry.derived().discovery.folder_pairs:
        m = pair.model.fullmatch(model_dir.name)
        if m is None:
            continue
        opt = model_dir.parent / pair.optimizer.format(*m.groups())
        if opt != model_dir and os.path.isfile(opt / _DCP_METADATA):
            return (os.path.relpath(opt, given) if opt.is_relative_to(given) else str(opt)) + "/"
    return None


def unpaired_model(optimizer_dir: Path, given: Path) -> str | None:
    """The model folder saved beside ``optimizer_dir`` when ``optimizer_dir`` is the optimizer folder of a
    model/optimizer pair (Accelerate's ``optimizer_0/`` beside ``pytorch_model_fsdp_0/``, NeMo Automodel's
    ``optim/`` beside ``model/``: the schemas' folder pairs) opened alone: a DCP checkpoint (``.metadata``)
    whose name pairs with it. Named as :func:`unpaired_optimizer` names; ``None`` when there is none or the
    parent cannot be listed."""
    from ckpttool.model.schemas import registry

    try:
        with os.scandir(optimizer_dir.parent) as it:
            names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return None
    for pair in registry.derived().discovery.folder_pairs:
        for name in names:
            m = pair.model.fullmatch(name)
            model = optimizer_dir.parent / name
            if (
                m is not None
                and model != optimizer_dir
                and pair.optimizer.format(*m.groups()) == optimizer_dir.name
                and os.path.isfile(model / _DCP_METADATA)
            ):
                return (os.path.relpath(model, given) if model.is_relative_to(given) else str(model)) + "/"
    return None


def model_folder_hint(cat_path: object, default: str) -> str:
    """The hint for a checkpoint without model tensors: where it is the optimizer folder of a model/optimizer
    pair (:func:`unpaired_model`), the step directory to pass instead; else ``default``. A URL: ``default``."""
    from ckpttool.format.storage import is_url

    if is_url(str(cat_path)):
        return default
    given = Path(str(cat_path))
    here = Path(os.path.abspath(given))  # `.` (the optimizer folder itself) has a name and a parent too
    model = unpaired_model(here, here)
    if model is None:
        return default
    if not given.is_absolute():  # named as the user named the checkpoint: relative to the current directory
        model, step = os.path.relpath(model) + "/", os.path.relpath(here.parent)
    else:
        step = str(here.parent)
    return f"its model folder {shell_arg(model)} lies beside it: pass the step directory {shell_arg(step)}, which holds both"


def unread_in_listing(names: Collection[str], read: Collection[str] = ()) -> tuple[str, ...]:
    """:func:`unread_beside` for an object-store prefix: its one listing ``names`` (every object below the
    prefix, relative to it) instead of a directory scan.

    The same names as a local directory of those files gives: a top-level object matching the training-state
    or pickle patterns (not one in ``read``: the checkpoint's own data objects), a top-level folder named like
    DeepSpeed's ``global_stepN/``, holding a ``.metadata`` of its own or a pickle at its top (not ``extra_state/``
    or the model's assets, :data:`_OWN_FOLDERS`; a folder ends in ``/``). Only the
    prefix itself is looked in (a URL names the checkpoint's own prefix: no model/optimizer pair above it).
    """
    own = set(read)
    files: set[str] = set()
    dirs: set[str] = set()
    nested: set[str] = set()
    pickles: set[str] = set()
    for name in names:
        top, sep, rest = name.partition("/")
        if not sep:
            files.add(name)
            continue
        dirs.add(top)
        if rest == _DCP_METADATA:
            nested.add(top)
        elif "/" not in rest and _PICKLE_FILE.search(rest) and name not in own:
            pickles.add(top)
    pickles -= _OWN_FOLDERS
    out = [
        d + "/" if d in dirs else d
        for d in sorted(files | dirs)
        if (
            (_unread_folder(d, d in nested) or (d in pickles and not d.startswith(".")))
            if d in dirs
            else _unread_file(d) and d not in own
        )
    ]
    return tuple(out)


#: Folders of the checkpoint folder that are not training state ckpttool leaves unread: ``extra_state/`` (read),
#: the model's assets (:data:`_HF_CONFIG_DIRS`: config, tokenizer) and the inputs of a consolidated HF save (``sharded/``).
#: Any other folder of it holding a pickle (a loop's ``rng/rank0.pt``, ``dataloader/rank_0.pt``) is named.
_OWN_FOLDERS = frozenset({"extra_state", "sharded", "consolidated", "huggingface", "model_assets"})

#: At most this many entries of a folder beside the checkpoint are looked at for pickles.
_FOLDER_SCAN = 1000


def _holds_pickles(folder: Path) -> bool:
    """``folder`` (in the step directory above a model/optimizer pair) holds a pickle at its top level
    (:data:`_PICKLE_FILE`): training state saved per rank into a folder of its own, NeMo Automodel's
    ``rng/rng_global_rank_R.pt`` and ``dataloader/dataloader_dp_rank_R.pt`` (``Checkpointer.save_on_global_ranks``
    / ``save_on_dp_ranks``). Hidden folders are not looked into; ``False`` when it cannot be listed."""
    if folder.name.startswith("."):
        return False
    try:
        with os.scandir(folder) as it:
            for i, e in enumerate(it):
                if i >= _FOLDER_SCAN:
                    break
                if _PICKLE_FILE.search(e.name) and e.is_file(follow_symlinks=False):
                    return True
    except OSError:
        return False
    return False


#: Where the model's Hugging Face config is saved with a checkpoint, relative to the model folder: the folder
#: itself (a Hugging Face model folder, safetensors and config.json), NeMo Automodel's ``model/consolidated/``
#: and ``model/.hf_metadata/``, verl's ``actor/huggingface/``, ``model_assets/`` (``ckpttool sample``, VeOmni).
_HF_CONFIG_DIRS = (".", "consolidated", ".hf_metadata", "huggingface", "model_assets")


def hf_config_beside(model_dir: Path) -> Path | None:
    """The folder holding the model's ``config.json`` that was saved with ``model_dir``, if any
    (:data:`_HF_CONFIG_DIRS`, first found); ``None`` when there is none or it cannot be listed.

    Raises:
        PathEscapeError: (E101) the ``config.json`` found, or the folder holding it, is a symlink out of ``model_dir``.
    """
    from ckpttool.format.files import resolve_inside

    for name in _HF_CONFIG_DIRS:
        folder = model_dir if name == "." else model_dir / name
        try:
            if not os.path.lexists(folder / "config.json"):  # a FIFO, folder or dangling link: read, refused there
                continue
        except OSError:
            continue
        if name != ".":  # the folder's own config.json is confined where it is read (read_hf_config)
            resolve_inside(model_dir, f"{name}/config.json", what="config.json")
        return folder
    return None


def _is_url(model_dir: Path) -> bool:
    """``model_dir`` is a remote checkpoint's ``UrlPath`` (``Path()`` of it would name a local ``s3:/...``)."""
    from ckpttool.format.storage import is_url

    return is_url(os.fspath(model_dir))


def training_state_beside(model_dir: Path) -> list[str]:
    """Paths (relative to the opened directory's parent) of training-state files saved beside it.

    ``train/rank{R}.pt`` files (OLMo-core), by rank, and NeMo Automodel's ``step_scheduler.pt``
    beside a ``model/`` folder; ``[]`` when there are none or the parent cannot be listed.
    """
    out: list[str] = []
    if _is_url(model_dir):  # object storage: its neighbours are objects, never local files below ./s3:/...
        return out
    train = model_dir.parent / "train"
    try:
        names = os.listdir(train)
    except OSError:
        names = []
    ranks = sorted((int(m.group(1)), n) for n in names if (m := _RANK_PT.match(n)))
    out += [f"train/{n}" for _, n in ranks]
    if model_dir.name == "model" and os.path.lexists(model_dir.parent / NEMO_STEP_SCHEDULER):
        out.append(NEMO_STEP_SCHEDULER)  # NeMo Automodel's recipe, beside model/ and optim/
    return out


def files_beside(model_dir: Path) -> list[str]:
    """Paths (relative to the opened directory's parent) of every file a trainer saved beside it that a
    restore reads: :func:`training_state_beside`, then OLMo-core's ``stepN/.metadata.json`` (beside
    ``model_and_optim/`` or ``train/``); what ``manifest`` digests beside the checkpoint."""
    out = training_state_beside(model_dir)
    if _is_url(model_dir):
        return out
    step = model_dir.parent
    if os.path.lexists(step / OLMO_CORE_METADATA) and (
        model_dir.name == "model_and_optim" or os.path.isdir(step / "train")
    ):
        out.append(OLMO_CORE_METADATA)
    return out


def trainer_state_missing(model_dir: Path) -> str | None:
    """Why OLMo-core's load would find no trainer state beside ``model_dir`` (``None``: it would).

    OLMo-core's ``Checkpointer.load`` reads ``train/rank{R}.pt``, else ``train/rank0.pt`` (a
    different world size), and without either loads no trainer state: the run restarts at step 0
    with the saved weights and moments. Its ``dir_is_checkpoint`` (behind ``latest_checkpoint``)
    requires ``train/rank0.pt``. Said for a step directory its ``Checkpointer`` wrote (it holds
    ``.metadata.json`` or ``train/``) that lacks that file.
    """
    step = model_dir.parent
    if not (os.path.lexists(step / ".metadata.json") or os.path.lexists(step / "train")):
        return None
    if os.path.lexists(step / "train" / "rank0.pt"):
        return None
    others = training_state_beside(model_dir)
    held = f"train/ holds {', '.join(others[:4])}" if others else "no train/rank*.pt"
    return (
        f"{step}: train/rank0.pt missing ({held}): OLMo-core's load falls back to it and, without it, "
        "restores no trainer state (the step, tokens seen and data loader restart from 0 over the saved "
        "weights and moments); its latest_checkpoint skips this directory"
    )


@dataclass(frozen=True)
class TrainerState:
    """One rank's trainer-state file beside the checkpoint.

    Attributes:
        file: its path relative to the step directory (``train/rank0.pt``).
        values: its top-level numbers (``global_step``, ``global_train_tokens_seen``, ``epoch``...).
        keys: its top-level keys (``rng``, ``data_loader``... included).
        error: why it could not be read (``None``: read).
    """

    file: str
    values: dict[str, int | float] = field(default_factory=dict)
    keys: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self, values={k: json_number(v) for k, v in self.values.items()})


def read_training_state_beside(model_dir: Path) -> list[TrainerState]:
    """Read every :func:`training_state_beside` file (a file that cannot be read gets its ``error``).

    Each file is read whole up to the object cap (``--max-object-size``) and loaded by
    :func:`ckpttool.format.reader.load_saved_object` with ``tensors="describe"``: a pickle that
    needs a global outside the allow-list is not run, a file (or ``train/``) that is a symlink out
    of the step directory is not read (its ``error`` says so).
    """
    from ckpttool.errors import CkptError
    from ckpttool.format import limits
    from ckpttool.format.files import read_regular, resolve_inside
    from ckpttool.format.reader import load_saved_object

    out = []
    for rel in training_state_beside(model_dir):
        path = model_dir.parent / rel
        try:
            src = resolve_inside(model_dir.parent, rel, what="trainer state")  # a symlink out of the step: refused
            obj = load_saved_object(
                read_regular(src, limits.current().max_object_bytes, shown=path, what="trainer state"),
                str(path),
                tensors="describe",
            )
        except CkptError as e:
            out.append(TrainerState(rel, error=str(e).splitlines()[0][:300]))
            continue
        if not isinstance(obj, dict):
            out.append(TrainerState(rel, error=f"holds a {type(obj).__name__}, not the trainer's state dict"))
            continue
        values = {str(k): v for k, v in obj.items() if type(v) in (int, float)}
        out.append(TrainerState(rel, values, tuple(str(k) for k in obj)))
    return out
