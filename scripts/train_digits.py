"""Train a small CNN on scikit-learn's 8x8 digits and export it to ONNX by hand.

The export builds the graph with `onnx.helper` from the trained state_dict instead of calling
torch.onnx.export: torch's default exporter needs onnxscript and its output changes between
torch versions, while this graph is fixed op for op (BatchNormalization is kept as its own node
with the trained running statistics, so the packager under test has something to fold).

    python scripts/train_digits.py [--out tests/data/digits_cnn.onnx] [--seed 0]

`load_split()` needs only numpy and scikit-learn, so tests can rebuild the exact test set
without torch installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "data" / "digits_cnn.onnx"
SPLIT_DESC = "train_test_split(test_size=0.25, random_state=0, stratify=y)"
OPSET = 17
IR_VERSION = 8  # loadable by every onnxruntime >= 1.14
BN_EPS = 1e-5
EPOCHS = 30
BATCH_SIZE = 32
LR = 3e-3
LABEL_SMOOTHING = 0.1


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (X_train, X_test, y_train, y_test); X is float32 [N, 1, 8, 8] in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.25, random_state=0, stratify=y
    )
    return X_train, X_test, y_train, y_test


def _build_torch_model() -> Any:
    import torch.nn as nn

    # Layer indices matter: export_onnx() reads the state_dict by these names.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),  # 0 (bias kept: folding must merge it into BN)
        nn.BatchNorm2d(16, eps=BN_EPS),  # 1
        nn.ReLU(),  # 2
        nn.Conv2d(16, 32, 3, padding=1),  # 3
        nn.ReLU(),  # 4
        nn.MaxPool2d(2),  # 5: 8x8 -> 4x4
        nn.Conv2d(32, 32, 3, padding=1),  # 6
        nn.ReLU(),  # 7
        nn.AdaptiveAvgPool2d(1),  # 8: GlobalAveragePool
        nn.Flatten(),  # 9
        nn.Linear(32, 64),  # 10
        nn.ReLU(),  # 11
        nn.Linear(64, 10),  # 12
    )


def train(seed: int = 0, epochs: int = EPOCHS) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Train on the split; return (state_dict as numpy, torch eval-mode logits on X_test)."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    X_train, X_test, y_train, _ = load_split()
    xt = torch.from_numpy(X_train)
    yt = torch.from_numpy(y_train)
    model = _build_torch_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    # Label smoothing keeps the logits small (|logit| of a few units instead of ~50), so the
    # float32 rounding noise stays well below the 1e-5 ONNX-vs-torch check.
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    # A dedicated generator so the shuffle order depends on the seed alone.
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), BATCH_SIZE):
            idx = perm[i : i + BATCH_SIZE]
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(X_test)).numpy()
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    return state, logits


def export_onnx(state: dict[str, np.ndarray]) -> Any:
    """Build the opset-17 graph equivalent to the eval-mode torch model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def init(name: str) -> str:
        arr = state[name]
        if arr.dtype != np.float32:
            raise TypeError(f"{name}: unexpected dtype {arr.dtype}")
        inits.append(numpy_helper.from_array(arr, name))
        return name

    def node(op: str, inputs: list[str], name: str, output: str | None = None, **attrs: Any) -> str:
        out = output or name
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv(x: str, idx: int) -> str:
        k = state[f"{idx}.weight"].shape[-1]
        return node(
            "Conv",
            [x, init(f"{idx}.weight"), init(f"{idx}.bias")],
            f"conv{idx}",
            dilations=[1, 1],
            group=1,
            kernel_shape=[k, k],
            pads=[1, 1, 1, 1],
            strides=[1, 1],
        )

    x = conv("image", 0)
    bn_inputs = [init(f"1.{s}") for s in ("weight", "bias", "running_mean", "running_var")]
    x = node("BatchNormalization", [x, *bn_inputs], "bn1", epsilon=BN_EPS, momentum=0.9)
    x = node("Relu", [x], "relu2")
    x = node("Relu", [conv(x, 3)], "relu4")
    x = node(
        "MaxPool",
        [x],
        "pool5",
        ceil_mode=0,
        dilations=[1, 1],
        kernel_shape=[2, 2],
        pads=[0, 0, 0, 0],
        strides=[2, 2],
    )
    x = node("Relu", [conv(x, 6)], "relu7")
    x = node("GlobalAveragePool", [x], "gap8")
    x = node("Flatten", [x], "flatten9", axis=1)
    # nn.Linear stores [out, in]; Gemm(transB=1) is how torch.onnx exports it.
    x = node("Gemm", [x, init("10.weight"), init("10.bias")], "fc10", transB=1)
    x = node("Relu", [x], "relu11")
    node("Gemm", [x, init("12.weight"), init("12.bias")], "fc12", output="logits", transB=1)

    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="edgepack.train_digits",
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args(argv)

    import onnxruntime as ort
    import torch

    t0 = time.perf_counter()
    state, torch_logits = train(seed=args.seed, epochs=args.epochs)
    t_train = time.perf_counter() - t0
    model = export_onnx(state)
    data = model.SerializeToString()

    _, X_test, _, y_test = load_split()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (onnx_logits,) = sess.run(["logits"], {"image": X_test})
    max_diff = float(np.abs(onnx_logits - torch_logits).max())
    if not max_diff <= 1e-5:
        raise SystemExit(f"ONNX and torch disagree: max |diff| = {max_diff:.3g} > 1e-5")
    acc = float((onnx_logits.argmax(1) == y_test).mean())
    torch_acc = float((torch_logits.argmax(1) == y_test).mean())

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    meta = {
        "test_accuracy": acc,
        "seed": args.seed,
        "torch_version": torch.__version__,
        "split": SPLIT_DESC,
    }
    meta_path = args.out.with_suffix(".json")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"trained {args.epochs} epochs in {t_train:.1f}s; torch acc {torch_acc:.4f}, "
        f"onnxruntime acc {acc:.4f} on {len(y_test)} test images; "
        f"max |onnx - torch| = {max_diff:.2e}"
    )
    print(f"wrote {args.out} ({len(data)} bytes) and {meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
