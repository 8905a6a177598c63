"""The one table of the `vllm serve` flags vlaunch writes, reads, offers, suggests or refuses.

Why one table: a flag spelt by hand in many modules drifts (a pin the CLI offers that the argv
never writes, a flag the doctor copies from a log that a plan may not carry, a secret the
redaction misses). Every place that spells a vLLM flag reads it here: the CLI's pin options
(launcher/cli/), the planner's argv (`argv`), the flags after `--` (`parse`), the doctor's
reading of a log's "non-default args" (`from_log_args`), the flags and environment a plan run
by `exec` may carry (`check_plan_args`, `check_plan_env`) and the redaction list
(launcher/redact.py).

Why Python dataclasses and not a YAML profile: each entry carries a value check (a path inside
the model's or the plan's folder, a JSON object of known keys), which is code; the facts that
are data elsewhere are referenced, not copied: `gate` names the row of
profiles/capabilities.yaml `vllm_features` (or profiles/serving.yaml) that records the first
release with the flag, so a release number lives in one place; the other flags carry their own
`since`/`until`. Both were read from every release's sdist from 0.6.0 to 0.32.0
(bench/flag_releases.py; tests/fixtures/vllm_flag_releases.csv, which a test holds the table to).

Names, types and destinations are vLLM 0.32.0's (`vllm/engine/arg_utils.py` EngineArgs,
`vllm/entrypoints/launchers/cli_args.py` FrontendArgs, `vllm/entrypoints/cli/serve.py`);
tests/test_vllm_flags.py checks every entry against the installed parser. vLLM's
FlexibleArgumentParser folds `--api_key` to `--api-key` and, with argparse's `allow_abbrev`,
accepts any unique prefix (`--api-ke K` is `--api-key K`): `canonical` and `secret_of` follow.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

# Value kinds: how a value is written and read back.
INT, FLOAT, STR, SWITCH, LIST, OPTIONAL, JSON = (
    "int", "float", "str", "switch", "list", "optional", "json")
# Value checks for a plan run by `exec` (plan.json is a file on a shared volume: whoever can
# write it must not choose what runs).
COUNT = "count"  # a whole number >= 1
FRACTION = "fraction"  # a number in (0, 1]
NAME = "name"  # a registered name (parser, dtype, backend): letters, digits, . _ -
SERVED = "served"  # served model names: printable text, not an option
REVISION = "revision"  # a Hub branch, tag or commit
MODEL = "model"  # exactly the plan's own model
PATH = "path"  # a file inside the model's folder or the plan's folder
SPECULATIVE = "speculative"  # {"method": NAME, "num_speculative_tokens": COUNT}, nothing else
EPLB = "eplb"  # {"num_redundant_experts": COUNT}, nothing else
KV_TRANSFER = "kv_transfer"  # {"kv_connector": a known connector, "kv_role", "kv_buffer_device"}


@dataclass(frozen=True)
class Pin:
    """How the CLI offers a flag as a pin of `plan`, `serve`, `tune` and `doctor`."""

    option: str  # vlaunch's option name ("--tp" for --tensor-parallel-size)
    field: str  # the planner's Pins field
    help: str
    negatable: bool = False  # --x/--no-x, unset by default (a tri-state pin)
    group: str = "plan"  # plan: layout, memory, scheduler; serving: parsers, backends


@dataclass(frozen=True)
class FlagSpec:
    """One `vllm serve` flag: its spelling, its value, and what vlaunch may do with it."""

    dest: str  # argparse's dest, the key of vLLM's "non-default args"
    kind: str  # INT, FLOAT, STR, SWITCH, LIST (nargs +), OPTIONAL (nargs ?), JSON
    aliases: tuple[str, ...] = ()  # other option strings vLLM accepts (-tp)
    secret_env: str | None = None  # a secret: the environment variable vLLM reads instead
    pin: Pin | None = None  # offered by the CLI as a pin
    suggest: bool = False  # the doctor may put it in a `fix:` or `run:` line
    plan: str | None = None  # the check a plan run by `exec` passes it through; None: refused
    gate: str | None = None  # the table row with its first release (capabilities/serving.yaml)
    since: str | None = None  # first release with it (the sdists; None: every release read)
    until: str | None = None  # first release without it again (removed), None: still there
    note: str = ""  # why it is in the table, when that is not obvious

    @property
    def name(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def secret(self) -> bool:
        return self.secret_env is not None


def _p(option: str, field: str, help: str, negatable: bool = False, group: str = "plan") -> Pin:
    return Pin(option, field, help, negatable, group)


_FLAGS = (
    # --- what a plan says: the model, its layout, its memory and scheduler ---------------------
    FlagSpec("model", STR, plan=MODEL),
    FlagSpec("served_model_name", LIST, plan=SERVED),
    FlagSpec("revision", STR, plan=REVISION),
    FlagSpec("tensor_parallel_size", INT, ("-tp",), plan=COUNT, suggest=True,
             pin=_p("--tp", "tp", "Pin tensor-parallel size.")),
    FlagSpec("pipeline_parallel_size", INT, ("-pp",), plan=COUNT, suggest=True,
             pin=_p("--pp", "pp", "Pin pipeline-parallel size.")),
    FlagSpec("data_parallel_size", INT, ("-dp",), plan=COUNT, suggest=True, gate="data_parallel",
             pin=_p("--dp", "dp", "Pin data-parallel size.")),
    FlagSpec("enable_expert_parallel", SWITCH, ("-ep",), plan=SWITCH, gate="expert_parallel",
             pin=_p("--expert-parallel", "expert_parallel", "Pin expert parallelism (MoE).",
                    negatable=True)),
    FlagSpec("max_model_len", INT, plan=COUNT, suggest=True,
             pin=_p("--max-model-len", "max_model_len", "Pin the context length.")),
    FlagSpec("kv_cache_dtype", STR, plan=NAME, suggest=True,
             pin=_p("--kv-cache-dtype", "kv_cache_dtype",
                    "Pin the KV dtype: auto, bfloat16, fp8, ...")),
    FlagSpec("gpu_memory_utilization", FLOAT, ("--device-memory-utilization",), plan=FRACTION,
             suggest=True, pin=_p("--gpu-memory-utilization", "gpu_memory_utilization",
                                  "Pin vLLM's memory fraction.")),
    FlagSpec("max_num_seqs", INT, plan=COUNT, suggest=True,
             pin=_p("--max-num-seqs", "max_num_seqs",
                    "Pin max concurrent sequences per engine.")),
    FlagSpec("max_num_batched_tokens", INT, plan=COUNT, suggest=True,
             pin=_p("--max-num-batched-tokens", "max_num_batched_tokens",
                    "Pin the prefill token budget.")),
    FlagSpec("enforce_eager", SWITCH, plan=SWITCH, suggest=True,
             pin=_p("--enforce-eager", "enforce_eager", "No CUDA graphs (more KV, slower).")),
    FlagSpec("kv_cache_memory_bytes", INT, plan=COUNT, suggest=True,
             gate="kv_cache_memory_bytes",
             pin=_p("--kv-cache-memory-bytes", "kv_cache_memory_bytes",
                    "Pin the KV cache size per GPU (vLLM then skips its profiling).")),
    FlagSpec("enable_chunked_prefill", SWITCH, plan=SWITCH),
    FlagSpec("block_size", INT, plan=COUNT),
    # --- serving features (predict/features/serving_flags.py, ep_backend.py, speculative.py) --
    FlagSpec("reasoning_parser", STR, plan=NAME, since="0.7.1",
             pin=_p("--reasoning-parser", "reasoning_parser",
                    "Pin vLLM's reasoning parser ('none': off).", group="serving")),
    FlagSpec("enable_reasoning", SWITCH, plan=SWITCH, since="0.7.1", until="0.10.0",
             note="needed with --reasoning-parser before 0.9.0 (profiles/serving.yaml "
                  "enable_reasoning_flag), accepted until 0.10.0 removed it"),
    FlagSpec("tool_call_parser", STR, plan=NAME,
             pin=_p("--tool-call-parser", "tool_call_parser",
                    "Pin vLLM's tool-call parser ('none': off).", group="serving")),
    FlagSpec("enable_auto_tool_choice", SWITCH, plan=SWITCH),
    FlagSpec("chat_template", STR, plan=PATH,
             pin=_p("--chat-template", "chat_template",
                    "Chat template file for vLLM (tool calling).", group="serving")),
    FlagSpec("tokenizer_mode", STR, plan=NAME),
    FlagSpec("all2all_backend", STR, plan=NAME, gate="serving:ep_backends.selector",
             pin=_p("--all2all-backend", "all2all_backend",
                    "Pin the DP+EP all-to-all backend (e.g. deepep_low_latency).",
                    group="serving")),
    FlagSpec("speculative_config", JSON, ("-sc",), plan=SPECULATIVE, since="0.8.2"),
    # EPLB (predict/features/eplb.py): vLLM's expert-parallel load balancer and the redundant
    # experts it places (config/parallel.py ParallelConfig.enable_eplb, EPLBConfig)
    FlagSpec("enable_eplb", SWITCH, plan=SWITCH, since="0.9.2",
             pin=_p("--eplb", "eplb", "Pin vLLM's expert-parallel load balancer with its "
                    "redundant experts (wide-EP MoE).", negatable=True, group="serving")),
    FlagSpec("eplb_config", JSON, plan=EPLB, since="0.10.2"),
    FlagSpec("kv_transfer_config", JSON, plan=KV_TRANSFER, since="0.6.5",
             note="a P/D pool's side of the KV hand-off (predict/features/connectors.py)"),
    # --- set by vlaunch at launch, never by a plan ----------------------------------------------
    FlagSpec("port", INT, suggest=True, note="serve picks a free one; the doctor may move it"),
    FlagSpec("host", STR, note="serve binds loopback unless told (launcher/run/exposure.py)"),
    FlagSpec("shutdown_timeout", INT, since="0.18.0", note="serve's drain (launcher/run/drain.py)"),
    FlagSpec("headless", SWITCH, since="0.9.0"),
    FlagSpec("nnodes", INT, ("-n",), since="0.11.1"),
    FlagSpec("node_rank", INT, ("-r",), since="0.11.1"),
    FlagSpec("master_addr", STR, since="0.11.1"),
    FlagSpec("master_port", INT, since="0.11.1"),
    FlagSpec("data_parallel_size_local", INT, ("-dpl",), since="0.9.0"),
    FlagSpec("data_parallel_address", STR, ("-dpa",), since="0.9.0"),
    FlagSpec("data_parallel_rpc_port", INT, ("-dpp",), since="0.9.0"),
    FlagSpec("data_parallel_start_rank", INT, ("-dpr",), since="0.9.0"),
    FlagSpec("distributed_executor_backend", STR),
    FlagSpec("disable_custom_all_reduce", SWITCH, suggest=True,
             note="the doctor's fix for a custom all-reduce failure"),
    FlagSpec("ssl_certfile", STR, note="the endpoint is https when it is set"),
    FlagSpec("root_path", STR, note="the endpoint's path prefix"),
    # --- secrets: never echoed, never replayed from a log -------------------------------------
    FlagSpec("api_key", LIST, secret_env="VLLM_API_KEY"),
    FlagSpec("hf_token", OPTIONAL, secret_env="HF_TOKEN", since="0.8.4"),
    # --- known to be dangerous: never from a plan, never suggested (issue 31 H2, M3) ---------
    FlagSpec("trust_remote_code", SWITCH, note="runs the checkpoint's own Python"),
    FlagSpec("tool_parser_plugin", STR, since="0.6.3", note="imports a Python file"),
    FlagSpec("allowed_local_media_path", STR, since="0.6.4", note="lets requests read local files"),
)  # fmt: skip

BY_DEST: dict[str, FlagSpec] = {f.dest: f for f in _FLAGS}
BY_NAME: dict[str, FlagSpec] = {n: f for f in _FLAGS for n in f.names}
assert len(BY_DEST) == len(_FLAGS), "a flag is in the table twice"


OLDEST_READ = "0.6.0"
"""The oldest release whose sdist was read for the table (bench/flag_releases.py,
tests/fixtures/vllm_flag_releases.csv): `since` None means "in every release from this one"."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def _gate_row(gate: str) -> dict[str, Any]:
    """The release row a gate names: `NAME` in profiles/capabilities.yaml vllm_features,
    `serving:A.B` in profiles/serving.yaml (a list of rows: the `style: flag` one)."""
    from ..paths import profiles_dir, read_yaml

    if gate.startswith("serving:"):
        row: Any = read_yaml(profiles_dir() / "serving.yaml")
        for key in gate.split(":", 1)[1].split("."):
            row = row[key]
        if isinstance(row, list):
            row = next(r for r in row if r.get("style") == "flag")
        return row
    return read_yaml(profiles_dir() / "capabilities.yaml")["vllm_features"][gate]


