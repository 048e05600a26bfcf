"""LoRA adapters in the simulated fleet: a replica's adapter loads (charged to the step that
needs one not held) and its reports, and routing by adapter against load alone."""

from __future__ import annotations

import random

from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import summarize_records
from fleet_sim.replica import ReplicaConfig, SimAdapters
from fleet_sim.routers import Ranked, SimRouter, make_router
from fleet_sim.trace import SimRequest
from replica_engine.scheduler.step_time_model import StepTimeModel
from router.ranking import PrefixRanking, PressureRanking

# About SmolLM2 on this machine's CPU (as tests/sim/test_fleet.py): 12 ms a step.
STEP_TIME = StepTimeModel.from_coefficients([0.012, 0.0005, 0.00025, 1e-8, 1e-8, 0.0])
LOAD_S = 0.2
# Two adapters run at once, two held loaded: a replica cannot hold the workload's eight.
REPLICA = ReplicaConfig(num_kv_blocks=256, max_loras=2, max_cpu_loras=2, lora_load_s=LOAD_S)


def adapters_workload(seed: int, num_adapters: int, num_requests: int, rate: float, base_share: float):
    """Poisson arrivals; each request for the base model (`base_share`) or an adapter of Zipf
    popularity, with its own 32-128 token prompt (no shared prefixes: adapters alone attract)."""
    rng = random.Random(seed)
    names = [f"adapter-{i}" for i in range(num_adapters)]
    weights = [1 / (i + 1) for i in range(num_adapters)]
    requests, now = [], 0.0
    for i in range(num_requests):
        now += rng.expovariate(rate)
        lora = None if rng.random() < base_share else rng.choices(names, weights)[0]
        prompt = tuple(rng.randrange(1, 32000) for _ in range(rng.randrange(32, 128)))
        requests.append(SimRequest(f"r{i}", now, prompt, rng.randrange(8, 32), lora=lora))
    return requests


def serve(router: SimRouter, requests: list[SimRequest]) -> tuple[dict[str, dict[str, int]], dict]:
    fleet = Fleet(FleetConfig(4, REPLICA), STEP_TIME, router)
    records = fleet.run(requests)
    return fleet.adapter_loads(), summarize_records(records)


def test_a_step_that_needs_an_adapter_not_held_takes_its_load_time_once():
    adapters = SimAdapters(max_loras=1, max_cpu_loras=2, load_s=LOAD_S)
    a, b, c = (SimRequest(name, 0.0, (1,), 1, lora=name).lora_request for name in "abc")
    assert adapters.prepare([a, None, a]) == LOAD_S  # one load for the step's rows of one adapter
    assert adapters.prepare([a]) == 0.0
    assert adapters.prepare([b]) == LOAD_S  # b takes a's slot; both held on the host
    assert adapters.prepare([a]) == 0.0  # back into the slot from the host LRU: no load
    assert adapters.prepare([c]) == LOAD_S  # the LRU evicts b (a was used since)
    assert adapters.prepare([b]) == LOAD_S
    assert dict(adapters.loads) == {"a": 1, "b": 2, "c": 1}


def test_a_replica_charges_the_load_to_its_step_and_reports_the_adapter():
    requests = [
        SimRequest("first", 0.0, tuple(range(1, 17)), max_tokens=2, lora="sql"),
        SimRequest("again", 5.0, tuple(range(1, 17)), max_tokens=2, lora="sql"),
        SimRequest("base", 10.0, tuple(range(1, 17)), max_tokens=2),
    ]
    fleet = Fleet(FleetConfig(1, REPLICA), STEP_TIME, make_router("kv_prefix", 0))
    ttft = {record.request.request_id: record.timing().ttft_s for record in fleet.run(requests)}
    assert abs(ttft["first"] - ttft["base"] - LOAD_S) < 1e-9  # the same step's time, plus one load
    assert abs(ttft["again"] - ttft["base"]) < 1e-9  # held: no load
    assert fleet.adapter_loads() == {"sql": {"replica-0": 1}}
    replica = fleet.replicas[0]
    assert replica.reporter.report(replica.stats(), 0).lora_adapters == ("sql",)


def test_routing_by_adapter_loads_each_adapter_on_fewer_replicas_than_load_alone():
    """Eight adapters on four replicas that hold two each: by load alone every adapter is loaded
    everywhere, over and over (each evicts another); by adapter, each settles on about one
    replica, and no step waits for loads, so requests start sooner."""
    requests = adapters_workload(seed=0, num_adapters=8, num_requests=250, rate=20.0, base_share=0.25)
    results = {
        "kv_pressure": serve(make_router("kv_pressure", 0), requests),
        "kv_prefix": serve(make_router("kv_prefix", 0), requests),
        "by load": serve(Ranked(PressureRanking(adapter_policy=None), random.Random(0)), requests),
        "prefix, no adapter": serve(Ranked(PrefixRanking(adapter_policy=None), random.Random(0)), requests),
    }
    figures = {
        name: (
            sum(len(replicas) for replicas in loads.values()) / len(loads),  # replicas per adapter
            sum(sum(replicas.values()) for replicas in loads.values()),  # loads from disk
            summary["ttft_p90_s"],
        )
        for name, (loads, summary) in results.items()
    }
    print(figures)
    for aware, blind in (("kv_pressure", "by load"), ("kv_prefix", "prefix, no adapter")):
        per_replica, loads, ttft_p90 = figures[aware]
        blind_per_replica, blind_loads, blind_ttft_p90 = figures[blind]
        assert per_replica <= 1.5 and blind_per_replica >= 3.5, figures
        assert loads * 5 <= blind_loads, figures
        assert ttft_p90 < blind_ttft_p90, figures


def test_a_hot_adapter_spreads_over_the_replicas_its_load_needs():
    """One adapter at a rate one replica cannot serve: the load guard passes requests on, and
    the replicas they land on load it too."""
    requests = adapters_workload(seed=1, num_adapters=1, num_requests=300, rate=80.0, base_share=0.0)
    loads, _ = serve(make_router("kv_prefix", 0), requests)
    assert len(loads["adapter-0"]) == 4
