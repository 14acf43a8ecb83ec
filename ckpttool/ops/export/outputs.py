"""The output-format plug-in interface: what ``export --format NAME`` selects, writes and copies.

An :class:`OutputFormat` owns, for one format: which checkpoint tensors it selects and their
output names (:meth:`~OutputFormat.select`), the output tensors each source becomes (one or
several :class:`~ckpttool.ops.export.plan.Piece` s: :meth:`~OutputFormat.pieces_planner`), how
they are packed into files and how the files are named, the index / config documents it writes
beside them (:meth:`~OutputFormat.documents`), and which ``--model-assets`` files it copies or
edits (:meth:`~OutputFormat.skips_asset`, :meth:`~OutputFormat.edited_assets`: e.g. a
``quantization_config`` added to ``config.json``). Formats are registered by name
(:func:`register_format`, :data:`OUTPUT_FORMATS`); the ``--format`` choices, ``--help``, the
docs table and the ``format`` enum of ``ckpttool.export/1`` come from the registry. The built-in
formats (:mod:`ckpttool.ops.export.formats`: ``hf``, ``lora``, ``hf-merged``) register themselves
when ``ckpttool.ops.export`` is imported. This module imports nothing heavy (the CLI reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpttool.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from ckpttool.format.reader import CheckpointReader
    from ckpttool.model.adapters import AdapterConfig, ModelAdapter
    from ckpttool.model.catalog import Catalog
    from ckpttool.ops.export.plan import ExportPlan, Piece, Selected, SelectResult
    from ckpttool.ops.export.rules import ExportRules
    from ckpttool.ops.export.transform import Run, SlabTransform

__all__ = [
    "OUTPUT_FORMATS",
    "OutputFormat",
    "PieceContext",
    "PrepareRequest",
    "SelectRequest",
    "PiecesFn",
    "SourcePieces",
    "format_help",
    "get_format",
    "register_format",
    "unregister_format",
]

#: ``(pieces, runs, expert_order, counted)`` of one source: its output tensors, the explicit element
#: runs (``None``: derived from the pieces), the stored position of each true expert (``None``: identity)
#: and the output names it counts in ``casts`` / ``origins`` (a fused tensor shared by sources counts once).
SourcePieces = tuple["tuple[Piece, ...]", "tuple[Run, ...] | None", "tuple[int, ...] | None", "list[str]"]


#: ``fn(selected, dtype, ctx)`` -> the :data:`SourcePieces` of one source (:meth:`OutputFormat.pieces_planner`).
PiecesFn = Callable[["Selected", str, "PieceContext"], SourcePieces]


@dataclass(frozen=True)
class PieceContext:
    """What :meth:`OutputFormat.pieces_planner`'s function needs besides the source (the options of ``build_plan``).

    Attributes:
        rules: the expert split rules.
        per_expert: ``--experts per-expert``.
        orders: model key -> stored position of each true expert (legacy EP un-permutation).
        num_experts: expected expert count (``--model-assets`` config), checked against dim 0.
        model_names: filled by the planning: output name -> the model's own key, where a per-expert export
            names a tensor as the family's ``save_pretrained`` does (:func:`~ckpttool.ops.export.plan.saved_names`).
    """

    rules: ExportRules
    per_expert: bool
    orders: dict[str, tuple[int, ...]]
    num_experts: int | None
    model_names: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SelectRequest:
    """What :meth:`OutputFormat.select` chooses from: the catalog, the key rules and the export's choices.

    Attributes:
        cat: the checkpoint's catalog.
        rules: the export key rules (YAML defaults or ``--rules``).
        weights: ``"params"`` or ``"master"`` (the FP32 master weights of the optimizer state).
        filter_glob: ``--filter``, or ``None``.
        adapter: the model adapter naming the tensors, or ``None``.
        adapter_config: its configuration, or ``None``.
        peft_config: a given PEFT ``adapter_config.json`` (``--adapter-config`` / ``--model-assets``), or ``None``.
        model_config: the model's ``config.json`` where its model class names the keys (the key rules' note on
            keys outside the HF naming leaves out the class's own names), or ``None``.
    """

    cat: Catalog
    rules: ExportRules
    weights: str
    filter_glob: str | None
    adapter: ModelAdapter | None
    adapter_config: AdapterConfig | None
    peft_config: dict[str, Any] | None = None
    model_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class PrepareRequest:
    """What :meth:`OutputFormat.prepare` and :meth:`OutputFormat.transforms` see, once the plan is made.

    Attributes:
        plan: the export plan.
        cat: the checkpoint's catalog.
        reader: the checkpoint's reader (value transforms read LoRA factors through it).
        given: the ``adapter_config.json`` given (``--adapter-config`` / ``--model-assets``), or ``None``.
        lora_alpha: ``--lora-alpha``, or ``None``.
        model_config: the ``--model-assets`` ``config.json``, or ``None``.
        config_beside: the ``adapter_config.json`` saved in the checkpoint's (model) folder (NeMo Automodel's PEFT
            save writes one beside ``adapter_model.safetensors``), named by the error that asks for ``lora_alpha``;
            ``None`` when there is none or one is given.
    """

    plan: ExportPlan
    cat: Catalog
    reader: CheckpointReader
    given: dict[str, Any] | None
    lora_alpha: float | None
    model_config: dict[str, Any] | None
    config_beside: Path | None = None


class OutputFormat:
    """One ``--format``. :meth:`check_names`, :meth:`select`, :meth:`pieces_planner` and :meth:`file_names`
    have no default here (:class:`ckpttool.ops.export.formats.base.ModelFormat` gives the key rules'
    ones); the other hooks default to a plain safetensors export (no documents, assets copied).

    Attributes:
        name: the ``--format`` choice and the ``format`` value of ``ckpttool.export/1``.
        help: what it writes, one line (``--help`` and the docs table).
        tensors_noun: what it exports, for "no ... to export".
        reads_adapter_config: reads ``--adapter-config`` / ``--model-assets``' ``adapter_config.json``.
        detects_model_adapter: detects a model adapter from the key names when none is given.
        ties_embeddings: honours the config's ``tie_word_embeddings`` (``lm_head`` left out when tied).
        checks_model_class: compares the output with the model class ``config.json`` builds (:mod:`.expected`).
    """

    name = ""
    help = ""
    tensors_noun = "model tensors"
    reads_adapter_config = False
    detects_model_adapter = False
    ties_embeddings = False
    checks_model_class = False

    # -- options and selection -------------------------------------------------------------------
    def check_options(self, experts: str) -> None:
        """Refuse options this format cannot honour (``UsageError``)."""

    def check_model_adapter(self, adapter: ModelAdapter) -> None:
        """Refuse a model adapter given with ``--adapter`` that this format cannot apply (``UsageError``)."""

    def check_names(self, cat: Catalog, adapter: ModelAdapter | None) -> None:
        """Refuse model names this format has no output names for (``ExportError`` / ``ExportNamingError``)."""
        raise NotImplementedError

    def select(self, req: SelectRequest) -> SelectResult:
        """``(selected, warnings, skipped, tags)``: the tensors to export and their output keys."""
        raise NotImplementedError

    def check_selection(self, cat: Catalog, tags: dict[str, str], warnings: list[str]) -> None:
        """Refuse (``ExportError``) or warn about a selection before it is planned (``tags``: from :meth:`select`)."""

    # -- planning --------------------------------------------------------------------------------
    def pieces_planner(self) -> PiecesFn:
        """The function giving each source's output tensors: ``fn(selected, dtype, ctx)`` (called per source;
        one or several pieces, e.g. a weight and its scales)."""
        raise NotImplementedError

    def starts_file(self, packed: int, nbytes: int, shard_size: int) -> bool:
        """Whether a source of ``nbytes`` starts a new file after one holding ``packed`` bytes."""
        return packed > 0 and packed + nbytes > shard_size

    def file_names(self, n: int) -> list[str]:
        """The names of ``n`` output files, in order."""
        raise NotImplementedError

    # -- writing ---------------------------------------------------------------------------------
    def prepare(self, req: PrepareRequest) -> dict[str, Any] | None:
        """Checked before any output exists; the result is ``ExportResult.adapter_config`` (LoRA)."""
        return None

    def transforms(self, req: PrepareRequest) -> dict[str, SlabTransform]:
        """Source key -> the value transform that replaces its cast (a LoRA merge); none by default."""
        return {}

    def check_written(self, transforms: dict[str, SlabTransform], plan: ExportPlan) -> None:
        """After this process's writes: refuse or warn about what :meth:`transforms` did."""

    def documents(self, plan: ExportPlan, prepared: dict[str, Any] | None) -> dict[str, bytes]:
        """File name -> content written beside the tensor files by one process (an index, an adapter config)."""
        return {}

    def skips_asset(self, name: str) -> bool:
        """Whether the ``--model-assets`` file ``name`` is not copied (``adapter_*`` never is)."""
        return name.startswith("adapter_")

    def edited_assets(self, model_config: dict[str, Any] | None) -> dict[str, bytes]:
        """``--model-assets`` file name -> the content written instead of a copy (e.g. an edited ``config.json``)."""
        return {}


#: name -> the registered output format, in registration order (the order ``--format`` lists them).
OUTPUT_FORMATS: dict[str, OutputFormat] = {}


def register_format(fmt: OutputFormat) -> OutputFormat:
    """Register output format ``fmt`` under ``fmt.name`` (once per name); returns it."""
    assert fmt.name and fmt.name not in OUTPUT_FORMATS, f"output format {fmt.name!r} registered twice"
    OUTPUT_FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a registered output format (a plug-in's tests)."""
    del OUTPUT_FORMATS[name]


def get_format(name: str) -> OutputFormat:
    """The registered output format ``name``.

    Raises:
        UsageError: not a registered format (the message lists them).
    """
    fmt = OUTPUT_FORMATS.get(name)
    if fmt is None:
        raise UsageError(f"`fmt` {name!r} is not one of {', '.join(OUTPUT_FORMATS)}", param="fmt")
    return fmt


def format_help() -> str:
    """``--format``'s help: ``name: what it writes`` of every registered format, ``; ``-separated."""
    return "; ".join(f"{f.name}: {f.help}" for f in OUTPUT_FORMATS.values()) + "."
