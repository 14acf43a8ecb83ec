"""Export rules: checkpoint key -> output key, tied embeddings, fused expert splits, LoRA keys.

The rules are YAML (schema in ``docs/export.md``); the packaged defaults live in
``ckpttool/ops/export/default_rules.yaml`` (read as ``default_rules.json``, the same document,
so that an export without ``--rules`` does not import ``yaml``: ~50 ms of start-up) and a user
file given with ``--rules`` is merged on top of them:

- ``keys``: ordered ``{match: REGEX, to: TEMPLATE | null, warn: bool}``; the user's
  entries are tried before the defaults, the first match wins. ``to: null`` skips
  the key. Only ``model.*`` keys reach the rules: optimizer state, param groups,
  the layout record and other items are never exported.
- ``tied_embeddings``, ``experts``, ``num_experts_config_keys``, ``lora``: a
  section present in the user's file replaces the default section.

Pure functions over strings; no I/O except :func:`load_rules` reading the rules files.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import SizeLimitError, UsageError
from ckpttool.format import limits
from ckpttool.format.files import read_regular, refuse_directory
from ckpttool.format.unpickler import short_repr

__all__ = [
    "KeyRule",
    "ExpertRule",
    "ExportRules",
    "RULES_FORMAT",
    "load_rules",
    "parse_rules",
]

RULES_FORMAT = "ckpttool.export-rules"
_RULES_VERSION = 1
_SECTIONS = ("format", "version", "keys", "tied_embeddings", "experts", "num_experts_config_keys", "lora")


@dataclass(frozen=True)
class KeyRule:
    """One key mapping rule: ``re.fullmatch(match, key)`` -> ``match.expand(to)`` (``None``: skip)."""

    pattern: re.Pattern[str]
    to: str | None
    warn: bool = False

    def apply(self, key: str) -> tuple[bool, str | None]:
        """``(matched, output key or None)`` for checkpoint key ``key``."""
        m = self.pattern.fullmatch(key)
        if m is None:
            return False, None
        if self.to is None:
            return True, None
        parts = _template(self.pattern, self.to)
        if parts is None:
            return True, m.expand(self.to)
        return True, "".join([p if type(p) is str else (m.group(p) or "") for p in parts])


_TEMPLATE_RE = re.compile(r"\\(?:([1-9])(?![0-9])|g<([1-9][0-9]*|[A-Za-z_][A-Za-z0-9_]*)>)")


@functools.lru_cache(maxsize=256)
def _template(pattern: re.Pattern[str], to: str) -> tuple[str | int, ...] | None:
    """``to`` as literal text and group references, parsed once (``Match.expand`` parses it per call:
    the largest part of planning 10^6 keys); ``None`` for a template with other
    escapes or a reference to a group the pattern lacks (``Match.expand`` then handles or refuses it).
    """
    parts: list[str | int] = []
    pos = 0
    for m in _TEMPLATE_RE.finditer(to):
        parts.append(to[pos : m.start()])
        ref: str | int = int(m.group(1) or m.group(2)) if (m.group(1) or m.group(2).isdecimal()) else m.group(2)
        if isinstance(ref, int) and ref > pattern.groups or isinstance(ref, str) and ref not in pattern.groupindex:
            return None
        parts.append(ref if isinstance(ref, int) else pattern.groupindex[ref])
        pos = m.end()
    parts.append(to[pos:])
    if any("\\" in p for p in parts if isinstance(p, str)):
        return None  # another escape (\n, \\, octal ...): left to Match.expand
    return tuple(p for p in parts if p != "")


@dataclass(frozen=True)
class ExpertRule:
    """A fused expert tensor (expert dim 0) and its per-expert output keys.

    Attributes:
        pattern: regex over the output key, with named groups used by ``parts``.
        parts: output key templates (``str.format`` with the groups and ``j``, the
            expert index); the per-expert slab is cut along its dim 0 into
            ``len(parts)`` equal pieces, in this order.
    """

    pattern: re.Pattern[str]
    parts: tuple[str, ...]

    def split_names(self, out_key: str, num_experts: int) -> list[list[str]] | None:
        """Per-expert output keys ``names[j][part]``, or ``None`` when ``out_key`` does not match."""
        m = self.pattern.fullmatch(out_key)
        if m is None:
            return None
        groups = m.groupdict()
        return [[p.format(j=j, **groups) for p in self.parts] for j in range(num_experts)]


@dataclass(frozen=True)
class ExportRules:
    """Parsed export rules (see module docstring)."""

    keys: tuple[KeyRule, ...]
    tied_embeddings: tuple[str, ...]
    """The output keys of the input embedding a tied ``tied_lm_head`` may share (the rules' ``embedding``, else the
    model classes' own: :data:`~ckpttool.model.hfconfig.TIED_EMBEDDING_KEYS`); :meth:`tied_embedding_in` picks it."""
    tied_lm_head: str
    experts: tuple[ExpertRule, ...]
    num_experts_config_keys: tuple[str, ...]
    lora_pattern: re.Pattern[str]
    sources: tuple[str, ...] = ()
    saved_name: Callable[[str], str] | None = None
    """The model family's per-expert checkpoint form's renames, reversed (:meth:`ExpertForm.saved_name`): a
    per-expert export names every tensor as ``save_pretrained`` does (Mixtral's ``block_sparse_moe``); ``None``
    where the form renames nothing."""

    def tied_embedding_in(self, names: Container[str]) -> str | None:
        """The embedding of :attr:`tied_embeddings` among the output keys ``names`` (``None``: none, or several)."""
        from ckpttool.model.hfconfig import tied_embedding_key

        return tied_embedding_key(names, self.tied_embeddings)

    def map_key(self, key: str) -> tuple[str | None, bool, bool]:
        """Map a checkpoint key to its output key.

        Returns:
            ``(output key or None, matched, warn)``; ``matched`` is ``False`` when no
            rule applies (the key is not exported).
        """
        for rule in self.keys:
            matched, out = rule.apply(key)
            if matched:
                return out, True, rule.warn and out is not None
        return None, False, False

    def key_mapper(self) -> Callable[[str], tuple[str | None, bool, bool]]:
        """:meth:`map_key` as one function over the rules, their templates parsed once (for 10^6 keys).

        Returns:
            ``f(key)`` giving exactly ``map_key(key)``.
        """
        compiled = tuple(
            (r.pattern.fullmatch, r.to, None if r.to is None else _template(r.pattern, r.to), r.warn and True)
            for r in self.keys
        )

        def mapped(key: str) -> tuple[str | None, bool, bool]:
            for fullmatch, to, parts, warn in compiled:
                m = fullmatch(key)
                if m is None:
                    continue
                if to is None:
                    return None, True, False
                if parts is None:
                    return m.expand(to), True, warn
                return "".join([p if type(p) is str else (m.group(p) or "") for p in parts]), True, warn
            return None, False, False

        return mapped

    def expert_rule(self, out_key: str) -> ExpertRule | None:
        """The first expert rule whose pattern matches ``out_key``."""
        for rule in self.experts:
            if rule.pattern.fullmatch(out_key):
                return rule
        return None

    def num_experts_from_config(self, config: dict[str, Any]) -> int | None:
        """Routed expert count from an HF ``config.json`` dict (first known field present)."""
        for name in self.num_experts_config_keys:
            value = config.get(name)
            if value is None and isinstance(config.get("text_config"), dict):
                value = config["text_config"].get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    def lora_output_key(self, key: str) -> tuple[str, str | None] | None:
        """``(adapter output key, adapter name)`` for a LoRA checkpoint key, else ``None``.

        The adapter name component is removed the way ``peft.get_peft_model_state_dict``
        removes it (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``). A key the
        pattern matches without an adapter name (PEFT's saved names, ``...q_proj.lora_A.weight``, as
        NeMo Automodel's PEFT save stores them) is its own output key, with the name ``None``.
        """
        m = self.lora_pattern.fullmatch(key)
        if m is None:
            return None
        inner = m.group("key")
        if m.group("adapter_name") is None:
            return inner, None
        start, end = m.span("adapter_name")
        base = m.start("key")
        out = inner[: start - base - 1] + inner[end - base :]
        return out, m.group("adapter_name")


def _compile(pattern: Any, where: str) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise UsageError(f"{where}: 'match' must be a non-empty regular expression string", hint="fix the rules file")
    try:
        return re.compile(pattern, re.DOTALL)  # a key may hold a newline: `.` matches every character
    except re.error as e:
        raise UsageError(f"{where}: invalid regular expression {pattern!r} ({e})", hint="fix the rules file") from e


def parse_rules(doc: Any, source: str) -> dict[str, Any]:
    """Validate one rules document and return its sections (compiled).

    Args:
        doc: the YAML document (a mapping).
        source: file name for messages.

    Returns:
        Section name -> parsed value, only for sections present in ``doc``.

    Raises:
        UsageError: wrong format/version, unknown section, bad regex or template.
    """
    if not isinstance(doc, dict):
        raise UsageError(f"{source}: export rules must be a YAML mapping", hint="see docs/export.md for the schema")
    unknown = sorted(str(k) for k in set(doc) - set(_SECTIONS))  # YAML keys may be ints, null, ...
    if unknown:
        raise UsageError(f"{source}: unknown section(s) {unknown}", hint=f"known sections: {', '.join(_SECTIONS[2:])}")
    fmt = doc.get("format", RULES_FORMAT)
    if fmt != RULES_FORMAT:
        # short_repr: YAML aliases make a nested list of 9**9 items out of 100 lines; repr would expand it
        raise UsageError(f"{source}: format is {short_repr(fmt)}, expected {RULES_FORMAT!r}", hint="see docs/export.md")
    version = doc.get("version", _RULES_VERSION)
    if version != _RULES_VERSION:
        raise UsageError(
            f"{source}: rules version {short_repr(version)} is not supported (expected {_RULES_VERSION})",
            hint="upgrade ckpttool or fix the rules file",
        )
    return {section: parse(doc[section], source) for section, parse in _PARSERS.items() if section in doc}


def _entries(items: Any, source: str, section: str, fields: str) -> Iterator[tuple[str, Any]]:
    """``(where, entry)`` of a section that is a list of ``{fields}`` mappings (``where``: ``SOURCE: section[i]``).

    Raises:
        UsageError: the section is not a list.
    """
    if not isinstance(items, list):
        raise UsageError(f"{source}: '{section}' must be a list of {{{fields}}} entries", hint="see docs/export.md")
    for i, item in enumerate(items):
        yield f"{source}: {section}[{i}]", item


def _parse_keys(items: Any, source: str) -> tuple[KeyRule, ...]:
    """The ``keys`` section: ``{match, to, warn}`` entries (``to: null`` skips the key)."""
    rules = []
    for where, item in _entries(items, source, "keys", "match, to"):
        if not isinstance(item, dict) or "match" not in item or "to" not in item:
            raise UsageError(f"{where}: needs 'match' and 'to' (to: null skips the key)", hint="see docs/export.md")
        extra = sorted(set(item) - {"match", "to", "warn"})
        if extra:
            raise UsageError(f"{where}: unknown field(s) {extra}", hint="fields: match, to, warn")
        pattern = _compile(item["match"], where)
        to = item["to"]
        if to is not None and not isinstance(to, str):
            raise UsageError(f"{where}: 'to' must be a string template or null", hint="see docs/export.md")
        if to is not None:
            _check_template(pattern, to, where)
        warn = item.get("warn", False)
        if not isinstance(warn, bool):  # bool('no') is True: a quoted 'no' or a list would turn warnings on
            raise UsageError(
                f"{where}: 'warn' is {short_repr(warn)}, expected true or false", hint="see docs/export.md"
            )
        rules.append(KeyRule(pattern, to, warn))
    return tuple(rules)


def _parse_tied(tied: Any, source: str) -> tuple[tuple[str, ...], str]:
    """The ``tied_embeddings`` section: ``(embeddings, lm_head)`` output keys; without ``embedding``, the embeddings
    transformers' model classes tie the head to (:data:`~ckpttool.model.hfconfig.TIED_EMBEDDING_KEYS`)."""
    from ckpttool.model.hfconfig import TIED_EMBEDDING_KEYS

    if (
        not isinstance(tied, dict)
        or not isinstance(tied.get("embedding", ""), str)
        or not isinstance(tied.get("lm_head"), str)
    ):
        raise UsageError(
            f"{source}: 'tied_embeddings' needs a string 'lm_head' output key (and 'embedding', if given, a string)",
            hint="see docs/export.md",
        )
    return ((tied["embedding"],) if "embedding" in tied else TIED_EMBEDDING_KEYS, tied["lm_head"])


def _parse_experts(items: Any, source: str) -> tuple[ExpertRule, ...]:
    """The ``experts`` section: ``{match, parts}`` entries (each part a template with ``{j}``)."""
    erules = []
    for where, item in _entries(items, source, "experts", "match, parts"):
        if (
            not isinstance(item, dict)
            or "match" not in item
            or not isinstance(item.get("parts"), list)
            or not item["parts"]
        ):
            raise UsageError(f"{where}: needs 'match' and a non-empty 'parts' list", hint="see docs/export.md")
        pattern = _compile(item["match"], where)
        parts = tuple(item["parts"])
        for p in parts:
            _check_part(p, pattern, where)
        erules.append(ExpertRule(pattern, parts))
    return tuple(erules)


def _check_part(p: Any, pattern: re.Pattern[str], where: str) -> None:
    """Refuse an expert part template that is not a string, uses unknown fields or lacks ``{j}``."""
    if not isinstance(p, str):
        raise UsageError(f"{where}: parts must be strings", hint="see docs/export.md")
    try:
        fields = [(field, spec, conv) for _, field, spec, conv in string.Formatter().parse(p) if field is not None]
    except ValueError as e:
        raise UsageError(
            f"{where}: invalid template {p!r} ({e})", hint="use {j} and the named groups of 'match'"
        ) from e
    # a spec (:>99999999999), a conversion (!r), an index or attribute ({j[0]}, {l.__class__}): not a plain name
    if any(spec or conv or not field.isidentifier() for field, spec, conv in fields):
        raise UsageError(
            f"{where}: template {p!r} gives a field a format spec, conversion, index or attribute; fields are plain",
            hint="write {j} and the named groups of 'match' (e.g. {layer}) without ':', '!', '[' or '.'",
        )
    try:
        p.format(j=0, **dict.fromkeys(pattern.groupindex, "x"))
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(
            f"{where}: template {p!r} uses an unknown field ({e})",
            hint="use {j} and the named groups of 'match'",
        ) from e
    if "{j}" not in p:
        raise UsageError(
            f"{where}: template {p!r} lacks {{j}} (the expert index)",
            hint="every per-expert key must contain {j}",
        )


def _parse_num_experts_keys(names: Any, source: str) -> tuple[str, ...]:
    """The ``num_experts_config_keys`` section: config.json keys holding the expert count."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{source}: 'num_experts_config_keys' must be a list of strings", hint="see docs/export.md")
    return tuple(names)


def _parse_lora(lora: Any, source: str) -> re.Pattern[str]:
    """The ``lora`` section: a ``match`` regex with named groups ``key`` and ``adapter_name``."""
    if not isinstance(lora, dict):
        raise UsageError(f"{source}: 'lora' must be a mapping with 'match'", hint="see docs/export.md")
    pattern = _compile(lora.get("match"), f"{source}: lora")
    if not {"key", "adapter_name"} <= set(pattern.groupindex):
        raise UsageError(f"{source}: lora.match needs named groups 'key' and 'adapter_name'", hint="see docs/export.md")
    return pattern


#: section -> its parser, in the order the sections are checked
_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "keys": _parse_keys,
    "tied_embeddings": _parse_tied,
    "experts": _parse_experts,
    "num_experts_config_keys": _parse_num_experts_keys,
    "lora": _parse_lora,
}


def _check_template(pattern: re.Pattern[str], to: str, where: str) -> None:
    """Refuse templates that reference groups the pattern does not have."""
    for ref in re.findall(r"\\(\d+)|\\g<(\w+)>", to):
        num, name = ref
        if num and (len(num) > 6 or int(num) > pattern.groups):  # (int() reads at most 4,300 digits)
            raise UsageError(
                f"{where}: template {to!r} uses group {num} but 'match' has {pattern.groups}", hint="fix the rules file"
            )
        # what int() reads (not a superscript '²', at most 4,300 digits)
        if name and name.isdecimal() and (len(name) > 6 or int(name) > pattern.groups):
            raise UsageError(
                f"{where}: template {to!r} uses group {name} but 'match' has {pattern.groups}",
                hint="fix the rules file",
            )
        if name and not name.isdecimal() and name not in pattern.groupindex:
            raise UsageError(f"{where}: template {to!r} uses unknown group {name!r}", hint="fix the rules file")
    # every other template error (a trailing backslash, \q, \g<1, \g<-1>) as Match.expand raises it, on an
    # empty match of a pattern with the same groups (the real pattern may match no string we could make)
    names = {i: n for n, i in pattern.groupindex.items()}
    same_groups = "".join(f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, pattern.groups + 1))
    try:
        re.fullmatch(same_groups, "").expand(to)  # type: ignore[union-attr]
    except (re.error, IndexError) as e:
        raise UsageError(f"{where}: invalid template {to!r} ({e})", hint="fix the rules file") from e


@functools.cache
def _rules_loader() -> Any:
    """A safe YAML loader (libyaml's when available: same result, faster) that refuses a mapping key given twice,
    which plain YAML loading resolves by keeping the last (a second ``keys:`` section would drop the first's rules
    unsaid). A key a ``<<`` merge brings in may be given again: that is YAML's override, not a repeat."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc,valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {short_repr(key)} at line {key_node.start_mark.line + 1}", None
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


#: The largest ``--rules`` file read (the packaged rules are 3 KiB): YAML builds some 180 bytes of objects per
#: byte of a flow list, so the object cap (256 MiB) would let one file take tens of GB.
RULES_CAP = 1 << 20


def _read_yaml(text: str, source: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_rules_loader())
    except yaml.YAMLError as e:
        raise UsageError(f"{source}: not valid YAML ({str(e).splitlines()[0]})", hint="fix the rules file") from e


def _saved_name(model_type: str | None) -> Callable[[str], str] | None:
    """:meth:`ExpertForm.saved_name` of the family form of ``model_type`` that renames keys, or ``None``."""
    from ckpttool.model.hf_forms import forms_for

    return next((f.saved_name for f in forms_for(model_type) if f.model_types is not None and f.renames), None)


def _form_rules(model_type: str | None) -> tuple[ExpertRule, ...]:
    """The expert split rules of the per-expert checkpoint forms of ``model_type`` that name their own
    projections (the loader's names: ``<prefix>.experts.{j}.<gate|up|down>.weight``, which transformers'
    conversion fuses on load)."""
    from ckpttool.model.hf_forms import forms_for

    out: list[ExpertRule] = []
    for form in forms_for(model_type):
        if form.model_types is None:
            continue  # the generic form: the default rules' names
        for fused, parts in form.fused():
            out.append(
                ExpertRule(
                    re.compile(rf"^(?P<prefix>.+\.experts)\.{fused}$"),
                    tuple(f"{{prefix}}.{{j}}.{p}.weight" for p in parts),
                )
            )
    return tuple(out)


def load_rules(user_file: str | Path | None = None, model_type: str | None = None) -> ExportRules:
    """Packaged default rules, merged with an optional user rules file.

    Args:
        user_file: a ``--rules FILE.yaml`` path or ``None``.
        model_type: the ``config.json`` ``model_type`` of the model: where the family's per-expert checkpoint
            form has its own names (:mod:`ckpttool.model.hf_forms`: Mixtral's ``w1`` / ``w3`` / ``w2``), its
            expert split rules come first and its renames name a per-expert export (unless the user file gives
            an ``experts`` section).

    Returns:
        The merged :class:`ExportRules`.

    Raises:
        UsageError: the user file is missing, not YAML or invalid.
    """
    # package data: default_rules.yaml as JSON (a test holds the two equal); json is imported anyway
    default_doc = json.loads(Path(__file__).with_name("default_rules.json").read_bytes())
    merged = parse_rules(default_doc, "default_rules.yaml")
    sources = ["default_rules.yaml"]
    if user_file is not None:
        p = Path(user_file)
        refuse_directory(p, "rules", "a YAML rules file")
        cap = min(RULES_CAP, limits.current().max_object_bytes)
        try:
            text = read_regular(p, cap, what="rules file").decode("utf-8")
        except SizeLimitError as e:
            if cap == RULES_CAP:  # not the object cap: raising --max-object-size would not help
                e.hint = "a rules file holds a few KiB of YAML (docs/export.md); pass the rules file itself"
            raise
        except OSError as e:
            raise UsageError(
                f"{p}: cannot read rules file ({e.strerror})", path=p, hint="pass an existing YAML file"
            ) from e
        except UnicodeDecodeError as e:
            raise UsageError(f"{p}: rules file is not UTF-8 text", path=p, hint="pass a YAML file") from e
        user = parse_rules(_read_yaml(text, str(p)), str(p))
        for section, value in user.items():
            merged[section] = value + merged["keys"] if section == "keys" else value
        sources.append(str(p))
        if "experts" in user:
            model_type = None  # the user's split rules replace the defaults, the family's too
    return ExportRules(
        keys=merged["keys"],
        tied_embeddings=merged["tied_embeddings"][0],
        tied_lm_head=merged["tied_embeddings"][1],
        experts=_form_rules(model_type) + merged["experts"],
        num_experts_config_keys=merged["num_experts_config_keys"],
        lora_pattern=merged["lora"],
        sources=tuple(sources),
        saved_name=_saved_name(model_type),
    )