def releases(dest: str) -> tuple[str | None, str | None]:
    """(first release with the flag, first release without it again) - from its gate's row
    when it has one, else from the table."""
    f = BY_DEST[dest]
    if f.gate is not None:
        row = _gate_row(f.gate)
        return row.get("since"), row.get("until")
    return f.since, f.until


def available(dest: str, version: str) -> bool:
    """Does vLLM `version` have the flag? (A version older than OLDEST_READ is taken to have
    what OLDEST_READ has: nothing older was read.)"""
    since, until = releases(dest)
    v = _version(version)
    return (since is None or v >= _version(since)) and (until is None or v < _version(until))


def flags() -> tuple[FlagSpec, ...]:
    """Every flag of the table, in the order the planner writes them."""
    return _FLAGS


def flag(dest: str) -> str:
    """`max_model_len` -> `--max-model-len` (KeyError for a flag the table does not hold)."""
    return BY_DEST[dest].name


def pins() -> tuple[FlagSpec, ...]:
    """The flags the CLI offers as pins."""
    return tuple(f for f in _FLAGS if f.pin is not None)


def canonical(option: str) -> str:
    """An option as vLLM's parser folds it: `--api_key=x` -> `--api-key`."""
    name = option.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def spec_of(option: str) -> FlagSpec | None:
    """The table's entry for an option string (aliases and `--x_y` folded), or None."""
    return BY_NAME.get(canonical(option))


