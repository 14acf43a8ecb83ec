"""The built-in per-rank formats (:mod:`ckpttool.format.perrank` plug-ins): verl FSDP and torch-checkpointing.

- **verl-fsdp** — verl's ``FSDPCheckpointManager.save_checkpoint``
  (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``): in ``global_step_N/actor/`` each rank
  ``R`` of ``W`` writes ``model_world_size_W_rank_R.pt`` (``torch.save(model.state_dict())``,
  FSDP2 DTensors by fqn), ``optim_world_size_W_rank_R.pt`` (``optimizer.state_dict()``: state
  keyed by parameter index, in ``model.parameters()`` order) and
  ``extra_state_world_size_W_rank_R.pt`` (``{"lr_scheduler": ..., "rng": ...}``); rank 0 writes
  ``fsdp_config.json`` (``FSDP_version``, ``world_size``) and ``huggingface/`` (config, tokenizer;
  with ``hf_model`` a full ``model.safetensors``): assets, not the checkpoint.

Keys are assembled in torch's flattened spelling: ``model.<fqn>``,
``optimizer.state.<fqn>.<field>``, ``optimizer.param_groups.<fqn>.<hyperparameter>``,
``lr_scheduler.<field>``. Torch-free.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ckpttool.errors import IncompleteCheckpointError
from ckpttool.format.perrank import (
    Assembled,
    DTensorRec,
    PerRankError,
    RankFile,
    RankLayout,
    RankObject,
    assemble,
    describe,
    flatten,
    is_tensor,
    register_layout,
)

__all__ = ["VERL_FILE_RE", "VERL_HF_DIR"]

VERL_FILE_RE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
VERL_HF_DIR = "huggingface"
_VERL_ROLES = {"model": "model", "optim": "optimizer", "extra_state": "extra"}


# --------------------------------------------------------------------------- verl
def _verl_claims(path: Path, names: list[str]) -> list[RankFile] | None:
    files = []
    for n in names:
        m = VERL_FILE_RE.match(n)
        if m:
            files.append(RankFile(_VERL_ROLES[m.group(1)], int(m.group(3)), n))
    if not files:
        return None
    return sorted(files, key=lambda f: (("model", "optimizer", "extra").index(f.role), f.rank))


def _verl_world(path: Path, files: list[RankFile]) -> int:
    """The world size every rank file names, each rank present once per role.

    Raises:
        IncompleteCheckpointError: a rank's file of a role is missing (a save that did not finish).
        PerRankError: files of different world sizes, a rank past the world size, ``fsdp_config.json`` disagreeing.
    """
    worlds = {int(VERL_FILE_RE.match(f.relative_path).group(2)) for f in files}  # type: ignore[union-attr]
    if len(worlds) != 1:
        raise PerRankError(f"{path}: rank files of world sizes {sorted(worlds)} (several saves mixed)", path=path)
    world = worlds.pop()
    for role in ("model", "optimizer", "extra"):
        ranks = sorted(f.rank for f in files if f.role == role)
        if ranks and ranks != list(range(world)):
            missing = sorted(set(range(world)) - set(ranks))
            raise IncompleteCheckpointError(
                f"{path}: {role} files of ranks {missing or ranks} missing or extra for world size {world}",
                path=path,
                hint="the save did not finish on every rank; use an earlier step",
            )
    if not any(f.role == "model" for f in files):
        raise IncompleteCheckpointError(f"{path}: verl rank files but no model_world_size_* file", path=path)
    cfg = path / "fsdp_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text()[:4096])
        except (OSError, ValueError) as e:
            raise PerRankError(f"{cfg}: not readable JSON ({type(e).__name__})", path=cfg) from e
        if isinstance(data, dict) and data.get("world_size") not in (None, world):
            raise PerRankError(f"{cfg}: world_size {data.get('world_size')!r:.20} but rank files of {world}", path=cfg)
    return world


def _param_order(obj: dict[str, Any]) -> list[str]:
    """The model's parameters in ``model.parameters()`` order: its DTensor entries, a tied one once."""
    seen: set[int] = set()
    out = []
    for k, v in obj.items():
        if isinstance(v, DTensorRec) and id(v) not in seen:
            seen.add(id(v))
            out.append(k)
    return out


