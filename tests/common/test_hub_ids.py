"""A hub id (`org/name`) loads from the Hugging Face cache as vLLM loads one, and is served under
that id; a snapshot directory of the cache is served under its id too, not its commit hash.
Nothing can be downloaded here: the test fills a cache directory with the embedded model's files
and runs offline (HF_HUB_OFFLINE=1), in a process of its own as a user's would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.model_source import DEFAULT_MODEL, resolve_model, served_model_name
from harness.serve_cluster import REPO

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding HUB_ID's files at COMMIT (links to the converted model)."""
    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    source = resolve_model(DEFAULT_MODEL).hf_dir
    assert source is not None
    for file in source.iterdir():
        (snapshot / file.name).symlink_to(file.resolve())
    return snapshot


def resolved_offline(model: str, cache: Path) -> subprocess.CompletedProcess[str]:
    script = f"from common.model_source import resolve_model as r; s = r({model!r}); print(s.name, s.hf_dir)"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)


def test_a_hub_id_loads_from_the_cache_under_its_id(tmp_path: Path):
    snapshot = hub_cache(tmp_path)
    found = resolved_offline(HUB_ID, tmp_path)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == [HUB_ID, str(snapshot)]
    assert served_model_name(str(snapshot)) == HUB_ID  # not COMMIT


def test_a_hub_id_not_in_the_cache_fails_naming_the_model(tmp_path: Path):
    missing = resolved_offline("HuggingFaceTB/no-such-model", tmp_path)
    assert missing.returncode != 0
    assert "InvalidRequestError: model: hub id 'HuggingFaceTB/no-such-model'" in missing.stderr
