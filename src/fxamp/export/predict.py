"""Static FP16/BF16 predictions for machines without a GPU (issue 4, item 5).

Which ONNX ops TensorRT and onnxruntime's CUDA execution provider can run in FP16 (and BF16),
transcribed by hand from their published operator-support matrices, so a precision report can
say "TensorRT will not run this op in FP16" before anyone builds an engine. These are
PREDICTIONS from documentation, not measurements: an op the table lists as FP16-capable can
still fall back (unsupported attributes, restrictions in the source's "Restrictions" column,
layer fusion, tactic choice), and the tables age. Nothing here reads files or the network.

Sources (see :data:`SOURCES`):

* TensorRT: onnx-tensorrt ``docs/operators.md``, the revision whose header reads "TensorRT
  10.15 supports operators in the inclusive range of opset 9 to opset 24" (read through the
  public-code index, stored-file id 4266455660; the index did not return the commit hash).
  Column "Supported Types" per op; ops marked ``N`` are not supported by the parser at all.
  Older revisions differ: the ``onnx/onnx-tensorrt`` commit
  6d0ab7be324d02c7feb3a306b6fdbeae84f71ddc (TensorRT 8.5) lists LayerNormalization as ``N``
  and has no BF16 column; commit 009d6541b4ee1fa3f3150cd7cbabe7e56aa54840 (TensorRT 8.4)
  lists RoiAlign as ``N``.
* onnxruntime CUDA: ``microsoft/onnxruntime`` ``docs/OperatorKernels.md`` at commit
  001d12d2623fd411ce0f83d05abb5e82304a3389, section "Operators implemented by
  CUDAExecutionProvider", domain ``ai.onnx``. Recorded: the floating types of the op's main
  type constraint (``T``/``T1``) in its NEWEST registered opset row (older opsets sometimes
  lack float16/bfloat16, e.g. CumSum [11, 13] has no float16). Ops listed as ``None`` have no
  CUDA kernel in that section (checked by their place in the alphabetical list); onnxruntime
  then runs them on another provider (CPU). When a CUDA kernel lacks float16, the node does
  not run in FP16 on the CUDA provider (onnxruntime inserts Casts to float32 or assigns the
  node to another provider).

Only ``ai.onnx`` ops are covered; contrib ops (``com.microsoft``) and custom ops are unknown
(``supported=None``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

BACKENDS = ("tensorrt", "onnxruntime-cuda")

SOURCES: Dict[str, Dict[str, str]] = {
    "tensorrt": {
        "repo": "onnx/onnx-tensorrt", "path": "docs/operators.md",
        "version": "TensorRT 10.15 (opset 9-24) revision",
        "commit": "not returned by the index (stored-file id 4266455660)",
        "short": "onnx-tensorrt docs/operators.md @ TensorRT 10.15",
    },
    "onnxruntime-cuda": {
        "repo": "microsoft/onnxruntime", "path": "docs/OperatorKernels.md",
        "version": "CUDAExecutionProvider, ai.onnx domain, newest opset row per op",
        "commit": "001d12d2623fd411ce0f83d05abb5e82304a3389",
        "short": "onnxruntime docs/OperatorKernels.md @ 001d12d",
    },
}

# op -> the "Supported Types" column, or None where "Supported" is N.
TENSORRT_TYPES: Dict[str, Optional[str]] = {
    "Abs": 'FP32 FP16 BF16 INT32 INT64',
    "Acos": 'FP32 FP16 BF16',
    "Acosh": 'FP32 FP16 BF16',
    "Add": 'FP32 FP16 BF16 INT32 INT64',
    "AffineGrid": None,
    "And": 'BOOL',
    "ArgMax": 'FP32 FP16 BF16 INT32 INT64',
    "ArgMin": 'FP32 FP16 BF16 INT32 INT64',
    "Asin": 'FP32 FP16 BF16',
    "Asinh": 'FP32 FP16 BF16',
    "Atan": 'FP32 FP16 BF16',
    "Atanh": 'FP32 FP16 BF16',
    "Attention": 'FP32 FP16 BF16 INT8 FP8',
    "AveragePool": 'FP32 FP16 BF16',
    "BatchNormalization": 'FP32 FP16 BF16',
    "Bernoulli": None,
    "BitShift": None,
    "BitwiseAnd": None,
    "BitwiseNot": None,
    "BitwiseOr": None,
    "BitwiseXor": None,
    "BlackmanWindow": 'FP32 FP16',
    "Cast": 'FP32 FP16 BF16 INT32 INT64 UINT8 BOOL',
    "CastLike": 'FP32 FP16 BF16 INT32 INT64 UINT8 BOOL',
    "Ceil": 'FP32 FP16 BF16',
    "Col2Im": None,
    "Celu": 'FP32 FP16 BF16',
    "CenterCropPad": None,
    "Clip": 'FP32 FP16 BF16',
    "Compress": None,
    "Concat": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "ConcatFromSequence": None,
    "Constant": 'FP32 FP16 BF16 FP8 FP4 INT4 INT32 INT64 BOOL',
    "ConstantOfShape": 'FP32 FP16 BF16 FP8 FP4 INT4 INT32 INT64 BOOL',
    "Conv": 'FP32 FP16 BF16',
    "ConvInteger": None,
    "ConvTranspose": 'FP32 FP16 BF16',
    "Cos": 'FP32 FP16 BF16',
    "Cosh": 'FP32 FP16 BF16',
    "CumSum": 'FP32 FP16 BF16',
    "DFT": None,
    "DeformConv": 'FP32 FP16',
    "DepthToSpace": 'FP32 FP16 BF16 INT32 INT64',
    "DequantizeLinear": 'INT8 FP8 FP4 INT4',
    "Det": None,
    "Div": 'FP32 FP16 BF16 INT32 INT64',
    "Dropout": 'FP32 FP16 BF16',
    "DynamicQuantizeLinear": None,
    "Einsum": 'FP32 FP16 BF16',
    "Elu": 'FP32 FP16 BF16',
    "Equal": 'FP32 FP16 BF16 INT32 INT64',
    "Erf": 'FP32 FP16 BF16',
    "Exp": 'FP32 FP16 BF16',
    "Expand": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "EyeLike": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Flatten": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Floor": 'FP32 FP16 BF16',
    "Gather": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "GatherElements": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "GatherND": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Gelu": 'FP32 FP16 BF16 INT8 INT32 INT64',
    "Gemm": 'FP32 FP16 BF16',
    "GlobalAveragePool": 'FP32 FP16 BF16',
    "GlobalLpPool": 'FP32 FP16 BF16',
    "GlobalMaxPool": 'FP32 FP16 BF16',
    "Greater": 'FP32 FP16 BF16 INT32 INT64',
    "GreaterOrEqual": 'FP32 FP16 BF16 INT32 INT64',
    "GridSample": 'FP32 FP16',
    "GroupNormalization": 'FP32 FP16 BF16',
    "GRU": 'FP32 FP16 BF16',
    "HammingWindow": 'FP32 FP16',
    "HannWindow": 'FP32 FP16',
    "HardSigmoid": 'FP32 FP16 BF16',
    "HardSwish": 'FP32 FP16 BF16',
    "Hardmax": 'FP32 FP16 BF16',
    "Identity": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "If": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "ImageScaler": 'FP32 FP16 BF16',
    "ImageDecoder": None,
    "InstanceNormalization": 'FP32 FP16 BF16',
    "IsInf": 'FP32 FP16 BF16',
    "IsNaN": 'FP32 FP16 BF16 INT32 INT64',
    "LayerNormalization": 'FP32 FP16 BF16',
    "LeakyRelu": 'FP32 FP16 BF16',
    "Less": 'FP32 FP16 BF16 INT32 INT64',
    "LessOrEqual": 'FP32 FP16 BF16 INT32 INT64',
    "Log": 'FP32 FP16 BF16',
    "LogSoftmax": 'FP32 FP16 BF16',
    "Loop": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "LRN": 'FP32 FP16 BF16',
    "LSTM": 'FP32 FP16 BF16',
    "LpNormalization": 'FP32 FP16 BF16',
    "LpPool": 'FP32 FP16 BF16',
    "MatMul": 'FP32 FP16 BF16',
    "MatMulInteger": None,
    "Max": 'FP32 FP16 BF16 INT32 INT64',
    "MaxPool": 'FP32 FP16 BF16',
    "MaxRoiPool": None,
    "MaxUnpool": None,
    "Mean": 'FP32 FP16 BF16 FP8 INT32 INT64',
    "MeanVarianceNormalization": 'FP32 FP16 BF16',
    "MelWeightMatrix": None,
    "Min": 'FP32 FP16 BF16 INT32 INT64',
    "Mish": 'FP32 FP16',
    "Mod": 'FP32 FP16 BF16 INT32 INT64',
    "Mul": 'FP32 FP16 BF16 INT32 INT64',
    "Multinomial": None,
    "Neg": 'FP32 FP16 BF16 INT32 INT64',
    "NegativeLogLikelihoodLoss": None,
    "NonMaxSuppression": 'FP32 FP16',
    "NonZero": 'FP32 FP16',
    "Not": 'BOOL',
    "OneHot": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Optional": None,
    "OptionalGetElement": None,
    "OptionalHasElement": None,
    "Or": 'BOOL',
    "Pad": 'FP32 FP16 BF16 INT32 INT64',
    "ParametricSoftplus": 'FP32 FP16 BF16',
    "Pow": 'FP32 FP16 BF16 INT32 INT64',
    "PRelu": 'FP32 FP16 BF16',
    "QLinearConv": None,
    "QLinearMatMul": None,
    "QuantizeLinear": 'FP32 FP16 BF16',
    "RandomNormal": 'FP32 FP16 BF16',
    "RandomNormalLike": 'FP32 FP16 BF16',
    "RandomUniform": 'FP32 FP16 BF16',
    "RandomUniformLike": 'FP32 FP16 BF16',
    "Range": 'FP32 FP16 BF16 INT32 INT64',
    "Reciprocal": 'FP32 FP16 BF16',
    "ReduceL1": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceL2": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceLogSum": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceLogSumExp": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceMax": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceMean": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceMin": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceProd": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceSum": 'FP32 FP16 BF16 INT32 INT64',
    "ReduceSumSquare": 'FP32 FP16 BF16 INT32 INT64',
    "RegexFullMatch": None,
    "Relu": 'FP32 FP16 BF16 INT32 INT64',
    "Reshape": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Resize": 'FP32 FP16 BF16',
    "ReverseSequence": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "RMSNormalization": 'FP32 FP16 BF16',
    "RNN": 'FP32 FP16 BF16',
    "RoiAlign": 'FP32 FP16',
    "RotaryEmbedding": 'FP32 FP16 BF16',
    "Round": 'FP32 FP16 BF16',
    "STFT": 'FP32',
    "ScaledTanh": 'FP32 FP16 BF16',
    "Scan": 'FP32 FP16 BF16',
    "Scatter": 'FP32 FP16 BF16 INT32 INT64',
    "ScatterElements": 'FP32 FP16 BF16 INT32 INT64',
    "ScatterND": 'FP32 FP16 BF16 INT32 INT64',
    "Selu": 'FP32 FP16 BF16',
    "SequenceAt": None,
    "SequenceConstruct": None,
    "SequenceEmpty": None,
    "SequenceErase": None,
    "SequenceInsert": None,
    "SequenceLength": None,
    "SequenceMap": None,
    "Shape": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Shrink": 'FP32 FP16 BF16 INT32 INT64',
    "Sigmoid": 'FP32 FP16 BF16',
    "Sign": 'FP32 FP16 BF16 INT32 INT64',
    "Sin": 'FP32 FP16 BF16',
    "Sinh": 'FP32 FP16 BF16',
    "Size": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Slice": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Softmax": 'FP32 FP16 BF16',
    "SoftmaxCrossEntropyLoss": None,
    "Softplus": 'FP32 FP16 BF16',
    "Softsign": 'FP32 FP16 BF16',
    "SpaceToDepth": 'FP32 FP16 BF16 INT32 INT64',
    "Split": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "SplitToSequence": None,
    "Sqrt": 'FP32 FP16 BF16',
    "Squeeze": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "StringConcat": None,
    "StringNormalizer": None,
    "StringSplit": None,
    "Sub": 'FP32 FP16 BF16 INT32 INT64',
    "Sum": 'FP32 FP16 BF16 INT32 INT64',
    "Tan": 'FP32 FP16 BF16',
    "Tanh": 'FP32 FP16 BF16',
    "TensorScatter": 'FP32 FP16 BF16 INT32',
    "TfIdfVectorizer": None,
    "ThresholdedRelu": 'FP32 FP16 BF16',
    "Tile": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "TopK": 'FP32 FP16 BF16 INT32 INT64',
    "Transpose": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Trilu": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Unique": None,
    "Unsqueeze": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Upsample": 'FP32 FP16 BF16',
    "Where": 'FP32 FP16 BF16 INT32 INT64 BOOL',
    "Xor": 'BOOL',
}

# op -> (newest registered opset, floating types of its main type constraint there), or None
# where the CUDA provider registers no kernel for the op.
ORT_CUDA_TYPES: Dict[str, Optional[Tuple[str, str]]] = {
    "Abs": ('13+', 'bf16 fp64 fp32 fp16'),
    "Acos": None,
    "Acosh": None,
    "Add": ('14+', 'bf16 fp64 fp32 fp16'),
    "Affine": ('1+', 'fp64 fp32 fp16'),
    "AffineGrid": None,
    "ArgMax": ('13+', 'fp64 fp32 fp16'),
    "ArgMin": ('13+', 'fp64 fp32 fp16'),
    "Asin": None,
    "Asinh": None,
    "Atan": None,
    "Atanh": None,
    "Attention": ('24+', 'bf16 fp32 fp16'),
    "AveragePool": ('22+', 'bf16 fp64 fp32 fp16'),
    "BatchNormalization": ('15+', 'fp64 fp32 fp16'),
    "BitShift": None,
    "Cast": ('23+', 'bf16 fp64 fp32 fp16'),
    "Ceil": ('13+', 'fp64 fp32 fp16'),
    "Celu": None,
    "Clip": ('13+', 'fp64 fp32 fp16'),
    "Col2Im": None,
    "Compress": ('11+', 'bf16 fp64 fp32 fp16'),
    "Concat": ('13+', 'bf16 fp64 fp32 fp16'),
    "ConstantOfShape": ('9+', 'bf16 fp64 fp32 fp16'),
    "Conv": ('22+', 'bf16 fp64 fp32 fp16'),
    "ConvTranspose": ('11+', 'fp64 fp32 fp16'),
    "Cos": ('7+', 'fp64 fp32 fp16'),
    "Cosh": None,
    "Crop": ('1+', 'fp64 fp32 fp16'),
    "CumSum": ('14+', 'fp64 fp32 fp16'),
    "DepthToSpace": ('13+', 'fp64 fp32 fp16'),
    "DequantizeLinear": ('21+', 'fp32 fp16'),
    "Det": None,
    "DFT": None,
    "Div": ('14+', 'bf16 fp64 fp32 fp16'),
    "Dropout": ('13+', 'bf16 fp64 fp32 fp16'),
    "Einsum": ('12+', 'fp64 fp32 fp16'),
    "Elu": ('6+', 'fp64 fp32 fp16'),
    "Equal": ('13+', 'fp64 fp32 fp16'),
    "Erf": ('13+', 'bf16 fp64 fp32 fp16'),
    "Exp": ('13+', 'bf16 fp64 fp32 fp16'),
    "Expand": ('13+', 'bf16 fp64 fp32 fp16'),
    "EyeLike": ('9+', 'fp64 fp32'),
    "Flatten": ('13+', 'bf16 fp64 fp32 fp16'),
    "Floor": ('13+', 'fp64 fp32 fp16'),
    "Gather": ('13+', 'bf16 fp64 fp32 fp16'),
    "GatherElements": ('13+', 'bf16 fp64 fp32 fp16'),
    "GatherND": ('13+', 'bf16 fp64 fp32 fp16'),
    "Gelu": ('20+', 'bf16 fp64 fp32 fp16'),
    "Gemm": ('13+', 'bf16 fp64 fp32 fp16'),
    "GlobalAveragePool": ('1+', 'fp64 fp32 fp16'),
    "GlobalLpPool": None,
    "GlobalMaxPool": ('1+', 'fp64 fp32 fp16'),
    "Greater": ('13+', 'fp64 fp32 fp16'),
    "GreaterOrEqual": ('16+', 'fp64 fp32 fp16'),
    "GridSample": ('22+', 'fp32'),
    "GroupNormalization": None,
    "GRU": ('14+', 'fp64 fp32 fp16'),
    "Hardmax": None,
    "HardSigmoid": ('22+', 'bf16 fp64 fp32 fp16'),
    "HardSwish": ('22+', 'bf16 fp64 fp32 fp16'),
    "Identity": ('19+', 'bf16 fp64 fp32 fp16'),
    "ImageScaler": ('1+', 'fp64 fp32 fp16'),
    "InstanceNormalization": ('6+', 'fp64 fp32 fp16'),
    "IsInf": ('20+', 'bf16 fp64 fp32 fp16'),
    "IsNaN": ('20+', 'bf16 fp64 fp32 fp16'),
    "LayerNormalization": ('17+', 'bf16 fp64 fp32 fp16'),
    "LeakyRelu": ('16+', 'fp64 fp32 fp16'),
    "Less": ('13+', 'fp64 fp32 fp16'),
    "LessOrEqual": ('16+', 'fp64 fp32 fp16'),
    "Log": ('13+', 'fp64 fp32 fp16'),
    "LogSoftmax": ('13+', 'fp64 fp32 fp16'),
    "LpNormalization": None,
    "LpPool": None,
    "LRN": ('13+', 'fp64 fp32 fp16'),
    "LSTM": ('14+', 'fp64 fp32 fp16'),
    "MatMul": ('13+', 'bf16 fp64 fp32 fp16'),
    "Max": ('13+', 'bf16 fp64 fp32 fp16'),
    "MaxPool": ('12+', 'fp64 fp32 fp16'),
    "MaxRoiPool": None,
    "MaxUnpool": None,
    "Mean": None,
    "MeanVarianceNormalization": None,
    "Min": ('13+', 'bf16 fp64 fp32 fp16'),
    "Mish": None,
    "Mod": ('13+', 'bf16 fp64 fp32 fp16'),
    "Mul": ('14+', 'bf16 fp64 fp32 fp16'),
    "Neg": ('13+', 'bf16 fp64 fp32 fp16'),
    "NonMaxSuppression": None,
    "NonZero": ('13+', 'fp32 fp16'),
    "OneHot": ('11+', 'fp32 fp16'),
    "Pad": ('18+', 'fp64 fp32 fp16'),
    "ParametricSoftplus": ('1+', 'fp64 fp32 fp16'),
    "Pow": ('15+', 'bf16 fp64 fp32 fp16'),
    "PRelu": ('16+', 'fp64 fp32 fp16'),
    "QuantizeLinear": ('21+', 'fp32 fp16'),
    "RandomNormal": ('1+', 'fp64 fp32 fp16'),
    "RandomNormalLike": ('1+', 'fp64 fp32 fp16'),
    "RandomUniform": ('1+', 'fp64 fp32 fp16'),
    "RandomUniformLike": ('1+', 'fp64 fp32 fp16'),
    "Range": ('11+', 'fp64 fp32'),
    "Reciprocal": ('13+', 'fp64 fp32 fp16'),
    "ReduceL1": ('18+', 'fp64 fp32 fp16'),
    "ReduceL2": ('18+', 'fp64 fp32 fp16'),
    "ReduceLogSum": ('18+', 'fp64 fp32 fp16'),
    "ReduceLogSumExp": ('18+', 'fp64 fp32 fp16'),
    "ReduceMax": ('18+', 'fp64 fp32 fp16'),
    "ReduceMean": ('18+', 'fp64 fp32 fp16'),
    "ReduceMin": ('18+', 'fp64 fp32 fp16'),
    "ReduceProd": ('18+', 'fp64 fp32 fp16'),
    "ReduceSum": ('13+', 'bf16 fp64 fp32 fp16'),
    "ReduceSumSquare": ('18+', 'fp64 fp32 fp16'),
    "Relu": ('14+', 'bf16 fp64 fp32 fp16'),
    "Reshape": ('23+', 'bf16 fp64 fp32 fp16'),
    "Resize": ('19+', 'fp64 fp32 fp16'),
    "ReverseSequence": ('10+', 'bf16 fp64 fp32 fp16'),
    "RMSNormalization": ('23+', 'bf16 fp64 fp32 fp16'),
    "RNN": ('14+', 'fp64 fp32 fp16'),
    "RoiAlign": ('10+', 'fp64 fp32'),
    "RotaryEmbedding": ('23+', 'bf16 fp32 fp16'),
    "Round": ('11+', 'fp64 fp32 fp16'),
    "ScaledTanh": ('1+', 'fp64 fp32 fp16'),
    "Scan": ('19+', 'bf16 fp64 fp32 fp16'),
    "ScatterElements": ('18+', 'bf16 fp64 fp32 fp16'),
    "ScatterND": ('18+', 'bf16 fp64 fp32 fp16'),
    "Selu": ('6+', 'fp64 fp32 fp16'),
    "Shape": ('23+', 'bf16 fp64 fp32 fp16'),
    "Shrink": ('9+', 'fp64 fp32 fp16'),
    "Sigmoid": ('13+', 'bf16 fp64 fp32 fp16'),
    "Sign": ('13+', 'bf16 fp64 fp32 fp16'),
    "SimplifiedLayerNormalization": ('1+', 'bf16 fp64 fp32 fp16'),
    "Sin": ('7+', 'fp64 fp32 fp16'),
    "Sinh": None,
    "Size": ('13+', 'bf16 fp64 fp32 fp16'),
    "Slice": ('13+', 'bf16 fp64 fp32 fp16'),
    "Softmax": ('13+', 'bf16 fp64 fp32 fp16'),
    "Softplus": ('1+', 'fp64 fp32 fp16'),
    "Softsign": ('1+', 'fp64 fp32 fp16'),
    "SpaceToDepth": ('13+', 'fp64 fp32 fp16'),
    "Split": ('18+', 'bf16 fp64 fp32 fp16'),
    "Sqrt": ('13+', 'bf16 fp64 fp32 fp16'),
    "Squeeze": ('23+', 'bf16 fp64 fp32 fp16'),
    "STFT": None,
    "Sub": ('14+', 'bf16 fp64 fp32 fp16'),
    "Sum": ('13+', 'bf16 fp64 fp32 fp16'),
    "Tan": None,
    "Tanh": ('13+', 'bf16 fp64 fp32 fp16'),
    "TensorScatter": ('24+', 'bf16 fp64 fp32 fp16'),
    "ThresholdedRelu": ('10+', 'fp64 fp32 fp16'),
    "Tile": ('13+', 'bf16 fp64 fp32 fp16'),
    "TopK": ('11+', 'fp64 fp32 fp16'),
    "Transpose": ('23+', 'bf16 fp64 fp32 fp16'),
    "Trilu": ('14+', 'bf16 fp64 fp32 fp16'),
    "Unique": None,
    "Unsqueeze": ('23+', 'bf16 fp64 fp32 fp16'),
    "Upsample": ('9', 'fp64 fp32 fp16'),
    "Where": ('16+', 'bf16 fp64 fp32 fp16'),
}

_NAMES = {"fp16": ("FP16", "fp16", "float16", "FP16"), "bf16": ("BF16", "bf16", "bfloat16",
                                                                 "BF16")}
_LABEL = {"tensorrt": "TensorRT", "onnxruntime-cuda": "onnxruntime's CUDA provider"}


@dataclass(frozen=True)
class Prediction:
    """A documented (not measured) answer: can ``backend`` run ``op_type`` in the dtype?

    supported: True / False, or None when the op is not in the table. note: one sentence,
    starting with "prediction (<source>)". source: the document it comes from.
    """

    op_type: str
    backend: str
    dtype: str
    supported: Optional[bool]
    note: str
    source: str


def _check(backend: str, dtype: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype not in _NAMES:
        raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")


def predict(op_type: str, backend: str, dtype: str = "fp16") -> Prediction:
    """The documented support of ``op_type`` (an ai.onnx op name) in ``dtype`` on
    ``backend`` ("tensorrt" or "onnxruntime-cuda")."""
    _check(backend, dtype)
    source = SOURCES[backend]["short"]
    head = f"prediction ({source}): "
    trt_name, ort_name, _, upper = _NAMES[dtype]
    label = _LABEL[backend]
    if backend == "tensorrt":
        if op_type not in TENSORRT_TYPES:
            return Prediction(op_type, backend, dtype, None, head + f"{op_type} is not in the "
                              "TensorRT operator table; no prediction", source)
        types = TENSORRT_TYPES[op_type]
        if types is None:
            return Prediction(op_type, backend, dtype, False, head + f"TensorRT does not "
                              f"support {op_type} at all; the ONNX parser will reject it",
                              source)
        if trt_name in types.split():
            return Prediction(op_type, backend, dtype, True, head + f"TensorRT lists {upper} "
                              f"for {op_type}", source)
        return Prediction(op_type, backend, dtype, False, head + f"TensorRT has no {upper} "
                          f"{op_type} (types: {types.replace(' ', ', ')}); it will run in "
                          "FP32", source)
    if op_type not in ORT_CUDA_TYPES:
        return Prediction(op_type, backend, dtype, None, head + f"{op_type} is not in the "
                          "onnxruntime CUDA table here; no prediction", source)
    entry = ORT_CUDA_TYPES[op_type]
    if entry is None:
        return Prediction(op_type, backend, dtype, False, head + f"{label} has no {op_type} "
                          "kernel; it will run on another provider (CPU), not in "
                          f"{upper} on the GPU", source)
    opset, types = entry
    if ort_name in types.split():
        return Prediction(op_type, backend, dtype, True, head + f"{label} registers {upper} "
                          f"{op_type} (opset {opset})", source)
    return Prediction(op_type, backend, dtype, False, head + f"{label} has no {upper} "
                      f"{op_type} kernel (opset {opset}: {types.replace(' ', ', ')}); it will "
                      f"not run in {upper} there (onnxruntime casts it to FP32 or places it on "
                      "another provider)", source)


def predict_fp16(op_type: str, backend: str) -> Prediction:
    """:func:`predict` for FP16."""
    return predict(op_type, backend, "fp16")


def predicted_fallbacks(op_type: str, planned: Optional[str],
                        backends: Tuple[str, ...] = BACKENDS) -> Dict[str, str]:
    """backend -> note, for each backend the tables say will not run ``op_type`` in the
    ``planned`` dtype ("fp16"/"bf16"; anything else: empty)."""
    if planned not in _NAMES:
        return {}
    out = {}
    for backend in backends:
        p = predict(op_type, backend, planned)
        if p.supported is False:
            out[backend] = p.note
    return out
