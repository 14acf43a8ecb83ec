"""The parsed-``.metadata`` cache (ckpttool.format.mdcache): same result as parsing, never trusted, never in the checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import xxhash
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format import CheckpointDir, mdcache, parse_metadata_bytes
from ckpttool.format import cache as usercache
from ckpttool.format.mdcache import CorruptEntry, decode, encode
from ckpttool.format.metadata import CheckpointMetadata
from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.special_files import SPECIAL_KINDS, fails_instead_of_hanging, make_special


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory, used for every ``.metadata`` whatever its size."""
    d = tmp_path / "cache"
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(d))
    monkeypatch.delenv(usercache.NO_CACHE_ENV, raising=False)
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    usercache.set_cache_enabled(None)
    yield d
    usercache.set_cache_enabled(None)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "metadata-v2").glob("*.ckmd")) if (cache / "metadata-v2").is_dir() else []


def _roundtrip(ckpt: Path) -> tuple[CheckpointMetadata, CheckpointMetadata]:
    data = (ckpt / ".metadata").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    md = parse_metadata_bytes(data)
    return md, decode(encode(md, digest, len(data)), digest, len(data))


@pytest.mark.parametrize("fixture", ["dense_ckpt", "fsdp_ckpt", "multi_optim_ckpt", "sample_ckpt", "per_expert_ckpt"])
def test_entry_decodes_to_the_parsed_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    md, back = _roundtrip(request.getfixturevalue(fixture))
    assert back == md
    assert list(back.entries) == list(md.entries) and list(back.storage) == list(md.storage)  # file order kept
    assert list(back.planner_data) == list(md.planner_data)


def test_every_ep_save_round_trips(ep_suite: Path) -> None:
    dirs = sorted(p.parent for p in ep_suite.rglob(".metadata"))
    assert dirs
    for d in dirs:
        md, back = _roundtrip(d)
        assert back == md, d


def _inspect_json(ckpt: Path, *extra: str) -> dict[str, object]:
    res = CliRunner().invoke(app, [*extra, "inspect", "--json", str(ckpt)])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def _validate_json(ckpt: Path, *extra: str) -> dict[str, object]:
    res = CliRunner().invoke(app, [*extra, "validate", "--strict", "--json", str(ckpt)])
    out = json.loads(res.stdout)
    out.pop("stats", None)  # timings
    return out  # type: ignore[no-any-return]


def test_hit_gives_the_same_inspect_and_validate_output(fsdp_ckpt: Path, cache: Path) -> None:
    direct_inspect = _inspect_json(fsdp_ckpt, "--no-cache")
    usercache.set_cache_enabled(None)
    direct_validate = _validate_json(fsdp_ckpt, "--no-cache")
    usercache.set_cache_enabled(None)
    assert _entries(cache) == []  # --no-cache: nothing written
    assert _inspect_json(fsdp_ckpt) == direct_inspect  # miss: parsed and stored
    (entry,) = _entries(cache)
    mtime = entry.stat().st_mtime_ns
    assert _inspect_json(fsdp_ckpt) == direct_inspect  # hit
    assert _validate_json(fsdp_ckpt) == direct_validate
    assert entry.stat().st_mtime_ns == mtime  # a hit does not rewrite the entry


