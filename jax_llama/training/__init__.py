"""Training in JAX: the step, the loop around it and what it reads and writes.

    step.py      TrainConfig, the optimizer (AdamW, clipping, warmup-cosine), the jitted train step
    state.py     what a run keeps on disk: checkpoints and their manifest, stop signals, the NaN policy
    tracking.py  metrics to TensorBoard / W&B
    data.py      corpora to token batches
    loop.py      the run: resume, steps, evaluation, checkpoints, the run record
    sft.py, dpo.py  the supervised fine-tuning and preference recipes' data and losses
    spec.py      what a run is asked to do: RunSpec, SftSpec, DpoSpec
    inputs.py    a language-model run's tokenizer and model config

The mesh and its sharding rules are jax_llama.sharding's: loading a checkpoint onto a mesh
uses them as much as training does.
"""
