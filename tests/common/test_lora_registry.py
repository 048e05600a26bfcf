"""The Ingress's LoRA registry without Ray or torch: which `model` names reach which adapter, the
checks before a request leaves the Ingress, and vLLM's load/unload semantics. Adapters here are
written by hand in PEFT's format (a config and a safetensors file of zeros) on a tiny model's
shape; the served ones (tests/serve/test_lora_serving.py) are real PEFT adapters."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from common.errors import InvalidRequestError
from common.lora import LoRARequest
from deployments.lora_registry import (
    LoadLoraAdapterRequest,
    LoraRegistry,
    LoraSettings,
    UnloadLoraAdapterRequest,
    check_lora_settings,
    parse_lora_modules,
)
from deployments.protocol import ApiError

BASE = "tiny"
MODEL = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
}


class _Config:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


MODEL_NS = _Config(MODEL)  # what the builder passes: a config with attributes (transformers')


def write_adapter(path: Path, rank: int = 2, **config: Any) -> Path:
    """q_proj and v_proj of both layers, in PEFT's key names; `config` overrides the JSON."""
    path.mkdir(parents=True)
    head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    outs = {
        "q_proj": MODEL["num_attention_heads"] * head_dim,
        "v_proj": MODEL["num_key_value_heads"] * head_dim,
    }
    header, offset = {}, 0
    for layer in range(MODEL["num_hidden_layers"]):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for which, shape in (("A", [rank, MODEL["hidden_size"]]), ("B", [out, rank])):
                size = 4 * shape[0] * shape[1]
                header[f"{prefix}.lora_{which}.weight"] = {
                    "dtype": "F32",
                    "shape": shape,
                    "data_offsets": [offset, offset + size],
                }
                offset += size
    blob = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs)}
    (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return path


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    root.mkdir()
    return {
        "a": write_adapter(tmp_path / "a"),
        "b": write_adapter(root / "b", rank=4),
        "root": root,
        "c": write_adapter(tmp_path / "c"),
        "wide": write_adapter(tmp_path / "wide", rank=32),
        "unknown_module": write_adapter(tmp_path / "unknown", target_modules=["q_proj", "lm_head"]),
    }


def registry(adapters: dict[str, Path], runtime_updating: bool = True) -> LoraRegistry:
    settings = LoraSettings((("a", str(adapters["a"])),), str(adapters["root"]), 16, runtime_updating)
    return LoraRegistry(BASE, MODEL, settings)


def api_error(call: Any, *args: Any) -> dict[str, Any]:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return {"status": caught.value.status, **caught.value.body["error"]}


def test_model_names_resolve_to_the_base_or_an_adapter(adapters: dict[str, Path]):
    lora = registry(adapters)
    assert lora.resolve(None) is None and lora.resolve(BASE) is None
    a = LoRARequest("a", str(adapters["a"]))
    assert lora.resolve("a") == a and lora.resolve(f"{BASE}:a") == a  # vLLM's and Ray Serve LLM's forms
    assert lora.resolve("b") == LoRARequest("b", str(adapters["root"] / "b"))  # found under lora_root
    for unknown in ("nope", f"{BASE}:nope", "other:a", f"{BASE}:", f"{BASE}:../a", "../root/b", "a/b"):
        error = api_error(lora.resolve, unknown)
        assert (error["status"], error["code"], error["param"]) == (404, "model_not_found", "model"), unknown


def test_an_alias_names_the_base_model_and_is_not_listed(adapters: dict[str, Path]):
    settings = LoraSettings((("a", str(adapters["a"])),), None, 16, False)
    lora = LoraRegistry(BASE, MODEL, settings, aliases=("org/base",))
    assert lora.knows("org/base") and lora.resolve("org/base") is None
    assert [card["id"] for card in lora.cards(0)] == ["a"]
    assert api_error(lora.resolve, "org/other")["code"] == "model_not_found"


def test_a_bad_adapter_is_a_400_naming_model_before_any_replica(adapters: dict[str, Path]):
    write_adapter(adapters["root"] / "wide", rank=32)
    with pytest.raises(InvalidRequestError) as caught:
        registry(adapters).resolve("wide")
    assert caught.value.param == "model" and caught.value.code == "invalid_lora_adapter"
    assert "max_lora_rank 16" in caught.value.message


def test_a_changed_adapter_is_checked_again(adapters: dict[str, Path]):
    lora = registry(adapters)
    lora.resolve("b")  # checked, remembered by its files' stat
    config = adapters["b"] / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    with pytest.raises(InvalidRequestError, match="use_dora"):
        lora.resolve("b")


def test_load_then_unload_as_vllm(adapters: dict[str, Path]):
    lora = registry(adapters)
    message = lora.load(LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["c"])))
    assert message == "Success: LoRA adapter 'c' added successfully."
    assert lora.resolve(f"{BASE}:c") == LoRARequest("c", str(adapters["c"]))
    again = api_error(lora.load, LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["a"])))
    assert again["status"] == 400 and "already been loaded" in again["message"]
    lora.load(LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["a"]), load_inplace=True))
    assert lora.resolve("c") == LoRARequest("c", str(adapters["a"]))
    assert lora.unload(UnloadLoraAdapterRequest(lora_name="c")).startswith("Success")
    assert api_error(lora.resolve, "c")["code"] == "model_not_found"
    gone = api_error(lora.unload, UnloadLoraAdapterRequest(lora_name="c"))
    assert gone["status"] == 404 and gone["param"] == "lora_name"
    assert lora.unload(UnloadLoraAdapterRequest(lora_name="a")).startswith("Success")  # a listed one too
    under_root = api_error(lora.unload, UnloadLoraAdapterRequest(lora_name="b"))
    assert under_root["status"] == 400 and "lora_root" in under_root["message"]


