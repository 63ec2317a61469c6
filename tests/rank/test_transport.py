"""A rank's record crosses the pipe whole: ``unpack(pickle(pack(obj)))`` rebuilds every tensor
with its dtype, shape and bits, inside the structure it came in."""

from __future__ import annotations

import pickle

import pytest
import torch

from ddpcheck._language.records import StepRecord
from ddpcheck._oracle.compare import bitwise_equal
from ddpcheck._rank.transport import pack, unpack


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    ],
)
def test_every_dtype_round_trips_bitwise(dtype):
    values = torch.tensor([[0.0, -0.0, 1.5], [float("nan"), float("inf"), -2.25]])
    if dtype.is_floating_point:
        tensor = values.to(dtype)
    elif dtype.is_complex:
        tensor = torch.complex(values, values.flip(0)).to(dtype)
    else:
        tensor = torch.arange(6).reshape(2, 3).to(dtype)
    record = {
        "a": tensor,
        "b": [tensor.t(), (tensor[:1], None)],
        "n": 3,
        "empty": torch.empty(0, 4, dtype=dtype),
    }
    back = unpack(pickle.loads(pickle.dumps(pack(record))))
    assert back["n"] == 3 and back["b"][1][1] is None
    for got, want in (
        (back["a"], tensor),
        (back["b"][0], tensor.t()),
        (back["b"][1][0], tensor[:1]),
        (back["empty"], record["empty"]),
    ):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bitwise_equal(got.contiguous(), want.contiguous())


def test_records_keep_their_types_and_a_rebuilt_buffer_is_writable():
    step = StepRecord(
        grads={"w": torch.ones(2)},
        params={"w": torch.zeros(2)},
        buffers={},
        state={"w": {"step": torch.tensor(1.0)}},
    )
    back = unpack(pickle.loads(pickle.dumps(pack([step]))))[0]
    assert isinstance(back, StepRecord) and back.state["w"]["step"].item() == 1.0
    back.params["w"] += 1  # the oracle and the replay may compute on what came back
    assert back.params["w"].tolist() == [1.0, 1.0]
