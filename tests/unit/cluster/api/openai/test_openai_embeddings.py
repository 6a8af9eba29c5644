"""`/v1/embeddings`' body and encoding, and the deployment's pooling setting (the route end to
end, against HF's vectors: the integration module `test_api_http_surface`)."""

from __future__ import annotations

import base64
import struct

import pytest

from pagedserve.cluster.api.config import split_app_args
from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.embeddings import MAX_INPUTS, EmbeddingBody, encode
from pagedserve.cluster.api.openai.models import parse_body
from pagedserve.workers.protocol.sampling import Pooling


def inputs(value) -> list:
    return parse_body(EmbeddingBody, {"model": "m", "input": value}).inputs()


def test_every_input_shape_is_a_batch():
    assert inputs("a b") == ["a b"]
    assert inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2]) == [[1, 2]]
    assert inputs([[1], [2, 3]]) == [[1], [2, 3]]


@pytest.mark.parametrize(
    "value, param",
    [("", "input"), ([], "input"), (["a", ""], "input[1]"), ([[1], []], "input[1]")],
)
def test_empty_input_is_named(value, param):
    with pytest.raises(ApiError, match="is empty") as caught:
        inputs(value)
    assert caught.value.param == param and caught.value.http_status == 400


def test_too_many_inputs_and_dimensions_are_refused():
    with pytest.raises(ApiError, match="at most 2,048") as caught:
        inputs(["a"] * (MAX_INPUTS + 1))
    assert caught.value.param == "input"
    body = parse_body(EmbeddingBody, {"model": "m", "input": "a", "dimensions": 8})
    with pytest.raises(ApiError, match="dimensions is not supported") as caught:
        body.inputs()
    assert caught.value.param == "dimensions"


def test_base64_is_little_endian_float32():
    vector = [0.5, -1.25, 3.0e-8]
    packed = base64.b64decode(encode(vector, "base64"))
    assert packed == struct.pack("<3f", *vector)
    assert list(struct.unpack("<3f", packed))[:2] == [0.5, -1.25]
    assert encode(vector, "float") is vector


def test_pooling_is_a_deployment_setting():
    assert split_app_args({})[1].embedding_pooling is Pooling.LAST
    _, api = split_app_args({"num_workers": 1, "embedding_pooling": "mean"})
    assert api.embedding_pooling is Pooling.MEAN
    with pytest.raises(ValueError, match="embedding_pooling must be one of last, mean, got 'max'"):
        split_app_args({"embedding_pooling": "max"})
