"""The names of what a replica reports to Serve's autoscaler (EngineReplica.record_autoscaling_stats)
and the KV-pressure policy reads back (router.autoscaling): here so the replica needs no router."""

KV_USAGE = "kv_cache_usage"  # 0-1, the share of the replica's KV blocks held
WAITING = "num_waiting"  # requests queued in the replica's scheduler
