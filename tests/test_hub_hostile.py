"""A hostile Hub (issue 31, H1 and M1): commit ids that are paths, replies that never end or
arrive a byte at a time, a 1 GiB config.json, thousands of shards, credentials in HF_ENDPOINT.

The stand-in Hub is a loopback server run by the test, reached through HF_ENDPOINT, so the real
huggingface_hub client runs. Every server here is bounded: it stops writing after a fixed number
of bytes or seconds, whatever the client does.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.inputs import hub, hub_limits
from launcher.paths import inside

CONFIG = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=512, vocab_size=1000, num_hidden_layers=2,
              max_position_embeddings=2048, torch_dtype="bfloat16")
GOOD_SHA = "0123456789abcdef0123456789abcdef01234567"
SERVER_CAP_S = 30.0  # no hostile reply lasts longer than this, whatever the client does


class Hostile:
    """A Hub whose model info and files are whatever the test says, and how it sends them."""

    def __init__(self) -> None:
        self.sha: Any = GOOD_SHA
        self.files: dict[str, bytes] = {"config.json": json.dumps(CONFIG).encode()}
        self.info_extra: dict[str, Any] = {}
        # name -> a sender(handler) that writes the whole reply itself (hostile forms)
        self.senders: dict[str, Callable[[BaseHTTPRequestHandler], None]] = {}
        self.requests: list[str] = []
        self.sent = 0  # body bytes the hostile senders wrote
        self.lock = threading.Lock()

    def count(self, n: int) -> None:
        with self.lock:
            self.sent += n


def _handler(h: Hostile) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _serve(self) -> None:
            h.requests.append(f"{self.command} {self.path}")
            path = self.path.split("?")[0]
            if path.startswith("/api/models/"):
                if "info" in h.senders:
                    h.senders["info"](self)
                    return
                info = {"id": "acme/x", "sha": h.sha,
                        "siblings": [{"rfilename": f} for f in h.files], **h.info_extra}
                self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                return
            name = path.split("/resolve/", 1)[-1].split("/", 1)[-1]
            if name in h.senders:
                h.senders[name](self)
                return
            data = h.files.get(name)
            if data is None:
                self._reply(404, b"", {"X-Error-Code": "EntryNotFound"})
                return
            self._reply(200, data, {"X-Repo-Commit": GOOD_SHA, "ETag": f'"{len(data)}-{name}"'})

        do_GET = do_HEAD = _serve  # noqa: N815 - http.server's naming

    return Handler


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hostile]:
    state = Hostile()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(k, raising=False)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    monkeypatch.setenv("HF_ENDPOINT", state.url)  # type: ignore[attr-defined]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "vlaunch"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield state
    server.shutdown()
    server.server_close()


def _one_line(args: list[str]) -> str:
    r = CliRunner().invoke(cli, ["plan", *args, "--gpus", "1xH100"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("vlaunch: error: "), r.stderr
    return lines[0]


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


# ----------------------------------------------------------------------------- H1


def _hostile_ids(rng: random.Random, outside: Path) -> list[Any]:
    """Commit ids a hostile server might answer: paths, climbs, NUL, long, near-misses."""
    fixed: list[Any] = [str(outside / "y"), f"{outside}/y", "../../../y", "../" * 8 + "y",
                        "a" * 39, "a" * 41, "A" * 40, "g" * 40, GOOD_SHA[:-1] + "\x00",
                        GOOD_SHA + "/../x", "/" + GOOD_SHA[1:], "x" * 10_000, "", None, 7,
                        ["a" * 40], " " + GOOD_SHA[1:], GOOD_SHA[:-1] + "\n", ".", ".."]
    alphabet = "abcdef0123456789/.\\\x00\n~ AZ%"
    for _ in range(40):
        n = rng.choice([1, 39, 40, 41, rng.randint(2, 300)])
        fixed.append("".join(rng.choice(alphabet) for _ in range(n)))
    return fixed


def test_a_commit_id_is_taken_only_as_40_hex_digits(hostile: Hostile, tmp_path: Path) -> None:
    """The attack: model info whose "sha" is an absolute path ending in /y made `plan` exit 0
    and write y.json there. Every hostile id is refused with one line, and no file appears
    anywhere but the two caches."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ids = _hostile_ids(random.Random(31), outside)
    for sha in ids:
        if isinstance(sha, str) and hub.is_commit(sha):
            continue  # a random draw that happens to be a commit
        hostile.sha = sha
        with pytest.raises(InputError, match="not 40 hex digits"):
            hub.fetch("acme/x")
    assert _files_under(outside) == set()
    for p in _files_under(tmp_path):
        assert p.is_relative_to(tmp_path / "hf") or p.is_relative_to(tmp_path / "vlaunch"), p
    # no request ever named a hostile id as a revision: no file was asked for at all
    assert any("/api/models/acme/x" in r for r in hostile.requests)
    assert not any("/resolve/" in r for r in hostile.requests), hostile.requests
    hostile.sha = str(outside / "y")
    assert "not 40 hex digits" in _one_line(["acme/x"])
    assert not (outside / "y.json").exists() and not (outside / "y").exists()


