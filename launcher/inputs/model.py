"""Models: where a config comes from, and the weights it implies.

A model is read from a built-in profile (`profiles/models/*.yaml`, config.json keys plus a little
metadata), a local Hugging Face directory, a path to a config.json, or a Hugging Face id found in
the local HF cache or on the Hub (launcher/inputs/hub.py). Its weights are described
as a list of `Tensor` groups, each knowing how vLLM shards it (column/row-parallel, vocab-parallel,
replicated, per-expert) and whether the checkpoint's quantization covers it. Counting parameters,
weight bytes and per-rank bytes are then simple sums in `launcher.predict.memory.budget`; nothing
here knows about GPUs.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..paths import profiles_dir, read_small_text, read_yaml
from .arch import ARCHITECTURES, Tensor, decoder
from .config_check import check_config

__all__ = ["ModelSpec", "Quant", "Tensor", "load_model", "list_profiles"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1, "fp8": 1}


@dataclass(frozen=True)
class Quant:
    """How the checkpoint stores its quantized linear weights.

    method: none | fp8_block (DeepSeek 128x128 blocks + fp32 scales) | fp8_channel
    (compressed-tensors / per-channel fp8) | int4_group (AWQ / GPTQ) | mxfp4 (gpt-oss experts).
    """

    method: str = "none"
    bits: int = 16
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    skip: tuple[str, ...] = ()  # module name fragments the format leaves unquantized
    only_experts: bool = False  # mxfp4: only the MoE experts are packed

    @property
    def label(self) -> str:
        return {"none": "unquantized", "fp8_block": "fp8 (128x128 blocks)",
                "fp8_channel": "fp8 (per-channel)", "int4_group": f"int4 (group {self.group_size})",
                "mxfp4": "mxfp4 experts"}.get(self.method, self.method)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the budget model needs it: shapes, dtype, quantization and tensors."""

    name: str
    hf_id: str
    architecture: str  # model_type, e.g. deepseek_v3
    config: dict[str, Any] = field(repr=False)
    dtype: str
    quant: Quant
    tensors: tuple[Tensor, ...] = field(repr=False)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    attention: str  # mla | mla_sparse | gqa
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    intermediate_size: int = 0
    checkpoint_bytes: int | None = None  # from model.safetensors.index.json, when given
    path: str | None = None  # local directory vLLM should load
    description: str = ""
    distill_of: str | None = None
    advertised_context: int | None = None
    mtp_layers: int = 0
    revision: str | None = None  # Hub revision as the user gave it (passed to vLLM unchanged)
    commit: str | None = None  # the Hub commit the config and weights came from
    source: str = "local"  # profile | local | hf-cache | vlaunch-cache | hub
    estimate: str = "architecture"  # architecture | generic (model_type not in the tables)
    params_by_dtype: tuple[tuple[str, int], ...] = ()  # exact, from safetensors headers

    def provenance(self) -> dict[str, Any]:
        """Where the model came from, for the plan: a plan made from the Hub names the commit
        it used, and a generic estimate says so."""
        out: dict[str, Any] = {"source": self.source, "estimate": self.estimate}
        if self.commit:
            out["revision"] = self.revision
            out["commit"] = self.commit
        if self.params_by_dtype:
            out["params_by_dtype"] = dict(self.params_by_dtype)
            out["checkpoint_params"] = sum(n for _, n in self.params_by_dtype)
        return out

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2)


