"""Pooling: a prompt's hidden states made into one vector, for ``LLM.embed`` and ``/v1/embeddings``.

A pooling request (``runner="pooling"``, vLLM's) is a prompt and nothing after it. The scheduler
admits and chunks it as it does any prompt and the model computes its prefill; where generation
would take the last position's logits and sample, a pooling runner keeps the hidden states after
the final norm and pools them (vLLM's types): the last token's (``LAST``, the default, the one
position of a decoder that has seen the whole prompt), the mean over the prompt (``MEAN``) or
the first token's (``CLS``), normalized (L2) unless the model says not to. There is no decode
step and no sampler: the step that computes a prompt's last token finishes its request.

What the model says: a sentence-transformers checkpoint lists its modules in ``modules.json``,
among them a ``Pooling`` module whose ``config.json`` sets one ``pooling_mode_*`` true, and a
``Normalize`` module or none; that is read as vLLM reads it. Any other checkpoint is pooled
``LAST``, normalized. ``pooler_config`` (vLLM's) overrides either field.

Chunks and the prefix cache: ``LAST`` needs only the prompt's last position, which a step always
computes (block_manager.py never serves it from the cache). ``MEAN`` and ``CLS`` need positions an
earlier chunk computed or a prefix-cache hit skipped: a sequence carries its pooled state from
chunk to chunk (the running sum, the first row), and with those types nothing is read back from
the prefix cache (as in vLLM; config.py turns it off).

``dimensions`` (OpenAI's, vLLM's ``PoolingParams``): a model trained for Matryoshka truncation
(its ``config.json`` says ``is_matryoshka``, or lists ``matryoshka_dimensions``) keeps a vector's
first ``dimensions`` and normalizes what is left; any other model refuses it, because its first
dimensions alone mean little.
"""

import json
import os
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from nanoengine.sampling_params import is_int

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# A sentence-transformers Pooling module's flags (1_Pooling/config.json) for the types above.
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}


@dataclass
class PoolerConfig:
    """vLLM's ``pooler_config``, e.g. ``{"pooling_type": "MEAN", "normalize": true}``. A field left
    None is the model's (``load_pooler_config`` fills it in)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config's pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config's normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_dict(cls, value: "PoolerConfig | dict") -> "PoolerConfig":
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f'pooler_config must be a dict such as {{"pooling_type": "MEAN", "normalize": true}}, '
                             f"got {value!r}")
        if unknown := sorted(set(value) - {f.name for f in fields(cls)}):
            raise ValueError(f"pooler_config has unknown key(s) {unknown}; it takes pooling_type and normalize")
        return cls(**value)


@dataclass
class PoolingParams:
    """vLLM's: what one pooling request asks for. ``dimensions``: Matryoshka truncation (module
    docstring); ``truncate_prompt_tokens``: the prompt's last ``k`` tokens (-1: ``max_model_len``),
    as ``SamplingParams``' cuts a long prompt rather than refusing it."""

    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be None or a positive integer, got {self.dimensions!r}")
        if (k := self.truncate_prompt_tokens) is not None and (not is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, got {k!r}")


def _read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return json.load(file)


def sentence_transformers_pooling(path: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint names, or None for a checkpoint without
    ``modules.json`` (or without a Pooling module in it)."""
    modules = _read_json(os.path.join(path, "modules.json")) or []
    types = {module.get("type"): module for module in modules}
    pooling = types.get("sentence_transformers.models.Pooling")
    if pooling is None:
        return None
    flags = _read_json(os.path.join(path, pooling["path"], "config.json")) or {}
    modes = [key for key, value in flags.items() if key.startswith("pooling_mode_") and value is True]
    if len(modes) > 1 or any(mode not in ST_POOLING_MODES for mode in modes):  # several: their concatenation
        raise ValueError(f"the checkpoint's sentence-transformers pooling {modes} is not supported (only one of "
                         f"{sorted(ST_POOLING_MODES)}): pass pooler_config to choose one of {POOLING_TYPES}")
    pooling_type = ST_POOLING_MODES[modes[0]] if modes else None
    return PoolerConfig(pooling_type, "sentence_transformers.models.Normalize" in types)


def load_pooler_config(path: str, user: PoolerConfig | None) -> PoolerConfig:
    """The pooler for the checkpoint at ``path``: the user's ``pooler_config`` over the model's own
    (its sentence-transformers config), over ``LAST``, normalized (vLLM's default for embedding)."""
    model = sentence_transformers_pooling(path) or PoolerConfig()
    user = user or PoolerConfig()
    pooling_type = user.pooling_type or model.pooling_type or "LAST"
    normalize = next(v for v in (user.normalize, model.normalize, True) if v is not None)
    return PoolerConfig(pooling_type, normalize)


class Pooler:
    """A pooling runner's last layer, on rank 0 (model_runner.py): each step, a sequence's pooled
    state after the rows the step computed for it; at its prompt's end, its vector."""

    def __init__(self, config: PoolerConfig, hf_config: PretrainedConfig):
        self.pooling_type, self.normalize = config.pooling_type, config.normalize
        self.hidden_size = hf_config.hidden_size
        # vLLM's reading of config.json: any dimension up to the hidden size, or only those listed
        self.matryoshka_dimensions = getattr(hf_config, "matryoshka_dimensions", None)
        self.is_matryoshka = getattr(hf_config, "is_matryoshka", False) or bool(self.matryoshka_dimensions)

    def check(self, params: PoolingParams) -> None:
        """A ``ValueError`` naming ``dimensions`` for a truncation this model cannot give."""
        if (d := params.dimensions) is None:
            return
        if not self.is_matryoshka:
            raise ValueError(f"dimensions={d}: this model is not Matryoshka-trained (its config.json sets neither "
                             "is_matryoshka nor matryoshka_dimensions), so a shortened vector would lose its "
                             "meaning; leave dimensions unset")
        if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions={d} is not one of the model's matryoshka_dimensions "
                             f"{self.matryoshka_dimensions}")
        if d > self.hidden_size:
            raise ValueError(f"dimensions={d} is more than the model's {self.hidden_size}")

    def update(self, state: torch.Tensor | None, rows: torch.Tensor, start: int) -> torch.Tensor:
        """The state after ``rows``, the hidden states of positions ``start``, ``start + 1``, ...
        A step that starts at position 0 starts afresh (a preempted sequence is recomputed from there).
        A row is copied, not viewed: the step's hidden states are not kept."""
        if self.pooling_type == "LAST":
            return rows[-1].to(torch.float32, copy=True)
        assert start == 0 or state is not None, "MEAN and CLS pooling read no prefix cache"
        if self.pooling_type == "CLS":
            return rows[0].to(torch.float32, copy=True) if start == 0 else state
        total = rows.float().sum(0)
        return total if start == 0 else state + total

    def finish(self, state: torch.Tensor, num_tokens: int, dimensions: int | None) -> torch.Tensor:
        """A prompt's vector, float32 on the CPU, from its state once all ``num_tokens`` are pooled."""
        vector = state / num_tokens if self.pooling_type == "MEAN" else state
        vector = vector[:dimensions]  # Matryoshka: the first dimensions, then normalized
        return (F.normalize(vector, dim=-1) if self.normalize else vector).cpu()