def test_a_sound_commit_still_plans_and_is_kept_inside_the_cache(hostile: Hostile,
                                                                   tmp_path: Path) -> None:
    model = hub.fetch("acme/x")
    assert model.commit == GOOD_SHA
    kept = tmp_path / "vlaunch" / "hub" / "acme--x" / f"{GOOD_SHA}.json"
    assert kept.is_file()
    # revision= sent back to the Hub is the checked commit, never the user's branch name
    assert any(f"/resolve/{GOOD_SHA}/config.json" in r for r in hostile.requests)


HOSTILE_CHARS = "ab09/._-+\x00\n \\~:%@"


def test_every_revision_either_is_refused_or_stays_inside_the_cache(tmp_path: Path) -> None:
    """Property over 600 hostile revisions: `_check` refuses it (InputError), or every path
    built from it lies inside its folder."""
    rng = random.Random(7)
    base = tmp_path / "hf" / "models--acme--x"
    samples = ["../x", "/etc/passwd", "refs/../../x", "a/../../b", "main", "refs/pr/1", "v1.0",
               "a" * 201, "..", ".", "a/", "a//b", "\x00", "main\n", "-rf"]
    samples += ["".join(rng.choice(HOSTILE_CHARS if rng.random() < 0.5 else "ab09/._-")
                        for _ in range(rng.randint(1, 30))) for _ in range(600)]
    accepted = 0
    for rev in samples:
        try:
            hub._check("acme/x", rev)  # noqa: SLF001 - the one gate every lookup passes
        except InputError:
            continue
        accepted += 1
        for folder in (base / "refs", base / "snapshots"):
            p = inside(folder, rev)
            assert os.path.realpath(p).startswith(os.path.realpath(folder) + "/"), rev
        assert "\x00" not in rev and ".." not in rev.split("/") and not rev.startswith("/")
    assert accepted > 20  # the property is not vacuous: ordinary branch names pass
    for rev in ("main", "refs/pr/1", "v1.0", "release-2024.1"):
        hub._check("acme/x", rev)  # noqa: SLF001


def test_inside_refuses_every_escape(tmp_path: Path) -> None:
    rng = random.Random(3)
    (tmp_path / "link").symlink_to("/")
    bad = ["/abs", "../x", "a/../../x", "", "a\x00b", ".", "a/./b", "x" * 2000, "link/etc"]
    bad += ["/".join(rng.choice(["..", "a", "", "."]) for _ in range(rng.randint(2, 6)))
            for _ in range(200)]
    for name in bad:
        parts = name.split("/")
        if all(p not in ("", ".", "..") for p in parts) and name not in ("link/etc",) \
                and len(name) <= 1020 and "\x00" not in name:
            continue  # a draw with nothing hostile in it
        with pytest.raises(InputError):
            inside(tmp_path, name)
    assert inside(tmp_path, "a", "b.json") == tmp_path / "a" / "b.json"


