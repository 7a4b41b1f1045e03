"""Decoder language models: a Hugging Face folder (config.json + safetensors) becomes two
planned graphs over one set of weights, prefill (a chunk of one prompt's tokens) and
decode (one token per sequence slot), sharing a KV cache planned in the arena.

hf.py reads the folder (bounded safetensors parsing), arch.py turns its config into a
``DecoderSpec`` (one row per supported architecture; anything else fails naming it),
rope.py computes the RoPE tables, graph.py writes the graphs, build.py packs the bundle.
"""

# The build options' defaults and choices (here, so the CLI can list them without
# importing the packager).
DEFAULT_CTX = 2048
DEFAULT_CHUNK = 32  # prompt rows per prefill run: bounds the arena, not the prompt
KV_DTYPES = ("f16", "f32")
ACT_QUANT = ("auto", "int8", "none")  # activations of int4 linears (build_llm's act_quant)
