"""The slot reaches the scheduler through `SlotHost` only: `Scheduler` implements every
member with the same parameters, and the slot touches nothing else of it."""

import inspect
import re

from scheduler import slot as slot_module
from scheduler.core import Scheduler
from scheduler.slot import SlotHost


def test_the_scheduler_implements_every_slot_host_method():
    for name, member in inspect.getmembers(SlotHost, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(Scheduler, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(member).parameters), name


def test_the_slot_calls_only_slot_host_members():
    declared = {name for name, _ in inspect.getmembers(SlotHost, inspect.isfunction) if not name.startswith("_")}
    called = set(re.findall(r"self\.host\.([a-z_]+)", inspect.getsource(slot_module)))
    assert called and called <= declared
