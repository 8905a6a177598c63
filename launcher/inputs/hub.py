"""Hugging Face model ids: a config and the checkpoint's weight metadata, found the way
`vllm serve ORG/NAME` finds a model, without downloading a single weight.

Where an id is looked up, in order:

1. the local HF cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``): ``models--ORG--NAME/refs/REV``
   names a commit, ``snapshots/COMMIT/`` holds config.json and, when the model is downloaded,
   the safetensors headers that give exact parameter counts per dtype. It works offline: on a
   Kubernetes node the model usually already sits there, on the model volume;
2. vlaunch's own cache: one small JSON per repo and commit (``$VLAUNCH_CACHE_DIR/hub/``) of
   what an earlier lookup fetched, and ``refs.json`` mapping the branches it resolved;
3. the Hub, through ``huggingface_hub`` (``HF_ENDPOINT``, ``HF_TOKEN``, proxies): the model-info
   API (commit, files, parameters per dtype), config.json, and the safetensors headers when the
   Hub did not count the parameters itself. ``huggingface_hub`` is imported only here: a cached
   plan stays import-light.

``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) stops at step 2. Every failure a user can
fix is one line (`InputError`): a gated repo, a missing repo or revision, offline and not
cached, an unreachable endpoint, a repo without config.json, a corrupt cached file.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..paths import (
    cache_dir,
    inside,
    loads_json,
    read_json_object,
    read_small_text,
    report_corrupt,
    update_json_object,
)

__all__ = ["HubModel", "cached", "fetch", "hf_hub_cache", "is_repo_id", "offline"]

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A branch, tag or ref as git and the Hub spell them ("main", "v1.0", "refs/pr/1"): no `..`,
# no empty or dot-led part, nothing but these characters, at most 200 of them.
_REVISION = re.compile(r"^(?!.*\.\.)(?!.*//)[A-Za-z0-9_][A-Za-z0-9._/+-]{0,199}(?<![/.])$")
# Bytes per element of each safetensors dtype (the format's own names).
SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                     "BF16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                     "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20  # the safetensors format's own bound on a header
_MAX_JSON = 16 << 20
_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HubModel:
    """What planning needs of a Hub repo at one commit."""

    repo_id: str
    revision: str | None  # as the user gave it (None: the default branch)
    commit: str | None  # the commit the config came from
    config: dict[str, Any]
    params_by_dtype: dict[str, int] | None  # exact, from the safetensors headers
    checkpoint_bytes: int | None  # tensor bytes of the checkpoint (index total or the counts)
    source: str  # hf-cache | vlaunch-cache | hub


def is_repo_id(ref: str) -> bool:
    """ORG/NAME as the Hub spells repo ids (a bare NAME is a profile or a typo, not a lookup)."""
    return bool(_REPO_ID.match(ref)) and ".." not in ref


def offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as huggingface_hub reads them."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def shown_endpoint() -> str:
    """HF_ENDPOINT as printed: a mirror's URL may carry `user:password@` or a `?token=`;
    neither belongs in an error line or a CI log (issue 31)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(endpoint())
        host = u.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.port else "")
    except ValueError:
        return "HF_ENDPOINT (not a URL)"
    return urlunsplit((u.scheme, netloc, u.path, "", ""))


def is_commit(value: object) -> bool:
    """A Hub commit id: exactly 40 lowercase hex digits, the only form used as a path."""
    return isinstance(value, str) and bool(_COMMIT.match(value))


def hf_hub_cache() -> Path:
    """The HF cache folder huggingface_hub (and so vLLM) uses: HF_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _check(repo_id: str, revision: str | None) -> None:
    if not is_repo_id(repo_id):
        raise InputError(f"'{repo_id}' is not a Hugging Face model id; give ORG/NAME, a local "
                         "model folder or a profile name (see `vlaunch profiles`)")
    if revision is not None and not _REVISION.match(revision):
        raise InputError(f"--revision {revision[:80]!r} is not a branch, tag or commit (letters, "
                         "digits and . _ - + /, no '..')")


# ----------------------------------------------------------------------------- offline


def cached(repo_id: str, revision: str | None = None) -> HubModel | None:
    """The model from the HF cache or vlaunch's cache, or None; never touches the network."""
    _check(repo_id, revision)
    hit = _from_hf_cache(repo_id, revision)
    if hit is not None:
        return hit
    return _from_vlaunch_cache(repo_id, revision)


