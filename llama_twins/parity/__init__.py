"""Cross-framework checks that load both twins: the parity report behind `llama-bridge parity` and
the greedy comparison behind `jax-llama generate --compare-torch`.

Like everything in llama_twins it sits above both twins; jax_llama, torch_llama (and transformers)
are imported inside the functions, so that the commands start fast and a missing reference is
reported rather than fatal.

The package, in the order a report runs:
- report.py      parity_report (its stages in order) and format_parity_report
- memory.py      what a report needs in memory, refused before anything loads; malloc tuning
- components.py  the figures of one component: RoPE over the context, the weights held, RMSNorm
- forward.py     the forward passes (JAX, torch, transformers) and their hidden / logit / KL figures
- greedy.py      greedy decoding by both twins (also behind `generate --compare-torch`)
- training.py    one step's loss and gradients, AdamW steps (judged against the perturbed float64
                 runs' spread too), the optimizers on shared gradients
- references.py  transformers and llama.cpp as independent references
- products.py    torch's bfloat16 products in float32 where torch has no bfloat16 kernel (AVX2)
- judgement.py   how a figure is measured and judged: U, BUDGET, budget, judge
- planted.py     bugs planted in one twin, for the tests' and the calibration's negative cases
                 (imports torch: not imported here)
"""

from .components import NORM_ROWS, ROPE_POSITIONS
from .greedy import compare_greedy, format_greedy_parity, greedy_parity
from .judgement import (BUDGET, COMPOUNDING, NEAR_TIE, SPREAD_MULTIPLE, U, WEIGHT_ULPS,
                        budget, judge)
from .memory import BYTES_PER_PARAMETER, FLOAT64_BYTES_PER_PARAMETER, RUNTIME_BYTES, parity_memory
from .references import LLAMA_CPP_LOGITS, REFERENCES
from .report import format_parity_report, parity_report
from .training import ADAMW_EPS, ADAMW_STEPS, PERTURBED_RUNS

__all__ = [
    "parity_report", "format_parity_report", "parity_memory",
    "greedy_parity", "compare_greedy", "format_greedy_parity", "judge",
    "BUDGET", "budget", "U", "NEAR_TIE", "WEIGHT_ULPS", "LLAMA_CPP_LOGITS", "REFERENCES",
    "ADAMW_STEPS", "ADAMW_EPS", "PERTURBED_RUNS", "SPREAD_MULTIPLE", "COMPOUNDING",
    "ROPE_POSITIONS", "NORM_ROWS",
    "BYTES_PER_PARAMETER", "FLOAT64_BYTES_PER_PARAMETER", "RUNTIME_BYTES",
]
