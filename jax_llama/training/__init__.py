"""Training in JAX: the step, the loop around it and what it reads and writes.

    step.py      TrainConfig, the optimizer (AdamW, clipping, warmup-cosine), the jitted train step
    state.py     what a run keeps on disk: checkpoints and their manifest, stop signals, the NaN policy
    tracking.py  metrics to TensorBoard / W&B
    data.py      corpora to token batches
    recipe.py    the Recipe interface: what one kind of run does, as the loop calls it
    loop.py      the run, the same for every recipe: resume, steps, evaluation, checkpoints,
                 the run record
    lm.py        the recipes on a Llama: their shared set-up, and pretraining on a corpus
    sft.py, dpo.py, grpo.py (grpo_loss.py, grpo_prompts.py), finetune.py
                 the supervised fine-tuning, preference, RL and classifier recipes
    spec.py      what a run is asked to do: RunSpec, SftSpec, DpoSpec, GrpoSpec
    inputs.py    a language-model run's tokenizer and model config

The mesh and its sharding rules are jax_llama.sharding's: loading a checkpoint onto a mesh
uses them as much as training does.
"""
