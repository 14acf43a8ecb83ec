"""Checkpoints in object storage: every reading command from ``s3://``, export/reshard to ``s3://``.

Against a real S3-compatible server on 127.0.0.1 (moto's standalone server, ``s3_server``);
checkpoints are uploaded with boto3 (an independent client) and outputs downloaded with it.
Outputs are compared byte for byte with the local run of the same command.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.commands.schema import load_schema
from ckpttool.errors import PathEscapeError, RemoteStorageError
from ckpttool.format.storage import confine_key, parse_storage_options, redact, storage_config
from tests.fixtures import s3 as s3fx
from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.damage import corrupt_chunk_bytes, edit_storage
from tests.fixtures.dcp_equal import assert_same_state

runner = CliRunner()


def cli(server: Any, *args: str, endpoint: str | None = None) -> Any:
    opts = server.cli_options()
    if endpoint is not None:
        opts[1] = f"client_kwargs.endpoint_url={endpoint}"
    return runner.invoke(app, [*opts, *args])


def upload(server: Any, local: Path) -> str:
    return server.upload_dir(local, "ckpts", f"t-{uuid.uuid4().hex[:8]}")


def download(s3_server: Any, bucket: str, prefix: str, local: Path) -> dict[str, bytes]:
    """``s3_server.download_dir`` but ckpttool's marker (compared with :func:`files_of`)."""
    got = s3_server.download_dir(bucket, prefix, local)
    return {k: v for k, v in got.items() if k != ".ckpttool-output.json"}


