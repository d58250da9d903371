"""lm-evaluation-harness support (the optional extra `eval`): importing this package registers
the model `jax-llama` with lm-eval; `python -m jax_llama.harness` is lm-eval's command line with
it registered.

    import jax_llama.harness                    # registers "jax-llama"
    lm_eval.simple_evaluate(model="jax-llama", model_args="pretrained=CKPT", tasks=[...])
"""

from .lm import JaxLlamaLM, continuation_scores, cut_at_stops

__all__ = ["JaxLlamaLM", "continuation_scores", "cut_at_stops"]
