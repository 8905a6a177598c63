"""The flags that make a DeepSeek endpoint usable by clients: reasoning and tool-call parsers.

Without `--reasoning-parser` an R1 answer arrives with its whole `<think>` block in `content`;
without `--tool-call-parser` and `--enable-auto-tool-choice` a V3.1/V3.2 tool call arrives as
raw DSML text and OpenAI clients never see `tool_calls`. Which parser a checkpoint needs, the
chat template or tokenizer mode it needs for tools, and the first vLLM release that has each
are data in `profiles/serving.yaml` (`parsers`, `parser_versions`); this module matches the
model to a row, applies your overrides (`--reasoning-parser`, `--tool-call-parser`,
`--chat-template`, `none` to drop one) and drops what the planned vLLM version lacks, with the
reason. The flag names are vLLM 0.32.0's (`vllm/entrypoints/openai/cli_args.py`
`FrontendArgs`: reasoning_parser, tool_call_parser, enable_auto_tool_choice, chat_template;
`vllm/engine/arg_utils.py` EngineArgs.tokenizer_mode), and the parser names those registered in
`vllm/reasoning/__init__.py` and `vllm/tool_parsers/__init__.py`.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any

from ...deployment.plan import Parsers, Reason
from ...errors import InputError
from ...inputs import vllm_flags
from ...inputs.model import ModelSpec
from ...paths import profiles_dir, read_yaml
from ..search.pins import Origin, origin_data, said
from .capabilities import parse_version

NONE = "none"
"""An override value that drops a parser the profile would set."""


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    """profiles/serving.yaml, shared by speculative.py and ep_backend.py."""
    return read_yaml(profiles_dir() / "serving.yaml")


def at_least(version: str, since: str | None) -> bool:
    return since is None or parse_version(version) >= parse_version(str(since))


def _names(spec: ModelSpec) -> list[str]:
    tail = (spec.hf_id or "").rstrip("/").rsplit("/", 1)[-1]
    return [n.lower() for n in (spec.name, tail) if n]


def profile_row(spec: ModelSpec) -> dict[str, Any] | None:
    """The first `parsers` row whose globs match the profile name or the HF id's last part."""
    names = _names(spec)
    for row in table().get("parsers", ()):
        if any(fnmatch.fnmatch(n, pat.lower()) for pat in row["match"] for n in names):
            return row
    return None


@dataclass(frozen=True)
class ServingFlags:
    """What the plan passes to the API server for clients, and why: the plan's own `Parsers`
    (deployment/plan.py, its fields declared there once), plus what only the argv and the
    plan's warnings need."""

    parsers: Parsers = Parsers(None, None, False, None, None, "none")
    enable_reasoning_flag: bool = False  # vLLM 0.7.1-0.8.x needed --enable-reasoning too
    warnings: tuple[Reason, ...] = ()

    def vllm_args(self) -> list[str]:
        p = self.parsers
        reasoning, tools = bool(p.reasoning_parser), bool(p.tool_call_parser)
        return vllm_flags.argv((
            ("enable_reasoning", reasoning and self.enable_reasoning_flag),
            ("reasoning_parser", p.reasoning_parser or None),
            ("tool_call_parser", p.tool_call_parser or None),
            ("enable_auto_tool_choice", tools and p.enable_auto_tool_choice),
            ("chat_template", p.chat_template or None),
            ("tokenizer_mode", p.tokenizer_mode or None),
        ))


def needs_enable_reasoning(version: str) -> bool:
    """Whether this vLLM takes a reasoning parser only with --enable-reasoning (0.7.1-0.8.x)."""
    erow = table().get("enable_reasoning_flag") or {}
    return at_least(version, erow.get("since")) and not at_least(version, erow.get("until"))


def _gate(kind: str, name: str, version: str) -> dict[str, Any] | None:
    """None when `version` has the parser or tokenizer mode `name`, else the figures of why
    not (the release that added it, and its source)."""
    row = (table().get("parser_versions", {}).get(kind) or {}).get(name)
    if row is None or at_least(version, row.get("since")):
        return None  # a name the table does not know (your own): vLLM checks it
    return {"kind": kind, "name": name, "vllm_version": version, "since": str(row["since"]),
            "source": row.get("source", "")}


def _lack(g: dict[str, Any]) -> str:
    return (f"vLLM {g['vllm_version']} has no {g['kind'].replace('_', ' ')} '{g['name']}' "
            f"(since {g['since']}: {g['source']})")


def _override(value: str | None, pinned: str | None) -> tuple[str | None, bool]:
    if pinned is None:
        return value, False
    return (None if pinned.lower() == NONE else pinned), True


