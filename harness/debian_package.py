"""A program from Debian's package, installed on first use where we are root with apt-get (the
test machine), so the tests use the real thing (Prometheus, Redis) rather than a stand-in."""

from __future__ import annotations

import os
import shutil
import subprocess


def find_or_install(binary: str, package: str) -> tuple[str | None, str]:
    """The binary's path, installing `package` if we can; else None and why not."""
    path = shutil.which(binary)
    if path:
        return path, ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, f"{binary} is not installed and apt-get (as root) is not available to install {package}"
    result = subprocess.run(
        ["apt-get", "install", "-y", "-q", package],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    path = shutil.which(binary)
    return path, "" if path else f"`apt-get install {package}` failed: {result.stderr[-500:]}"
