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
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, DataFileError, FormatVersionError, IncompleteCheckpointError, PerRankError
from ckpttool.format import limits
from ckpttool.format.files import read_regular, resolve_inside
from ckpttool.format.hf_storage import HF_INDEX_NAME, read_hf_index, read_safetensors_header
from ckpttool.format.jsonfile import parse_json
from ckpttool.format.manifest_file import MANIFEST_NAME, is_manifest_head
from ckpttool.format.metadata import DType, TensorMeta
from ckpttool.format.perrank import (
    Assembled,
    Placed,
    RankFile,
    RankLayout,
    RankObject,
    assemble,
    checked_pickle,
    describe,
    flatten,
    is_tensor,
    read_rank_file,
    register_layout,
    registered_layouts,
)
from ckpttool.format.perrank_pickle import DTensorRec, LocalTensor, Placement
from ckpttool.format.pickleframes import pickle_input
from ckpttool.format.safetensors import SAFETENSORS_TAGS
from ckpttool.format.unpickler import PrimitiveUnpickler, short_repr

log = logging.getLogger(__name__)

__all__ = [
    "TC_METADATA",
    "VERL_FILE_RE",
    "VERL_HF_DIR",
    "detect_layout",
    "layout_in_listing",
    "staging_of",
    "unfinished_layout",
]

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
        if ranks:
            _check_ranks(
                path,
                f"{role} files",
                ranks,
                world,
                "their names",
                "the save did not finish on every rank; use an earlier step",
            )
    if not any(f.role == "model" for f in files):
        raise IncompleteCheckpointError(f"{path}: verl rank files but no model_world_size_* file", path=path)
    cfg = path / "fsdp_config.json"
    if os.path.lexists(cfg):  # confined and capped as every JSON file (a symlink out, a FIFO, 10 GB: refused)
        try:
            raw = read_regular(resolve_inside(path, cfg.name, what="verl config"), 1 << 20, what="fsdp_config.json")
            data = parse_json(raw, str(cfg))
        except (OSError, ValueError) as e:
            raise PerRankError(f"{cfg}: not readable JSON ({type(e).__name__})", path=cfg) from e
        if not isinstance(data, dict) or data.get("world_size") not in (None, world):
            what = f"world_size {data.get('world_size')!r:.20}" if isinstance(data, dict) else "not a JSON object"
            raise PerRankError(f"{cfg}: {what}, but rank files of {world} rank(s)", path=cfg)
        if data.get("FSDP_version") == 1:
            raise PerRankError(f"{cfg}: {FSDP1_SAVE}", path=cfg, hint=FSDP1_HINT)
    return world


#: What a verl save of an FSDP1 model is, and why it is not read (``fsdp_config.json``'s ``FSDP_version`` 1).
FSDP1_SAVE = (
    "a verl save of an FSDP1 model (FSDP_version 1, verl's actor strategy 'fsdp'): its rank files hold FSDP's "
    "SHARDED_STATE_DICT (ShardedTensor model shards) and the optimizer's state over FSDP1's flat parameters, whose "
    "layout (which elements are which parameter) is not saved; ckpttool does not read it"
)
#: What to do with a verl FSDP1 save (:data:`FSDP1_SAVE`).
FSDP1_HINT = (
    "train with verl's actor strategy fsdp2 (FSDP2 DTensor shards, which ckpttool reads); for this save, load it "
    "with verl on its world size and re-save it with torch's dcp.save (get_state_dict) to check it"
)


def _param_order(obj: dict[str, Any]) -> list[str]:
    """The model's parameters in ``model.parameters()`` order: its DTensor entries, a tied one once.

    A tied parameter (``lm_head.weight`` is ``embed_tokens.weight``) is pickled as two DTensors over one
    local tensor: the same view of the same storage record, which no two distinct parameters share.
    """
    seen: set[Any] = set()
    out = []
    for k, v in obj.items():
        if not isinstance(v, DTensorRec):
            continue
        loc = v.local
        ident = (loc.key, loc.storage_offset, loc.size, loc.stride) if loc is not None else id(v)
        if ident not in seen:
            seen.add(ident)
            out.append(k)
    return out


