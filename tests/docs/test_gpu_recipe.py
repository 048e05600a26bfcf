"""The GPU node recipe (deploy/Dockerfile.gpu) cannot be built here (no Docker, no network), so
what can go stale in it is checked: Ray's image is the Ray these tests run, with their Python;
every package the project installs is copied in; serving's install has no dev extra; and the
docs point to it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile.gpu"


def test_the_image_is_the_ray_and_python_the_tests_run():
    image = re.search(
        r"^FROM rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>\d+)-cu\d+$", DOCKERFILE.read_text(), re.M
    )
    assert image is not None
    assert image["ray"] == ray.__version__
    assert image["py"] == f"{sys.version_info.major}{sys.version_info.minor}"


def test_every_package_is_copied_and_installed_without_the_dev_extra():
    text = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", text, re.M))
    found = re.search(r"^include = \[(?P<names>[^]]*)\]", (REPO / "pyproject.toml").read_text(), re.M)
    assert found is not None  # [tool.setuptools.packages.find]'s include
    packages = {name.rstrip("*") for name in re.findall(r'"([^"]+)"', found["names"])}
    assert packages and packages <= copied
    assert all((REPO / name).is_dir() for name in copied)
    assert "pip install --no-cache-dir ." in text and "[dev]" not in text
    # torch's CUDA build goes in before the project, which would otherwise pull a CPU one
    assert text.index("download.pytorch.org/whl/cu") < text.index("pip install --no-cache-dir .")


def test_the_gpu_docs_point_to_it():
    assert "deploy/Dockerfile.gpu" in (REPO / "docs" / "deployment.md").read_text()
