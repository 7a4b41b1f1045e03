"""How far a quantized LLM bundle is from its fp32 model, measured at pack time.

Both decode graphs (the fp32 one and the quantized one the bundle carries) read the same
fixed text, token by token, each with its own KV cache: the per-layer error table (the
relative L2 and cosine of every node's output against fp32, over all tokens, as for
CNNs), and over the text's next-token predictions the mean KL divergence of the
quantized distribution from the fp32 one (llama.cpp's ``--kl-divergence``), both
perplexities and the top-1 agreement. ``--max-error`` gates the build on the mean KL.

The text is shipped here (EVAL_TEXT: plain prose written for this purpose) and
tokenized with the model's own tokenizer; a bundle without one reads seeded random ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...runtime.executor import Executor
from ..ir import Graph
from ..manifest import make_manifest
from ..plan import plan_memory
from ..quantize import ErrorAcc

EVAL_TEXT = (
    "The harbour town woke slowly. Fishing boats came back with the tide, and the market "
    "stalls along the quay filled with crates of mackerel, crabs and bright green samphire. "
    "A baker opened her shutters and the smell of warm bread drifted over the water. "
    "Children ran to school past the old lighthouse, which had not been lit for forty years "
    "but was still painted white every spring. At the end of the pier an old man mended a "
    "net, counting the knots under his breath, while gulls argued over the scraps he threw "
    "them. By noon the sun had burned off the mist, and the hills behind the town showed "
    "their fields of barley and the dark line of the forest. In the afternoon a letter "
    "arrived at the post office: the ferry to the island would start running again next "
    "week, after two years of repairs. The news spread quickly, from the café to the "
    "church and up the steep lanes, and by evening everyone was talking about the summer."
)
EVAL_TOKENS = 96  # tokens read (fewer when the context is shorter)


def eval_tokens(tokenizer: bytes | None, vocab: int, n: int) -> tuple[list[int], str]:
    """(ids, what they are) of the shipped text, or seeded random ids without a tokenizer."""
    if tokenizer:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_str(tokenizer.decode("utf-8")).encode(EVAL_TEXT).ids[:n]
        if len(ids) >= 2 and max(ids) < vocab:
            return ids, f"the shipped text ({len(ids)} tokens)"
    ids = [int(t) for t in np.random.default_rng(0).integers(0, vocab, n)]
    return ids, f"{n} seeded random token ids (no tokenizer)"


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def evaluate(
    ref: Graph, quantized: Graph, ids: list[int], backends: Sequence[str] = ("cpu", "ref")
) -> dict:
    """The error table of ``quantized`` against ``ref`` (two decode graphs over the same
    spec) reading ``ids`` in slot 0, one token a run, on the host."""
    runs, manifests = [], []
    for g in (ref, quantized):
        manifests.append(make_manifest(g, plan_memory(g, backends)))
        runs.append(Executor(manifests[-1], g.consts, device="cpu"))
    rows = ref.shapes[ref.inputs[0]][0]
    feeds = {k: np.zeros(rows, np.int32) for k in ("ids", "pos", "slot")}
    feeds["slot"][:] = -1
    feeds["slot"][0] = 0
    nodes = manifests[1]["graph"]["nodes"]
    accs = {t: ErrorAcc() for n in nodes for t in n["outputs"]}
    kl, nll_ref, nll_q, agree = [], [], [], []
    for p, tok in enumerate(ids):
        feeds["ids"][0], feeds["pos"][0] = tok, p
        tr_ref, tr_q = (ex.run_traced(feeds) for ex in runs)
        for t, acc in accs.items():
            if t in tr_ref:
                acc.add(tr_ref[t][:1], tr_q[t][:1])
        lr, lq = _log_softmax(tr_ref["logits"][0]), _log_softmax(tr_q["logits"][0])
        kl.append(float(np.exp(lr) @ (lr - lq)))
        agree.append(int(np.argmax(lr)) == int(np.argmax(lq)))
        if p + 1 < len(ids):
            nll_ref.append(-lr[ids[p + 1]])
            nll_q.append(-lq[ids[p + 1]])
    layers = [
        {"node": n["name"], "op": n["op"], "tensor": t, "rel_l2": accs[t].rel_l2(),
         "cosine": accs[t].cosine()}
        for n in nodes for t in n["outputs"] if t in tr_ref
    ]  # fmt: skip
    logits = accs["logits"]
    return {
        "layers": layers,
        "outputs": {"logits": {"rel_l2": logits.rel_l2(), "cosine": logits.cosine()}},
        "max_output_rel_l2": logits.rel_l2(),
        "kl": float(np.mean(kl)),
        "kl_p99": float(np.percentile(kl, 99)),
        "top1": float(np.mean(agree)),
        "ppl_fp32": float(np.exp(np.mean(nll_ref))) if nll_ref else None,
        "ppl": float(np.exp(np.mean(nll_q))) if nll_q else None,
        "tokens": len(ids),
    }
