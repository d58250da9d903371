"""tasks: what both twins train, evaluate and serve on, framework-neutral.

The chats of supervised fine-tuning and their loss masks (chats), preference pairs for DPO
(preference), reward functions for GRPO (rewards), labelled texts for classification
(classification), texts for perplexity (evaluation), prompts and the text printed back
(prompts), a conversation that keeps its turns (conversation).

Above bridge (the weights, formats, tokenizers, chat templates and config), below the twins:
numpy and bridge only, never jax or torch.
"""
