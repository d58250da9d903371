"""The recipe interface (jax_llama.training.recipe): a recipe defined here, in the test, runs on
the one training loop (jax_llama.training.loop.run) with nothing in loop.py knowing it, and gets
what every recipe gets: run.json, metrics.jsonl, checkpoints, a resume that ends where an
uninterrupted run ends, and a resume refused when the setup differs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bridge.errors import BridgeError
from conftest import interrupted_at
from jax_llama.training.loop import run
from jax_llama.training.recipe import Recipe, RunOptions
from jax_llama.training.step import TrainConfig

SLOPE, INTERCEPT = 3.0, -1.0


class LineRecipe(Recipe):
    """The smallest recipe: fit y = 3x - 1 by least squares on fresh points each step."""

    def __init__(self, steps: int = 12, lr: float = 0.1):
        self.steps, self.lr = steps, lr

    def read(self) -> None:
        self.tc = TrainConfig(steps=self.steps, batch_size=8, seq_len=1, lr=self.lr,
                              warmup_steps=0, weight_decay=0.0, eval_every=4,
                              checkpoint_every=4, keep_checkpoints=5)

    def record(self) -> dict:
        return {"recipe": "line", "train": self.tc.to_dict()}

    def model(self, run: RunOptions):
        return None, {"w": jnp.zeros(()), "b": jnp.zeros(())}, None, None

    def loss(self, model):
        def loss(params, batch, key):
            return jnp.mean((params["w"] * batch["x"] + params["b"] - batch["y"]) ** 2)
        return loss

    def next_batch(self, step: int, state) -> dict:
        x = np.random.default_rng(step).normal(size=8).astype(np.float32)  # the step's points
        return {"x": x, "y": SLOPE * x + INTERCEPT}

    def evaluate(self, params) -> dict:
        return {"val_loss": float((params["w"] - SLOPE) ** 2 + (params["b"] - INTERCEPT) ** 2)}

    def save(self, out, model, params):
        (out / "model").mkdir(exist_ok=True)
        (out / "model" / "line.json").write_text(json.dumps({k: float(v) for k, v in
                                                             params.items()}))
        return model, params


def test_a_recipe_defined_outside_the_package_runs_on_the_one_loop(tmp_path):
    out = tmp_path / "line"
    summary = run(LineRecipe(), RunOptions(out, progress=False))
    assert json.loads((out / "run.json").read_text())["recipe"] == "line"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all({"loss", "grad_norm", "lr", "tokens_per_s"} <= set(r) for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]  # eval_every 4
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [4, 8, 12]
    # it learns: the held-out distance to the line shrinks, the train loss with it
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert evals[-1] < evals[0] < SLOPE ** 2 + INTERCEPT ** 2
    assert summary["train_loss"] == records[-1]["loss"] and summary["val_loss"] == evals[-1]
    assert (out / "loss.png").is_file() == (summary["plot"] is not None)

    # a new run refuses the directory; a resume with another setup is refused, naming it
    with pytest.raises(BridgeError, match="is not empty"):
        run(LineRecipe(), RunOptions(out, progress=False))
    with pytest.raises(BridgeError, match="different setup.*lr"):
        run(LineRecipe(lr=0.2), RunOptions(out, resume=True, progress=False))


def test_a_plugged_in_recipe_resumes_where_it_stopped(tmp_path):
    whole = tmp_path / "whole"
    run(LineRecipe(), RunOptions(whole, progress=False))
    cut = tmp_path / "cut"
    with interrupted_at(6):  # killed after step 6: its newest checkpoint is step 4's
        run(LineRecipe(), RunOptions(cut, progress=False))
    assert sorted(int(p.name) for p in (cut / "checkpoints").iterdir()) == [4]
    run(LineRecipe(), RunOptions(cut, resume=True, progress=False))
    assert (json.loads((cut / "model" / "line.json").read_text())
            == json.loads((whole / "model" / "line.json").read_text()))
    steps = [json.loads(line)["step"]
             for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # steps 5 and 6 written again, once


def test_the_loop_names_no_recipe():
    """loop.py's code (its docstrings aside) refers to no recipe and imports none: every branch
    on what runs is a recipe's method."""
    import ast
    from pathlib import Path

    import jax_llama.training.loop as loop_lib

    tree = ast.parse(Path(loop_lib.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name.split(".")[-1] for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    names |= {n.module.split(".")[-1] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}
    recipes = {"lm", "sft", "dpo", "grpo", "finetune", "CorpusRecipe", "SftRecipe", "DpoRecipe",
               "GrpoRecipe", "FinetuneRecipe", "LanguageModelRecipe"}
    assert not names & recipes, names & recipes
    assert {"next_batch", "evaluate", "loss", "save", "finish"} <= names  # it calls the recipe
