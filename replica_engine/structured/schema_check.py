"""Which JSON-schema keywords a constrained request may use: the ones xgrammar enforces (each
checked, a valid and an invalid instance per keyword, by tests/engine/test_grammar.py). xgrammar
compiles some others without enforcing them (`not`, `if`, `contains`, `uniqueItems`,
`dependentRequired`, `unevaluatedProperties`, several `format`s, remote `$ref`s) or wrongly
(`patternProperties` refuses valid instances); a schema with one is refused, naming it, rather
than served with a constraint silently dropped."""

from __future__ import annotations

from typing import Any

from common.errors import InvalidRequestError

# Keywords that constrain output and are enforced.
_ENFORCED = frozenset(
    {
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties", "propertyNames", "minProperties",
        "maxProperties",
        "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Keywords that say nothing about valid output (annotations, and OpenAPI's discriminator).
_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
        "readOnly", "writeOnly", "discriminator", "contentEncoding", "contentMediaType",
    }
)  # fmt: skip
_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# Keywords whose value maps names to subschemas, or lists subschemas.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMAS = frozenset({"items", "additionalProperties", "propertyNames", "unevaluatedItems"})


def check_schema(schema: Any, param: str) -> None:
    """Raise InvalidRequestError(param) naming the first keyword that would not be enforced."""
    _check(schema, param, "#")


def _check(schema: Any, param: str, path: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(param, f"{path}: a schema must be an object or a boolean")
    for keyword, value in schema.items():
        where = f"{path}/{keyword}"
        if keyword not in _ENFORCED and keyword not in _ANNOTATIONS:
            raise InvalidRequestError(param, f"{where}: JSON-schema keyword {keyword!r} is not supported")
        if keyword == "format" and value not in _FORMATS:
            raise InvalidRequestError(param, f"{where}: format {value!r} is not supported")
        if keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise InvalidRequestError(param, f"{where}: only local references (#/...) are supported")
        if keyword == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequestError(param, f"{where}: allOf with more than one schema is not supported")
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            for name, subschema in value.items():
                _check(subschema, param, f"{where}/{name}")
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            for index, subschema in enumerate(value):
                _check(subschema, param, f"{where}/{index}")
        elif keyword in _SUBSCHEMAS:
            _check(value, param, where)
