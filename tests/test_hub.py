"""Hugging Face ids against a stand-in Hub served by the test itself.

The server answers the routes the real huggingface_hub calls (the model-info API, HEAD/GET on
/ORG/NAME/resolve/REV/FILE with range requests for safetensors headers) and the error headers
the Hub sends (X-Error-Code: GatedRepo, RepoNotFound, RevisionNotFound, EntryNotFound), reached
through HF_ENDPOINT, so the real client code runs. Every test has its own HF cache and
vlaunch cache (tmp_path).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.inputs import hub
from launcher.inputs.model import load_model

ROOT = Path(__file__).resolve().parent.parent

CONFIG = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=512, vocab_size=1000, num_hidden_layers=2,
              max_position_embeddings=2048, torch_dtype="bfloat16", tie_word_embeddings=False)
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "U8": 1}


def safetensors_file(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A valid safetensors file: 8-byte header length, JSON header, zeroed tensor data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = 1
        for d in shape:
            n *= d
        size = n * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def random_tensors(rng: random.Random, count: int,
                   prefix: str = "t") -> dict[str, tuple[str, list[int]]]:
    return {f"{prefix}{i}": (rng.choice(sorted(DTYPE_BYTES)),
                             [rng.randint(1, 40), rng.randint(1, 40)]) for i in range(count)}


def counts(tensors: dict[str, tuple[str, list[int]]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for dtype, shape in tensors.values():
        out[dtype] = out.get(dtype, 0) + shape[0] * shape[1]
    return out


# ----------------------------------------------------------------------------- stand-in Hub


@dataclass
class Repo:
    files: dict[str, bytes]
    branches: dict[str, str]
    gated: bool = False
    params: dict[str, int] | None = None  # what the model-info API reports, when it does


@dataclass
class StandInHub:
    url: str
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    tokens: list[str | None] = field(default_factory=list)

    def add(self, repo_id: str, files: dict[str, bytes], branches: dict[str, str] | None = None,
            **kw: Any) -> str:
        sha = hashlib.sha1(repo_id.encode() + json.dumps(sorted(files)).encode()).hexdigest()
        self.repos[repo_id] = Repo(files, branches or {"main": sha}, **kw)
        return self.repos[repo_id].branches["main"]


def _handler(state: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _repo(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
            repo = state.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound")
                return None
            if repo.gated and not self.headers.get("authorization"):
                self._error(401, "GatedRepo")
                return None
            commit = repo.branches.get(rev) or (rev if rev in repo.branches.values() else None)
            if commit is None:
                self._error(404, "RevisionNotFound")
                return None
            return repo, commit

        def _serve(self, body: bool) -> None:
            state.requests.append(f"{self.command} {self.path}")
            state.tokens.append(self.headers.get("authorization"))
            path = self.path.split("?")[0]
            m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
            if m:
                found = self._repo(m.group(1), m.group(2) or "main")
                if found is None:
                    return
                repo, commit = found
                info: dict[str, Any] = {"id": m.group(1), "sha": commit,
                                        "siblings": [{"rfilename": f} for f in repo.files]}
                if repo.params:
                    info["safetensors"] = {"parameters": repo.params,
                                           "total": sum(repo.params.values())}
                data = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m:
                self._error(404, "RepoNotFound")
                return
            found = self._repo(m.group(1), m.group(2))
            if found is None:
                return
            repo, commit = found
            data = repo.files.get(m.group(3))
            if data is None:
                self._error(404, "EntryNotFound")
                return
            status = 200
            rng = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("range") or "")
            if rng:
                status, data = 206, data[int(rng.group(1)):int(rng.group(2)) + 1]
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", '"' + hashlib.sha256(repo.files[m.group(3)]).hexdigest()
                             + '"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._serve(True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(False)

    return Handler


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(StandInHub("")))
    state = StandInHub(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "vlaunch"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield state
    server.shutdown()
    server.server_close()


def plan_json(args: list[str]) -> tuple[int, dict[str, Any] | None, str]:
    r = CliRunner().invoke(cli, ["plan", *args, "--gpus", "1xH100", "--format", "json"])
    try:
        return r.exit_code, json.loads(r.stdout), r.stderr
    except (json.JSONDecodeError, ValueError):
        return r.exit_code, None, r.stderr


def one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(cli, ["plan", *args, "--gpus", "1xH100"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("vlaunch: error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


# ----------------------------------------------------------------------------- the Hub


def test_hub_id_plans_from_config_and_safetensors_headers(stand_in: StandInHub) -> None:
    rng = random.Random(7)
    shard1, shard2 = random_tensors(rng, 5, "a"), random_tensors(rng, 4, "b")
    index = {"metadata": {"total_size": 1}, "weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in shard1},
        **{k: "model-00002-of-00002.safetensors" for k in shard2}}}
    commit = stand_in.add("acme/tiny", {
        "config.json": json.dumps(CONFIG).encode(),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": safetensors_file(shard1),
        "model-00002-of-00002.safetensors": safetensors_file(shard2)})
    code, d, err = plan_json(["acme/tiny"])
    assert code == 0, err
    want = counts({**shard1, **shard2})
    m = d["model"]
    assert m["hf_id"] == "acme/tiny" and m["commit"] == commit and m["source"] == "hub"
    assert m["params_by_dtype"] == want and m["checkpoint_params"] == sum(want.values())
    # the headers' bytes are the truth, not the config's count
    assert m["weights_bytes"] == sum(n * DTYPE_BYTES[t] for t, n in want.items())
    assert d["vllm_args"][:2] == ["--model", "acme/tiny"] and "--revision" not in d["vllm_args"]
    # weights were never downloaded: shard bodies were only read by range, up to the header
    gets = [r for r in stand_in.requests if r.startswith("GET") and "model-0000" in r]
    assert gets and not any(r.startswith("GET") and r.endswith("/model.safetensors.index")
                            for r in stand_in.requests)


def test_model_info_parameter_counts_are_used_without_reading_headers(
        stand_in: StandInHub) -> None:
    params = {"BF16": 7_000_000_000, "F32": 1_000}
    stand_in.add("acme/big", {"config.json": json.dumps(CONFIG).encode(),
                              "model.safetensors.index.json": b"{}"}, params=params)
    spec = load_model("acme/big")
    assert dict(spec.params_by_dtype) == params
    assert spec.checkpoint_bytes == 2 * 7_000_000_000 + 4 * 1_000
    assert not any("safetensors" in r for r in stand_in.requests)


def test_second_plan_is_offline_from_vlaunch_cache(stand_in: StandInHub,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()},
                 params={"BF16": 1234567})
    first = load_model("acme/tiny")
    seen = len(stand_in.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = load_model("acme/tiny")
    assert len(stand_in.requests) == seen
    assert again.source in ("vlaunch-cache", "hf-cache") and again.commit == first.commit
    assert again.params_by_dtype == first.params_by_dtype and again.config == first.config


def test_cached_plan_does_not_import_huggingface_hub(stand_in: StandInHub,
                                                     tmp_path: Path) -> None:
    stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()},
                 params={"BF16": 1234567})
    load_model("acme/tiny")
    code = ("import sys\nfrom launcher.cli import main\n"
            "sys.argv = ['vlaunch', 'plan', 'acme/tiny', '--gpus', '1xH100', '--format', "
            f"'json', '-o', {str(tmp_path / 'p.json')!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('huggingface_hub' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert json.loads((tmp_path / "p.json").read_text())["model"]["commit"]


def test_revision_pins_a_branch_and_reaches_vllm_unchanged(stand_in: StandInHub) -> None:
    main = stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()})
    dev = "d" * 40
    stand_in.repos["acme/tiny"].branches["dev"] = dev
    code, d, err = plan_json(["acme/tiny", "--revision", "dev"])
    assert code == 0, err
    assert d["model"]["commit"] == dev != main and d["model"]["revision"] == "dev"
    i = d["vllm_args"].index("--revision")
    assert d["vllm_args"][i + 1] == "dev"
    assert "/api/models/acme/tiny/revision/dev" in " ".join(stand_in.requests)


def test_exec_replans_the_recorded_commit_offline(stand_in: StandInHub, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.deployment.codec import load
    from launcher.predict.search.plan_inputs import inputs_from_plan

    stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()},
                 branches={"main": "a" * 40, "dev": "b" * 40})
    code, d, err = plan_json(["acme/tiny", "--revision", "dev"])
    assert code == 0, err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(stand_in.requests)
    spec, _, _ = inputs_from_plan(load(d))
    assert len(stand_in.requests) == seen
    assert spec.commit == "b" * 40 and spec.revision == "dev"


# ----------------------------------------------------------------------------- errors


def test_gated_repo(stand_in: StandInHub) -> None:
    stand_in.add("meta/locked", {"config.json": json.dumps(CONFIG).encode()}, gated=True)
    line = one_line_error(["meta/locked"])
    assert "gated" in line and "licence" in line and "HF_TOKEN" in line
    assert f"{stand_in.url}/meta/locked" in line


def test_gated_repo_with_token_is_read(stand_in: StandInHub,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in.add("meta/locked", {"config.json": json.dumps(CONFIG).encode()}, gated=True,
                 params={"BF16": 10})
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert load_model("meta/locked").commit
    assert "Bearer hf_test" in stand_in.tokens


def test_missing_repo(stand_in: StandInHub) -> None:
    line = one_line_error(["nobody/nothing"])
    assert "no model repo nobody/nothing" in line and stand_in.url in line


def test_missing_revision(stand_in: StandInHub) -> None:
    stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()})
    line = one_line_error(["acme/tiny", "--revision", "v9"])
    assert "no revision 'v9'" in line


def test_repo_without_config_json(stand_in: StandInHub) -> None:
    stand_in.add("acme/weights-only", {"model.safetensors": safetensors_file({})})
    line = one_line_error(["acme/weights-only"])
    assert "has no config.json" in line


def test_offline_and_not_cached(stand_in: StandInHub, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_line_error(["acme/tiny"])
    assert "HF_HUB_OFFLINE" in line and "not in the HF cache" in line
    assert stand_in.requests == []


def test_unreachable_endpoint_is_named(stand_in: StandInHub,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    line = one_line_error(["acme/tiny"])
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in line


def test_profile_ids_stay_offline_aliases(stand_in: StandInHub) -> None:
    spec = load_model("Qwen/Qwen3-8B")
    assert spec.source == "profile" and spec.hf_id == "Qwen/Qwen3-8B"
    assert stand_in.requests == []


def test_bare_unknown_name_is_not_looked_up(stand_in: StandInHub) -> None:
    line = one_line_error(["no-such-model"])
    assert "not a profile" in line and "ORG/NAME" in line
    assert stand_in.requests == []


# ----------------------------------------------------------------------------- the HF cache


def hf_cache_repo(root: Path, repo_id: str, files: dict[str, bytes], commit: str = "c" * 40,
                  ref: str = "main") -> Path:
    """The layout huggingface_hub writes: blobs, snapshot symlinks, a ref naming the commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hf_cache_works_offline_with_exact_counts(stand_in: StandInHub, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  seed: int) -> None:
    tensors = random_tensors(random.Random(seed), 6)
    hf_cache_repo(tmp_path / "hf", "acme/cached", {
        "config.json": json.dumps(CONFIG).encode(),
        "model.safetensors": safetensors_file(tensors)})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = load_model("acme/cached")
    assert spec.source == "hf-cache" and spec.commit == "c" * 40
    assert dict(spec.params_by_dtype) == counts(tensors)
    assert spec.checkpoint_bytes == sum(n * DTYPE_BYTES[t] for t, n in counts(tensors).items())
    assert stand_in.requests == []