def _verl_build(a: Assembled, objs: list[RankObject]) -> None:
    names: list[str] | None = None
    for ro in objs:
        obj, where = ro.obj, ro.file.relative_path
        if ro.file.role == "model":
            if not isinstance(obj, dict):
                raise PerRankError(f"{where}: not a state dict", path=where)
            for k, v in obj.items():
                if not is_tensor(v):
                    raise PerRankError(f"{where}: {k!r:.80} is not a tensor", path=where, fqn=str(k))
                a.add_tensor(f"model.{k}", v, ro)
            order = _param_order(obj)
            if names is None:
                names = order
            elif order != names:
                raise PerRankError(f"{where}: parameters differ from rank 0's", path=where)
        elif ro.file.role == "optimizer":
            _verl_optim(a, ro, names or [])
        else:
            _extra(a, ro)
    a.notes.append(
        f"verl FSDP per-rank torch.save files of {len(objs) and max(o.file.rank for o in objs) + 1} rank(s): "
        f"{sum(o.file.role == 'model' for o in objs)} model, {sum(o.file.role == 'optimizer' for o in objs)} optimizer, "
        f"{sum(o.file.role == 'extra' for o in objs)} extra_state file(s) read"
    )


def _verl_optim(a: Assembled, ro: RankObject, names: list[str]) -> None:
    """An ``optimizer.state_dict()`` keyed by index: index ``i`` is the model's ``i``-th parameter."""
    obj, where = ro.obj, ro.file.relative_path
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("state"), dict)
        or not isinstance(obj.get("param_groups"), list)
    ):
        raise PerRankError(f"{where}: not an optimizer state_dict (state, param_groups)", path=where)
    ids = [i for g in obj["param_groups"] if isinstance(g, dict) for i in g.get("params", [])]
    if sorted(ids) != list(range(len(names))) if ids and all(type(i) is int for i in ids) else True:
        raise PerRankError(
            f"{where}: the optimizer steps {len(ids)} parameters, the model file holds {len(names)}",
            path=where,
            hint="the optimizer's indices are mapped to the model's parameters in order; both must come from one save",
        )
    for i, st in obj["state"].items():
        if type(i) is not int or not 0 <= i < len(names) or not isinstance(st, dict):
            raise PerRankError(f"{where}: optimizer state of index {i!r:.20} names no parameter", path=where)
        fqn = names[i]
        for fld, v in st.items():
            key = f"optimizer.state.{fqn}.{fld}"
            if is_tensor(v):
                a.add_tensor(key, v, ro)
            else:
                a.add_object(key, v, ro)
    for g in obj["param_groups"]:
        for i in g.get("params", []):
            for hp, v in g.items():
                if hp != "params":
                    a.add_object(f"optimizer.param_groups.{names[i]}.{hp}", v, ro)


def _extra(a: Assembled, ro: RankObject) -> None:
    """``{"lr_scheduler": state_dict, "rng": ...}``: the scheduler as byte items, the RNG state described."""
    obj, where = ro.obj, ro.file.relative_path
    if not isinstance(obj, dict):
        raise PerRankError(f"{where}: extra state is not a dict", path=where)
    for k, v in obj.items():
        if k == "rng":
            if ro.file.rank == 0:
                a.notes.append(f"RNG state read (per rank, not exported): {describe(v)}")
            continue
        if v is None:
            if ro.file.rank == 0:
                a.notes.append(f"{k}: None saved")
            continue
        flat: dict[str, Any] = {}
        flatten(str(k), v, flat)
        for fk, fv in flat.items():
            if is_tensor(fv):
                a.add_tensor(fk, fv, ro)
            else:
                a.add_object(fk, fv, ro)


def _verl_assemble(path: Path, files: list[RankFile]) -> Assembled:
    world = _verl_world(path, files)
    a = assemble(path, files, _verl_build, name="verl-fsdp", schema="verl")
    hf = path / VERL_HF_DIR
    if hf.is_dir():
        a.notes.append(f"{VERL_HF_DIR}/ beside it: assets for export (config, tokenizer), not the checkpoint")
    _ = world
    return a


register_layout(RankLayout("verl-fsdp", "verl", _verl_claims, _verl_assemble))
