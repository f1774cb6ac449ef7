"""A request with a video, as the rollout driver sends it (relax_hpc/rollout/driver.py: ``video_data`` beside the
prompt ids, one video a list of base64 PNG frames), sent by :class:`relax_hpc.engines.client.EngineClient` over a real
socket to SGLang's own HTTP application: parsed into SGLang's ``GenerateReqInput`` (its ``video_data`` field, the
``MultimodalDataInputFormat`` union taking a list of videos, each a list of frames), nothing dropped."""

from __future__ import annotations

import base64

import pytest

from relax_hpc.engines.client import EngineClient, SamplingParams
from tests.sglang_contract.test_requests import parsed


@pytest.fixture
def client(recorder):
    recorder.take()
    c = EngineClient(recorder.url, api_key=recorder.api_key, retries=0)
    yield c
    c.close()


def test_a_video_request_is_sglangs_generate_req_input(client, recorder):
    frames = [base64.b64encode(b"\x89PNG frame %d, not decoded by the recorder" % i).decode() for i in range(4)]
    g = client.generate([1, 2, 3], SamplingParams(max_new_tokens=2), extra={"video_data": [frames]})
    body = parsed(recorder.take(), "/generate", "GenerateReqInput", recorder.api_key)
    assert body["video_data"] == [frames] and "image_data" not in body
    assert len(g.output_ids) == 2
