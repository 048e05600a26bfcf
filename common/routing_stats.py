"""The one message a replica sends its routers every ~0.5 s: what its KV pool holds and owes, and
what its steps cost (the kv_prefix router predicts each replica's time to first token from it).

Built by the replica (EngineReplica.record_routing_stats), carried by Serve's controller as a
plain dict (bytes, ints and a list of adapter names: the controller never imports this package),
and parsed back by every router with `RoutingStats.from_report`. A report that is not a whole
message raises MalformedRoutingStats naming the field: a renamed or mistyped key must be seen (the
routers log and count it), not read as "no stats yet", which would silently send every request by
queue length."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common.block_hash import BlockHash
from common.block_summary import BlockSummary

# The Bloom filter travels as its parts (a BlockSummary instance would need this package to unpickle).
_SUMMARY_BITS = "block_summary_bits"
_SUMMARY_PROBES = "block_summary_probes"
_HASH_ROOT = "block_hash_root"
_LORA_ADAPTERS = "lora_adapters"
_STEP_TIME = "step_time_coefficients"

# A summary sized for the whole pool, up to this many keys (39 KiB at 1%); a larger pool's full
# cache raises the false-positive rate instead (common/block_summary.py gives the formula).
MAX_SUMMARY_KEYS = 32768
SUMMARY_FALSE_POSITIVE_RATE = 0.01


class MalformedRoutingStats(ValueError):
    """A replica's report that is not a RoutingStats: the message names the field."""


@dataclass(frozen=True)
class RoutingStats:
    num_total_blocks: int
    num_free_blocks: int  # cached but unheld blocks count as free (evictable)
    num_cached_free_blocks: int  # of the free blocks, those still holding a prefix-cache key
    # prompt tokens still to compute and to hold: waiting requests' (net of the prefix each will find
    # cached) and running requests' not yet prefilled (chunked prefill allocates chunk by chunk)
    num_pending_prompt_tokens: int
    num_waiting: int
    num_running: int
    block_size: int
    report_seq: int  # counts the replica's reports: a new number is a new report
    block_summary: BlockSummary  # every block key the pool holds
    hash_root: BlockHash  # the chain root (model, no salt) the keys start from
    # names of the LoRA adapters the replica holds loaded (its host LRU), least recent first
    lora_adapters: tuple[str, ...] = ()
    max_num_batched_tokens: int = 256  # the step's token budget: decodes first, then prompt chunks
    # generate and embed calls the replica is serving: what Serve's max_ongoing_requests counts (a
    # request of n choices is one call, n engine requests)
    num_ongoing_requests: int = 0
    num_running_context_tokens: int = 0  # tokens the running requests attend to (decode attention)
    # The replica's step-time model (replica_engine/scheduler/step_time_model.py: c0, c_prefill,
    # c_decode, c_prompt_attention, c_decode_attention, c_request, in seconds); empty: none learned.
    step_time_coefficients: tuple[float, ...] = ()

    def used_blocks(self) -> float:
        """Blocks held, plus the blocks its pending prompts will need."""
        pending_blocks = math.ceil(self.num_pending_prompt_tokens / self.block_size)
        return self.num_total_blocks - self.num_free_blocks + pending_blocks

    def to_report(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _COUNT_FIELDS},
            _SUMMARY_BITS: self.block_summary.bits,
            _SUMMARY_PROBES: self.block_summary.num_probes,
            _HASH_ROOT: self.hash_root,
            _LORA_ADAPTERS: list(self.lora_adapters),
            _STEP_TIME: list(self.step_time_coefficients),
        }

    @classmethod
    def from_report(cls, report: Mapping[str, Any] | None) -> RoutingStats | None:
        """None when the replica has not reported yet (Serve holds an empty dict until then)."""
        if report is None or (isinstance(report, Mapping) and not report):
            return None
        if not isinstance(report, Mapping):
            raise MalformedRoutingStats(f"routing stats must be a mapping, got {type(report).__name__}")
        counts = {name: _count(report, name, minimum=int(name in _POSITIVE)) for name in _COUNT_FIELDS}
        bits = _field(report, _SUMMARY_BITS, bytes)
        if not bits:
            raise MalformedRoutingStats(f"routing stats field {_SUMMARY_BITS!r} is empty")
        probes = _count(report, _SUMMARY_PROBES, minimum=1)
        summary = BlockSummary(len(bits) * 8, probes, bits)
        return cls(
            **counts,
            block_summary=summary,
            hash_root=_field(report, _HASH_ROOT, bytes),
            lora_adapters=_names(report, _LORA_ADAPTERS),
            step_time_coefficients=_coefficients(report, _STEP_TIME),
        )


_COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(RoutingStats) if f.type in ("int", int))
_POSITIVE = ("block_size", "max_num_batched_tokens")
NUM_STEP_TIME_COEFFICIENTS = 6


def _field(report: Mapping[str, Any], name: str, kind: type) -> Any:
    if name not in report:
        raise MalformedRoutingStats(f"routing stats lack field {name!r}")
    value = report[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MalformedRoutingStats(
            f"routing stats field {name!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _count(report: Mapping[str, Any], name: str, minimum: int) -> int:
    value = _field(report, name, int)
    if value < minimum:
        raise MalformedRoutingStats(f"routing stats field {name!r} must be >= {minimum}, got {value}")
    return value


def _names(report: Mapping[str, Any], name: str) -> tuple[str, ...]:
    values = _field(report, name, list)
    if not all(isinstance(value, str) and value for value in values):
        raise MalformedRoutingStats(f"routing stats field {name!r} must hold names, got {values!r}")
    return tuple(values)


def _coefficients(report: Mapping[str, Any], name: str) -> tuple[float, ...]:
    values = _field(report, name, list)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if values and not (
        numbers
        and len(values) == NUM_STEP_TIME_COEFFICIENTS
        and all(math.isfinite(v) and v >= 0 for v in values)
    ):
        raise MalformedRoutingStats(
            f"routing stats field {name!r} must be empty or {NUM_STEP_TIME_COEFFICIENTS} non-negative "
            f"seconds, got {values!r}"
        )
    return tuple(float(v) for v in values)


class PoolStats(Protocol):
    """What a replica's report is made from (the engine's EngineStats; the simulator's replica)."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_pending_prompt_tokens: int
    num_waiting: int
    num_running: int
    cached_block_hashes: tuple[bytes, ...]
    lora_adapters: tuple[str, ...]
    num_running_context_tokens: int
    step_time_coefficients: tuple[float, ...]


class RoutingReporter:
    """A replica's side of the message: numbers its reports (routers date a report by when they
    first see its number) and rebuilds the Bloom filter only when the pool's keys changed."""

    def __init__(self, block_size: int, hash_root: BlockHash, max_num_batched_tokens: int) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.hash_root = hash_root  # routers hash prompts from the root every unsalted chain starts at
        self._next_seq = 0
        self._summary: tuple[tuple[bytes, ...], BlockSummary] | None = None  # (of these keys, summary)

    def report(self, stats: PoolStats, num_ongoing_requests: int) -> RoutingStats:
        self._next_seq += 1
        return RoutingStats(
            num_total_blocks=stats.num_total_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_cached_free_blocks=stats.num_cached_free_blocks,
            num_pending_prompt_tokens=stats.num_pending_prompt_tokens,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            block_size=self.block_size,
            report_seq=self._next_seq,
            block_summary=self._block_summary(stats),
            hash_root=self.hash_root,
            lora_adapters=tuple(stats.lora_adapters),
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_ongoing_requests=num_ongoing_requests,
            num_running_context_tokens=stats.num_running_context_tokens,
            step_time_coefficients=tuple(stats.step_time_coefficients),
        )

    def _block_summary(self, stats: PoolStats) -> BlockSummary:
        keys = stats.cached_block_hashes
        if self._summary is None or self._summary[0] is not keys:
            capacity = min(stats.num_total_blocks, MAX_SUMMARY_KEYS)
            self._summary = keys, BlockSummary.of(keys, capacity, SUMMARY_FALSE_POSITIVE_RATE)
        return self._summary[1]
