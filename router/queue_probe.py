"""How long Serve waits for a replica to answer a queue-length probe, for our request routers.

Serve probes a replica when its cached queue length is over 10 s old, and a replica that does not
answer in time is skipped for the next rank. Serve's 0.1 s is missed by a replica whose event
loop shares a loaded host's cores with other work (a CPU replica's model step, a busy CI runner):
the request then went past the replica holding its prefix or adapter, or to another node's
Ingress. A dead replica is still found at once (ActorDiedError). Serve's variable still rules."""

from __future__ import annotations

import os

QUEUE_LEN_RESPONSE_DEADLINE_S = float(os.environ.get("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", 1.0))
