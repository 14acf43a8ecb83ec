"""Golden outputs of the ckpttool CLI: run a fixed battery of commands and record everything they produce.

Usage::

    PYTHONPATH=<tree> python scripts/golden_outputs.py OUTDIR [--fixtures DIR] [--jobs N]

Builds real checkpoints with the test fixture builders of ``<tree>`` (``tests/fixtures``: dense,
multi-optimizer, per-expert, the ``ckpttool sample`` MoE, HF Llama/LoRA/Qwen-MoE/master/mixed
dtypes, the hostile corpus), then runs ``python -m ckpttool ...`` subprocesses on them: inspect,
validate, export (several options), reshard, import of an export, diff, manifest (+ verify),
replay-step, stamp, rules, schema, and inspect/validate/export on every hostile-corpus entry.

For each invocation OUTDIR gets one text file: the argv, the exit code, stdout and stderr
(timings, rates and the temporary directories normalised) and, for commands that write files, the
sha256 of every output file (path-relative, sorted; JSON/text files are hashed after the same
normalisation; ``.distcp``/``.metadata`` files without the bytes every DCP save randomises:
torch.save serialization ids, zip timestamps and CRCs, ``save_id``). Two runs compare with
``diff -r OUTDIR1 OUTDIR2``.

``--fixtures DIR`` builds the fixtures into DIR once (DIR/.complete marks a finished build) and
reuses them later, so two trees can be compared on the very same input bytes. Without it the
fixtures are built into the run's temporary directory. ``fixtures.txt`` in OUTDIR lists the
sha256 of every fixture file (compare it to check that the builders are deterministic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TIMEOUT_S = 300
HOSTILE_GROUPS = 8  # chains of hostile-corpus runs (fixed: the output file names depend on it)
TEXT_SUFFIXES = {".json", ".txt", ".yaml", ".yml", ".xml", ".md", ".jinja", ".model"}

# ---------------------------------------------------------------------------------------- normalisation
_NORMALISERS: list[tuple[re.Pattern[str], str]] = [
    # rates: "12.3 kB/s", "1.2 GiB/s", "350 MB/s", "45 it/s"
    (re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?\s?(?:[kKMGT]i?B|B|it)/s\b"), "<RATE>"),
    # JSON timing fields: "seconds", "deep_seconds", "wall_s", "elapsed_ms", ... (the key's end decides)
    (
        re.compile(
            r'("[A-Za-z_]*(?:seconds|_s|_ms|elapsed|duration|per_second|throughput)"\s*:\s*)(-?[\d.eE+-]+|null)'
        ),
        r"\1<T>",
    ),
    # durations in text: "in 2.54 s", "(0.3 ms", "12 min"
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|us|µs|min)\b"), "<T>"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<DATE>"),
    # rates in JSON ("effective_gbps") and the memory replay-step found free on this machine
    (re.compile(r'("[A-Za-z_]*gbps"\s*:\s*)(-?[\d.eE+-]+)'), r"\1<RATE>"),
    (re.compile(r'("max_memory"\s*:\s*)(\d+)'), r"\1<MEM>"),
    (re.compile(r"(batch(?:es)? under )[\d.]+ ?[KMGT]i?B"), r"\1<MEM>"),
    # an output's ownership marker (.ckpttool-output.json): the writing process and this boot, new every run
    (re.compile(r'("(?:pid|pid_start)"\s*:\s*)\d+'), r"\1<PID>"),
    (re.compile(r'("(?:token|boot_id|host)"\s*:\s*)"[^"]*"'), r'\1"<RUN>"'),
]
# DCP files: torch.save archives carry a random serialization id and DOS timestamps, `.metadata`
# a random save_id and the checkpoint's path; zeroed before hashing, with every member's CRC-32
# (a function of bytes compared anyway). Every other byte is compared.
_SAVE_ID = re.compile(rb"(save_id.{1,3}?)[0-9a-fA-F-]{32,36}", re.S)
# a byte item (layout record) of an output names its source's `.metadata` digest: random when that
# source was itself written in this run
_SOURCE_DIGEST = re.compile(rb'("(?:metadata|manifest)_digest": ")([0-9a-f]{16,128})"')
_TMP_OUT = re.compile(rb"\.ckpttool-tmp-\d+-[0-9a-f]+")  # the atomic output's temporary name (checkpoint_id)
_SERIAL = b".data/serialization_id"
_DIGEST = re.compile(rb'"[0-9a-f]{32,128}"')


def _canonical_dcp_bytes(ctx: Context, data: bytes) -> bytes:
    """``data`` (a ``.distcp`` or ``.metadata`` file) with its run-specific bytes zeroed."""
    b = bytearray(data)
    for m in re.finditer(rb"PK\x03\x04", data):  # zip local headers: time/date; the id's bytes and CRC
        i = m.start()
        if i + 30 > len(b):
            continue
        n, e = struct.unpack_from("<HH", b, i + 26)
        b[i + 10 : i + 18] = bytes(8)  # time, date, CRC-32
        if bytes(b[i + 30 : i + 30 + n]).endswith(_SERIAL):
            size = struct.unpack_from("<I", b, i + 18)[0]
            start = i + 30 + n + e
            b[start : start + size] = b"0" * len(b[start : start + size])
    for m in re.finditer(rb"PK\x01\x02", data):  # central directory: time/date; the id's CRC
        i = m.start()
        if i + 46 > len(b):
            continue
        b[i + 12 : i + 20] = bytes(8)  # time, date, CRC-32
    out = _SAVE_ID.sub(lambda m: m.group(1) + b"0" * 32, bytes(b))
    out = _SOURCE_DIGEST.sub(lambda m: m.group(1) + b"0" * len(m.group(2)) + b'"', out)
    out = _TMP_OUT.sub(b".ckpttool-tmp-<PID>-<HEX>", out)
    out = out.replace(ctx.work.name.encode(), b"<TMPNAME>")  # a pickled PosixPath: one string per component
    for s, tok in ctx.subs:
        out = out.replace(s.encode(), tok.encode())
    return out


@dataclass
class Context:
    """Paths substituted by tokens in every recorded text."""

    work: Path
    fixtures: Path
    subs: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        pairs = [(self.work, "<TMP>"), (self.fixtures, "<FX>")]
        for p, tok in pairs:
            for s in {str(p), os.path.realpath(p)}:
                self.subs.append((s, tok))
        self.subs.sort(key=lambda st: -len(st[0]))  # longest first: a nested path before its parent

    def norm(self, text: str) -> str:
        for s, tok in self.subs:
            text = text.replace(s, tok)
        for rx, rep in _NORMALISERS:
            text = rx.sub(rep, text)
        return text


def _hash_tree(ctx: Context, root: Path) -> list[str]:
    """``<relpath> <kind> <sha256>`` for every entry under ``root`` (text files hashed normalised)."""
    if not root.exists() and not root.is_symlink():
        return [f"(absent) {ctx.norm(str(root))}"]
    if root.is_file():
        return [_hash_entry(ctx, root, root.name)]
    rows = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            p = Path(dirpath, name)
            rows.append(_hash_entry(ctx, p, str(p.relative_to(root))))
    return sorted(rows)


def _hash_entry(ctx: Context, p: Path, rel: str) -> str:
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return f"{rel} link {ctx.norm(os.readlink(p))}"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} special {stat.S_IFMT(st.st_mode):o}"
    data = p.read_bytes()
    if p.suffix == ".distcp" or p.name == ".metadata":
        canon = _canonical_dcp_bytes(ctx, data)
        if canon != data:
            return f"{rel} dcp-normalised {hashlib.sha256(canon).hexdigest()} {len(data)}"
        return f"{rel} sha256 {hashlib.sha256(data).hexdigest()} {len(data)}"
    if p.name == "manifest.json" and (p.parent / ".metadata").exists():
        # a DCP output's manifest digests records that hold torch.save's random serialization ids
        data = _DIGEST.sub(b'"<DIGEST>"', data)
    if p.suffix in TEXT_SUFFIXES or p.name.startswith("."):
        try:
            text = data.decode()
        except UnicodeDecodeError:
            pass
        else:
            normed = ctx.norm(text)
            if normed != text:
                return f"{rel} text-normalised {hashlib.sha256(normed.encode()).hexdigest()} {len(normed)}"
    return f"{rel} sha256 {hashlib.sha256(data).hexdigest()} {len(data)}"


# ---------------------------------------------------------------------------------------- invocations
@dataclass(frozen=True)
class Inv:
    """One ``python -m ckpttool`` run: a label, its arguments, the paths it writes (hashed after)."""

    label: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    before: Callable[[], None] | None = None  # e.g. copy a checkpoint a command writes into


@dataclass
class Chain:
    """Invocations that depend on each other (run in order); chains run in parallel."""

    name: str
    steps: list[Inv] = field(default_factory=list)

    def add(self, label: str, *argv: str, outputs: tuple[str | Path, ...] = (), before=None) -> None:  # type: ignore[no-untyped-def]
        self.steps.append(Inv(label, tuple(map(str, argv)), tuple(map(str, outputs)), before))


def _env(ctx: Context, chain: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTTOOL_", "FORCE_COLOR", "CLICOLOR"))}
    tmp = ctx.work / "tmp" / chain
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(
        TMPDIR=str(tmp),
        CKPTTOOL_CACHE_DIR=str(ctx.work / "cache" / chain),  # each chain its own cache: same hits every run
        COLUMNS="120",
        LINES="50",
        NO_COLOR="1",
        TERM="dumb",
        LC_ALL="C.UTF-8",
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS="1",
        TQDM_DISABLE="1",
    )
    return env


def _run_chain(ctx: Context, chain: Chain, outdir: Path) -> list[str]:
    env = _env(ctx, chain.name)
    cwd = ctx.work / "cwd" / chain.name
    cwd.mkdir(parents=True, exist_ok=True)
    done = []
    for i, inv in enumerate(chain.steps):
        if inv.before is not None:
            inv.before()
        argv = [sys.executable, "-m", "ckpttool", *inv.argv]
        try:
            res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=TIMEOUT_S, check=False)
            code, out, err = str(res.returncode), res.stdout, res.stderr
        except subprocess.TimeoutExpired as exc:
            code, out, err = "TIMEOUT", exc.stdout or b"", exc.stderr or b""
        parts = [
            "argv: " + ctx.norm(" ".join(inv.argv)),
            f"exit: {code}",
            "--- stdout",
            ctx.norm(out.decode(errors="replace")),
            "--- stderr",
            ctx.norm(err.decode(errors="replace")),
        ]
        for o in inv.outputs:
            parts += [f"--- files {ctx.norm(o)}", *_hash_tree(ctx, Path(o))]
        name = f"{chain.name}__{i:02d}_{inv.label}.txt"
        (outdir / name).write_text("\n".join(parts) + "\n", errors="replace")
        done.append(name)
    return done


# ---------------------------------------------------------------------------------------- fixtures
FIXTURES = ("sample", "dense", "multi_optim", "per_expert", "llama", "lora", "qwen_moe", "master", "mixed")


def _build_sample(out: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", "-q", "sample", str(out), "--overwrite"], capture_output=True, check=False
    )
    if res.returncode:
        raise RuntimeError(res.stderr.decode())


def build_fixtures(fx: Path) -> None:
    """Every fixture checkpoint of the battery under ``fx`` (skips ``fx`` when ``fx/.complete`` exists)."""
    if (fx / ".complete").exists():
        return
    from tests.fixtures import builders, hf_models
    from tests.fixtures.hostile import build_corpus

    warnings.filterwarnings("ignore")
    shutil.rmtree(fx, ignore_errors=True)
    fx.mkdir(parents=True)
    build: dict[str, Callable[[Path], None]] = {
        "sample": _build_sample,
        "dense": builders.build_dense,
        "multi_optim": builders.build_multi_optim,
        "per_expert": builders.build_per_expert,
        "llama": hf_models.build_llama,
        "lora": hf_models.build_lora,
        "qwen_moe": hf_models.build_qwen_moe,
        "master": hf_models.build_master,
        "mixed": hf_models.build_mixed_dtypes,
    }
    for name in FIXTURES:
        t0 = time.monotonic()
        (fx / name).mkdir()
        build[name](fx / name)
        print(f"fixture {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    t0 = time.monotonic()
    corpus = build_corpus(fx / "hostile", fx / "sample")
    for name, entry in corpus.items():  # the entries' own extra arguments (--model-assets, --config, ...)
        args = entry.extra.get("args", {})
        if args:
            (fx / "hostile" / name / "extra_args.json").write_text(json.dumps(args, sort_keys=True))
    print(f"hostile corpus: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    (fx / ".complete").write_text("ok\n")


def _fixture_listing(ctx: Context) -> list[str]:
    rows = []
    for name in FIXTURES:
        rows += [f"{name}/{r}" for r in _hash_tree(ctx, ctx.fixtures / name)]
    return rows


# ---------------------------------------------------------------------------------------- the battery
def _copier(src: Path, dst: Path) -> Callable[[], None]:
    def copy() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True)

    return copy


def _read_chain(name: str, ck: Path) -> Chain:
    c = Chain(f"read_{name}")
    c.add("inspect", "inspect", ck)
    c.add("inspect_json", "inspect", ck, "--json")
    c.add("inspect_depth_size", "inspect", ck, "--depth", "3", "--sort", "size", "--wide", "--filter", "*layers*")
    c.add("validate_strict", "validate", ck, "--strict")
    c.add("validate_strict_deep", "validate", ck, "--strict", "--deep", "--workers", "1")
    c.add("validate_strict_deep_json", "validate", ck, "--strict", "--deep", "--json", "--workers", "2")
    c.add("diff_self_all", "diff", ck, ck, "--what", "all")
    return c


def _export_chain(name: str, ck: Path, w: Path, *, full: bool, moe: bool, assets: bool) -> Chain:
    """Exports of one fixture (``full``: every option), each diffed or imported back."""
    c = Chain(f"export_{name}")
    a = ("--model-assets", str(ck / "model_assets")) if assets else ()
    out = w / f"export_{name}"
    c.add("export_default", "export", ck, out / "default", *a, outputs=(out / "default",))
    c.add("export_bf16_json", "export", ck, out / "bf16", "--save-dtype", "bfloat16", "--json", outputs=(out / "bf16",))
    c.add("diff_export", "diff", ck, out / "default", "--json")
    if full:
        c.add(
            "export_fp16_small_shards",
            "export",
            ck,
            out / "small",
            "--save-dtype",
            "float16",
            "--shard-size",
            "20KB",
            "--workers",
            "1",
            outputs=(out / "small",),
        )
        c.add("export_manifest", "export", ck, out / "man", "--manifest", outputs=(out / "man",))
        c.add("manifest_verify_export", "manifest", out / "man", "--verify")
        c.add("export_filter", "export", ck, out / "filter", "--filter", "*layers.1*", outputs=(out / "filter",))
        c.add("export_exists", "export", ck, out / "default")  # refused: non-empty output
        c.add("diff_export_bf16", "diff", ck, out / "bf16", "--as-dtype", "bfloat16")
    if moe:
        c.add(
            "export_per_expert",
            "export",
            ck,
            out / "per_expert",
            "--experts",
            "per-expert",
            *a,
            outputs=(out / "per_expert",),
        )
    if assets:
        imp = w / f"import_{name}"
        c.add("import_export", "import", out / "default", imp / "plain", outputs=(imp / "plain",))
        c.add("diff_import", "diff", ck, imp / "plain")
        if full:
            c.add(
                "import_export_world2",
                "import",
                out / "default",
                imp / "w2",
                "--world-size",
                "2",
                "--manifest",
                outputs=(imp / "w2",),
            )
            c.add(
                "validate_import", "validate", imp / "w2", "--strict", "--deep", "--manifest", imp / "w2/manifest.json"
            )
    return c


def _reshard_chain(name: str, ck: Path, w: Path) -> Chain:
    c = Chain(f"reshard_{name}")
    out = w / f"reshard_{name}"
    c.add("reshard_legacy", "reshard", ck, out / "legacy", "--to", "legacy", "--no-fsync", outputs=(out / "legacy",))
    c.add(
        "reshard_legacy_optim",
        "reshard",
        ck,
        out / "legacy_optim",
        "--to",
        "legacy",
        "--with-optimizer",
        "--no-fsync",
        "--json",
        outputs=(out / "legacy_optim",),
    )
    c.add(
        "reshard_legacy_p2f2",
        "reshard",
        ck,
        out / "legacy_p2f2",
        "--to",
        "legacy",
        "--with-optimizer",
        "--target-ep-size",
        "2",
        "--target-ep-fsdp-size",
        "2",
        "--manifest",
        "--no-fsync",
        outputs=(out / "legacy_p2f2",),
    )
    c.add("inspect_legacy", "inspect", out / "legacy_p2f2")
    c.add("validate_legacy", "validate", out / "legacy_p2f2", "--strict", "--deep", "--json")
    c.add(
        "reshard_back_canonical",
        "reshard",
        out / "legacy_p2f2",
        out / "canonical",
        "--to",
        "canonical",
        "--with-optimizer",
        "--no-fsync",
        outputs=(out / "canonical",),
    )
    c.add("diff_roundtrip", "diff", ck, out / "canonical", "--what", "all")
    c.add("diff_legacy_json", "diff", ck, out / "legacy_optim", "--what", "all", "--json")
    c.add(
        "reshard_canonical_noop",
        "reshard",
        ck,
        out / "canon2",
        "--to",
        "canonical",
        "--no-fsync",
        outputs=(out / "canon2",),
    )
    return c


def _misc_chains(ctx: Context, w: Path) -> list[Chain]:
    fx = ctx.fixtures
    c = Chain("misc")
    c.add("sample", "sample", w / "sample_out", outputs=(w / "sample_out",))
    c.add(
        "sample_opts",
        "sample",
        w / "sample2",
        "--train-steps",
        "1",
        "--seed",
        "7",
        "--optimizer",
        "master_fp32_adamw",
        outputs=(w / "sample2",),
    )
    c.add("diff_sample_fixture", "diff", w / "sample_out", fx / "sample", "--what", "all")
    c.add("rules", "rules")
    c.add("rules_json", "rules", "--json")
    c.add("validate_list_rules", "validate", "--list-rules")
    c.add("schema_list", "schema")
    for s in (
        "inspect",
        "validate",
        "export",
        "reshard",
        "stamp",
        "replay-step",
        "rules",
        "diff",
        "manifest",
        "manifest-check",
        "import",
    ):
        c.add(f"schema_{s}", "schema", s)
    c.add("version_help", "--help")
    m = Chain("manifest")
    for name in ("sample", "dense"):
        mf = w / f"manifest_{name}.json"
        m.add(f"manifest_{name}", "manifest", fx / name, "--output", mf, outputs=(mf,))
        m.add(
            f"manifest_{name}_json_record",
            "manifest",
            fx / name,
            "--output",
            w / f"m2_{name}.json",
            "--covers",
            "record",
            "--hash",
            "blake2b-256",
            "--json",
            outputs=(w / f"m2_{name}.json",),
        )
        m.add(f"manifest_{name}_verify", "manifest", fx / name, "--verify", "--output", mf)
        m.add(f"manifest_{name}_verify_json", "manifest", fx / name, "--verify", "--output", mf, "--json")
        m.add(f"validate_{name}_manifest", "validate", fx / name, "--manifest", mf)
    r = Chain("replay")
    r.add("replay_filter", "replay-step", fx / "sample", "--device", "cpu", "--filter", "*layers.0.self_attn*")
    r.add("replay_master", "replay-step", fx / "master", "--device", "cpu", "--json")
    s = Chain("stamp")
    for name in ("per_expert", "qwen_moe", "sample"):
        dst = w / f"stamp_{name}"
        s.add(
            f"stamp_{name}",
            "stamp",
            dst,
            "--source-layout",
            "canonical",
            "--ep-size",
            "1",
            "--ep-fsdp-size",
            "1",
            outputs=(dst,),
            before=_copier(fx / name, dst),
        )
        s.add(
            f"stamp_{name}_legacy_json",
            "stamp",
            dst,
            "--source-layout",
            "legacy",
            "--ep-size",
            "2",
            "--ep-fsdp-size",
            "2",
            "--json",
            outputs=(dst,),
            before=_copier(fx / name, dst),
        )
        s.add(f"inspect_{name}_stamped", "inspect", dst)
    e = Chain("export_special")
    e.add(
        "export_lora",
        "export",
        fx / "lora",
        w / "lora_out",
        "--format",
        "lora",
        "--lora-alpha",
        "8",
        outputs=(w / "lora_out",),
    )
    e.add("diff_lora", "diff", fx / "lora", w / "lora_out", "--json")
    e.add(
        "export_lora_merged",
        "export",
        fx / "lora",
        w / "lora_merged",
        "--format",
        "hf-merged",
        "--lora-alpha",
        "8",
        outputs=(w / "lora_merged",),
    )
    e.add(
        "export_master",
        "export",
        fx / "master",
        w / "master_out",
        "--weights",
        "master",
        "--model-assets",
        fx / "master" / "model_assets",
        outputs=(w / "master_out",),
    )
    e.add("diff_master", "diff", fx / "master", w / "master_out", "--weights", "master")
    e.add("export_multi_optim_master", "export", fx / "multi_optim", w / "mo_master", "--weights", "master")
    return [c, m, r, s, e]


def _hostile_chains(ctx: Context, w: Path, groups: int) -> list[Chain]:
    from tests.fixtures.hostile import ENTRY_NAMES

    chains = [Chain(f"hostile{g}") for g in range(groups)]
    for i, name in enumerate(ENTRY_NAMES):
        ck = ctx.fixtures / "hostile" / name / "ckpt"
        extra = _hostile_extra(ctx, name)
        c = chains[i % groups]
        out = w / "hostile" / name / "export"
        c.add(f"{name}_inspect", "inspect", ck, *extra.get("inspect", []))
        c.add(f"{name}_validate", "validate", ck, "--strict", "--deep", "--json", *extra.get("validate-deep", []))
        c.add(f"{name}_export", "export", ck, out, *extra.get("export", []), outputs=(out,))
    return chains


def _hostile_extra(ctx: Context, name: str) -> dict[str, list[str]]:
    """The entry's own extra arguments (``CorpusEntry.extra['args']``, saved by :func:`build_fixtures`)."""
    path = ctx.fixtures / "hostile" / name / "extra_args.json"
    return json.loads(path.read_text()) if path.exists() else {}