@pytest.mark.parametrize(
    ("name", "path", "param", "words"),
    [
        ("w", "wide", "lora_path", "max_lora_rank"),
        ("u", "unknown_module", "lora_path", "lm_head"),
        ("m", "missing", "lora_path", "no adapter_config.json"),
        ("x", "relative", "lora_path", "absolute"),
        ("a/b", "c", "lora_name", "adapter name"),
        (BASE, "c", "lora_name", "served model"),
    ],
)
def test_a_bad_load_is_a_400_and_loads_nothing(
    adapters: dict[str, Path], name: str, path: str, param: str, words: str
):
    lora = registry(adapters)
    lora_path = {"relative": "c", "missing": str(adapters["root"] / "missing")}.get(path) or str(
        adapters[path]
    )
    with pytest.raises((ApiError, InvalidRequestError)) as caught:
        lora.load(LoadLoraAdapterRequest(lora_name=name, lora_path=lora_path))
    error = caught.value
    if isinstance(error, ApiError):
        assert error.status == 400 and error.body["error"]["param"] == param
    else:
        assert error.param == param
    assert words in str(error)
    assert all(card["id"] != name for card in lora.cards(0))


def test_runtime_updating_off_refuses_both_endpoints(adapters: dict[str, Path]):
    lora = registry(adapters, runtime_updating=False)
    for call, body in (
        (lora.load, LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["c"]))),
        (lora.unload, UnloadLoraAdapterRequest(lora_name="a")),
    ):
        error = api_error(call, body)
        assert error["status"] == 404 and "allow_runtime_lora_updating" in error["message"]
    assert lora.resolve("a") is not None


def test_cards_list_every_adapter_with_its_parent(adapters: dict[str, Path]):
    (adapters["root"] / "not-an-adapter").mkdir()
    lora = registry(adapters)
    lora.load(LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["c"])))
    cards = {card["id"]: card for card in lora.cards(7)}
    assert set(cards) == {"a", "b", "c"}
    assert cards["b"]["root"] == str(adapters["root"] / "b")
    assert all(card["parent"] == BASE and card["created"] == 7 for card in cards.values())


def test_lora_modules_in_vllms_shapes(tmp_path: Path):
    expected = {"a": "/x/a", "b": "/y"}
    assert parse_lora_modules({"a": "/x/a", "b": "/y"}) == expected
    assert parse_lora_modules(["a=/x/a", "b=/y"]) == expected
    assert parse_lora_modules([{"name": "a", "path": "/x/a"}, {"name": "b", "path": "/y"}]) == expected
    for bad, words in (
        (["a"], "name=path"),
        (["a/b=/x"], "adapter name"),
        (["a=/x", "a=/y"], "twice"),
        ("a=/x", "mapping"),
    ):
        with pytest.raises(InvalidRequestError, match=words) as caught:
            parse_lora_modules(bad)
        assert caught.value.param == "lora_modules"


def test_deploy_time_checks_name_the_setting(adapters: dict[str, Path], tmp_path: Path):
    good = LoraSettings((("a", str(adapters["a"])),), str(adapters["root"]))
    check_lora_settings(good, MODEL_NS, BASE)
    for settings, param, words in (
        (LoraSettings((("w", str(adapters["wide"])),)), "lora_modules", "'w'"),
        (LoraSettings(((BASE, str(adapters["a"])),)), "lora_modules", "own name"),
        (LoraSettings(root=str(tmp_path / "nowhere")), "lora_root", "not a directory"),
    ):
        with pytest.raises(InvalidRequestError, match=words) as caught:
            check_lora_settings(settings, MODEL_NS, BASE)
        assert caught.value.param == param
