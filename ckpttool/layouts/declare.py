"""Resolve the EP layout of a checkpoint: embedded record, sidecar, command-line declaration.

Sources, in order of authority (DESIGN.md section 3):

1. the embedded byte item ``layout`` (written in the same ``dcp.save``),
2. the sidecar ``layout.json`` (``ckpttool stamp``),
3. a declaration on the command line (``--source-layout legacy|canonical
   --ep-size P --ep-fsdp-size F``).

Embedded and sidecar must agree (else ``E403``); a declaration must agree with a
record and with the chunk geometry (else ``E404``). Without a record, EP tensors
are detected by name (fused ``...experts.<name>`` tensors with a leading expert
dim) and their EP-FSDP dim is inferred from the chunk geometry; those whose
EP-FSDP dim equals the expert dim are *ambiguous* until declared
(:meth:`ResolvedLayout.require_unambiguous`, ``E405``).

Consumers (``validate``, ``export``, ``replay-step``, ``reshard``)::

    layout = resolve_layout(cat, reader, LayoutDeclaration.from_options(src, p, f))
    layout.require_unambiguous()
    w_true = layout.to_canonical(key, reader.read_tensor(key))   # true expert order
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..catalog import STATE_PREFIX, Catalog, TensorEntry, load_layout
from ..errors import LayoutError, UsageError
from .permute import apply_block_permutation, legacy_to_canonical_perm
from .record import EPTensorSpec, LayoutRecord

if TYPE_CHECKING:
    import torch

    from ..dcp.reader import CheckpointDir

__all__ = [
    "LayoutDeclaration",
    "ResolvedLayout",
    "resolve_layout",
    "detect_ep_tensors",
    "EP_NAME_RE",
    "LAYOUT_VERSIONS",
]

LAYOUT_VERSIONS = {"legacy": 1, "canonical": 2}
# Fused expert tensors (HF transformers v5 Qwen3-MoE / gpt-oss / DeepSeek-V3 naming): the
# component after `experts.` is a parameter name, not a per-expert module index.
EP_NAME_RE = re.compile(r"(?:^|\.)experts\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True)
class LayoutDeclaration:
    """An EP layout declared on the command line.

    Attributes:
        source_layout: ``"legacy"`` or ``"canonical"``.
        ep_size: EP size ``P`` of the saving mesh.
        ep_fsdp_size: EP-FSDP size ``F`` of the saving mesh.
    """

    source_layout: str | None
    ep_size: int | None
    ep_fsdp_size: int | None

    @property
    def version(self) -> int | None:
        return LAYOUT_VERSIONS.get(self.source_layout) if self.source_layout else None

    @classmethod
    def from_options(cls, source_layout: Any, ep_size: int | None, ep_fsdp_size: int | None) -> LayoutDeclaration | None:
        """Build a declaration from ``--source-layout/--ep-size/--ep-fsdp-size``.

        Args:
            source_layout: ``"legacy"``/``"canonical"`` (str or the CLI enum) or ``None``.
            ep_size, ep_fsdp_size: positive ints or ``None``.

        Returns:
            ``None`` when none of the three is given.

        Raises:
            UsageError: a layout without both sizes, sizes without a layout, or bad values.
        """
        if isinstance(source_layout, Enum):
            source_layout = source_layout.value
        if source_layout is None and ep_size is None and ep_fsdp_size is None:
            return None
        if source_layout is None:
            raise UsageError(
                "--ep-size/--ep-fsdp-size given without --source-layout",
                hint="add --source-layout legacy|canonical (the mesh order the checkpoint was saved with)",
            )
        if source_layout not in LAYOUT_VERSIONS:
            raise UsageError(f"--source-layout must be legacy or canonical, got {source_layout!r}",
                             hint="legacy: mesh (EP-FSDP, EP); canonical: mesh (EP, EP-FSDP)")
        if ep_size is None or ep_fsdp_size is None:
            missing = " and ".join(n for n, v in (("--ep-size", ep_size), ("--ep-fsdp-size", ep_fsdp_size)) if v is None)
            raise UsageError(f"--source-layout {source_layout} needs {missing}",
                             hint="declare the saving mesh: --source-layout L --ep-size P --ep-fsdp-size F")
        for name, v in (("--ep-size", ep_size), ("--ep-fsdp-size", ep_fsdp_size)):
            if type(v) is not int or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        return cls(source_layout, ep_size, ep_fsdp_size)


@dataclass(frozen=True)
class ResolvedLayout:
    """The EP layout a command works with.

    Attributes:
        version: 2 canonical, 1 legacy, ``None`` unversioned (no record, no declaration).
        source: ``"embedded"`` | ``"sidecar"`` | ``"declared"`` | ``"none"``.
        record: the layout record, if any.
        ep_size, ep_fsdp_size: ``P`` and ``F`` (``None`` when unknown).
        ep_tensors: checkpoint key -> :class:`EPTensorSpec` (model keys).
        declaration: the command-line declaration, if one was given.
    """

    version: int | None
    source: str
    record: LayoutRecord | None
    ep_size: int | None
    ep_fsdp_size: int | None
    ep_tensors: dict[str, EPTensorSpec]
    declaration: LayoutDeclaration | None = None

    @property
    def layout_name(self) -> str | None:
        """``"canonical"``, ``"legacy"`` or ``None``."""
        return {2: "canonical", 1: "legacy"}.get(self.version) if self.version else None

    @property
    def ambiguous(self) -> list[str]:
        """EP keys whose ``fsdp_dim == ep_dim`` while the version is unknown."""
        if self.version is not None:
            return []
        return [k for k, s in self.ep_tensors.items() if s.fsdp_dim is not None and s.fsdp_dim == s.ep_dim]

    def require_unambiguous(self) -> None:
        """Raise unless every EP tensor's stored order is known.

        Raises:
            LayoutError (E405): unversioned EP tensors sharded on the expert dim by both EP and FSDP.
        """
        amb = self.ambiguous
        if amb:
            more = f" (and {len(amb) - 1} more)" if len(amb) > 1 else ""
            raise LayoutError(
                f"{amb[0]}{more}: EP and EP-FSDP both shard the expert dim and the checkpoint has no layout "
                "record, so the expert order (legacy or canonical) is unknown",
                fqn=amb[0], code="E405",
                hint="declare it with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F "
                     "(or record it once with `ckpttool stamp`)",
            )

    def spec_for(self, key: str) -> EPTensorSpec | None:
        """EP spec of a model key, or of an ``optimizer.state.<fqn>.<field>`` key of an EP parameter."""
        spec = self.ep_tensors.get(key)
        if spec is not None:
            return spec
        if key.startswith(STATE_PREFIX):
            head, _, fld = key[len(STATE_PREFIX):].rpartition(".")
            model_key = f"model.{head}"
            if fld and model_key in self.ep_tensors:
                return self.ep_tensors[model_key]
        return None

    def is_permuted(self, key: str) -> bool:
        """The stored global tensor of ``key`` is block-transposed (legacy, EP and FSDP on one dim, F > 1, P > 1)."""
        spec = self.spec_for(key)
        return (
            spec is not None and self.version == 1 and spec.fsdp_dim == spec.ep_dim
            and (self.ep_size or 1) > 1 and (self.ep_fsdp_size or 1) > 1
        )

    def canonical_perm(self, key: str) -> list[int] | None:
        """Slab-level gather permutation from stored to true expert order, or ``None`` (already true order).

        Raises:
            LayoutError (E405): ``key`` is ambiguous (unversioned, same-dim).
        """
        spec = self.spec_for(key)
        if spec is None:
            return None
        if self.version is None and spec.fsdp_dim == spec.ep_dim and spec.fsdp_dim is not None:
            self.require_unambiguous()
        if not self.is_permuted(key):
            return None
        assert self.ep_size is not None and self.ep_fsdp_size is not None
        p, f = self.ep_size, self.ep_fsdp_size
        return legacy_to_canonical_perm(p * f, p, f)

    def to_canonical(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The stored global tensor of ``key`` in true expert order (``tensor`` itself when already so).

        Args:
            key: model key or optimizer state key of an EP parameter (others pass through).
            tensor: the global tensor as read from the checkpoint (``reader.read_tensor(key)``).

        Raises:
            LayoutError (E405/E406): ambiguous key, or a shape that does not split into ``P*F`` slabs.
        """
        if tensor.dim() == 0:
            return tensor  # a parameter's 0-d `step` is not sharded by expert
        perm = self.canonical_perm(key)
        if perm is None:
            return tensor
        spec = self.spec_for(key)
        assert spec is not None
        return apply_block_permutation(tensor, perm, spec.ep_dim)