def _dtype_of(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return raw if raw in DTYPE_BYTES else "bfloat16"


def _quant_of(cfg: dict[str, Any]) -> Quant:
    qc = cfg.get("quantization_config") or {}
    if not qc:
        return Quant()
    method = str(qc.get("quant_method", "")).lower()
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ())
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return Quant("fp8_block", 8, 0, (int(block[0]), int(block[1])), skip)
        return Quant("fp8_channel", 8, 0, (0, 0), skip)
    if method in ("compressed-tensors", "compressed_tensors"):
        groups = qc.get("config_groups") or {}
        weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
        bits = int(weights.get("num_bits", 8))
        if bits == 8 and weights.get("type", "float") == "float":
            block = weights.get("block_structure")
            if block:
                return Quant("fp8_block", 8, 0, (int(block[0]), int(block[1])), skip)
            return Quant("fp8_channel", 8, 0, (0, 0), skip)
        return Quant("int4_group", bits, int(weights.get("group_size") or 128), (0, 0), skip)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        return Quant("int4_group", int(qc.get("bits", qc.get("w_bit", 4))),
                     int(qc.get("group_size", qc.get("q_group_size", 128))), (0, 0), skip)
    if method == "mxfp4":
        return Quant("mxfp4", 4, 32, (0, 0), skip, only_experts=True)
    raise InputError(f"unsupported quantization '{method}' in config.json; supported: fp8 "
                     "(block or per-channel), compressed-tensors fp8/int4, awq, gptq, mxfp4")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model under text_config."""
    return cfg.get("text_config") or cfg


def max_context(cfg: dict[str, Any]) -> int:
    """The context vLLM derives: max_position_embeddings (yarn tables include the factor)."""
    text = _text_config(cfg)
    value = text.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    if not value:
        rope = text.get("rope_scaling") or {}
        orig = rope.get("original_max_position_embeddings")
        value = int(orig * rope.get("factor", 1)) if orig else 4096
    return int(value)


# What a decoder config must state for the generic estimate of an unknown model_type.
GENERIC_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                  "intermediate_size")


def _generic(cfg: dict[str, Any], model_type: str, name: str) -> None:
    """An unknown model_type is estimated as a pre-norm GQA decoder from the standard fields;
    without one of them there is nothing to estimate from, and the refusal names it."""
    text = {**cfg, **(_text_config(cfg) if isinstance(cfg.get("text_config"), dict) else {})}
    missing = next((k for k in GENERIC_FIELDS if text.get(k) is None), None)
    if missing:
        known = ", ".join(sorted(ARCHITECTURES))
        raise InputError(f"cannot size {name}: model_type '{model_type or '?'}' is not one "
                         f"vlaunch knows and config.json has no {missing} for a generic decoder "
                         f"estimate; known model_type values: {known}")


def spec_from_config(cfg: dict[str, Any], name: str, **meta: Any) -> ModelSpec:
    """Build a ModelSpec from config.json contents (profiles hold the same keys)."""
    model_type = str(cfg.get("model_type") or "")
    arch = ARCHITECTURES.get(model_type)
    check_config(cfg, name)
    if arch is None:
        _generic(cfg, model_type, name)
        arch = decoder
        meta["estimate"] = "generic"
    try:
        shapes = arch(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"config.json of {name} is incomplete for {model_type}: "
                         f"missing or bad {e}") from None
    _check_sizes(name, shapes, meta)
    return ModelSpec(name=name, hf_id=meta.pop("hf_id", name), architecture=model_type,
                     config=cfg, dtype=_dtype_of(_text_config(cfg) | cfg), quant=_quant_of(cfg),
                     max_context=max_context(cfg), **shapes, **meta)


def _check_sizes(name: str, shapes: dict[str, Any], meta: dict[str, Any]) -> None:
    """The last gate before a model is planned: every tensor's shape and every count the
    checkpoint gave is finite and not negative. config_check holds the config's keys; this
    holds what was derived from them and what the Hub or the headers reported, wherever it
    came from, so no path lets a negative size make a model "fit" (issue 31, M2)."""
    from .hub import check_counts

    for t in shapes.get("tensors", ()):
        if min(t.rows, t.cols, t.count) < 0:
            raise InputError(f"config.json of {name} gives tensor {t.name} the shape "
                             f"{t.count} x {t.rows} x {t.cols}; sizes cannot be negative")
    params = meta.get("params_by_dtype")
    if params:
        check_counts(dict(params), name)
    total = meta.get("checkpoint_bytes")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool)
                              or not 0 <= total <= 8 * (1 << 50)):
        raise InputError(f"checkpoint size {str(total)[:40]} bytes of {name} is not a whole "
                         "number of 0 or more; check the checkpoint")


@functools.lru_cache(maxsize=1)
def _profiles() -> dict[str, Path]:
    """Profile name and HF repo id (lower-cased) -> YAML path."""
    index: dict[str, Path] = {}
    for path in sorted((profiles_dir() / "models").glob("*.yaml")):
        head = read_yaml(path)
        index[path.stem.lower()] = path
        if head.get("hf_id"):
            index[str(head["hf_id"]).lower()] = path
        for alias in head.get("aliases") or ():  # other repo ids of the same checkpoint
            index[str(alias).lower()] = path
    return index


def list_profiles() -> list[ModelSpec]:
    """Every built-in profile, by name with numbers compared as numbers: deepseek-r1 before
    deepseek-r1-0528 (file order puts '-' before '.yaml'), llama-3.1-8b before 70b before
    405b."""
    import re

    def natural(p: Path) -> list[tuple[str, int]]:
        return [(part, 0) if i % 2 == 0 else ("", int(part))
                for i, part in enumerate(re.split(r"(\d+)", p.stem.lower()))]

    return [_load_profile(p) for p in sorted(set(_profiles().values()), key=natural)]


def _load_profile(path: Path) -> ModelSpec:
    data = read_yaml(path)
    cfg = copy.deepcopy(data["config"])  # the parsed file is shared by the YAML cache
    return spec_from_config(cfg, name=path.stem, hf_id=data.get("hf_id", path.stem),
                            description=data.get("description", ""),
                            distill_of=data.get("distill_of"),
                            advertised_context=data.get("advertised_context"),
                            checkpoint_bytes=data.get("checkpoint_bytes"), source="profile")


def _load_dir(path: Path) -> ModelSpec:
    cfg_path = path / "config.json" if path.is_dir() else path
    what = "give a model directory, a config.json or a profile name (see `vlaunch profiles`)"
    if cfg_path.exists() and not cfg_path.is_file():
        raise InputError(f"{cfg_path} is not a regular file; {what}")
    try:
        if cfg_path.stat().st_size > _MAX_CONFIG_BYTES:  # a checkpoint or a binary, not JSON
            raise InputError(f"{cfg_path} is too large to be a config.json; {what}")
        cfg = finite_json_loads(read_small_text(cfg_path, _MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise InputError(f"no config.json at {cfg_path}; {what}") from None
    except UnicodeDecodeError:
        raise InputError(f"cannot read {cfg_path}: not UTF-8 text, so not a config.json; "
                         f"{what}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path} is not a JSON object")
    folder = cfg_path.parent
    index = folder / "model.safetensors.index.json"
    total = None
    if index.is_file():
        total = _index_total(index)
    elif (folder / "model.safetensors").is_file():
        total = _safetensors_payload(folder / "model.safetensors")
    return spec_from_config(cfg, name=folder.name, hf_id=str(folder.resolve()),
                            checkpoint_bytes=total, path=str(folder.resolve()),
                            params_by_dtype=_header_counts(folder))


_MAX_CONFIG_BYTES = 16 << 20
_MAX_INT_DIGITS = 30  # far beyond any size in a config; int() itself stops at 4300 digits


def _nonfinite(text: str) -> float:
    raise json.JSONDecodeError(f"{text} is not a finite number", text, 0)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        _nonfinite(text[:40])
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise json.JSONDecodeError(f"an integer of {len(text)} digits (at most {_MAX_INT_DIGITS})",
                                   text[:40], 0)
    return int(text)


def finite_json_loads(text: str) -> object:
    """json.loads for files that hold sizes: NaN, Infinity and numbers that overflow to them
    (Python's json accepts all three) are refused as a JSONDecodeError, so the caller's one-line
    error reports them instead of arithmetic on them failing with a traceback much later."""
    from ..paths import loads_json

    return loads_json(text, parse_constant=_nonfinite, parse_float=_finite_float,
                      parse_int=_bounded_int)


def _header_counts(folder: Path) -> tuple[tuple[str, int], ...]:
    """Exact elements per dtype from the safetensors headers of a local checkpoint, when every
    file is there (a folder holding only config.json has none)."""
    from .hub import index_shards, safetensors_header_counts

    files = [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = finite_json_loads(read_small_text(index))  # _index_total checked it
        files = [folder / f for f in index_shards(data, index)] if isinstance(data, dict) else []
    if not files or not all(f.is_file() for f in files):
        return ()
    total: dict[str, int] = {}
    for f in files:
        for dtype, n in safetensors_header_counts(f).items():
            total[dtype] = total.get(dtype, 0) + n
    return tuple(sorted(total.items()))


def _index_total(index: Path) -> int | None:
    """metadata.total_size of a sharded checkpoint's index; None when the index omits it. An
    index that is not a JSON object, or a total that is not a positive integer, is a broken
    checkpoint (vLLM cannot load it either) and would size the weights wrongly."""
    try:
        data = finite_json_loads(read_small_text(index))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {index}: {e}; re-download the checkpoint") from None
    if not isinstance(data, dict):
        raise InputError(f"{index} is a JSON {type(data).__name__}, not the object a "
                         "safetensors index holds; re-download the checkpoint")
    meta = data.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if total is None:
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise InputError(f"{index}: metadata.total_size is {total!r}, not a positive number "
                         "of bytes; re-download the checkpoint")
    return total


def _safetensors_payload(path: Path) -> int | None:
    """Tensor bytes of a single-file checkpoint: file size minus its 8-byte length and JSON
    header. A header length that does not fit in the file is a corrupt (or truncated) file:
    the difference would be negative weights that "fit" anywhere."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
        size = path.stat().st_size
    except OSError:
        return None
    header = int.from_bytes(head, "little")
    if len(head) < 8 or 8 + header > size:
        raise InputError(f"{path} has a corrupt header ({header:,} header bytes claimed in a "
                         f"{size:,}-byte file); re-download the checkpoint")
    return size - 8 - header


def load_model(ref: str, revision: str | None = None) -> ModelSpec:
    """A model the way `vllm serve REF` finds it: a local folder or config.json; a profile
    name; an ORG/NAME id from the local HF cache or vlaunch's cache of earlier lookups, then
    the profile that carries that id (an offline alias), then the Hub (launcher/inputs/hub.py,
    which imports huggingface_hub only when it must reach the network). --revision pins a Hub
    branch, tag or commit: it skips the profile alias, whose config has no commit."""
    from . import hub

    p = Path(ref).expanduser()
    if p.exists():
        if revision is not None:
            raise InputError(f"--revision applies to Hugging Face ids, not to the local path "
                             f"{ref}")
        return _load_dir(p)
    hit = _profiles().get(ref.lower())
    if hit is not None and "/" not in ref:
        if revision is None:
            return _load_profile(hit)
        ref = str(read_yaml(hit).get("hf_id") or ref)
    if hub.is_repo_id(ref):
        found = hub.cached(ref, revision)
        if found is None and hit is not None and revision is None:
            return _load_profile(hit)
        return _load_hub(found or hub.fetch(ref, revision))
    if hit is not None:
        return _load_profile(hit)
    names = ", ".join(sorted(k for k in _profiles() if "/" not in k))
    raise InputError(f"unknown model '{ref}': not a local path, not a profile and not a "
                     f"Hugging Face id (ORG/NAME); profiles: {names}")


def _load_hub(m: Any) -> ModelSpec:
    """A ModelSpec from a hub.HubModel: the safetensors counts, when known, are the weights'
    truth (checkpoint_bytes rescales the counted tensors, whatever the architecture)."""
    params = tuple(sorted((m.params_by_dtype or {}).items()))
    return spec_from_config(copy.deepcopy(m.config), name=m.repo_id, hf_id=m.repo_id,
                            checkpoint_bytes=m.checkpoint_bytes, revision=m.revision,
                            commit=m.commit, source=m.source, params_by_dtype=params)