def test_hf_home_locates_the_cache(stand_in: StandInHub, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    hf_cache_repo(tmp_path / "home" / "hub", "acme/cached",
                  {"config.json": json.dumps(CONFIG).encode()})
    assert hub.hf_hub_cache() == tmp_path / "home" / "hub"
    assert load_model("acme/cached").source == "hf-cache"


def test_corrupt_config_in_hf_cache_is_one_line(stand_in: StandInHub, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    hf_cache_repo(tmp_path / "hf", "acme/broken", {"config.json": b"{\"model_type\": "})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_line_error(["acme/broken"])
    assert "config.json" in line and "delete it" in line


def test_corrupt_safetensors_header_in_hf_cache(stand_in: StandInHub, tmp_path: Path) -> None:
    hf_cache_repo(tmp_path / "hf", "acme/broken", {
        "config.json": json.dumps(CONFIG).encode(),
        "model.safetensors": struct.pack("<Q", 10 ** 9) + b"{}"})
    with pytest.raises(InputError, match="corrupt safetensors header"):
        load_model("acme/broken")


def test_corrupt_vlaunch_cache_entry_is_ignored_and_refetched(
        stand_in: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    commit = stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()},
                          params={"BF16": 99})
    load_model("acme/tiny")
    entry = tmp_path / "vlaunch" / "hub" / "acme--tiny" / f"{commit}.json"
    assert entry.is_file()
    # the HF cache copy of config.json goes too, so only vlaunch's cache could answer
    for f in (tmp_path / "hf").rglob("config.json"):
        f.unlink()
    entry.write_text("{not json")
    again = load_model("acme/tiny")
    assert again.source == "hub" and dict(again.params_by_dtype) == {"BF16": 99}
    assert "ignored, never trusted" in capfd.readouterr().err
    entry.write_text(json.dumps({"repo_id": "acme/tiny", "config": "nope"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="HF_HUB_OFFLINE"):
        load_model("acme/tiny")


def test_unknown_model_type_is_planned_generic_with_true_weights(stand_in: StandInHub) -> None:
    params = {"BF16": 3_000_000}
    stand_in.add("acme/novel", {"config.json": json.dumps(
        dict(CONFIG, model_type="novel_lm")).encode()}, params=params)
    code, d, err = plan_json(["acme/novel"])
    assert code == 0, err
    assert d["model"]["estimate"] == "generic"
    assert d["model"]["weights_bytes"] == 2 * 3_000_000
    assert any("generic decoder estimate" in w["text"] for w in d["warnings"])


def test_unknown_model_type_without_layers_is_refused(stand_in: StandInHub) -> None:
    cfg = {k: v for k, v in dict(CONFIG, model_type="novel_lm").items()
           if k != "num_hidden_layers"}
    stand_in.add("acme/novel", {"config.json": json.dumps(cfg).encode()})
    line = one_line_error(["acme/novel"])
    assert "novel_lm" in line and "num_hidden_layers" in line


def test_revision_on_a_local_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(InputError, match="--revision applies to Hugging Face ids"):
        load_model(str(tmp_path), "main")


def test_manifests_plan_and_serve_from_one_hf_cache_on_the_model_volume() -> None:
    """The init container resolves ORG/NAME in the same HF cache vLLM downloads into: HF_HOME
    is the same path, on the same persistent volume, in both containers."""
    import yaml

    doc = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    spec = doc["spec"]["template"]["spec"]
    claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    homes = set()
    for c in spec["initContainers"] + spec["containers"]:
        if c["name"] not in ("plan", "vllm"):
            continue
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        home = env["HF_HOME"]
        mounts = [m for m in c["volumeMounts"] if home.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts and mounts[0]["name"] in claims, c["name"]
        homes.add((home, mounts[0]["name"]))
    assert len(homes) == 1


@pytest.mark.parametrize("revision", [None, "main"])
def test_serve_passes_the_id_and_revision_to_vllm_unchanged(
        stand_in: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        revision: str | None) -> None:
    hf_cache_repo(tmp_path / "hf", "acme/cached", {"config.json": json.dumps(CONFIG).encode()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["serve", "acme/cached", "--gpus", "1xH100", "--dry-run", "--no-metrics",
            "--log-dir", str(tmp_path)] + (["--revision", revision] if revision else [])
    r = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert r.exit_code == 0, r.output
    command = json.loads(r.stdout)["command"]  # the dry run's argv, as data
    assert "acme/cached" in command and not any("snapshots" in a for a in command)
    if revision:
        assert command[command.index("--revision") + 1] == revision
    else:
        assert "--revision" not in command
    assert "--served-model-name" not in command


def test_text_plan_names_the_commit_and_where_it_came_from(stand_in: StandInHub) -> None:
    commit = stand_in.add("acme/tiny", {"config.json": json.dumps(CONFIG).encode()},
                          params={"BF16": 5})
    r = CliRunner().invoke(cli, ["plan", "acme/tiny", "--gpus", "1xH100"])
    assert r.exit_code == 0, r.output
    assert f"model acme/tiny at commit {commit[:12]}, from the Hub" in r.output
    r = CliRunner().invoke(cli, ["plan", "acme/tiny", "--gpus", "1xH100"])
    assert f"at commit {commit[:12]}, from " in r.output and "from the Hub" not in r.output


def test_local_folder_counts_come_from_its_safetensors_headers(tmp_path: Path) -> None:
    rng = random.Random(11)
    a, b = random_tensors(rng, 3, "a"), random_tensors(rng, 4, "b")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    index = {"metadata": {"total_size": 10}, "weight_map": {
        **{k: "s1.safetensors" for k in a}, **{k: "s2.safetensors" for k in b}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "s1.safetensors").write_bytes(safetensors_file(a))
    assert load_model(str(tmp_path)).params_by_dtype == ()  # a shard is missing
    (tmp_path / "s2.safetensors").write_bytes(safetensors_file(b))
    spec = load_model(str(tmp_path))
    assert dict(spec.params_by_dtype) == counts({**a, **b}) and spec.source == "local"