def _verl_build(a: Assembled, objs: list[RankObject]) -> None:
    names: list[str] | None = None
    fields: dict[str, tuple[str, list[str]]] = {}
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
            if obj and not order:  # verl's FSDP workers save DTensors: plain tensors are another writer's
                raise PerRankError(
                    f"{where}: plain tensors under verl's rank-file name, not the DTensors verl's FSDP workers save: "
                    "which are parameters, in the optimizer's order, is not recorded",
                    path=where,
                    hint="save with verl's checkpoint manager, or save model and optimizer with torch's dcp.save",
                )
            if names is None:
                names = order
            elif order != names:
                raise PerRankError(f"{where}: parameters differ from rank 0's", path=where)
        elif ro.file.role == "optimizer":
            _verl_optim(a, ro, names or [], fields)
        else:
            _extra(a, ro)
    _verl_frozen(a, names or [])
    a.notes.append(
        f"verl FSDP per-rank torch.save files of {len(objs) and max(o.file.rank for o in objs) + 1} rank(s): "
        f"{sum(o.file.role == 'model' for o in objs)} model, {sum(o.file.role == 'optimizer' for o in objs)} optimizer, "
        f"{sum(o.file.role == 'extra' for o in objs)} extra_state file(s) read"
    )


def _verl_frozen(a: Assembled, names: list[str]) -> None:
    """The parameters the optimizer lists without state on any rank: frozen (``requires_grad=False``).

    verl builds its optimizer over ``module.parameters()`` (``verl/workers/engine/fsdp``), frozen
    ones included; torch's optimizer creates state only for a parameter that had a gradient when it
    stepped, and each rank saves its whole ``state_dict()``, so no state on every rank means the
    parameter was never updated, not that its state was lost.
    """
    if not any(k.startswith("optimizer.state.") for k in a.entries):
        return  # no optimizer saved (or nothing stepped): nothing is frozen by this evidence
    grouped = {
        k[len("optimizer.param_groups.") :].rsplit(".", 1)[0]
        for k in a.entries
        if k.startswith("optimizer.param_groups.")
    }
    a.frozen = [n for n in names if n in grouped and not any(k.startswith(f"optimizer.state.{n}.") for k in a.entries)]
    if a.frozen:
        a.notes.append(
            f"{len(a.frozen)} frozen parameter(s) (in the param groups, no optimizer state on any rank: "
            f"requires_grad=False): {', '.join(a.frozen[:4])}{' ...' if len(a.frozen) > 4 else ''}"
        )


def _lora_name(fqn: str) -> bool:
    """verl's test of a LoRA-only model file's keys (``BaseCheckpointManager.is_lora_only_state_dict``)."""
    return "lora_" in fqn or ".adapter_" in fqn


def _lora_only(where: str, held: int, stepped: int) -> str:
    """Why the optimizer file ``where`` of a LoRA-only save (verl's ``save_lora_only``) cannot be read."""
    return (
        f"{where}: a LoRA-only save (verl's checkpoint save_lora_only): the model file holds only the {held} "
        f"adapter tensors (lora_/adapter_ keys), the optimizer steps all {stepped} parameters of the PEFT model, the "
        "frozen base model's included; which of its indices is which adapter tensor is not saved, so its state "
        "cannot be read"
    )


#: What to do with a LoRA-only verl save (:func:`_lora_only`).
_LORA_ONLY_HINT = (
    "verl's own load restores it only into the PEFT model that saved it (the base model rebuilt from its config); "
    "to check the optimizer state with ckpttool, save without save_lora_only (the whole model: base and adapters)"
)


def _verl_optim(
    a: Assembled, ro: RankObject, names: list[str], fields: dict[str, tuple[str, list[str]]] | None = None
) -> None:
    """An ``optimizer.state_dict()`` keyed by index: index ``i`` is the model's ``i``-th parameter; ``fields``: the
    state fields of each parameter in the first rank file that holds its state (:func:`same_state_fields`)."""
    obj, where = ro.obj, ro.file.relative_path
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("state"), dict)
        or not isinstance(obj.get("param_groups"), list)
    ):
        raise PerRankError(f"{where}: not an optimizer state_dict (state, param_groups)", path=where)
    ids = [i for g in obj["param_groups"] if isinstance(g, dict) for i in g.get("params", [])]
    if sorted(ids) != list(range(len(names))) if ids and all(type(i) is int for i in ids) else True:
        if names and len(ids) > len(names) and all(_lora_name(n) for n in names):
            raise PerRankError(_lora_only(where, len(names), len(ids)), path=where, hint=_LORA_ONLY_HINT)
        raise PerRankError(
            f"{where}: the optimizer steps {len(ids)} parameters, the model file holds {len(names)}",
            path=where,
            hint="the optimizer's indices are mapped to the model's parameters in order; both must come from one save",
        )
    for i, st in obj["state"].items():
        if type(i) is not int or not 0 <= i < len(names) or not isinstance(st, dict):
            raise PerRankError(f"{where}: optimizer state of index {i!r:.20} names no parameter", path=where)
        fqn = names[i]
        if fields is not None:
            same_state_fields(fields, fqn, list(st), where)
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
            if where not in a.partial:  # the RNG bytes are in no entry: the file is digested whole
                a.partial.append(where)
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
        full = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors") and not n.startswith("."))
        a.companions = [f"{VERL_HF_DIR}/{n}" for n in full]
        a.notes.append(
            f"{VERL_HF_DIR}/ beside it: assets for export (config, tokenizer), not the checkpoint"
            + (f"; its full model ({', '.join(full)}) is compared with the shards by validate --deep" if full else "")
        )
    a.notes.append(f"world size {world}")
    return a


