"""Full collections while serving walk only what serving made: the heap alive before is frozen (utils.heap_frozen)."""

import gc
import weakref

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.utils import heap_frozen


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A garbage reference cycle, which only the cyclic collector frees; returns a weak reference to watch it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def collectable(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def nothing_frozen_around(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_GC_FREEZE", raising=False)
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_what_lives_before_is_frozen_and_what_the_block_makes_is_still_collected():
    before = Node()
    with heap_frozen(collect_first=False):
        assert gc.get_freeze_count() > 0
        assert not collectable(before)  # in no generation the collector walks
        made_inside = cycle()
        gc.collect()
        assert made_inside() is None
    assert gc.get_freeze_count() == 0
    assert collectable(before)


def test_collect_first_frees_the_garbage_before_freezing_it():
    gc.disable()  # no automatic collection between making the garbage and the block
    try:
        left = cycle()
        with heap_frozen(collect_first=True):
            assert left() is None
        kept = cycle()
        with heap_frozen(collect_first=False):
            gc.collect()
            assert kept() is not None  # frozen with the rest: it waits for the block's end
        gc.collect()
        assert kept() is None
    finally:
        gc.enable()


def test_a_freeze_made_elsewhere_is_left_as_it_is():
    # Asserted on objects, not on gc.get_freeze_count(): a frozen object freed meanwhile (by another thread of the
    # test process) leaves the permanent generation, so the count may fall while nothing is frozen or unfrozen.
    frozen_before = Node()
    gc.freeze()  # the caller's own, or an enclosing block's
    made_after = Node()
    with heap_frozen(collect_first=True):
        assert collectable(made_after)  # nothing frozen again
        assert not collectable(frozen_before)
    assert not collectable(frozen_before)  # and the caller's freeze stands after the block
    assert collectable(made_after)


def test_the_switch_leaves_the_collector_as_python_sets_it(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_GC_FREEZE", "0")
    with heap_frozen(collect_first=True):
        assert gc.get_freeze_count() == 0


def test_generate_steps_with_the_heap_frozen_and_leaves_it_unfrozen(tiny_llama, monkeypatch):
    frozen_during_steps = []
    step = LLMEngine.step

    def watched(self):
        frozen_during_steps.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", watched)
    with LLM(str(tiny_llama)) as llm:
        prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 30))}]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert frozen_during_steps and min(frozen_during_steps) > 0
    assert gc.get_freeze_count() == 0
