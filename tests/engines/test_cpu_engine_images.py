"""The reference engine bounds the memory of concurrent requests with images (engines/model_runner.py
:class:`PixelBudget`): each request reserves its images' pixels, read from their headers, before any is decoded; one
that does not fit waits for room, then is answered 503 with ``Retry-After``; the engine's own accounting never
exceeds the budget. A real engine (in this process) behind its real HTTP server."""

from __future__ import annotations

import io
import queue
import threading

import httpx
import pytest

from relax_hpc.engines.cpu_engine import serve
from relax_hpc.engines.model_runner import RETRY_AFTER_S, CPUEngine
from tests.engines.test_engine_vision import prompt_ids

SIDE = 1000  # a 1-megapixel image (1 bit a pixel: ~1 kB to send), 80 × the tiny processor's max_pixels
PIXELS = SIDE * SIDE
BUDGET = 2 * PIXELS + PIXELS // 2  # room for two such requests at once, not three


def big_png_b64() -> str:
    import base64

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (SIDE, SIDE), 1).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def engine(tiny_vlm):
    eng = CPUEngine(str(tiny_vlm), seed=0, image_pixel_budget=BUDGET, image_wait_s=0)
    server = serve(eng)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield eng
    server.shutdown()
    server.server_close()


def wait_budget(eng, cond) -> None:
    with eng.pixels.cv:
        assert eng.pixels.cv.wait_for(lambda: cond(eng.pixels), timeout=120), eng.pixels.state()


def send_all(eng, body: dict, n: int) -> tuple[list[threading.Thread], queue.Queue]:
    """``n`` requests at once, each in its thread; their answers arrive in the queue as they come."""
    answers: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=lambda: answers.put(httpx.post(eng.url + "/generate", json=body,
                                                                      timeout=300))) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, answers


def test_four_concurrent_big_image_requests_stay_within_the_budget(engine, tiny_vlm):
    body = {"input_ids": prompt_ids(tiny_vlm), "image_data": [big_png_b64()],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert httpx.post(engine.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        threads, answers = send_all(engine, body, 4)
        # two hold their pixels (held after their first token by the pause), two found no room: answered at once
        refused = [answers.get(timeout=120), answers.get(timeout=120)]
        assert [r.status_code for r in refused] == [503, 503]
        assert engine.pixels.in_use == 2 * PIXELS and engine.pixels.refused == 2
        assert all(r.headers["Retry-After"] == str(RETRY_AFTER_S) for r in refused)
        assert "image budget has 500000 of 2500000 free (--image-pixel-budget)" in refused[0].text, refused[0].text
        info = httpx.get(engine.url + "/server_info").json()
        assert (info["image_pixels_in_use"], info["image_pixels_peak"]) == (2 * PIXELS, 2 * PIXELS)
    finally:
        assert httpx.post(engine.url + "/continue_generation", json={}).status_code == 200
    for t in threads:
        t.join(300)
    assert [answers.get_nowait().status_code for _ in range(2)] == [200, 200]
    # the stated bound: never more than the budget's pixels held at once; all of it returned once answered
    assert engine.pixels.peak == 2 * PIXELS <= BUDGET and engine.pixels.in_use == 0


def test_a_request_waits_for_room_and_one_that_can_never_fit_is_refused(engine, tiny_vlm):
    body = {"input_ids": prompt_ids(tiny_vlm), "image_data": [big_png_b64()],
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    engine.image_wait_s = 300  # the queue: a request waits for room instead of a 503
    try:
        assert httpx.post(engine.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        threads, answers = send_all(engine, body, 3)
        wait_budget(engine, lambda b: b.in_use == 2 * PIXELS and b.waiting == 1)
        assert httpx.post(engine.url + "/continue_generation", json={}).status_code == 200
        for t in threads:
            t.join(300)
        assert [answers.get_nowait().status_code for _ in range(3)] == [200, 200, 200]
        assert engine.pixels.peak <= BUDGET and engine.pixels.in_use == 0
        # three images in one request: more than the whole budget, so no wait would ever admit it
        r = httpx.post(engine.url + "/generate", json={**body, "input_ids": prompt_ids(tiny_vlm, 3),
                                                       "image_data": [big_png_b64()] * 3}, timeout=60)
        assert r.status_code == 400 and "3000000 pixels, more than this engine serves at once" in r.text, r.text
    finally:
        engine.image_wait_s = 0
        httpx.post(engine.url + "/continue_generation", json={})


def test_refusals_never_quote_more_than_a_little_of_the_request(engine, tiny_vlm):
    r = httpx.post(engine.url + "/generate", json={"input_ids": prompt_ids(tiny_vlm, 0),
                                                   "sampling_params": {"regex": "CANARY" * 1000}}, timeout=60)
    assert r.status_code == 400 and "sampling param regex=a str of 6000 is not supported" in r.text, r.text
    assert "CANARY" not in r.text
    r = httpx.post(engine.url + "/generate", json={"input_ids": prompt_ids(tiny_vlm),
                                                   "image_data": ["CANARY" * 20]}, timeout=60)
    assert r.status_code == 400 and "image_data[0] (str of 120) is not a usable image" in r.text, r.text
    assert "CANARY" not in r.text
