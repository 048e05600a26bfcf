"""LoRA adapters as the Ingress serves them: which `model` names an adapter, where its files are,
and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

A request's `model` is the served base name (no adapter), `<base>:<adapter>` (Ray Serve LLM's
form) or a bare adapter name (vLLM's form). An adapter is one of the app's `lora_modules`, one
loaded through the API, or a directory `<lora_root>/<name>` (Ray Serve LLM's dynamic loading).
Its files are checked here (config and safetensors header, no weights) before any replica is
asked, so a bad adapter is a 400 naming `model`, never a failure mid-stream; each replica loads
the weights itself on first use (replica_engine/lora).

Limitation: the registry lives in each Ingress replica. An adapter loaded or unloaded through the
API changes only the Ingress replica that answered; with `ingress_replicas` above 1, list
adapters in `lora_modules` or put them under `lora_root`, which every replica reads alike.
Torch-free, like the Ingress."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict

from common.errors import InvalidRequestError
from common.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest, check_adapter_name, read_adapter
from deployments.protocol import ApiError

_MAX_CHECKED = 1024  # adapters whose check is remembered (by their files' stat) before forgetting all


@dataclass(frozen=True)
class LoraSettings:
    """The app's LoRA args, as the Ingress needs them."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, absolute directory)
    root: str | None = None  # absolute directory; adapter x is <root>/x
    max_lora_rank: int = 16  # the engine's: an adapter above it is refused here already
    runtime_updating: bool = False  # the load/unload endpoints answer

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.root is not None or self.runtime_updating


