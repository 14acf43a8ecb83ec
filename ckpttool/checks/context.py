"""What the rules look at: the opened checkpoint, its catalog, layout, config, reference and deep results.

:func:`build_context` opens the checkpoint once and gathers everything the rules
need, turning every :class:`~ckpttool.errors.CkptError` it meets on the way into
recorded state (``metadata_error``, ``byte_item_errors``, ``layout_error``, ...)
instead of raising, so that a damaged checkpoint yields findings, not a crash.
Only bad invocations (a path that is not a directory, an unreadable ``--config``
or ``--against``) raise.

Reads: ``.metadata``, a directory listing, the small param-group and ``layout``
byte items, the ``extra_state/*.pt`` files (``weights_only``), and with
``--deep`` every data byte once (:mod:`ckpttool.checks.deep`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..catalog import HYPERPARAMETERS, Catalog, ParamGroup, build_catalog
from ..dcp.model import TensorMeta
from ..dcp.reader import CheckpointReader, load_saved_object
from ..errors import CkptError, DataFileError, MetadataError, PathEscapeError, UsageError
from .reference import Reference

if TYPE_CHECKING:
    from ..layouts.declare import LayoutDeclaration, ResolvedLayout
    from .deep import DeepResult

__all__ = ["Context", "build_context", "load_config", "config_value", "GROUP_ITEMS"]

#: Param-group items the rules read (``params``: nested flavor membership).
GROUP_ITEMS = (*HYPERPARAMETERS, "initial_lr", "params")

# Last key components that name parameters (nn.Linear/Embedding/Norm, fused experts).
_PARAM_NAMES = frozenset({
    "weight", "bias", "gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3",
    "gate_up_proj_bias", "down_proj_bias",
})
_INDEX_RE = re.compile(r"\.\d+\.")
_LAYER_RE = re.compile(r"^(.*?\.\d+)\.")


def _layer_of(fqn: str) -> str | None:
    """The key prefix up to the first numeric component (``model.layers.3``), or ``None``."""
    m = _LAYER_RE.match(fqn)
    return m.group(1) if m else None


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an HF ``config.json`` (a file, or a directory holding one).

    Raises:
        UsageError: missing, unreadable or not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"--config {p}: cannot read ({e.strerror})", path=p,
                         hint="pass the model's config.json (or the directory holding it)") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {p}: not valid JSON ({e})", path=p, hint="pass an HF config.json") from e
    if not isinstance(obj, dict):
        raise UsageError(f"--config {p}: expected a JSON object, got {type(obj).__name__}", path=p,
                         hint="pass an HF config.json")
    return obj


def config_value(cfg: dict[str, Any] | None, *names: str) -> Any:
    """First of ``names`` found in ``cfg`` or its ``text_config`` (multimodal HF configs), else ``None``."""
    if not cfg:
        return None
    for scope in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None):
        if scope:
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


@dataclass
class Context:
    """Everything the rules read (see module docstring).

    Attributes:
        path: the checkpoint directory.
        reader: open reader (``None`` when ``.metadata`` is unusable).
        cat: the catalog (``None`` when ``.metadata`` is unusable).
        metadata_error: why ``.metadata`` is unusable.
        deep, strict: command options.
        config: HF config dict (``--config``) or ``None``.
        reference: ``--against`` reference or ``None``.
        layout: the resolved EP layout (``None`` when it could not be resolved).
        layout_error: why it could not be resolved.
        byte_item_errors: byte-item key -> error met while reading it.
        extra_state_errors: ``extra_state`` relative path -> error met while loading it.
        deep_result: per-tensor statistics of the ``--deep`` pass.
    """

    path: Path
    reader: CheckpointReader | None = None
    cat: Catalog | None = None
    metadata_error: CkptError | None = None
    deep: bool = False
    strict: bool = False
    config: dict[str, Any] | None = None
    reference: Reference | None = None
    declaration: LayoutDeclaration | None = None
    layout: ResolvedLayout | None = None
    layout_error: CkptError | None = None
    byte_item_errors: dict[str, CkptError] = field(default_factory=dict)
    extra_state_errors: dict[str, CkptError] = field(default_factory=dict)
    deep_result: DeepResult | None = None
    workers: int | None = None
    _file_errors: dict[str, CkptError | None] = field(default_factory=dict)
    _params: dict[str, bool] | None = None
    _group_index: dict[str, ParamGroup] | None = None
    _storage_items: list[tuple[str, Any, Any]] | None = None
    _optimized: set[str] = field(default_factory=set)
    _patterns: set[str] = field(default_factory=set)
    _layers: set[str] = field(default_factory=set)
    _modules: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ storage helpers
    def file_error(self, relative_path: str) -> CkptError | None:
        """Why a referenced data file cannot be used (escaping path, missing), or ``None``."""
        if relative_path not in self._file_errors:
            err: CkptError | None = None
            try:
                assert self.reader is not None
                self.reader.file_size(relative_path)
            except (PathEscapeError, DataFileError) as e:
                err = e
            self._file_errors[relative_path] = err
        return self._file_errors[relative_path]

    def storage_ok(self, fqn: str, chunk: Any = None) -> bool:
        """The chunk/byte item has a storage entry inside an existing file, within its bounds."""
        assert self.reader is not None
        try:
            self.reader.storage_info(fqn, chunk)
        except CkptError:
            return False
        return True

    # ------------------------------------------------------------------ optimizer helpers
    @property
    def has_optimizer(self) -> bool:
        assert self.cat is not None
        return bool(self.cat.optimizer_state or self.cat.param_groups)

    def group_of(self, fqn: str) -> ParamGroup | None:
        """Param group holding ``fqn`` (nested: its ``params`` list; flattened: its own group)."""
        assert self.cat is not None
        if self._group_index is None:
            index: dict[str, ParamGroup] = {}
            for g in self.cat.param_groups:
                if g.flavor == "flattened":
                    index.setdefault(str(g.group_id), g)
                for p in g.params:
                    index.setdefault(p, g)
            self._group_index = index
        return self._group_index.get(fqn)

    def storage_items(self) -> list[tuple[str, Any, Any]]:
        """``(key, chunk or None, StorageInfo or None)`` of every non-empty chunk and byte item (cached)."""
        if self._storage_items is None:
            assert self.reader is not None
            md = self.reader.metadata
            items: list[tuple[str, Any, Any]] = []
            for key, meta in md.entries.items():
                if isinstance(meta, TensorMeta):
                    items.extend((key, c, md.storage.get((key, c.offsets))) for c in meta.chunks if 0 not in c.sizes)
                else:
                    items.append((key, None, md.storage.get((key, None))))
            self._storage_items = items
        return self._storage_items

    def lost_hyperparameters(self, fqn: str) -> bool:
        """Is there evidence that ``fqn`` is an optimized parameter although it has no state and no group?

        A model tensor outside every param group is normally frozen or a buffer. It counts as
        an optimized parameter that lost its hyperparameters when either

        - the tensor of the same name in another layer/expert is optimized *and* some tensor
          of its own layer is optimized (so the layer is not frozen), or
        - its name is a parameter name (``weight``, ``bias``, fused expert weights) and
          another tensor of the same module is optimized.

        Frozen layers/modules, LoRA base weights and buffers (``inv_freq``,
        ``e_score_correction_bias``, 0-d scales) give no such evidence.
        """
        assert self.cat is not None
        if self._params is None:
            grouped = {p for g in self.cat.param_groups for p in g.params}
            grouped |= {str(g.group_id) for g in self.cat.param_groups if g.flavor == "flattened"}
            optimized = {f for f in self.cat.param_fqns
                         if f in grouped or (f in self.cat.optimizer_state and self.cat.optimizer_state[f].fields)}
            self._optimized = optimized
            self._patterns = {_INDEX_RE.sub(".#.", f) for f in optimized}
            self._layers = {_layer_of(f) for f in optimized} - {None}
            self._modules = {f.rpartition(".")[0] for f in optimized}
            self._params = {}
        if fqn in self._optimized:
            return False
        hit = self._params.get(fqn)
        if hit is None:
            layer = _layer_of(fqn)
            by_pattern = (_INDEX_RE.sub(".#.", fqn) in self._patterns and layer is not None and layer in self._layers)
            by_module = fqn.rsplit(".", 1)[-1] in _PARAM_NAMES and fqn.rpartition(".")[0] in self._modules
            hit = self._params[fqn] = by_pattern or by_module
        return bool(hit)

    def group_sets(self) -> list[tuple[str, list[str]]]:
        """Parameters that share one param group, as ``(label, fqns)``.

        Nested flavor: each group's ``params``. Flattened flavor (hyperparameters repeated per
        parameter, leaf optimizers not recorded): parameters with identical hyperparameter
        values (``lr``, ``betas``, ``eps``, ``weight_decay``, ``initial_lr``) form one group.
        """
        assert self.cat is not None
        out: list[tuple[str, list[str]]] = []
        flat: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for g in self.cat.param_groups:
            if g.flavor == "nested":
                out.append((f"param group {g.group_id}", list(g.params)))
            else:
                vals = {h: g.values.get(h) for h in (*HYPERPARAMETERS, "initial_lr")}
                flat.setdefault(repr(vals), (vals, []))[1].append(str(g.group_id))
        for vals, fqns in flat.values():
            out.append((f"flattened group with lr={vals['lr']!r}, weight_decay={vals['weight_decay']!r}", fqns))
        return out


def _load_groups(ctx: Context) -> None:
    """Read the param-group items the rules need, recording (not raising) read errors."""
    assert ctx.cat is not None and ctx.reader is not None
    for g in ctx.cat.param_groups:
        for hyper, key in g.keys.items():
            if hyper not in GROUP_ITEMS:
                continue
            try:
                value = ctx.reader.read_object(key)
            except CkptError as e:
                ctx.byte_item_errors[key] = e
                continue
            if hyper == "params":
                if isinstance(value, (list, tuple)):
                    g.params = [str(v) for v in value]
            else:
                g.values[hyper] = value


def _load_extra_state(ctx: Context, trust_pickle: bool) -> None:
    assert ctx.cat is not None
    for f in ctx.cat.extra_state:
        p = ctx.path / f.relative_path
        try:
            load_saved_object(p.read_bytes(), str(p), trust_pickle=trust_pickle)
        except CkptError as e:
            ctx.extra_state_errors[f.relative_path] = e
        except OSError as e:
            ctx.extra_state_errors[f.relative_path] = DataFileError(f"{p}: cannot read ({e.strerror})", path=p)


def build_context(
    path: str | os.PathLike[str],
    *,
    deep: bool = False,
    strict: bool = False,
    config: dict[str, Any] | None = None,
    reference: Reference | None = None,
    declaration: LayoutDeclaration | None = None,
    trust_pickle: bool = False,
    workers: int | None = None,
) -> Context:
    """Open a checkpoint and gather what the rules need (see module docstring).

    Raises:
        UsageError: ``path`` is not a directory.
    """
    ctx = Context(Path(path), deep=deep, strict=strict, config=config, reference=reference,
                  declaration=declaration, workers=workers)
    try:
        ctx.reader = CheckpointReader(path, trust_pickle=trust_pickle)
    except UsageError:
        raise
    except MetadataError as e:  # includes unsafe pickle and incomplete saves
        ctx.metadata_error = e
        return ctx
    ctx.cat = build_catalog(ctx.reader)
    _load_groups(ctx)
    _load_extra_state(ctx, trust_pickle)
    from ..layouts.declare import resolve_layout

    try:
        ctx.layout = resolve_layout(ctx.cat, ctx.reader, declaration)
    except CkptError as e:
        ctx.layout_error = e
    return ctx
