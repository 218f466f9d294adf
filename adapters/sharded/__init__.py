"""Trainer ranks of a sharded (TP / PP / EP) layout.

- sliced_trainer: SlicedTrainer, any full TrainerModel presented as one rank of a layout.
"""
