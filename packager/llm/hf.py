"""Read a Hugging Face model folder: config.json, and the weights of model.safetensors
or of the shards an index lists, mapped (not read) and validated before any view is
made, with the bundle reader's bounded safetensors parser."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ...runtime.bundle import MAX_ST_HEADER, parse_safetensors_header
from ...runtime.bundle_format import ST_DTYPES
from ..ir import PackError


def _bad(path: Path, what: str) -> PackError:
    return PackError(f"{path}: not a valid safetensors file: {what}")


def read_safetensors(path: Path) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (read-only view of the file, safetensors dtype): BF16 as its uint16 bits.
    The header is checked (length, JSON, dtypes, shapes, offsets within the file, the
    tensors tiling the data) before the file is mapped."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        buf = head + f.read(min(n, MAX_ST_HEADER + 1, max(size - 8, 0)))
    start, entries = parse_safetensors_header(
        memoryview(buf), 0, str(path), size, fail=lambda p, m: _bad(path, m), align=1
    )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, e in entries.items():
        b, end = e["data_offsets"]
        dt = np.dtype(ST_DTYPES[e["dtype"]])
        out[name] = (mm[start + b : start + end].view(dt).reshape(e["shape"]), e["dtype"])
    return out


def load_folder(folder: str | Path) -> tuple[dict, dict[str, tuple[np.ndarray, str]]]:
    """(config.json as a dict, every weight by name) of a Hugging Face model folder."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise PackError(f"{folder}: no config.json (a Hugging Face model folder has one)")
    try:
        config = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{cfg_path}: not JSON: {e}") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise PackError(f"{index}: no weight_map ({e})") from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise PackError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    weights: dict[str, tuple[np.ndarray, str]] = {}
    for name in files:
        p = folder / name
        if p.parent != folder or not p.is_file():
            raise PackError(f"{index}: shard {name!r} is not a file of the folder")
        for k, v in read_safetensors(p).items():
            if k in weights:
                raise PackError(f"{p}: tensor {k!r} is also in another shard")
            weights[k] = v
    return text_decoder(config, weights)


# Multimodal folders whose language model edgepack packs: model_type -> (the text
# decoder's model_type, weight-name prefixes of the decoder -> the text model's names).
# The vision tower and projector are left out (a prompt of text needs neither).
MULTIMODAL = {
    "gemma3": ("gemma3_text", {"language_model.model.": "model.",
                               "model.language_model.": "model.",
                               "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}),
}  # fmt: skip


def text_decoder(config: dict, weights: dict) -> tuple[dict, dict]:
    """(config, weights) of the text decoder: the folder's own, or for a multimodal
    model (MULTIMODAL) its ``text_config`` and language-model weights under the text
    model's names."""
    if config.get("model_type") not in MULTIMODAL:
        return config, weights
    text_type, prefixes = MULTIMODAL[config["model_type"]]
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PackError(f"config.json: a {config['model_type']} model without text_config")
    text = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **text,
            "model_type": text_type}  # fmt: skip
    kept = {}
    for name, v in weights.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            kept[prefixes[prefix] + name[len(prefix) :]] = v
    return text, kept


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        v = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{path}: not JSON: {e}") from None
    return v if isinstance(v, dict) else {}


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v  # older configs nest it


def _ids(v) -> list[int]:
    return [v] if isinstance(v, int) else [int(x) for x in v or []]


def load_text(folder: str | Path, config: dict) -> tuple[bytes | None, dict]:
    """(tokenizer.json's bytes or None, the text facts the runtime needs): the chat
    template (tokenizer_config.json's, or chat_template.jinja), the BOS/EOS token
    strings, and the ids that end a generation (generation_config.json's eos_token_id,
    else config.json's)."""
    folder = Path(folder)
    tok = folder / "tokenizer.json"
    tcfg = _json(folder / "tokenizer_config.json")
    gcfg = _json(folder / "generation_config.json")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    eos = gcfg.get("eos_token_id", config.get("eos_token_id"))
    info = {
        "chat_template": template,
        "bos_token": _token_text(tcfg.get("bos_token")),
        "eos_token": _token_text(tcfg.get("eos_token")),
        "eos_ids": _ids(eos),
    }
    return (tok.read_bytes() if tok.is_file() else None), info
