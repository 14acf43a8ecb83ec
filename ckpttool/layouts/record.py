"""The ckpttool layout record (``docs/design.md`` §4): parse, validate, serialise.

The record is a JSON object stored as the byte item ``layout`` of the checkpoint
(a ``torch.save``'d ``str``), or as a sidecar ``layout.json`` beside ``.metadata``::

    {"format": "ckpttool.layout", "version": 2,
     "parallel": {"ep_size": 4, "ep_fsdp_size": 2, "ep_replicate_size": 1, "dp_shard_size": 8, "tp_size": 1},
     "extra_parallel": {"<key>": {"ep_dim": 0, "fsdp_dim": 0, "num_experts": 64}},
     "optimizer": {"type": "cpu_offload_adamw", ...},
     "global_step": 1200}

Version 2 is the canonical EP layout (mesh EP-outer / FSDP-inner), version 1 the
legacy one (FSDP-outer / EP-inner). Unknown ``format`` or a newer ``version``
is an error, never a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import CkptError, LayoutError, LayoutFormatError, LayoutVersionError
from ckpttool.format.jsonfile import DuplicateKeyError, parse_json
from ckpttool.format.unpickler import short_repr

__all__ = [
    "LAYOUT_FORMAT",
    "MAX_LAYOUT_VERSION",
    "SIDECAR_NAME",
    "EPTensorSpec",
    "LayoutRecord",
    "is_own_record",
    "parse_layout_record",
]

LAYOUT_FORMAT = "ckpttool.layout"
MAX_LAYOUT_VERSION = 2
SIDECAR_NAME = "layout.json"
LAYOUT_KEY = "layout"


@dataclass(frozen=True)
class EPTensorSpec:
    """How one expert-parallel tensor is sharded: expert dim, FSDP dim, expert count."""

    ep_dim: int
    fsdp_dim: int | None
    num_experts: int


@dataclass(frozen=True)
class LayoutRecord:
    """A validated layout record.

    Attributes:
        version: 1 (legacy mesh order) or 2 (canonical).
        parallel: mesh sizes (``ep_size``, ``ep_fsdp_size``, ...), ints >= 1.
        extra_parallel: checkpoint key -> :class:`EPTensorSpec`.
        optimizer: optimizer description (``type``, dtypes, ...), free-form dict.
        global_step: training step of the save, if recorded.
        raw: the JSON object as read.
    """

    version: int
    parallel: dict[str, int]
    extra_parallel: dict[str, EPTensorSpec]
    optimizer: dict[str, Any] = field(default_factory=dict)
    global_step: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def ep_size(self) -> int:
        return self.parallel.get("ep_size", 1)

    @property
    def ep_fsdp_size(self) -> int:
        return self.parallel.get("ep_fsdp_size", 1)

    @property
    def layout_name(self) -> str:
        return "canonical" if self.version == 2 else "legacy"

    def to_json(self) -> str:
        return json.dumps(self.raw, sort_keys=True, indent=2) + "\n"


def _int(value: Any, where: str, *, minimum: int = 0, source: str = "layout record") -> int:
    if type(value) is not int or value < minimum:
        raise LayoutError(f"{source}: {where} is {short_repr(value, 40)}, expected an integer >= {minimum}")
    return value


def is_own_record(obj: Any) -> bool:
    """Whether a byte item named ``layout`` (as read) is ckpttool's layout record rather than the trainer's own.

    By content: ckpttool writes a JSON object (a ``str``) whose ``format`` names it (``ckpttool.layout``, or another
    ``ckpttool.`` format, an error when parsed). Anything else (a string that is not a JSON object, JSON without that
    ``format``, a list, a dict, an object of the trainer's own) is a ``layout`` item of the trainer: an item of the
    checkpoint like any other, not a record to parse.
    """
    if isinstance(obj, (bytes, bytearray)):
        try:
            obj = obj.decode("utf-8")
        except UnicodeDecodeError:
            return False
    if not isinstance(obj, str) or not obj.lstrip().startswith("{"):
        return False
    try:
        value = parse_json(obj, "layout")
    except json.JSONDecodeError:
        return False
    except CkptError:  # an object too deep or too large: parse_layout_record says so
        return True
    fmt = value.get("format") if isinstance(value, dict) else None
    return isinstance(fmt, str) and fmt.startswith("ckpttool.")


def parse_layout_record(obj: Any, source: str = "layout record") -> LayoutRecord:
    """Validate a layout record (a JSON string, bytes, or an already-parsed dict).

    Raises:
        LayoutError: not JSON, unknown ``format``, unsupported ``version``, or malformed fields.
    """
    if isinstance(obj, (bytes, bytearray)):
        try:
            obj = obj.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LayoutError(f"{source}: not UTF-8 text") from e
    if isinstance(obj, str):
        try:
            obj = parse_json(obj, source, unique_keys=True)  # the last of two ep_size values is no record's meaning
        except json.JSONDecodeError as e:
            raise LayoutError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from e
        except DuplicateKeyError as e:
            raise LayoutError(f"{source}: {e}") from e
    if not isinstance(obj, dict):
        raise LayoutError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != LAYOUT_FORMAT:
        raise LayoutFormatError(f"{source}: unknown format {short_repr(fmt)} (expected {LAYOUT_FORMAT!r})")
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise LayoutFormatError(f"{source}: version {short_repr(version, 40)} is not a positive integer")
    if version > MAX_LAYOUT_VERSION:
        raise LayoutVersionError(
            f"{source}: version {version} is newer than this ckpttool supports ({MAX_LAYOUT_VERSION})"
        )
    par = obj.get("parallel", {})
    if not isinstance(par, dict):
        raise LayoutError(f"{source}: 'parallel' is not an object")
    parallel = {str(k): _int(v, f"parallel.{k}", minimum=1, source=source) for k, v in par.items()}
    ep_raw = obj.get("extra_parallel", {})
    if not isinstance(ep_raw, dict):
        raise LayoutError(f"{source}: 'extra_parallel' is not an object")
    extra: dict[str, EPTensorSpec] = {}
    for key, spec in ep_raw.items():
        if not isinstance(spec, dict):
            raise LayoutError(f"{source}: extra_parallel[{key!r}] is not an object", fqn=key)
        fsdp_dim = spec.get("fsdp_dim")
        extra[str(key)] = EPTensorSpec(
            ep_dim=_int(spec.get("ep_dim", 0), f"extra_parallel[{key!r}].ep_dim", source=source),
            fsdp_dim=None if fsdp_dim is None else _int(fsdp_dim, f"extra_parallel[{key!r}].fsdp_dim", source=source),
            num_experts=_int(spec.get("num_experts"), f"extra_parallel[{key!r}].num_experts", minimum=1, source=source),
        )
    opt = obj.get("optimizer", {})
    if not isinstance(opt, dict):
        raise LayoutError(f"{source}: 'optimizer' is not an object")
    step = obj.get("global_step")
    if step is not None:
        step = _int(step, "global_step", source=source)
    return LayoutRecord(version, parallel, extra, opt, step, obj)