def parse_lora_modules(value: object) -> dict[str, str]:
    """vLLM's --lora-modules in any of its shapes: {name: path}, ["name=path", ...], or
    [{"name": ..., "path": ...}, ...]; paths made absolute (the replicas' working directory
    is not the builder's)."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for item in value:
            if isinstance(item, str) and "=" in item:
                name, _, path = item.partition("=")
                pairs.append((name, path))
            elif isinstance(item, Mapping) and {"name", "path"} <= set(item):
                pairs.append((item["name"], item["path"]))
            else:
                raise InvalidRequestError(
                    "lora_modules", f"an entry is 'name=path' or {{name: ..., path: ...}}, got {item!r}"
                )
    else:
        raise InvalidRequestError("lora_modules", f"a mapping name -> path or a list, got {value!r}")
    modules: dict[str, str] = {}
    for name, path in pairs:
        check_adapter_name(name, "lora_modules")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_modules", f"adapter {name!r}: the path must be a string")
        if name in modules:
            raise InvalidRequestError("lora_modules", f"adapter {name!r} is listed twice")
        modules[name] = os.path.abspath(os.path.expanduser(path))
    return modules


def check_lora_settings(settings: LoraSettings, model_config: Any, base_name: str) -> None:
    """Deploy-time: every listed adapter runs on this model, and lora_root is a directory."""
    for name, path in settings.modules:
        if name == base_name:
            raise InvalidRequestError("lora_modules", f"adapter {name!r} has the served model's own name")
        read_adapter(LoRARequest(name, path), model_config, settings.max_lora_rank, "lora_modules")
    if settings.root is not None and not os.path.isdir(settings.root):
        raise InvalidRequestError("lora_root", f"{settings.root} is not a directory")


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name instead of refusing


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


class LoraRegistry:
    """The adapters one Ingress replica serves, by name, and the model names that reach them."""

    def __init__(
        self,
        base_name: str,
        model_config: Mapping[str, Any],
        settings: LoraSettings,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.base_name = base_name
        self._base_names = {base_name, *aliases}  # what names the base model (aliases: not listed)
        self.settings = settings
        self._model_config = SimpleNamespace(**model_config)  # read_adapter reads attributes
        self._adapters: dict[str, str] = dict(settings.modules)  # listed, then loaded by the API
        self._checked: dict[LoRARequest, tuple[int, ...]] = {}  # adapter -> its files' stat when checked

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), its files checked; 404
        model_not_found for a name we do not serve, 400 naming `model` for a bad adapter."""
        if model is None or model in self._base_names:
            return None
        lora = self._adapter(model)
        if lora is None:
            raise model_not_found(model)
        self._check(lora, "model")
        return lora

    def knows(self, model: str) -> bool:
        """Whether `model` names the base model or an adapter it serves (files not checked)."""
        return model in self._base_names or self._adapter(model) is not None

    def _adapter(self, model: str) -> LoRARequest | None:
        """The adapter `model` names (`name` or `<base>:name`), if there is one."""
        return self._find(model.removeprefix(f"{self.base_name}:"))

    def _find(self, name: str) -> LoRARequest | None:
        if not _valid_name(name):
            return None  # not a name an adapter can have; nothing on disk is looked at
        if name in self._adapters:
            return LoRARequest(name, self._adapters[name])
        if self.settings.root is not None:
            path = os.path.join(self.settings.root, name)
            if os.path.isdir(path):
                return LoRARequest(name, path)
        return None

    def _check(self, lora: LoRARequest, param: str) -> None:
        """read_adapter, skipped while the files are as they were when last checked."""
        stamp = _stat(lora.path)
        if stamp is not None and self._checked.get(lora) == stamp:
            return
        read_adapter(lora, self._model_config, self.settings.max_lora_rank, param)
        if len(self._checked) >= _MAX_CHECKED:
            self._checked.clear()
        if stamp is not None:
            self._checked[lora] = stamp

    def load(self, body: LoadLoraAdapterRequest) -> str:
        """vLLM's load: the adapter checked, then served under its name; the success message."""
        self._check_runtime_updating()
        name = check_adapter_name(body.lora_name, "lora_name")
        if name == self.base_name:
            raise ApiError(400, f"{name!r} is the served model's own name", param="lora_name")
        if name in self._adapters and not body.load_inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if not os.path.isabs(body.lora_path):
            raise ApiError(400, "lora_path must be an absolute path on the server", param="lora_path")
        lora = LoRARequest(name, os.path.normpath(body.lora_path))
        self._check(lora, "lora_path")
        self._adapters[name] = lora.path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: UnloadLoraAdapterRequest) -> str:
        """vLLM's unload: the name no longer resolves; requests already running finish with it."""
        self._check_runtime_updating()
        name = body.lora_name
        if name not in self._adapters:
            if self.settings.root is not None and self._find(name) is not None:
                raise ApiError(
                    400,
                    f"The lora adapter '{name}' is served from lora_root ({self.settings.root}): "
                    "remove its directory to stop serving it",
                    param="lora_name",
                )
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found"
            )
        del self._adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_runtime_updating(self) -> None:
        if not self.settings.runtime_updating:
            raise ApiError(
                404,
                "loading and unloading LoRA adapters at runtime is off: set "
                "allow_runtime_lora_updating: true in the app's args",
                code="not_found",
            )

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models' entries for the adapters (vLLM's shape: `parent` is the base model)."""
        adapters = dict(self._adapters)
        root = self.settings.root
        if root is not None:
            try:
                entries = sorted(os.listdir(root))
            except OSError:
                entries = []
            for name in entries:
                path = os.path.join(root, name)
                listed = name in adapters or not _valid_name(name)
                if not listed and os.path.isfile(os.path.join(path, CONFIG_FILE)):
                    adapters[name] = path
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "stallfree",
                "root": path,
                "parent": self.base_name,
            }
            for name, path in adapters.items()
        ]


def _valid_name(name: str) -> bool:
    try:
        check_adapter_name(name)
    except InvalidRequestError:
        return False
    return True


def _stat(path: str) -> tuple[int, ...] | None:
    """The adapter files' modification times and sizes; None if either is missing."""
    try:
        files = [os.stat(os.path.join(path, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    except (OSError, ValueError):  # ValueError: a NUL in a client's lora_path
        return None
    return tuple(value for stat in files for value in (stat.st_mtime_ns, stat.st_size))