# ----------------------------------------------------------------------------- M1


def _send_headers(handler: BaseHTTPRequestHandler, length: int | None) -> None:
    handler.send_response(200)
    handler.send_header("X-Repo-Commit", GOOD_SHA)
    handler.send_header("ETag", '"big"')
    if length is not None:
        handler.send_header("Content-Length", str(length))
    else:
        handler.send_header("Connection", "close")
    handler.end_headers()


def _stream(h: Hostile, handler: BaseHTTPRequestHandler, limit: int,
            chunk: bytes, pause_s: float = 0.0) -> None:
    """Write `chunk` until the client goes, `limit` bytes or SERVER_CAP_S pass."""
    end = time.monotonic() + SERVER_CAP_S
    sent = 0
    try:
        while sent < limit and time.monotonic() < end:
            handler.wfile.write(chunk)
            handler.wfile.flush()
            sent += len(chunk)
            h.count(len(chunk))
            if pause_s:
                time.sleep(pause_s)
    except OSError:
        pass
    handler.close_connection = True


def test_a_1_gib_config_json_is_refused_before_its_body_is_read(hostile: Hostile) -> None:
    def huge(handler: BaseHTTPRequestHandler) -> None:
        _send_headers(handler, 1 << 30)
        if handler.command == "GET":
            _stream(hostile, handler, 1 << 30, b"{" * 65536)

    hostile.senders["config.json"] = huge
    line = _one_line(["acme/x"])
    assert "more than 32 MiB" in line and "config.json" in line
    # refused on the declared length: at most what the socket buffers took, not 1 GiB
    assert hostile.sent < 64 << 20


def test_an_endless_reply_is_stopped_at_the_cap(hostile: Hostile,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_limits, "MAX_REPLY_BYTES", 1 << 20)

    def endless(handler: BaseHTTPRequestHandler) -> None:
        _send_headers(handler, None)  # no length: the body ends when the server closes
        if handler.command == "GET":
            _stream(hostile, handler, 1 << 40, b" " * 65536)

    hostile.senders["config.json"] = endless
    line = _one_line(["acme/x"])
    assert "more than 1 MiB" in line
    assert hostile.sent < 64 << 20  # stopped near the cap (plus socket buffers), not 12 GB