def detect_ep_tensors(cat: Catalog) -> dict[str, EPTensorSpec]:
    """EP tensors recognised by name: fused ``...experts.<name>`` with a leading expert dim.

    ``ep_dim`` is 0, ``num_experts`` is ``shape[0]``, ``fsdp_dim`` is inferred from the
    chunks: the other dim split into several intervals, else dim 0 when only dim 0 is
    split (EP and FSDP on one dim, or EP alone: undecidable from metadata), else ``None``.
    """
    from .geometry import _infer_fsdp_dim

    out: dict[str, EPTensorSpec] = {}
    for key, entry in cat.model.items():
        if EP_NAME_RE.search(key) and len(entry.shape) >= 2 and entry.shape[0] >= 1:
            out[key] = EPTensorSpec(ep_dim=0, fsdp_dim=_infer_fsdp_dim(entry, 0), num_experts=entry.shape[0])
    return out


def _check_declaration_against_record(decl: LayoutDeclaration, rec: LayoutRecord, where: str) -> None:
    diffs = []
    if decl.version != rec.version:
        diffs.append(f"layout {decl.source_layout} vs recorded {rec.layout_name} (version {rec.version})")
    if decl.ep_size != rec.ep_size:
        diffs.append(f"--ep-size {decl.ep_size} vs recorded ep_size {rec.ep_size}")
    if decl.ep_fsdp_size != rec.ep_fsdp_size:
        diffs.append(f"--ep-fsdp-size {decl.ep_fsdp_size} vs recorded ep_fsdp_size {rec.ep_fsdp_size}")
    if diffs:
        raise LayoutError(
            f"{where}: the declaration contradicts the layout record: {'; '.join(diffs)}",
            code="E404", hint="drop --source-layout/--ep-size/--ep-fsdp-size (the record is authoritative) or fix them",
        )