def _verl_unfinished(path: Path, files: list[RankFile]) -> str | None:
    """A rank's file of a role missing for the one world size the names give (verl writes every rank's files
    straight into ``actor/``, no staging: a save killed part way leaves some), else ``None``."""
    worlds = {int(m.group(2)) for f in files if (m := VERL_FILE_RE.match(f.relative_path))}
    if len(worlds) != 1:
        return None  # several saves mixed: the reader's E280
    world = worlds.pop()
    for role in ("model", "optimizer", "extra"):
        missing = _missing_ranks(sorted(f.rank for f in files if f.role == role), world)
        if missing and any(f.role == role for f in files):
            return f"{role} files of ranks {missing} missing for world size {world}"
    return None if any(f.role == "model" for f in files) else "rank files but no model_world_size_* file"


def unfinished_layout(path: Path) -> str | None:
    """Why the per-rank save in directory ``path`` did not finish, from its file names (the format's
    ``unfinished``), else ``None`` (not a per-rank save, or a complete one)."""
    found = detect_layout(path)
    if found is None or found[0].unfinished is None:
        return None
    return found[0].unfinished(path, found[1])


register_layout(RankLayout("verl-fsdp", "verl", _verl_claims, _verl_assemble, _verl_unfinished))


# --------------------------------------------------------------------------- torch-checkpointing
TC_METADATA = "metadata.pkl"
TC_VERSIONS = ("1.0", "2.0")
TC_STAGING_PREFIX = "tmp_"
_TC_FILE_RE = re.compile(r"^(?P<item>[A-Za-z][\w.-]*?)_(?P<rank>\d+)\.(?P<ext>[A-Za-z0-9]{1,16})$")
_TC_MODEL_RE = re.compile(r"^model_\d+\.(?:pt|safetensors)$")


def _tc_claims(path: Path, names: list[str]) -> list[RankFile] | None:
    """torch-checkpointing's files: ``metadata.pkl`` or a ``model_{rank}`` file; in its ``tmp_<name>`` staging
    directory any ``<item>_{rank}.pt``/``.safetensors`` file (a save stopped before its model item was written, or
    whose model write failed, leaves the other items there: :func:`staging_of` names it unfinished)."""
    if ".metadata" in names:
        return None
    if not (TC_METADATA in names or any(_TC_MODEL_RE.match(n) for n in names) or _tc_staged_items(path, names)):
        return None
    files = []
    for n in names:
        m = _TC_FILE_RE.match(n)
        if m:
            files.append(RankFile(m.group("item"), int(m.group("rank")), n))
    return sorted(files, key=lambda f: (f.role != "model", f.role, f.rank))


def _tc_staged_items(path: Path, names: list[str]) -> bool:
    """``path`` is named as torch-checkpointing's staging directory (``tmp_<name>``) and holds an item's rank file
    in one of its binary serializations (``<item>_{rank}.pt`` / ``.safetensors``)."""
    if not path.name.startswith(TC_STAGING_PREFIX) or len(path.name) == len(TC_STAGING_PREFIX):
        return False
    return any((m := _TC_FILE_RE.match(n)) is not None and m.group("ext") in ("pt", "safetensors") for n in names)


def _tc_metadata(path: Path) -> dict[str, Any] | None:
    """``metadata.pkl`` (torch-checkpointing's ``DistributedMetadata.to_dict()``, a plain pickle), or ``None``.

    Raises:
        FormatVersionError: a version other than "1.0" / "2.0" (named).
        UnsafePickleError: a global in the pickle (torch-checkpointing writes plain values only).
        PerRankError: not a dict with ``metadata`` and ``world_size``.
    """
    p = path / TC_METADATA
    if not os.path.lexists(p):
        return None
    try:
        data = read_regular(resolve_inside(path, TC_METADATA), limits.current().max_metadata_bytes, what=TC_METADATA)
    except OSError as e:
        raise DataFileError(f"{p}: cannot read ({e.strerror})", path=p) from e
    obj = checked_pickle(lambda: PrimitiveUnpickler(pickle_input(data), source=str(p)).load(), p)
    if not isinstance(obj, dict):
        raise PerRankError(f"{p}: not torch-checkpointing's DistributedMetadata dict", path=p)
    version = obj.get("version", "1.0")
    if version not in TC_VERSIONS:
        raise FormatVersionError(
            f"{p}: torch-checkpointing metadata version {short_repr(version)} (ckpttool reads {', '.join(TC_VERSIONS)})",
            path=p,
        )
    if not isinstance(obj.get("metadata"), dict) or type(obj.get("world_size")) is not int:
        raise PerRankError(f"{p}: DistributedMetadata without metadata / world_size", path=p)
    return obj


