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


# -- GatherElements: a plain gather, where onnx.reference's fails -----------------------------

_GATHER_TYPES = {np.dtype(np.float16): TensorProto.FLOAT16,
                 np.dtype(np.float32): TensorProto.FLOAT,
                 np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
                 np.dtype(np.bool_): TensorProto.BOOL}


def _gather_model(data, indices, axis):
    """One GatherElements node over graph inputs ``data`` and ``indices``."""
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["data", "indices"], ["y"], axis=axis)], "g",
        [helper.make_tensor_value_info("data", _GATHER_TYPES[data.dtype], data.shape),
         helper.make_tensor_value_info("indices", _GATHER_TYPES[indices.dtype],
                                       indices.shape)],
        [helper.make_tensor_value_info("y", _GATHER_TYPES[data.dtype], indices.shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=9)


def _onnxruntime(model, feed):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def _berts_gather():
    """BERT's ``token_type_ids`` buffer (1, 512) gathered at its position ids (1, 128),
    axis 1 (transformers' BertEmbeddings: ``torch.gather(buffered, 1, position_ids)``);
    the buffer holds distinct values here, so that a wrong gather shows."""
    data = (np.arange(512, dtype=np.int64) * 3)[None]
    return data, np.arange(128, dtype=np.int64)[None], 1


def test_onnx_reference_own_gather_elements_fails_on_berts_shapes_or_is_right():
    """The repro: onnx.reference (1.23) gathers with ``np.choose``, which takes at most 64
    choices; past that its 2-D fallback reads one index per row and cannot reshape the
    result. An onnx with the fix (merged upstream) gives the spec's answer: the override
    may then go, once the oldest onnx fxamp supports has it."""
    data, indices, axis = _berts_gather()
    model = _gather_model(data, indices, axis)
    feed = {"data": data, "indices": indices}
    want = data[:, :128]  # (the spec's answer)
    assert np.array_equal(_onnxruntime(model, feed), want)
    try:
        (got,) = ReferenceEvaluator(model).run(None, feed)
    except ValueError as err:  # (onnx 1.23)
        assert "cannot reshape array of size 1 into shape (1,128)" in str(err)
    else:  # (a later onnx, with the fix: the CI installs the newest)
        assert np.array_equal(got, want)


def test_gather_elements_matches_onnxruntime_on_berts_shapes():
    data, indices, axis = _berts_gather()
    model = _gather_model(data, indices, axis)
    feed = {"data": data, "indices": indices}
    got = evaluator(model).run(None, feed)[0]
    want = _onnxruntime(model, feed)
    assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)


def test_gather_elements_where_onnx_reference_is_silently_wrong():
    """(N, 1) data gathered along axis 0, N > 64: onnx.reference's 2-D fallback returns
    ``data[i][0]`` for row i whatever the index says."""
    data = np.arange(100, dtype=np.float32)[:, None]
    indices = np.zeros((100, 1), dtype=np.int64)
    model = _gather_model(data, indices, 0)
    feed = {"data": data, "indices": indices}
    want = _onnxruntime(model, feed)
    assert np.array_equal(want, np.zeros((100, 1), np.float32))
    assert not np.array_equal(ReferenceEvaluator(model).run(None, feed)[0], want)
    assert np.array_equal(evaluator(model).run(None, feed)[0], want)


def _gather_case(rng, rank, axis, data_dtype, index_dtype):
    """Random data of ``rank`` dims (the gathered one up to 80 long: past np.choose's 64
    choices), indices of the same rank, shorter on some other axes, about a third of
    them negative."""
    shape = [int(rng.integers(1, 5)) for _ in range(rank)]
    shape[axis] = int(rng.choice([1, 3, 17, 64, 65, 80]))
    index_shape = [int(rng.integers(1, s + 1)) for s in shape]
    index_shape[axis] = int(rng.integers(1, 9))
    if np.dtype(data_dtype).kind == "b":
        data = rng.random(shape) < 0.5
    elif np.dtype(data_dtype).kind == "f":
        data = (rng.standard_normal(shape) * 100).astype(data_dtype)
    else:
        data = rng.integers(-1000, 1000, shape).astype(data_dtype)
    n = shape[axis]
    indices = rng.integers(0, n, index_shape)
    negative = rng.random(index_shape) < 0.35
    indices = np.where(negative, indices - n, indices).astype(index_dtype)
    return data, indices


GATHER_CASES = [(rank, axis) for rank in (1, 2, 3, 4) for axis in range(-rank, rank)]


@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("data_dtype", [np.float16, np.float32, np.int64, np.bool_])
@pytest.mark.parametrize("rank, axis", GATHER_CASES)
def test_gather_elements_matches_onnxruntime_on_random_cases(rank, axis, data_dtype,
                                                              index_dtype):
    rng = np.random.default_rng([rank, axis + 4, np.dtype(data_dtype).num,
                                 np.dtype(index_dtype).num])
    for _ in range(3):
        data, indices = _gather_case(rng, rank, axis, data_dtype, index_dtype)
        model = _gather_model(data, indices, axis)
        feed = {"data": data, "indices": indices}
        got = evaluator(model).run(None, feed)[0]
        want = _onnxruntime(model, feed)
        assert got.dtype == want.dtype and got.shape == want.shape == indices.shape
        assert np.array_equal(got, want), (data.shape, indices.shape, axis)


def test_gather_elements_is_take_along_axis_with_negative_indices_wrapped():
    """Independent of onnxruntime: the spec's formula, element by element (axis 1)."""
    rng = np.random.default_rng(7)
    data = rng.standard_normal((3, 70, 2)).astype(np.float16)
    indices = rng.integers(-70, 70, (2, 5, 2))
    got = evaluator(_gather_model(data, indices, 1)).run(
        None, {"data": data, "indices": indices})[0]
    want = np.empty(indices.shape, np.float16)
    for i, j, k in np.ndindex(*indices.shape):
        want[i, j, k] = data[i, indices[i, j, k] % 70, k]
    assert np.array_equal(got, want)


def test_gather_elements_refuses_an_index_out_of_range_as_onnxruntime_does():
    """onnx.reference's own wraps it around (mode='wrap'); the spec makes it an error."""
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    indices = np.array([[4, 0], [2, 1], [0, -5]], dtype=np.int64)
    model = _gather_model(data, indices, 1)
    feed = {"data": data, "indices": indices}
    with pytest.raises(Exception, match="ut of range"):  # (onnxruntime's own words)
        _onnxruntime(model, feed)
    with pytest.raises(IndexError, match="index -5 is out of range for an axis of length 4"):
        evaluator(model).run(None, feed)


def test_gather_elements_of_empty_indices():
    data = np.ones((2, 80), np.float16)
    indices = np.zeros((2, 0), np.int64)
    got = evaluator(_gather_model(data, indices, 1)).run(
        None, {"data": data, "indices": indices})[0]
    assert got.shape == (2, 0) and got.dtype == np.float16
