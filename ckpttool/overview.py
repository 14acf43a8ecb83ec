"""``inspect``'s library function: a metadata-only overview of a checkpoint.

:func:`build_overview` returns a plain JSON-ready dict whose schema
(``ckpttool.inspect/1``) is documented in ``docs/inspect.md``. It reads
``.metadata``, the small param-group and layout byte items, and the
``extra_state/`` files (``weights_only`` only) — never tensor data.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from .catalog import (
    HYPERPARAMETERS,
    Catalog,
    TensorEntry,
    build_catalog,
    group_by_prefix,
    implied_optimizer_type,
    load_param_groups,
    match_filter,
)
from .dcp.reader import CheckpointReader, load_saved_object
from .errors import CkptError, TrustRequiredError, UsageError

__all__ = ["SCHEMA", "build_overview"]

SCHEMA = "ckpttool.inspect/1"


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    return {
        "key": t.key,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "numel": t.numel,
        "nbytes": t.nbytes,
        "chunks": len(t.chunks),
        "chunk_sizes": [list(c.sizes) for c in t.chunks],
        "ranks": list(t.ranks),
        "uneven": t.uneven,
        "zero_size_chunks": t.zero_size_chunks,
    }


def _plain(value: Any) -> Any:
    """JSON-safe view of a hyperparameter value (tuples -> lists, tensors -> numbers)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and value != value:
        return None
    return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)


def _optimizer_section(cat: Catalog, filt: str | None) -> dict[str, Any]:
    grouped = {p for g in cat.param_groups for p in g.params}
    nested_known = bool(grouped)
    # Param groups name the real parameters (nested: `params` lists; flattened: one group per
    # parameter); model tensors in no group are buffers.
    params = [
        f for f in cat.param_fqns
        if match_filter(f"model.{f}", filt) and (not nested_known or f in grouped or f in cat.optimizer_state)
    ]
    buffers = [f for f in cat.param_fqns if nested_known and f not in grouped and f not in cat.optimizer_state]
    with_state = [f for f in params if f in cat.optimizer_state and cat.optimizer_state[f].fields]
    field_dtypes: dict[str, Counter[str]] = defaultdict(Counter)
    implied: Counter[str] = Counter()
    for fqn in with_state:
        ps = cat.optimizer_state[fqn]
        dt = {}
        for name, t in ps.fields.items():
            dtype = t.dtype if t is not None else "bytes"
            field_dtypes[name][dtype] += 1
            dt[name] = dtype
        kind = implied_optimizer_type(dt)
        implied[kind or "unknown"] += 1
    orphans = sorted(f for f, ps in cat.optimizer_state.items() if not ps.in_model)
    # Param groups: nested groups as they are; flattened ones aggregated by identical values.
    groups_out: list[dict[str, Any]] = []
    if cat.optimizer_flavor == "flattened":
        agg: dict[tuple, dict[str, Any]] = {}
        for g in cat.param_groups:
            fqn = str(g.group_id)
            if not match_filter(f"model.{fqn}", filt):
                continue
            has_state = fqn in cat.optimizer_state and bool(cat.optimizer_state[fqn].fields)
            vals = {h: _plain(g.values.get(h)) for h in (*HYPERPARAMETERS, "initial_lr")}
            sig = (repr(vals), has_state)
            row = agg.get(sig)
            if row is None:
                row = agg[sig] = {"id": fqn, "flavor": "flattened", **vals, "params": 0,
                                  "example_params": [], "has_state": has_state,
                                  "missing": sorted(h for h in HYPERPARAMETERS if h not in g.keys)}
            row["params"] += 1
            if len(row["example_params"]) < 3:
                row["example_params"].append(fqn)
        groups_out = list(agg.values())
    else:
        for g in cat.param_groups:
            members = g.params
            has_state = any(p in cat.optimizer_state and cat.optimizer_state[p].fields for p in members)
            groups_out.append({
                "id": g.group_id, "flavor": g.flavor,
                **{h: _plain(g.values.get(h)) for h in (*HYPERPARAMETERS, "initial_lr")},
                "params": len(members), "example_params": members[:3], "has_state": has_state,
                "missing": sorted(h for h in HYPERPARAMETERS if h not in g.keys),
            })
    never_stepped = sorted(f for f in params if f not in with_state and f in grouped)
    declared = cat.layout.optimizer.get("type") if cat.layout is not None else None
    return {
        "flavor": cat.optimizer_flavor,
        "params_total": len(params),
        "params_with_state": len(with_state),
        "fields": {k: dict(v) for k, v in sorted(field_dtypes.items())},
        "implied_type": implied.most_common(1)[0][0] if implied else None,
        "implied_types": dict(implied),
        "declared_type": declared,
        "param_groups": groups_out,
        "params_without_state": sorted(f for f in params if f not in with_state),
        "never_stepped_with_hyperparameters": never_stepped,
        "orphan_state": orphans,
        "buffers": buffers,
    }


