"""The fleet: the KV-pressure request router and the KV-pressure autoscaling policy."""
