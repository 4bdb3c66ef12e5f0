"""A decoding step's thread count, learnt from the steps' times (inference/devices/threads.py): on
two threads while they are faster, on one while other processes hold the cores."""

import pytest
import torch

from tlm.generate import GenerationConfig
from tlm.generate.slots import Slots
from tlm.inference import Decoder
from tlm.inference.devices.threads import Threads, on_threads

pytestmark = pytest.mark.usefixtures("each_thread_count")  # callers at one thread and at two


def run(threads: Threads, seconds: dict[int, float], steps: int, kind=(1, 1)) -> list[int]:
    """The thread counts of `steps` steps whose times are seconds[count]."""
    counts = []
    for _ in range(steps):
        count = threads.count_for(kind)
        counts.append(count)
        threads.took(seconds[count])
    return counts


def test_a_quiet_machine_keeps_its_threads_and_probes_less_and_less():
    threads = Threads(2)
    counts = run(threads, {2: 1.0, 1: 1.5}, 2000)
    assert threads.count == 2
    assert 0 < counts.count(1) < 0.01 * len(counts)  # probed, rarely
    assert counts[5:9] == [1, 1, 2, 2]  # the first probe comes early: the other count, then this


def test_a_loaded_machine_moves_to_one_thread_and_back_when_the_load_goes():
    threads = Threads(2)
    counts = run(threads, {2: 10.0, 1: 2.0}, 20)
    assert threads.count == 1 and counts[-10:] == [1] * 10
    counts = run(threads, {2: 1.0, 1: 1.5}, 70)  # the other processes ended
    assert threads.count == 2 and counts[-3:] == [2] * 3


def test_a_sudden_load_is_probed_at_once():
    threads = Threads(2)
    run(threads, {2: 1.0, 1: 1.5}, 300)  # quiet long enough that probes wait long
    assert threads.wait > 64
    counts = run(threads, {2: 30.0, 1: 2.0}, 7)  # a step three times the recent ones
    assert counts == [2, 1, 1, 2, 2, 1, 1] and threads.count == 1
    once = Threads(2)
    run(once, {2: 1.0, 1: 1.5}, 300)
    once.took(30.0)  # one slow step (another process's moment), then quiet again
    assert run(once, {2: 1.0, 1: 1.5}, 4) == [1, 1, 2, 2] and once.count == 2


def test_a_small_difference_changes_nothing():
    threads = Threads(2)
    run(threads, {2: 1.0, 1: 0.95}, 500)  # one thread 5% faster: within the margin
    assert threads.count == 2


def test_steps_of_another_kind_are_not_compared():
    """A batch that changes size each step is never probed: its times are not a load's."""
    threads = Threads(2)
    for step in range(200):
        assert threads.count_for((1 + step % 2, 1 + step % 2)) == 2
        threads.took(10.0 if step % 2 else 1.0)
    assert threads.trial is None


def test_one_thread_has_nothing_to_choose_and_a_fixed_count_never_probes(make_model):
    threads = Threads(1)
    assert run(threads, {1: 1.0}, 100) == [1] * 100
    model = make_model()
    fixed = Decoder(model, fixed_threads=True).threads
    assert run(fixed, {fixed.most: 10.0, 1: 1.0}, 100) == [fixed.most] * 100
    chosen = Decoder(model).threads
    assert chosen is not fixed and chosen.adapt == (fixed.most > 1)
    on_meta = make_model().to("meta")  # a model off the CPU: its steps' times are not the CPU's
    assert not Decoder(on_meta).threads.adapt


def test_a_step_runs_on_the_chosen_count_and_gives_the_callers_back(make_model):
    """Slots sets torch's threads for a step and restores the caller's setting after it,
    also when the step fails; a decoder keeps its Threads from one Slots to the next, and
    two decoders of one model learn apart."""
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one thread here: nothing to choose")
    model = make_model()
    seen = []
    handle = model.register_forward_hook(lambda m, i, o: seen.append(torch.get_num_threads()))
    slots = Slots(model, 1)
    assert Slots(model, 2, decoder=slots.decoder).decoder.threads is slots.decoder.threads
    assert Slots(model, 1).decoder.threads is not slots.decoder.threads
    slots.decoder.threads.count_for = lambda kind: 1  # a probe, every step
    sequence = slots.add([1, 2, 3], GenerationConfig(max_new_tokens=3))
    while not sequence.done:
        slots.step()
    assert seen and set(seen) == {1} and torch.get_num_threads() == before
    handle.remove()
    model.register_forward_hook(lambda m, i, o: 1 / 0)
    slots.add([4, 5], GenerationConfig(max_new_tokens=3))
    with pytest.raises(ZeroDivisionError):
        slots.step()
    assert torch.get_num_threads() == before


def test_a_decode_sets_the_thread_count_for_its_block_and_gives_it_back():
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2  # a count that differs from the caller's
    with pytest.raises(RuntimeError), on_threads(other):
        assert torch.get_num_threads() == other
        raise RuntimeError("a step that fails")
    assert torch.get_num_threads() == before  # restored however the block ended