def decide(spec: ModelSpec, version: str, reasoning_parser: str | None = None,
           tool_call_parser: str | None = None, chat_template: str | None = None,
           from_plan: frozenset[str] = frozenset()) -> ServingFlags:
    """The parsers, tool choice, chat template and tokenizer mode for `spec` on `version`.

    A pinned value wins over the profile (`none` drops it); anything the version lacks is left
    out with the reason, so a plan never passes vLLM a flag value it rejects at start-up. Each
    reason and warning is data: a code, its figures, and the sentence they make; a pin named in
    `from_plan` came from the emitted plan (`exec --replan`), not from the user.
    """

    def origin(name: str, pinned: bool) -> Origin | None:
        return ("plan" if name in from_plan else "you") if pinned else None

    for flag, value in ((vllm_flags.flag("reasoning_parser"), reasoning_parser),
                        (vllm_flags.flag("tool_call_parser"), tool_call_parser),
                        (vllm_flags.flag("chat_template"), chat_template)):
        if value is not None and not value.strip():
            raise InputError(f"{flag} needs a value (a name, or '{NONE}' to leave it out)")
    row = profile_row(spec) or {}
    why = row.get("why", "")
    reasoning, r_pinned = _override(row.get("reasoning_parser"), reasoning_parser)
    template, t_pinned = _override(None, chat_template)
    tools_mode = row.get("tools", "none")
    tool = row.get("tool_call_parser") if tools_mode == "auto" or (
        tools_mode == "with_template" and template) else None
    tool, tool_pinned = _override(tool, tool_call_parser)
    mode = row.get("tokenizer_mode")
    source = "pinned" if r_pinned or tool_pinned or t_pinned else "profile" if row else "none"
    reasons: list[Reason] = []
    warnings: list[Reason] = []
    kept = {"reasoning_parser": None, "tool_call_parser": None, "tokenizer_mode": None}
    enable_flag = False
    if reasoning:
        lack = _gate("reasoning_parser", reasoning, version)
        if lack is None:
            kept["reasoning_parser"] = reasoning
            enable_flag = needs_enable_reasoning(version)
            reasons.append(Reason(
                "parsers.reasoning", f"reasoning-parser {reasoning}: "
                + (said(o) if (o := origin("reasoning_parser", r_pinned)) else why)
                + "; clients get the thinking in reasoning_content"
                + (" (with --enable-reasoning, which this vLLM still needs)"
                   if enable_flag else ""),
                {"parser": reasoning, **origin_data(o), "enable_reasoning": enable_flag}))
        else:
            warnings.append(Reason("parsers.reasoning_missing", f"no --reasoning-parser: "
                                   f"{_lack(lack)}; the reasoning stays inside the answer text",
                                   lack))
    if tool:
        lack = _gate("tool_call_parser", tool, version)
        if lack is None:
            kept["tool_call_parser"] = tool
            reasons.append(Reason(
                "parsers.tools", f"tool-call-parser {tool} with --enable-auto-tool-choice: "
                + (said(o) if (o := origin("tool_call_parser", tool_pinned)) else why)
                + "; tool calls arrive as OpenAI tool_calls",
                {"parser": tool, **origin_data(o)}))
        else:
            warnings.append(Reason("parsers.tools_missing", f"no --tool-call-parser: "
                                   f"{_lack(lack)}; tool calls would arrive as text", lack))
    elif tools_mode == "with_template" and not tool_pinned:
        reasons.append(Reason(
            "parsers.tools_need_template",
            f"no tool-call parser: {spec.name}'s tool calls need vLLM's tool chat template "
            f"({row.get('template')} in the vLLM repository, not shipped in its wheel); pass "
            f"--chat-template PATH to that file to get --tool-call-parser "
            f"{row.get('tool_call_parser')} --enable-auto-tool-choice",
            {"template": row.get("template"), "parser": row.get("tool_call_parser"),
             "pinned": False}))
    if template:
        o = origin("chat_template", True)
        reasons.append(Reason("parsers.chat_template", f"chat-template {template}: {said(o)}",
                              {"path": template, **origin_data(o)}))
    if mode and (tool or reasoning):
        lack = _gate("tokenizer_mode", mode, version)
        if lack is None:
            kept["tokenizer_mode"] = mode
            reasons.append(Reason(
                "parsers.tokenizer_mode", f"tokenizer-mode {mode}: the checkpoint has no Jinja "
                "chat template; vLLM's encoder for it renders the chat, thinking and tools",
                {"mode": mode, "pinned": False}))
        else:
            warnings.append(Reason("parsers.tokenizer_mode_missing",
                                   f"no --tokenizer-mode {mode}: {_lack(lack)}", lack))
    tools = kept["tool_call_parser"]
    parsers = Parsers(reasoning_parser=kept["reasoning_parser"], tool_call_parser=tools,
                      enable_auto_tool_choice=bool(tools), chat_template=template or None,
                      tokenizer_mode=kept["tokenizer_mode"], source=source,
                      reasons=tuple(reasons))
    return ServingFlags(parsers, enable_flag, tuple(warnings))