def _tc_items(md: dict[str, Any] | None) -> dict[str, dict[int, Any]]:
    """item -> rank -> its layout-info dict (``None``: the default ``<item>_<rank>.pt``), from metadata v2 / v1."""
    if md is None:
        return {}
    if md.get("version") == "2.0":
        out = {}
        for item, d in md["metadata"].items():
            layouts = d.get("rank_to_layout_info") if isinstance(d, dict) else None
            out[str(item)] = {int(r): v for r, v in layouts.items()} if isinstance(layouts, dict) else {}
        return out
    out2: dict[str, dict[int, Any]] = {}
    raw = md.get("rank_to_layout_info_mappings")
    for r, mapping in raw.items() if isinstance(raw, dict) else ():
        for item, v in mapping.items() if isinstance(mapping, dict) else ():
            out2.setdefault(str(item), {})[int(r)] = v
    return out2


def _tc_sharding(md: dict[str, Any] | None, item: str) -> dict[str, list[Any]]:
    """JSON path -> its ``GlobalObjectMetadata`` dicts, for ``item`` (metadata v2, or v1 paths starting with the item)."""
    if md is None:
        return {}
    if md.get("version") == "2.0":
        d = md["metadata"].get(item)
        paths = d.get("nested_path_to_metadata") if isinstance(d, dict) else None
        return dict(paths) if isinstance(paths, dict) else {}
    out = {}
    for k, v in md["metadata"].items():
        try:
            path = json.loads(k)
        except (TypeError, ValueError):
            continue
        if isinstance(path, list) and path and path[0] == item:
            out[json.dumps(path[1:], separators=(",", ":"))] = v
    return out


def _tc_placed(entries: Any, rank: int, where: str) -> Placed | None:
    """The placement torch-checkpointing recorded for ``rank`` (``DTensorShardingMetadata``), or ``None``."""
    for e in entries if isinstance(entries, list) else ():
        sm = e.get("sharding_metadata") if isinstance(e, dict) else None
        ranks = e.get("ranks") if isinstance(e, dict) else None
        if not isinstance(sm, dict) or sm.get("type") != "DTensorShardingMetadata":
            continue
        if isinstance(ranks, (list, tuple)) and rank not in ranks:
            continue
        data: Any = sm.get("data") if isinstance(sm.get("data"), dict) else {}
        mesh: Any = data.get("mesh_spec") if isinstance(data.get("mesh_spec"), dict) else {}
        shape: Any = mesh.get("mesh_shape")
        flat: Any = mesh.get("mesh_data")
        gshape: Any = data.get("global_shape")
        if not (_ints(shape) and _ints(flat) and _ints(gshape)) or rank not in flat:
            raise PerRankError(f"{where}: sharding metadata without a readable mesh for rank {rank}", path=where)
        coord, idx = [], list(flat).index(rank)
        for n in reversed(shape):
            coord.append(idx % n)
            idx //= n
        return Placed(
            tuple(gshape), _tc_placements(data.get("placements"), where), tuple(shape), tuple(reversed(coord))
        )
    return None


def _ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(type(x) is int and x >= 0 for x in v)


def _tc_placements(raw: Any, where: str) -> tuple[Placement, ...]:
    out = []
    for p in raw if isinstance(raw, list) else ():
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "Shard" and type(p.get("dim")) is int:
            out.append(Placement("shard", p["dim"]))
        elif kind == "StridedShard" and type(p.get("dim")) is int and type(p.get("split_factor")) is int:
            out.append(Placement("strided_shard", p["dim"], p["split_factor"]))
        elif kind == "Replicate":
            out.append(Placement("replicate"))
        else:
            raise PerRankError(f"{where}: placement {short_repr(kind)} is not read by ckpttool", path=where)
    return tuple(out)


