"""The true-FP16 run's PyTorch Conv, MaxPool and MatMul compute what onnx.reference's own
do: the same roundings (FP16 inputs, FP32 sums, FP16 result, FP16 bias add), the sums in
another order; a max exactly. Each case is one ONNX node run by both evaluators."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from fxamp.export.reference_ops import evaluator  # noqa: E402

_TYPES = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT}


def _model(op, inputs, attrs, outputs=("y",)):
    """One ``op`` node over ``inputs`` (name -> array), with ``attrs``."""
    nodes = [helper.make_node(op, list(inputs), list(outputs), **attrs)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype.type], a.shape)
         for n, a in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


CONVS = [  # (x shape, w shape, attributes, bias)
    ((1, 8, 16, 16), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    ((2, 8, 15, 15), (16, 8, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, False),
    ((1, 8, 12, 12), (8, 2, 3, 3), {"group": 4, "dilations": [2, 2]}, True),
    ((1, 4, 10, 10), (6, 4, 3, 2), {"pads": [0, 1, 2, 0]}, True),  # asymmetric pads
    ((1, 4, 10, 10), (6, 4, 3, 3), {"auto_pad": "VALID"}, True),
    ((1, 4, 10, 10), (6, 4, 3, 3), {"auto_pad": "SAME_UPPER"}, True),  # (onnx.reference's)
    ((1, 4, 20), (6, 4, 5), {"pads": [2, 2], "strides": [3]}, True),
    ((1, 2, 6, 6, 6), (4, 2, 3, 3, 3), {"pads": [1] * 6}, False),
    ((1, 64, 8, 8), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, True),  # 576 terms a sum
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("x_shape, w_shape, attrs, bias", CONVS)
def test_conv_matches_onnx_reference(dtype, x_shape, w_shape, attrs, bias):
    rng = np.random.default_rng(0)
    inputs = {"x": (rng.standard_normal(x_shape) * 3).astype(dtype),
              "w": rng.standard_normal(w_shape).astype(dtype)}
    if bias:
        inputs["b"] = rng.standard_normal(w_shape[0]).astype(dtype)
    model = _model("Conv", inputs, attrs)
    want = ReferenceEvaluator(model).run(None, inputs)[0]
    got = evaluator(model).run(None, inputs)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = float(np.abs(want.astype(np.float64)).max())
    # one FP16 rounding of a sum taken in another order: within an ulp or two
    tol = (2e-3 if dtype is np.float16 else 1e-5) * scale
    assert float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) <= tol


POOLS = [
    ((1, 8, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 8, 15, 15), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 8, 16, 16), {"kernel_shape": [3, 3], "dilations": [2, 2]}),
    ((1, 8, 16, 16), {"kernel_shape": [3, 3], "pads": [0, 0, 1, 1]}),  # (onnx.reference's)
    ((1, 4, 20), {"kernel_shape": [4], "strides": [2]}),
    ((1, 2, 8, 8, 8), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("x_shape, attrs", POOLS)
def test_max_pool_matches_onnx_reference_exactly(dtype, x_shape, attrs):
    x = np.random.default_rng(1).standard_normal(x_shape).astype(dtype)
    model = _model("MaxPool", {"x": x}, attrs)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = evaluator(model).run(None, {"x": x})[0]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_max_pool_with_indices_runs_onnx_reference_own():
    x = np.random.default_rng(2).standard_normal((1, 2, 8, 8)).astype(np.float16)
    model = _model("MaxPool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2]},
                   outputs=("y", "i"))
    want = ReferenceEvaluator(model).run(None, {"x": x})
    got = evaluator(model).run(None, {"x": x})
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


MATMULS = [((2, 3, 17, 64), (2, 3, 64, 17)), ((40, 192), (192, 96)), ((64,), (64, 8)),
           ((5, 64), (64,)), ((3, 1, 4, 32), (2, 32, 6))]  # (broadcast batch dims)


@pytest.mark.parametrize("a_shape, b_shape", MATMULS)
def test_fp16_matmul_matches_onnx_reference(a_shape, b_shape):
    """Both sum the FP16 products in FP32 and round once: equal bits here (the order of the
    sum could make a last-bit difference, so the bound is one FP16 step of the scale)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(a_shape).astype(np.float16)
    b = rng.standard_normal(b_shape).astype(np.float16)
    model = _model("MatMul", {"a": a, "b": b}, {})
    want = ReferenceEvaluator(model).run(None, {"a": a, "b": b})[0]
    got = evaluator(model).run(None, {"a": a, "b": b})[0]
    assert got.dtype == want.dtype == np.float16 and got.shape == want.shape
    scale = float(np.abs(want.astype(np.float32)).max())
    assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= scale * 2 ** -10


def test_fp32_matmul_runs_onnx_reference_own():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(
        np.float32)
    model = _model("MatMul", {"a": a, "b": b}, {})
    want = ReferenceEvaluator(model).run(None, {"a": a, "b": b})[0]
    assert np.array_equal(evaluator(model).run(None, {"a": a, "b": b})[0], want)


CONV_TRANSPOSES = [  # (x shape, w shape, attributes, bias, exact: no overlapping positions)
    ((1, 8, 6, 6), (8, 4, 2, 2), {"strides": [2, 2]}, True, True),
    ((2, 8, 5, 5), (8, 4, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1],
                                  "output_padding": [1, 1]}, False, False),
    ((1, 8, 5, 5), (8, 2, 3, 3), {"dilations": [2, 2]}, True, False),
    ((1, 4, 7), (4, 4, 4), {"strides": [4]}, True, True),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("x_shape, w_shape, attrs, bias, exact", CONV_TRANSPOSES)
def test_conv_transpose_matches_onnx_reference(dtype, x_shape, w_shape, attrs, bias, exact):
    """Bit for bit where kernel positions do not overlap; otherwise within 2e-3 of the
    output's scale (onnx.reference rounds each overlap's sum to FP16 once more)."""
    rng = np.random.default_rng(5)
    inputs = {"x": rng.standard_normal(x_shape).astype(dtype),
              "w": (rng.standard_normal(w_shape) * 0.2).astype(dtype)}
    if bias:
        inputs["b"] = rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(dtype)
    model = _model("ConvTranspose", inputs, attrs)
    want = ReferenceEvaluator(model).run(None, inputs)[0]
    got = evaluator(model).run(None, inputs)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact and dtype == np.float16:
        assert np.array_equal(got, want)
    scale = float(np.abs(want.astype(np.float32)).max())
    assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= 2e-3 * scale


def test_conv_transpose_with_an_output_shape_runs_onnx_reference_own():
    rng = np.random.default_rng(6)
    inputs = {"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float16),
              "w": rng.standard_normal((2, 2, 3, 3)).astype(np.float16)}
    model = _model("ConvTranspose", inputs, {"strides": [2, 2], "output_shape": [9, 9]})
    want = ReferenceEvaluator(model).run(None, inputs)[0]
    assert np.array_equal(evaluator(model).run(None, inputs)[0], want)
