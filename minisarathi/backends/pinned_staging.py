"""A step's small host-to-device copies (metadata, attention plans, sampler parameters) staged in pinned host
memory, so that each is a true cudaMemcpyAsync: a copy from pageable memory may synchronize the host with the
device and undo the overlap of one step's host work with the previous step's kernels.

Slots are taken round-robin, and a slot is written again only once the copy that last read it is done (its
event), so a step never overwrites what a step still in flight has yet to copy. A step makes well under half
SLOTS copies, so two steps in flight never wait on each other: double buffering.

    staging = PinnedStaging(cupy)
    staging.copy(device_array, host_array)   # on the current stream, ordered before the launches after it
"""

from __future__ import annotations

import numpy as np

SLOTS = 64
MIN_SLOT_BYTES = 4096
LARGEST_STAGED = 1 << 20  # larger arrays (weights, once) are copied from where they are


class PinnedStaging:
    def __init__(self, cupy, slots: int = SLOTS):
        self.cupy = cupy
        self.memory: list = [None] * slots  # pinned host buffers, grown on demand
        self.capacity = [0] * slots  # their bytes
        self.events: list = [None] * slots  # recorded behind each slot's last copy
        self.next = 0

    def copy(self, device, array: np.ndarray) -> None:
        """device[...] = array, which must match device's shape and dtype; the host array may be reused at
        once."""
        array = np.ascontiguousarray(array)
        if array.nbytes == 0:
            return
        if array.nbytes > LARGEST_STAGED:
            device.set(array)
            return
        slot, self.next = self.next, (self.next + 1) % len(self.memory)
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # the copy that last read this slot is done
        if self.capacity[slot] < array.nbytes:
            self.capacity[slot] = max(MIN_SLOT_BYTES, array.nbytes)
            self.memory[slot] = self.cupy.cuda.alloc_pinned_memory(self.capacity[slot])
            self.events[slot] = self.events[slot] or self.cupy.cuda.Event(disable_timing=True)
        host = np.frombuffer(self.memory[slot], array.dtype, array.size).reshape(array.shape)
        host[...] = array
        device.set(host)  # asynchronous on the current stream: the source is pinned
        self.events[slot].record()
