"""`melix-fsm serve --vision` on the tiny Qwen3.5 VL checkpoint, through the official openai client.

- A chat request with an image (a data: URI) answers mlx-vlm's own greedy output for the
  same prompt and image, token for token (decoded), with MTP drafts accepted; the receipt
  notes the vision tower.
- An image request and a text request in flight together (one batch: the peak rows
  metric says 2) each answer what they answer alone.
- Refusals, typed: bad base64, bytes that are no image, too many images, too large an
  image, a remote url without the operator's allow flag (400 / 413); an image sent to a
  text-only server is a 400.
Skipped when mlx-vlm or openai is not installed.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from melix_mlx.serve.images import VisionOptions  # noqa: E402
from melix_mlx.serve.provider import load_served_model  # noqa: E402
from melix_mlx.vlm import prepare, reference  # noqa: E402

from serve_helpers import assert_error_shape, client, metric, post_json, raw, serving  # noqa: E402
from vlm_helpers import TEXT_PROMPT, image, loaded_vl, png_bytes, tiny_vl  # noqa: E402

N = 12
LONG = 40  # the text request that stays in flight while the image request joins
# the server's prompt text: the tiny tokenizer has no chat template, so mlx-lm's plain chat
# form, with the image part as the checkpoint's vision placeholder
SERVED_IMAGE = "USER: <|vision_start|><|image_pad|><|vision_end|>" + TEXT_PROMPT + "\nASSISTANT:"
SERVED_TEXT = "USER: " + TEXT_PROMPT + "\nASSISTANT:"


def data_uri(payload: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(payload).decode()


def image_message(*uris: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT_PROMPT}]}]


def mlx_vlm_text(prompt: str, images: list, n: int) -> str:
    model, processor, _, _ = loaded_vl()
    tokens = reference(model, prepare(model, processor, prompt, images), n)
    return processor.tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def server():
    served = load_served_model(
        str(tiny_vl()), 2, "force_on", vision=VisionOptions(max_images=2, max_image_bytes=60_000)
    )
    with serving(served, max_batch_size=4) as running:
        yield running


def test_an_image_request_is_mlx_vlms_greedy(server):
    reply = client(server.url).chat.completions.create(
        model="default_model", messages=image_message(data_uri(png_bytes(0))), max_tokens=N, temperature=0
    )
    assert reply.choices[0].message.content == mlx_vlm_text(SERVED_IMAGE, [image(0)], N)
    speculative = reply.usage.model_extra["speculative"]
    assert speculative["method"] == "mtp" and speculative["accepted"] > 0, speculative
    status, _, body = raw(server.url, "GET", "/v1/melix/receipt")
    receipt = json.loads(body)
    assert status == 200 and receipt["receipt"]["vision_tower"].startswith("qwen3_5: depth 1"), receipt
    assert receipt["settings"]["vision"] and receipt["settings"]["max_images"] == 2


def test_image_and_text_requests_batch_together(server):
    openai = client(server.url)
    text_stream = openai.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": TEXT_PROMPT}], max_tokens=LONG,
        temperature=0, stream=True,
    )  # fmt: skip
    chunks = iter(text_stream)
    text = next(chunks).choices[0].delta.content or ""  # the text row decodes: now the image joins
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            openai.chat.completions.create, model="default_model", messages=image_message(data_uri(png_bytes(1))),
            max_tokens=N, temperature=0,
        )  # fmt: skip
        text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with_image = joined.result().choices[0].message.content
    assert with_image == mlx_vlm_text(SERVED_IMAGE, [image(1)], N)
    assert text == mlx_vlm_text(SERVED_TEXT, [], LONG)
    assert metric(server.url, "melix_batch_rows_peak") >= 2


def _noise_png(side: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((np.random.default_rng(7).random((side, side, 3)) * 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "uris, status, code",
    [
        (["data:image/png;base64,@@not base64@@"], 400, "invalid_image"),
        ([data_uri(b"these bytes are not an image")], 400, "invalid_image"),
        ([data_uri(png_bytes(0))] * 3, 400, "too_many_images"),
        (["https://example.com/cat.png"], 400, "remote_image_refused"),
        ([None], 413, "image_too_large"),  # a 256 x 256 noise PNG: over the 60 kB bound
    ],
)
def test_bad_images_are_refused_typed(server, uris, status, code):
    uris = [u if u is not None else data_uri(_noise_png(256)) for u in uris]
    got, _, payload = post_json(server.url, "/v1/chat/completions", {"messages": image_message(*uris)})
    assert got == status, payload
    assert_error_shape(payload)
    assert payload["error"]["code"] == code


def test_an_image_to_a_text_only_server_is_a_400():
    served = load_served_model(str(tiny_vl()), 2, "force_on")  # the same checkpoint, without --vision
    with serving(served) as running:
        status, _, payload = post_json(
            running.url, "/v1/chat/completions", {"messages": image_message(data_uri(png_bytes(0)))}
        )
    assert status == 400 and payload["error"]["code"] == "images_unsupported", payload
