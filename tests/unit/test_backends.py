"""Both backends implement the one interface of minisarathi/backends/base.py, and devices resolve to them."""

import pytest

from minisarathi.backends import cuda_ops
from minisarathi.backends.base import interface_names
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.devices import make_backend, resolve_device


def test_the_interface_lists_placement_and_the_ops_of_the_forward_pass():
    names = interface_names()
    assert {
        "device",
        "activation_dtype",
        "weight",
        "zeros",
        "to_numpy",
        "free_memory_bytes",
        "new_sampler",
        "constant",
        "embedding",
        "rms_norm",
        "add_rms_norm",
        "linear",
        "rope_store_kv",
        "paged_attention",
        "silu_and_mul",
    } <= set(names)


@pytest.mark.parametrize("backend", [CpuOps(), cuda_ops.emulated()], ids=["cpu", "cuda-emulated"])
def test_every_backend_has_every_name_of_the_interface(backend):
    missing = [name for name in interface_names() if not hasattr(backend, name)]
    assert not missing, f"{type(backend).__name__} lacks {missing}"
    assert backend.free_memory_bytes() is None  # both hold their arrays in host memory


def test_devices_build_their_backends():
    assert isinstance(make_backend("cpu", "bfloat16"), CpuOps)
    emulated = make_backend("cuda-emulated", "bfloat16")
    assert isinstance(emulated, cuda_ops.CudaOps) and emulated.device == "cuda-emulated"
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
