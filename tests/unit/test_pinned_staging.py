"""PinnedStaging (the CUDA launcher's host-to-device copies) over a recording stand-in for CuPy: every step
array goes through pinned memory, and a slot is rewritten only after the copy that read it is done."""

import numpy as np

from minisarathi.backends import pinned_staging
from minisarathi.backends.pinned_staging import PinnedStaging


class Recorder:
    def __init__(self):
        self.log = []
        self.pinned = []  # the "pinned" buffers handed out


class FakeCupy:
    """cupy.cuda's pinned allocations and events, and device arrays whose set() records its source."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.cuda = self

    def alloc_pinned_memory(self, nbytes):
        self.recorder.log.append(("alloc", nbytes))
        self.recorder.pinned.append(bytearray(nbytes))
        return self.recorder.pinned[-1]

    def Event(self, disable_timing):
        recorder = self.recorder

        class Event:
            def record(self):
                recorder.log.append(("record", id(self)))

            def synchronize(self):
                recorder.log.append(("wait", id(self)))

        return Event()


class DeviceArray:
    def __init__(self, recorder, shape, dtype):
        self.recorder, self.value = recorder, np.zeros(shape, dtype)

    def set(self, host):
        pinned = any(np.shares_memory(host, np.frombuffer(b, np.uint8)) for b in self.recorder.pinned)
        self.recorder.log.append(("set", pinned))
        self.value[...] = host  # what the device gets (at once, here)


def test_copies_go_through_pinned_slots_reused_after_their_event():
    recorder = Recorder()
    staging = PinnedStaging(FakeCupy(recorder), slots=2)
    arrays = [np.arange(5, dtype=np.int32) + i for i in range(3)]
    devices = [DeviceArray(recorder, (5,), np.int32) for _ in arrays]
    for device, array in zip(devices, arrays):
        staging.copy(device, array)
        array[...] = -1  # the host may reuse its array as soon as copy() returns
    for i, device in enumerate(devices):
        np.testing.assert_array_equal(device.value, np.arange(5) + i)
    kinds = [entry[0] for entry in recorder.log]
    assert kinds == ["alloc", "set", "record", "alloc", "set", "record", "wait", "set", "record"]
    assert all(entry[1] for entry in recorder.log if entry[0] == "set")  # every source was pinned
    # the third copy reused slot 0: it waited for the event recorded behind the first copy
    assert recorder.log[6][1] == recorder.log[2][1]


def test_a_slot_grows_for_a_larger_array_and_weights_are_not_staged():
    recorder = Recorder()
    staging = PinnedStaging(FakeCupy(recorder), slots=1)
    staging.copy(DeviceArray(recorder, (4,), np.int32), np.ones(4, np.int32))
    big = np.ones(pinned_staging.MIN_SLOT_BYTES, np.int32)  # 4x the first slot
    device = DeviceArray(recorder, big.shape, np.int32)
    staging.copy(device, big)
    assert [e for e in recorder.log if e[0] == "alloc"] == [
        ("alloc", pinned_staging.MIN_SLOT_BYTES),
        ("alloc", big.nbytes),
    ]
    np.testing.assert_array_equal(device.value, big)
    recorder.log.clear()
    weight = np.ones(pinned_staging.LARGEST_STAGED // 4 + 1, np.float32)
    staging.copy(DeviceArray(recorder, weight.shape, np.float32), weight)
    assert recorder.log == [("set", False)]  # straight from the array: one copy at load time


def test_an_empty_array_copies_nothing():
    recorder = Recorder()
    staging = PinnedStaging(FakeCupy(recorder), slots=2)
    staging.copy(
        DeviceArray(recorder, (0, 4), np.int32), np.zeros((0, 4), np.int32)
    )  # e.g. a plan with no split rows
    assert recorder.log == []