def _read_safetensors(path: Path, f: RankFile) -> RankObject:
    """A safetensors item file as a :class:`RankObject`: its tensors as plain local tensors, records by name."""
    p = path / f.relative_path
    size = resolve_inside(path, f.relative_path, what="safetensors file").stat().st_size
    header, start = read_safetensors_header(p, size)
    header.pop("__metadata__", None)
    obj: dict[str, Any] = {}
    records: dict[str, tuple[int, int]] = {}
    for name, rec in header.items():
        tag = rec.get("dtype") if isinstance(rec, dict) else None
        dtype = SAFETENSORS_TAGS.get(tag) if isinstance(tag, str) else None
        shape: Any = rec.get("shape") if isinstance(rec, dict) else None
        span: Any = rec.get("data_offsets") if isinstance(rec, dict) else None
        if dtype is None or not _ints(shape) or not _ints(span) or len(span) != 2 or span[1] + start > size:
            raise PerRankError(f"{p}: header entry {name!r:.80} is malformed", path=p)
        numel = math.prod(shape)
        if span[1] - span[0] != numel * DType(dtype).itemsize:
            raise PerRankError(f"{p}: {name!r:.80} data_offsets do not hold {dtype}{list(shape)}", path=p)
        stride, acc = [], 1
        for n in reversed(shape):
            stride.append(acc)
            acc *= n
        obj[name] = LocalTensor(dtype, name, numel, 0, tuple(shape), tuple(reversed(stride)))
        records[name] = (start + span[0], span[1] - span[0])
    return RankObject(f, obj, records)


#: torch-checkpointing's ``SerializationFormat`` types (``checkpoint_layout.py``) -> how ckpttool reads the file.
_TC_SERIALIZATIONS = {
    "TorchSerialization": "pt",
    "SafetensorsSerialization": "safetensors",
    "JsonSerialization": "json",
    "RawSerialization": "raw",
}


def _tc_kind(info: Any, name: str, where: Path) -> str:
    """How item file ``name`` is serialized: its ``LayoutInfo``'s format, else ``.pt`` / ``.safetensors`` /
    ``.json`` by extension, else raw bytes.

    Raises:
        PerRankError: a serialization format ckpttool does not read (named).
    """
    fmt = info.get("serialization_format") if isinstance(info, dict) else None
    if isinstance(fmt, dict):
        kind = _TC_SERIALIZATIONS.get(fmt.get("type"))  # type: ignore[arg-type]
        if kind is None:
            raise PerRankError(
                f"{where}: {TC_METADATA} names serialization {short_repr(fmt.get('type'))} for {name!r}, "
                f"which ckpttool does not read ({', '.join(_TC_SERIALIZATIONS)})",
                path=where,
            )
        return kind
    ext = name.rsplit(".", 1)[-1]
    return ext if ext in ("pt", "safetensors", "json") else "raw"


def _read_item(path: Path, f: RankFile, kind: str | None = None) -> RankObject:
    kind = kind or _tc_kind(None, f.relative_path, path)
    if kind == "pt":
        return read_rank_file(path, f)
    if kind == "safetensors":
        return _read_safetensors(path, f)
    p = path / f.relative_path
    try:
        data = read_regular(resolve_inside(path, f.relative_path), limits.current().max_object_bytes, what="item file")
    except OSError as e:
        raise DataFileError(f"{p}: cannot read ({e.strerror})", path=p) from e
    if kind == "json":
        try:
            return RankObject(f, parse_json(data, str(p)), {})
        except ValueError as e:  # not JSON (a damaged or edited item file); too deep or too long: its own error
            raise PerRankError(
                f"{p}: not readable JSON ({type(e).__name__}), but the save's metadata says a JSON item",
                path=p,
                hint="the item file changed after the save: restore it from a good copy of the checkpoint",
            ) from e
    return RankObject(f, bytes(data), {})  # RawSerialization: the item's bytes as they are


def _tc_per_rank(objs: list[RankObject]) -> set[str]:
    """Items (other than ``model`` / ``optimizer``) whose non-tensor values differ between ranks:
    per-rank state (a data loader's position, a JSON or raw item each rank writes its own), kept
    per rank as ``<item>.rank_<R>.<key>`` instead of one replicated value."""
    first: dict[str, dict[str, Any]] = {}
    out: set[str] = set()
    for ro in objs:
        item = ro.file.role
        if item in ("model", "optimizer"):
            continue
        flat: dict[str, Any] = {}
        flatten("", ro.obj, flat)
        vals = {k: v for k, v in flat.items() if not is_tensor(v)}
        ref = first.setdefault(item, vals)
        if ref is not vals and (ref.keys() != vals.keys() or any(not _equal(ref[k], v) for k, v in vals.items())):
            out.add(item)
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RecursionError):
        return False


