"""``ckpttool export DIR OUT``: Hugging Face safetensors (sharded + index) or a PEFT LoRA adapter."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpttool.errors import UsageError, shell_arg
from ckpttool.model.adapters import adapter_metavar
from ckpttool.ops.export.outputs import OUTPUT_FORMATS, format_help
from ckpttool.ui.options import (
    CheckpointArg,
    DryRunOpt,
    EpFsdpSizeOpt,
    EpSizeOpt,
    FilterOpt,
    JsonOpt,
    ModelPrefixOpt,
    NoEpOpt,
    OptimizerDirOpt,
    OptimizerPrefixOpt,
    OutputArg,
    OutputHashOpt,
    OverwriteOpt,
    SchemaOpt,
    SourceLayoutOpt,
    StepOpt,
    TrustPickleOpt,
    VerifyCrcOpt,
    declaration,
    dtype_aliases_help,
    examples,
    given_path,
    parse_dtype,
    parse_size,
    selection,
)
from ckpttool.ui.output import Output, command_boundary, with_flags

if TYPE_CHECKING:
    from ckpttool.ops.export import ExportOptions, ExportResult


#: the registered output formats (:mod:`ckpttool.ops.export.formats`), as ``--format`` choices
ExportFormat = Enum(  # type: ignore[misc]  # built from the registry
    "ExportFormat", {name.replace("-", "_"): name for name in OUTPUT_FORMATS}, type=str
)


class Weights(str, Enum):
    params = "params"
    master = "master"
    auto = "auto"


class Experts(str, Enum):
    fused = "fused"
    per_expert = "per-expert"


@dataclass(frozen=True)
class ExportCLIOptions:
    """The flags of ``ckpttool export`` as parsed (one field per parameter; the Typer declarations are the types)."""

    checkpoint: CheckpointArg
    out: OutputArg
    fmt: Annotated[ExportFormat, typer.Option("--format", help=format_help())] = ExportFormat("hf")
    save_dtype: Annotated[
        str,
        typer.Option(
            "--save-dtype",
            metavar="<preserve|bfloat16|float16|float32>",
            help="preserve: each tensor in its stored dtype, bit-exact; else cast floating tensors only "
            f"({dtype_aliases_help(('bfloat16', 'float16', 'float32'))}).",
        ),
    ] = "preserve"
    weights: Annotated[
        Weights | None,
        typer.Option(
            "--weights",
            help="params: stored parameters; master: FP32 optimizer master_weight where present; auto: master "
            "when the checkpoint has any [default: params; with --quantize: auto].",
        ),
    ] = None
    shard_size: Annotated[
        str,
        typer.Option(
            "--shard-size", metavar="SIZE", help="Max bytes per file: 5GB (5*10^9), 5GiB or 5G (5*2^30), or bytes."
        ),
    ] = "5GB"
    experts: Annotated[
        Experts | None,
        typer.Option(
            "--experts",
            help="fused: experts.gate_up_proj [E,2I,H] as stored (transformers v5); per-expert: experts.{j}.*_proj.weight "
            "[default: fused; with --quantize: per-expert, the FP8 layout vLLM reads].",
        ),
    ] = None
    rules: Annotated[
        Path | None,
        typer.Option(
            "--rules",
            help="YAML key/expert rules merged over the packaged defaults (docs/export.md).",
            parser=given_path,
        ),
    ] = None
    model_assets: Annotated[
        Path | None,
        typer.Option(
            "--model-assets",
            help="Directory with config.json / tokenizer files to copy (config drives tied embeddings and num_experts).",
            parser=given_path,
        ),
    ] = None
    filter_glob: FilterOpt = None
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="Reader threads [default: min(8, CPUs)].")] = (
        None
    )
    overwrite: OverwriteOpt = False
    dry_run: DryRunOpt = False
    json_output: JsonOpt = False
    source_layout: SourceLayoutOpt = None
    ep_size: EpSizeOpt = None
    ep_fsdp_size: EpFsdpSizeOpt = None
    adapter_config: Annotated[
        Path | None,
        typer.Option(
            "--adapter-config",
            help="LoRA: adapter_config.json to write (default: --model-assets' or inferred).",
            parser=given_path,
        ),
    ] = None
    lora_alpha: Annotated[
        float | None, typer.Option("--lora-alpha", help="LoRA: lora_alpha when no adapter config is given.")
    ] = None
    trust_pickle: TrustPickleOpt = False
    no_ep: NoEpOpt = False
    step: StepOpt = None
    optimizer_dir: OptimizerDirOpt = None
    schema: SchemaOpt = None
    model_prefix: ModelPrefixOpt = None
    optimizer_prefix: OptimizerPrefixOpt = None
    verify_crc: VerifyCrcOpt = True
    manifest: Annotated[
        bool,
        typer.Option(
            "--manifest",
            help="Also write OUT/manifest.json: a digest of every byte range as it is written (no second read); verify with `ckpttool manifest OUT --verify`.",
        ),
    ] = False
    hash_name: OutputHashOpt = "xxh3-128"
    adapter: Annotated[
        str | None,
        typer.Option(
            "--adapter",
            metavar=adapter_metavar(),
            help="Model adapter (names and layouts to HF, e.g. the RoPE q/k row permutation) "
            "[default: detected from the key names].",
        ),
    ] = None
    merge_lora: Annotated[
        bool,
        typer.Option(
            "--merge-lora",
            help="Same as --format hf-merged: W + s·B@A in FP32 (s = alpha/r, alpha/sqrt(r) with rsLoRA), stored dtype.",
        ),
    ] = False
    allow_mismatch: Annotated[
        str | None,
        typer.Option(
            "--allow-mismatch",
            metavar="KINDS",
            help="Write even if the tensors differ from the model class transformers builds from config.json: "
            "comma list of missing, unexpected, shape, dtype.",
        ),
    ] = None
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            metavar="<fp8-block|fp8-channel>",
            help="fp8-block: 2-D *.weight as float8_e4m3fn + a float32 scale per block (DeepSeek-V3, vLLM fp8); "
            "fp8-channel: a scale per output row (--quant-format compressed-tensors); embeddings, norms, lm_head, "
            "router gates stay unquantized, in --save-dtype (preserve: bfloat16 here).",
        ),
    ] = None
    quantize_block: Annotated[
        int, typer.Option("--quantize-block", min=1, metavar="N", help="FP8 block size of fp8-block (N x N blocks).")
    ] = 128
    quantize_skip: Annotated[
        list[str] | None,
        typer.Option("--quantize-skip", metavar="GLOB", help="Output keys left unquantized (repeatable)."),
    ] = None
    quant_format: Annotated[
        str,
        typer.Option(
            "--quant-format",
            metavar="<fp8|compressed-tensors>",
            help="fp8: weight_scale_inv + quant_method fp8 (DeepSeek-V3); compressed-tensors: weight_scale + "
            "llm-compressor's float-quantized config_groups and ignore list.",
        ),
    ] = "fp8"


@command_boundary
def run_export(cli: ExportCLIOptions) -> None:
    """Export model weights as Hugging Face safetensors or a LoRA adapter (streaming, bit-exact by default)."""
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import run_writing
    from ckpttool.ops.export import export_checkpoint, masters_note
    from ckpttool.ui.render import PhaseProgress

    decl = declaration(cli.source_layout, cli.ep_size, cli.ep_fsdp_size, cli.no_ep)
    sel = selection(cli.step, cli.optimizer_dir, cli.schema, cli.model_prefix, cli.optimizer_prefix)
    options = export_options(cli)
    # phases named on stderr (opening, planning, building model class ..., writing); the byte bar from its total on
    with PhaseProgress.on_stderr("export", not cli.json_output and sys.stderr.isatty()) as shown:
        if shown is not None:
            shown.phase(f"opening {cli.checkpoint}")
        result, masters = run_writing(
            export_checkpoint,
            cli.checkpoint,
            cli.out,
            options,
            opening=OpenOptions(declaration=decl, trust_pickle=cli.trust_pickle, selection=sel),
            progress=lambda: contextlib.nullcontext(shown.progress if shown is not None else None),
            phase=shown.phase if shown is not None else None,
            note=masters_note,
            hold_gc=True,
        )
    sink = Output(cli.json_output)
    for w in result.warnings:
        sink.warning(w)
    if masters:
        sink.note(masters)
    for n in result.notes:
        sink.note(n)
    # a folder from_pretrained cannot load (--json says so by its `assets`, with no note beside the document)
    if not cli.json_output and result.format != "lora" and "config.json" not in result.assets:
        held = f"{result.output} {'would hold' if result.dry_run else 'holds'} no config.json"
        needs = "transformers' from_pretrained needs one" + (
            f" (and the {cli.quantize} weights' quantization_config goes into it: vLLM cannot load them without it)"
            if cli.quantize is not None
            else ""
        )
        beside = shell_arg(result.config_beside) if result.config_beside else None
        sink.note(
            f"{held} (no --model-assets): {needs}; pass --model-assets DIR, the folder of the model's config.json "
            "and tokenizer files"
            + (f" ({_saved_with(result.config_beside)}: --model-assets {beside})" if result.config_beside else "")
            if cli.model_assets is None
            else f"{held} ({cli.model_assets} has none): {needs}; copy the model's config.json into {cli.model_assets}"
        )
    sink.result(result, _render)


def _saved_with(folder: str) -> str:
    """How the note names the folder of a ``config.json`` found with the checkpoint (``config_beside``)."""
    if Path(folder).name in ("model_assets", "consolidated", ".hf_metadata", "huggingface"):
        return "the trainer saved one beside the checkpoint"
    return "the checkpoint's folder holds one"


#: The flags that are :class:`~ckpttool.ops.export.ExportOptions` fields of the same name and value.
_PASSED_ON = (
    "rules",
    "model_assets",
    "filter_glob",
    "workers",
    "overwrite",
    "verify_crc",
    "adapter_config",
    "manifest",
    "adapter",
    "dry_run",
    "quantize",
    "quantize_block",
    "quant_format",
)


def export_options(cli: ExportCLIOptions) -> ExportOptions:
    """The library's :class:`~ckpttool.ops.export.ExportOptions` of the parsed flags.

    Raises:
        UsageError: a ``--save-dtype`` or ``--shard-size`` that does not parse; ``--merge-lora`` with ``--format lora``.
    """
    from ckpttool.ops.export import ExportOptions
    from ckpttool.ops.fields import same_named

    if cli.merge_lora and cli.fmt.value == "lora":  # one would silently win: --merge-lora, merging the adapter
        raise UsageError(
            "--merge-lora (= --format hf-merged) and --format lora are exclusive",
            hint="--format lora writes the PEFT adapter as it is; --merge-lora merges it into the base weights: "
            "give one",
        )
    alpha: float | int | None = cli.lora_alpha
    if alpha is not None and float(alpha).is_integer():
        alpha = int(alpha)
    return ExportOptions(
        fmt="hf-merged" if cli.merge_lora else cli.fmt.value,
        save_dtype=parse_dtype(
            cli.save_dtype,
            "--save-dtype",
            ("bfloat16", "float16", "float32"),
            extra=("preserve",),
            float8_hint="an FP8 export is --quantize fp8-block (or fp8-channel): float8_e4m3fn weights with float32 "
            "scales (docs/export.md)",
        ),
        weights=cli.weights.value if cli.weights is not None else None,
        shard_size=parse_size(cli.shard_size, "--shard-size"),
        experts=cli.experts.value if cli.experts is not None else None,
        lora_alpha=alpha,
        algorithm=cli.hash_name,
        allow_mismatch=tuple(k.strip() for k in (cli.allow_mismatch or "").split(",") if k.strip()),
        quantize_skip=tuple(cli.quantize_skip or ()),
        **same_named(cli, *_PASSED_ON),
    )


def _typer_command(options_type: type[Any], run: Callable[[Any], None]) -> Callable[..., None]:
    """A Typer command whose parameters are ``options_type``'s dataclass fields (their Annotated types and
    defaults): it calls ``run(options_type(**params))``; its docstring (the command's help) is ``run``'s."""
    hints = typing.get_type_hints(options_type, include_extras=True)
    params = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            annotation=hints[f.name],
        )
        for f in dataclasses.fields(options_type)
    ]

    def command(**kwargs: Any) -> None:
        run(options_type(**kwargs))

    command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = run.__doc__
    command.__name__ = command.__qualname__ = getattr(run, "__name__", "command")
    return command


def _render(r: ExportResult) -> None:
    """Human summary on stdout (the console escapes control characters and never interprets markup)."""
    from ckpttool.ui.render import Col, fmt_rate, fmt_seconds, human_bytes, plural, print_table, stdout_console

    con = stdout_console()
    if r.dry_run:  # --dry-run: the plan, nothing written (file bytes: tensor data, headers not yet known)
        con.print(
            f"dry run: would export {plural(r.tensors, 'tensor')}, {human_bytes(r.bytes)} in "
            f"{plural(len(r.files), 'file')} to {r.output}; nothing was written (planned in {fmt_seconds(r.seconds)})"
        )
    else:
        con.print(
            f"exported {plural(r.tensors, 'tensor')}, {human_bytes(r.bytes)} in {plural(len(r.files), 'file')} "
            f"to {r.output} ({fmt_seconds(r.seconds)} in all; written in {fmt_seconds(r.write_seconds)}, "
            f"{fmt_rate(r.bytes, r.write_seconds)})"
        )
    print_table(
        con,
        "files",
        [Col("file", "key"), Col("tensors", "num"), Col("bytes", "num")],
        [[f["name"], f"{f['tensors']:,}", human_bytes(f["bytes"])] for f in r.files],
    )
    if r.model_adapter and r.model_adapter != "hf":
        con.print(f"adapter     {r.model_adapter}")
    con.print(f"save dtype  {r.save_dtype}" + (f"; casts: {_counts(r.casts)}" if r.casts else "; no casts"))
    if r.narrowing_casts:
        con.print(f"narrowing casts (precision or range lost): {_counts(r.narrowing_casts)}")
    for line in _source_lines(r):
        con.print(line)
    if r.tied_embeddings:
        msg = {
            "omitted": "tied: lm_head omitted (bitwise equal to the embedding)",
            "absent": "tied: no lm_head exported (none selected; from_pretrained ties it to the embedding)",
            "embedding-not-exported": "tied: embedding not exported, lm_head written",
        }.get(r.tied_embeddings, r.tied_embeddings)
        con.print(f"embeddings  {msg}")
    if r.skipped:
        # a reason naming a library parameter (`filter_glob`) names the command's flag (--filter)
        reasons = (f"{with_flags(reason)}: {len(keys)}" for reason, keys in r.skipped.items())
        con.print("not exported " + "; ".join(reasons))
    if r.adapter_config is not None:
        con.print(_lora_line(r.adapter_config))
    if r.assets:
        con.print(f"assets      {', '.join(r.assets)}")
    if r.config_edits:  # config.json made to match the written weights (ckpttool.ops.export.serving)
        edits = "; ".join(
            f"{k} {'(unset)' if old is None else json.dumps(old)} -> {json.dumps(new)}"
            for k, (old, new) in r.config_edits.items()
        )
        con.print(f"config.json {edits}")
    if r.manifest is not None:
        con.print(
            f"manifest    {'would write ' if r.dry_run else ''}{r.output}/{r.manifest} (every byte digested as written)"
        )


def _source_lines(r: ExportResult) -> list[str]:
    """The summary lines on where the written weights come from: masters, quantization, expert layout."""
    from ckpttool.ui.render import plural

    out: list[str] = []
    params = r.origins.get("params", [])
    master = r.origins.get("master", [])
    if r.weights == "master":
        out.append(
            f"weights     {len(master)} from FP32 master_weight, {len(params)} from stored parameters (no master)"
            + (f": {', '.join(params[:5])}{' ...' if len(params) > 5 else ''}" if params else "")
        )
    q = r.quantization
    if q is not None:
        out.append(
            f"quantized   {q['quantized']} weight(s) {q['method']} "
            + (f"({q['block_size']}x{q['block_size']} blocks) " if q["method"] == "fp8-block" else "(per output row) ")
            + f"as {q['format']} from "
            + ("FP32 master weights" if q["source"] == "master" else "the stored parameters")
            + (
                f"; max error {q['max_rel_error']:.4g} of the {'block' if q['method'] == 'fp8-block' else 'row'} amax "
                if q["max_rel_error"] is not None
                else "; error not measured (dry run) "
            )
            + f"(bound {q['max_rel_error_bound']:.4g})"
        )
    if r.experts == "per-expert" or r.layout.get("unpermuted"):
        un = r.layout.get("unpermuted") or []
        out.append(
            f"experts     {r.experts}"
            + (f"; {plural(len(un), 'tensor')} un-permuted from the legacy EP layout" if un else "")
        )
    return out


def _lora_line(cfg: dict[str, Any]) -> str:
    """The summary line of the ``adapter_config.json`` a LoRA export wrote: the settings PEFT's scaling and module
    matching read (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA)."""

    def show(v: Any) -> str:
        if isinstance(v, list):
            return ", ".join(str(x) for x in v) if v else "[]"
        if isinstance(v, dict):
            return ", ".join(f"{k}: {x}" for k, x in v.items())
        return json.dumps(v)

    parts = [f"{k} {show(cfg.get(k))}" for k in ("r", "lora_alpha", "use_rslora", "use_dora")]
    for k in ("rank_pattern", "alpha_pattern", "target_modules", "modules_to_save"):
        if cfg.get(k) not in (None, {}, [], ""):
            parts.append(f"{k} {show(cfg[k])}")
    return "lora config " + "; ".join(parts)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in d.items())


EPILOG = examples(
    "ckpttool export ckpt/ hf/ --model-assets ckpt/model_assets",
    "ckpttool export ckpt/ hf/ --save-dtype bf16 --shard-size 2GB --overwrite",
    "ckpttool export ckpt/ hf/ --weights master --save-dtype bf16",
    "ckpttool export ckpt/ hf/ --experts per-expert --filter 'model.layers.0.*'",
    "ckpttool export ckpt/ adapter/ --format lora --lora-alpha 16",
    "ckpttool export ckpt/ hf/ --manifest   # then: ckpttool manifest hf/ --verify",
    "ckpttool export ckpt/ merged/ --merge-lora --lora-alpha 16 --model-assets base/",
    "ckpttool export titan/step-1 hf/ --adapter torchtitan-llama3 --model-assets hf_config/",
)


#: The Typer command: :class:`ExportCLIOptions`' fields as its parameters, calling :func:`run_export`.
export_command = _typer_command(ExportCLIOptions, run_export)
