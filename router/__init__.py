"""The fleet: request routers (kv_prefix, kv_pressure, round_robin) and the KV-pressure autoscaling
policy. Imports no engine code (only common/), as it runs in every Ingress process."""
