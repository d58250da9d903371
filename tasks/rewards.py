"""Reward functions for GRPO, called as TRL 1.16's GRPOTrainer calls them.

A reward function takes keyword arguments and returns one value per completion:

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

prompts: each completion's prompt as the data gave it (a string, or a list of messages);
completions: the text (for a conversational prompt: [{"role": "assistant", "content": text}]);
completion_ids: the sampled ids, the stop token included; kwargs: every other column of the data
by its name, and `trainer_state` (the step: .global_step, .max_steps) and `log_metric(name,
value)`, as TRL passes them. None means "not applicable to this completion" (it does not count
in that function's mean, and a completion no function scores gets no advantage). So a user's
TRL reward functions work unchanged: `--reward my_rewards.py:my_reward`.

Built in (by name): `exact_answer` - 1.0 when the last number in the completion equals the row's
`answer` column, else 0.0 (None where the row has no answer); `number_only` - 1.0 when the
completion is a number and nothing else; and `regex:PATTERN` - 1.0 when the completion matches
PATTERN as a whole (re.fullmatch, DOTALL), else 0.0.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bridge.errors import BridgeError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    """A completion's text: the string, or the content of its (assistant) messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


def exact_answer(completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the last number in the completion equals the row's answer, else 0.0; None where
    the row has no answer."""
    answers = answer if answer is not None else [None] * len(completions)
    scores = []
    for completion, expected in zip(completions, answers):
        if expected is None:
            scores.append(None)
            continue
        found = _NUMBER.findall(_text(completion).replace(",", ""))
        try:
            scores.append(float(bool(found) and math.isclose(float(found[-1]), float(expected))))
        except ValueError:  # an answer that is not a number: compare the texts
            scores.append(float(bool(found) and found[-1] == str(expected).strip()))
    return scores


def regex_reward(pattern: str, name: str = "regex") -> Callable:
    """A reward of 1.0 where the stripped completion matches `pattern` as a whole, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions, **kwargs) -> list[float]:
        return [float(compiled.fullmatch(_text(c).strip()) is not None) for c in completions]
    reward.__name__ = name
    return reward


BUILTIN: dict[str, Callable] = {"exact_answer": exact_answer,
                                "number_only": regex_reward(r"-?\d+(?:\.\d+)?", "number_only")}


@dataclass(frozen=True)
class Reward:
    name: str        # the function's __name__ (TRL's name for its metrics)
    spec: str        # as given: FILE.py:FUNC, a built-in name, or regex:PATTERN
    func: Callable


def load_reward(spec: str) -> Reward:
    """The reward function `spec` names: FILE.py:FUNC (imported from that file), a built-in name,
    or regex:PATTERN. Refused in one line naming what is missing."""
    if spec.startswith("regex:"):
        try:
            return Reward("regex", spec, regex_reward(spec[len("regex:"):]))
        except re.error as e:
            raise BridgeError(f"reward {spec!r}: not a regular expression ({e})",
                              field="reward") from None
    if spec in BUILTIN:
        return Reward(spec, spec, BUILTIN[spec])
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise BridgeError(f"{spec!r}: expected FILE.py:FUNCTION, regex:PATTERN or a built-in "
                          f"reward ({', '.join(BUILTIN)})", field="reward")
    if not Path(path).is_file():
        raise BridgeError(f"{path}: no such file (reward {spec!r})", field="reward")
    module_name = f"_jax_llama_reward_{abs(hash(str(Path(path).resolve())))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error it raises on import
        sys.modules.pop(module_name, None)
        raise BridgeError(f"{path}: importing it raised {type(e).__name__}: {e}",
                          field="reward") from None
    func = getattr(module, name, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module_name)
        raise BridgeError(f"{path}: no function {name!r} (found: {', '.join(found) or 'none'})",
                          field="reward")
    return Reward(getattr(func, "__name__", name), spec, func)


class RewardFailed(RuntimeError):
    """A reward function raised, returned the wrong number of values, or a value that is not a
    number or None: the message names the function and the row."""


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list], **extra) -> np.ndarray:
    """(N, F) float32: reward function f's value for completion n, NaN where it returned None.
    columns: the data's other columns, one value per completion; extra: keywords passed as they
    are (trainer_state, log_metric). Raises RewardFailed naming the function and the row."""
    n = len(completions)
    out = np.full((n, len(rewards)), np.nan, np.float32)
    for j, reward in enumerate(rewards):
        try:
            values = reward.func(prompts=prompts, completions=completions,
                                 completion_ids=completion_ids, **columns, **extra)
        except Exception as e:  # the user's function: whatever it raises stops the run
            raise RewardFailed(f"reward {reward.name} ({reward.spec}) raised "
                               f"{type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardFailed(f"reward {reward.name} ({reward.spec}) returned "
                               f"{type(values).__name__}, not a list of numbers") from None
        if len(values) != n:
            raise RewardFailed(f"reward {reward.name} ({reward.spec}) returned {len(values)} "
                               f"values for {n} completions")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if isinstance(value, str) or not math.isfinite(number):
                raise RewardFailed(f"reward {reward.name} ({reward.spec}): row {i} (prompt "
                                   f"{_short(prompts[i])}): returned {value!r}, not a finite "
                                   f"number or None")
            out[i, j] = number
    return out


def _short(prompt) -> str:
    text = _text(prompt) if not isinstance(prompt, str) else prompt
    text = " ".join(text.split())
    return repr(text if len(text) <= 60 else text[:57] + "...")
