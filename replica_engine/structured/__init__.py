"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained request."""

from replica_engine.structured.grammar import (
    GrammarCompiler,
    RequestGrammar,
    apply_token_bitmasks,
    new_bitmask,
)

__all__ = ["GrammarCompiler", "RequestGrammar", "apply_token_bitmasks", "new_bitmask"]
