"""Convert a GGUF file to a float32 Hugging Face directory (config, safetensors, tokenizer).

Run as `python -m replica_engine.models.gguf_convert <file.gguf> <target dir>`:
common.model_source.convert_gguf starts it in a child process and caches the result, because
transformers' converter takes ~20 s and a cached directory loads in under a second."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from replica_engine.models.gguf_file import read_metadata


def expert_widths(gguf_path: Path) -> dict[str, int]:
    """A mixture's expert widths, which transformers' GGUF loader does not read (it would size the
    experts by its config's defaults): as config fields, where the file has them."""
    values = read_metadata(gguf_path)  # gguf-py's reader: 3.6 s for the tokenizer's arrays alone
    architecture = values["general.architecture"]
    fields = {
        "moe_intermediate_size": f"{architecture}.expert_feed_forward_length",
        "shared_expert_intermediate_size": f"{architecture}.expert_shared_feed_forward_length",
    }
    return {ours: int(values[key]) for ours, key in fields.items() if key in values}


def convert(gguf_path: Path, target: Path) -> None:
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    widths = expert_widths(gguf_path)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, **widths)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent processes never see half a directory.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        config = hf_model.config
        del config.quantization_config  # weights are dequantized now; the marker blocks reloading
        config.save_pretrained(staging)
        hf_model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k not in tied}
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
