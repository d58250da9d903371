"""Is checkpoint B still checkpoint A? (`llama-bridge compare A B`, issue 80.)

Each section compares one thing two checkpoints carry and says so in a Finding: the config by
meaning (config.py), the tokenizer and its BOS/EOS decisions (tokenizer.py), the chat template
(template.py), the weights tensor by tensor against what their storage type costs (weights.py).
The outputs on real text and the block where two models part need a model to run, and live above
this package (llama_twins.compare). report.py holds the Finding and the verdict over them.
"""

from .report import DIFFERENT, SAME, SKIPPED, WITHIN, Finding, verdict

__all__ = ["DIFFERENT", "Finding", "SAME", "SKIPPED", "WITHIN", "verdict"]