def secret_of(option: str) -> FlagSpec | None:
    """The secret flag `option` names, counting the prefixes argparse's `allow_abbrev` accepts
    (`--api-ke` is `--api-key`). Any prefix of a secret's name counts, even one that is
    ambiguous in vLLM's parser (it would refuse it, so hiding its value costs nothing)."""
    name = canonical(option)
    if not name.startswith("--") or len(name) < 3:
        return None
    for f in _FLAGS:
        if f.secret and f.name.startswith(name):
            return f
    return None


def takes_value(word: str) -> bool:
    """A value, not the next option (argparse stops a list at anything that looks like one)."""
    return not word.startswith("-") or word == "-" or _NEGATIVE.fullmatch(word) is not None


_NEGATIVE = re.compile(r"-\d+(\.\d*)?")


# --- writing and reading argv --------------------------------------------------------------------


def _text(f: FlagSpec, value: Any) -> list[str]:
    if f.kind == FLOAT:
        return [f"{float(value):.2f}"] if f.dest == "gpu_memory_utilization" else [str(value)]
    if f.kind == LIST:
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    if f.kind == JSON and not isinstance(value, str):
        return [json.dumps(value, separators=(",", ":"))]
    return [str(value)]


def argv(values: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[str]:
    """vLLM's arguments for `values` (dest -> value, in the order given): a switch is written
    when True, None and False are left out (vLLM's default), everything else as its text.
    A dest the table does not hold is a KeyError: a flag is added to the table, not here."""
    items = values.items() if isinstance(values, Mapping) else values
    out: list[str] = []
    for dest, value in items:
        f = BY_DEST[dest]
        if value is None or value is False:
            continue
        if f.kind == SWITCH or (f.kind == OPTIONAL and value is True):
            out.append(f.name)
        else:
            out += [f.name, *_text(f, value)]
    return out


@dataclass(frozen=True)
class Parsed:
    """Arguments read the way vLLM's parser reads them: the table's flags by dest (last one
    wins), and everything else as it was given."""

    values: dict[str, Any]
    given: dict[str, str]  # dest -> the option string as written (for messages)
    unknown: list[str]


def parse(args: Sequence[str]) -> Parsed:
    """Read `args` (a plan's vllm_args, the words after `--`): `--flag V`, `--flag=V`, switches,
    lists up to the next option. Values stay text; `check_value` says whether they are valid."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    unknown: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        f = spec_of(word) if word.startswith("-") else None
        if f is None:
            unknown.append(word)
            i += 1
            continue
        name, eq, inline = word.partition("=")
        given[f.dest] = name
        i += 1
        if f.kind == SWITCH:
            values[f.dest] = inline if eq else True
        elif eq:
            values[f.dest] = [inline] if f.kind == LIST else inline
        elif f.kind == LIST:
            items = []
            while i < len(args) and takes_value(args[i]):
                items.append(args[i])
                i += 1
            values[f.dest] = items
        elif f.kind == OPTIONAL:
            if i < len(args) and takes_value(args[i]):
                values[f.dest] = args[i]
                i += 1
            else:
                values[f.dest] = True
        elif i < len(args) and takes_value(args[i]):
            values[f.dest] = args[i]
            i += 1
        else:
            values[f.dest] = None  # a flag without its value (vLLM would refuse it)
    return Parsed(values, given, unknown)


def value(args: Sequence[str], dest: str) -> str | None:
    """The value of one flag in `args` as text (the last one wins, as argparse does); of a list
    (--served-model-name A B, --api-key K1 K2) the first, the one vLLM reports and clients use."""
    got = parse(args).values.get(dest)
    if isinstance(got, list):
        return got[0] if got else None
    return None if got is None or got is True else str(got)


def has(args: Sequence[str], dest: str) -> bool:
    """Is the flag (any of its spellings) in `args`?"""
    return dest in parse(args).values


def from_log_args(values: Mapping[str, Any], *, keep: Iterable[str] = ()) -> list[str]:
    """A log's "non-default args" ({dest: value}, as vLLM prints them) as argv, limited to the
    flags the doctor may suggest plus `keep`: a log is the attacker's text, and copying its
    `--trust-remote-code` or `--tool-parser-plugin /tmp/x.py` into a `run:` line would have a
    reader run it (issue 31 M3). Secrets become `--flag <VAR>` markers (`secret_marker`)."""
    keep = set(keep)
    out: list[str] = []
    for dest, v in values.items():
        f = BY_DEST.get(str(dest))
        if f is None:
            continue
        if f.secret:
            out += [f.name, SECRET_MARK + str(f.secret_env)]
            continue
        if not (f.suggest or f.dest in keep) or not _sane(f, v):
            continue
        out += argv({f.dest: v})
    return out


SECRET_MARK = "\0env:"
"""A word that stands for "$VARIABLE" in a command the doctor prints (never the value)."""


def sane_log_value(dest: str, v: Any) -> bool:
    """Is a log's number for the table's flag `dest` one the flag takes (a count, a fraction in
    (0, 1])? A flag outside the table, or a value that is no number, is not judged here."""
    f = BY_DEST.get(dest)
    if f is None or f.kind not in (INT, FLOAT):
        return True
    return _sane(f, v)


def _sane(f: FlagSpec, v: Any) -> bool:
    """A log's value of a suggested flag that is what the flag takes (a count, a fraction in
    (0, 1], a registered name); nonsense from a hostile log is left out, not suggested."""
    if f.kind == SWITCH:
        return v is True
    check = f.plan or (COUNT if f.kind == INT else NAME)
    return _check(f, check, v if not isinstance(v, bool) else None) is None


# --- what a plan run by `exec` may carry ----------------------------------------------------------


def _refuse(what: str) -> InputError:
    return InputError(f"plan.json carries {what}, which `vlaunch plan` never writes; refusing "
                      "a tampered or hand-edited plan: re-run `vlaunch plan --emit`")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_SERVED = re.compile(r"[^\x00-\x20\x7f-\x9f-][^\x00-\x1f\x7f-\x9f]{0,255}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,254}")
_SPEC_KEYS = {"method": NAME, "num_speculative_tokens": COUNT}
_EPLB_KEYS = {"num_redundant_experts": COUNT}


@dataclass(frozen=True)
class PlanContext:
    """What a plan's values are checked against: its own model and the folders a path may
    point into (the model's folder and the plan's)."""

    model: str | None = None
    roots: tuple[str, ...] = ()


def _inside(path: str, roots: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return True
    return False


def _check(f: FlagSpec, check: str, v: Any, ctx: PlanContext | None = None) -> str | None:
    """Why `v` is not a value a plan may give `f` (None when it is)."""
    text = v if isinstance(v, str) else None
    if check == COUNT:
        n = _number(v, int)
        return None if n is not None and n >= 1 else "is not a whole number of at least 1"
    if check == FRACTION:
        x = _number(v, float)
        return None if x is not None and 0 < x <= 1 else "is not a number in (0, 1]"
    if check == SWITCH:
        return None if v is True else "takes no value"
    if check in (NAME, SERVED, REVISION):
        pattern = {NAME: _NAME, SERVED: _SERVED, REVISION: _REVISION}[check]
        words = v if isinstance(v, list) and f.kind == LIST else [v]
        ok = bool(words) and all(isinstance(w, str) and pattern.fullmatch(w)
                                 and (check == SERVED or ".." not in w) for w in words)
        return None if ok else "is not a plain name"
    if check == MODEL:
        want = ctx.model if ctx else None
        if want is None or text == want:
            return None
        return f"names another model than the plan's {want!r}"
    if check == PATH:
        # vLLM opens it relative to its working directory, as realpath resolves it here
        if text and _inside(text, ctx.roots if ctx else ()):
            return None
        return "is not a file inside the model's folder or the plan's folder"
    if check == SPECULATIVE:
        return _check_speculative(v)
    if check == EPLB:
        return _check_object(v, _EPLB_KEYS, f)
    if check == KV_TRANSFER:
        return _check_kv_transfer(v)
    return "cannot be checked"


def _check_speculative(v: Any) -> str | None:
    """MTP's config as the planner writes it (deployment/argv.py engine_values): a method name and a
    draft count; a `model`, a draft path or anything else names code or weights to load."""
    return _check_object(v, _SPEC_KEYS, BY_DEST["speculative_config"])


def _json_object(v: Any) -> dict[str, Any] | None:
    """`v` read as a non-empty JSON object, or None (not text, not JSON, or not an object)."""
    try:
        obj = json.loads(v) if isinstance(v, str) else None
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) and obj else None


def _check_object(v: Any, keys: Mapping[str, str], f: FlagSpec) -> str | None:
    """A JSON object flag as the planner writes it: only `keys`, each value passing its check."""
    obj = _json_object(v)
    if obj is None:
        return "is not a JSON object"
    for key, val in obj.items():
        check = keys.get(key)
        if check is None:
            return f"sets {str(key)[:40]!r}, which the planner never writes"
        if _check(f, check, val) is not None:
            return f"has {key}={val!r:.40}"
    return None


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_DEVICES = ("cuda", "cpu")
_STORE = "/var/run/vlaunch-kv"  # ExampleConnector's store in a pod (predict/search/pd_pools.py)


def _check_kv_transfer(v: Any) -> str | None:
    """A pool's KVTransferConfig as the planner writes it (predict/features/connectors.py
    Transfer.config): a connector the connector table knows, a kv_role, a buffer device, and
    for a shared-store connector only its store. Never `kv_connector_module_path` (it imports a
    module) or any field the planner does not write."""
    from ..paths import profiles_dir, read_yaml

    obj = _json_object(v)
    if obj is None:
        return "is not a JSON object"
    allowed = {"kv_connector": tuple(read_yaml(profiles_dir() / "connectors.yaml")["connectors"]),
               "kv_role": _KV_ROLES, "kv_buffer_device": _KV_DEVICES}
    for key, val in obj.items():
        if key == "kv_connector_extra_config":
            ok = val == {"shared_storage_path": _STORE}
        elif key in allowed:
            ok = isinstance(val, str) and val in allowed[key]
        else:
            return f"sets {str(key)[:40]!r}, which the planner never writes"
        if not ok:
            return f"has {key}={val!r:.40}"
    return None if "kv_connector" in obj else "names no kv_connector"


def _number(v: Any, kind: type) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int) or (isinstance(v, float) and kind is float):
        x = v
    elif isinstance(v, str) and len(v) < 40:
        try:
            x = kind(v)
        except ValueError:
            return None
    else:
        return None
    if not math.isfinite(x) or abs(x) > _LARGEST:
        return None
    return x


_LARGEST = 2**53  # beyond any count or byte size a flag takes; 1e26 from a log is nonsense


def check_value(dest: str, v: Any, ctx: PlanContext | None = None) -> str | None:
    """Why `v` is not a value a plan may give the flag `dest` (None when it may)."""
    f = BY_DEST[dest]
    if f.plan is None:
        return "is not a flag a plan may carry"
    return _check(f, f.plan, v, ctx)


def check_plan_args(args: Sequence[str], ctx: PlanContext | None = None) -> Parsed:
    """Every argument of a plan is a flag the table lets a plan carry, with a value that passes
    its check; anything else (a positional, `--trust-remote-code`, `--model /elsewhere`, a
    `--chat-template /etc/shadow`) is refused, not dropped, so a tampered plan fails loudly."""
    parsed = parse(args)
    if parsed.unknown:
        raise _refuse(f"the argument {parsed.unknown[0][:64]!r}")
    for dest, v in parsed.values.items():
        f = BY_DEST[dest]
        shown = parsed.given.get(dest, f.name)
        if f.plan is None:
            raise _refuse(f"the argument {shown!r}")
        if v is None:
            raise _refuse(f"{shown} without a value")
        why = _check(f, f.plan, v, ctx)
        if why is not None:
            raise _refuse(f"{shown} {str(v)[:64]!r} (it {why})")
    return parsed


# The environment a plan may carry: what the planner writes (Plan.env, serving env) and nothing
# else. vLLM reads many more VLLM_ names (vllm/envs.py); some load code or move files
# (VLLM_NCCL_SO_PATH and VLLM_CUDART_SO_PATH name libraries it loads, the power of LD_PRELOAD;
# VLLM_MODEL_REDIRECT_PATH, VLLM_CONFIG_ROOT, VLLM_TRACE_FUNCTION, VLLM_USAGE_STATS_SERVER,
# VLLM_DP_MASTER_IP, VLLM_PLUGINS ...), so an allow-list, each name with its value check.
PLAN_ENV = {
    "VLLM_ENGINE_READY_TIMEOUT_S": COUNT,
    "VLLM_ENABLE_STARTUP_PLAN": "bit",
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "bit",
    "VLLM_ALL2ALL_BACKEND": NAME,
    "VLLM_CACHE_ROOT": "own",  # only the value this process's own environment gives
    # a P/D pool's side of the KV hand-off (predict/features/connectors.py Transfer.env)
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "host",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "port",
    "UCX_TLS": "words",
    "UCX_NET_DEVICES": "words",
}
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}")  # an address or a host name
_WORDS = re.compile(r"\^?[A-Za-z0-9_.:-]{1,64}(,\^?[A-Za-z0-9_.:-]{1,64}){0,31}")  # UCX lists


def _own_cache_root(environ: Mapping[str, str]) -> str | None:
    """Where the planner puts VLLM_CACHE_ROOT (Plan.env): the environment's own, or HF_HOME's
    vllm folder. A plan may repeat that, never move it."""
    if environ.get("VLLM_CACHE_ROOT"):
        return environ["VLLM_CACHE_ROOT"]
    return os.path.join(environ["HF_HOME"], "vllm") if environ.get("HF_HOME") else None


def _env_ok(check: str, text: str, environ: Mapping[str, str]) -> bool:
    if check == COUNT:
        return (_number(text, int) or 0) >= 1
    if check == "bit":
        return text in ("0", "1")
    if check == NAME:
        return _NAME.fullmatch(text) is not None
    if check == "port":
        return 1 <= (_number(text, int) or 0) <= 65535
    if check in ("host", "words"):
        return (_HOST if check == "host" else _WORDS).fullmatch(text) is not None
    return text == _own_cache_root(environ)


def check_plan_env(env: Mapping[object, object],
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The plan's environment as strings, if every name is on the allow-list with a valid value."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, v in env.items():
        name = str(key)
        check = PLAN_ENV.get(name)
        if check is None:
            raise _refuse(f"the environment variable {name[:64]!r}")
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise _refuse(f"a non-scalar value for {name}")
        text = str(v)
        if not _env_ok(check, text, environ):
            raise _refuse(f"{name}={text[:64]!r}")
        out[name] = text
    return out
