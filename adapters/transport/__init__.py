"""Bucket transports and refit-world plumbing.

- inprocess: InProcessTransport, zero-copy between two threads of one process (colocated use, tests).
- torch_dist: TorchDistTransport and TorchDistCollectives over torch.distributed (gloo / NCCL).
- launch: launch_world, a bounded world of local processes over gloo on 127.0.0.1.

Nothing is imported here: import the module you need.
"""
