"""The recipes that train a Llama on tokens (jax_llama.training.recipe): LanguageModelRecipe, what
pretraining, SFT, DPO and GRPO share - the run's tokenizer and model config, the device mesh,
the model with its LoRA adapters, the final model saved with its tokenizer - and CorpusRecipe,
pretraining (`jax-llama train`): next-token cross-entropy on a corpus, 5% held out."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from bridge.config import LlamaConfig
from bridge.data_dirs import check_out_apart
from bridge.errors import BridgeError
from bridge.merge import merge_lora as merge_checkpoint
from bridge.progress import bar as progress_bar

from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_native
from ..lora import add_lora, count, merge_lora, save_adapter, trainable_for
from ..model.attention import choose as choose_attention
from ..model.llama import Llama, init
from ..perf import train_flops_per_token
from ..sharding import check_batch, global_batch, make_mesh
from . import data as data_lib
from .inputs import open_init, run_config, run_tokenizer
from .recipe import Recipe, RunOptions, plot_losses
from .spec import RunSpec
from .state import say
from .step import jit_eval_step, lm_loss


class LanguageModelRecipe(Recipe):
    """What the recipes on a Llama share. A subclass reads its inputs in `read(init)` (the
    --init checkpoint opened once, or None), setting self.tokenizer and self.config, and makes its
    batches in `batches(local_batch)`."""

    title: str | None = None   # set: the recipe runs in one process only (its name in the
                               # refusal); None: across several too (not with LoRA)
    template = None         # a chat template the run saves (bridge.chat.ChatTemplate)

    def __init__(self, spec: RunSpec):
        self.spec, self.tc = spec, spec.train
        self.init = None

    # -- the inputs ----------------------------------------------------------------------------

    def check(self, run: RunOptions) -> None:
        spec = self.spec
        choose_attention(spec.attention, 1, 1)  # refused before anything is read or written
        # the recipes' data are files; a run's own output is never its input
        settings = spec.settings
        check_out_apart(spec.out, [*spec.data, *((settings.data, settings.eval_data)
                                                  if settings else ())])
        if jax.process_count() > 1 and (spec.lora or self.title):
            raise BridgeError(f"{'LoRA' if spec.lora else self.title} runs across several "
                              f"processes are not supported yet (one process with many "
                              f"devices is)", field="multi_host")

    def read(self) -> None:
        """Open --init once and read the inputs from it (the subclass's part: `inputs`), then
        check the mesh the run asks for against the model."""
        # the --init checkpoint, opened once: its tokenizer, config, template and weights
        self.init = open_init(self.spec)
        self.inputs(self.init)
        self.flops_per_token = train_flops_per_token(self.config, self.tc.seq_len)
        self.mesh = make_mesh(self.spec.mesh)
        check_batch(self.tc.batch_size, self.mesh)
        check_mesh_splits(self.config, self.mesh)
        self.local_batch = self.tc.batch_size // jax.process_count()

    def inputs(self, init) -> None:
        raise NotImplementedError

    def record(self) -> dict:
        spec = self.spec
        return {"model": self.config.to_dict(), "train": spec.train.to_dict(), "data": spec.data,
                "tokenizer": spec.tokenizer, "init": spec.init, "strip_labels": spec.strip_labels,
                "pack": spec.pack, "lora": None if spec.lora is None else spec.lora.to_dict(),
                **spec.settings_record(), "tracking": spec.tracking.to_dict()}

    # run.json files from before strip_labels and pack were recorded ran without them
    record_before = {"strip_labels": False, "pack": False}

    def begin(self, out: Path) -> None:
        if not (out / "tokenizer").is_dir():
            (out / "tokenizer").mkdir()
            self.tokenizer.save(out / "tokenizer")
        if self.template is not None:
            self.template.save(out)

    # -- the model -----------------------------------------------------------------------------

    def model(self, run: RunOptions):
        spec, tc = self.spec, self.tc
        self.batches(self.local_batch)
        model = Llama(self.config, dtype=tc.dtype, scan_layers=spec.scan_layers,
                      remat=spec.remat, attention=spec.attention)
        # A frozen base needs no float32 master copy: with LoRA it is held in the compute dtype.
        base_dtype = tc.dtype if spec.lora else "float32"
        if self.init is not None:
            # straight onto the mesh: each process reads only the parts its devices hold
            params = load_checkpoint(self.init, dtype=base_dtype, scan_layers=spec.scan_layers,
                                     mesh=self.mesh)[1]
        else:
            params = init(self.config, seed=tc.seed, scan_layers=spec.scan_layers,
                          param_dtype=base_dtype)[1]
        labels = None
        if spec.lora:
            model, params = add_lora(model, params, spec.lora, seed=tc.seed)
            labels = trainable_for(spec.lora)
            n_train, n_all = count(params, labels(params)), count(params)
            say(f"LoRA rank {spec.lora.rank} on {', '.join(spec.lora.targets)}"
                f"{' and the embedding table' if spec.lora.train_embeddings else ''}: training "
                f"{n_train:,} of {n_all:,} parameters")
            self.desc = f"training LoRA ({n_train / 1e6:.3g}M of {n_all / 1e6:.3g}M params)"
        self.network = model
        return model, params, labels, self.mesh

    def batches(self, local_batch: int) -> None:
        raise NotImplementedError

    def save(self, out: Path, model, params):
        """out/model: the final weights (LoRA: out/adapter too, and the base with it merged);
        returns the model and weights as merged."""
        spec = self.spec
        if spec.lora:
            save_adapter(out / "adapter", model, params, base_model=spec.init, overwrite=True)
            model, params = merge_lora(model, params)
        # Merged into the base as stored, not the compute-dtype copy: the merge streams the base
        # from its file again, tensor by tensor, a second reading that is needed by design.
        if spec.lora and spec.init:
            merge_checkpoint(spec.init, out / "adapter", out / "model", force=True,
                             progress=False)
        else:  # every process takes part in gathering the tensors; process 0 writes them
            save_native(out / "model", self.config, params, overwrite=True)
        return model, params

    def summary(self, out: Path, last: dict) -> dict:
        return {"steps": self.tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"],
                "unigram_loss": getattr(self, "unigram", None), "model": str(out / "model"),
                "plot": None, "sample": ""}

    def finish(self, out: Path, model, params, scores: dict, summary: dict, tracker) -> dict:
        """The tokenizer (and template) beside the model, and the recipe's own files
        (`results`); with LoRA, where the adapter is."""
        self.tokenizer.save(out / "model")
        if self.template is not None:
            self.template.save(out / "model")
        summary = self.results(out, model, params, scores, summary, tracker)
        if self.spec.lora:
            summary["adapter"] = str(out / "adapter")
        return summary

    def results(self, out: Path, model, params, scores: dict, summary: dict, tracker) -> dict:
        return Recipe.finish(self, out, model, params, scores, summary, tracker)


class NextTokenRecipe(LanguageModelRecipe):
    """A recipe whose loss is next-token cross-entropy (jax_llama.training.step.lm_loss) on its
    batches (self.train_batches), evaluated on held-out ones (self.val_batches)."""

    def loss(self, model):
        return lm_loss(model)

    def resumed(self, state, meta: dict | None) -> None:
        self.eval_step = jit_eval_step(self.network, state, self.mesh)

    def next_batch(self, step: int, state) -> dict:
        return global_batch(self.train_batches.batch(step), self.mesh)

    def evaluate(self, params) -> dict:
        losses = [self.eval_step(params, global_batch(self.val_batches.batch(i), self.mesh))
                  for i in range(self.tc.eval_batches)]
        return {"val_loss": float(np.mean(jax.device_get(losses)))}


class CorpusRecipe(NextTokenRecipe):
    """Pretraining (`jax-llama train`): next-token cross-entropy on a corpus (the embedded
    default, or the files given), tokenized once into the cache beside the run, 5% held out;
    evaluated by the held-out loss, against the unigram baseline; a short sample at the end."""

    def inputs(self, init) -> None:
        spec = self.spec
        files = (data_lib.corpus_files(spec.data, out=spec.out) if spec.data
                 else data_lib.default_corpus())
        self.files = files
        self.tokenizer = run_tokenizer(spec, init, lambda: data_lib.read_documents(
            files, labeled=spec.strip_labels), f"{len(files)} files")
        self.config = run_config(spec, init, self.tokenizer)

    def batches(self, local_batch: int) -> None:
        (self.train_batches, self.val_batches, self.unigram,
         self.val_tokens) = corpus_batches(self.spec, self.files, self.tokenizer, self.config,
                                           local_batch)

    def results(self, out: Path, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_losses(out, self.unigram)
        # one process decodes: a model sharded over several would need them all
        summary["sample"] = sample(model, params, self.tokenizer, self.val_tokens,
                                   self.tc.seq_len, self.spec.sample_tokens
                                   if jax.process_count() == 1 else 0, self.tc.seed)
        return summary


def check_mesh_splits(config: LlamaConfig, mesh) -> None:
    """Refuse an fsdp or tensor axis that divides none of the model's sharded dimensions: the
    rules would leave every parameter whole on every device, which is not what it asks for."""
    from bridge.tensors import canonical_shapes

    from ..params import flax_path
    from ..sharding import spec_for

    for axis in ("fsdp", "tensor"):
        if mesh.shape[axis] == 1:
            continue
        split = False
        for name, shape in canonical_shapes(config).items():
            path, _, transposed = flax_path(name, False)
            keys = [jax.tree_util.DictKey(k) for k in path]
            leaf = tuple(reversed(shape)) if transposed else shape
            split |= axis in tuple(spec_for(keys, leaf, mesh))
        if not split:
            raise BridgeError(f"{axis}={mesh.shape[axis]} divides none of the model's sharded "
                              f"dimensions (dim {config.dim}, ffn_dim {config.ffn_dim}, "
                              f"vocab_size {config.vocab_size}, heads x head_dim); every "
                              f"parameter would stay whole on every device", field="mesh")


def corpus_batches(spec: RunSpec, files: list[Path], tokenizer, config: LlamaConfig,
                   local_batch: int):
    """(train batches, validation batches, unigram baseline, validation tokens) of a corpus:
    tokenized once into the cache beside the run, 5% held out."""
    tc = spec.train
    tokens = data_lib.tokenize_corpus(files, tokenizer, spec.out.parent / "token-cache",
                                      progress=lambda it: progress_bar(
                                          it, total=len(files), desc="tokenizing", unit="file",
                                          leave=False, enabled=spec.progress),
                                      labeled=spec.strip_labels)
    train_tokens, val_tokens = data_lib.split(tokens, 0.05, tc.seq_len + 1)
    unigram = data_lib.unigram_loss(train_tokens, val_tokens, config.vocab_size)
    kind = data_lib.PackedBatches if spec.pack else data_lib.Batches
    where = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                 bos_id=tokenizer.bos_id if tokenizer.add_bos else None)  # BOS opens documents
    if spec.pack:
        where["eos_id"] = tokenizer.eos_id  # each document ends at EOS when it opens with no BOS
    batches = kind(train_tokens, local_batch, tc.seq_len, tc.seed, **where)
    val_batches = kind(val_tokens, local_batch, tc.seq_len, tc.seed + 1, **where)
    say(f"{len(tokens):,} tokens ({len(train_tokens):,} train, {len(val_tokens):,} validation); "
        f"unigram baseline {unigram:.3f} nats/token")
    if spec.pack:
        say(f"packed {len(batches.rows):,} rows of whole documents, {batches.padding():.1%} "
            f"padding")
    return batches, val_batches, unigram, val_tokens


def sample(model, params, tokenizer, val_tokens, seq_len: int, n_new: int, seed: int) -> str:
    """A short temperature-0.8 continuation of the start of the validation tokens, with the
    KV-cache generator."""
    from bridge.sampling import Sampler

    from ..inference.generate import generate

    if n_new <= 0:
        return ""
    prompt = [int(t) for t in val_tokens[:max(1, min(seq_len // 4, 64))]]
    n_new = min(n_new, model.config.max_seq_len - len(prompt))
    new = generate(model, params, [prompt], n_new, Sampler(temperature=0.8), seed=seed).tokens[0]
    return tokenizer.decode(prompt + new)