def resolve_layout(cat: Catalog, reader: CheckpointDir, declaration: LayoutDeclaration | None = None) -> ResolvedLayout:
    """Reconcile the embedded record, the sidecar and a declaration into one layout.

    Args:
        cat: the catalog (``cat.layout`` is filled as a side effect, like :func:`load_layout`).
        reader: a reader of the same checkpoint (reads the small ``layout`` byte item only).
        declaration: from :meth:`LayoutDeclaration.from_options`, or ``None``.

    Returns:
        The :class:`ResolvedLayout`.

    Raises:
        LayoutError: invalid record (E400-E402), embedded and sidecar disagree (E403), the
            declaration contradicts the record or the chunk geometry (E404).
    """
    from .geometry import tensor_geometry

    rec = load_layout(cat, reader)
    where = str(cat.path)
    if rec is not None:
        if declaration is not None:
            _check_declaration_against_record(declaration, rec, where)
        source = "embedded" if cat.has_layout_item else "sidecar"
        ep = dict(rec.extra_parallel)
        return ResolvedLayout(rec.version, source, rec, rec.ep_size, rec.ep_fsdp_size, ep, declaration)
    if declaration is None:
        ep = detect_ep_tensors(cat)
        return ResolvedLayout(None, "none", None, None, None, ep, None)
    ep = detect_ep_tensors(cat)
    for key, spec in ep.items():
        entry: TensorEntry = cat.model[key]
        geo = tensor_geometry(entry, key, spec, version=declaration.version, ep_size=declaration.ep_size,
                              ep_fsdp_size=declaration.ep_fsdp_size)
        if geo.problems:
            raise LayoutError(
                f"{key}: the declared layout ({declaration.source_layout}, ep_size {declaration.ep_size}, "
                f"ep_fsdp_size {declaration.ep_fsdp_size}) contradicts the chunk geometry: {geo.problems[0]}",
                fqn=key, code="E404",
                hint="check the mesh sizes of the job that saved the checkpoint (`ckpttool inspect` shows the chunks)",
            )
    return ResolvedLayout(declaration.version, "declared", None, declaration.ep_size, declaration.ep_fsdp_size, ep,
                          declaration)
