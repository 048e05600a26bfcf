"""The fleet simulator: routers and autoscaling at sizes one machine cannot run, and its validation."""
