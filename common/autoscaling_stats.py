"""What a replica reports to Serve's autoscaler (EngineReplica.record_autoscaling_stats) and the
KV-pressure policy reads back (router.autoscaling): here so the replica needs no router. Serve
averages each over its look-back window, per replica."""

from __future__ import annotations

from dataclasses import dataclass

KV_USAGE = "kv_cache_usage"  # 0-1, the share of the replica's KV blocks held
WAITING = "num_waiting"  # requests queued in the replica's scheduler
# Rates since the replica's previous report:
ARRIVALS = "arrivals_per_s"  # requests added to its engine
FINISHED = "finished_per_s"  # requests its engine finished
WORK = "step_work_fraction"  # seconds of step work (EngineStats.step_work_s) per second


@dataclass
class LoadMeter:
    """A replica's running totals (EngineStats) turned into rates over the time since the
    previous call; nothing on the first."""

    _last: tuple[float, int, int, float] | None = None

    def rates(self, now: float, num_added: int, num_finished: int, work_s: float) -> dict[str, float]:
        last, self._last = self._last, (now, num_added, num_finished, work_s)
        if last is None or now <= last[0]:
            return {}
        elapsed = now - last[0]
        return {
            ARRIVALS: (num_added - last[1]) / elapsed,
            FINISHED: (num_finished - last[2]) / elapsed,
            WORK: (work_s - last[3]) / elapsed,
        }
