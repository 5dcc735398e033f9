"""Tensor parallelism: a model split over N rank processes (docs/deploy.md, "Tensor parallelism").

group.py is the engine's side (starts the ranks, sends each step's batch, detects dead or hung ranks),
worker.py the ranks' side, sharding.py which slice of each weight a rank holds, communicator.py the
all-reduce the model calls (MPI on the CPU, NCCL on GPUs).
"""
