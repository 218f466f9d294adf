"""The refit across processes: bucket transports, the collectives of a refit world, trainer shards.

- inprocess: InProcessTransport, zero-copy between two threads of one process (colocated use, tests).
- transport: TorchDistTransport, a bucket stream over torch.distributed (gloo / NCCL).
- shm_transport: ShmTransport, a bucket stream through a shared-memory ring, on one host.
- receiving: what every transport's receiver shares (its consumer's run, huge-page receive buffers).
- collectives: TorchDistCollectives, the process groups of a refit world, its agreement, turns and
  tensor-parallel collectives; it hands out the transports.
- launch: launch_world, a bounded world of local processes over gloo on 127.0.0.1.
- sliced_trainer: SlicedTrainer, any full TrainerModel presented as one rank of a TP / PP / EP layout.

Nothing is imported here: import the module you need.
"""