def same_state_fields(seen: dict[str, tuple[str, list[str]]], fqn: str, have: list[str], where: str) -> None:
    """Each rank saves its optimizer's whole ``state_dict()``, the state of every parameter it stepped with the
    same fields (``step``, ``exp_avg``, ``exp_avg_sq``) on every rank: a rank file whose state of ``fqn`` has other
    fields than another's (a ``step`` lost on one rank, while another's is read in its place as a replica) cannot
    be resumed from, that rank's optimizer fails on its first step. ``seen``: ``fqn`` -> ``(rank file, fields)``
    of the first rank file read."""
    first = seen.setdefault(fqn, (where, sorted(have)))
    if first[1] != sorted(have):
        raise PerRankError(
            f"{where}: optimizer state of {fqn!r:.100} has field(s) {', '.join(sorted(have)) or 'none'}, "
            f"{first[0]} has {', '.join(first[1])}",
            fqn=f"optimizer.state.{fqn}",
            hint="every rank saves the same state fields for a parameter: the file is damaged or from another save; "
            "resume from a complete checkpoint",
        )


def _tc_state_fields(fields: dict[str, tuple[str, list[str]]], obj: Any, where: str) -> None:
    """The state fields of each parameter in an optimizer item (keyed by fqn) against the other ranks'
    (:func:`same_state_fields`)."""
    state = obj.get("state") if isinstance(obj, dict) else None
    for fqn, st in state.items() if isinstance(state, dict) else ():
        if isinstance(st, dict):
            same_state_fields(fields, str(fqn), [str(f) for f in st], where)


def _tc_build(a: Assembled, objs: list[RankObject], md: dict[str, Any] | None, kinds: dict[str, str]) -> None:
    per_rank = _tc_per_rank(objs)
    if per_rank:
        a.notes.append(f"per-rank item(s) {', '.join(sorted(per_rank))} (values differ by rank): keys <item>.rank_<R>")
    fields: dict[str, tuple[str, list[str]]] = {}
    for ro in objs:
        item, obj, where = ro.file.role, ro.obj, ro.file.relative_path
        prefix = f"{item}.rank_{ro.file.rank}" if item in per_rank else item
        sharding = _tc_sharding(md, item)
        if item == "optimizer":
            _tc_state_fields(fields, obj, where)
        if item == "optimizer" and isinstance(obj, dict) and isinstance(obj.get("param_groups"), list):
            for g in obj["param_groups"]:
                for fqn in g.get("params", []) if isinstance(g, dict) else ():
                    for hp, v in g.items():
                        if hp != "params":
                            a.add_object(f"optimizer.param_groups.{fqn}.{hp}", v, ro)
            obj = {"state": obj.get("state", {})}
        flat: dict[str, Any] = {}
        flatten("", obj, flat)
        for k, v in flat.items():
            key = f"{prefix}.{k}" if k else prefix
            if is_tensor(v):
                placed = None
                if not isinstance(v, DTensorRec) and kinds.get(where, _tc_kind(None, where, Path())) == "safetensors":
                    placed = _tc_placed(sharding.get(json.dumps([k], separators=(",", ":"))), ro.file.rank, where)
                    if placed is None and len({o.file.rank for o in objs}) > 1:
                        raise PerRankError(f"{where}: {k!r:.80} has no sharding metadata in {TC_METADATA}", path=where)
                a.add_tensor(key, v, ro, placed)
            else:
                a.add_object(key, v, ro)
    _tc_check_shapes(a, md)


def _tc_check_shapes(a: Assembled, md: dict[str, Any] | None) -> None:
    """Every DTensor path in ``metadata.pkl`` (v2) has the global shape the assembled tensor has."""
    if md is None or md.get("version") != "2.0":
        return
    for item in md["metadata"]:
        for jpath, entries in _tc_sharding(md, str(item)).items():
            try:
                path = json.loads(jpath)
            except (TypeError, ValueError):
                continue
            key = ".".join([str(item), *map(str, path)]) if isinstance(path, list) else ""
            for e in entries if isinstance(entries, list) else ():
                sm = e.get("sharding_metadata") if isinstance(e, dict) else None
                data: Any = sm.get("data") if isinstance(sm, dict) and isinstance(sm.get("data"), dict) else {}
                want: Any = data.get("global_shape")
                meta = a.entries.get(key)
                if _ints(want) and isinstance(meta, TensorMeta) and tuple(want) != meta.size:
                    raise PerRankError(
                        f"{TC_METADATA}: {key!r:.80} is {list(want)}, its shards assemble {list(meta.size)}", fqn=key
                    )


def _tc_files(
    path: Path, files: list[RankFile], md: dict[str, Any] | None
) -> tuple[dict[str, RankFile], dict[str, str]]:
    """The item files: those named ``<item>_<rank>.<ext>`` and those ``metadata.pkl``'s layouts name
    (any path inside the checkpoint, ``{rank}`` filled in), with how each is serialized.

    Raises:
        IncompleteCheckpointError: a file a layout names is missing.
        PathEscapeError: a layout names a path outside the checkpoint.
    """
    by_name = {f.relative_path: f for f in files}
    kinds: dict[str, str] = {}
    for item, ranks in _tc_items(md).items():
        for r, info in ranks.items():
            name = info.get("file_path") if isinstance(info, dict) else f"{item}_{r}.pt"
            name = str(name).replace("{rank}", str(r))
            if not os.path.lexists(resolve_inside(path, name, what=f"{TC_METADATA} file_path")):
                raise IncompleteCheckpointError(
                    f"{path}: {TC_METADATA} names {name!r} for item {item!r}, which is missing", path=path
                )
            by_name[name] = RankFile(item, r, name)
            kinds[name] = _tc_kind(info, name, path)
    return by_name, kinds