def test_hit_is_read_from_the_entry(dense_ckpt: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    CheckpointDir(dense_ckpt).close()
    calls: list[str] = []
    real = mdcache.parse_metadata_bytes
    monkeypatch.setattr(
        mdcache, "parse_metadata_bytes", lambda data, source: calls.append(source) or real(data, source)
    )
    md = CheckpointDir(dense_ckpt).metadata
    assert calls == [] and md == parse_metadata_bytes((dense_ckpt / ".metadata").read_bytes())


def test_changed_file_is_a_miss(dense_ckpt: Path, tmp_path: Path, cache: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    first = CheckpointDir(ck).metadata
    import pickle

    from tests.fixtures.hostile import write_torch_metadata

    with open(ck / ".metadata", "rb") as f:
        tmd = pickle.load(f)  # torch's own objects (trusted: our fixture)
    key = next(iter(tmd.state_dict_metadata))
    del tmd.state_dict_metadata[key]
    write_torch_metadata(ck, tmd)
    second = CheckpointDir(ck).metadata
    assert key in first.entries and key not in second.entries
    assert second == parse_metadata_bytes((ck / ".metadata").read_bytes())
    assert len(_entries(cache)) == 2


def _damage(blob: bytes, how: str) -> bytes:
    if how == "truncated":
        return blob[: len(blob) // 2]
    if how == "empty":
        return b""
    if how == "garbage":
        return os.urandom(len(blob))
    if how == "flipped":
        b = bytearray(blob)
        b[len(b) // 2] ^= 0x01
        return bytes(b)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "flipped"])
def test_damaged_entry_is_ignored_and_rebuilt(how: str, fsdp_ckpt: Path, cache: Path) -> None:
    expected = parse_metadata_bytes((fsdp_ckpt / ".metadata").read_bytes())
    CheckpointDir(fsdp_ckpt).close()
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    entry.write_bytes(_damage(good, how))
    assert CheckpointDir(fsdp_ckpt).metadata == expected
    assert entry.read_bytes() == good  # rebuilt


def _forge(md: CheckpointMetadata, data: bytes, edit: str) -> bytes:
    """An entry with a valid checksum whose content the unpickler would have refused."""
    from array import array

    digest = hashlib.sha256(data).hexdigest()
    blob = encode(md, digest, len(data))[:-16]  # less its xxh3-128 trailer
    head_len = int.from_bytes(blob[8:16], "little")
    header = json.loads(blob[16 : 16 + head_len])
    flat = array("q")
    flat.frombytes(blob[16 + head_len :])
    cols, pos = {}, 0
    for name, n in zip(mdcache._COLUMNS, header["columns"]):
        cols[name] = flat[pos : pos + n]
        pos += n
    if edit == "string id":
        cols["entry_key"][0] = -1  # Python would index the last string
    elif edit == "huge dim":
        cols["layout_dims"][0] = 2**63 - 1
    elif edit == "dtype":
        header["strings"][cols["layout_dtype"][0]] = "not_a_dtype"
    elif edit == "other bytes":
        header["sha256"] = "0" * 64
    elif edit == "parser":
        header["parser"] = mdcache.PARSER_VERSION + 1
    elif edit == "planner":
        cols["planner_key"][0] = len(header["strings"])
    elif edit == "storage range":
        cols["storage_offset"][0] = -5
    elif edit == "chunk count":
        cols["layout_nchunks"][0] += 1
    elif edit == "storage key twice":
        cols["storage_fqn"][1], cols["storage_tuple"][1] = cols["storage_fqn"][0], cols["storage_tuple"][0]
    elif edit == "storage fqn id":
        cols["storage_fqn"][0] = len(header["strings"])
    elif edit == "string twice":  # record 0's fqn again, named by record 1: one fqn under two string ids
        header["strings"].append(header["strings"][cols["storage_fqn"][0]])
        cols["storage_fqn"][1] = len(header["strings"]) - 1
    elif edit == "tuple twice":
        n = cols["tuple_ndim"][0]
        cols["tuple_ndim"].append(n)
        cols["tuple_dims"].extend(cols["tuple_dims"][:n])
    header["columns"] = [len(cols[n]) for n in mdcache._COLUMNS]
    head = json.dumps(header).encode()
    body = blob[:8] + len(head).to_bytes(8, "little") + head + b"".join(cols[n].tobytes() for n in mdcache._COLUMNS)
    return body + xxhash.xxh3_128_digest(body)


@pytest.mark.parametrize(
    "edit",
    [
        *("string id", "huge dim", "dtype", "other bytes", "parser", "planner", "storage range", "chunk count"),
        *("storage key twice", "storage fqn id", "string twice", "tuple twice"),
    ],
)
def test_forged_entry_is_refused(edit: str, dense_ckpt: Path) -> None:
    data = (dense_ckpt / ".metadata").read_bytes()
    md = parse_metadata_bytes(data)
    assert md.planner_data and next(iter(md.entries.values())).__class__.__name__ == "TensorMeta"
    with pytest.raises(CorruptEntry) as refused:
        decode(_forge(md, data, edit), hashlib.sha256(data).hexdigest(), len(data))
    assert "checksum" not in str(refused.value)  # refused for the edit, past the (recomputed) trailer


def test_trailer_is_the_xxh3_128_of_the_entry_and_an_older_format_is_refused(dense_ckpt: Path) -> None:
    data = (dense_ckpt / ".metadata").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    md = parse_metadata_bytes(data)
    blob = encode(md, digest, len(data))
    assert blob[:8] == b"CKPTMDC2" and blob[-16:] == xxhash.xxh3_128_digest(blob[:-16])
    assert decode(blob, digest, len(data)) == md
    # format 2 (b"CKPTMDC1", a SHA-256 trailer), as the previous version wrote it: not decoded
    head_len = int.from_bytes(blob[8:16], "little")
    header = json.loads(blob[16 : 16 + head_len])
    header["format"] = 2
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"CKPTMDC1" + len(head).to_bytes(8, "little") + head + blob[16 + head_len : -16]
    for old in (
        body + hashlib.sha256(body).digest(),
        b"CKPTMDC2" + body[8:] + xxhash.xxh3_128_digest(b"CKPTMDC2" + body[8:]),
    ):
        with pytest.raises(CorruptEntry):
            decode(old, digest, len(data))


def test_chunk_outside_its_tensor_is_refused(dense_ckpt: Path) -> None:
    data = (dense_ckpt / ".metadata").read_bytes()
    md = parse_metadata_bytes(data)
    key, meta = next((k, m) for k, m in md.entries.items() if getattr(m, "size", ()) and m.size[0] > 1)  # type: ignore[union-attr]
    bad_chunk = meta.chunks[0]._replace(offsets=(1,) + meta.chunks[0].offsets[1:])  # type: ignore[union-attr]
    bad = CheckpointMetadata(
        {**md.entries, key: type(meta)(meta.dtype, meta.size, (bad_chunk,))},  # type: ignore[union-attr,call-arg]
        md.storage,
        md.planner_data,
        md.version,
    )
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(CorruptEntry, match="outside"):
        decode(encode(bad, digest, len(data)), digest, len(data))


def test_unusable_cache_dir_is_not_an_error(
    dense_ckpt: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = parse_metadata_bytes((dense_ckpt / ".metadata").read_bytes())
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(not_a_dir))
    assert CheckpointDir(dense_ckpt).metadata == expected
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(ro))
    try:
        assert CheckpointDir(dense_ckpt).metadata == expected
        if os.geteuid() != 0:  # root writes anywhere
            assert not any(ro.rglob("*.ckmd"))
    finally:
        ro.chmod(stat.S_IRWXU)


def test_cache_is_never_written_in_the_checkpoint(dense_ckpt: Path, tmp_path: Path, cache: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    before = sorted((p.relative_to(ck), p.stat().st_size, p.stat().st_mtime_ns) for p in ck.rglob("*"))
    for _ in range(2):
        _inspect_json(ck)
        usercache.set_cache_enabled(None)
    assert sorted((p.relative_to(ck), p.stat().st_size, p.stat().st_mtime_ns) for p in ck.rglob("*")) == before
    assert len(_entries(cache)) == 1


def test_location_and_switches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(usercache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert usercache.cache_dir() == tmp_path / "xdg" / "ckpttool"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert usercache.cache_dir() == tmp_path / "home" / ".cache" / "ckpttool"
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "given"))
    assert mdcache.entry_path("ab").parent == tmp_path / "given" / "metadata-v2"
    monkeypatch.setenv(usercache.NO_CACHE_ENV, "1")
    assert not usercache.cache_enabled()
    monkeypatch.setenv(usercache.NO_CACHE_ENV, "0")
    assert usercache.cache_enabled()
    for off in ("false", "False", "no", "off", " "):  # "NO_CACHE=false" means the cache is on
        monkeypatch.setenv(usercache.NO_CACHE_ENV, off)
        assert usercache.cache_enabled(), off
    for on in ("true", "yes", "2"):
        monkeypatch.setenv(usercache.NO_CACHE_ENV, on)
        assert not usercache.cache_enabled(), on
    usercache.set_cache_enabled(False)
    try:
        assert not usercache.cache_enabled()
    finally:
        usercache.set_cache_enabled(None)


def test_small_metadata_is_parsed_directly(sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(usercache.CACHE_DIR_ENV, str(tmp_path / "c"))
    assert (sample_ckpt / ".metadata").stat().st_size < mdcache.MIN_CACHED_BYTES
    CheckpointDir(sample_ckpt).close()
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("edit", ["string id", "huge dim", "planner", "storage range"])
def test_forged_entry_after_the_bytes_were_freed_is_ignored(
    edit: str, dense_ckpt: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the .metadata bytes are freed once an entry's checksum and header match: an entry that fails a
    # later check makes the file be read again and parsed, the same result as without the cache
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    data = (dense_ckpt / ".metadata").read_bytes()
    md = parse_metadata_bytes(data)
    path = mdcache.entry_path(hashlib.sha256(data).hexdigest())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_forge(md, data, edit))
    reads: list[int] = []

    def reread() -> bytes:
        reads.append(1)
        return data

    assert mdcache.parse_metadata_taken([data], ".metadata", reread) == md
    assert reads == [1]
    assert mdcache.decode(path.read_bytes(), hashlib.sha256(data).hexdigest(), len(data)) == md  # rebuilt
    holder = [data]
    assert mdcache.parse_metadata_taken(holder, ".metadata", reread) == md and holder == []
    assert reads == [1]  # a good entry: never read again


def test_file_changed_before_the_reread_is_parsed_and_not_cached(
    dense_ckpt: Path, fsdp_ckpt: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    data = (dense_ckpt / ".metadata").read_bytes()
    other = (fsdp_ckpt / ".metadata").read_bytes()
    md = parse_metadata_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    path = mdcache.entry_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    forged = _forge(md, data, "huge dim")
    path.write_bytes(forged)
    assert mdcache.parse_metadata_taken([data], ".metadata", lambda: other) == parse_metadata_bytes(other)
    assert path.read_bytes() == forged  # never replaced by an entry of other bytes under this key


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("special", SPECIAL_KINDS)
def test_a_special_file_as_entry_is_ignored_without_blocking(special: str, dense_ckpt: Path, cache: Path) -> None:
    data = (dense_ckpt / ".metadata").read_bytes()
    path = mdcache.entry_path(hashlib.sha256(data).hexdigest())
    path.parent.mkdir(parents=True)
    make_special(path, special)
    with fails_instead_of_hanging():
        assert CheckpointDir(dense_ckpt).metadata == parse_metadata_bytes(data)


def test_no_cache_holds_for_its_own_invocation_only(sample_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-cache`` switches the caches off for the command it is given to; the next command in the same
    process (a library user running the CLI in process, the test suite) has them on again."""
    monkeypatch.delenv(usercache.NO_CACHE_ENV, raising=False)
    assert CliRunner().invoke(app, ["--no-cache", "inspect", str(sample_ckpt)]).exit_code == 0
    assert not usercache.cache_enabled()
    assert CliRunner().invoke(app, ["inspect", str(sample_ckpt)]).exit_code == 0
    assert usercache.cache_enabled()
