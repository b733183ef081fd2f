"""Tensor storage held on a rank, measured: the CPU allocator's allocations and frees, as torch's profiler records
them, replayed in order (``held_storage_peak``). Left out: what a collective allocates (gloo copies a reduce-scatter's
input and works in threads of its own; NCCL does neither) and what the code in ``left_out`` allocates (on the CPU
AdamW is not fused and the grad-norm upcasts a copy of each gradient: temporaries of the update, which a GPU does
not hold). The peak is taken within ``passes`` only: the forward and backward passes, where the memory planner
puts a GPU's."""

from __future__ import annotations

from contextlib import contextmanager

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

PASSES, LEFT_OUT = "passes", "left out"


def left_out(function):
    """``function``, its allocations left out of the measured storage."""
    def measured_without(*args, **kwargs):
        with record_function(LEFT_OUT):
            return function(*args, **kwargs)
    return measured_without


@contextmanager
def passes():
    """The code within which the peak is taken (e.g. training steps with their update ``left_out``)."""
    with record_function(PASSES):
        yield


@contextmanager
def held_storage_peak():
    """Record the block's allocations; once it ends, the yielded list holds the peak bytes held within ``passes``
    (counted from the block's start: what was allocated before it is not counted)."""
    peak: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        yield peak
    peak.append(_replayed_peak(recorded.profiler.kineto_results.experimental_event_tree()))


def _replayed_peak(roots) -> int:
    main = next(root.start_tid for root in roots if root.name == PASSES)
    events = []  # (time, bytes (negative: freed), address, within the passes, the collective's or a foreign thread's)

    def walk(node, within: bool, foreign: bool) -> None:
        foreign = foreign or node.start_tid != main or node.name.startswith("c10d::")
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr, within, foreign))
            return
        within = (within or node.name == PASSES) and node.name != LEFT_OUT
        for child in node.children:
            walk(child, within, foreign)

    for root in roots:
        walk(root, False, False)
    live: dict[int, int] = {}
    foreign_addresses: set[int] = set()
    held = peak = 0
    for _, size, address, within, foreign in sorted(events, key=lambda event: event[0]):
        if size > 0 and foreign:
            foreign_addresses.add(address)
        elif size > 0:
            live[address] = size
            held += size
        elif address in foreign_addresses:
            foreign_addresses.discard(address)
        else:
            held -= live.pop(address, 0)
        if within:
            peak = max(peak, held)
    return peak
