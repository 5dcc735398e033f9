"""bench/op_calls.py counts what it says: NumPy buffer allocations, and operations split by layer and op."""
import numpy as np

from bench.op_calls import AllocationCounter, count_steps


def test_allocations_are_counted_only_for_new_buffers_and_only_while_installed():
    seen = []
    counter = AllocationCounter(lambda: seen.append(1))
    a = np.arange(12.0)
    with counter:
        b = np.empty((3, 4))               # a buffer
        c = a.reshape(3, 4)[:, ::2]        # views: none
        d = c.copy()                       # a buffer
        b[:, :2] = d                       # in place: none
        b[:, 2:] = c                       # in place: none
        f = b + 1.5                        # a buffer, and a 0-d one for the Python scalar
    e = np.empty(5)                        # uninstalled: not counted
    assert len(seen) == 4
    assert f.sum() == 2 * a[::2].sum() + 18 and e.shape == (5,)


def test_step_counts_add_up_per_layer_and_op():
    """The bundled model (5 layers): a section's total is its ops' sum, a step's is the sections' sum, and the
    later layers, which share the first layer's per-batch work, make fewer calls than the first."""
    rows = count_steps(None)
    assert [r["step"] for r in rows] == ["hybrid", "decode"]
    for row in rows:
        assert row["layers"] == 5
        for what in ("operations", "allocations"):
            s = row[what]
            assert s["first layer"] == sum(s["first layer by op"].values())
            assert abs(s["later layer"] - sum(s["later layer by op"].values())) < 1
            assert abs(s["step"] - (s["engine"] + s["outside layers"] + s["first layer"] + 4 * s["later layer"])) < 1
        ops = row["operations"]
        assert 0 < ops["later layer"] < ops["first layer"]
        assert {"paged_attention", "rope_store_kv", "silu_and_mul"} <= set(ops["later layer by op"])
        assert ops["engine"] > 0 and row["allocations"]["later layer"] > 0
