"""The GPU path on a lent device (rehearsed on this CPU with --dry-run)."""
