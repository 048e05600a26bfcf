"""The engine's startup heap is out of the garbage collector's walk, and still freed when dropped."""

from __future__ import annotations

import gc
import weakref

from replica_engine import LLM, SamplingParams


def test_a_built_engine_is_out_of_the_collectors_walk_and_freed_once_dropped():
    llm = LLM(model="dummy:tiny-llama")
    weights = next(llm.engine.core.runner.model.parameters())
    walked = {id(o) for o in gc.get_objects()}  # what a full collection would traverse
    assert id(llm.engine.core) not in walked and id(llm.engine.core.scheduler) not in walked
    assert llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids

    engine, weights_ref = weakref.ref(llm.engine), weakref.ref(weights)
    del llm, weights
    gc.collect()
    assert engine() is None and weights_ref() is None  # frozen is not kept: nothing refers to them