def _from_hf_cache(repo_id: str, revision: str | None) -> HubModel | None:
    repo = inside(hf_hub_cache(), "models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit: str | None = rev if _COMMIT.match(rev) else None
    if commit is None:
        ref = inside(repo / "refs", rev)
        try:
            commit = read_small_text(ref, 4096).strip()
        except (OSError, UnicodeDecodeError):
            return None
        if not _COMMIT.match(commit):
            report_corrupt(ref, f"not a commit hash: {commit[:50]!r}")
            return None
    snap = inside(repo / "snapshots", commit)
    cfg_path = snap / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = _read_json_file(cfg_path, "the HF cache")
    _add_quantize_config(cfg, snap / "quantize_config.json")
    params, total = _local_weights(snap)
    if params is None and total is None:  # config cached, weights not: an earlier lookup?
        kept = _vlaunch_entry(repo_id, commit)
        if kept is not None:
            params, total = kept.params_by_dtype, kept.checkpoint_bytes
    return HubModel(repo_id, revision, commit, cfg, params, total, "hf-cache")


def _read_json_file(path: Path, where: str) -> dict[str, Any]:
    """A small JSON object from a cache the user owns: corrupt is one line naming the file."""
    try:
        data = loads_json(read_small_text(path, _MAX_JSON))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path} in {where}: {e}; delete it so it is downloaded "
                         "again") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} in {where} is a JSON {type(data).__name__}, not an object; "
                         "delete it so it is downloaded again")
    return data


def _add_quantize_config(cfg: dict[str, Any], path: Path) -> None:
    """Older GPTQ repos keep their quantization in quantize_config.json (vLLM reads it too)."""
    if cfg.get("quantization_config") or not path.is_file():
        return
    qc = _read_json_file(path, "the checkpoint")
    cfg["quantization_config"] = {"quant_method": "gptq", **qc}


def safetensors_header_counts(path: Path) -> dict[str, int]:
    """Elements per dtype in one safetensors file, from its header alone (8 + N bytes)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little")
            if len(head) < 8 or size > _MAX_HEADER or 8 + size > path.stat().st_size:
                raise ValueError(f"header of {size:,} bytes claimed")
            header = loads_json(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} has a corrupt safetensors header ({e}); delete it so it is "
                         "downloaded again") from None
    counts: dict[str, int] = {}
    for name, t in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        shape = t.get("shape") or []
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_COUNT
                for d in shape):
            raise InputError(f"{path} has a corrupt safetensors header (tensor {str(name)[:60]!r} "
                             f"has shape {str(shape)[:60]}, not whole numbers of 0 or more); "
                             "delete it so it is downloaded again")
        n = 1
        for d in shape:
            n *= d
        counts[str(t.get("dtype"))] = counts.get(str(t.get("dtype")), 0) + n
    return check_counts(counts, str(path))


MAX_COUNT = 1 << 50
"""Far above any checkpoint (DeepSeek-V3: 6.7e11 parameters = 2^39.3), low enough that bytes
stay exact in a float: a larger count is corrupt or hostile, not a model."""


def check_counts(params: Any, where: str) -> dict[str, int]:
    """Parameters per dtype as whole numbers from 0 to MAX_COUNT, or one line saying which is
    not: a negative count from a hostile Hub or header made −2 TB of weights "fit" one GPU and
    so opened the init container's does-not-fit gate (issue 31, M2)."""
    if not isinstance(params, dict):
        raise InputError(f"parameter counts from {where} are not a table of dtype: count")
    out: dict[str, int] = {}
    for k, v in params.items():
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_COUNT:
            raise InputError(f"parameter count {str(v)[:40]} for {str(k)[:20]!r} from {where} "
                             f"is not a whole number from 0 to {MAX_COUNT:.1e}; check the "
                             "checkpoint (or HF_ENDPOINT)")
        out[str(k)] = out.get(str(k), 0) + v
    if sum(out.values()) > MAX_COUNT:
        raise InputError(f"{sum(out.values()):.3g} parameters from {where} is more than any "
                         "checkpoint holds; check the checkpoint (or HF_ENDPOINT)")
    return out


def _local_weights(snap: Path) -> tuple[dict[str, int] | None, int | None]:
    """Exact counts from the snapshot's safetensors headers when every shard is there; the
    index's total_size when only the index is."""
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json_file(index, "the HF cache")
        shards = index_shards(data, index)
        meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
        total = meta.get("total_size")
        total = total if isinstance(total, int) and not isinstance(total, bool) else None
        if shards and all((snap / s).is_file() for s in shards):
            params = _sum_counts(safetensors_header_counts(snap / s) for s in shards)
            return params, total or counts_bytes(params)
        return None, total
    single = snap / "model.safetensors"
    if single.is_file():
        params = safetensors_header_counts(single)
        return params, counts_bytes(params)
    return None, None


