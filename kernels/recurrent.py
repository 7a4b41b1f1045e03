"""The recurrent cells (ONNX LSTM, GRU and RNN, one direction a node), written once over
an array module: NumPy on the cpu backend, CuPy on cuda (kernels/generic.py's pattern).

The input's contribution to every gate, x_t W^T + biases, is one GEMM over all the
steps before the loop; each step is then h W_r^T (a small GEMM) and the gates'
elementwise math, every result written in place into the node's planned scratch: no
allocation per step or run. Gate order and equations are ONNX's (LSTM i o f c, GRU
z r h; activations sigmoid / tanh / tanh).
"""

from __future__ import annotations

import numpy as np

CELLS = {"lstm": 4, "gru": 3, "rnn": 1}  # gates per cell


def rnn_scratch_floats(cell: str, steps: int, batch: int, hidden: int) -> int:
    """float32 scratch of an rnn node: every step's input gates, one step's recurrent
    gates, the cell state, two temporaries and a zero initial state."""
    g = CELLS[cell] * hidden
    return steps * batch * g + batch * g + 4 * batch * hidden


def _sigmoid(xp, v) -> None:
    """In place; exp(-v) overflowing to inf gives 0, as the function's limit."""
    xp.negative(v, out=v)
    xp.exp(v, out=v)
    xp.add(v, 1.0, out=v)
    xp.reciprocal(v, out=v)


def rnn_step(xp, ins, y, scratch, attrs: dict, recur=None):
    """The step of an ``rnn`` node. ``ins``: x [S, B, I], w [G*H, I], r [G*H, H],
    b [2*G*H] (W's biases then R's), h0 [B, H] or None, c0 [B, H] or None; ``y``
    [S, B, H]: each step's h (``emit`` "c": each step's cell state; "hc": [S + 1, B, H],
    each step's h then the final cell state; LSTM only).
    ``recur`` (the cpu backend's numba loop, kernels/cpu/kernels.py rnn_recur) makes,
    from the buffers, (a call that runs every step in place of the ufuncs below,
    whether that call makes the input gates too: else the input's GEMM runs first)."""
    x, w, r, b, h0, c0 = (list(ins) + [None] * 6)[:6]
    cell, reverse = attrs["cell"], bool(attrs.get("reverse"))
    lbr = cell == "gru" and bool(attrs.get("linear_before_reset"))
    emit = {"h": 0, "c": 1, "hc": 2}[attrs.get("emit", "h")]
    emit_c = emit == 1
    steps, batch, _ = x.shape
    hid = r.shape[1]
    g = CELLS[cell] * hid
    f32 = scratch.reshape(-1)
    gx = f32[: steps * batch * g].reshape(steps, batch, g)
    rest = f32[steps * batch * g :]
    gh = rest[: batch * g].reshape(batch, g)
    c, t1, t2, zero = (rest[batch * g + k * batch * hid :][: batch * hid].reshape(batch, hid)
                       for k in range(4))  # fmt: skip
    wb, rb = b[:g], b[g:]
    bias = xp.empty(g, np.float32)  # made once, here; filled each run (b may be an input)
    wt, rt = w.T, r.T
    x2, gx2 = x.reshape(steps * batch, -1), gx.reshape(steps * batch, g)
    order = range(steps - 1, -1, -1) if reverse else range(steps)

    def inputs_part() -> None:
        """Every step's input gates, x W^T + biases (those adding outside the reset gate
        of a linear_before_reset GRU), one GEMM; the zero state cleared."""
        xp.add(wb, rb, out=bias)
        if lbr:
            xp.copyto(bias[2 * hid :], wb[2 * hid :])
        xp.matmul(x2, wt, out=gx2)
        xp.add(gx2, bias, out=gx2)
        zero.fill(0.0)

    if recur is not None:
        code = {"lstm": 0, "gru": 1, "rnn": 2}[cell]
        rbh = rb[2 * hid :] if lbr else bias[:hid]  # read only with linear_before_reset
        given = int(h0 is not None) | 2 * int(c0 is not None)
        states = (h0 if h0 is not None else zero, c0 if c0 is not None else zero)
        loop, whole = recur(x2, w, b, gx, r, rbh, *states, y, gh, c, t1, t2, code,
                            int(reverse), int(lbr), emit, given)  # fmt: skip
        if whole:  # the loop makes the input gates too
            return loop

        def run() -> None:
            inputs_part()
            loop()

        return run

    def step() -> None:
        inputs_part()
        h = h0 if h0 is not None else zero
        if cell == "lstm":
            xp.copyto(c, c0 if c0 is not None else zero)
        for t in order:
            a = gx[t]
            xp.matmul(h, rt, out=gh)
            if cell == "rnn":
                xp.add(a, gh, out=y[t])
                xp.tanh(y[t], out=y[t])
                h = y[t]
            elif cell == "lstm":
                xp.add(a, gh, out=gh)
                i, o, f, cc = (gh[:, k * hid : (k + 1) * hid] for k in range(4))
                _sigmoid(xp, gh[:, : 3 * hid])
                xp.tanh(cc, out=cc)
                xp.multiply(f, c, out=c)
                xp.multiply(i, cc, out=t1)
                xp.add(c, t1, out=c)
                out = t2 if emit_c else y[t]  # h: the output, or kept aside
                xp.tanh(c, out=out)
                xp.multiply(o, out, out=out)
                if emit_c:
                    xp.copyto(y[t], c)
                h = out
            else:  # gru
                z_r = gh[:, : 2 * hid]
                xp.add(a[:, : 2 * hid], z_r, out=z_r)
                _sigmoid(xp, z_r)
                z, rg, hh = gh[:, :hid], gh[:, hid : 2 * hid], gh[:, 2 * hid :]
                if lbr:  # r * (h R_h^T + Rb_h)
                    xp.add(hh, rb[2 * hid :], out=hh)
                    xp.multiply(rg, hh, out=hh)
                else:  # (r * h) R_h^T
                    xp.multiply(rg, h, out=t1)
                    xp.matmul(t1, rt[:, 2 * hid :], out=hh)
                xp.add(a[:, 2 * hid :], hh, out=hh)
                xp.tanh(hh, out=hh)
                # h' = h~ + z * (h - h~)
                xp.subtract(h, hh, out=t1)
                xp.multiply(z, t1, out=t1)
                out = y[t]
                xp.add(hh, t1, out=out)
                h = out
        if emit == 2:
            xp.copyto(y[steps], c)

    return step
