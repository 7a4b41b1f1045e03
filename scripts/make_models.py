"""Build ResNet-18 and MobileNetV2 ONNX models with random weights.

Only `onnx.helper` and numpy are used (no torch, no downloads) so the test models can be
regenerated anywhere from a seed. The graphs follow the torchvision architectures op for op,
with BatchNormalization kept as separate nodes because folding them is the packager's job.

    python scripts/make_models.py --out DIR [--models resnet18 mobilenet_v2] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# IR 8 is what onnx 1.12..1.13 wrote; every onnxruntime >= 1.14 loads it.
IR_VERSION = 8
NUM_CLASSES = 1000
BN_EPS = 1e-5


class _GraphBuilder:
    """Accumulates nodes and initializers; weights are drawn from one seeded generator.

    Every draw happens in graph-construction order, so one seed gives byte-identical models.
    """

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count: dict[str, int] = {}

    def _node_name(self, op: str) -> str:
        n = self._count.get(op, 0)
        self._count[op] = n + 1
        return f"{op}_{n}"

    def add_init(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: list[str], output: str | None = None, **attrs: object) -> str:
        name = self._node_name(op)
        out = output or f"{name}_out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    # --- layers -------------------------------------------------------------------------

    def conv(
        self,
        x: str,
        prefix: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        pad: int = 0,
        group: int = 1,
        bias: bool = False,
    ) -> str:
        # Kaiming normal in fan_in mode: eval-mode BN with random running stats does not
        # renormalise, so the conv itself has to preserve the activation scale.
        fan_in = (cin // group) * k * k
        w = self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / fan_in)
        inputs = [x, self.add_init(f"{prefix}.weight", w.astype(np.float32))]
        if bias:
            b = self.rng.normal(0.0, 0.01, cout).astype(np.float32)
            inputs.append(self.add_init(f"{prefix}.bias", b))
        return self.node(
            "Conv",
            inputs,
            dilations=[1, 1],
            group=group,
            kernel_shape=[k, k],
            pads=[pad, pad, pad, pad],
            strides=[stride, stride],
        )

    def bn(self, x: str, prefix: str, c: int, gamma_scale: float = 1.0) -> str:
        gamma = self.rng.uniform(0.5, 1.5, c) * gamma_scale
        beta = self.rng.normal(0.0, 0.1, c)
        mean = self.rng.normal(0.0, 0.1, c)
        var = self.rng.uniform(0.5, 1.5, c)
        inputs = [x]
        for suffix, arr in (
            ("weight", gamma),
            ("bias", beta),
            ("running_mean", mean),
            ("running_var", var),
        ):
            inputs.append(self.add_init(f"{prefix}.{suffix}", arr.astype(np.float32)))
        return self.node("BatchNormalization", inputs, epsilon=BN_EPS, momentum=0.9)

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def relu6(self, x: str) -> str:
        # opset >= 11 Clip takes min/max as inputs; share one pair of scalar initializers
        # like torch.onnx does.
        if not any(t.name == "relu6.min" for t in self.initializers):
            self.add_init("relu6.min", np.array(0.0, dtype=np.float32))
            self.add_init("relu6.max", np.array(6.0, dtype=np.float32))
        return self.node("Clip", [x, "relu6.min", "relu6.max"])

    def add(self, a: str, b: str) -> str:
        return self.node("Add", [a, b])

    def head(self, x: str, cin: int, num_classes: int) -> str:
        x = self.node("GlobalAveragePool", [x])
        x = self.node("Flatten", [x], axis=1)
        w = self.rng.standard_normal((num_classes, cin)) * np.sqrt(2.0 / cin)
        b = self.rng.normal(0.0, 0.01, num_classes)
        wn = self.add_init("fc.weight", w.astype(np.float32))
        bn = self.add_init("fc.bias", b.astype(np.float32))
        # Gemm with transB=1 is what torch.onnx emits for nn.Linear.
        return self.node("Gemm", [x, wn, bn], output="logits", alpha=1.0, beta=1.0, transB=1)

    def model(self, graph_name: str, batch: int | str, num_classes: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            graph_name,
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 224, 224])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, num_classes])],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="edgepack.make_models",
            producer_version="1",
        )
        model.ir_version = IR_VERSION
        return model


# --- ResNet-18 ---------------------------------------------------------------------------

# The last BN of each residual branch starts with a damped gamma: without it the variance
# roughly doubles at every Add and the logits blow up through 8 blocks.
RESNET_RESIDUAL_GAMMA = 0.3


def _basic_block(g: _GraphBuilder, x: str, prefix: str, cin: int, cout: int, stride: int) -> str:
    out = g.conv(x, f"{prefix}.conv1", cin, cout, 3, stride=stride, pad=1)
    out = g.relu(g.bn(out, f"{prefix}.bn1", cout))
    out = g.conv(out, f"{prefix}.conv2", cout, cout, 3, pad=1)
    out = g.bn(out, f"{prefix}.bn2", cout, gamma_scale=RESNET_RESIDUAL_GAMMA)
    identity = x
    if stride != 1 or cin != cout:
        identity = g.conv(x, f"{prefix}.downsample.0", cin, cout, 1, stride=stride)
        identity = g.bn(identity, f"{prefix}.downsample.1", cout)
    return g.relu(g.add(out, identity))


def resnet18(seed: int = 0, batch: int | str = 1) -> onnx.ModelProto:
    """torchvision ResNet-18 (BasicBlock x [2, 2, 2, 2]) with random weights."""
    g = _GraphBuilder(seed)
    x = g.conv("input", "conv1", 3, 64, 7, stride=2, pad=3)
    x = g.relu(g.bn(x, "bn1", 64))
    x = g.node(
        "MaxPool",
        [x],
        ceil_mode=0,
        dilations=[1, 1],
        kernel_shape=[3, 3],
        pads=[1, 1, 1, 1],
        strides=[2, 2],
    )
    cin = 64
    for stage, cout in enumerate([64, 128, 256, 512], start=1):
        for block in range(2):
            stride = 2 if (stage > 1 and block == 0) else 1
            x = _basic_block(g, x, f"layer{stage}.{block}", cin, cout, stride)
            cin = cout
    g.head(x, cin, NUM_CLASSES)
    return g.model("resnet18", batch, NUM_CLASSES)


# --- MobileNetV2 -------------------------------------------------------------------------

# (expand ratio t, output channels c, repeats n, first stride s), as in torchvision.
MOBILENET_V2_SETTINGS = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]
# Same damping as in ResNet, on the linear-bottleneck BN of blocks that end in an Add.
MOBILENET_RESIDUAL_GAMMA = 0.3


def _inverted_residual(
    g: _GraphBuilder, x: str, prefix: str, cin: int, cout: int, stride: int, t: int
) -> str:
    hidden = cin * t
    use_res = stride == 1 and cin == cout
    out = x
    idx = 0
    if t != 1:
        out = g.conv(out, f"{prefix}.conv.{idx}.0", cin, hidden, 1)
        out = g.relu6(g.bn(out, f"{prefix}.conv.{idx}.1", hidden))
        idx += 1
    # Depthwise 3x3: one group per channel.
    out = g.conv(out, f"{prefix}.conv.{idx}.0", hidden, hidden, 3, stride, 1, group=hidden)
    out = g.relu6(g.bn(out, f"{prefix}.conv.{idx}.1", hidden))
    idx += 1
    # Linear bottleneck: projection conv + BN, no activation.
    out = g.conv(out, f"{prefix}.conv.{idx}", hidden, cout, 1)
    gamma = MOBILENET_RESIDUAL_GAMMA if use_res else 1.0
    out = g.bn(out, f"{prefix}.conv.{idx + 1}", cout, gamma_scale=gamma)
    return g.add(x, out) if use_res else out


def mobilenet_v2(seed: int = 0, batch: int | str = 1) -> onnx.ModelProto:
    """torchvision MobileNetV2 (width 1.0) with random weights; ReLU6 is Clip(0, 6)."""
    g = _GraphBuilder(seed)
    cin = 32
    x = g.conv("input", "features.0.0", 3, cin, 3, stride=2, pad=1)
    x = g.relu6(g.bn(x, "features.0.1", cin))
    layer = 1
    for t, c, n, s in MOBILENET_V2_SETTINGS:
        for i in range(n):
            x = _inverted_residual(g, x, f"features.{layer}", cin, c, s if i == 0 else 1, t)
            cin = c
            layer += 1
    last = 1280
    x = g.conv(x, f"features.{layer}.0", cin, last, 1)
    x = g.relu6(g.bn(x, f"features.{layer}.1", last))
    # torchvision's Dropout(0.2) is the identity at inference, so it is not emitted.
    g.head(x, last, NUM_CLASSES)
    return g.model("mobilenet_v2", batch, NUM_CLASSES)


BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
}


def logits_stats(model: onnx.ModelProto, seed: int = 0) -> dict[str, float]:
    """Run the model with onnxruntime on a seeded N(0, 1) input; used to sanity-check init."""
    import onnxruntime as ort

    dim0 = model.graph.input[0].type.tensor_type.shape.dim[0]
    batch = dim0.dim_value if dim0.HasField("dim_value") else 2
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    (y,) = sess.run(["logits"], {"input": x})
    return {
        "std": float(y.std()),
        "mean": float(y.mean()),
        "absmax": float(np.abs(y).max()),
        "finite": bool(np.isfinite(y).all()),
        "distinct": int(np.unique(y).size),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--models", nargs="+", choices=sorted(BUILDERS), default=list(BUILDERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", default="1", help="batch size, or a name for a symbolic dim")
    parser.add_argument("--check-run", action="store_true", help="run with onnxruntime too")
    args = parser.parse_args(argv)

    batch: int | str = int(args.batch) if args.batch.isdigit() else args.batch
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        t0 = time.perf_counter()
        model = BUILDERS[name](seed=args.seed, batch=batch)
        onnx.checker.check_model(model)
        path = args.out / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        msg = f"{path}: {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.2f}s"
        if args.check_run:
            msg += f", logits {logits_stats(model, seed=args.seed)}"
        print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
