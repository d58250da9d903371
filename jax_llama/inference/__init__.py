"""Inference: running a loaded model on prompts.

    generate.py  prefill, then one compiled decode step per new token over a KV cache; the
                 samplers' masks (top-k, top-p) as small free functions
    serving.py   the batching engine behind `jax-llama serve`: one KV cache of rows that
                 requests join and leave between decode steps
"""
