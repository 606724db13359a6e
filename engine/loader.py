"""Load a Hugging Face Llama checkpoint folder (config.json + *.safetensors, possibly sharded with
model.safetensors.index.json) into `LlamaModel`, fusing q/k/v and gate/up.

The checkpoint must match its config exactly: every tensor present with the expected shape, and
no tensor the model has no place for (biases, other architectures). All names and shapes are
checked from the file headers before any data is read; a mismatch raises one CheckpointError
naming the tensor.

A tensor-parallel rank (`comm`) reads only its slices of each tensor (engine.tp.shard.hf_pieces:
safetensors slices, rows or columns) into its shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from bubblesim.core.models import ModelSpec
from engine.model import LlamaModel
from engine.tp.shard import Piece, hf_pieces

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that carry no weights (recomputed from the config).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    attn_backend: str | None = None,
    max_positions: int | None = None,
    comm=None,
) -> LlamaModel:
    """`comm` (engine.tp.comm.Comm): load this rank's slices only."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint '{path}': no config.json")
    spec = ModelSpec.from_hf_config(path / "config.json", name=path.name)
    model = LlamaModel(spec, dtype, device, attn_backend, max_positions, comm=comm)
    load_weights(model, path)
    return model


def _destinations(model: LlamaModel) -> dict[str, tuple[torch.Tensor, int]]:
    """HF tensor name -> (parameter, first row) it fills; the row count is the tensor's
    (tensor parallelism: its slice's, see `_slices`)."""
    s = model.local  # this rank's sizes (the whole model's without tensor parallelism)
    dest = {"model.embed_tokens.weight": (model.embed_tokens, 0)}
    dest["model.norm.weight"] = (model.norm.weight, 0)
    if not s.tie_word_embeddings:
        dest["lm_head.weight"] = (model.lm_head, 0)
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        dest |= {
            p + "input_layernorm.weight": (layer.input_layernorm.weight, 0),
            p + "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0),
            p + "self_attn.q_proj.weight": (attn.qkv_proj, 0),
            p + "self_attn.k_proj.weight": (attn.qkv_proj, s.q_size),
            p + "self_attn.v_proj.weight": (attn.qkv_proj, s.q_size + s.kv_size),
            p + "self_attn.o_proj.weight": (attn.o_proj, 0),
            p + "mlp.gate_proj.weight": (mlp.gate_up_proj, 0),
            p + "mlp.up_proj.weight": (mlp.gate_up_proj, s.intermediate_size),
            p + "mlp.down_proj.weight": (mlp.down_proj, 0),
        }
    return dest


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, kv, i = spec.hidden_size, spec.kv_size, spec.intermediate_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (spec.q_size, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, spec.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or every file's header)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint '{path}': bad {INDEX_FILE} ({e})") from None
        mapped = {name: path / fname for name, fname in sorted(weight_map.items())}
        for name, file in mapped.items():
            if not file.is_file():
                raise CheckpointError(
                    f"checkpoint '{path}': tensor '{name}' is mapped to missing file '{file.name}'"
                )
        return mapped
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint '{path}': no *.safetensors files")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in files:
                    raise CheckpointError(
                        f"checkpoint '{path}': tensor '{name}' is in both "
                        f"'{files[name].name}' and '{shard.name}'"
                    )
                files[name] = shard
    return files


def _check(path: Path, spec: ModelSpec, files: dict[str, Path]) -> list[str]:
    """The names to load, after checking names and shapes against the config."""
    expected = _expected_shapes(spec)
    optional = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    problems: list[str] = []
    for name in sorted(expected):
        if name not in files:
            problems.append(f"tensor '{name}' is missing")
    for name in sorted(files):
        if name not in expected and name not in optional and not _IGNORED.fullmatch(name):
            problems.append(f"unexpected tensor '{name}' (no such weight in a {spec.name} model)")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(files):
        if name in expected or name in optional:
            by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                want = expected.get(name, (spec.vocab_size, spec.hidden_size))
                if shape != want:
                    problems.append(f"tensor '{name}' has shape {list(shape)}, "
                                    f"config.json implies {list(want)}")  # fmt: skip
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint '{path}': {problems[0]}{more}")
    return sorted(expected)


def _slices(model: LlamaModel) -> dict[str, Piece]:
    """HF tensor name -> the slice this rank reads (empty without tensor parallelism)."""
    comm = model.comm
    if comm is None:
        return {}
    out = {}
    for key, (_, piece) in hf_pieces(model.spec, comm.rank, comm.size).items():
        if key.startswith(("model.", "lm_head")):
            out[key] = piece
        else:
            for i in range(model.spec.num_layers):
                out[f"model.layers.{i}.{key}"] = piece
    return out


def _read(f, name: str, piece: Piece | None) -> torch.Tensor:
    """The whole tensor, or only its slice's rows or columns."""
    if piece is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    a, b = piece.start, piece.start + piece.length
    return sl[a:b] if piece.dim == 0 else sl[:, a:b]


@torch.no_grad()
def load_weights(model: LlamaModel, path: str | Path) -> None:
    path = Path(path)
    files = _tensor_files(path)
    names = _check(path, model.spec, files)
    dest = _destinations(model)
    slices = _slices(model)
    if slices:  # vocab rows past the vocabulary (the last rank's padding) stay zero
        model.embed_tokens.zero_()
        model.lm_head.zero_()
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file in sorted(by_file):
        with safe_open(file, framework="pt") as f:
            for name in by_file[file]:
                piece = slices.get(name)
                tensor = _read(f, name, piece)
                param, row = dest[name]  # row: the slice's first row (_destinations: local)
                param[row : row + tensor.shape[0]].copy_(tensor.to(param.dtype))
