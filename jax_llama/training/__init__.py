"""Training in JAX: the step, the loop around it and what it reads and writes.

    step.py      TrainConfig, the optimizer (AdamW, clipping, warmup-cosine), the jitted train step
    sharding.py  the mesh and the sharding rules for params, optimizer state and batches
    state.py     what a run keeps on disk: checkpoints and their manifest, stop signals, the NaN policy
    tracking.py  metrics to TensorBoard / W&B
    data.py      corpora to token batches
    loop.py      the run: resume, steps, evaluation, checkpoints, the run record
    sft.py, dpo.py  the supervised fine-tuning and preference recipes' data and losses

The package's face stays empty so that `jax_llama.generate` (which pads with training.data.bucket)
can import a module here without pulling in the loop.
"""
