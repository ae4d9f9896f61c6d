"""Grammars as text, for tests that look into what a request's grammar enforces."""

from __future__ import annotations

from typing import Any

from edgepath.contract import wire
from edgepath.edge.apis.structured import grammar_of
from edgepath.edge.http import Grammar


def gbnf(grammar: Grammar | None) -> str | None:
    """The GBNF text of ``grammar``, built now (None: no grammar)."""
    return None if grammar is None else wire.read_constraint(grammar.build())


def grammar_for(response_format: Any) -> str | None:
    """``response_format``'s grammar, checked and built now (None: plain text)."""
    return gbnf(grammar_of(response_format))
