"""The command-line layer: the three commands and what they share.

`jax-llama` (main.py) assembles its families of subcommands, each module holding its parsers
beside its handlers: train.py (train, sft, dpo), generate.py, serve.py, classify.py (finetune,
zero-shot, predict, split), evaluate.py (eval), bench.py; options.py holds the flags several of
them share. `llama-bridge` (bridge_main.py: convert, inspect, parity, demo, merge-lora) and
`torch-llama` (torch_main.py: generate, eval) are one module each. common.py holds what all three
share (exit codes, an error line naming the flag at fault, the generate and eval options);
docs.py reads the parsers for the generated reference and the help checks.
"""