_MAX_WALK = 10_000


def _own_manifest(path: Path) -> list[str]:
    """``[manifest.json]`` when the directory holds ckpttool's own manifest (``ckpttool manifest DIR``'s default
    output, which ``validate --manifest`` then reads): a file of the tool's, not a state file left unread."""
    try:
        with open(path / MANIFEST_NAME, "rb") as f:
            head = f.read(256)
    except OSError:
        return []
    return [MANIFEST_NAME] if is_manifest_head(head) else []


def _tc_unread(path: Path, read: set[str]) -> list[str]:
    """Regular files below ``path`` (not hidden, at most 10,000 looked at) that are not in ``read``.

    torch-checkpointing records an item's file path in ``metadata.pkl`` only for items that declare
    a resharder; an item saved at a custom ``LayoutInfo`` path without one is found by nothing else.
    """
    out: list[str] = []
    seen = 0
    for top, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            seen += 1
            rel = os.path.relpath(os.path.join(top, n), path)
            if not n.startswith(".") and rel not in read and os.path.isfile(os.path.join(top, n)):
                out.append(rel)
        if seen > _MAX_WALK:
            break
    return out


#: torch-checkpointing's ``consolidate_hf_safetensors_checkpoint`` (its hf consolidation) writes
#: :data:`~ckpttool.format.hf_storage.HF_INDEX_NAME` beside the rank files (its default ``output_dir``, ``item_key``
#: ``model``), last, atomically, over its ``model-0000K-of-0000N.safetensors`` files.
_TC_HF_FILE = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors\Z")


def _tc_consolidated(path: Path, unread: list[str]) -> tuple[list[str], list[str]]:
    """``(HF copy files, still unread)``: where ``unread`` holds the index and every file its
    ``weight_map`` names (``model-0000K-of-0000N.safetensors``), those files are the full model that
    torch-checkpointing's consolidation wrote (``validate --deep`` compares them with the shards, ``D012``); any
    other index (unreadable, naming another file or one that is not there) leaves everything unread (``K020``)."""
    if HF_INDEX_NAME not in unread:
        return [], unread
    try:
        wm = read_hf_index(path)  # bounded, a weight_map of str -> str, or MetadataError
    except (OSError, ValueError, CkptError):
        return [], unread
    names = set(wm.values()) if wm else set()
    if not names or not all(isinstance(n, str) and _TC_HF_FILE.match(n) and n in unread for n in names):
        return [], unread
    return sorted(names), [u for u in unread if u not in names and u != HF_INDEX_NAME]


def _all_ranks(ranks: list[int], world: Any) -> bool:
    """``ranks`` (sorted) are exactly ``0..world-1``; compared by length first: a world size declared by a file
    name or ``metadata.pkl`` (10**9) never becomes a list of that size."""
    return type(world) is int and len(ranks) == world and ranks == list(range(len(ranks)))


def _check_ranks(path: Path, what: str, ranks: list[int], world: Any, source: str, hint: str | None = None) -> None:
    """``ranks`` (sorted: the rank of each file of one item) are exactly ``0..world-1``.

    Raises:
        IncompleteCheckpointError: a rank has no file (a save that did not finish).
        PerRankError: a file of a rank at or past the world size, or two files of one rank (files
            of another save mixed in).
    """
    if _all_ranks(ranks, world):
        return
    missing = _missing_ranks(ranks, world)
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: {what} of ranks {missing}{' ...' if len(missing) == 8 else ''} missing for world size {world} "
            f"(from {source}; files of ranks {ranks[:8]}{' ...' if len(ranks) > 8 else ''})",
            path=path,
            hint=hint
            or "the save did not finish on every rank (crashed, or an async save still running); use an earlier checkpoint",
        )
    extra = sorted({r for r in ranks if type(world) is not int or r >= world})[:8]
    twice = sorted({r for i, r in enumerate(ranks) if i and ranks[i - 1] == r})[:8]
    parts = [f"files of ranks {extra} past world size {world} (from {source})"] if extra else []
    if twice:
        parts.append(f"more than one file of rank(s) {twice}")
    raise PerRankError(
        f"{path}: {what}: {'; '.join(parts) or f'ranks {ranks[:8]} for world size {world}'}",
        path=path,
        hint="files of another save are mixed in (a run with another world size, or a second copy of a rank's "
        "file): move them out of the checkpoint directory, or copy the save again",
    )


