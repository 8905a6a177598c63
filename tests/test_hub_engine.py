"""`vlaunch serve ORG/NAME` on the real CPU engine, from the HF cache, offline.

The tiny model is placed in the layout huggingface_hub writes (blobs, a snapshot of symlinks,
refs/main naming the commit) and served by its id with HF_HUB_OFFLINE=1: vlaunch plans from
the snapshot and vLLM must load the same id from the same cache, so the id reaches vLLM
unchanged and nothing needs the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from test_serve_engine import PAGE, _complete, _group_alive, _stop, _vlaunch, _wait_for

pytestmark = pytest.mark.engine

REPO = "vlaunch-test/tiny-deepseek-v3"
COMMIT = "5eed" * 10


def _to_hf_cache(model: Path, root: Path) -> Path:
    repo = root / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(model.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_serve_hub_id_from_the_hf_cache_offline(tiny_model: Path, tmp_path: Path) -> None:
    _to_hf_cache(tiny_model, tmp_path / "hf")
    env = {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9", "VLAUNCH_CACHE_DIR": str(tmp_path / "vlaunch")}
    proc = _vlaunch("serve", REPO, "--gpus", "cpu", "--kv-cache-memory-bytes", str(64 * PAGE),
                    "--metrics-port", "0", "--log-dir", str(tmp_path), env=env)
    try:
        base, text = _wait_for(proc, r"serving on (http://\S+)", timeout=900)
        assert base, text[-3000:]
        # vLLM names a model by what --model said: the id, not a snapshot path
        out = _complete(base, REPO)
        assert out["model"] == REPO and out["usage"]["completion_tokens"] > 0
    finally:
        _stop(proc)
    assert not _group_alive(proc.pid)