def _extra_state(cat: Catalog, trust_pickle: bool) -> list[dict[str, Any]]:
    out = []
    for f in cat.extra_state:
        row: dict[str, Any] = {"path": f.relative_path, "size": f.size, "rank": f.rank}
        try:
            data = (cat.path / f.relative_path).read_bytes()
            obj = load_saved_object(data, f"{cat.path / f.relative_path}", trust_pickle=trust_pickle)
            row["status"] = "ok"
            row["keys"] = sorted(map(str, obj)) if isinstance(obj, dict) else []
            if isinstance(obj, dict):
                for k in ("global_step", "step", "curr_step"):
                    if isinstance(obj.get(k), int):
                        row["global_step"] = obj[k]
                        break
        except TrustRequiredError:
            row["status"] = "needs --trust-pickle"
        except (CkptError, OSError) as e:
            row["status"] = f"unreadable: {e}"
        out.append(row)
    return out


def build_overview(
    path: str | os.PathLike[str],
    *,
    filter_glob: str | None = None,
    depth: int | None = None,
    sort: str = "name",
    trust_pickle: bool = False,
    declaration: Any = None,
) -> dict[str, Any]:
    """Metadata-only overview of a checkpoint (``ckpttool inspect``).

    Args:
        path: checkpoint directory.
        filter_glob: only tensors whose key matches (see :func:`~ckpttool.catalog.match_filter`).
        depth: also aggregate model tensors by their first ``depth`` key components.
        sort: ``name`` (file order) or ``size`` (largest first) for tensor lists.
        trust_pickle: allow ``weights_only=False`` for byte items / extra state.
        declaration: a :class:`~ckpttool.layouts.declare.LayoutDeclaration` from
            ``--source-layout/--ep-size/--ep-fsdp-size``, or ``None``.

    Returns:
        A JSON-ready dict, schema ``ckpttool.inspect/1`` (``docs/inspect.md``).

    Raises:
        CkptError: unreadable or unsafe checkpoint (metadata, byte items, paths).
        LayoutError: the declaration contradicts the record or the chunk geometry (E404).
    """
    with _gc_paused():
        return _build_overview(path, filter_glob, depth, sort, trust_pickle, declaration)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building ~10^6 acyclic objects (it would rescan them repeatedly)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _build_overview(path: str | os.PathLike[str], filter_glob: str | None, depth: int | None, sort: str,
                    trust_pickle: bool, declaration: Any = None) -> dict[str, Any]:
    from .layouts.declare import resolve_layout
    from .layouts.geometry import ep_geometry

    reader = CheckpointReader(path, trust_pickle=trust_pickle)
    try:
        cat = build_catalog(reader)
        layout_error = None
        resolved = None
        try:
            resolved = resolve_layout(cat, reader, declaration)
        except CkptError as e:
            if declaration is not None:
                raise  # a contradicting declaration is the user's error, not a finding
            layout_error = e.to_dict()
        load_param_groups(cat, reader)
    finally:
        reader.close()
    tensors = cat.tensors
    bytes_by_dtype: Counter[str] = Counter()
    for t in tensors.values():
        bytes_by_dtype[t.dtype] += t.nbytes
    state_bytes = sum(t.nbytes for ps in cat.optimizer_state.values() for t in ps.fields.values() if t)
    model_rows = [t for t in cat.model.values() if match_filter(t.key, filter_glob)]
    if filter_glob and not model_rows and not any(match_filter(k, filter_glob) for k in cat.tensors):
        raise UsageError(f"--filter {filter_glob!r} matches no key of {path}",
                         hint="globs match keys with or without the 'model.' prefix, e.g. 'model.layers.0.*'")
    # Bytes each data file must hold: the end of its last record (metadata only; no data read).
    needed: dict[str, int] = {}
    for info in reader.metadata.storage.values():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, 0):
            needed[info.relative_path] = end
    if sort == "size":
        model_rows.sort(key=lambda t: (-t.nbytes, t.key))
    other_rows = [t for t in cat.other_tensors.values() if match_filter(t.key, filter_glob)]
    layout = None
    if cat.layout is not None:
        rec = cat.layout
        layout = {
            "version": rec.version,
            "layout": rec.layout_name,
            "source": "embedded" if cat.has_layout_item else "sidecar",
            "parallel": rec.parallel,
            "extra_parallel": {
                k: {"ep_dim": s.ep_dim, "fsdp_dim": s.fsdp_dim, "num_experts": s.num_experts}
                for k, s in rec.extra_parallel.items()
            },
            "optimizer": rec.optimizer,
            "global_step": rec.global_step,
        }
    if resolved is not None and (resolved.record is None and resolved.ep_tensors):
        # Unversioned or declared: EP tensors detected by name (docs/layouts.md).
        layout = {
            "version": resolved.version,
            "layout": resolved.layout_name or "unversioned",
            "source": resolved.source,
            "parallel": {"ep_size": resolved.ep_size, "ep_fsdp_size": resolved.ep_fsdp_size}
            if resolved.ep_size is not None else {},
            "extra_parallel": {
                k: {"ep_dim": s.ep_dim, "fsdp_dim": s.fsdp_dim, "num_experts": s.num_experts}
                for k, s in resolved.ep_tensors.items()
            },
            "optimizer": {},
            "global_step": None,
        }
    if layout is not None and resolved is not None:
        layout["ambiguous"] = resolved.ambiguous
        layout["geometry"] = [g.to_json() for g in ep_geometry(cat, resolved)]
    overview: dict[str, Any] = {
        "schema": SCHEMA,
        "path": str(Path(path)),
        "dcp_version": cat.dcp_version,
        "summary": {
            "files": sum(1 for f in cat.data_files if f.referenced),
            "ranks": list(cat.ranks),
            "bytes_on_disk": sum(f.size or 0 for f in cat.data_files),
            "tensor_count": len(tensors),
            "model_tensor_count": len(cat.model),
            "byte_item_count": len(cat.byte_items),
            "numel_model": sum(t.numel for t in cat.model.values()),
            "bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
            "bytes_by_category": {
                "model": sum(t.nbytes for t in cat.model.values()),
                "optimizer_state": state_bytes,
                "other": sum(t.nbytes for t in cat.other_tensors.values()),
            },
        },
        "files": [
            {"path": f.relative_path, "size": f.size, "rank": f.rank, "referenced": f.referenced,
             "needed": needed.get(f.relative_path, 0),
             "status": ("missing" if f.size is None else "short" if f.size < needed.get(f.relative_path, 0)
                        else "ok" if f.referenced else "unreferenced")}
            for f in cat.data_files
        ],
        "model": [_tensor_json(t) for t in model_rows],
        "optimizer": _optimizer_section(cat, filter_glob),
        "layout": layout,
        "layout_error": layout_error,
        "extra_state": _extra_state(cat, trust_pickle),
        "byte_items": [{"key": k, "bytes": n} for k, n in cat.byte_items.items()],
        "other_keys": cat.other_keys,
        "other_tensors": [_tensor_json(t) for t in other_rows],
    }
    if depth:
        tree = group_by_prefix([(t.key, t.numel, t.nbytes) for t in model_rows], depth)
        overview["tree"] = [
            {"prefix": k, "tensors": n, "numel": numel, "nbytes": nbytes} for k, (n, numel, nbytes) in tree.items()
        ]
    return overview
