"""Validate a command's JSON output against its schema in launcher/schemas (one validator per
schema, checked itself first), for the tests of every command's `--format json`."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).resolve().parent.parent / "launcher" / "schemas"


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(name: str, doc: Any) -> list[str]:
    """Every way `doc` breaks schema `name`, as 'path: message' lines (empty when it holds)."""
    return [f"{'/'.join(map(str, e.path))}: {e.message}"
            for e in _validator(name).iter_errors(doc)]
