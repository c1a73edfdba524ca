"""The thread governor (engine/thread_governor.py): the cores other processes leave, sampled on a
fake clock and fake CPU counters."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from blockserve import LLM
from blockserve.engine.thread_governor import ThreadGovernor, machine_busy_seconds, usable_cpus
from blockserve.models.random_checkpoint import save_random_model


class Machine:
    """A 4-core machine: each `run(seconds, others)` advances the clock, this process busy on one
    core and the other processes on `others` cores."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.readable = True

    def run(self, seconds: float, others: float) -> None:
        self.now += seconds
        self.own += seconds
        self.busy += seconds * (1 + others)

    def idle(self, seconds: float, others: float) -> None:
        """This process waits (no steps, no CPU) while the others keep `others` cores busy."""
        self.now += seconds
        self.busy += seconds * others

    def governor(self, max_threads: int, set_to: list[int]) -> ThreadGovernor:
        return ThreadGovernor(max_threads, set_to.append, interval=0.9, cores=4, clock=lambda: self.now,
                              machine_busy=lambda: self.busy if self.readable else None, own_busy=lambda: self.own)


def test_threads_follow_the_cores_the_others_leave():
    machine, set_to = Machine(), []
    governor = machine.governor(4, set_to)
    machine.run(0.5, others=3.0)
    assert governor.tick() is None  # within the interval (0.9 s): no sample yet
    machine.run(0.5, others=3.0)
    assert governor.tick() == 1 and governor.threads == 1  # 3 busy cores of 4
    for others, want in ((2.2, 2), (0.8, 3), (0.4, 4), (0.0, None)):
        machine.run(1.0, others)
        assert governor.tick() == want
    assert set_to == [1, 2, 3, 4]


def test_less_than_half_a_core_of_others_takes_no_thread():
    machine, set_to = Machine(), []
    governor = machine.governor(4, set_to)
    for others, want in ((0.45, None), (0.55, 3), (0.45, 4)):  # e.g. a benchmark client beside the engine
        machine.run(1.0, others)
        assert governor.tick() == want


def test_a_burst_while_the_engine_sat_idle_takes_no_thread():
    """A client starting up beside an idle server (1.5 cores for 3 s), then its requests: the first
    sample spans the idle spell and is skipped; load that lasts into the steps counts one sample later."""
    machine, set_to = Machine(), []
    governor = machine.governor(4, set_to)
    machine.idle(3.0, others=1.5)
    machine.run(0.2, others=0.0)
    assert governor.tick() is None and set_to == []
    machine.run(1.0, others=0.0)
    assert governor.tick() is None and governor.threads == 4
    machine.idle(3.0, others=0.0)
    machine.run(1.0, others=3.0)  # busy neighbours while the engine steps: the sample after the pause
    assert governor.tick() is None  # spans it and is skipped; the next one counts them
    machine.run(1.0, others=3.0)
    assert governor.tick() == 1


def test_the_count_never_leaves_one_to_max_threads():
    machine, set_to = Machine(), []
    governor = machine.governor(2, set_to)
    machine.run(1.0, others=0.0)
    assert governor.tick() is None and governor.threads == 2  # 4 free cores, but at most 2
    machine.run(1.0, others=8.0)  # more than the machine: still one thread
    assert governor.tick() == 1 and set_to == [1]


def test_unreadable_counters_and_one_thread_change_nothing():
    machine, set_to = Machine(), []
    governor = machine.governor(4, set_to)
    machine.readable = False
    machine.run(2.0, others=3.0)
    assert governor.tick() is None and set_to == []
    one = machine.governor(1, set_to)
    machine.readable = True
    machine.run(2.0, others=3.0)
    assert one.tick() is None and set_to == []
    with pytest.raises(ValueError, match="max_threads must be at least 1"):
        machine.governor(0, set_to)


def test_only_the_cpus_this_process_may_use_count():
    """In a container's cpuset (or under taskset) the host's other CPUs take no core from the engine."""
    if machine_busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    assert machine_busy_seconds(frozenset()) == 0
    cpus = sorted(usable_cpus())
    first = machine_busy_seconds(frozenset(cpus[:1]))
    mine = machine_busy_seconds()
    every = machine_busy_seconds(frozenset(range(1024)))
    assert 0 < first <= mine <= every  # counters only grow, and each set holds the one before
    assert ThreadGovernor(2, lambda n: None).cores == len(cpus)


def test_the_engine_has_one_on_the_cpu_unless_switched_off(tmp_path):
    assert machine_busy_seconds() is None or machine_busy_seconds() > 0
    save_random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1), tmp_path)
    governor = LLM(str(tmp_path), num_threads=1).engine.core.thread_governor
    assert governor is not None and governor.max_threads == 1
    assert LLM(str(tmp_path), adaptive_threads=False).engine.core.thread_governor is None
