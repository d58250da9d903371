"""Run by test_train.py in a subprocess with 8 simulated CPU devices: one train step on a mesh
versus the same step on one device. Prints one JSON line of max differences per mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_step.py [--lora]

With --lora the model carries LoRA adapters (B made non-zero) and only they train.
"""

import json
import sys

import jax
import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.lora import LoraConfig
from jax_llama import init
from jax_llama.model import Llama
from jax_llama.sharding import batch_sharding, check_batch, global_batch, make_mesh, tree_shardings
from jax_llama.training.step import (TrainConfig, init_state, jit_train_step, lm_loss, loss_fn,
                             make_optimizer, place_state)

MESHES = ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"]


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    # Every sharded dimension divides by 8 (dim 64, kv 32, ffn 128) except the vocab (97), which
    # the rules must then leave whole.
    config = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=97,
                         max_seq_len=32, rope_theta=10000.0)
    # eps = 1 keeps the AdamW update smooth in the gradient (~ lr * g), so parameter differences
    # measure the sharded math, not Adam dividing rounding noise by sqrt(nu) ~ 0.
    tc = TrainConfig(steps=10, batch_size=8, seq_len=16, lr=1e-1, eps=1.0, warmup_steps=0)
    model = Llama(config)
    params = init(config, seed=0)[1]
    labels = None
    if "--lora" in sys.argv:
        from jax_llama.lora import add_lora, trainable
        model, params = add_lora(model, params, LoraConfig(rank=4, alpha=8.0))
        params = jax.tree_util.tree_map_with_path(  # B non-zero, so every adapter has a gradient
            lambda path, x: x + 0.05 if "lora_B" in jax.tree_util.keystr(path) else x, params)
        labels = trainable
    params = jax.tree_util.tree_map(np.asarray, params)  # host copies: steps donate
    optimizer = make_optimizer(tc, labels)
    rng = np.random.default_rng(0)
    batches = [{"inputs": rng.integers(0, 97, (8, 16), dtype=np.int32),
                "targets": rng.integers(0, 97, (8, 16), dtype=np.int32),
                "mask": np.ones((8, 16), np.float32)} for _ in range(3)]

    def run(mesh_spec):
        mesh = make_mesh(mesh_spec)
        state = place_state(init_state(params, optimizer), mesh)
        grad = jax.jit(jax.grad(loss_fn), static_argnums=1,
                       in_shardings=(tree_shardings(state.params, mesh), batch_sharding(mesh)))
        grads = [np.asarray(g) for g in jax.tree_util.tree_leaves(
            grad(state.params, model, global_batch(batches[0], mesh)))]
        step = jit_train_step(lm_loss(model), optimizer, tc, state, mesh, labels)
        losses = []
        for batch in batches:
            state, metrics = step(state, global_batch(batch, mesh))
            losses.append(float(metrics["loss"]))
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]
        sharded = any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
                      for x in jax.tree_util.tree_leaves(state.params))
        return losses, grads, leaves, sharded

    ref_losses, ref_grads, ref_leaves = single_device(model, params, optimizer, tc, batches, labels)
    initial = jax.tree_util.tree_leaves(params)
    grad_scale = max(float(np.abs(g).max()) for g in ref_grads)
    for spec in MESHES:
        losses, grads, leaves, sharded = run(spec)
        print(json.dumps({
            "mesh": spec, "params_sharded": sharded, "lr": tc.lr,
            "loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad_rel_diff": max(float(np.abs(a - b).max()) for a, b in zip(grads, ref_grads)) / grad_scale,
            "param_diff": max(float(np.abs(a - b).max()) for a, b in zip(leaves, ref_leaves)),
            "param_moved": max(float(np.abs(a - b).max()) for a, b in zip(ref_leaves, initial))}))
    try:
        check_batch(6, make_mesh("data=4,fsdp=2"))
    except BridgeError as e:
        print(json.dumps({"refusal": str(e)}))
    sys.stdout.flush()


def single_device(model, params, optimizer, tc, batches, labels):
    """The same three steps with plain jit on one device: no mesh, no shardings."""
    from jax_llama.training.step import lr_schedule, make_train_step
    step = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc), trainable=labels))
    device = jax.devices()[0]
    state = jax.device_put(init_state(params, optimizer), device)
    grads = [np.asarray(g) for g in jax.tree_util.tree_leaves(
        jax.jit(jax.grad(loss_fn), static_argnums=1)(state.params, model, jax.device_put(batches[0], device)))]
    losses = []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, device))
        losses.append(float(metrics["loss"]))
    return losses, grads, [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]


if __name__ == "__main__":
    main()