def test_a_drip_fed_reply_is_bounded_by_the_total_deadline(
        hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.2 s never trips a 10 s socket timeout; the lookup's deadline stops it."""
    monkeypatch.setattr(hub_limits, "DEADLINE_S", 1.5)
    body = json.dumps({"id": "acme/x", "sha": GOOD_SHA, "siblings": []}).encode() * 1000

    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        _stream(hostile, handler, len(body), b" ", pause_s=0.2)

    hostile.senders["info"] = drip
    with pytest.raises(InputError, match="took more than 2 s"):
        hub.fetch("acme/x")
    assert hostile.sent < 200  # a few seconds of drip, never the whole reply


def test_drip_fed_headers_are_bounded_by_the_total_deadline(
        hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers a byte at a time: no hook runs inside that read, the deadline still ends it."""
    monkeypatch.setattr(hub_limits, "DEADLINE_S", 1.0)

    def drip_headers(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        _stream(hostile, handler, 1 << 20, b"X", pause_s=0.2)

    hostile.senders["info"] = drip_headers
    with pytest.raises(InputError, match="took more than 1 s"):
        hub.fetch("acme/x")


def test_a_compressed_reply_is_refused(hostile: Hostile) -> None:
    """Counted bytes must be the bytes kept: a 1 KiB gzip inflates to 1 MiB and more."""
    import gzip

    packed = gzip.compress(b" " * (4 << 20))

    def zipped(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("Content-Length", str(len(packed)))
        handler.end_headers()
        handler.wfile.write(packed)

    hostile.senders["config.json"] = zipped
    assert "compressed" in _one_line(["acme/x"])


def test_thousands_of_shards_are_refused_after_one_index(hostile: Hostile,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    index = {"metadata": {"total_size": 1},
             "weight_map": {f"t{i}": f"model-{i:05d}-of-03000.safetensors"
                            for i in range(3000)}}
    hostile.files["model.safetensors.index.json"] = json.dumps(index).encode()
    line = _one_line(["acme/x"])
    assert "3,000 safetensors shards" in line
    assert not any("model-0" in r for r in hostile.requests)  # no shard header was asked for
    assert len(hostile.requests) < 10


def test_a_shard_name_outside_the_folder_is_refused(hostile: Hostile) -> None:
    index = {"weight_map": {"a": "../../../etc/passwd"}}
    hostile.files["model.safetensors.index.json"] = json.dumps(index).encode()
    assert "climbs out" in _one_line(["acme/x"])


def test_credentials_in_hf_endpoint_are_never_printed(hostile: Hostile,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url = hostile.url.replace("http://", "http://mirror-user:s3cret-pw@")  # type: ignore[attr-defined]
    monkeypatch.setenv("HF_ENDPOINT", url)
    hostile.sha = "../y"
    line = _one_line(["acme/x"])
    assert "s3cret" not in line and "mirror-user" not in line
    assert "127.0.0.1" in line
    del hostile.files["config.json"]
    hostile.sha = GOOD_SHA
    line = _one_line(["acme/x"])
    assert "s3cret" not in line and "mirror-user" not in line


# ----------------------------------------------------------------------------- M2


@pytest.mark.parametrize("params", [{"BF16": -2 * 10**12}, {"BF16": 10**9, "F32": -1},
                                    {"BF16": "7e9"}, {"BF16": 10**30}, {"BF16": True}])
def test_negative_or_nonsense_parameter_counts_from_the_hub_are_refused(
        hostile: Hostile, params: dict) -> None:
    """The attack: model info reporting −2e12 parameters planned −4 TB of weights and 4.1
    billion KV tokens on one H100, so the init container's does-not-fit gate passed."""
    hostile.info_extra = {"safetensors": {"parameters": params, "total": 1}}
    line = _one_line(["acme/x"])
    assert "parameter count" in line or "parameters" in line


def test_a_real_sized_shard_is_asked_about_and_read_by_range_not_refused(hostile: Hostile) -> None:
    """The caps count bytes sent, not the size a HEAD reply declares: huggingface_hub asks
    whether a 16 GiB model.safetensors exists (HEAD), then reads its header by range."""
    import struct

    header = json.dumps({"w": {"dtype": "BF16", "shape": [1000, 256],
                               "data_offsets": [0, 512000]}}).encode()
    head = struct.pack("<Q", len(header)) + header
    size = 16 << 30

    def shard(handler: BaseHTTPRequestHandler) -> None:
        rng = handler.headers.get("range") or ""
        if handler.command == "HEAD" or not rng:
            _send_headers(handler, size)
            return  # a GET without a range would be a download of weights: never sent
        lo, hi = (int(x) for x in rng.split("=")[1].split("-"))
        part = (head + b"\0" * 512000)[lo:hi + 1]
        handler.send_response(206)
        handler.send_header("Content-Range", f"bytes {lo}-{lo + len(part) - 1}/{size}")
        handler.send_header("Content-Length", str(len(part)))
        handler.send_header("X-Repo-Commit", GOOD_SHA)
        handler.send_header("ETag", '"shard"')
        handler.end_headers()
        handler.wfile.write(part)

    hostile.files["model.safetensors"] = b""
    hostile.senders["model.safetensors"] = shard
    model = hub.fetch("acme/x")
    assert model.params_by_dtype == {"BF16": 256_000}