def battery(ctx: Context) -> list[Chain]:
    w = ctx.work / "w"
    fx = ctx.fixtures
    chains = [_read_chain(n, fx / n) for n in FIXTURES]
    assets = {"sample", "llama", "qwen_moe", "master", "mixed", "lora"}
    moe = {"sample", "qwen_moe", "multi_optim", "per_expert"}
    full = {"sample", "qwen_moe"}
    chains += [
        _export_chain(n, fx / n, w, full=n in full, moe=n in moe, assets=n in assets) for n in FIXTURES if n != "lora"
    ]
    chains += [_reshard_chain(n, fx / n, w) for n in ("sample", "qwen_moe")]
    chains += _misc_chains(ctx, w)
    chains += _hostile_chains(ctx, w, HOSTILE_GROUPS)
    return chains


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--fixtures", type=Path, help="build the fixtures here once and reuse them")
    ap.add_argument("--jobs", type=int, default=4, help="chains run in parallel [4]")
    ap.add_argument(
        "--only", help="run only the chains whose name contains one of these (comma-separated, e.g. reshard_,misc)"
    )
    args = ap.parse_args()
    outdir: Path = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    if any(outdir.iterdir()):
        ap.error(f"{outdir} is not empty")
    probe = subprocess.run([sys.executable, "-m", "ckpttool", "--help"], capture_output=True, text=True, check=False)
    if probe.returncode:  # e.g. not the project's environment: every invocation would record the same traceback
        ap.error(f"python -m ckpttool does not start:\n{probe.stderr[-2000:]}")
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        work = Path(tmp)
        fx = (args.fixtures or work / "fx").resolve()
        t0 = time.monotonic()
        build_fixtures(fx)
        ctx = Context(work, fx)
        (outdir / "fixtures.txt").write_text("\n".join(_fixture_listing(ctx)) + "\n")
        print(f"fixtures ready: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        only = args.only.split(",") if args.only else []
        chains = [c for c in battery(ctx) if not only or any(o in c.name for o in only)]
        chains.sort(key=lambda c: -len(c.steps))
        with ThreadPoolExecutor(args.jobs) as pool:
            names = [n for done in pool.map(lambda c: _run_chain(ctx, c, outdir), chains) for n in done]
    print(f"{len(names)} invocations in {time.monotonic() - t0:.0f} s -> {outdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
