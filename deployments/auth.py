"""Optional API keys: `Authorization: Bearer <key>` on every /v1 route when keys are configured.

Keys come from an environment variable (comma-separated) and/or a file (one per line) on the
Ingress's node; never from serve_config.yaml itself, which is not a place for secrets."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from deployments.protocol import ApiError


def load_api_keys(env_var: str | None, key_file: str | None) -> frozenset[str]:
    keys: set[str] = set()
    if env_var:
        keys.update(k.strip() for k in os.environ.get(env_var, "").split(","))
    if key_file:
        keys.update(line.strip() for line in Path(key_file).read_text().splitlines())
    return frozenset(k for k in keys if k and not k.startswith("#"))


def check_api_key(authorization: str | None, keys: frozenset[str]) -> None:
    """Pass when no keys are configured or the bearer token is one of them; else 401."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # compare_digest against every key: the time taken says nothing about which key nearly matched.
    matches = [hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise ApiError(
            401,
            "Invalid or missing API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