def index_shards(index: dict[str, Any], where: Path | str) -> list[str]:
    """The shard files an index names: plain names inside the checkpoint folder, at most
    MAX_SHARDS of them (a hostile index of 3,000 made 3,007 requests; one of `../x` pointed
    outside the folder)."""
    from .hub_limits import MAX_SHARDS

    wmap = index.get("weight_map")
    shards = sorted({str(f) for f in wmap.values()}) if isinstance(wmap, dict) else []
    if len(shards) > MAX_SHARDS:
        raise InputError(f"{where} names {len(shards):,} safetensors shards, more than the "
                         f"{MAX_SHARDS:,} vlaunch reads (the largest public checkpoints have "
                         "under 200); check the checkpoint")
    for s in shards:
        inside(Path("."), s)  # raises for an absolute or climbing name
    return shards


def _sum_counts(parts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def counts_bytes(params: dict[str, int] | None) -> int | None:
    """Tensor bytes of a checkpoint from its elements per safetensors dtype."""
    if not params:
        return None
    return sum(n * SAFETENSORS_BYTES.get(d.upper(), 2) for d, n in params.items())


# ----------------------------------------------------------------------------- vlaunch cache


def _folder(repo_id: str) -> Path:
    return inside(cache_dir() / "hub", repo_id.replace("/", "--"))


def _entry_path(repo_id: str, commit: str) -> Path:
    """vlaunch's cache file for one commit: named only by a 40-hex commit, inside the folder."""
    if not is_commit(commit):
        raise InputError(f"refusing {commit[:80]!r} as a commit id of {repo_id}: a commit is "
                         "40 hex digits")
    return inside(_folder(repo_id), f"{commit}.json")


def _from_vlaunch_cache(repo_id: str, revision: str | None) -> HubModel | None:
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    if commit is None:
        refs = read_json_object(_folder(repo_id) / "refs.json")
        value = refs.get(rev)
        if not isinstance(value, str) or not _COMMIT.match(value):
            return None
        commit = value
    hit = _vlaunch_entry(repo_id, commit)
    if hit is None:
        return None
    return HubModel(repo_id, revision, commit, hit.config, hit.params_by_dtype,
                    hit.checkpoint_bytes, "vlaunch-cache")


def _vlaunch_entry(repo_id: str, commit: str) -> HubModel | None:
    """The JSON an earlier lookup kept; a corrupt one is reported once and ignored."""
    path = _entry_path(repo_id, commit)
    data = read_json_object(path)
    if not data:
        return None
    cfg, params, total = data.get("config"), data.get("params_by_dtype"), data.get("bytes")
    ok = (isinstance(cfg, dict) and data.get("repo_id") == repo_id
          and (params is None or (isinstance(params, dict) and all(
              isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in params.items())))
          and (total is None or (isinstance(total, int) and total > 0)))
    if not ok:
        report_corrupt(path, "not a vlaunch Hub entry (config, params_by_dtype, bytes)")
        return None
    return HubModel(repo_id, None, commit, cfg, params, total, "vlaunch-cache")


def _keep(model: HubModel) -> None:
    """Record a fetched model for the next, offline, plan."""
    from ..paths import atomic_write

    folder = _folder(model.repo_id)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(_entry_path(model.repo_id, model.commit or ""), json.dumps(
            {"repo_id": model.repo_id, "commit": model.commit, "config": model.config,
             "params_by_dtype": model.params_by_dtype, "bytes": model.checkpoint_bytes,
             "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            indent=1, sort_keys=True) + "\n")
        rev = model.revision or "main"
        if rev != model.commit:
            update_json_object(folder / "refs.json",
                               lambda refs: refs.__setitem__(rev, model.commit))
    except OSError as e:  # a read-only cache costs the next plan a lookup, not this one
        report_corrupt(folder, f"cannot write: {e.strerror or e}")


# ----------------------------------------------------------------------------- the Hub


def fetch(repo_id: str, revision: str | None = None) -> HubModel:
    """The model from the Hub (or one line saying why not), kept in vlaunch's cache."""
    _check(repo_id, revision)
    if offline():
        raise InputError(f"{repo_id}{_at(revision)} is not in the HF cache ({hf_hub_cache()}) "
                         "nor in vlaunch's cache, and HF_HUB_OFFLINE is set; download it first "
                         f"(hf download {repo_id}) or unset HF_HUB_OFFLINE")
    from .hub_limits import within_deadline

    try:
        model = within_deadline(lambda: _fetch(repo_id, revision), shown_endpoint())
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - every library error becomes one line
        raise _explain(e, repo_id, revision) from None
    _keep(model)
    return model


def _at(revision: str | None) -> str:
    return f" at revision '{revision}'" if revision else ""


def _fetch(repo_id: str, revision: str | None) -> HubModel:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # a plan prints the plan; shard-header bars would interleave
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint(), token=token)
    info = api.model_info(repo_id, revision=revision, timeout=_TIMEOUT_S)
    commit = info.sha
    if not is_commit(commit):  # it names a path in both caches and is sent back as revision=
        raise InputError(f"the Hub at {shown_endpoint()} answered {str(commit)[:60]!r} as the "
                         f"commit of {repo_id}{_at(revision)}, not 40 hex digits; check "
                         "HF_ENDPOINT")
    files = {s.rfilename for s in info.siblings or []}
    if "config.json" not in files:
        raise InputError(f"{repo_id}{_at(revision)} has no config.json (vLLM needs a "
                         "transformers-style repo); give a repo or local folder that has one")

    def download(name: str) -> dict[str, Any]:
        path = hf_hub_download(repo_id, name, revision=commit,
                               cache_dir=hf_hub_cache(), endpoint=endpoint(), token=token,
                               etag_timeout=_TIMEOUT_S)
        return _read_json_file(Path(path), "the HF cache")

    cfg = download("config.json")
    if "quantize_config.json" in files and not cfg.get("quantization_config"):
        cfg["quantization_config"] = {"quant_method": "gptq", **download("quantize_config.json")}
    params: dict[str, int] | None = None
    st = getattr(info, "safetensors", None)
    if st is not None and getattr(st, "parameters", None):
        params = check_counts(dict(st.parameters), f"the Hub at {shown_endpoint()}")
    elif files & {"model.safetensors", "model.safetensors.index.json"}:
        if "model.safetensors.index.json" in files and "model.safetensors" not in files:
            index_shards(download("model.safetensors.index.json"), f"{repo_id}'s index")
        meta = api.get_safetensors_metadata(repo_id, revision=commit)
        params = check_counts(dict(meta.parameter_count), f"{repo_id}'s safetensors headers")
    return HubModel(repo_id, revision, commit, cfg, params, counts_bytes(params), "hub")


def _explain(e: Exception, repo_id: str, revision: str | None) -> InputError:
    """One line for what huggingface_hub or the HTTP client raised."""
    name = type(e).__name__
    names = {c.__name__ for c in type(e).__mro__}
    where = shown_endpoint()
    if "GatedRepoError" in names:
        return InputError(f"{repo_id} is gated on {where}: accept its licence at "
                          f"{where}/{repo_id} and set HF_TOKEN to a token of that account")
    if "RevisionNotFoundError" in names:
        return InputError(f"{repo_id} has no revision '{revision}' on {where}; give a branch, "
                          "tag or commit that exists")
    if "RepositoryNotFoundError" in names:
        return InputError(f"no model repo {repo_id} on {where} (a private repo also needs "
                          "HF_TOKEN); check the id")
    if "EntryNotFoundError" in names:
        return InputError(f"{repo_id}{_at(revision)} has no config.json (vLLM needs a "
                          "transformers-style repo)")
    if "OfflineModeIsEnabled" in names:
        return InputError(f"{repo_id} is not cached and HF_HUB_OFFLINE is set; download it "
                          "first or unset HF_HUB_OFFLINE")
    transport = names & {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
                         "NetworkError", "ProxyError", "TransportError", "ConnectionError",
                         "RemoteProtocolError"}
    if transport or "LocalEntryNotFoundError" in names:
        return InputError(f"cannot reach the Hub at {where} to look up {repo_id} ({name}); "
                          "check the network and proxy (HTTPS_PROXY), set HF_ENDPOINT to a "
                          "mirror, or download the model into the HF cache and set "
                          "HF_HUB_OFFLINE=1")
    status = getattr(getattr(e, "response", None), "status_code", None)
    detail = str(e).strip().splitlines()[0] if str(e).strip() else name
    detail = re.sub(r"(://)[^/@\s]*@", r"\1", detail.replace(endpoint(), where))
    return InputError(f"the Hub at {where} refused {repo_id}{_at(revision)}"
                      f"{f' (HTTP {status})' if status else ''}: {detail[:160]}")
