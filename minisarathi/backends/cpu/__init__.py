"""The fast CPU backend (device "cpu", the default without a GPU): CpuOps and everything it needs to be fast.

ops.py is the Backend interface; attention.py its paged attention (kept decode K/V, reused gather buffers);
packed_gemm, half_linear, quant_linear, native_attention and native_sampling are native kernels, each with
its .cpp (cpu_isa.h: which vector paths the CPU runs), built and loaded by native.py and off where they
cannot run; process_setup.py sets BLAS threads and the allocator. It is held
to the plain reference, minisarathi/backends/reference.py. Nothing is imported here: the sampler imports
native_sampling without loading CpuOps.
"""