def files_of(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` but ckpttool's marker (its token and pid differ from run to run)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() != ".ckpttool-output.json"
    }


# ------------------------------------------------------------------ confinement and options (no server)
@pytest.mark.parametrize(
    "rel",
    [
        "",
        "../x.distcp",
        "a/../../x",
        "/etc/passwd",
        "s3://other/x",
        "other:x",
        "a\\..\\x",
        "a\x00b",
        "./x",
        "a//b",
        "a/.",
    ],
)
def test_relative_paths_that_could_leave_the_prefix_are_refused(rel: str) -> None:
    with pytest.raises(PathEscapeError):
        confine_key("bucket/run/step-1", rel, shown="s3://bucket/run/step-1")


def test_confined_key_is_below_the_prefix() -> None:
    assert confine_key("bucket/run", "extra_state/x.pt", shown="s") == "bucket/run/extra_state/x.pt"


def test_storage_options_nest_and_convert_and_are_redacted() -> None:
    opts = parse_storage_options(
        ["anon=false", "client_kwargs.endpoint_url=http://h:1", "retries=3", "secret=abcd1234"]
    )
    assert opts == {"anon": False, "client_kwargs": {"endpoint_url": "http://h:1"}, "retries": 3, "secret": "abcd1234"}
    assert "abcd1234" not in redact("signature abcd1234 failed", opts)
    # an endpoint names a place (shown, so a wrong one can be seen), unless it carries credentials
    assert redact("cannot reach http://h:1/bkt", opts) == "cannot reach http://h:1/bkt"
    with_user = {"client_kwargs": {"endpoint_url": "http://u:pw12@h:1"}}
    assert redact("cannot reach http://u:pw12@h:1/bkt", with_user) == "cannot reach ***/bkt"
    with pytest.raises(RemoteStorageError):
        parse_storage_options(["novalue"])


def test_botocore_makes_one_request_per_attempt() -> None:
    """--remote-retries is the only retry budget (docs/storage.md): botocore's `retries.max_attempts` 1 counts the
    retries, so every attempt was two requests (a silent endpoint took twice --remote-retries x --remote-timeout,
    and --remote-retries 1 still retried); the client ckpttool builds now has `total_max_attempts` 1, and a
    retries setting of the user's is kept."""
    if s3fx.missing():
        pytest.skip(s3fx.missing())
    from ckpttool.format.storage import RemoteStore

    endpoint = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "k", "secret": "s"}
    for options, attempts in (
        (endpoint, 1),
        ({**endpoint, "config_kwargs": {"retries": {"total_max_attempts": 3}}}, 3),
    ):
        with storage_config(options=options):
            fs = RemoteStore("s3://bkt/ck").fs
            fs.connect()  # builds the botocore client; no request
            assert fs.s3.meta.config.retries["total_max_attempts"] == attempts


# ------------------------------------------------------------------ reads
def test_inspect_reads_only_metadata_and_shown_items(sample_ckpt: Path, s3_server: Any) -> None:
    url = upload(s3_server, sample_ckpt)
    remote = cli(s3_server, "inspect", url, "--json")
    assert remote.exit_code == 0, remote.output
    local = runner.invoke(app, ["inspect", str(sample_ckpt), "--json"])
    r, loc = json.loads(remote.stdout), json.loads(local.stdout)
    jsonschema.validate(r, load_schema("inspect"))
    stats = r.pop("storage")
    for d in (r, loc):
        d.pop("path"), d.pop("location")
    assert r == loc
    # .metadata + the byte items shown + extra_state files: never a byte of a .distcp file
    shown = sum(b["bytes"] for b in loc["byte_items"]) + sum(f["size"] for f in loc["extra_state"])
    md = (sample_ckpt / ".metadata").stat().st_size
    assert stats["bytes_requested"] == md + shown
    assert stats["bytes_requested"] < sum(f["size"] for f in loc["files"])
    assert stats["requests"] == 2 + len(loc["byte_items"]) + len(loc["extra_state"])  # listing + .metadata + items


def test_validate_deep_from_s3_equals_local(sample_ckpt: Path, s3_server: Any) -> None:
    url = upload(s3_server, sample_ckpt)
    remote = cli(s3_server, "validate", url, "--deep", "--json")
    local = runner.invoke(app, ["validate", str(sample_ckpt), "--deep", "--json"])
    assert remote.exit_code == local.exit_code == 0, remote.output
    r, loc = json.loads(remote.stdout), json.loads(local.stdout)
    assert r["findings"] == loc["findings"]
    assert r["stats"]["bytes_read"] == loc["stats"]["bytes_read"]


def test_validate_deep_finds_a_damaged_remote_chunk(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    bad = copy_checkpoint(sample_ckpt, tmp_path / "bad")
    corrupt_chunk_bytes(bad, "model.model.embed_tokens.weight")
    url = upload(s3_server, bad)
    r = cli(s3_server, "validate", url, "--deep")
    assert r.exit_code != 0
    assert "model.model.embed_tokens.weight" in r.output


def test_replay_step_from_s3(sample_ckpt: Path, s3_server: Any) -> None:
    url = upload(s3_server, sample_ckpt)
    r = cli(s3_server, "replay-step", url)
    assert r.exit_code == 0, r.output


def test_storage_path_escaping_the_prefix_is_refused(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    bad = copy_checkpoint(sample_ckpt, tmp_path / "esc")
    edit_storage(bad, "model.model.embed_tokens.weight", relative_path="../other/__0_0.distcp")
    url = upload(s3_server, bad)
    r = cli(s3_server, "export", url, str(tmp_path / "out"))
    assert r.exit_code == 2
    assert "[E101]" in r.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ writes
def test_export_from_and_to_s3_is_bitwise_the_local_export(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, sample_ckpt)
    args = ["--save-dtype", "float32", "--shard-size", "100KB"]
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local"), *args]).exit_code == 0
    r = cli(s3_server, "export", url, str(tmp_path / "from_s3"), *args)
    assert r.exit_code == 0, r.output
    out = url + "-hf"
    r = cli(s3_server, "export", url, out, *args)
    assert r.exit_code == 0, r.output
    want = files_of(tmp_path / "local")
    assert len(want) > 2
    assert files_of(tmp_path / "from_s3") == want
    assert download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / "dl") == want
    assert not [k for k in s3_server.keys("ckpts") if "ckpttool-tmp" in k]  # the temporary prefix is gone
    # an existing output: refused without --overwrite, replaced with it
    assert cli(s3_server, "export", url, out, *args).exit_code == 2
    r = cli(s3_server, "export", url, out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / "dl2")) == [
        "config.json",
        "model.safetensors",
    ] or "model.safetensors" in download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / "dl3")


def test_reshard_s3_to_s3_is_bitwise_the_local_reshard(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, sample_ckpt)
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    local = runner.invoke(app, ["reshard", str(sample_ckpt), str(tmp_path / "local"), *args])
    assert local.exit_code == 0, local.output
    out = url + "-rs"
    r = cli(s3_server, "reshard", url, out, *args)
    assert r.exit_code == 0, r.output
    got = download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / "dl")
    want = files_of(tmp_path / "local")
    assert sorted(got) == sorted(want)
    # torch.save archives carry a random serialization id per run: compare what torch loads
    assert_same_state(tmp_path / "dl", tmp_path / "local", tmp_path)
    # and the resharded output reads back from s3
    assert cli(s3_server, "validate", out, "--deep").exit_code == 0


# ------------------------------------------------------------------ failures
def test_diff_of_a_remote_checkpoint_is_the_diff_of_its_local_copy(s3_server: Any, tmp_path: Path) -> None:
    """diff s3://... (was E610 'diff compares local checkpoints only'): a remote checkpoint against its local copy
    is equal, against another save it names the tensors that differ, as diff of the two local folders does."""
    import torch
    import torch.distributed.checkpoint as dcp

    for name, seed in (("a", 0), ("b", 1)):
        g = torch.Generator().manual_seed(seed)
        state = {"model": {"w": torch.randn(16, 8, generator=g), "bias": torch.zeros(8)}}
        dcp.save(state, checkpoint_id=tmp_path / name, no_dist=True)
    url = upload(s3_server, tmp_path / "a")

    def verdict(*args: str) -> dict[str, Any]:
        r = cli(s3_server, "--json", "diff", *args) if any("://" in a for a in args) else None
        r = r or runner.invoke(app, ["--json", "diff", *args])
        assert r.exit_code in (0, 1), r.output
        doc = json.loads(r.stdout)
        return {"exit": r.exit_code, "equal": doc["equal"], "counts": doc["counts"], "tensors": doc["tensors"]}

    same = verdict(url, str(tmp_path / "a"))
    assert same == verdict(str(tmp_path / "a"), str(tmp_path / "a")) and same["exit"] == 0 and same["equal"]
    other = verdict(url, str(tmp_path / "b"))
    assert other == verdict(str(tmp_path / "a"), str(tmp_path / "b")) and other["exit"] == 1
    assert other["counts"]["different"] == 1  # model.w; the zero bias is equal
    assert verdict(str(tmp_path / "b"), url) == verdict(str(tmp_path / "b"), str(tmp_path / "a"))


def test_diff_all_with_a_remote_side_names_the_files_beside_it_that_were_not_compared(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """``diff --what all`` of a checkpoint against a copy whose ``extra_state`` differs: two local folders give a note
    and "equal; files beside the checkpoints differ"; with the copy in a bucket (its files beside are not fetched) the
    verdict was a bare "equal", claiming files it never read. It now names them and says they were not compared."""
    copy = copy_checkpoint(sample_ckpt, tmp_path / "copy")
    state = copy / "extra_state" / "extra_state_rank_0.pt"
    state.write_bytes(state.read_bytes() + b"\0")
    local = runner.invoke(app, ["diff", str(sample_ckpt), str(copy), "--what", "all"])
    assert local.exit_code == 0 and "files beside the checkpoints differ" in local.output, local.output
    url = upload(s3_server, copy)
    r = cli(s3_server, "diff", str(sample_ckpt), url, "--what", "all")
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1].startswith("equal; files beside the checkpoints not compared (note above)")
    doc = json.loads(cli(s3_server, "--json", "diff", str(sample_ckpt), url, "--what", "all").stdout)
    assert doc["equal"]
    (note,) = [n for n in doc["notes"] if n.startswith("files beside the checkpoints not compared: ")]
    beside = "extra_state/extra_state_rank_0.pt, model_assets/config.json"
    assert f"2 beside A ({beside}); 2 beside B ({beside})" in note, note
    assert f"the files beside B ({url}) are not fetched: copy it to a local directory and diff that" in note, note
    both = json.loads(
        cli(s3_server, "--json", "diff", url, url2 := upload(s3_server, sample_ckpt), "--what", "all").stdout
    )
    (note,) = [n for n in both["notes"] if n.startswith("files beside the checkpoints not compared: ")]
    assert f"beside A ({url}) and B ({url2}) are not fetched: copy them to local directories and diff those" in note
    # the model alone (no files beside compared, local or not): unchanged
    model = cli(s3_server, "--json", "diff", str(sample_ckpt), url)
    assert not [n for n in json.loads(model.stdout)["notes"] if "files beside" in n]


def test_diff_of_a_remote_checkpoint_holds_one_tensor_in_the_spool(s3_server: Any, tmp_path: Path) -> None:
    """diff of a remote side fetched each window as it was read and kept every one until the end (the spool in
    $TMPDIR grew to the bytes of all compared tensors); it now holds one tensor's windows at a time."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.diff import diff_checkpoints

    g = torch.Generator().manual_seed(0)
    dcp.save({f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}, checkpoint_id=tmp_path / "a", no_dist=True)
    url = upload(s3_server, tmp_path / "a")
    with storage_config(options=s3_server.options()):
        with open_checkpoint(url) as remote:
            windows = [i.length for i in remote.reader.metadata.storage.values()]
            assert diff_checkpoints(remote, tmp_path / "a").equal
            peak = remote.reader.spool_peak()
    assert peak is not None and max(windows) <= peak <= max(windows) + 4096 < sum(windows)


def test_stats_of_a_remote_checkpoint_gives_each_measured_chunk_back_to_the_spool(
    s3_server: Any, tmp_path: Path
) -> None:
    """stats of a remote checkpoint kept every chunk window it measured in the $TMPDIR spool until it ended (the
    whole checkpoint's tensor bytes on local disk); each window is evicted once measured, and the figures are
    those of the local copy."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.stats import StatsOptions, collect_stats

    g = torch.Generator().manual_seed(0)
    dcp.save({f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}, checkpoint_id=tmp_path / "a", no_dist=True)
    url = upload(s3_server, tmp_path / "a")
    opts = StatsOptions(workers=1)
    with storage_config(options=s3_server.options()):
        with open_checkpoint(url) as remote:
            windows = [i.length for i in remote.reader.metadata.storage.values()]
            got = collect_stats(remote, opts).to_dict()
            peak = remote.reader.spool_peak()
    assert peak is not None and max(windows) <= peak < sum(windows)
    want = collect_stats(tmp_path / "a", opts).to_dict()
    assert got["checkpoints"][0]["tensors"] == want["checkpoints"][0]["tensors"]


def test_manifest_of_a_remote_checkpoint_gives_each_hashed_window_back_to_the_spool(
    s3_server: Any, tmp_path: Path
) -> None:
    """manifest (and --verify) of a remote checkpoint kept every chunk window it hashed in the $TMPDIR spool until
    it ended; each is evicted once digested, and the entries are those of the local copy's manifest."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.manifest import _WORKERS, build_manifest, verify_manifest

    g = torch.Generator().manual_seed(0)
    n = _WORKERS + 4
    dcp.save({f"w{i}": torch.randn(64, 64, generator=g) for i in range(n)}, checkpoint_id=tmp_path / "a", no_dist=True)
    url = upload(s3_server, tmp_path / "a")
    with open_checkpoint(tmp_path / "a") as local:
        want = build_manifest(local.reader).to_dict()["entries"]
    with storage_config(options=s3_server.options()):
        for check in (False, True):
            with open_checkpoint(url) as remote:
                windows = [i.length for i in remote.reader.metadata.storage.values()]
                man = build_manifest(remote.reader)
                assert man.to_dict()["entries"] == want
                if check:
                    assert verify_manifest(remote.reader, man) == []
                peak = remote.reader.spool_peak()
            assert peak is not None and max(windows) <= peak <= _WORKERS * max(windows) < sum(windows)


def test_dropped_connections_are_retried(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, sample_ckpt)
    proxy = s3fx.DroppingProxy(s3_server.port)
    try:
        proxy.drop = 3
        r = cli(s3_server, "export", url, str(tmp_path / "out"), endpoint=proxy.endpoint)
        assert r.exit_code == 0, r.output
        assert proxy.drop == 0
    finally:
        proxy.close()
    want = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local")])
    assert want.exit_code == 0
    assert files_of(tmp_path / "out") == files_of(tmp_path / "local")


def test_outage_mid_run_fails_with_a_code_and_publishes_nothing(sample_ckpt: Path, s3_server: Any) -> None:
    from ckpttool.errors import RemoteTransientError
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.export import export_checkpoint

    url = upload(s3_server, sample_ckpt)
    out = url + "-out"
    proxy = s3fx.DroppingProxy(s3_server.port)
    opts = {**s3_server.options(), "client_kwargs": {"endpoint_url": proxy.endpoint}}
    opts["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2}
    try:
        with storage_config(options=opts, retries=2, backoff_s=0.01):
            ckpt = open_checkpoint(url)  # .metadata read; then the store goes away
            try:
                proxy.drop = -1
                with pytest.raises(RemoteTransientError) as exc:
                    export_checkpoint(ckpt, out)
            finally:
                ckpt.close()
    finally:
        proxy.close()
    assert exc.value.code == "E144"
    assert s3fx.SECRET not in str(exc.value) + exc.value.hint
    prefix = out.split("/", 3)[3]
    assert not [k for k in s3_server.keys("ckpts") if k.startswith(prefix) or "ckpttool-tmp" in k]


def test_a_store_that_keeps_throttling_is_e143_after_the_retries(s3_server: Any) -> None:
    """An endpoint that answers every request with S3's ``503 SlowDown`` (a real HTTP server, the real s3fs and
    botocore client): exit 2, one ``E143`` line naming the URL and the attempts, nothing on stdout
    (docs/errors.md: the store kept throttling through every retry)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'

    class SlowDown(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = _reply

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowDown)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        r = cli(s3_server, "--remote-retries", "2", "inspect", "s3://ckpts/throttled/step-1", endpoint=endpoint)
    finally:
        server.shutdown()
        server.server_close()
    assert r.exit_code == 2 and r.stdout == "", r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: [E143] s3://ckpts/throttled/step-1"), r.stderr
    assert "still throttled after 2 attempt(s)" in lines[0] and lines[1].startswith("hint: ")


def test_secrets_never_in_logs_or_errors(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, sample_ckpt)
    ok = cli(s3_server, "-vv", "export", url, str(tmp_path / "out"))
    assert ok.exit_code == 0, ok.output
    bad = cli(s3_server, "-vv", "--remote-retries", "1", "inspect", url, endpoint="http://127.0.0.1:9")
    assert bad.exit_code == 2 and "[E14" in bad.output
    assert "127.0.0.1:9" in bad.output, bad.output  # the endpoint that failed is named (not a secret)
    for r in (ok, bad):
        assert s3fx.SECRET not in r.output
        assert s3fx.SECRET not in (r.stderr or "")


def test_an_https_endpoint_on_a_plain_http_port_fails_at_once_naming_the_endpoint(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """A wrong endpoint (``https://`` for moto's plain-HTTP port): one connection, one line ``E140`` saying the
    endpoint does not speak TLS and how to fix it; not retried --remote-retries times as a network blip (was
    ``E144`` "failed after 5 attempt(s)", hint "run again"), and nothing written."""
    url = upload(s3_server, sample_ckpt)
    proxy = s3fx.DroppingProxy(s3_server.port)  # forwards every byte; counts the connections
    try:
        r = cli(
            s3_server,
            "--remote-retries",
            "5",
            "export",
            url,
            str(tmp_path / "out"),
            endpoint=f"https://127.0.0.1:{proxy.port}",
        )
        seen = proxy.seen
    finally:
        proxy.close()
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"error: [E140] {url}: listing: the endpoint cannot be used: it does not speak TLS"), (
        r.output
    )
    assert f"https://127.0.0.1:{proxy.port}" in lines[0] and "not retried" in lines[0]
    assert lines[1].startswith("hint: check the endpoint (--storage-option client_kwargs.endpoint_url=URL")
    assert len(lines) == 2 and "Traceback" not in r.output
    assert seen == 1  # one attempt
    assert not (tmp_path / "out").exists()


def test_an_endpoint_whose_host_does_not_resolve_fails_at_once(sample_ckpt: Path, s3_server: Any) -> None:
    """``client_kwargs.endpoint_url`` naming a host that does not exist (``.invalid``, RFC 6761): one line ``E140``
    saying its host name does not resolve, not retried (was ``E144`` after 5 attempts, "check the network")."""
    import socket

    host = "no-such-host.ckpttool.invalid"
    try:
        socket.getaddrinfo(host, 9000)
        pytest.skip(f"{host} resolves here")
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:
            pytest.skip(f"the resolver answers {e} for {host} (not 'no such name')")
    url = upload(s3_server, sample_ckpt)
    r = cli(s3_server, "--remote-retries", "5", "inspect", url, endpoint=f"http://{host}:9000")
    assert r.exit_code == 2, r.output
    first = r.output.strip().splitlines()[0]
    assert first.startswith(
        f"error: [E140] {url}: listing: the endpoint cannot be used: its host name does not resolve"
    )
    assert "not retried" in first and host in first and "Traceback" not in r.output


def test_missing_prefix_is_not_found(s3_server: Any) -> None:
    s3_server.bucket("ckpts")
    r = cli(s3_server, "inspect", "s3://ckpts/no/such/prefix")
    assert r.exit_code == 2 and "[E141]" in r.output


def test_a_url_with_a_dot_dot_component_is_refused_naming_the_prefix_meant(sample_ckpt: Path, s3_server: Any) -> None:
    """`..` in a URL is part of an S3 key, not the parent prefix: reading `s3://b/run/../run/step-3` was E141 'no
    object below this prefix' (the checkpoint is there), and `export ... s3://b/x/../hf` wrote objects whose keys
    hold `x/../hf/` (and was refused as overlapping a source at `s3://b/x`). Now E140 naming the URL, the hint the
    prefix meant; nothing written."""
    url = upload(s3_server, sample_ckpt)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    read = cli(s3_server, "inspect", f"s3://{bucket}/{prefix}/../{prefix}")
    out = f"s3://{bucket}/{prefix}/../hf-{uuid.uuid4().hex[:8]}"
    write = cli(s3_server, "export", url, out)
    for r, given in ((read, f"s3://{bucket}/{prefix}/../{prefix}"), (write, out)):
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.startswith(f"error: [E140] {given}: "), r.output
        assert "'..'" in r.output
    assert f"hint: name the prefix itself: {url}\n" in read.output
    assert not any(".." in k for k in s3_server.keys(bucket))


def test_a_url_with_version_id_in_its_key_is_refused_not_read_or_written_at_the_cut_key(
    sample_ckpt: Path, s3_server: Any
) -> None:
    """``?versionId=`` in a key is an object version to s3fs, which cuts the key there: a checkpoint uploaded below
    ``p?versionId=x/step-1`` was said to hold no object (E141, a false statement) and an export to
    ``q?versionId=y/out`` uploaded its files as the one object ``q`` until the copy failed (E144 after every retry,
    hint "check the network"). Both are E140 before any request, the hint saying what to do; nothing is written."""
    bucket = s3_server.bucket("ckpts")
    tag = uuid.uuid4().hex[:8]
    src = s3_server.upload_dir(sample_ckpt, bucket, f"p{tag}?versionId=x/step-1")
    plain = upload(s3_server, sample_ckpt)
    before = s3_server.keys(bucket)
    out = f"s3://{bucket}/q{tag}?versionId=y/out"
    for args, url in ((["inspect", src], src), (["validate", "--deep", src], src), (["export", plain, out], out)):
        r = cli(s3_server, *args)
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert lines[0].startswith(f"error: [E140] {url}: '?versionId=' in an s3:// URL"), r.output
        assert lines[1].startswith("hint: copy or move the objects to a prefix without '?versionId='"), r.output
        assert len(lines) == 2, r.output
    assert s3_server.keys(bucket) == before


def test_a_dot_dot_url_leaving_its_bucket_is_refused_without_naming_another_bucket(s3_server: Any) -> None:
    """`s3://b/..` hinted 'name the prefix itself: s3://' (no bucket) and `s3://b/../c` 's3://c', another bucket the
    user never named. The hint now says a '..' cannot leave the bucket; a '..' inside it still names the prefix."""
    s3_server.bucket("ckpts")
    for url in ("s3://ckpts/..", "s3://ckpts/../other/run", "s3://ckpts/a/../../b"):
        r = cli(s3_server, "inspect", url)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.startswith(f"error: [E140] {url}: "), r.output
        assert "hint: a '..' cannot leave the bucket: name the bucket and the prefix inside it\n" in r.output, r.output
    r = cli(s3_server, "inspect", "s3://ckpts/a/../b/")
    assert r.exit_code == 2 and "hint: name the prefix itself: s3://ckpts/b\n" in r.output, r.output


def test_a_url_with_an_empty_or_dot_component_is_refused_not_read_as_another_prefix(
    s3_server: Any, tmp_path: Path
) -> None:
    """torch's own FsspecWriter to `s3://b//run` writes the keys `/run/...` (S3 keeps the empty component), and
    dcp.load from that URL reads them back. ckpttool collapsed the URL to `s3://b/run` and reported another
    checkpoint saved there (stats: all zeros, exit 0), and `export ... s3://b//hf` wrote to `s3://b/hf`. Now E140
    naming the URL as given, the hint the prefix without the component; nothing read, nothing written."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    bucket, name = s3_server.bucket("ckpts"), f"t-{uuid.uuid4().hex[:8]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, storage_writer=FsspecWriter(f"s3://{bucket}//{name}", **s3_server.options()))
        dcp.save({"w": torch.zeros(4)}, storage_writer=FsspecWriter(f"s3://{bucket}/{name}", **s3_server.options()))
    assert f"/{name}/.metadata" in s3_server.keys(bucket, "/")  # the writer kept the empty component
    before = s3_server.keys(bucket)
    for given in (f"s3://{bucket}//{name}", f"s3://{bucket}/./{name}"):
        for args in (
            ["stats", given],
            ["inspect", given],
            ["diff", given, f"s3://{bucket}/{name}"],
            ["export", f"s3://{bucket}/{name}", given + "-hf"],
            ["validate", f"s3://{bucket}/{name}", "--manifest", given + "/manifest.json"],
        ):
            r = cli(s3_server, *args)
            shown = next(a for a in args if a.startswith(given))
            assert r.exit_code == 2 and "Traceback" not in r.output, (args, r.output)
            assert r.stderr.startswith(f"error: [E140] {shown}: an empty or '.' component in a URL"), (args, r.output)
            meant = shown.replace("//" + name, "/" + name).replace("/./", "/")
            assert f"hint: name the prefix without it: {meant} " in r.stderr, r.output
            assert len(r.stderr.splitlines()) == 2
    assert s3_server.keys(bucket) == before
    # a trailing slash is no component
    r = cli(s3_server, "--json", "stats", f"s3://{bucket}/{name}/")
    assert r.exit_code == 0 and json.loads(r.stdout)["checkpoints"][0]["tensors"][0]["abs_max"] == 0.0


def test_a_remote_safetensors_export_is_refused_with_a_hint_that_says_so(sample_ckpt: Path, s3_server: Any) -> None:
    """`export CKPT s3://b/hf` then `diff s3://b/hf CKPT` (or inspect) was E200 with the hint 'pass the URL of the
    prefix that dcp.save wrote (it holds .metadata and __R_N.distcp)', about ckpttool's own export. The hint now
    says the prefix holds safetensors files, read from a local folder only; a prefix without them keeps its hint."""
    out = f"s3://ckpts/t-{uuid.uuid4().hex[:8]}-hf"
    s3_server.bucket("ckpts")
    assert cli(s3_server, "export", str(sample_ckpt), out).exit_code == 0
    for args in (["inspect", out], ["diff", out, str(sample_ckpt)]):
        r = cli(s3_server, *args)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.stderr.splitlines()[0].startswith(f"error: [E200] {out}: no .metadata object"), r.output
        assert r.stderr.splitlines()[1] == (
            "hint: it holds safetensors files (a Hugging Face save or a ckpttool export), which are read from a "
            "local folder only: copy the prefix to a local directory and pass that"
        )
    s3_server.client().put_object(Bucket="ckpts", Key=out.split("/", 3)[3] + "-notes/readme.txt", Body=b"notes")
    r = cli(s3_server, "inspect", out + "-notes")
    assert r.exit_code == 2 and "hint: pass the URL of the prefix that dcp.save wrote" in r.stderr, r.output


def test_url_of_an_object_names_its_prefix(sample_ckpt: Path, s3_server: Any) -> None:
    """The URL of a checkpoint's ``.metadata`` (copied from a console listing) said "no object below this prefix":
    it now says the URL is an object and names the prefix to pass."""
    url = upload(s3_server, sample_ckpt)
    r = cli(s3_server, "inspect", f"{url}/.metadata")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.stderr.startswith(f"error: [E141] {url}/.metadata: an object, not a prefix"), r.stderr
    assert f"hint: pass the URL of the checkpoint directory (the prefix holding .metadata): {url}" in r.stderr


def test_missing_credentials_are_a_permission_error(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No credentials anywhere (botocore's NoCredentialsError): E142 with the credentials hint, no install hint."""
    s3_server.bucket("ckpts")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.fspath(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = runner.invoke(
        app, ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint}", "inspect", "s3://ckpts/x"]
    )
    assert r.exit_code == 2 and "[E142]" in r.output and "credentials" in r.output
    assert "pip install" not in r.output and "Traceback" not in r.output


def test_a_profile_that_does_not_exist_is_a_credentials_error(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """AWS_PROFILE naming no profile (botocore's ProfileNotFound) was E140 'storage request failed' with the hint
    'check the URL and --storage-option', about a URL that was right; it is E142 with the credentials hint, one
    error line, at once."""
    import s3fs

    s3_server.bucket("ckpts")
    for var, value in s3_server.env().items():  # keys in the environment too: the profile is looked up first
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.fspath(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps a filesystem per options: one of an earlier environment
    try:
        got = [
            runner.invoke(app, ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint}", *args])
            for args in (["inspect", "s3://ckpts/x"], ["export", "s3://ckpts/x", "s3://ckpts/y"])
        ]
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # none of this environment is left to the tests after this one
    for r in got:
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        lines = r.stderr.splitlines()
        assert lines[0].startswith("error: [E142] s3://ckpts/x: listing: permission denied (ProfileNotFound: ")
        assert "no-such-profile" in lines[0] and len(lines) == 2
        assert lines[1] == (
            "hint: check the credentials (environment, config files, --storage-option) and the bucket policy"
        )


def test_a_policy_denying_the_data_objects_is_told_with_the_credentials_hint(sample_ckpt: Path, s3_server: Any) -> None:
    """An IAM user whose policy allows the listing and `.metadata` but not the data objects (moto's IAM enforcement
    on): `validate --deep` fails (exit 1, never OK) with its findings' hints on the credentials and the policy, not
    'the data file is damaged' / 'the stored bytes are damaged' of a corrupt chunk or byte item; `export` is E142
    naming the data object, with no output; `inspect` (it shows the byte items) E142 too."""
    import urllib.request

    import boto3

    url = upload(s3_server, sample_ckpt)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1", **_fake_keys())
    user = f"reader-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "*"},
            {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"arn:aws:s3:::{bucket}/{prefix}/.metadata"},
        ],
    }
    iam.put_user_policy(UserName=user, PolicyName="metadata-only", PolicyDocument=json.dumps(policy))
    opts = [
        "--storage-option",
        f"client_kwargs.endpoint_url={s3_server.endpoint}",
        "--storage-option",
        f"key={key['AccessKeyId']}",
        "--storage-option",
        f"secret={key['SecretAccessKey']}",
    ]

    def auth(count: str) -> None:  # moto enforces IAM from its `count`-th request on ("inf": never)
        req = urllib.request.Request(
            f"{s3_server.endpoint}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # flask leaves a form-encoded body out of request.data
        )
        urllib.request.urlopen(req, timeout=30).close()

    auth("0")
    try:
        deep = runner.invoke(app, [*opts, "validate", "--deep", "--json", url])
        export = runner.invoke(app, [*opts, "export", url, f"s3://{bucket}/out-{uuid.uuid4().hex[:8]}"])
        inspect = runner.invoke(app, [*opts, "inspect", url])
    finally:
        auth("inf")
    assert deep.exit_code == 1, deep.output
    doc = json.loads(deep.stdout)
    assert doc["ok"] is False
    by_rule = {f["code"]: f for f in doc["findings"]}
    for rule in ("S010", "S011", "S013"):
        assert by_rule[rule]["error_code"] == "E142", by_rule[rule]
        assert "permission denied" in by_rule[rule]["message"]
        assert by_rule[rule]["hint"].startswith("check the credentials"), by_rule[rule]
    for r in (export, inspect):
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert r.output.startswith(f"error: [E142] {url}/__0_0.distcp: permission denied"), r.output
    assert not any(k.startswith("out-") for k in s3_server.keys(bucket))


def _fake_keys() -> dict[str, str]:
    return {"aws_access_key_id": s3fx.KEY_ID, "aws_secret_access_key": s3fx.SECRET}


@pytest.mark.parametrize("url", ["zip://x::s3://b/y", "tar://x::file:///nonexistent", "dir://x/y"])
def test_chained_url_that_opens_a_file_is_one_error_line(url: str) -> None:
    """zip:// and tar:// filesystems open their target when built: an E999 (IsADirectoryError) became E140;
    dir:// (a wrapper of a filesystem and path it is not given) raised AttributeError when built: E999 too."""
    r = runner.invoke(app, ["inspect", url])
    assert r.exit_code == 2 and "[E140]" in r.stderr and "E999" not in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1


@pytest.mark.parametrize("host", ["", "localhost", "LOCALHOST"])
def test_file_url_is_the_local_path(sample_ckpt: Path, host: str) -> None:
    """``file:///p`` and ``file://localhost/p`` (RFC 8089) name the local ``/p``; ``localhost/p`` relative to the
    current directory was read before."""
    r = runner.invoke(app, ["inspect", f"file://{host}" + os.fspath(sample_ckpt), "--json"])
    assert r.exit_code == 0, r.output
    assert "storage" not in json.loads(r.stdout)


@pytest.mark.slow
def test_stamp_on_s3_writes_the_sidecar_a_local_stamp_writes(ep_suite: Path, s3_server: Any, tmp_path: Path) -> None:
    declared = ["--source-layout", "legacy", "--ep-size", "2", "--ep-fsdp-size", "2"]
    local = copy_checkpoint(ep_suite / "legacy", tmp_path / "legacy")
    url = upload(s3_server, local)
    assert runner.invoke(app, ["stamp", str(local), *declared]).exit_code == 0
    r = cli(s3_server, "stamp", url, *declared)
    assert r.exit_code == 0, r.output
    got = download(s3_server, "ckpts", url.split("/", 3)[3], tmp_path / "dl")
    assert json.loads(got["layout.json"]) == json.loads((local / "layout.json").read_text())
    doc = json.loads(cli(s3_server, "inspect", url, "--json").stdout)
    assert doc["layout"]["source"] == "sidecar"


@pytest.mark.heavy  # CI time
@pytest.mark.slow
def test_torchrun_export_from_s3_is_bitwise_the_local_export(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    from tests.ops.test_distributed import torchrun

    url = upload(s3_server, sample_ckpt)
    args = ["--shard-size", "60KB"]
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local"), *args]).exit_code == 0
    r = torchrun(2, *s3_server.cli_options(), "export", url, str(tmp_path / "many"), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert files_of(tmp_path / "many") == files_of(tmp_path / "local")


def test_import_to_s3_is_the_local_import(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    """`import HF s3://...` (plain and EP-pre-sharded): the same files as the local import, published atomically."""
    hf = tmp_path / "hf"
    assets = sample_ckpt / "model_assets"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--model-assets", str(assets)]).exit_code == 0
    base = upload(s3_server, hf)  # the bucket exists; the import writes beside the uploaded copy
    for extra in ([], ["--ep-size", "2", "--ep-fsdp-size", "2"]):
        name = "ep" if extra else "plain"
        local = runner.invoke(app, ["import", str(hf), str(tmp_path / name), *extra])
        assert local.exit_code == 0, local.output
        out = f"{base}-imp-{name}"
        r = cli(s3_server, "import", str(hf), out, *extra, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["output"] == out
        got = download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / f"dl-{name}")
        assert sorted(got) == sorted(files_of(tmp_path / name))
        assert not [k for k in s3_server.keys("ckpts") if "ckpttool-tmp" in k]
        # torch.save archives carry a random serialization id per run: compare what torch loads
        assert_same_state(tmp_path / f"dl-{name}", tmp_path / name, tmp_path)
        assert cli(s3_server, "validate", "--strict", out).exit_code == 0
        # an existing output is refused without --overwrite
        assert cli(s3_server, "import", str(hf), out, *extra).exit_code == 2


# ------------------------------------------------------------------ interrupted runs
def _interrupt_when(proc: Any, ready: Any, signum: int, timeout_s: float = 120.0) -> None:
    """Send ``signum`` to ``proc`` as soon as ``ready()`` holds (polled)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if time.monotonic() > deadline:  # a hang guard, not a speed check
            pytest.fail("never reached the point to interrupt")
        time.sleep(0.02)
    proc.send_signal(signum)


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_signal_during_upload_publishes_nothing_and_cleans_up(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path, signame: str
) -> None:
    """Ctrl-C / SIGTERM while the output is uploaded (remote source: the spool exists too): exit 130,
    `error: interrupted`, nothing under the target, the temporary prefix and the local staging and
    spool directories removed."""
    import signal
    import subprocess
    import sys

    url = upload(s3_server, sample_ckpt)
    out = url + "-int"
    proxy = s3fx.DroppingProxy(s3_server.port)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    opts = s3_server.cli_options()
    opts[1] = f"client_kwargs.endpoint_url={proxy.endpoint}"
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("CKPTTOOL_DEBUG", None)
    cmd = [sys.executable, "-m", "ckpttool", *opts, "--remote-workers", "2", "export", url, out, "--shard-size", "20KB"]
    # the link stalls at the first upload to the temporary output (a PUT naming it) ...
    proxy.hold_on = lambda piece: piece.startswith(b"PUT ") and b"ckpttool-tmp" in piece.split(b"\r\n", 1)[0]
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # a test runner may ignore SIGINT, and an ignored SIGINT is inherited: Ctrl-C as in a shell
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            # ... so the run is still uploading when the signal lands, however busy the machine (before, a test
            # that polled the server too late found the run done); then the link runs again, for the cleanup
            _interrupt_when(proc, proxy.held.is_set, getattr(signal, signame), timeout_s=300)
            proxy.release.set()
            _, err = proc.communicate(timeout=300)  # a hang guard
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        proxy.close()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "error: interrupted", err[-2000:]
    prefix = out.split("/", 3)[3]
    left = [k for k in s3_server.keys("ckpts") if k.startswith(prefix) or "ckpttool-tmp" in k]
    assert not left, (left, err[-2000:])
    assert not list(tmpdir.iterdir())  # staging and spool removed


@pytest.mark.slow
def test_an_overwrite_killed_while_publishing_is_finished_by_the_next_overwrite(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """`export --overwrite` to a prefix holding an earlier export, killed (SIGKILL: no cleanup) at its first
    server-side copy into the prefix: the old markers were deleted, so the prefix held old data objects and no
    `.ckpttool-output.json`, and the next `--overwrite` refused it (E606: not provably ckpttool's) until the user
    deleted the objects by hand. Now the prefix holds a `replacing` marker naming both outputs' objects: it never
    looks complete (no index), and the next `--overwrite` replaces it with the complete new output."""
    import signal
    import subprocess
    import sys

    url = upload(s3_server, sample_ckpt)
    out = url + "-ow"
    assert cli(s3_server, "export", url, out, "--shard-size", "20KB").exit_code == 0
    new_args = ["--save-dtype", "float32", "--shard-size", "30KB"]
    local = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local"), *new_args])
    assert local.exit_code == 0, local.output
    prefix = out.split("/", 3)[3]

    def copy_into_target(piece: bytes) -> bool:
        first = piece.split(b"\r\n", 1)[0]
        return first.startswith(b"PUT ") and prefix.encode() in first and b"x-amz-copy-source" in piece.lower()

    proxy = s3fx.DroppingProxy(s3_server.port)
    proxy.hold_on = copy_into_target
    opts = s3_server.cli_options()
    opts[1] = f"client_kwargs.endpoint_url={proxy.endpoint}"
    cmd = [sys.executable, "-m", "ckpttool", *opts, "--remote-workers", "1", "export", url, out, "--overwrite"]
    try:
        proc = subprocess.Popen([*cmd, *new_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _interrupt_when(proc, proxy.held.is_set, signal.SIGKILL, timeout_s=300)
            proc.communicate(timeout=300)  # a hang guard
        finally:
            if proc.poll() is None:
                proc.kill()
        proxy.release.set()
    finally:
        proxy.close()
    left = [k.split("/", 3)[-1] for k in s3_server.keys("ckpts", prefix + "/")]
    assert "model.safetensors.index.json" not in [k.rsplit("/", 1)[-1] for k in left], left  # never complete
    doc = json.loads(
        s3_server.client().get_object(Bucket="ckpts", Key=f"{prefix}/.ckpttool-output.json")["Body"].read()
    )
    assert doc["state"] == "replacing", doc
    assert set(left) - {".ckpttool-output.json"} <= set(doc["files"]) | set(doc["previous"]), left

    again = cli(s3_server, "export", url, out, "--overwrite", *new_args)
    assert again.exit_code == 0, again.output
    assert download(s3_server, "ckpts", prefix, tmp_path / "dl") == files_of(tmp_path / "local")
    doc = json.loads(
        s3_server.client().get_object(Bucket="ckpts", Key=f"{prefix}/.ckpttool-output.json")["Body"].read()
    )
    assert doc["state"] == "complete" and "previous" not in doc
    # the killed run's temporary objects stay beside the output (docs/storage.md); removed for the other tests
    tmp = s3_server.keys("ckpts", f".{prefix}.ckpttool-tmp-")
    assert tmp
    s3_server.client().delete_objects(Bucket="ckpts", Delete={"Objects": [{"Key": k} for k in tmp]})


# ------------------------------------------------------------------ the local spool of remote reads
def test_spool_is_bounded_and_evicted(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    """An export from s3:// holds about `--remote-spool-size` of windows at a time (fetched, written,
    evicted in batches) and writes the local export's bytes; validate --deep evicts each chunk once checked."""
    from ckpttool.format.metadata import TensorMeta
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.export import ExportOptions, export_checkpoint
    from ckpttool.ops.validate.runner import ValidateOptions, validate

    url = upload(s3_server, sample_ckpt)
    args = ["--save-dtype", "float32", "--shard-size", "100KB"]
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local"), *args]).exit_code == 0
    r = cli(s3_server, "--remote-spool-size", "64KiB", "export", url, str(tmp_path / "cli"), *args)
    assert r.exit_code == 0, r.output
    assert files_of(tmp_path / "cli") == files_of(tmp_path / "local")

    budget = 64 << 10
    with storage_config(options=s3_server.options(), spool_bytes=budget, workers=4):
        ck = open_checkpoint(url)
        try:
            windows = [
                i.length for (k, _), i in ck.metadata.storage.items() if isinstance(ck.metadata.entries[k], TensorMeta)
            ]
            total = sum(windows)
            export_checkpoint(ck, tmp_path / "api", ExportOptions(save_dtype="float32", shard_size=100_000))
            peak = ck.reader.spool_peak()
            spool = ck.reader.spool
            assert spool is not None and spool.held <= max(
                windows
            )  # all evicted but what the tied-embedding check re-read
            held_blocks = sum(os.stat(p).st_blocks * 512 for p in spool.dir.iterdir())
        finally:
            ck.close()
    assert peak is not None and total > 4 * budget  # the bound mattered
    biggest_task = max(windows) * 4  # a source tensor's chunks (4 ranks) are one task: a batch of its own
    assert peak <= budget + biggest_task, (peak, budget, total)
    assert held_blocks <= max(windows) + (1 << 20)  # the holes were punched: the spool files take ~no disk
    assert files_of(tmp_path / "api") == files_of(tmp_path / "local")

    with storage_config(options=s3_server.options(), workers=2):
        ck = open_checkpoint(url, record_problems=True)
        try:
            validate(ck, ValidateOptions(deep=True, workers=2))
            spool = ck.reader.spool
            # every chunk window evicted once checked: what stays are the byte items (fetched whole, small)
            byte_items = sum(
                i.length
                for (k, _), i in ck.metadata.storage.items()
                if not isinstance(ck.metadata.entries[k], TensorMeta)
            )
            assert spool is not None and spool.held <= byte_items < spool.peak
        finally:
            ck.close()


def test_a_word_in_the_url_does_not_classify_the_error() -> None:
    """A connection error quotes the endpoint URL: a prefix named credentials-eval or forbidden-planet made it a
    permission error (E142, never retried); the words are looked for in the error itself."""
    pytest.importorskip("botocore", reason="botocore is not installed (pip install -e '.[s3-test]')")
    from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError

    from ckpttool.format.storage import _classify

    url = "https://s3.us-east-1.amazonaws.com/forbidden-planet/credentials-eval/step-100/.metadata"
    assert _classify(EndpointConnectionError(endpoint_url=url)) == "transient"
    assert _classify(ConnectTimeoutError(endpoint_url=url)) == "transient"
    assert _classify(NoCredentialsError()) == "permission"
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")
    assert _classify(denied) == "permission"


@pytest.mark.parametrize(
    ("scheme", "options", "said"),
    [
        ("reference", {}, "bad storage options for reference:// (ReferenceFileSystem.__init__() missing"),  # TypeError
        ("nosuchproto", {}, "fsspec knows no nosuchproto:// filesystem"),
        # a known filesystem whose message mentions a protocol option it lacks is not an unknown one
        ("cached", {}, "bad storage options for cached:// (Please provide filesystem instance(fs) or target_protocol"),
    ],
)
def test_a_filesystem_fsspec_refuses_is_named_with_its_options(scheme: str, options: dict[str, Any], said: str) -> None:
    from ckpttool.format.storage import _filesystem

    with pytest.raises(RemoteStorageError) as info:
        _filesystem(scheme, options, f"{scheme}://b/k")
    assert said in str(info.value)
    assert info.value.hint == (
        "use a URL fsspec resolves"
        if "knows no" in said
        else "check --storage-option keys against the backend's documentation"
    )


def test_training_state_beside_a_remote_checkpoint_is_named_as_locally(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """HF Trainer / DeepSpeed files, a pickle and a DCP subfolder in the prefix: K012 and inspect's
    ``unread_beside`` as for the same directory (a URL said OK, exit 0 under --strict)."""
    ck = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "trainer_state.json", "my_state.pkl"):
        (ck / name).write_bytes(b"x" * 8)
    (ck / "global_step3").mkdir()
    (ck / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ck / "optim").mkdir()
    (ck / "optim" / ".metadata").write_bytes((ck / ".metadata").read_bytes())
    (ck / "rng").mkdir()  # a folder of per-rank pickles in the checkpoint folder
    (ck / "rng" / "rank0.pt").write_bytes(b"x")
    url = upload(s3_server, ck)
    local = runner.invoke(app, ["validate", "--strict", "--json", str(ck)])
    remote = cli(s3_server, "validate", "--strict", "--json", url)
    assert local.exit_code == remote.exit_code == 1, remote.output
    named = [
        (f["code"], f["message"].split("does not read: ", 1)[1])
        for f in json.loads(remote.stdout)["findings"]
        if f["code"] == "K012"
    ]
    assert named == [
        (f["code"], f["message"].split("does not read: ", 1)[1])
        for f in json.loads(local.stdout)["findings"]
        if f["code"] == "K012"
    ]
    assert "global_step3/" in named[0][1] and "optim/" in named[0][1] and "my_state.pkl" in named[0][1]
    li = json.loads(runner.invoke(app, ["inspect", "--json", str(ck)]).stdout)["unread_beside"]
    ri = json.loads(cli(s3_server, "inspect", "--json", url).stdout)["unread_beside"]
    assert (
        ri
        == li
        == [
            "global_step3/",
            "my_state.pkl",
            "optim/",
            "optimizer.pt",
            "rng/",
            "rng_state_0.pth",
            "scheduler.pt",
            "trainer_state.json",
        ]
    )
    clean = cli(s3_server, "validate", "--strict", upload(s3_server, sample_ckpt))
    assert clean.exit_code == 0, clean.output


def test_validate_of_an_unreadable_remote_metadata_names_the_url(s3_server: Any) -> None:
    """The report of a URL whose .metadata is garbage names the URL (was '/bucket/prefix': the scheme lost)."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    c = s3_server.client()
    s3_server.bucket("ckpts")
    c.put_object(Bucket="ckpts", Key=f"{prefix}/.metadata", Body=b"not a pickle")
    c.put_object(Bucket="ckpts", Key=f"{prefix}/__0_0.distcp", Body=b"xx")
    url = f"s3://ckpts/{prefix}"
    r = cli(s3_server, "validate", "--json", url)
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == url
    assert [(f["code"], f["error_code"]) for f in doc["findings"]] == [("S001", "E200")]
    table = cli(s3_server, "validate", url)
    assert table.stdout.splitlines()[0].split() == ["checkpoint", url]


def test_an_object_cut_short_after_the_listing_is_a_data_file_error(sample_ckpt: Path, s3_server: Any) -> None:
    """The data object replaced by a shorter one between the listing and the chunk reads: E300 naming the object,
    said to have changed, at once (was retried --remote-retries times, then E144 'check the network')."""
    from ckpttool.errors import DataFileError
    from ckpttool.model.checkpoint import open_checkpoint

    url = upload(s3_server, sample_ckpt)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    with storage_config(options=s3_server.options(), retries=3, backoff_s=5.0):
        with open_checkpoint(url) as ckpt:  # the listing and .metadata read
            data = (sample_ckpt / "__0_0.distcp").read_bytes()
            s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp", Body=data[:1000])
            fqn = "model.lm_head.weight"
            with pytest.raises(DataFileError) as got:
                ckpt.reader.read_tensor(fqn)
            requests = ckpt.reader.remote.requests
    # the read is pinned to the listed ETag: the shorter object is told as replaced (E300 either way)
    assert f"{url}/__0_0.distcp" in got.value.message and "changed while being read" in got.value.message
    assert "run again once it is finished" in got.value.hint
    assert requests == 3  # the listing, .metadata, one range request: not retried


def test_an_object_deleted_after_the_listing_is_a_data_file_error(sample_ckpt: Path, s3_server: Any) -> None:
    """A listed object deleted before its bytes are read (a cleanup job, a save that rotates old steps): E300
    naming the object, said to have changed while being read, not retried (was E141 'not found', hint 'check the
    URL: its bucket and prefix', about a URL that was right); a chunk's range read and a whole-object read alike."""
    from ckpttool.errors import DataFileError
    from ckpttool.format.storage import RemoteStore
    from ckpttool.model.checkpoint import open_checkpoint

    url = upload(s3_server, sample_ckpt)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    c = s3_server.client()
    with storage_config(options=s3_server.options(), retries=3, backoff_s=5.0):
        store = RemoteStore(url)
        assert store.size("extra_state/extra_state_rank_0.pt")  # listed
        with open_checkpoint(url) as ckpt:  # the listing and .metadata read
            c.delete_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp")
            c.delete_object(Bucket=bucket, Key=f"{prefix}/extra_state/extra_state_rank_0.pt")
            with pytest.raises(DataFileError) as got:
                ckpt.reader.read_tensor("model.lm_head.weight")
            requests = ckpt.reader.remote.requests
        with pytest.raises(DataFileError) as whole:
            store.read_whole("extra_state/extra_state_rank_0.pt", 1 << 20)
    for e, name in ((got.value, "__0_0.distcp"), (whole.value, "extra_state/extra_state_rank_0.pt")):
        assert e.code == "E300" and e.message.startswith(f"{url}/{name}: "), e.message
        assert "deleted since it was listed" in e.message and "changed while being read" in e.message
        assert "run again once it is finished" in (e.hint or "")
    assert requests == 3  # the listing, .metadata, one range request: not retried


def test_a_save_landing_in_the_output_prefix_during_the_run_is_not_overwritten(
    sample_ckpt: Path, s3_server: Any
) -> None:
    """The output prefix was checked only on entry: a checkpoint that torch's FsspecWriter saved into it while
    ckpttool wrote its output (a trainer pointed at the same prefix) had its `.metadata` and data files replaced
    by the output's, without --overwrite (the local output's rename re-checks the target and fails). Now the
    prefix is listed again before anything is published: E600 without --overwrite, E606 with it over a previous
    output that the save wrote into; the save's objects keep their bytes, the temporary prefix is removed."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from ckpttool.errors import ForeignOutputError, OutputError
    from ckpttool.format.outputs import output_dir

    bucket = s3_server.bucket("ckpts")
    previous = f"s3://{bucket}/t-{uuid.uuid4().hex[:8]}"
    assert cli(s3_server, "export", str(sample_ckpt), previous).exit_code == 0  # an output of ckpttool
    for target, overwrite, error, code in (
        (f"s3://{bucket}/t-{uuid.uuid4().hex[:8]}", False, OutputError, "E600"),
        (previous, True, ForeignOutputError, "E606"),
    ):
        prefix = target.split("/", 3)[3]
        with storage_config(options=s3_server.options()), pytest.raises(error) as got:
            with output_dir(target, overwrite=overwrite, kind="reshard") as tmp:
                (tmp / ".metadata").write_bytes(b"the output's metadata")
                (tmp / "__0_0.distcp").write_bytes(b"the output's data")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    writer = FsspecWriter(target, **s3_server.options())
                    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
                saved = {
                    k: s3_server.client().get_object(Bucket=bucket, Key=k)["Body"].read()
                    for k in s3_server.keys(bucket, prefix + "/")
                    if k.rsplit("/", 1)[1] in (".metadata", "__0_0.distcp")
                }
                assert len(saved) == 2
        assert got.value.code == code and got.value.message.startswith(f"{target}: "), got.value.message
        if code == "E600":
            assert "2 object(s), written there while this run wrote its output" in got.value.message
        for key, body in saved.items():  # the save's objects are its own
            assert s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read() == body, key
        assert not [k for k in s3_server.keys(bucket) if "ckpttool-tmp" in k]
        sd = {"w": torch.zeros(4)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=FsspecReader(target, **s3_server.options()), no_dist=True)
        assert torch.equal(sd["w"], torch.arange(4.0))


def test_overwrite_of_a_prefix_holding_only_sub_prefixes_names_them(sample_ckpt: Path, s3_server: Any) -> None:
    """export --overwrite onto a prefix whose objects all lie below sub-prefixes (a run root: step folders, logs)
    is E606 naming its folders, as the local refusal names a directory's entries (it said 'it holds nothing');
    nothing below it is touched."""
    src = upload(s3_server, sample_ckpt)
    bucket, prefix = "ckpts", f"t-{uuid.uuid4().hex[:8]}"
    c = s3_server.client()
    before = {f"{prefix}/logs/run.txt": b"log", f"{prefix}/step-1/.metadata": b"md"}
    for key, body in before.items():
        c.put_object(Bucket=bucket, Key=key, Body=body)
    r = cli(s3_server, "export", "--overwrite", src, f"s3://{bucket}/{prefix}")
    assert r.exit_code == 2, r.output
    assert f"[E606] s3://{bucket}/{prefix}: --overwrite refused: it holds 2 entries (logs, step-1)," in r.output
    assert s3_server.keys(bucket, prefix + "/") == sorted(before)


def test_overwrite_of_a_prefix_holding_a_folder_named_object_with_bytes_names_it(
    sample_ckpt: Path, s3_server: Any
) -> None:
    """An object named like the output prefix with a trailing '/' that holds bytes (not a folder marker: those are
    empty) is refused (E606) naming it '/' (it said 'it holds 1 entry ()', naming nothing); it is left as it is."""
    src = upload(s3_server, sample_ckpt)
    bucket, prefix = "ckpts", f"t-{uuid.uuid4().hex[:8]}"
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/", Body=b"mine")
    r = cli(s3_server, "export", "--overwrite", src, f"s3://{bucket}/{prefix}")
    assert r.exit_code == 2, r.output
    assert f"[E606] s3://{bucket}/{prefix}: --overwrite refused: it holds 1 entry (/), not an output" in r.output
    assert s3_server.keys(bucket, prefix) == [f"{prefix}/"]
    assert s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/")["Body"].read() == b"mine"


def test_overwrite_of_an_output_prefix_with_an_object_added_says_so_as_locally(
    sample_ckpt: Path, s3_server: Any
) -> None:
    """An export to a prefix, a report PUT beside it, then export --overwrite: E606 said the prefix was "not an
    output of ckpttool" and the report "(ckpttool did not write it)", where the same steps on a folder now say
    "not provably an output of ckpttool" and "(not part of the output ckpttool wrote)". Nothing is touched."""
    bucket, prefix = "ckpts", f"t-{uuid.uuid4().hex[:8]}"
    s3_server.bucket(bucket)
    url = f"s3://{bucket}/{prefix}"
    assert cli(s3_server, "export", str(sample_ckpt), url).exit_code == 0
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/report.xml", Body=b"<testsuites/>")
    before = s3_server.keys(bucket, prefix + "/")
    r = cli(s3_server, "export", "--overwrite", str(sample_ckpt), url)
    assert r.exit_code == 2, r.output
    line = next(x for x in r.stderr.splitlines() if x.startswith("error: [E606]"))
    assert "not provably an output of ckpttool" in line, line
    assert line.endswith("report.xml is not listed in .ckpttool-output.json (not part of the output ckpttool wrote)")
    assert s3_server.keys(bucket, prefix + "/") == before


def test_an_object_replaced_by_one_of_the_same_size_after_the_listing_is_said_to_have_changed(
    s3_server: Any, tmp_path: Path
) -> None:
    """The data object overwritten by another save of the same shapes (same size) between the listing and the
    chunk reads (a run saving into the same prefix again): E300 'replaced since it was listed' (the
    tensor of the other save was returned, read at the offsets of the first save's .metadata). Every s3 read is
    pinned to the listing's ETag (If-Match)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.errors import DataFileError
    from ckpttool.format.storage import RemoteStore
    from ckpttool.model.checkpoint import open_checkpoint

    for name, seed in (("a", 0), ("b", 1)):
        w = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
        dcp.save({"w": w}, checkpoint_id=tmp_path / name, no_dist=True)
    a, b = ((tmp_path / n / "__0_0.distcp").read_bytes() for n in ("a", "b"))
    assert len(a) == len(b) and a != b
    url = upload(s3_server, tmp_path / "a")
    bucket, prefix = url[len("s3://") :].split("/", 1)
    with storage_config(options=s3_server.options(), retries=3, backoff_s=5.0):
        with open_checkpoint(url) as ckpt:  # the listing and .metadata read
            s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp", Body=b)
            with pytest.raises(DataFileError) as got:
                ckpt.reader.read_tensor("w")
        assert f"{url}/__0_0.distcp" in got.value.message and "replaced since it was listed" in got.value.message
        assert "run again once it is finished" in got.value.hint
        store = RemoteStore(url)  # a whole-object read is pinned too
        assert store.read_whole("__0_0.distcp", 1 << 30) == b  # unchanged since its listing: its bytes
        s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp", Body=a)
        with pytest.raises(DataFileError) as got:
            store.read_whole("__0_0.distcp", 1 << 30)
        assert "replaced since it was listed" in got.value.message


def test_an_object_rewritten_after_the_listing_is_said_to_have_changed(sample_ckpt: Path, s3_server: Any) -> None:
    """A whole-object read (.metadata, layout.json, extra_state) of an object rewritten longer or shorter since
    the listing: E300 'it changed while being read' (a longer .metadata was cut at the listed size and parsed:
    E200 'not a readable pickle', hint 're-save the checkpoint')."""
    from ckpttool.errors import DataFileError
    from ckpttool.format.storage import RemoteStore

    url = upload(s3_server, sample_ckpt)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    md = (sample_ckpt / ".metadata").read_bytes()
    with storage_config(options=s3_server.options()):
        store = RemoteStore(url)
        assert store.read_whole(".metadata", 1 << 30) == md  # unchanged: its bytes, exactly
        assert store.bytes_requested == len(md)
        for body in (md + b"\0" * 100, md[:-100]):
            s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/.metadata", Body=body)
            with pytest.raises(DataFileError) as got:
                store.read_whole(".metadata", 1 << 30)
            assert (
                got.value.message.startswith(f"{url}/.metadata: ") and "changed while being read" in got.value.message
            )
            assert "replaced since it was listed" in got.value.message  # its ETag, before its length


def test_manifest_of_a_remote_checkpoint_is_written_beside_its_metadata_and_verifies(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`manifest s3://...` (docs/storage.md lists it) was E999 'internal error: AttributeError' (and would have
    written a local ./s3:/bucket/... tree); it PUTs manifest.json beside .metadata, with the entries of the local
    manifest, and `--verify` reads it back from the prefix; `-o FILE` writes a local file."""
    monkeypatch.chdir(tmp_path)
    local = copy_checkpoint(sample_ckpt, tmp_path / "local")
    url = upload(s3_server, local)
    prefix = url.split("/", 3)[3]
    assert runner.invoke(app, ["manifest", str(local)]).exit_code == 0
    want = json.loads((local / "manifest.json").read_text())
    r = cli(s3_server, "manifest", url)
    assert r.exit_code == 0, r.output
    assert f"wrote {url}/manifest.json" in r.stdout
    got = json.loads(download(s3_server, "ckpts", prefix, tmp_path / "dl")["manifest.json"])
    assert got["entries"] == want["entries"] and got["metadata"] == want["metadata"]
    assert sorted(os.listdir(tmp_path)) == ["dl", "local"]  # nothing written locally (no ./s3:/...)
    v = cli(s3_server, "manifest", url, "--verify")
    assert v.exit_code == 0, v.output
    assert f"{url} (dcp) matches its manifest {url}/manifest.json" in v.stdout
    # the windows are read (were the spool's zeros: every chunk and byte item 'changed'): a damaged chunk is named
    corrupt_chunk_bytes(local, "model.model.embed_tokens.weight")
    s3_server.client().upload_file(str(local / "__0_0.distcp"), "ckpts", f"{prefix}/__0_0.distcp")
    v = cli(s3_server, "manifest", url, "--verify")
    assert v.exit_code == 1, v.output
    assert [ln.split()[:2] for ln in v.stdout.splitlines()[:-1]] == [["changed", "'model.model.embed_tokens.weight'"]]
    s3_server.client().upload_file(str(sample_ckpt / "__0_0.distcp"), "ckpts", f"{prefix}/__0_0.distcp")
    out = tmp_path / "m.json"
    r = cli(s3_server, "manifest", url, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["entries"] == want["entries"]
    assert cli(s3_server, "manifest", url, "--verify", "-o", str(out)).exit_code == 0
    # a manifest.json on the prefix that ckpttool did not write is kept
    s3_server.client().put_object(Bucket="ckpts", Key=f"{prefix}/manifest.json", Body=b'{"mine": 1}')
    r = cli(s3_server, "manifest", url)
    assert r.exit_code == 2 and "[E600]" in r.output and f"{url}/manifest.json" in r.output, r.output
    assert "Traceback" not in r.output
    assert s3_server.client().get_object(Bucket="ckpts", Key=f"{prefix}/manifest.json")["Body"].read() == b'{"mine": 1}'


def test_manifest_of_a_remote_checkpoint_names_the_files_beside_it_that_it_does_not_cover(
    sample_ckpt: Path, s3_server: Any
) -> None:
    """A local manifest digests ``extra_state/`` and ``model_assets/config.json`` (its ``sidecars``); one of the same
    checkpoint in a bucket cannot (they are not fetched), and said nothing: ``--verify`` answered a bare "matches"
    while those objects could hold anything. Writing and verifying now warn, naming them, and the verdict says so."""
    url = upload(s3_server, sample_ckpt)
    beside = "2 files beside the data of a remote checkpoint {} (extra_state/extra_state_rank_0.pt, model_assets/config.json)"
    w = cli(s3_server, "manifest", url)
    assert w.exit_code == 0, w.output
    assert f"warning: {url}/manifest.json: {beside.format('not digested')}" in w.stderr, w.output
    v = cli(s3_server, "manifest", url, "--verify")
    assert v.exit_code == 0, v.output
    assert f"warning: {url}/manifest.json: {beside.format('not checked')}" in v.stderr, v.output
    assert v.stdout.strip().endswith("; files beside the data or bytes after it not checked (see the warning)")
    doc = json.loads(cli(s3_server, "--json", "manifest", url, "--verify").stdout)
    assert [x for x in doc["warnings"] if "beside the data of a remote checkpoint" in x]
    assert not doc["problems"]
    # validate --manifest: S016 names them (it passed, as if the manifest vouched for them)
    val = json.loads(cli(s3_server, "--json", "validate", url, "--manifest").stdout)
    (s016,) = [f for f in val["findings"] if f["code"] == "S016"]
    assert s016["message"] == (
        f"{url}/manifest.json: 2 file(s) beside the data of a remote checkpoint not checked (not fetched through "
        "object storage): extra_state/extra_state_rank_0.pt, model_assets/config.json"
    )


def test_manifest_verify_of_a_remote_data_object_cut_short_or_deleted_reports_what_its_local_copy_does(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """``manifest --verify`` after the data object was cut short since the manifest: the local copy lists each entry
    whose window is gone as ``changed`` (exit 1); the bucket's failed with one E300 (exit 2, no report: the spool's
    eviction asked the cut window's storage info again). Deleted: the local copy says ``missing``, the bucket said
    ``changed``. Both now report the local copy's problems, word for word but the path."""
    local = copy_checkpoint(sample_ckpt, tmp_path / "local")
    url = upload(s3_server, local)
    bucket, prefix = url[len("s3://") :].split("/", 1)
    assert runner.invoke(app, ["manifest", str(local)]).exit_code == 0
    assert cli(s3_server, "manifest", url).exit_code == 0
    data = (local / "__0_0.distcp").read_bytes()

    def problems(*args: str) -> tuple[int, list[dict[str, Any]]]:
        r = cli(s3_server, "--json", "manifest", *args, "--verify")
        assert "Traceback" not in r.output
        got = json.loads(r.stdout)["problems"] if r.stdout.strip() else r.output
        return r.exit_code, got

    for cut in (len(data) * 2 // 3, None):
        if cut is None:
            s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp")
            (local / "__0_0.distcp").unlink()
        else:
            s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp", Body=data[:cut])
            (local / "__0_0.distcp").write_bytes(data[:cut])
        want_rc, want = problems(str(local))
        assert want_rc == 1 and want, want
        rc, got = problems(url)
        assert rc == 1, got
        assert json.dumps(got).replace(url, "P") == json.dumps(want).replace(str(local), "P")
        assert {p["kind"] for p in got} == ({"changed"} if cut else {"missing"})


def test_a_manifest_written_into_a_remote_output_keeps_it_replaceable_as_locally(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """`manifest s3://b/out` of a reshard output PUT manifest.json without listing it in the output's
    .ckpttool-output.json, so the next `reshard ... s3://b/out --overwrite` was E606 'manifest.json is not listed
    ... (ckpttool did not write it)' (now '(not part of the output ckpttool wrote)'), while the same steps on a local folder replace it (the local manifest is
    recorded in the marker). Now the marker lists it: the overwrite succeeds as locally, and the replaced output
    reads back; a prefix that is no ckpttool output gets no marker."""
    args = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    local = tmp_path / "local"
    out = f"s3://ckpts/t-{uuid.uuid4().hex[:8]}"
    s3_server.bucket("ckpts")
    for target in (str(local), out):
        assert cli(s3_server, "reshard", str(sample_ckpt), target, *args).exit_code == 0
        r = cli(s3_server, "manifest", target)
        assert r.exit_code == 0, r.output
        r = cli(s3_server, "reshard", str(sample_ckpt), target, *args, "--overwrite")
        assert r.exit_code == 0, (target, r.output)
        assert cli(s3_server, "validate", target, "--deep").exit_code == 0
    assert sorted(download(s3_server, "ckpts", out.split("/", 3)[3], tmp_path / "dl")) == sorted(files_of(local))
    # a checkpoint that ckpttool did not write: the manifest is written, no marker appears
    url = upload(s3_server, sample_ckpt)
    s3_server.client().delete_object(Bucket="ckpts", Key=url.split("/", 3)[3] + "/.ckpttool-output.json")
    assert cli(s3_server, "manifest", url).exit_code == 0
    assert ".ckpttool-output.json" not in [
        k.rsplit("/", 1)[1] for k in s3_server.keys("ckpts", url.split("/", 3)[3] + "/")
    ]


def test_a_remote_rank_local_save_has_its_rank_metadata_covered_by_its_manifest(
    ep_suite: Path, s3_server: Any, tmp_path: Path
) -> None:
    """A rank-local DCP save (`dcp.save(..., use_collectives=False)`: `__R.metadata`, no `.metadata`) in object
    storage: its manifest recorded `metadata: null` and no sidecars, so a dtype rewritten in the `__R.metadata` files
    (every data window unchanged) passed `manifest --verify` and `validate --manifest` (exit 0), while the local copy's
    manifest names the file changed. Now the `__R.metadata` objects are digested: a `metadata` problem, exit 1."""
    import pickle

    import torch

    local = copy_checkpoint(ep_suite / "legacy_rank_local", tmp_path / "rl")
    url = upload(s3_server, local)
    for target in (str(local), url):
        assert cli(s3_server, "manifest", target).exit_code == 0
        assert cli(s3_server, "manifest", target, "--verify").exit_code == 0
    prefix = url.split("/", 3)[3]
    key = "model.model.layers.0.mlp.experts.down_proj"
    for rank in range(4):  # the dtype of one tensor rewritten in every rank's metadata: no data window changes
        md = pickle.loads((local / f"__{rank}.metadata").read_bytes())  # torch's own Metadata of our fixture
        assert md.state_dict_metadata[key].properties.dtype == torch.bfloat16
        md.state_dict_metadata[key].properties.dtype = torch.float16
        (local / f"__{rank}.metadata").write_bytes(pickle.dumps(md))
        s3_server.client().upload_file(str(local / f"__{rank}.metadata"), "ckpts", f"{prefix}/__{rank}.metadata")
    for target in (str(local), url):
        r = cli(s3_server, "manifest", target, "--verify")
        assert r.exit_code == 1, (target, r.output)
        v = cli(s3_server, "validate", "--json", target, "--manifest", "--" if target == url else str(local))
        assert v.exit_code == 1, (target, v.output)
        assert "S015" in {f["code"] for f in json.loads(v.stdout)["findings"]}
    assert "metadata the rank-local .metadata files (__R.metadata) differ from the manifest's" in r.stdout
    doc = json.loads(s3_server.client().get_object(Bucket="ckpts", Key=f"{prefix}/manifest.json")["Body"].read())
    assert doc["metadata"]["file"] == "rank-local .metadata files"


def test_a_remote_data_object_grown_since_the_manifest_is_changed_as_its_local_copy(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """Bytes appended to a data object after its last window (a botched copy) are in no entry: the local verify names
    the grown file, the remote one said 'matches' (and `validate --manifest` OK), since a remote manifest recorded no
    data_files and a remote verify skipped them. The listing's sizes are now recorded and checked."""
    local = copy_checkpoint(sample_ckpt, tmp_path / "local")
    sizes = [{"file": p.name, "size": p.stat().st_size} for p in sorted(local.glob("*.distcp"))]
    made = tmp_path / "remote.json"
    assert cli(s3_server, "manifest", upload(s3_server, local), "-o", str(made)).exit_code == 0
    assert json.loads(made.read_text())["data_files"] == sizes
    with open(local / "__0_0.distcp", "ab") as f:
        f.write(b"appended")
    url = upload(s3_server, local)
    want = runner.invoke(app, ["manifest", str(local), "--verify", "-o", str(made)])
    assert want.exit_code == 1, want.output
    got = cli(s3_server, "manifest", url, "--verify", "-o", str(made))
    assert got.exit_code == 1, got.output
    assert got.stdout.splitlines()[:-1] == want.stdout.splitlines()[:-1]
    assert got.stdout.splitlines()[0].startswith("changed  __0_0.distcp: 8 byte(s) after the data")
    v = cli(s3_server, "validate", "--manifest", str(made), url)
    assert v.exit_code == 1, v.output


def test_validate_of_a_remote_incomplete_save_names_the_url(sample_ckpt: Path, s3_server: Any) -> None:
    """Data objects without .metadata: S001/E202 keyed by the URL, as a local directory is by its path (the key
    was 's3:/ckpts/...', the scheme's slash lost, and the error line said 's3:/ckpts/x: s3://ckpts/x: ...')."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    s3_server.bucket("ckpts")
    s3_server.client().upload_file(str(sample_ckpt / "__0_0.distcp"), "ckpts", f"{prefix}/__0_0.distcp")
    url = f"s3://ckpts/{prefix}"
    r = cli(s3_server, "validate", "--json", url)
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert [(f["code"], f["error_code"], f["key"]) for f in doc["findings"]] == [("S001", "E202", url)]
    assert r.stderr.splitlines()[0] == f"error: [E202] {url}: has .distcp data files but no .metadata (incomplete save)"


def test_export_into_the_remote_source_prefix_is_refused(sample_ckpt: Path, s3_server: Any) -> None:
    """docs/storage.md: 'The target may not overlap the source checkpoint'. An export of s3://b/ck to s3://b/ck/hf
    was published inside the checkpoint's prefix (the source's URL lost its scheme on the way to the check): E600
    naming both, before anything is written, as for local directories."""
    url = upload(s3_server, sample_ckpt)
    prefix = url.split("/", 3)[3]
    before = s3_server.keys("ckpts", prefix + "/")
    for out in (f"{url}/hf", f"{url}/hf/deeper"):
        r = cli(s3_server, "export", url, out)
        assert r.exit_code == 2, r.output
        assert r.stderr.splitlines()[0] == f"error: [E600] {out}: the output overlaps the source checkpoint {url}"
    assert s3_server.keys("ckpts", prefix + "/") == before
    assert not [k for k in s3_server.keys("ckpts", "") if ".ckpttool-tmp-" in k and k.startswith(prefix)]


def test_an_output_url_naming_an_existing_object_is_refused_as_a_local_file_is(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """export/reshard/import to s3://b/single, where `single` is an object a user uploaded, wrote the output below
    it as single/... (with --overwrite too); a local OUT that is a regular file is E600. The URL is E600 as well, one
    line naming it and a hint, before anything is uploaded: the object keeps its bytes, nothing lands below it."""
    url = upload(s3_server, sample_ckpt)
    prefix = url.split("/", 3)[3]
    s3_server.client().put_object(Bucket="ckpts", Key=f"{prefix}-single", Body=b"user data\n")
    obj = f"{url}-single"
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf)]).exit_code == 0
    local_file = tmp_path / "single"
    local_file.write_bytes(b"user data\n")
    local = runner.invoke(app, ["export", str(sample_ckpt), str(local_file)])
    assert local.exit_code == 2 and local.stderr.startswith(f"error: [E600] {local_file} exists and is not a dir")
    rs = ["--to", "canonical", "--with-optimizer"]
    for args in (
        ["export", url, obj],
        ["export", url, obj + "/"],
        ["export", url, obj, "--overwrite"],
        ["export", url, obj, "--dry-run"],
        ["reshard", url, obj, *rs],
        ["reshard", url, obj, *rs, "--overwrite"],
        ["import", str(hf), obj],
        ["import", str(hf), obj, "--overwrite"],
    ):
        r = cli(s3_server, *args)
        assert r.exit_code == local.exit_code, (args, r.output)
        assert r.stderr.splitlines() == [
            f"error: [E600] {obj} is an object, not a prefix: ckpttool writes the output as objects below a prefix",
            "hint: choose a new or empty output prefix (OUT names a prefix; the object is left as it is)",
        ], args
    assert [k for k in s3_server.keys("ckpts", f"{prefix}-") if not k.startswith(f"{prefix}/")] == [f"{prefix}-single"]
    got = s3_server.client().get_object(Bucket="ckpts", Key=f"{prefix}-single")["Body"].read()
    assert got == b"user data\n"
    assert not [k for k in s3_server.keys("ckpts") if "ckpttool-tmp" in k]


@pytest.mark.parametrize("name", ["extra/../../../escaped.txt", "/abs/escaped.txt"])
def test_reshard_of_a_prefix_holding_an_object_named_to_escape_names_that_object(
    name: str, sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """reshard copies every object beside the checkpoint into OUT. An object whose key has a '..' component (or an
    empty one: '//') is refused (E101), nothing written: the message said "storage path ... the checkpoint references
    files outside its directory", which .metadata did not; it names the object below the prefix and what to do."""
    url = upload(s3_server, sample_ckpt)
    prefix = url.split("/", 3)[3]
    s3_server.client().put_object(Bucket="ckpts", Key=f"{prefix}/{name}", Body=b"x")
    out = tmp_path / "sub" / "out"
    r = cli(s3_server, "reshard", url, str(out), "--to", "canonical", "--with-optimizer")
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"error: [E101] {url}: object {name!r} "), lines
    assert lines[0].endswith(": it cannot be copied to OUT")
    assert lines[1] == (
        "hint: it is no part of the DCP checkpoint (its .metadata does not name it): rename or delete the object, "
        "then run again"
    )
    assert not (tmp_path / "sub").exists() and not (tmp_path / "escaped.txt").exists()


def test_validate_manifest_of_a_remote_checkpoint_reads_the_one_manifest_wrote(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """`validate --manifest` without a value on a URL was refused ('needs a local checkpoint') and a URL value was
    read as the local path 's3:/...' ('no such manifest file'); both read the object `manifest URL` PUT, and
    a chunk changed since is named (S015, exit 1)."""
    local = copy_checkpoint(sample_ckpt, tmp_path / "local")
    url = upload(s3_server, local)
    prefix = url.split("/", 3)[3]
    assert cli(s3_server, "manifest", url).exit_code == 0
    for args in (["--manifest", "--", url], ["--manifest", f"{url}/manifest.json", url]):
        r = cli(s3_server, "validate", "--json", *args)
        assert r.exit_code == 0, r.output
        assert {s["code"]: s["status"] for s in json.loads(r.stdout)["rules"]}["S015"] == "passed"
    missing = cli(s3_server, "validate", "--manifest", f"{url}/other.json", url)
    assert missing.exit_code == 2 and missing.stderr.startswith(f"error: [E100] {url}/other.json: no such manifest")
    corrupt_chunk_bytes(local, "model.model.embed_tokens.weight")
    s3_server.client().upload_file(str(local / "__0_0.distcp"), "ckpts", f"{prefix}/__0_0.distcp")
    r = cli(s3_server, "validate", "--json", "--manifest", "--", url)
    assert r.exit_code == 1, r.output
    s015 = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "S015"]
    assert [f["key"] for f in s015] == ["model.model.embed_tokens.weight"]


def test_validate_manifest_naming_the_remote_prefix_reads_its_manifest_as_a_local_dir(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """`validate DIR --manifest DIR` reads DIR/manifest.json; `validate URL --manifest URL` (the prefix that
    `manifest URL` wrote its manifest.json into) was E100 'URL: no such manifest file, write one with `ckpttool
    manifest URL`', about a prefix holding one. Now it reads URL/manifest.json: the findings of the local copy."""
    local = copy_checkpoint(sample_ckpt, tmp_path / "local")
    url = upload(s3_server, local)
    assert cli(s3_server, "manifest", url).exit_code == 0
    assert runner.invoke(app, ["manifest", str(local)]).exit_code == 0
    corrupt_chunk_bytes(local, "model.model.embed_tokens.weight")
    s3_server.client().upload_file(str(local / "__0_0.distcp"), "ckpts", f"{url.split('/', 3)[3]}/__0_0.distcp")
    want = runner.invoke(app, ["validate", "--json", str(local), "--manifest", str(local)])
    for given in (url, url + "/"):
        r = cli(s3_server, "validate", "--json", url, "--manifest", given)
        assert r.exit_code == want.exit_code == 1, r.output
        got = [(f["code"], f["key"]) for f in json.loads(r.stdout)["findings"] if f["code"] == "S015"]
        assert got == [(f["code"], f["key"]) for f in json.loads(want.stdout)["findings"] if f["code"] == "S015"]
        assert got == [("S015", "model.model.embed_tokens.weight")]


def test_manifest_output_that_is_a_url_is_refused_not_written_as_a_local_s3_folder(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`manifest CK -o s3://b/m.json` wrote the local file ./s3:/b/m.json (Path() of the URL) and said 'wrote
    s3:/b/m.json'; --output is a local file: a URL is E100 before anything is read, nothing written."""
    monkeypatch.chdir(tmp_path)
    url = upload(s3_server, sample_ckpt)
    for ck in (url, str(sample_ckpt)):
        for extra in ([], ["--verify"]):
            r = cli(s3_server, "manifest", ck, *extra, "-o", "s3://ckpts/elsewhere/m.json")
            assert r.exit_code == 2, r.output
            assert r.stderr.startswith("error: [E100] ") and "--output" in r.stderr and "s3://" in r.stderr, r.stderr
            assert os.listdir(tmp_path) == []
    assert "manifest.json" not in os.listdir(sample_ckpt)
    r = cli(s3_server, "manifest", url, "-o", f"file://{tmp_path}/m.json")  # file://PATH is the local PATH
    assert r.exit_code == 0 and r.stdout.startswith(f"wrote {tmp_path}/m.json: "), r.output
    assert os.listdir(tmp_path) == ["m.json"]


@pytest.mark.parametrize(
    "args",
    [
        ["export", "{url}", "{out}", "--model-assets", "s3://ckpts/assets"],
        ["validate", "{url}", "--config", "s3://ckpts/config.json"],
        ["validate", "{url}", "--against", "s3://ckpts/ref"],
    ],
)
def test_a_url_for_a_local_file_option_is_refused_naming_the_url(
    args: list[str], sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """--model-assets / --config / --against read local files only: a URL was taken as the local path
    's3:/ckpts/...' ('s3:/ckpts/assets: --model-assets is not a directory'); it is E100 naming the option and the
    URL as given, before the checkpoint is read."""
    url = upload(s3_server, sample_ckpt)
    r = cli(s3_server, *[a.format(url=url, out=tmp_path / "out") for a in args])
    assert r.exit_code == 2, r.output
    line = r.stderr.splitlines()[0]
    assert line.startswith(f"error: [E100] Invalid value for '{args[-2]}'"), line
    assert f"{args[-1]}: a URL;" in line and "s3:/ckpts" not in line.replace("s3://", "")
    assert not (tmp_path / "out").exists()


def test_a_remote_run_root_names_the_checkpoints_below_it(sample_ckpt: Path, s3_server: Any) -> None:
    """A URL of a run root (step-100/, step-200/ with .metadata each; step-300/ unfinished): step discovery is for
    local directories (docs/storage.md), so E200 'no .metadata object' — its hint now names the prefixes below
    that hold a .metadata (the newest last) instead of only 'pass the URL of the prefix that dcp.save wrote'."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    for step in ("step-100", "step-200"):
        s3_server.upload_dir(sample_ckpt, "ckpts", f"{run}/{step}")
    s3_server.client().upload_file(str(sample_ckpt / "__0_0.distcp"), "ckpts", f"{run}/step-300/__0_0.distcp")
    url = f"s3://ckpts/{run}"
    for args in (["inspect", url], ["validate", url, "--step", "latest"]):
        r = cli(s3_server, *args)
        assert r.exit_code == 2, r.output
        assert "Traceback" not in r.output
    r = cli(s3_server, "inspect", url)
    assert r.stderr.splitlines() == [
        f"error: [E200] {url}: no .metadata object; not a DCP checkpoint (remote checkpoints are opened at their "
        "own prefix, without step discovery or safetensors-only storage)",
        f"hint: checkpoints below it: {url}/step-100, {url}/step-200 (pass one of them)",
    ]


def test_step_on_a_remote_run_root_names_its_complete_checkpoints(sample_ckpt: Path, s3_server: Any) -> None:
    """`--step latest` / `--step N` on a URL run root (step-1/, step-2/ complete; the newest, step-3/, a save that did
    not finish: a data object, no .metadata): step discovery is for local directories, so E100 — its hint named no
    prefix ('pass the URL of the checkpoint prefix itself'); it now names the complete checkpoints below, the newest
    last, and not the incomplete step-3, as the E200 of the run root without --step does."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    for step in ("step-1", "step-2"):
        s3_server.upload_dir(sample_ckpt, "ckpts", f"{run}/{step}")
    s3_server.client().upload_file(str(sample_ckpt / "__0_0.distcp"), "ckpts", f"{run}/step-3/__0_0.distcp")
    url = f"s3://ckpts/{run}"
    for args in (
        ["validate", url, "--step", "latest"],
        ["inspect", url, "--step", "2"],
        ["stats", url, "--step", "latest"],
    ):
        r = cli(s3_server, *args)
        assert r.exit_code == 2, r.output
        assert r.stderr.splitlines() == [
            f"error: [E100] {url}: --step is not supported for a URL (step discovery and model/optimizer pairs are "
            "for local directories)",
            f"hint: checkpoints below it: {url}/step-1, {url}/step-2 (pass one of them)",
        ], r.stderr
    assert s3_server.keys("ckpts", f"{run}/step-3/") == [f"{run}/step-3/__0_0.distcp"]  # nothing written


def test_diff_step_on_a_remote_run_root_names_its_checkpoints(sample_ckpt: Path, s3_server: Any) -> None:
    """`diff LOCAL s3://.../run --step latest`: the URL side is a run root, but steps are picked below local
    directories only; the error said that neither side 'is a directory of several checkpoints' (the URL one is).
    It names the URL side and, in its hint, the complete checkpoints below it (not the unfinished step-3)."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    for step in ("step-1", "step-2"):
        s3_server.upload_dir(sample_ckpt, "ckpts", f"{run}/{step}")
    s3_server.client().upload_file(str(sample_ckpt / "__0_0.distcp"), "ckpts", f"{run}/step-3/__0_0.distcp")
    url = f"s3://ckpts/{run}"
    r = cli(s3_server, "diff", str(sample_ckpt), url, "--step", "latest")
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [
        f"error: [E100] --step latest given, but {url} is a URL: steps are picked below local directories only",
        f"hint: checkpoints below it: {url}/step-1, {url}/step-2 (pass one of them)",
    ], r.stderr


def test_a_dcp_output_written_to_a_url_records_its_url_as_checkpoint_id(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """`import HF s3://b/out` and `reshard CKPT s3://b/out`: `.metadata`'s `storage_meta.checkpoint_id` was
    '/b/out' (the URL made a local Path, its scheme dropped: a path that names nothing); it is the URL, as torch's
    FsspecWriter records it (and the local path for a local output, as FileSystemWriter does). Read back with
    torch's own FileSystemReader from the downloaded objects."""
    from torch.distributed.checkpoint import FileSystemReader

    hf = tmp_path / "hf"
    assets = sample_ckpt / "model_assets"
    assert runner.invoke(app, ["export", str(sample_ckpt), str(hf), "--model-assets", str(assets)]).exit_code == 0
    url = upload(s3_server, sample_ckpt)
    for args, out in (
        (["import", str(hf)], f"{url}-imp"),
        (["reshard", url, "--to", "canonical", "--with-optimizer"], f"{url}-rs"),
    ):
        r = cli(s3_server, *args[:2], out, *args[2:])
        assert r.exit_code == 0, r.output
        local = tmp_path / out.rsplit("/", 1)[1]
        s3_server.download_dir("ckpts", out.split("/", 3)[3], local)
        assert FileSystemReader(local).read_metadata().storage_meta.checkpoint_id == out
    assert runner.invoke(app, ["import", str(hf), str(tmp_path / "here")]).exit_code == 0
    assert FileSystemReader(tmp_path / "here").read_metadata().storage_meta.checkpoint_id == str(tmp_path / "here")


def test_folder_markers_are_directories_not_objects(sample_ckpt: Path, s3_server: Any, tmp_path: Path) -> None:
    """Zero-byte objects whose key ends in '/' (what an S3 console's "Create folder" writes): inside a checkpoint,
    `extra_state/` was read as the storage path 'extra_state/' ('has an empty component: it could leave the
    checkpoint prefix', S013 E101: validate failed a good checkpoint); an output prefix holding only its own marker
    (an empty folder) was 'already holds 1 object(s)' (E600), with --overwrite 'holds 1 entry ()' (E606), where an
    empty local directory is a valid output. Both are read as the folders they stand for."""
    url = upload(s3_server, sample_ckpt)
    c = s3_server.client()
    prefix = url.split("/", 3)[3]
    for key in (f"{prefix}/", f"{prefix}/extra_state/"):
        c.put_object(Bucket="ckpts", Key=key, Body=b"")

    def findings(*args: str) -> list[dict[str, Any]]:
        r = cli(s3_server, "validate", "--json", "--strict", "--deep", *args)
        assert r.exit_code == 0, r.output
        return [{k: f[k] for k in ("code", "key", "severity")} for f in json.loads(r.stdout)["findings"]]

    assert findings(url) == findings(str(sample_ckpt))
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local")]).exit_code == 0
    for name, extra in (("empty", []), ("empty-ow", ["--overwrite"])):
        c.put_object(Bucket="ckpts", Key=f"{prefix}-{name}/", Body=b"")
        r = cli(s3_server, "export", url, f"{url}-{name}", *extra)
        assert r.exit_code == 0, r.output
        assert f"{prefix}-{name}/" in s3_server.keys("ckpts", f"{prefix}-{name}/")  # the folder stays a folder
        c.delete_object(Bucket="ckpts", Key=f"{prefix}-{name}/")  # (download_dir writes files only)
        assert download(s3_server, "ckpts", f"{prefix}-{name}", tmp_path / name) == files_of(tmp_path / "local")


def test_an_output_prefix_with_glob_characters_is_written_and_replaced_as_named(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """An output prefix `s3://b/run/exp[v2]`: fsspec's copy and rm read '[v2]' in a key as a pattern. `--overwrite`
    of a previous output there (copied in with boto3, as `aws s3 sync` would) deleted what the pattern matched
    instead of its markers: `run/expv/model.safetensors.index.json`, an object ckpttool did not write; then the
    publish failed (E141 naming the temporary object) and left the temporary objects. A new output there failed the
    same way. Each key is now copied and deleted as it is named."""
    url = upload(s3_server, sample_ckpt)
    run = f"run-{uuid.uuid4().hex[:8]}"
    c = s3_server.client()
    c.put_object(Bucket="ckpts", Key=f"{run}/expv/model.safetensors.index.json", Body=b'{"theirs": true}')
    c.put_object(Bucket="ckpts", Key=f"{run}/exp2/.ckpttool-output.json", Body=b"theirs")
    theirs = s3_server.keys("ckpts", f"{run}/exp")
    r = cli(s3_server, "export", url, f"s3://ckpts/{run}/plain", "--shard-size", "100KB")
    assert r.exit_code == 0, r.output
    for key in s3_server.keys("ckpts", f"{run}/plain/"):
        c.copy_object(
            Bucket="ckpts", Key=key.replace("/plain/", "/exp[v2]/"), CopySource={"Bucket": "ckpts", "Key": key}
        )
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local")]).exit_code == 0
    for name, extra in (("exp[v2]", ["--overwrite"]), ("new[1]", [])):
        r = cli(s3_server, "export", url, f"s3://ckpts/{run}/{name}", *extra)
        assert [k for k in s3_server.keys("ckpts", f"{run}/exp") if "[v2]" not in k] == theirs
        assert r.exit_code == 0, r.output
        assert download(s3_server, "ckpts", f"{run}/{name}", tmp_path / name) == files_of(tmp_path / "local")
        assert not [k for k in s3_server.keys("ckpts") if "ckpttool-tmp" in k]


def test_import_of_a_url_names_the_url_and_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`import s3://bucket/model OUT`: the Hugging Face folder is read from a local directory; the URL was taken as
    the local path 's3:/bucket/model' ('no such directory', with a hint listing the current directory's entries).
    It is E100 naming the URL as given, before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "unrelated-run").mkdir()
    r = runner.invoke(app, ["import", "s3://ckpts/hf-model", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[0] == (
        "error: [E100] s3://ckpts/hf-model: a URL; import reads the Hugging Face model from a local directory"
    ), r.stderr
    assert "unrelated-run" not in r.stderr and "Traceback" not in r.output
    assert os.listdir(tmp_path) == ["unrelated-run"]


def test_inspect_of_a_url_reads_no_local_file_named_like_it(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training state 'beside' s3://ckpts/P was looked for on the local disk, below ./s3:/ckpts (the URL made
    a Path): with such a folder in the current directory inspect --json was E999 'UrlPath has no attribute
    resolve'. A URL's neighbours are never local files: the report is the one of a clean directory."""
    url = upload(s3_server, sample_ckpt)
    monkeypatch.chdir(tmp_path)
    clean = cli(s3_server, "inspect", "--json", url)
    assert clean.exit_code == 0, clean.output
    (tmp_path / "s3:" / "ckpts" / "train").mkdir(parents=True)
    (tmp_path / "s3:" / "ckpts" / "train" / "rank0.pt").write_bytes(b"not a checkpoint of that bucket")
    r = cli(s3_server, "inspect", "--json", url)
    assert r.exit_code == 0, r.output
    a, b = json.loads(r.stdout), json.loads(clean.stdout)
    assert a["trainer_state"] == b["trainer_state"] and a["training_values"] == b["training_values"]


def test_rules_reading_files_beside_a_remote_megatron_checkpoint_are_skipped_not_run_on_local_look_alikes(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate s3://…/iter_0000003 of a Megatron save said `common.pt: missing` (K014) and `metadata.json`
    absent (K013): the rules looked for them in the local folder `s3:/…` (Path() of the URL). They are skipped
    with the reason, and a local folder of that name is not read."""
    local = Path(__file__).parent.parent / "fixtures" / "megatron_data" / "dense1" / "iter_0000003"
    url = upload(s3_server, local)
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / url.replace("://", ":/")
    planted.mkdir(parents=True)
    (planted / "metadata.json").write_text("{not json")
    r = cli(s3_server, "validate", url, "--json")
    doc = json.loads(r.stdout)
    assert not [f for f in doc["findings"] if f["code"] in ("K011", "K013", "K014")], doc["findings"]
    skipped = {x["code"]: x["reason"] for x in doc["rules"] if x.get("status") == "skipped"}
    assert all("not fetched" in skipped.get(c, "") for c in ("K011", "K013")), skipped
    assert "K014" not in skipped  # common.pt's presence is known from the listing


def test_a_remote_megatron_checkpoint_without_common_pt_fails_k014_as_its_local_copy(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K014 (common.pt missing, megatron's load fails) was skipped for a URL ("the files beside it are not
    fetched"): it is known from the prefix's listing, so the remote copy fails as the local one does; a local
    look-alike folder s3:/… holding a common.pt is not read."""
    import shutil

    local = tmp_path / "iter_0000003"
    shutil.copytree(MEGATRON_DENSE1, local)
    (local / "common.pt").unlink()
    url = upload(s3_server, local)
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / url.replace("://", ":/")
    planted.mkdir(parents=True)
    shutil.copy(MEGATRON_DENSE1 / "common.pt", planted / "common.pt")
    r = cli(s3_server, "validate", url, "--json")
    lo = cli(s3_server, "validate", str(local), "--json")
    assert r.exit_code == lo.exit_code == 1, (r.output, lo.output)
    a, b = json.loads(r.stdout), json.loads(lo.stdout)
    k014 = [f for f in a["findings"] if f["code"] == "K014"]
    assert [f["key"] for f in k014] == ["common.pt"]
    assert k014[0]["message"].startswith(f"{url}/common.pt: missing; megatron-core's dist_checkpointing.load")
    assert _findings(a, url) == _findings(b, str(local))


MEGATRON_DENSE1 = Path(__file__).parent.parent / "fixtures" / "megatron_data" / "dense1" / "iter_0000003"


def _findings(doc: dict[str, Any], where: str) -> list[tuple[str, str, str | None, str]]:
    return sorted(
        (f["code"], f["severity"], f.get("key"), f["message"].replace(where, "<ckpt>")) for f in doc["findings"]
    )


def test_a_remote_megatron_checkpoint_reads_its_common_pt_as_the_local_copy_does(s3_server: Any) -> None:
    """validate s3://…/iter_0000003 of a Megatron save said "optimizer state lacks step (has exp_avg, exp_avg_sq)"
    and R002 could not check the iteration: common.pt (the param groups, the shared step, the iteration) was not
    fetched. It is read through the checkpoint's reader: the findings and inspect's trainer state and param groups
    are those of the local copy."""
    url = upload(s3_server, MEGATRON_DENSE1)
    remote = cli(s3_server, "validate", url, "--json")
    local = cli(s3_server, "validate", str(MEGATRON_DENSE1), "--json")
    assert remote.exit_code == local.exit_code, (remote.output, local.output)
    r, lo = json.loads(remote.stdout), json.loads(local.stdout)
    assert _findings(r, url) == _findings(lo, str(MEGATRON_DENSE1))
    assert not [f for f in r["findings"] if "lacks step" in f["message"]], r["findings"]
    ran = {x["code"] for x in r["rules"] if x.get("status") != "skipped"}
    assert "R002" in ran
    remote = cli(s3_server, "inspect", "--json", url)
    local = cli(s3_server, "inspect", "--json", str(MEGATRON_DENSE1))
    assert remote.exit_code == local.exit_code == 0, (remote.output, local.output)
    r, lo = json.loads(remote.stdout), json.loads(local.stdout)
    assert r["trainer_state"] == lo["trainer_state"] and r["training_values"] == lo["training_values"]
    assert r["trainer_state"] and r["trainer_state"][0]["values"]["iteration"] == 3
    assert r["optimizer"] == lo["optimizer"] and len(r["optimizer"]["param_groups"]) == 2


@pytest.mark.parametrize("damage", ["over the cap", "code-running pickle"])
def test_a_remote_common_pt_is_refused_as_the_local_one_is(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A remote common.pt over --max-object-size or holding a call to eval is refused with the local copy's error
    (E307 / E304, the same exit status), and the pickle never runs."""
    import shutil

    import torch

    from tests.fixtures.hostile import Call

    local = tmp_path / "iter_0000003"
    shutil.copytree(MEGATRON_DENSE1, local)
    canary = tmp_path / "ran"
    caps: list[str] = []
    if damage == "over the cap":
        caps = ["--max-object-size", "1KiB"]
    else:
        torch.save({"iteration": 3, "x": Call(eval, f"open({str(canary)!r}, 'w').close()")}, local / "common.pt")
    url = upload(s3_server, local)
    monkeypatch.chdir(tmp_path)
    for cmd in (["validate", "--json"], ["inspect", "--json"]):
        r = runner.invoke(app, [*s3_server.cli_options(), *caps, cmd[0], url, *cmd[1:]])
        lo = runner.invoke(app, [*caps, cmd[0], str(local), *cmd[1:]])
        assert lo.exit_code != 0 and r.exit_code == lo.exit_code, (r.output, lo.output)
        first = lo.stderr.splitlines()[0]
        assert "common.pt" in first and "Traceback" not in r.output
        assert r.stderr.splitlines()[0] == first.replace(str(local), url), (r.stderr, lo.stderr)
    assert not canary.exists()


def test_a_remote_checkpoint_dropped_without_close_deletes_its_spool(s3_server: Any, tmp_path: Path) -> None:
    """A remote checkpoint opened and read without ``close()`` (a notebook cell) left its spool directory, with the
    fetched windows, in $TMPDIR and its descriptors open for the life of the process; a handle no longer referenced
    deletes it, as ``close()`` does."""
    import gc

    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.model.checkpoint import open_checkpoint

    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    dcp.save({"w": w}, checkpoint_id=tmp_path / "a", no_dist=True)
    url = upload(s3_server, tmp_path / "a")
    with storage_config(options=s3_server.options()):
        ck = open_checkpoint(url)
        assert torch.equal(ck.reader.read_tensor("w"), w)
        spool = ck.reader.spool
        assert spool is not None and spool.dir.is_dir()
        folder, fds = spool.dir, list(spool._fds.values())
        del ck, spool
        gc.collect()
    assert not folder.exists()
    for fd in fds:
        assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}").find(folder.name) < 0


def test_an_overwrite_over_a_marker_larger_than_any_of_ckpttools_is_e606_as_locally(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """A prefix holding a user's object and a `.ckpttool-output.json` over the 64 MiB marker cap: `--overwrite` is
    E606 (not provably ckpttool's), as a local directory with that file is; both objects are left as they are. Was
    E307 with a hint to raise `--max-object-size`, which does not move the fixed marker cap."""
    url = upload(s3_server, sample_ckpt)
    big = b" " * (64 << 20) + b"{}"
    s3 = s3_server.client()
    s3.put_object(Bucket="ckpts", Key="big/notes.txt", Body=b"my notes")
    s3.put_object(Bucket="ckpts", Key="big/.ckpttool-output.json", Body=big)
    res = cli(s3_server, "--max-object-size", "1GB", "export", url, "s3://ckpts/big", "--overwrite")
    assert res.exit_code == 2 and "[E606]" in res.stderr and "Traceback" not in res.output, res.output
    assert "its .ckpttool-output.json of 67108866 bytes is larger than any ckpttool marker" in res.stderr
    assert sorted(s3_server.keys("ckpts", "big/")) == ["big/.ckpttool-output.json", "big/notes.txt"]
    assert s3.get_object(Bucket="ckpts", Key="big/notes.txt")["Body"].read() == b"my notes"
    local = tmp_path / "big"
    local.mkdir()
    (local / "notes.txt").write_bytes(b"my notes")
    (local / ".ckpttool-output.json").write_bytes(big)
    res = runner.invoke(app, ["export", str(sample_ckpt), str(local), "--overwrite"])
    assert res.exit_code == 2 and "[E606]" in res.stderr, res.output


def test_a_data_object_whose_key_holds_version_id_is_read_by_its_own_key(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """A data object named ``__0_0.distcp?versionId=v1`` (characters of its key, as a local file name holds them):
    s3fs's ``split_path`` cut the key at ``?versionId=`` and asked for ``__0_0.distcp``, an object not listed, so
    every read failed ``E300`` "the object was deleted since it was listed" (it never was) while the local copy
    reads whole. Each read now asks for the key as listed: ``validate --deep`` and ``export`` give what they give
    for the local copy."""
    import dataclasses

    from tests.fixtures.metadata_edit import load_md, save_md

    odd = "__0_0.distcp?versionId=v1"
    ckpt = copy_checkpoint(sample_ckpt, tmp_path / "ck")
    md = load_md(ckpt)
    for k, info in list(md.storage_data.items()):
        if info.relative_path == "__0_0.distcp":
            md.storage_data[k] = dataclasses.replace(info, relative_path=odd)
    save_md(ckpt, md)
    (ckpt / "__0_0.distcp").rename(ckpt / odd)
    url = upload(s3_server, ckpt)
    assert f"{url.split('/', 3)[3]}/{odd}" in s3_server.keys("ckpts")
    local = runner.invoke(app, ["--json", "validate", str(ckpt), "--deep"])
    remote = cli(s3_server, "--json", "validate", url, "--deep")
    assert local.exit_code == 0, local.output
    assert remote.exit_code == 0, remote.output[:600]
    assert json.loads(remote.stdout)["findings"] == json.loads(local.stdout)["findings"]
    assert json.loads(remote.stdout)["stats"]["bytes_read"] == json.loads(local.stdout)["stats"]["bytes_read"]
    assert runner.invoke(app, ["export", str(ckpt), str(tmp_path / "local")]).exit_code == 0
    r = cli(s3_server, "export", url, str(tmp_path / "from_s3"))
    assert r.exit_code == 0, r.output
    assert files_of(tmp_path / "from_s3") == files_of(tmp_path / "local")


def test_overwrite_deletes_a_stale_object_whose_key_holds_version_id_by_that_key(
    sample_ckpt: Path, s3_server: Any, tmp_path: Path
) -> None:
    """A previous output whose marker lists an object ``model.safetensors?versionId=X`` (written there beside it):
    ``--overwrite`` deletes it as stale, and s3fs cut the key at ``?versionId=``, deleting ``model.safetensors``,
    the weights it had just published, then published the index and the marker: exit 0 and an output that looked
    complete without its weights. The stale object is now deleted by its own key; the output is the local export."""
    from ckpttool.format import marker

    url = upload(s3_server, sample_ckpt)
    out = url + "-hf"
    assert cli(s3_server, "export", url, out).exit_code == 0
    bucket, prefix = out[len("s3://") :].split("/", 1)
    c = s3_server.client()
    doc = json.loads(c.get_object(Bucket=bucket, Key=f"{prefix}/{marker.MARKER_NAME}")["Body"].read())
    name, body = "model.safetensors?versionId=X", b"an object beside the output"
    c.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)
    doc["files"][name] = [len(body), marker.digest_parts(len(body), body, b"")]
    c.put_object(Bucket=bucket, Key=f"{prefix}/{marker.MARKER_NAME}", Body=marker.marker_bytes(doc))
    r = cli(s3_server, "export", url, out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "local")]).exit_code == 0
    assert download(s3_server, bucket, prefix, tmp_path / "dl") == files_of(tmp_path / "local")


def test_a_storage_option_of_the_wrong_type_is_named_as_one(s3_server: Any) -> None:
    """``--storage-option config_kwargs.retries=3`` (botocore takes a dict there) was E140 'storage request failed
    (AttributeError: ...)' with the URL hint, about a URL that was right; the message and hint now name the options
    and how a nested setting is given."""
    s3_server.bucket("ckpts")
    opts = ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint}"]
    r = runner.invoke(app, [*opts, "--storage-option", "config_kwargs.retries=3", "inspect", "s3://ckpts/x"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: [E140] s3://ckpts/x: listing: the backend could not use the storage options")
    assert "config_kwargs.retries.max_attempts=3" in lines[1] and len(lines) == 2, r.stderr