def _missing_ranks(ranks: list[int], world: Any, most: int = 8) -> list[int]:
    """Up to ``most`` ranks below ``world`` that ``ranks`` lacks (at most ``len(ranks) + most`` steps)."""
    present, missing = set(ranks), []
    for r in range(world if type(world) is int else 0):
        if r not in present:
            missing.append(r)
            if len(missing) == most:
                break
    return missing


def _tc_assemble(path: Path, files: list[RankFile]) -> Assembled:
    if path.name.startswith(TC_STAGING_PREFIX):
        raise IncompleteCheckpointError(
            f"{path}: torch-checkpointing's staging directory of a save that did not finish "
            f"(a finished save is renamed to {path.name[len(TC_STAGING_PREFIX) :]!r})",
            path=path,
        )
    md = _tc_metadata(path)
    by_name, kinds = _tc_files(path, files, md)
    files = sorted(by_name.values(), key=lambda f: (f.role != "model", f.role, f.rank))
    world = md["world_size"] if md is not None else max(f.rank for f in files) + 1
    for item in sorted({f.role for f in files}):
        have = sorted(f.rank for f in files if f.role == item)
        _check_ranks(path, f"item {item!r}", have, world, TC_METADATA if md is not None else "the highest rank")
    objs = [_read_item(path, f, kinds.get(f.relative_path)) for f in files]
    a = Assembled("torch-checkpointing", "torch-checkpointing")
    a.read_files(files)
    _tc_build(a, objs, md, kinds)
    a.describe_placements()
    log.info("%s: %s", path, "; ".join(a.notes))
    a.unread = _tc_unread(path, {*a.files, TC_METADATA, *_own_manifest(path)})
    a.companions, a.unread = _tc_consolidated(path, a.unread)
    if a.companions:
        a.notes.append(
            f"{HF_INDEX_NAME} and {', '.join(a.companions[:4])} beside it: the full model torch-checkpointing's "
            "consolidate_hf_safetensors_checkpoint wrote, compared with the shards by validate --deep"
        )
    if a.unread:
        a.notes.append(f"{len(a.unread)} file(s) no item names, not read: {', '.join(a.unread[:4])}")
    items = sorted({f.role for f in files})
    a.notes.append(
        f"torch-checkpointing items {', '.join(items)} of {world} rank(s) read"
        + (f"; {TC_METADATA} version {md.get('version', '1.0')}" if md is not None else f"; no {TC_METADATA}")
    )
    return a


register_layout(RankLayout("torch-checkpointing", "torch-checkpointing", _tc_claims, _tc_assemble))


def layout_in_listing(names: list[str]) -> tuple[str, RankLayout, list[RankFile]] | None:
    """The first folder of an object listing (relative names, ``/``-separated, up to 3 levels deep)
    whose objects a per-rank format claims: ``(folder, layout, rank files)``, else ``None``.
    For naming a per-rank checkpoint found below a URL, which ckpttool reads only from a local directory."""
    by_dir: dict[str, list[str]] = {}
    for n in names:
        head, _, base = n.rpartition("/")
        if head.count("/") < 3:
            by_dir.setdefault(head, []).append(base)
    for folder in sorted(by_dir, key=lambda d: (d.count("/") + bool(d), d)):
        listed = sorted(by_dir[folder])
        if ".metadata" in listed:
            continue
        for lay in registered_layouts():
            files = lay.claims(Path(folder or "."), listed)
            if files:
                return folder, lay, files
    return None


def staging_of(path: Path) -> str | None:
    """The name a finished save gets when directory ``path`` is torch-checkpointing's ``tmp_``
    staging directory of a save that did not finish (``CheckpointWriter`` writes every rank's files
    there and renames it after its barrier), else ``None``."""
    if not path.name.startswith(TC_STAGING_PREFIX) or len(path.name) == len(TC_STAGING_PREFIX):
        return None
    found = detect_layout(path)
    if found is None or found[0].name != "torch-checkpointing":
        return None
    return path.name[len(TC_STAGING_PREFIX) :]


def detect_layout(path: Path) -> tuple[RankLayout, list[RankFile]] | None:
    """The per-rank format of directory ``path`` (the registered formats, asked in order) and its
    rank files, or ``None`` (never raises; a directory holding ``.metadata`` is DCP, never per-rank)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    if ".metadata" in names:
        return None
    for lay in registered_layouts():
        files = lay.claims(path, names)
        if files is not None:
            return lay, files
    return None
