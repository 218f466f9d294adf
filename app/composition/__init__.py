"""The composition root's wiring, by job: the adapter tables, the distributed world, the embedded
model, the engines' processes and kernels, and the trainer's side. `app.bootstrap.Services` holds
them; only `app.bootstrap` reads the environment and hands its values down.
"""
