"""GGUF, llama.cpp's single-file format: the whole wing in one place.

    container.py      the file itself: its key / value metadata and its tensors' views, read
                      straight from one memory map
    pretokenizers.py  llama.cpp's BPE pre-tokenizers as one table, by tokenizer.ggml.pre name
    tokenizer.py      a file's tokenizer.ggml.* keys -> the tokenizer llama.cpp runs (import)
    vocab.py          a tokenizer -> the tokenizer.ggml.* keys (export)
    read.py           a LLaMA GGUF as a checkpoint: LlamaConfig, canonical tensors, its tokenizer
                      and chat template as files
    conventions.py    what a write makes and a read takes back: llama.cpp's tensor names, the
                      file types, our own keys, the rope_freqs formula
    write.py          a checkpoint as a GGUF: the float and 32-element block types here, the
                      K-quants through quantize.py
    quantize.py       the K-quants, by llama.cpp's own quantiser

The wing stands above what it builds on - the tokenizer kinds (bridge.tokenizer), chat templates
(bridge.chat) and the checkpoint interface (bridge.formats.base) - so those meet a GGUF file
through a hook, never an import: this module enters GGUF's readers in bridge.tokenizer's and
bridge.chat's lists of model files that carry their own vocabulary or template (`bridge` imports
it), and bridge.formats' registry names read.py and write.py.
"""

from ..chat import MODEL_FILE_TEMPLATES
from ..tokenizer import MODEL_FILE_TOKENIZERS
from .container import is_gguf
from .read import gguf_file_template
from .tokenizer import gguf_file_tokenizer

MODEL_FILE_TOKENIZERS.append((is_gguf, gguf_file_tokenizer))
MODEL_FILE_TEMPLATES.append((is_gguf, gguf_file_template))
